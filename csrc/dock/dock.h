// DockCore: the transfer dock's one control plane — the row allocator, one controller per stage,
// epochs, claim completion, the ledger of puts in flight and (partial) reset — plus, for the embedded
// ("local") backend, S warehouses in the same process. The Ray backend hosts a metadata-only DockCore
// (store_bytes = false) in its controller actor: its warehouses are byte stores in other processes, and
// its client drives the put protocol below (begin -> store the bytes -> publish) and reset in steps.
//
// Rows are grouped: group g holds rows [g*G, (g+1)*G) and lives in exactly one warehouse (warehouse w
// owns a contiguous range of groups). New rows are allocated as whole groups, interleaved across
// warehouses so consecutive groups spread the load.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
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
  std::vector<StageSpec> stages;    // may be empty (a keyed store read with get(), no stages)
  int64_t capacity = 0;             // rows
  int64_t group_size = 1;
  int warehouses = 1;
  // false: metadata only (the Ray controller): rows, readiness, claims, puts in flight and reset, but no
  // warehouse in this process (put, put_new, gather and view throw; begin_put*/publish carry puts).
  bool store_bytes = true;
};

// A column a put wrote, for publish(): readiness for the stages reading it; `lengths` (items per row, or
// null) are recorded by a stage that balances its claims by this column.
struct ColumnMark {
  int column = -1;
  const int64_t* lengths = nullptr;
};

// One column of a put: values packed in row order; lengths (items per row) for ragged columns.
struct ColumnInput {
  int column = -1;
  const void* data = nullptr;
  size_t nbytes = 0;
  const int64_t* lengths = nullptr;
};

// The one all-or-nothing store of a put's columns (ColumnInput: values packed in row order) into rows of
// some warehouses: validates every column, routes each row to warehouses[route(row)], reserves
// everywhere, copies without locks, commits; on error nothing changed. Returns the bytes stored.
// DockCore's puts use it over its warehouses, a Ray warehouse actor over its one.
int64_t store_columns(const std::vector<Warehouse*>& warehouses, const std::function<int(int64_t)>& route,
                      const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n, bool overwrite = false);

struct OpStats {
  std::atomic<int64_t> count{0};
  std::atomic<int64_t> total_ns{0};
  std::atomic<int64_t> max_ns{0};
  std::atomic<int64_t> rows{0};
  std::atomic<int64_t> bytes{0};
  void record(int64_t ns, int64_t nrows, int64_t nbytes);
};

// A tag entry: (name, value as JSON text). Tags are never interpreted natively, only stored and merged.
using TagItem = std::pair<std::string, std::string>;
using Tags = std::vector<TagItem>;

// A put by keys, begun (begin_put_keys): its rows in key order and which of them are new.
struct KeyedPut {
  uint64_t put = 0;
  std::vector<int64_t> rows;
  std::vector<uint8_t> fresh;  // 1: the key is new (its row allocated by this put)
  uint64_t put_epoch = 0;
  bool rewrites = false;  // some cell of the put is already written (overwrite=true)
};

// The keys of a partition with their rows and tags (list_keys).
struct KeyListing {
  std::vector<std::string> keys;
  std::vector<int64_t> rows;
  std::vector<Tags> tags;
};

class DockCore {
 public:
  static constexpr int kMaxPartitions = 256;
  explicit DockCore(DockConfig config);
  DockCore(const DockCore&) = delete;
  DockCore& operator=(const DockCore&) = delete;

  const DockConfig& config() const { return config_; }
  int column_index(const std::string& name) const;  // NotFound
  int stage_index(const std::string& name) const;   // NotFound
  int num_warehouses() const { return config_.warehouses; }
  int warehouse_of(int64_t row) const;
  // Rows [first, first + second) of warehouse w (one contiguous range of whole groups).
  std::pair<int64_t, int64_t> warehouse_rows(int w) const;
  bool stores_bytes() const { return config_.store_bytes; }
  const Warehouse& warehouse(int w) const;  // store_bytes only
  const Controller& controller(int s, int partition = 0) const;
  int num_columns() const { return ncols_.load(std::memory_order_acquire); }
  const ColumnSpec& column(int c) const;  // NotFound
  // A column declared at run time, or the id of an existing one with the same type. A column of that
  // name with another dtype, inner shape or raggedness: InvalidArgument naming both, nothing changed.
  // Thread-safe: concurrent first puts of a column agree on one declaration. Stages reading the name
  // (declared in their inputs before the column existed) start counting it.
  int declare_column(const ColumnSpec& spec);

  // ---- Partitions and keys (the keyed store). Partition 0 is the default partition (name ""): the
  // row-id API (put_new, put with rows, claims without a partition) works in it. Every other partition
  // is a name with its own keys, tags, readiness and claims per stage and epoch (clears); all share the
  // row space and the warehouses. Keys are opaque byte strings, unique within their partition. ----
  // The id of a partition (NotFound with create=false, naming the known ones). Ids stay valid until the
  // partition is dropped (then NotFound), so callers may cache them.
  int partition(const std::string& name, bool create);
  std::vector<std::string> partition_names() const;  // live named partitions
  uint64_t partition_epoch(int p) const;
  // A read of a claim's rows is still valid: InvalidArgument ("stale claim", naming the partition) when the
  // partition was cleared or the dock reset since the claim (epoch: the claim's). Checked after the bytes
  // are copied, so a clear that reused the rows meanwhile is caught too.
  void check_claim_epoch(int p, int64_t epoch) const { check_epoch(epoch, p); }
  // Begins a put of `columns` into the rows of `keys` (new keys get rows, as whole groups in key order):
  // validated first (a key twice, an existing key's written cell without overwrite, a key being put or
  // erased by another call, new keys not whole groups, the dock full) with nothing changed on error.
  // New keys are pending (invisible) until publish_keys; abort_put forgets them.
  KeyedPut begin_put_keys(int p, const std::vector<std::string>& keys, const std::vector<int>& columns, bool overwrite);
  // Publishes a begun keyed put: keys visible, written cells, tags merged (tags empty or one per key),
  // versions (empty, or one per key), readiness for the partition's stages. Ends the put.
  void publish_keys(const KeyedPut& kp, int p, const std::vector<ColumnMark>& columns, const std::vector<Tags>& tags,
                    const std::vector<int64_t>& versions);
  // The whole keyed put on a dock holding its bytes; with rewrites, fetches wait (no torn reads) and
  // zero-copy views must not be alive.
  std::vector<int64_t> put_keys(int p, const std::vector<std::string>& keys, const std::vector<ColumnInput>& inputs,
                                bool overwrite, const std::vector<Tags>& tags, const std::vector<int64_t>& versions);
  std::vector<int64_t> rows_of(int p, const std::vector<std::string>& keys) const;  // NotFound
  std::vector<std::string> keys_of(int p, const int64_t* rows, size_t n) const;     // NotFound
  KeyListing list_keys(int p) const;                                                // in row order
  // Written flags [keys x columns] (1 = written).
  std::vector<uint8_t> written(int p, const std::vector<std::string>& keys, const std::vector<int>& columns) const;
  // Upserts tags (one Tags per key, merged by name); unknown keys are created without data.
  void tag(int p, const std::vector<std::string>& keys, const std::vector<Tags>& tags);
  // Erase in steps for a backend whose warehouses are elsewhere: begin_erase forgets the keys (or
  // rows) in the partition's metadata — readiness, claims, tags, versions — and returns their rows,
  // which stay unusable until end_erase (after the caller erased their bytes). Refuses (nothing
  // changed) rows a put in flight writes. Unknown keys: NotFound.
  std::vector<int64_t> begin_erase_keys(int p, const std::vector<std::string>& keys);
  std::vector<int64_t> begin_erase_rows(int p, const int64_t* rows, size_t n);
  std::vector<int64_t> begin_clear(int p);  // every row of the partition; its epoch + 1 (claims stale)
  void end_erase(const std::vector<int64_t>& rows) noexcept;  // the rows' groups become free when empty
  // The whole erase on a dock holding its bytes: waits for fetches in flight (deadline kResetWaitS);
  // refuses while zero-copy views are alive.
  void erase_keys(int p, const std::vector<std::string>& keys);
  void erase_rows(int p, const int64_t* rows, size_t n);
  void clear(int p);
  void drop_partition(int p);  // clear + the name is forgotten (p 0 cannot be dropped)
  // Claims in a partition; min_version filters by policy version (Controller::claim).
  std::vector<int64_t> claim_in(int p, int stage, int64_t max_rows, int64_t min_rows, double timeout_s, uint64_t* epoch,
                                int64_t max_items, uint64_t* claim_id, int64_t min_version);
  // DP-aware claim: round `round` of D = dp_size replicas with R ranks each: the round's first call
  // claims up to D * max_rows rows and splits them into D shares balanced by the stage's length column
  // (else rows); call (round, dp_rank) gets share dp_rank, every rank of a replica the same rows; the
  // round is forgotten after D * R calls. Shares of a round never overlap.
  std::vector<int64_t> claim_dp(int p, int stage, const std::string& round, int dp_rank, int dp_size,
                                int ranks_per_replica, int64_t max_rows, int64_t min_rows, double timeout_s,
                                uint64_t* epoch, uint64_t* claim_id, int64_t min_version);
  void release_in(int p, int stage, const int64_t* rows, size_t n, int64_t epoch, uint64_t claim_id);
  void complete_in(int p, int stage, const int64_t* rows, size_t n, int64_t epoch, uint64_t claim_id);
  // begin_put / publish of a claim's put into existing rows in a partition.
  uint64_t begin_put_in(int p, const int64_t* rows, size_t n, int64_t epoch, int stage, uint64_t claim_id,
                        uint64_t* put_epoch = nullptr);
  void put_in(int p, const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n, int64_t epoch, int stage,
              uint64_t claim_id);
  // True when the column of the row is written (metadata, both backends).
  bool cell_written(int column, int64_t row) const;

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

  // ---- The put protocol in steps; put_new() and put() run it around this process's warehouses, a
  // backend whose warehouses are elsewhere (Ray) runs it around its own copies. ----
  // 1. Begin: registers a put in flight (reset() refuses while one is registered; reset(force) abandons
  //    it). Waits while a reset runs (Timeout after kResetWaitS; nothing changed). begin_put_new
  //    allocates n rows (whole groups) into *rows; begin_put checks a put into existing rows: current
  //    iteration (epoch >= 0, from a claim), allocated, and (stage >= 0, claim_id != 0) still held by the
  //    claim. Errors register nothing. Returns the put's id (never 0); *put_epoch (optional) receives the
  //    iteration the put belongs to (warehouses elsewhere refuse its bytes once they have moved on).
  uint64_t begin_put_new(int64_t n, std::vector<int64_t>* rows, uint64_t* put_epoch = nullptr);
  uint64_t begin_put(const int64_t* rows, size_t n, int64_t epoch = -1, int stage = -1, uint64_t claim_id = 0,
                     uint64_t* put_epoch = nullptr);
  // 2. The caller stores the bytes in every warehouse holding some of the rows (reserve, copy, commit).
  // 3. Publish: readiness of the columns for every stage reading them, then completion — of the putting
  //    claim (stage >= 0), or for plain row ids (stage -1) of every stage that holds the rows and reads
  //    none of the columns (Controller::complete_by_put) — and ends the put. Throws InvalidArgument with
  //    nothing published when reset(force) abandoned the put or the rows are not those it began with. A
  //    reset waits for a publish in progress (a put is wholly before or after it).
  void publish(uint64_t put, const std::vector<ColumnMark>& columns, const int64_t* rows, size_t n, int stage = -1,
               uint64_t claim_id = 0, int p = 0);
  //    Or abort: ends the put and returns true when it was in flight (nothing of it published, and now
  //    nothing will be); false for an unknown id, an ended put or one reset(force) abandoned. With
  //    give_rows_back the rows begin_put_new allocated for it go back to the allocator; without (its bytes
  //    may be stored somewhere: the caller erases them) they stay allocated until the next reset.
  bool abort_put(uint64_t put, bool give_rows_back = true) noexcept;
  int64_t puts_in_flight() const;
  static constexpr double kResetWaitS = 30.0;  // a put that begins during a reset waits this long

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

  // ---- Reset in steps, for a backend whose warehouses are elsewhere (Ray): begin_reset(), then the
  // warehouses prepare (each refuses while its reads or writes are in flight), then reset_metadata() and
  // the warehouses' own reset with the kept rows, then end_reset(); end_reset() also cancels. ----
  // Refuses (InvalidArgument, nothing changed) while another reset runs or puts are in flight; with
  // force, puts in flight are abandoned instead (their publish throws; their abort frees nothing). Holds
  // new puts back (begin_put* wait) until end_reset().
  void begin_reset(bool force = false);
  // Between begin_reset() and end_reset(), on a metadata-only dock: the next iteration of the
  // controllers and the allocator, as reset(keep_unfinished) does it. Returns the kept rows (ascending).
  std::vector<int64_t> reset_metadata(bool keep_unfinished);
  void end_reset() noexcept;
  void close();  // wakes blocked claims with Closed

  OpStats put_stats, claim_stats, fetch_stats;

 private:
  std::vector<int64_t> allocate(int64_t n, uint64_t* alloc_epoch);             // the iteration it allocated in
  std::vector<int64_t> allocate_locked(int64_t n, uint64_t* alloc_epoch);      // alloc_mu_ held
  uint64_t register_put(uint64_t* put_epoch);                                  // waits while a reset runs
  std::vector<int64_t> groups_of(const std::vector<int64_t>& new_rows) const;  // rows of whole groups
  void end_put(uint64_t put) noexcept;                                         // published: the put's rows stay
  void publish_locked(const std::vector<ColumnMark>& columns, const int64_t* rows, size_t n, int stage,
                      uint64_t claim_id, int p = 0);
  void store(const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n, int64_t* nbytes,
             bool overwrite = false);
  std::vector<int64_t> reset_state(bool keep_unfinished);  // ops_mu_ held exclusively, resetting_ set
  void need_bytes(const char* op) const;
  // Gives groups allocated in iteration `epoch` back; nothing once a reset moved on (it freed them).
  void free_groups(const std::vector<int64_t>& groups, uint64_t epoch) noexcept;
  void check_allocated(const int64_t* rows, size_t n, int p = 0) const;
  void check_epoch(int64_t epoch, int p = 0) const;
  void check_stage(int p, int stage) const;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> live_views_{0};  // changed under ops_mu_ (shared to pin, exclusive in reset)

  DockConfig config_;
  std::vector<std::unique_ptr<Warehouse>> warehouses_;
  // Partitions: slot 0 the default; slots are never freed (a dropped one is reused by a new name).
  struct Partition {
    std::string name;
    bool live = false;
    uint32_t gen = 0;  // bumped when the slot is reused by another name: ids carry it
    std::atomic<uint64_t> epoch{0};
    std::vector<std::unique_ptr<Controller>> controllers;
    std::unordered_map<std::string, int64_t> key_row;  // includes pending keys
  };
  std::vector<std::unique_ptr<Controller>>& ctl(int p) const;
  Partition& part(int p) const;  // NotFound for an id of a dropped partition
  // Partition ids are slot + kMaxPartitions * generation: an id outlives no drop of its partition.
  static int slot_of(int p) { return p % kMaxPartitions; }
  static constexpr int kMaxGenerations = (1 << 22);
  void new_controllers(Partition& pt);
  std::vector<std::unique_ptr<Partition>> partitions_;  // kMaxPartitions slots, filled on creation
  std::atomic<int> npartitions_{1};
  mutable std::mutex part_mu_;  // creation / drop of partitions

  // Row metadata of the keyed store (keys_mu_): partition (-1: free), key, pending (a put in flight
  // created the key), erasing, written cells per column, tags.
  mutable std::mutex keys_mu_;
  std::vector<int16_t> row_part_;
  std::vector<std::string> row_key_;
  std::vector<uint8_t> row_pending_;
  std::vector<uint8_t> row_erasing_;
  std::vector<std::vector<uint8_t>> written_;  // [column][row], sized kMaxColumns, rows on first use
  std::vector<Tags> row_tags_;
  std::vector<int64_t> group_live_;  // rows with a key (or pending) per group of keyed partitions
  void mark_written_locked(const std::vector<ColumnMark>& columns, const int64_t* rows, size_t n);
  void forget_rows_locked(const std::vector<int64_t>& rows);
  std::vector<int64_t> begin_erase_locked(int p, std::vector<int64_t> rows);
  void erase_local(int p, const std::vector<int64_t>& rows);  // bytes of this process's warehouses

  // Columns: config_.columns is reserved to Warehouse::kMaxColumns and only appended (cols_mu_).
  std::mutex cols_mu_;
  std::atomic<int> ncols_{0};

  // DP rounds: (partition, stage, round) -> the shares and calls left.
  struct DpRound {
    std::vector<std::vector<int64_t>> shares;
    uint64_t epoch = 0, claim_id = 0;
    int calls_left = 0;
  };
  std::mutex dp_mu_;
  std::unordered_map<std::string, DpRound> dp_rounds_;
  std::vector<int> group_warehouse_;                         // group -> warehouse
  std::vector<std::pair<int64_t, int64_t>> warehouse_rows_;  // warehouse -> (first row, rows)

  mutable std::mutex alloc_mu_;
  std::vector<uint8_t> group_allocated_;
  std::vector<int64_t> order_;       // all groups, interleaved over warehouses
  std::vector<int64_t> free_order_;  // order_ less the groups kept by a partial reset
  size_t next_free_ = 0;             // groups are handed out in free_order_ until reset
  int64_t allocated_groups_ = 0;
  std::vector<int64_t> returned_;  // groups given back by a failed put_new, reused first

  std::shared_mutex ops_mu_;  // shared by fetches, views, complete and release; exclusive for reset

  // The ledger of puts in flight and the reset gate.
  mutable std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  // The puts between begin and publish/abort: their rows (publish must name the same ones) and whether
  // begin_put_new allocated them (abort_put gives those back).
  struct PutEntry {
    std::vector<int64_t> rows;
    bool allocated = false;
    uint64_t alloc_epoch = 0;         // the iteration its groups were allocated in
    int partition = -1;               // a keyed put: its new keys are pending in this partition
    std::vector<int64_t> fresh_rows;  // rows of the new keys
  };
  std::unordered_map<uint64_t, PutEntry> puts_;
  uint64_t next_put_ = 0;
  bool resetting_ = false;
};

}  // namespace msrl::dock
