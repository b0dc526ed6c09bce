// DockCore: the embedded ("local") transfer dock — S warehouses, one controller per stage, and the
// row allocator, all in one process. The Ray backend uses Warehouse and Controller directly.
//
// Rows are grouped: group g holds rows [g*G, (g+1)*G) and lives in exactly one warehouse (warehouse w
// owns a contiguous range of groups). New rows are allocated as whole groups, interleaved across
// warehouses so consecutive groups spread the load.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "dock/controller.h"
#include "dock/warehouse.h"

namespace msrl::dock {

struct StageSpec {
  std::string name;
  std::vector<std::string> inputs;
  std::string length_column;  // optional: balance claims by this column's row lengths
};

struct DockConfig {
  std::vector<ColumnSpec> columns;  // ragged columns: arena_bytes is per warehouse
  std::vector<StageSpec> stages;
  int64_t capacity = 0;  // rows
  int64_t group_size = 1;
  int warehouses = 1;
};

// One column of a put: values packed in row order; lengths (items per row) for ragged columns.
struct ColumnInput {
  int column = -1;
  const void* data = nullptr;
  size_t nbytes = 0;
  const int64_t* lengths = nullptr;
};

struct OpStats {
  std::atomic<int64_t> count{0};
  std::atomic<int64_t> total_ns{0};
  std::atomic<int64_t> max_ns{0};
  std::atomic<int64_t> rows{0};
  std::atomic<int64_t> bytes{0};
  void record(int64_t ns, int64_t nrows, int64_t nbytes);
};

class DockCore {
 public:
  explicit DockCore(DockConfig config);
  DockCore(const DockCore&) = delete;
  DockCore& operator=(const DockCore&) = delete;

  const DockConfig& config() const { return config_; }
  int column_index(const std::string& name) const;  // NotFound
  int stage_index(const std::string& name) const;   // NotFound
  int num_warehouses() const { return static_cast<int>(warehouses_.size()); }
  int warehouse_of(int64_t row) const;
  const Warehouse& warehouse(int w) const { return *warehouses_.at(w); }
  const Controller& controller(int s) const { return *controllers_.at(s); }

  // Allocates n rows (whole groups) and writes the columns into them; on any error nothing changes.
  std::vector<int64_t> put_new(const std::vector<ColumnInput>& inputs, int64_t n);
  // Writes columns into allocated rows; all-or-nothing over columns and warehouses. With epoch >= 0
  // (from a claim) the rows must belong to the current iteration: a claim from before a reset is stale.
  // With stage >= 0 and claim_id != 0 (a Claim's) the claim must still hold the rows (checked before
  // anything is written) and a successful put completes it (Controller::complete), so a partial reset
  // keeps the stage's work on them. With plain row ids (stage -1) the put completes the claim of every
  // stage that holds the rows and reads none of the columns written (Controller::complete_by_put).
  void put(const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n, int64_t epoch = -1, int stage = -1,
           uint64_t claim_id = 0);
  // Completes a claim without putting (a stage that writes no columns); see reset(true).
  void complete(int stage, const int64_t* rows, size_t n, int64_t epoch = -1, uint64_t claim_id = 0);

  // Claims never block reset(): a blocked claim is served by the next iteration. `epoch` receives the
  // iteration of the rows.
  std::vector<int64_t> claim(int stage, int64_t max_rows, int64_t min_rows, double timeout_s, uint64_t* epoch = nullptr,
                             int64_t max_items = 0, uint64_t* claim_id = nullptr);
  uint64_t epoch() const { return epoch_.load(); }
  void release(int stage, const int64_t* rows, size_t n, int64_t epoch = -1, uint64_t claim_id = 0);

  // Items per row (1 for fixed columns).
  void lengths(int column, const int64_t* rows, size_t n, int64_t* out) const;
  // Packed copy of the rows in order: dst_bytes must equal the sum of their sizes.
  void gather(int column, const int64_t* rows, size_t n, void* dst, size_t dst_bytes, int64_t epoch = -1);
  // Padded copy [n, max_items, inner...], tails zero-filled.
  void gather_padded(int column, const int64_t* rows, size_t n, int64_t max_items, void* dst, int64_t epoch = -1);

  // Zero-copy read: when the rows' bytes of the column lie back to back in one warehouse arena (in the
  // given order), returns true, sets *data / *nbytes to that span and *pins* the iteration: reset()
  // refuses until unpin() is called once for it. Otherwise returns false and pins nothing (the caller
  // falls back to gather). `lengths` (n) receives items per row either way. Readiness and epoch are
  // checked as for gather; errors change nothing.
  bool view(int column, const int64_t* rows, size_t n, const uint8_t** data, size_t* nbytes, int64_t* lengths,
            int64_t epoch = -1);
  void unpin();                                              // one call per successful view()
  int64_t live_views() const { return live_views_.load(); }  // views not yet unpinned

  bool allocated(int64_t row) const;
  int64_t allocated_rows() const;
  // Clears rows, readiness and claims and starts the next iteration. Throws InvalidArgument (nothing
  // changed) while a put or fetch runs, another reset runs or views are alive (live_views() > 0).
  // Claims from before the reset are stale.
  // keep_unfinished (partial rollout): only *finished* groups — completed by every stage — are freed.
  // Unfinished groups keep their rows, written columns, readiness and each stage's completed claims
  // (ragged arenas are compacted); a claim not completed (no put with it, no complete()) is dropped and
  // its group is claimable again by that stage. New puts allocate around the kept groups. Returns the
  // kept rows (empty without keep_unfinished). Same errors as reset(), nothing changed on error.
  void reset();
  std::vector<int64_t> reset(bool keep_unfinished);
  void close();  // wakes blocked claims with Closed

  OpStats put_stats, claim_stats, fetch_stats;

 private:
  std::vector<int64_t> allocate(int64_t n);
  void put_locked(const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n);
  void free_rows(const std::vector<int64_t>& rows);
  void check_allocated(const int64_t* rows, size_t n) const;
  void check_epoch(int64_t epoch) const;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> live_views_{0};  // changed under ops_mu_ (shared to pin, exclusive in reset)

  DockConfig config_;
  std::vector<std::unique_ptr<Warehouse>> warehouses_;
  std::vector<std::unique_ptr<Controller>> controllers_;
  std::vector<int> group_warehouse_;  // group -> warehouse

  mutable std::mutex alloc_mu_;
  std::vector<uint8_t> group_allocated_;
  std::vector<int64_t> order_;       // all groups, interleaved over warehouses
  std::vector<int64_t> free_order_;  // order_ less the groups kept by a partial reset
  size_t next_free_ = 0;             // groups are handed out in free_order_ until reset
  int64_t allocated_groups_ = 0;
  std::vector<int64_t> returned_;  // groups given back by a failed put_new, reused first

  std::shared_mutex ops_mu_;  // shared by puts and fetches, exclusive for reset
};

}  // namespace msrl::dock
