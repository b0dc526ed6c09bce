#include "dock/controller.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace msrl::dock {

Controller::Controller(std::string stage, int64_t capacity, int64_t group_size, std::vector<int> input_columns,
                       int length_column)
    : stage_(std::move(stage)),
      capacity_(capacity),
      group_size_(group_size),
      inputs_(std::move(input_columns)),
      length_column_(length_column) {
  MSRL_CHECK(group_size_ > 0, kInvalidArgument, "stage '", stage_, "': group_size must be > 0, got ", group_size_);
  MSRL_CHECK(capacity_ > 0 && capacity_ % group_size_ == 0, kInvalidArgument, "stage '", stage_,
             "': capacity must be a positive multiple of group_size ", group_size_, ", got ", capacity_);
  MSRL_CHECK(!inputs_.empty(), kInvalidArgument, "stage '", stage_, "' must read at least one column");
  MSRL_CHECK(inputs_.size() < 65535, kInvalidArgument, "stage '", stage_, "' reads too many columns");
  for (int c : inputs_) {
    MSRL_CHECK(c >= 0, kInvalidArgument, "stage '", stage_, "': column id must be >= 0, got ", c);
    max_column_ = std::max(max_column_, c);
  }
  slot_.assign(max_column_ + 1, -1);
  for (size_t s = 0; s < inputs_.size(); ++s) {
    MSRL_CHECK(slot_[inputs_[s]] == -1, kInvalidArgument, "stage '", stage_, "' lists column ", inputs_[s], " twice");
    slot_[inputs_[s]] = static_cast<int>(s);
  }
  ready_bits_.assign(inputs_.size() * capacity_, 0);
  ready_count_.assign(capacity_, 0);
  group_ready_.assign(capacity_ / group_size_, 0);
  consumed_.assign(capacity_, 0);
  done_.assign(capacity_, 0);
  row_len_.assign(capacity_, 0);
  claim_of_.assign(capacity_, 0);
  version_.assign(capacity_, 0);
}

int Controller::slot_of(int column) const { return (column >= 0 && column <= max_column_) ? slot_[column] : -1; }

bool Controller::reads(int column) const { return slot_of(column) >= 0; }

void Controller::check_row(int64_t row) const {
  MSRL_CHECK(row >= 0 && row < capacity_, kInvalidArgument, "stage '", stage_, "': row ", row, " out of range [0, ",
             capacity_, ")");
}

void Controller::mark_ready(int column, const int64_t* rows, size_t n, const int64_t* lengths) {
  const int slot = slot_of(column);
  const bool record = column == length_column_ && length_column_ >= 0 && lengths != nullptr;
  if (slot < 0 && !record) return;
  for (size_t i = 0; i < n; ++i) check_row(rows[i]);
  if (record) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) row_len_[rows[i]] = lengths[i];
  }
  if (slot < 0) return;
  const uint16_t need = static_cast<uint16_t>(inputs_.size());
  bool woke = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    uint8_t* bits = ready_bits_.data() + static_cast<size_t>(slot) * capacity_;
    for (size_t i = 0; i < n; ++i) {
      const int64_t row = rows[i];
      if (bits[row]) continue;  // idempotent
      bits[row] = 1;
      if (++ready_count_[row] == need) {
        const int64_t g = row / group_size_;
        if (++group_ready_[g] == group_size_ && !consumed_[g * group_size_]) {
          queue_.push_back(g);
          woke = true;
        }
      }
    }
  }
  if (woke) cv_.notify_all();
}

size_t Controller::eligible_locked(int64_t min_version, size_t want) const {
  if (min_version == kAnyVersion) return queue_.size();
  size_t k = 0;
  for (int64_t g : queue_) {
    bool ok = true;
    for (int64_t r = g * group_size_; r < (g + 1) * group_size_ && ok; ++r) ok = version_[r] >= min_version;
    if (ok && ++k >= want) break;
  }
  return k;
}

std::vector<int64_t> Controller::claim(int64_t max_rows, int64_t min_rows, double timeout_s, uint64_t* epoch,
                                       int64_t max_items, uint64_t* claim_id, int64_t min_version) {
  MSRL_CHECK(max_rows >= group_size_, kInvalidArgument, "stage '", stage_, "': max_rows ", max_rows,
             " is smaller than one group (group_size ", group_size_, ")");
  MSRL_CHECK(min_rows >= 0 && min_rows <= max_rows, kInvalidArgument, "stage '", stage_, "': min_rows ", min_rows,
             " must be in [0, max_rows=", max_rows, "]");
  MSRL_CHECK(timeout_s >= 0 && std::isfinite(timeout_s), kInvalidArgument, "stage '", stage_,
             "': timeout must be a finite number of seconds >= 0, got ", timeout_s);
  timeout_s = std::min(timeout_s, kMaxWaitS);  // a deadline in steady_clock nanoseconds must not overflow
  const size_t max_groups = static_cast<size_t>(max_rows / group_size_);
  const size_t min_groups = static_cast<size_t>((min_rows + group_size_ - 1) / group_size_);
  MSRL_CHECK(min_groups <= max_groups, kInvalidArgument, "stage '", stage_, "': min_rows ", min_rows,
             " rounds up to more whole groups than max_rows ", max_rows, " allows");

  std::unique_lock<std::mutex> lock(mu_);
  MSRL_CHECK(!closed_, kClosed, "stage '", stage_, "': the dock is closed");
  const size_t want = std::max<size_t>(min_groups, 1);
  if (eligible_locked(min_version, want) < want && timeout_s > 0) {
    const auto deadline =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
    ++waiting_;
    bool ok = cv_.wait_until(lock, deadline, [&] { return closed_ || eligible_locked(min_version, want) >= want; });
    --waiting_;
    MSRL_CHECK(!closed_, kClosed, "stage '", stage_, "': the dock was closed while a claim waited");
    const size_t have = eligible_locked(min_version, want);
    if (!ok && have < min_groups) {
      MSRL_THROW(kTimeout, "stage '", stage_, "': claim of ", min_rows, "..", max_rows, " rows timed out after ",
                 timeout_s, " s with ", have * group_size_, " rows ready");
    }
  }
  const size_t avail = eligible_locked(min_version, max_groups);
  if (avail < min_groups) {
    MSRL_THROW(kTimeout, "stage '", stage_, "': ", avail * group_size_, " rows ready, fewer than min_rows ", min_rows,
               " (timeout ", timeout_s, " s)");
  }
  // The eligible groups in FIFO order (all of the queue's head without a version filter).
  std::vector<size_t> picks;  // positions in queue_
  for (size_t q = 0; q < queue_.size() && picks.size() < max_groups; ++q) {
    const int64_t g = queue_[q];
    bool ok = true;
    if (min_version != kAnyVersion) {
      for (int64_t r = g * group_size_; r < (g + 1) * group_size_ && ok; ++r) ok = version_[r] >= min_version;
    }
    if (ok) picks.push_back(q);
  }
  size_t take = picks.size();
  if (max_items > 0) {  // length-balanced: FIFO groups while their items fit the budget
    int64_t items = 0;
    size_t k = 0;
    for (; k < take; ++k) {
      const int64_t g = queue_[picks[k]];
      int64_t gi = 0;
      for (int64_t r = g * group_size_; r < (g + 1) * group_size_; ++r) gi += row_len_[r];
      if (k > 0 && items + gi > max_items) break;
      items += gi;
    }
    take = std::max<size_t>(k, std::min<size_t>(min_groups, picks.size()));
  }
  picks.resize(take);
  std::vector<int64_t> rows;
  rows.reserve(take * group_size_);
  const uint64_t id = next_claim_++;
  for (size_t q : picks) {
    const int64_t g = queue_[q];
    for (int64_t r = g * group_size_; r < (g + 1) * group_size_; ++r) {
      consumed_[r] = 1;
      claim_of_[r] = id;
      rows.push_back(r);
    }
  }
  if (take == picks.size() && !picks.empty() && picks.back() + 1 == take) {
    queue_.erase(queue_.begin(), queue_.begin() + static_cast<std::ptrdiff_t>(take));  // the head: the common case
  } else {
    std::deque<int64_t> rest;
    size_t p = 0;
    for (size_t q = 0; q < queue_.size(); ++q) {
      if (p < picks.size() && picks[p] == q) {
        ++p;
        continue;
      }
      rest.push_back(queue_[q]);
    }
    queue_.swap(rest);
  }
  consumed_rows_ += static_cast<int64_t>(rows.size());
  if (epoch != nullptr) *epoch = epoch_;
  if (claim_id != nullptr) *claim_id = id;
  return rows;
}

void Controller::set_versions(const int64_t* rows, size_t n, const int64_t* versions) {
  for (size_t i = 0; i < n; ++i) check_row(rows[i]);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) version_[rows[i]] = versions[i];
  }
  cv_.notify_all();  // a claim waiting for new enough rows re-checks
}

std::vector<int64_t> Controller::items_of(const int64_t* rows, size_t n) const {
  for (size_t i = 0; i < n; ++i) check_row(rows[i]);
  std::vector<int64_t> out(n, 1);
  if (length_column_ < 0) return out;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) out[i] = row_len_[rows[i]];
  return out;
}

void Controller::erase(const int64_t* rows, size_t n) {
  for (size_t i = 0; i < n; ++i) check_row(rows[i]);
  const size_t slots = inputs_.size();
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> groups;
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = rows[i], g = r / group_size_;
    if (ready_count_[r] == slots && slots > 0) --group_ready_[g];
    for (size_t s = 0; s < slots; ++s) ready_bits_[s * capacity_ + r] = 0;
    ready_count_[r] = 0;
    if (consumed_[r]) --consumed_rows_;
    consumed_[r] = done_[r] = 0;
    claim_of_[r] = 0;
    row_len_[r] = 0;
    version_[r] = 0;
    groups.push_back(g);
  }
  std::sort(groups.begin(), groups.end());
  queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                              [&](int64_t g) { return std::binary_search(groups.begin(), groups.end(), g); }),
               queue_.end());
}

void Controller::release(const int64_t* rows, size_t n, uint64_t claim_id) {
  for (size_t i = 0; i < n; ++i) check_row(rows[i]);
  bool woke = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      MSRL_CHECK(consumed_[rows[i]], kInvalidArgument, "stage '", stage_, "': row ", rows[i],
                 " is not claimed, cannot release it");
      MSRL_CHECK(claim_id == 0 || claim_of_[rows[i]] == claim_id, kInvalidArgument, "stage '", stage_,
                 "': this claim no longer holds row ", rows[i],
                 " (it was released, or claimed again by another worker); nothing was released");
      MSRL_CHECK(!done_[rows[i]], kInvalidArgument, "stage '", stage_, "': row ", rows[i],
                 " was completed (a put with its claim, or complete()); a completed claim cannot be released");
    }
    MSRL_CHECK(n % group_size_ == 0, kInvalidArgument, "stage '", stage_, "': release of ", n,
               " rows is not whole groups of ", group_size_);
    for (size_t i = 0; i < n; ++i) {
      const int64_t expect = rows[i - i % group_size_] + static_cast<int64_t>(i % group_size_);
      MSRL_CHECK(rows[i - i % group_size_] % group_size_ == 0 && rows[i] == expect, kInvalidArgument, "stage '", stage_,
                 "': release takes whole groups in row order; row ", rows[i], " breaks a group");
    }
    for (size_t i = 0; i < n; i += group_size_) {
      const int64_t g = rows[i] / group_size_;
      if (!consumed_[g * group_size_]) continue;  // the same group listed twice
      for (int64_t r = g * group_size_; r < (g + 1) * group_size_; ++r) {
        consumed_[r] = done_[r] = 0;
        claim_of_[r] = 0;
      }
      consumed_rows_ -= group_size_;
      queue_.push_front(g);
      woke = true;
    }
  }
  if (woke) cv_.notify_all();
}

void Controller::check_held(const int64_t* rows, size_t n, uint64_t claim_id) const {
  for (size_t i = 0; i < n; ++i) check_row(rows[i]);
  std::lock_guard<std::mutex> lock(mu_);
  check_held_locked(rows, n, claim_id);
}

void Controller::check_held_locked(const int64_t* rows, size_t n, uint64_t claim_id) const {
  for (size_t i = 0; i < n; ++i) {
    MSRL_CHECK(consumed_[rows[i]] && claim_of_[rows[i]] == claim_id, kInvalidArgument, "stage '", stage_,
               "': this claim no longer holds row ", rows[i],
               " (it was released, or claimed again by another worker); nothing was changed");
  }
}

void Controller::complete(const int64_t* rows, size_t n, uint64_t claim_id) {
  for (size_t i = 0; i < n; ++i) check_row(rows[i]);
  std::lock_guard<std::mutex> lock(mu_);
  if (claim_id != 0) check_held_locked(rows, n, claim_id);
  for (size_t i = 0; i < n; ++i) {
    if (consumed_[rows[i]]) done_[rows[i]] = 1;
  }
}

bool Controller::complete_by_put(const std::vector<int>& columns, const int64_t* rows, size_t n) {
  for (int c : columns)
    if (reads(c)) return false;
  for (size_t i = 0; i < n; ++i) check_row(rows[i]);
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i)
    if (!consumed_[rows[i]]) return false;
  for (size_t i = 0; i < n; ++i) done_[rows[i]] = 1;
  return n > 0;
}

bool Controller::group_completed(int64_t g) const {
  MSRL_CHECK(g >= 0 && g < capacity_ / group_size_, kInvalidArgument, "stage '", stage_, "': group ", g,
             " out of range [0, ", capacity_ / group_size_, ")");
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t r = g * group_size_; r < (g + 1) * group_size_; ++r)
    if (!consumed_[r] || !done_[r]) return false;
  return true;
}

bool Controller::group_consumed(int64_t g) const {
  MSRL_CHECK(g >= 0 && g < capacity_ / group_size_, kInvalidArgument, "stage '", stage_, "': group ", g,
             " out of range [0, ", capacity_ / group_size_, ")");
  std::lock_guard<std::mutex> lock(mu_);
  return consumed_[g * group_size_] != 0;
}

StageProgress Controller::progress() const {
  std::lock_guard<std::mutex> lock(mu_);
  return StageProgress{static_cast<int64_t>(queue_.size()) * group_size_, consumed_rows_, waiting_};
}

bool Controller::consumed(int64_t row) const {
  check_row(row);
  std::lock_guard<std::mutex> lock(mu_);
  return consumed_[row] != 0;
}

void Controller::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(ready_bits_.begin(), ready_bits_.end(), 0);
  std::fill(ready_count_.begin(), ready_count_.end(), 0);
  std::fill(group_ready_.begin(), group_ready_.end(), 0);
  std::fill(consumed_.begin(), consumed_.end(), 0);
  std::fill(done_.begin(), done_.end(), 0);
  std::fill(row_len_.begin(), row_len_.end(), 0);
  std::fill(claim_of_.begin(), claim_of_.end(), 0);
  std::fill(version_.begin(), version_.end(), 0);
  queue_.clear();
  consumed_rows_ = 0;
  ++epoch_;
}

void Controller::reset(const std::vector<uint8_t>& keep_groups) {
  const int64_t groups = capacity_ / group_size_;
  MSRL_CHECK(static_cast<int64_t>(keep_groups.size()) == groups, kInvalidArgument, "stage '", stage_, "': reset with ",
             keep_groups.size(), " keep flags for ", groups, " groups");
  const size_t slots = inputs_.size();
  bool woke = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::deque<int64_t> queue;
    std::vector<int64_t> reclaimed;
    for (int64_t g : queue_)
      if (keep_groups[g]) queue.push_back(g);  // still ready and unclaimed, FIFO order kept
    consumed_rows_ = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t b = g * group_size_, e = b + group_size_;
      if (!keep_groups[g]) {
        for (size_t s = 0; s < slots; ++s)
          std::fill(ready_bits_.begin() + s * capacity_ + b, ready_bits_.begin() + s * capacity_ + e, 0);
        std::fill(ready_count_.begin() + b, ready_count_.begin() + e, 0);
        std::fill(consumed_.begin() + b, consumed_.begin() + e, 0);
        std::fill(done_.begin() + b, done_.begin() + e, 0);
        std::fill(row_len_.begin() + b, row_len_.begin() + e, 0);
        std::fill(claim_of_.begin() + b, claim_of_.begin() + e, 0);
        std::fill(version_.begin() + b, version_.begin() + e, 0);
        group_ready_[g] = 0;
        continue;
      }
      if (!consumed_[b]) continue;
      bool done = true;
      for (int64_t r = b; r < e; ++r) done = done && done_[r];
      if (done) {
        consumed_rows_ += group_size_;
        continue;
      }
      // A claim does not survive a reset: the group goes back to the stage.
      std::fill(consumed_.begin() + b, consumed_.begin() + e, 0);
      std::fill(done_.begin() + b, done_.begin() + e, 0);
      std::fill(claim_of_.begin() + b, claim_of_.begin() + e, 0);
      if (group_ready_[g] == group_size_) {
        reclaimed.push_back(g);
        woke = true;
      }
    }
    queue.insert(queue.begin(), reclaimed.begin(), reclaimed.end());
    queue_.swap(queue);
    ++epoch_;
  }
  if (woke) cv_.notify_all();
}

uint64_t Controller::epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

void Controller::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

}  // namespace msrl::dock
