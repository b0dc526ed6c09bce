// Controller: the metadata plane of one stage. No tensor bytes, only bits per row.
//
// Per input column a readiness bit per row; per row the number of ready input columns; per group
// the number of fully ready rows. When a group's last row becomes ready it joins a FIFO queue, so a
// claim pops whole groups in O(groups claimed) and never rescans the rows. A consumed bit per row
// makes every row go to the stage exactly once per iteration. Blocking claims wait on a condition
// variable with a deadline; mark_ready() notifies. No polling.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace msrl::dock {

struct StageProgress {
  int64_t ready_rows = 0;      // ready and not yet claimed
  int64_t consumed_rows = 0;   // claimed since the last reset
  int64_t waiting_claims = 0;  // claims blocked right now
};

class Controller {
 public:
  // input_columns: dock column ids this stage reads; a row is ready when all of them are written.
  // length_column: a dock column (usually ragged) whose per-row lengths the controller records from
  // mark_ready() for length-balanced claims; -1 for none.
  Controller(std::string stage, int64_t capacity, int64_t group_size, std::vector<int> input_columns,
             int length_column = -1);
  Controller(const Controller&) = delete;
  Controller& operator=(const Controller&) = delete;

  const std::string& stage() const { return stage_; }
  const std::vector<int>& input_columns() const { return inputs_; }
  bool reads(int column) const;

  // Marks the rows' column written (a no-op for columns this stage does not read) and wakes waiters.
  // lengths (optional): items per row, recorded when column is the length column.
  void mark_ready(int column, const int64_t* rows, size_t n, const int64_t* lengths = nullptr);

  // Claims up to max_rows rows as whole groups, FIFO by readiness. Waits until at least min_rows
  // (rounded up to whole groups) are ready or timeout_s passes (Timeout; nothing claimed). With
  // timeout_s == 0 it never waits and returns what is ready (maybe nothing, when min_rows == 0).
  // `epoch`, when given, receives the iteration the rows belong to (the number of resets so far).
  // max_items > 0 balances claims by length: whole groups are taken FIFO while their summed lengths in
  // the length column stay within max_items (always at least one group), so concurrent workers of a
  // stage get about the same number of tokens rather than the same number of rows.
  // `claim_id`, when given, receives the claim's identity (unique per controller, never 0): release and
  // complete with it check that the claim still holds its rows. timeout_s is clamped to kMaxWaitS.
  // min_version (max_staleness): only groups whose every row has a policy version >= min_version are
  // claimed (FIFO among them); older groups are skipped and stay queued. kAnyVersion: no filter.
  std::vector<int64_t> claim(int64_t max_rows, int64_t min_rows, double timeout_s, uint64_t* epoch = nullptr,
                             int64_t max_items = 0, uint64_t* claim_id = nullptr, int64_t min_version = kAnyVersion);
  static constexpr int64_t kAnyVersion = INT64_MIN;
  // The policy version of rows (for min_version claims); 0 until set.
  void set_versions(const int64_t* rows, size_t n, const int64_t* versions);
  // Items per row of the length column (1 per row without one), for DP shares.
  std::vector<int64_t> items_of(const int64_t* rows, size_t n) const;
  // Forgets rows (erase / drop): readiness, lengths, version, consumption and any claim on them (a later
  // release/complete/put with that claim on these rows is refused). Their groups leave the queue.
  void erase(const int64_t* rows, size_t n);
  static constexpr double kMaxWaitS = 365.0 * 86400.0;
  int length_column() const { return length_column_; }

  // Puts claimed rows back (a worker failed): they become claimable again. Rows must be claimed and not
  // completed; with claim_id != 0 they must still be held by that claim (a claim released before, or
  // whose rows were claimed again by another worker, is refused: rows never go out twice).
  void release(const int64_t* rows, size_t n, uint64_t claim_id = 0);
  // Throws InvalidArgument unless claim `claim_id` (!= 0) holds every row (completed or not).
  void check_held(const int64_t* rows, size_t n, uint64_t claim_id) const;
  // Marks claimed rows as completed by this stage (its worker put its outputs). Only completed claims
  // survive reset(keep_groups): a kept group claimed but not completed becomes claimable again.
  // With claim_id != 0 the claim must hold every row (check_held); with 0, rows not claimed are ignored.
  void complete(const int64_t* rows, size_t n, uint64_t claim_id = 0);
  // A put of `columns` into plain row ids (no claim): completes this stage's claim on the rows when the
  // stage reads none of the columns (it wrote them: they are its outputs) and holds every row. Returns
  // whether it completed them.
  bool complete_by_put(const std::vector<int>& columns, const int64_t* rows, size_t n);
  // True when group g has been claimed by this stage in the current iteration.
  bool group_consumed(int64_t g) const;
  // True when group g has been claimed and completed by this stage (a finished group, for this stage).
  bool group_completed(int64_t g) const;

  StageProgress progress() const;
  bool consumed(int64_t row) const;
  // Clears every bit and starts the next iteration (epoch + 1). Blocked claims keep waiting and are
  // served by the next iteration's rows.
  void reset();
  // Partial reset (epoch + 1): groups with keep_groups[g] != 0 keep their readiness, lengths and the
  // claims this stage completed on every row of the group; a group claimed but not completed
  // becomes claimable again (ahead of the others, like a release). Every other group is cleared.
  // keep_groups has one entry per group.
  void reset(const std::vector<uint8_t>& keep_groups);
  uint64_t epoch() const;
  // Wakes every waiter with Closed; later claims raise Closed.
  void close();

 private:
  int slot_of(int column) const;
  void check_held_locked(const int64_t* rows, size_t n, uint64_t claim_id) const;
  void check_row(int64_t row) const;

  const std::string stage_;
  const int64_t capacity_;
  const int64_t group_size_;
  const std::vector<int> inputs_;
  const int length_column_;
  int max_column_ = -1;
  std::vector<int> slot_;  // dock column id -> input slot, -1 if not read

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> ready_bits_;                                // [slot * capacity + row]
  std::vector<uint16_t> ready_count_;                              // per row: input columns written
  std::vector<int64_t> group_ready_;                               // per group: fully ready rows
  std::vector<uint8_t> consumed_;                                  // per row
  std::vector<uint8_t> done_;                                      // per row: claimed and completed (complete())
  std::vector<int64_t> row_len_;                                   // per row, from the length column
  std::vector<uint64_t> claim_of_;                                 // per row: the claim holding it (0: none)
  std::vector<int64_t> version_;                                   // per row: policy version (set_versions)
  size_t eligible_locked(int64_t min_version, size_t want) const;  // queued groups passing the filter, up to want
  uint64_t next_claim_ = 1;
  std::deque<int64_t> queue_;  // groups fully ready and not consumed, FIFO
  int64_t consumed_rows_ = 0;
  int64_t waiting_ = 0;
  uint64_t epoch_ = 0;
  bool closed_ = false;
};

}  // namespace msrl::dock
