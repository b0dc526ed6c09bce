#include "dock/dock.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/error.h"

namespace msrl::dock {

namespace {
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Records an operation's latency when it leaves scope (also on error paths: errors are operations).
class Timer {
 public:
  Timer(OpStats& s) : s_(s), start_(now_ns()) {}
  ~Timer() { s_.record(now_ns() - start_, rows, bytes); }
  int64_t rows = 0, bytes = 0;

 private:
  OpStats& s_;
  int64_t start_;
};
std::vector<ColumnMark> marks_of(const std::vector<ColumnInput>& inputs) {
  std::vector<ColumnMark> marks;
  for (const ColumnInput& in : inputs) marks.push_back({in.column, in.lengths});
  return marks;
}
}  // namespace

// Takes a lock within a deadline: try_lock with a growing pause (50 us .. 1 ms). (A timed lock of a
// shared mutex would be pthread_rwlock_clockwrlock, which ThreadSanitizer does not model.)
static bool lock_within(std::unique_lock<std::shared_mutex>& lock, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  auto pause = std::chrono::microseconds(50);
  while (!lock.try_lock()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  return true;
}

void OpStats::record(int64_t ns, int64_t nrows, int64_t nbytes) {
  count.fetch_add(1, std::memory_order_relaxed);
  total_ns.fetch_add(ns, std::memory_order_relaxed);
  rows.fetch_add(nrows, std::memory_order_relaxed);
  bytes.fetch_add(nbytes, std::memory_order_relaxed);
  int64_t m = max_ns.load(std::memory_order_relaxed);
  while (ns > m && !max_ns.compare_exchange_weak(m, ns, std::memory_order_relaxed)) {
  }
}

DockCore::DockCore(DockConfig config) : config_(std::move(config)) {
  const int64_t G = config_.group_size;
  MSRL_CHECK(G > 0, kInvalidArgument, "group_size must be > 0, got ", G);
  MSRL_CHECK(config_.capacity > 0 && config_.capacity % G == 0, kInvalidArgument,
             "capacity must be a positive multiple of group_size ", G, ", got ", config_.capacity);
  const int64_t groups = config_.capacity / G;
  MSRL_CHECK(config_.warehouses > 0 && config_.warehouses <= groups, kInvalidArgument, "warehouses must be in [1, ",
             groups, "] (one group at least per warehouse), got ", config_.warehouses);
  MSRL_CHECK(config_.columns.size() <= static_cast<size_t>(Warehouse::kMaxColumns), kInvalidArgument, "at most ",
             Warehouse::kMaxColumns, " columns, got ", config_.columns.size());
  // A name a stage reads that is not a column yet: an undeclared placeholder, typed by its first put.
  for (const StageSpec& st : config_.stages) {
    for (const std::string& c : st.inputs) {
      bool known = false;
      for (const ColumnSpec& spec : config_.columns) known = known || spec.name == c;
      if (known) continue;
      ColumnSpec ph;
      ph.name = c;
      ph.dtype = DType::kUInt8;
      ph.declared = false;
      config_.columns.push_back(ph);
    }
  }
  config_.columns.reserve(Warehouse::kMaxColumns);
  ncols_.store(static_cast<int>(config_.columns.size()), std::memory_order_release);
  written_.resize(Warehouse::kMaxColumns);
  const int S = config_.warehouses;
  // Warehouse w owns groups [w*groups/S, (w+1)*groups/S).
  group_warehouse_.resize(groups);
  for (int w = 0; w < S; ++w) {
    const int64_t gb = w * groups / S, ge = (w + 1) * groups / S;
    for (int64_t g = gb; g < ge; ++g) group_warehouse_[g] = w;
    warehouse_rows_.emplace_back(gb * G, (ge - gb) * G);
    if (!config_.store_bytes) continue;
    std::vector<ColumnSpec> cols(config_.columns.begin(), config_.columns.end());
    warehouses_.push_back(std::make_unique<Warehouse>(w, gb * G, (ge - gb) * G, std::move(cols)));
  }
  for (size_t s = 0; s < config_.stages.size(); ++s) {
    const StageSpec& st = config_.stages[s];
    for (size_t j = 0; j < s; ++j) {
      MSRL_CHECK(config_.stages[j].name != st.name, kInvalidArgument, "duplicate stage name '", st.name, "'");
    }
    if (!st.length_column.empty()) (void)column_index(st.length_column);
  }
  partitions_.resize(kMaxPartitions);
  partitions_[0] = std::make_unique<Partition>();
  partitions_[0]->live = true;
  new_controllers(*partitions_[0]);
  row_part_.assign(config_.capacity, -1);
  row_key_.assign(config_.capacity, std::string());
  row_pending_.assign(config_.capacity, 0);
  row_erasing_.assign(config_.capacity, 0);
  row_tags_.assign(config_.capacity, Tags());
  group_live_.assign(groups, 0);
  group_allocated_.assign(groups, 0);
  // Interleave: first group of each warehouse, then the second, ...
  std::vector<int64_t> next(S);
  for (int w = 0; w < S; ++w) next[w] = w * groups / S;
  while (static_cast<int64_t>(free_order_.size()) < groups) {
    for (int w = 0; w < S; ++w) {
      if (next[w] < (w + 1) * groups / S) free_order_.push_back(next[w]++);
    }
  }
  order_ = free_order_;
}

void DockCore::new_controllers(Partition& pt) {
  pt.controllers.clear();
  for (const StageSpec& st : config_.stages) {
    std::vector<int> inputs;
    for (const std::string& c : st.inputs) inputs.push_back(column_index(c));
    int len_col = -1;
    if (!st.length_column.empty()) len_col = column_index(st.length_column);
    pt.controllers.push_back(
        std::make_unique<Controller>(st.name, config_.capacity, config_.group_size, std::move(inputs), len_col));
  }
}

DockCore::Partition& DockCore::part(int p) const {
  MSRL_CHECK(p >= 0 && p < npartitions_.load(std::memory_order_acquire) && partitions_[p] != nullptr, kNotFound,
             "partition id ", p, " out of range");
  return *partitions_[p];
}

std::vector<std::unique_ptr<Controller>>& DockCore::ctl(int p) const { return part(p).controllers; }

const Controller& DockCore::controller(int s, int p) const { return *ctl(p).at(s); }

const ColumnSpec& DockCore::column(int c) const {
  const int n = num_columns();
  MSRL_CHECK(c >= 0 && c < n, kNotFound, "column id ", c, " out of range [0, ", n, ")");
  return config_.columns[c];
}

int DockCore::column_index(const std::string& name) const {
  const int n = num_columns();
  for (int c = 0; c < n; ++c)
    if (config_.columns[c].name == name) return c;
  std::string known;
  for (int c = 0; c < n; ++c) known += (known.empty() ? "" : ", ") + config_.columns[c].name;
  MSRL_THROW(kNotFound, "unknown column '", name, "'; columns are: ", known);
}

namespace {
std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}
std::string type_str(const ColumnSpec& c) {
  const std::string dt = c.label.empty() ? std::string(dtype_name(c.dtype)) : c.label;
  return dt + (c.ragged ? " ragged" : "") + " inner shape " + shape_str(c.inner_shape);
}
}  // namespace

int DockCore::declare_column(const ColumnSpec& spec) {
  MSRL_CHECK(!spec.name.empty(), kInvalidArgument, "a column needs a name");
  std::lock_guard<std::mutex> lock(cols_mu_);
  const int n = num_columns();
  for (int c = 0; c < n; ++c) {
    ColumnSpec& have = config_.columns[c];
    if (have.name != spec.name) continue;
    if (!have.declared) {  // a stage's placeholder: typed now
      ColumnSpec typed = spec;
      typed.declared = true;
      for (const auto& w : warehouses_) w->set_column(c, typed);
      have = typed;
      return c;
    }
    MSRL_CHECK(have.dtype == spec.dtype && have.ragged == spec.ragged && have.inner_shape == spec.inner_shape &&
                   have.label == spec.label,
               kInvalidArgument, "column '", spec.name, "' is ", type_str(have), "; this put has ", type_str(spec),
               " (a column's type is fixed by its first put)");
    return c;
  }
  MSRL_CHECK(n < Warehouse::kMaxColumns, kInvalidArgument, "cannot declare column '", spec.name, "': at most ",
             Warehouse::kMaxColumns, " columns");
  ColumnSpec typed = spec;
  typed.declared = true;
  for (const auto& w : warehouses_) (void)w->add_column(typed);  // validates the spec (first warehouse throws)
  config_.columns.push_back(typed);                              // reserved: no reallocation
  ncols_.store(n + 1, std::memory_order_release);
  return n;
}

int DockCore::stage_index(const std::string& name) const {
  for (size_t s = 0; s < config_.stages.size(); ++s)
    if (config_.stages[s].name == name) return static_cast<int>(s);
  std::string known;
  for (const auto& s : config_.stages) known += (known.empty() ? "" : ", ") + s.name;
  MSRL_THROW(kNotFound, "unknown stage '", name, "'; stages are: ", known);
}

int DockCore::warehouse_of(int64_t row) const {
  MSRL_CHECK(row >= 0 && row < config_.capacity, kInvalidArgument, "row ", row, " out of range [0, ", config_.capacity,
             ")");
  return group_warehouse_[row / config_.group_size];
}

std::pair<int64_t, int64_t> DockCore::warehouse_rows(int w) const {
  MSRL_CHECK(w >= 0 && w < num_warehouses(), kInvalidArgument, "warehouse ", w, " out of range [0, ", num_warehouses(),
             ")");
  return warehouse_rows_[w];
}

const Warehouse& DockCore::warehouse(int w) const {
  need_bytes("warehouse()");
  return *warehouses_.at(w);
}

void DockCore::need_bytes(const char* op) const {
  MSRL_CHECK(config_.store_bytes, kInvalidArgument, op,
             " needs the bytes, and this dock holds metadata only (its warehouses are elsewhere)");
}

std::vector<int64_t> DockCore::allocate(int64_t n, uint64_t* alloc_epoch) {
  const int64_t G = config_.group_size;
  MSRL_CHECK(n > 0 && n % G == 0, kInvalidArgument, "a put of new rows must hold whole groups of ", G, " rows, got ", n,
             " rows");
  std::lock_guard<std::mutex> lock(alloc_mu_);
  return allocate_locked(n, alloc_epoch);
}

std::vector<int64_t> DockCore::allocate_locked(int64_t n, uint64_t* alloc_epoch) {
  const int64_t G = config_.group_size;
  const size_t want = static_cast<size_t>(n / G);
  const size_t free_groups = returned_.size() + (free_order_.size() - next_free_);
  MSRL_CHECK(want <= free_groups, kOutOfMemory, "put of ", n, " new rows overflows the dock: ", free_groups * G, " of ",
             config_.capacity, " rows free (capacity); reset() frees them");
  std::vector<int64_t> rows;
  rows.reserve(n);
  for (size_t k = 0; k < want; ++k) {
    int64_t g;
    if (!returned_.empty()) {
      g = returned_.back();
      returned_.pop_back();
    } else {
      g = free_order_[next_free_++];
    }
    group_allocated_[g] = 1;
    group_live_[g] = G;
    for (int64_t r = g * G; r < (g + 1) * G; ++r) rows.push_back(r);
  }
  *alloc_epoch = epoch_.load();  // moves only in reset_state, under alloc_mu_
  allocated_groups_ += static_cast<int64_t>(want);
  return rows;
}

void DockCore::free_groups(const std::vector<int64_t>& groups, uint64_t epoch) noexcept {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  if (epoch_.load() != epoch) return;  // a reset freed them (and they may be another put's now)
  for (int64_t g : groups) {
    group_allocated_[g] = 0;
    group_live_[g] = 0;
    returned_.push_back(g);
    --allocated_groups_;
  }
}

bool DockCore::allocated(int64_t row) const {
  if (row < 0 || row >= config_.capacity) return false;
  std::lock_guard<std::mutex> lock(alloc_mu_);
  return group_allocated_[row / config_.group_size] != 0;
}

int64_t DockCore::allocated_rows() const {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  return allocated_groups_ * config_.group_size;
}

void DockCore::check_allocated(const int64_t* rows, size_t n, int p) const {
  {
    std::lock_guard<std::mutex> lock(alloc_mu_);
    for (size_t i = 0; i < n; ++i) {
      MSRL_CHECK(rows[i] >= 0 && rows[i] < config_.capacity, kInvalidArgument, "row ", rows[i], " out of range [0, ",
                 config_.capacity, ")");
      MSRL_CHECK(group_allocated_[rows[i] / config_.group_size], kInvalidArgument, "row ", rows[i],
                 " was never allocated (put new rows without rows= first)");
    }
  }
  std::lock_guard<std::mutex> lock(keys_mu_);
  for (size_t i = 0; i < n; ++i) {
    const int16_t rp = row_part_[rows[i]];
    MSRL_CHECK(rp == p || (p == 0 && rp < 0), kInvalidArgument, "row ", rows[i], " is not in partition '",
               partitions_[p]->name, "'", rp >= 0 ? " (it is in partition '" + partitions_[rp]->name + "')" : "");
    MSRL_CHECK(!row_erasing_[rows[i]], kInvalidArgument, "row ", rows[i], " is being erased");
  }
}

void DockCore::check_stage(int p, int stage) const {
  MSRL_CHECK(stage >= 0 && stage < static_cast<int>(ctl(p).size()), kNotFound, "stage id ", stage, " out of range [0, ",
             ctl(p).size(), ")");
}

std::vector<int64_t> DockCore::put_new(const std::vector<ColumnInput>& inputs, int64_t n) {
  need_bytes("put");
  Timer timer(put_stats);
  std::vector<int64_t> rows;
  const uint64_t id = begin_put_new(n, &rows);
  try {
    store(inputs, rows.data(), rows.size(), &timer.bytes);
  } catch (...) {
    abort_put(id);  // gives the rows back
    throw;
  }
  publish(id, marks_of(inputs), rows.data(), rows.size());  // ends the put; its rows stay
  timer.rows = static_cast<int64_t>(rows.size());
  return rows;
}

void DockCore::check_epoch(int64_t epoch, int p) const {
  if (p == 0) {
    MSRL_CHECK(epoch < 0 || static_cast<uint64_t>(epoch) == epoch_.load(), kInvalidArgument,
               "stale claim: its rows are from iteration ", epoch, " but the dock was reset and is at iteration ",
               epoch_.load());
    return;
  }
  const uint64_t now = part(p).epoch.load();
  MSRL_CHECK(epoch < 0 || static_cast<uint64_t>(epoch) == now, kInvalidArgument, "stale claim: its rows are from ",
             "epoch ", epoch, " of partition '", part(p).name, "', which was cleared or reset since (epoch ", now, ")");
}

void DockCore::put(const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n, int64_t epoch, int stage,
                   uint64_t claim_id) {
  need_bytes("put");
  Timer timer(put_stats);
  const uint64_t id = begin_put(rows, n, epoch, stage, claim_id);
  try {
    store(inputs, rows, n, &timer.bytes);
  } catch (...) {
    abort_put(id);
    throw;
  }
  publish(id, marks_of(inputs), rows, n, stage, claim_id);  // ends the put
  timer.rows = static_cast<int64_t>(n);
}

uint64_t DockCore::register_put(uint64_t* put_epoch) {
  std::unique_lock<std::mutex> lock(gate_mu_);
  if (resetting_) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(kResetWaitS);
    MSRL_CHECK(gate_cv_.wait_until(lock, deadline, [&] { return !resetting_; }), kTimeout, "put waited ", kResetWaitS,
               " s for a reset() in flight; nothing stored");
  }
  const uint64_t id = ++next_put_;
  puts_.emplace(id, PutEntry{});
  // The epoch moves only inside a reset (resetting_, under this lock): the put's iteration is this one.
  if (put_epoch != nullptr) *put_epoch = epoch_.load();
  return id;
}

std::vector<int64_t> DockCore::groups_of(const std::vector<int64_t>& new_rows) const {
  std::vector<int64_t> groups;
  for (size_t i = 0; i < new_rows.size(); i += static_cast<size_t>(config_.group_size)) {
    groups.push_back(new_rows[i] / config_.group_size);
  }
  return groups;
}

uint64_t DockCore::begin_put_new(int64_t n, std::vector<int64_t>* rows, uint64_t* put_epoch) {
  const uint64_t id = register_put(put_epoch);
  uint64_t alloc_epoch = 0;
  try {
    *rows = allocate(n, &alloc_epoch);
  } catch (...) {
    abort_put(id);
    throw;
  }
  {
    std::lock_guard<std::mutex> klock(keys_mu_);
    for (int64_t r : *rows) row_part_[r] = 0;
  }
  {
    std::lock_guard<std::mutex> lock(gate_mu_);
    auto it = puts_.find(id);
    if (it != puts_.end()) {
      it->second = PutEntry{*rows, true, alloc_epoch, -1, {}};
      return id;
    }
  }
  // reset(force) abandoned the put between its registration and its allocation: the rows may be of the
  // next iteration, and nobody else would free them.
  free_groups(groups_of(*rows), alloc_epoch);
  rows->clear();
  MSRL_THROW(kInvalidArgument,
             "this put was abandoned by reset(force=True) as it began; nothing was stored (put again)");
}

uint64_t DockCore::begin_put(const int64_t* rows, size_t n, int64_t epoch, int stage, uint64_t claim_id,
                             uint64_t* put_epoch) {
  return begin_put_in(0, rows, n, epoch, stage, claim_id, put_epoch);
}

uint64_t DockCore::begin_put_in(int p, const int64_t* rows, size_t n, int64_t epoch, int stage, uint64_t claim_id,
                                uint64_t* put_epoch) {
  MSRL_CHECK(stage >= -1 && stage < static_cast<int>(ctl(p).size()), kNotFound, "stage id ", stage, " out of range");
  MSRL_CHECK(n > 0, kInvalidArgument, "put needs at least one row");
  const uint64_t id = register_put(put_epoch);  // registered: no reset can start until the put ends
  try {
    check_epoch(epoch, p);
    check_allocated(rows, n, p);
    if (stage >= 0 && claim_id != 0) ctl(p)[stage]->check_held(rows, n, claim_id);
  } catch (...) {
    abort_put(id);
    throw;
  }
  std::lock_guard<std::mutex> lock(gate_mu_);
  auto it = puts_.find(id);
  if (it != puts_.end()) it->second.rows.assign(rows, rows + n);  // else abandoned: publish refuses
  return id;
}

void DockCore::put_in(int p, const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n, int64_t epoch,
                      int stage, uint64_t claim_id) {
  need_bytes("put");
  Timer timer(put_stats);
  const uint64_t id = begin_put_in(p, rows, n, epoch, stage, claim_id);
  try {
    store(inputs, rows, n, &timer.bytes);
  } catch (...) {
    abort_put(id);
    throw;
  }
  publish(id, marks_of(inputs), rows, n, stage, claim_id, p);
  timer.rows = static_cast<int64_t>(n);
}

void DockCore::publish(uint64_t put, const std::vector<ColumnMark>& columns, const int64_t* rows, size_t n, int stage,
                       uint64_t claim_id, int p) {
  MSRL_CHECK(stage >= -1 && stage < static_cast<int>(ctl(p).size()), kNotFound, "stage id ", stage, " out of range");
  // Shared ops lock through the publication: reset_metadata (exclusive) runs wholly before or after it,
  // even a forced reset that abandons the put meanwhile.
  std::shared_lock<std::shared_mutex> ops(ops_mu_);
  {
    std::lock_guard<std::mutex> lock(gate_mu_);
    auto it = puts_.find(put);
    MSRL_CHECK(it != puts_.end(), kInvalidArgument,
               "this put was abandoned by reset(force=True) before it was published (or was never begun); nothing "
               "was published (put again)");
    const std::vector<int64_t>& began = it->second.rows;
    MSRL_CHECK(began.size() == n && std::equal(began.begin(), began.end(), rows), kInvalidArgument,
               "publish: the rows are not those this put began with; nothing was published");
  }
  try {
    publish_locked(columns, rows, n, stage, claim_id, p);
  } catch (...) {
    end_put(put);  // readiness may be partly published: the rows stay allocated
    throw;
  }
  end_put(put);
  // put() and put_new() time themselves; a metadata-only dock counts the puts published here.
  if (!config_.store_bytes) put_stats.record(0, static_cast<int64_t>(n), 0);
}

void DockCore::publish_locked(const std::vector<ColumnMark>& columns, const int64_t* rows, size_t n, int stage,
                              uint64_t claim_id, int p) {
  for (const ColumnMark& m : columns) {
    MSRL_CHECK(m.column >= 0 && m.column < num_columns(), kNotFound, "column id ", m.column, " out of range");
  }
  {
    std::lock_guard<std::mutex> lock(keys_mu_);
    mark_written_locked(columns, rows, n);
  }
  auto& controllers = ctl(p);
  // Readers get readiness; a stage balancing by a column also records its lengths.
  for (const ColumnMark& m : columns) {
    for (const auto& c : controllers) c->mark_ready(m.column, rows, n, m.lengths);
  }
  if (stage >= 0) {
    controllers[stage]->complete(rows, n, claim_id);
    return;
  }
  std::vector<int> ids;
  for (const ColumnMark& m : columns) ids.push_back(m.column);
  for (const auto& c : controllers) c->complete_by_put(ids, rows, n);
}

void DockCore::mark_written_locked(const std::vector<ColumnMark>& columns, const int64_t* rows, size_t n) {
  for (const ColumnMark& m : columns) {
    std::vector<uint8_t>& w = written_[m.column];
    if (w.empty()) w.assign(config_.capacity, 0);
    for (size_t i = 0; i < n; ++i) w[rows[i]] = 1;
  }
}

bool DockCore::cell_written(int column, int64_t row) const {
  (void)this->column(column);
  MSRL_CHECK(row >= 0 && row < config_.capacity, kInvalidArgument, "row ", row, " out of range");
  std::lock_guard<std::mutex> lock(keys_mu_);
  return !written_[column].empty() && written_[column][row] != 0;
}

bool DockCore::abort_put(uint64_t put, bool give_rows_back) noexcept {
  PutEntry entry;
  {
    std::lock_guard<std::mutex> lock(gate_mu_);
    auto it = puts_.find(put);
    if (it == puts_.end()) return false;  // ended, or abandoned by reset(force): that reset freed its rows
    entry = std::move(it->second);
    puts_.erase(it);
  }
  if (entry.partition >= 0 && !entry.fresh_rows.empty()) {
    // A keyed put's pending keys are forgotten; their rows go back (or, without give_rows_back, stay
    // allocated to nobody until an erase or reset: the caller erases their bytes first).
    std::lock_guard<std::mutex> lock(keys_mu_);
    Partition& pt = *partitions_[entry.partition];
    for (int64_t r : entry.fresh_rows) {
      if (!row_pending_[r]) continue;
      pt.key_row.erase(row_key_[r]);
      row_key_[r].clear();
      row_pending_[r] = 0;
      row_part_[r] = -1;
      row_tags_[r].clear();
    }
  }
  if (give_rows_back && entry.allocated && !entry.rows.empty()) {
    free_groups(groups_of(entry.partition >= 0 ? entry.fresh_rows : entry.rows), entry.alloc_epoch);
  }
  if (entry.partition < 0 && entry.allocated && give_rows_back) {
    std::lock_guard<std::mutex> lock(keys_mu_);
    for (int64_t r : entry.rows) row_part_[r] = -1;
  }
  return true;
}

void DockCore::end_put(uint64_t put) noexcept {
  std::lock_guard<std::mutex> lock(gate_mu_);
  puts_.erase(put);
}

int64_t DockCore::puts_in_flight() const {
  std::lock_guard<std::mutex> lock(gate_mu_);
  return static_cast<int64_t>(puts_.size());
}

void DockCore::complete(int stage, const int64_t* rows, size_t n, int64_t epoch, uint64_t claim_id) {
  complete_in(0, stage, rows, n, epoch, claim_id);
}

void DockCore::complete_in(int p, int stage, const int64_t* rows, size_t n, int64_t epoch, uint64_t claim_id) {
  check_stage(p, stage);
  std::shared_lock<std::shared_mutex> ops(ops_mu_);
  check_epoch(epoch, p);
  ctl(p)[stage]->complete(rows, n, claim_id);
}

int64_t store_columns(const std::vector<Warehouse*>& warehouses, const std::function<int(int64_t)>& route,
                      const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n, bool overwrite) {
  MSRL_CHECK(!inputs.empty(), kInvalidArgument, "put needs at least one column");
  MSRL_CHECK(n > 0, kInvalidArgument, "put needs at least one row");
  MSRL_CHECK(!warehouses.empty(), kInvalidArgument, "a put needs at least one warehouse");
  const int S = static_cast<int>(warehouses.size());
  const std::vector<ColumnSpec>& columns = warehouses[0]->columns();
  int64_t stored = 0;

  // Validate every column and route rows to warehouses before touching anything. Every column routes a
  // row to the same warehouse; lengths and source offsets are per column.
  struct Route {
    std::vector<int64_t> rows;
    std::vector<std::vector<int64_t>> lengths, src_offsets;  // [column k][row]
  };
  std::vector<Route> routes(S);
  std::vector<int> wh(n);
  for (size_t i = 0; i < n; ++i) {
    wh[i] = route(rows[i]);
    MSRL_CHECK(wh[i] >= 0 && wh[i] < S, kInvalidArgument, "row ", rows[i], " routes to no warehouse");
    routes[wh[i]].rows.push_back(rows[i]);
  }
  for (Route& r : routes) {
    r.lengths.resize(inputs.size());
    r.src_offsets.resize(inputs.size());
  }
  std::vector<int> column_ids;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const ColumnInput& in = inputs[k];
    MSRL_CHECK(in.column >= 0 && in.column < warehouses[0]->num_columns(), kNotFound, "column id ", in.column,
               " out of range");
    for (size_t j = 0; j < k; ++j) {
      MSRL_CHECK(inputs[j].column != in.column, kInvalidArgument, "column '", columns[in.column].name,
                 "' given twice in one put");
    }
    column_ids.push_back(in.column);
    const ColumnSpec& spec = columns[in.column];
    MSRL_CHECK(spec.declared, kInvalidArgument, "column '", spec.name, "' has no type yet: declare it first");
    MSRL_CHECK(!spec.ragged || in.lengths != nullptr, kInvalidArgument, "column '", spec.name,
               "' is ragged: lengths required");
    const int64_t item = static_cast<int64_t>(spec.item_bytes());
    int64_t off = 0;
    for (size_t i = 0; i < n; ++i) {
      const int64_t len = spec.ragged ? in.lengths[i] : 1;
      MSRL_CHECK(len >= 0, kInvalidArgument, "column '", spec.name, "': negative length ", len, " at row ", rows[i]);
      const int w = wh[i];
      // Bounded by the arena before multiplying: a huge length must not wrap the byte count.
      MSRL_CHECK(item == 0 || len <= warehouses[w]->max_row_bytes(in.column) / item, kOutOfMemory, "column '",
                 spec.name, "': row ", rows[i], " has ", len, " items, more than its arena holds (",
                 warehouses[w]->max_row_bytes(in.column), " bytes)");
      Route& r = routes[w];
      r.lengths[k].push_back(len);
      r.src_offsets[k].push_back(off);
      off += len * item;
    }
    MSRL_CHECK(static_cast<size_t>(off) == in.nbytes, kInvalidArgument, "column '", spec.name, "': ", n, " rows need ",
               off, " bytes of values, got ", in.nbytes);
    stored += off;
  }

  // Reserve in every warehouse (all or none), copy without locks, commit.
  std::vector<std::pair<int, std::vector<Reservation>>> reserved;
  try {
    for (int w = 0; w < S; ++w) {
      const Route& r = routes[w];
      if (r.rows.empty()) continue;
      std::vector<const int64_t*> lens;
      for (const auto& l : r.lengths) lens.push_back(l.data());
      reserved.emplace_back(w,
                            warehouses[w]->reserve_columns(column_ids, r.rows.data(), r.rows.size(), lens, overwrite));
    }
  } catch (...) {
    for (auto& [w, res] : reserved)
      for (const Reservation& x : res) warehouses[w]->abort(x);
    throw;
  }
  for (auto& [w, res] : reserved) {
    for (size_t k = 0; k < res.size(); ++k) {
      warehouses[w]->write(res[k], static_cast<const uint8_t*>(inputs[k].data), routes[w].src_offsets[k].data());
    }
  }
  for (auto& [w, res] : reserved)
    for (const Reservation& x : res) warehouses[w]->commit(x);
  return stored;
}

void DockCore::store(const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n, int64_t* nbytes,
                     bool overwrite) {
  std::vector<Warehouse*> whs;
  for (const auto& w : warehouses_) whs.push_back(w.get());
  *nbytes += store_columns(
      whs, [this](int64_t row) { return warehouse_of(row); }, inputs, rows, n, overwrite);
}

std::vector<int64_t> DockCore::claim(int stage, int64_t max_rows, int64_t min_rows, double timeout_s, uint64_t* epoch,
                                     int64_t max_items, uint64_t* claim_id) {
  return claim_in(0, stage, max_rows, min_rows, timeout_s, epoch, max_items, claim_id, Controller::kAnyVersion);
}

std::vector<int64_t> DockCore::claim_in(int p, int stage, int64_t max_rows, int64_t min_rows, double timeout_s,
                                        uint64_t* epoch, int64_t max_items, uint64_t* claim_id, int64_t min_version) {
  check_stage(p, stage);
  Timer timer(claim_stats);
  std::vector<int64_t> rows =
      ctl(p)[stage]->claim(max_rows, min_rows, timeout_s, epoch, max_items, claim_id, min_version);
  timer.rows = static_cast<int64_t>(rows.size());
  return rows;
}

void DockCore::release(int stage, const int64_t* rows, size_t n, int64_t epoch, uint64_t claim_id) {
  release_in(0, stage, rows, n, epoch, claim_id);
}

void DockCore::release_in(int p, int stage, const int64_t* rows, size_t n, int64_t epoch, uint64_t claim_id) {
  check_stage(p, stage);
  std::shared_lock<std::shared_mutex> ops(ops_mu_);
  check_epoch(epoch, p);
  ctl(p)[stage]->release(rows, n, claim_id);
}

void DockCore::lengths(int column, const int64_t* rows, size_t n, int64_t* out) const {
  need_bytes("lengths()");
  std::vector<const uint8_t*> ptrs(1);
  for (size_t i = 0; i < n; ++i) {
    warehouses_[warehouse_of(rows[i])]->views(column, rows + i, 1, ptrs.data(), out + i);
  }
}

void DockCore::gather(int column, const int64_t* rows, size_t n, void* dst, size_t dst_bytes, int64_t epoch) {
  need_bytes("fetch");
  std::shared_lock<std::shared_mutex> ops(ops_mu_);
  check_epoch(epoch);
  Timer timer(fetch_stats);
  MSRL_CHECK(column >= 0 && column < num_columns(), kNotFound, "column id ", column, " out of range");
  const size_t item = config_.columns[column].item_bytes();
  std::vector<const uint8_t*> ptrs(n);
  std::vector<int64_t> lens(n);
  for (size_t i = 0; i < n; ++i) {
    warehouses_[warehouse_of(rows[i])]->views(column, rows + i, 1, ptrs.data() + i, lens.data() + i);
  }
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) total += static_cast<size_t>(lens[i]) * item;
  MSRL_CHECK(total == dst_bytes, kInvalidArgument, "column '", config_.columns[column].name, "': ", n, " rows hold ",
             total, " bytes, destination has ", dst_bytes);
  std::vector<Segment> segs;
  segs.reserve(n);
  uint8_t* out = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < n; ++i) {
    const size_t nb = static_cast<size_t>(lens[i]) * item;
    if (nb) segs.push_back({out, ptrs[i], nb});
    out += nb;
  }
  copy_segments(std::move(segs));
  timer.rows = static_cast<int64_t>(n);
  timer.bytes = static_cast<int64_t>(total);
}

void DockCore::gather_padded(int column, const int64_t* rows, size_t n, int64_t max_items, void* dst, int64_t epoch) {
  need_bytes("fetch");
  std::shared_lock<std::shared_mutex> ops(ops_mu_);
  check_epoch(epoch);
  Timer timer(fetch_stats);
  MSRL_CHECK(column >= 0 && column < num_columns(), kNotFound, "column id ", column, " out of range");
  MSRL_CHECK(max_items >= 0, kInvalidArgument, "padded width must be >= 0, got ", max_items);
  const size_t item = config_.columns[column].item_bytes();
  const size_t stride = static_cast<size_t>(max_items) * item;
  std::vector<const uint8_t*> ptrs(n);
  std::vector<int64_t> lens(n);
  for (size_t i = 0; i < n; ++i) {
    warehouses_[warehouse_of(rows[i])]->views(column, rows + i, 1, ptrs.data() + i, lens.data() + i);
    MSRL_CHECK(lens[i] <= max_items, kInvalidArgument, "column '", config_.columns[column].name, "': row ", rows[i],
               " has ", lens[i], " items, more than the padded width ", max_items);
  }
  std::vector<Segment> segs;
  segs.reserve(n);
  uint8_t* out = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < n; ++i) {
    const size_t nb = static_cast<size_t>(lens[i]) * item;
    if (nb) segs.push_back({out + i * stride, ptrs[i], nb});
    if (nb < stride) std::memset(out + i * stride + nb, 0, stride - nb);
  }
  copy_segments(std::move(segs));
  timer.rows = static_cast<int64_t>(n);
  timer.bytes = static_cast<int64_t>(n * stride);
}

bool DockCore::view(int column, const int64_t* rows, size_t n, const uint8_t** data, size_t* nbytes, int64_t* lengths,
                    int64_t epoch) {
  need_bytes("fetch");
  std::shared_lock<std::shared_mutex> ops(ops_mu_);
  check_epoch(epoch);
  Timer timer(fetch_stats);
  MSRL_CHECK(column >= 0 && column < num_columns(), kNotFound, "column id ", column, " out of range");
  MSRL_CHECK(n > 0, kInvalidArgument, "a view needs at least one row");
  const size_t item = config_.columns[column].item_bytes();
  std::vector<const uint8_t*> ptrs(n);
  for (size_t i = 0; i < n; ++i) {
    warehouses_[warehouse_of(rows[i])]->views(column, rows + i, 1, ptrs.data() + i, lengths + i);
  }
  const int w0 = warehouse_of(rows[0]);
  size_t total = static_cast<size_t>(lengths[0]) * item;
  bool contiguous = true;
  for (size_t i = 1; i < n && contiguous; ++i) {
    contiguous = warehouse_of(rows[i]) == w0 && ptrs[i] == ptrs[0] + total;
    total += static_cast<size_t>(lengths[i]) * item;
  }
  timer.rows = static_cast<int64_t>(n);
  if (!contiguous) return false;
  *data = ptrs[0];
  *nbytes = total;
  // Under the shared ops lock: reset (exclusive) sees either no pin and no view, or the pin.
  live_views_.fetch_add(1);
  return true;
}

void DockCore::unpin() {
  int64_t v = live_views_.load();
  do {
    MSRL_CHECK(v > 0, kInvalidArgument, "unpin() without a live view");
  } while (!live_views_.compare_exchange_weak(v, v - 1));
}

void DockCore::reset() { (void)reset(false); }

std::vector<int64_t> DockCore::reset(bool keep_unfinished) {
  need_bytes("reset()");  // a metadata-only dock resets in steps (begin_reset ... end_reset)
  begin_reset(false);     // in-process puts cannot be orphaned: never forced
  struct EndReset {
    DockCore* d;
    ~EndReset() { d->end_reset(); }
  } end{this};
  std::unique_lock<std::shared_mutex> ops(ops_mu_, std::try_to_lock);
  MSRL_CHECK(ops.owns_lock(), kInvalidArgument, "reset() while a fetch is in flight; nothing was reset");
  const int64_t views = live_views_.load();
  MSRL_CHECK(views == 0, kInvalidArgument, "reset() while ", views,
             " zero-copy fetch view(s) of this iteration are alive (arrays from fetch(copy=False)); drop them "
             "first; nothing was reset");
  std::vector<int64_t> kept = reset_state(keep_unfinished);
  // No put runs (none registered, new ones held back), so no warehouse has a write in flight: nothing
  // below throws.
  const int64_t G = config_.group_size;
  if (kept.empty()) {
    for (const auto& w : warehouses_) w->reset();
  } else {
    std::vector<std::vector<int64_t>> per_wh(warehouses_.size());
    for (int64_t r : kept) per_wh[group_warehouse_[r / G]].push_back(r);
    for (size_t w = 0; w < warehouses_.size(); ++w) warehouses_[w]->reset(per_wh[w]);
  }
  return kept;
}

void DockCore::begin_reset(bool force) {
  std::lock_guard<std::mutex> lock(gate_mu_);
  MSRL_CHECK(!resetting_, kInvalidArgument, "reset() while another reset is in flight; nothing was reset");
  MSRL_CHECK(force || puts_.empty(), kInvalidArgument, "reset() while ", puts_.size(),
             " put(s) are in flight; nothing was reset");
  puts_.clear();  // (force) abandoned: their publish refuses, their abort frees nothing
  resetting_ = true;
}

void DockCore::end_reset() noexcept {
  {
    std::lock_guard<std::mutex> lock(gate_mu_);
    resetting_ = false;
  }
  gate_cv_.notify_all();
}

std::vector<int64_t> DockCore::reset_metadata(bool keep_unfinished) {
  MSRL_CHECK(!config_.store_bytes, kInvalidArgument,
             "reset_metadata() is for a metadata-only dock; this one holds its warehouses: use reset()");
  {
    std::lock_guard<std::mutex> lock(gate_mu_);
    MSRL_CHECK(resetting_, kInvalidArgument, "reset_metadata() outside begin_reset() ... end_reset()");
  }
  std::unique_lock<std::shared_mutex> ops(ops_mu_);  // complete/release finish first
  return reset_state(keep_unfinished);
}

std::vector<int64_t> DockCore::reset_state(bool keep_unfinished) {
  const int64_t G = config_.group_size;
  const int64_t groups = config_.capacity / G;
  std::vector<uint8_t> keep(groups, 0);
  std::vector<int64_t> kept_rows;
  std::lock_guard<std::mutex> lock(alloc_mu_);
  std::lock_guard<std::mutex> klock(keys_mu_);
  if (keep_unfinished) {
    for (int64_t g = 0; g < groups; ++g) {
      if (!group_allocated_[g] || row_part_[g * G] > 0) continue;  // keyed partitions are cleared
      bool finished = true;
      for (const auto& c : ctl(0)) finished = finished && c->group_completed(g);
      if (finished) continue;
      keep[g] = 1;
      for (int64_t r = g * G; r < (g + 1) * G; ++r) kept_rows.push_back(r);
    }
  }
  for (const auto& c : ctl(0)) {
    if (kept_rows.empty()) {
      c->reset();
    } else {
      c->reset(keep);
    }
  }
  const int np = npartitions_.load();
  for (int q = 1; q < np; ++q) {
    Partition& pt = *partitions_[q];
    for (const auto& c : pt.controllers) c->reset();
    pt.key_row.clear();
    pt.epoch.fetch_add(1);
  }
  for (int64_t r = 0; r < config_.capacity; ++r) {
    if (keep[r / G]) continue;
    row_part_[r] = -1;
    row_key_[r].clear();
    row_pending_[r] = row_erasing_[r] = 0;
    row_tags_[r].clear();
    for (int c = 0; c < num_columns(); ++c)
      if (!written_[c].empty()) written_[c][r] = 0;
  }
  for (int64_t g = 0; g < groups; ++g) group_live_[g] = keep[g] ? G : 0;
  {
    std::lock_guard<std::mutex> dlock(dp_mu_);
    dp_rounds_.clear();
  }
  group_allocated_ = keep;
  free_order_.clear();
  for (int64_t g : order_)
    if (!keep[g]) free_order_.push_back(g);
  next_free_ = 0;
  returned_.clear();
  allocated_groups_ = static_cast<int64_t>(kept_rows.size()) / G;
  epoch_.fetch_add(1);
  return kept_rows;
}

void DockCore::close() {
  const int np = npartitions_.load();
  for (int q = 0; q < np; ++q)
    if (partitions_[q]) {
      for (const auto& c : partitions_[q]->controllers) c->close();
    }
}

// ---- The keyed store ----

namespace {
// Keys arrive encoded by the bindings: 'i' + decimal (an int key) or 's' + UTF-8 (a str key).
std::string key_repr(const std::string& k) {
  if (!k.empty() && k[0] == 'i') return k.substr(1);
  if (!k.empty() && k[0] == 's') return "'" + k.substr(1) + "'";
  return "'" + k + "'";
}
}  // namespace

int DockCore::partition(const std::string& name, bool create) {
  if (name.empty()) return 0;
  std::lock_guard<std::mutex> lock(part_mu_);
  const int np = npartitions_.load();
  int free_slot = -1;
  for (int q = 1; q < np; ++q) {
    Partition& pt = *partitions_[q];
    if (pt.live && pt.name == name) return q;
    if (!pt.live && free_slot < 0) free_slot = q;
  }
  if (!create) {
    std::string known;
    for (int q = 1; q < np; ++q)
      if (partitions_[q]->live) known += (known.empty() ? "" : ", ") + ("'" + partitions_[q]->name + "'");
    MSRL_THROW(kNotFound, "unknown partition '", name, "'; partitions are: ", known.empty() ? "(none)" : known);
  }
  if (free_slot >= 0) {
    Partition& pt = *partitions_[free_slot];
    new_controllers(pt);  // fresh claim ids; the epoch keeps counting (claims of the old name stay stale)
    pt.epoch.fetch_add(1);
    for (const auto& c : pt.controllers)
      while (c->epoch() < pt.epoch.load()) c->reset();
    pt.key_row.clear();
    pt.name = name;
    pt.live = true;
    return free_slot;
  }
  MSRL_CHECK(np < kMaxPartitions, kInvalidArgument, "cannot create partition '", name, "': at most ",
             kMaxPartitions - 1, " partitions are alive at once (drop_partition frees one)");
  auto pt = std::make_unique<Partition>();
  pt->name = name;
  pt->live = true;
  new_controllers(*pt);
  partitions_[np] = std::move(pt);
  npartitions_.store(np + 1, std::memory_order_release);
  return np;
}

std::vector<std::string> DockCore::partition_names() const {
  std::lock_guard<std::mutex> lock(part_mu_);
  std::vector<std::string> out;
  const int np = npartitions_.load();
  for (int q = 1; q < np; ++q)
    if (partitions_[q]->live) out.push_back(partitions_[q]->name);
  return out;
}

uint64_t DockCore::partition_epoch(int p) const { return p == 0 ? epoch_.load() : part(p).epoch.load(); }

KeyedPut DockCore::begin_put_keys(int p, const std::vector<std::string>& keys, const std::vector<int>& columns,
                                  bool overwrite) {
  MSRL_CHECK(p > 0, kInvalidArgument, "keys need a named partition (the default partition takes row ids)");
  Partition& pt = part(p);
  MSRL_CHECK(!keys.empty(), kInvalidArgument, "a put by keys needs at least one key");
  for (int c : columns) (void)column(c);
  KeyedPut kp;
  kp.put = register_put(&kp.put_epoch);
  try {
    std::lock_guard<std::mutex> alock(alloc_mu_);
    std::lock_guard<std::mutex> klock(keys_mu_);
    std::unordered_map<std::string, size_t> seen;
    seen.reserve(keys.size());
    kp.rows.assign(keys.size(), -1);
    kp.fresh.assign(keys.size(), 0);
    size_t fresh = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      const std::string& k = keys[i];
      MSRL_CHECK(seen.emplace(k, i).second, kInvalidArgument, "key ", key_repr(k), " is listed twice in one put (at ",
                 seen[k], " and ", i, "); nothing was changed");
      auto it = pt.key_row.find(k);
      if (it == pt.key_row.end()) {
        kp.fresh[i] = 1;
        ++fresh;
        continue;
      }
      const int64_t r = it->second;
      MSRL_CHECK(!row_pending_[r], kInvalidArgument, "key ", key_repr(k), " of partition '", pt.name,
                 "' is being created by another put in flight; nothing was changed");
      MSRL_CHECK(!row_erasing_[r], kInvalidArgument, "key ", key_repr(k), " is being erased; nothing was changed");
      for (int c : columns) {
        if (written_[c].empty() || !written_[c][r]) continue;
        MSRL_CHECK(overwrite, kInvalidArgument, "key ", key_repr(k), " of partition '", pt.name, "' has column '",
                   config_.columns[c].name, "' written already: rewrite it with overwrite=True; nothing was changed");
        kp.rewrites = true;
      }
      kp.rows[i] = r;
    }
    const int64_t G = config_.group_size;
    MSRL_CHECK(static_cast<int64_t>(fresh) % G == 0, kInvalidArgument, "a put of new keys must hold whole groups of ",
               G, " keys, got ", fresh, " new keys; nothing was changed");
    uint64_t alloc_epoch = 0;
    std::vector<int64_t> fresh_rows;
    if (fresh > 0) fresh_rows = allocate_locked(static_cast<int64_t>(fresh), &alloc_epoch);
    size_t f = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!kp.fresh[i]) continue;
      const int64_t r = fresh_rows[f++];
      kp.rows[i] = r;
      pt.key_row.emplace(keys[i], r);
      row_key_[r] = keys[i];
      row_part_[r] = static_cast<int16_t>(p);
      row_pending_[r] = 1;
    }
    std::lock_guard<std::mutex> glock(gate_mu_);
    auto it = puts_.find(kp.put);
    if (it == puts_.end()) {
      // A forced reset abandoned the put as it began (it cleared nothing of ours yet: we hold the locks).
      for (int64_t r : fresh_rows) {
        pt.key_row.erase(row_key_[r]);
        row_key_[r].clear();
        row_part_[r] = -1;
        row_pending_[r] = 0;
        const int64_t g = r / G;
        if (group_allocated_[g]) {
          group_allocated_[g] = 0;
          group_live_[g] = 0;
          returned_.push_back(g);
          --allocated_groups_;
        }
      }
      MSRL_THROW(kInvalidArgument, "this put was abandoned by reset(force=True) as it began; nothing was stored");
    }
    it->second = PutEntry{kp.rows, fresh > 0, alloc_epoch, p, fresh_rows};
  } catch (...) {
    abort_put(kp.put);  // registered only (no keys), or a no-op when the entry is gone
    throw;
  }
  return kp;
}

void DockCore::publish_keys(const KeyedPut& kp, int p, const std::vector<ColumnMark>& columns,
                            const std::vector<Tags>& tags, const std::vector<int64_t>& versions) {
  const size_t n = kp.rows.size();
  MSRL_CHECK(tags.empty() || tags.size() == n, kInvalidArgument, tags.size(), " tag sets for ", n, " keys");
  MSRL_CHECK(versions.empty() || versions.size() == n, kInvalidArgument, versions.size(), " versions for ", n, " keys");
  Partition& pt = part(p);
  {
    std::lock_guard<std::mutex> klock(keys_mu_);
    {
      std::lock_guard<std::mutex> glock(gate_mu_);
      MSRL_CHECK(puts_.count(kp.put) != 0, kInvalidArgument,
                 "this put was abandoned by reset(force=True) before it was published; nothing was published");
    }
    for (size_t i = 0; i < n; ++i) {
      const int64_t r = kp.rows[i];
      row_pending_[r] = 0;
      if (tags.empty()) continue;
      Tags& have = row_tags_[r];
      for (const TagItem& t : tags[i]) {
        auto it = std::find_if(have.begin(), have.end(), [&](const TagItem& x) { return x.first == t.first; });
        if (it == have.end()) {
          have.push_back(t);
        } else {
          it->second = t.second;
        }
      }
    }
  }
  if (!versions.empty()) {
    for (const auto& c : pt.controllers) c->set_versions(kp.rows.data(), n, versions.data());
  }
  publish(kp.put, columns, kp.rows.data(), n, -1, 0, p);
}

std::vector<int64_t> DockCore::put_keys(int p, const std::vector<std::string>& keys,
                                        const std::vector<ColumnInput>& inputs, bool overwrite,
                                        const std::vector<Tags>& tags, const std::vector<int64_t>& versions) {
  need_bytes("put");
  Timer timer(put_stats);
  std::vector<int> cols;
  for (const ColumnInput& in : inputs) cols.push_back(in.column);
  KeyedPut kp = begin_put_keys(p, keys, cols, overwrite);
  try {
    if (!inputs.empty()) {
      std::unique_lock<std::shared_mutex> ops(ops_mu_, std::defer_lock);
      if (kp.rewrites) {
        // A rewrite frees or rewrites bytes in place: no fetch may copy them meanwhile, no view may see them.
        MSRL_CHECK(lock_within(ops, kResetWaitS), kTimeout, "overwrite waited ", kResetWaitS,
                   " s for fetches in flight; nothing was changed");
        const int64_t views = live_views_.load();
        MSRL_CHECK(views == 0, kInvalidArgument, "overwrite while ", views,
                   " zero-copy fetch view(s) are alive (arrays from fetch(copy=False)); drop them first; nothing "
                   "was changed");
      }
      store(inputs, kp.rows.data(), kp.rows.size(), &timer.bytes, overwrite);
    }
  } catch (...) {
    abort_put(kp.put);
    throw;
  }
  publish_keys(kp, p, marks_of(inputs), tags, versions);
  timer.rows = static_cast<int64_t>(kp.rows.size());
  return kp.rows;
}

std::vector<int64_t> DockCore::rows_of(int p, const std::vector<std::string>& keys) const {
  Partition& pt = part(p);
  std::lock_guard<std::mutex> lock(keys_mu_);
  std::vector<int64_t> out;
  out.reserve(keys.size());
  for (const std::string& k : keys) {
    auto it = pt.key_row.find(k);
    MSRL_CHECK(it != pt.key_row.end() && !row_pending_[it->second] && !row_erasing_[it->second], kNotFound,
               "unknown key ", key_repr(k), " in partition '", pt.name, "'");
    out.push_back(it->second);
  }
  return out;
}

std::vector<std::string> DockCore::keys_of(int p, const int64_t* rows, size_t n) const {
  Partition& pt = part(p);
  std::lock_guard<std::mutex> lock(keys_mu_);
  std::vector<std::string> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = rows[i];
    MSRL_CHECK(r >= 0 && r < config_.capacity, kInvalidArgument, "row ", r, " out of range [0, ", config_.capacity,
               ")");
    MSRL_CHECK(row_part_[r] == p && !row_key_[r].empty() && !row_pending_[r] && !row_erasing_[r], kNotFound, "row ", r,
               " has no key in partition '", pt.name, "'");
    out.push_back(row_key_[r]);
  }
  return out;
}

KeyListing DockCore::list_keys(int p) const {
  Partition& pt = part(p);
  std::lock_guard<std::mutex> lock(keys_mu_);
  std::vector<int64_t> rows;
  rows.reserve(pt.key_row.size());
  for (const auto& kv : pt.key_row)
    if (!row_pending_[kv.second] && !row_erasing_[kv.second]) rows.push_back(kv.second);
  std::sort(rows.begin(), rows.end());
  KeyListing out;
  out.rows = rows;
  for (int64_t r : rows) {
    out.keys.push_back(row_key_[r]);
    out.tags.push_back(row_tags_[r]);
  }
  return out;
}

std::vector<uint8_t> DockCore::written(int p, const std::vector<std::string>& keys,
                                       const std::vector<int>& columns) const {
  for (int c : columns) (void)column(c);
  std::vector<int64_t> rows = rows_of(p, keys);
  std::lock_guard<std::mutex> lock(keys_mu_);
  std::vector<uint8_t> out(rows.size() * columns.size(), 0);
  for (size_t i = 0; i < rows.size(); ++i)
    for (size_t j = 0; j < columns.size(); ++j)
      out[i * columns.size() + j] = !written_[columns[j]].empty() && written_[columns[j]][rows[i]];
  return out;
}

void DockCore::tag(int p, const std::vector<std::string>& keys, const std::vector<Tags>& tags) {
  MSRL_CHECK(tags.size() == keys.size(), kInvalidArgument, tags.size(), " tag sets for ", keys.size(), " keys");
  KeyedPut kp = begin_put_keys(p, keys, {}, false);
  publish_keys(kp, p, {}, tags, {});
}

std::vector<int64_t> DockCore::begin_erase_locked(int p, std::vector<int64_t> rows) {
  Partition& pt = part(p);
  for (int64_t r : rows) {
    MSRL_CHECK(r >= 0 && r < config_.capacity, kInvalidArgument, "row ", r, " out of range [0, ", config_.capacity,
               ")");
    MSRL_CHECK(row_part_[r] == p || (p == 0 && row_part_[r] < 0 && group_allocated_[r / config_.group_size]), kNotFound,
               "row ", r, " is not in partition '", pt.name, "'; nothing was erased");
    MSRL_CHECK(!row_pending_[r], kInvalidArgument, "row ", r, " (key ", key_repr(row_key_[r]),
               ") is being created by a put in flight; nothing was erased");
    MSRL_CHECK(!row_erasing_[r], kInvalidArgument, "row ", r, " is being erased already; nothing was erased");
  }
  {
    std::vector<int64_t> sorted = rows;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 1; i < sorted.size(); ++i)
      MSRL_CHECK(sorted[i] != sorted[i - 1], kInvalidArgument, "row ", sorted[i],
                 " is listed twice in one erase; nothing was erased");
    std::lock_guard<std::mutex> glock(gate_mu_);
    for (const auto& kv : puts_) {
      for (int64_t r : kv.second.rows) {
        MSRL_CHECK(!std::binary_search(sorted.begin(), sorted.end(), r), kInvalidArgument, "row ", r,
                   " is written by a put in flight; nothing was erased");
      }
    }
  }
  for (int64_t r : rows) {
    row_erasing_[r] = 1;
    if (!row_key_[r].empty()) pt.key_row.erase(row_key_[r]);
    row_key_[r].clear();
    row_tags_[r].clear();
    for (int c = 0; c < num_columns(); ++c)
      if (!written_[c].empty()) written_[c][r] = 0;
  }
  for (const auto& c : pt.controllers) c->erase(rows.data(), rows.size());
  return rows;
}

std::vector<int64_t> DockCore::begin_erase_keys(int p, const std::vector<std::string>& keys) {
  std::vector<int64_t> rows = rows_of(p, keys);
  std::lock_guard<std::mutex> alock(alloc_mu_);
  std::lock_guard<std::mutex> klock(keys_mu_);
  // Looked up again under the lock: the keys must still name these rows.
  Partition& pt = part(p);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = pt.key_row.find(keys[i]);
    MSRL_CHECK(it != pt.key_row.end() && it->second == rows[i], kNotFound, "unknown key ", key_repr(keys[i]),
               " in partition '", pt.name, "'");
  }
  return begin_erase_locked(p, std::move(rows));
}

std::vector<int64_t> DockCore::begin_erase_rows(int p, const int64_t* rows, size_t n) {
  std::lock_guard<std::mutex> alock(alloc_mu_);
  std::lock_guard<std::mutex> klock(keys_mu_);
  return begin_erase_locked(p, std::vector<int64_t>(rows, rows + n));
}

std::vector<int64_t> DockCore::begin_clear(int p) {
  MSRL_CHECK(p > 0, kInvalidArgument, "clear() takes a named partition; the default partition is reset()");
  std::lock_guard<std::mutex> alock(alloc_mu_);
  std::lock_guard<std::mutex> klock(keys_mu_);
  Partition& pt = part(p);
  std::vector<int64_t> rows;
  for (const auto& kv : pt.key_row) {
    MSRL_CHECK(!row_pending_[kv.second], kInvalidArgument, "clear('", pt.name, "') while a put of key ",
               key_repr(kv.first), " is in flight; nothing was cleared");
    if (!row_erasing_[kv.second]) rows.push_back(kv.second);
  }
  std::sort(rows.begin(), rows.end());
  rows = begin_erase_locked(p, std::move(rows));
  for (const auto& c : pt.controllers) c->reset();
  pt.epoch.fetch_add(1);
  {
    std::lock_guard<std::mutex> dlock(dp_mu_);
    const std::string prefix = std::to_string(p) + "/";
    for (auto it = dp_rounds_.begin(); it != dp_rounds_.end();)
      it = it->first.compare(0, prefix.size(), prefix) == 0 ? dp_rounds_.erase(it) : std::next(it);
  }
  return rows;
}

void DockCore::end_erase(const std::vector<int64_t>& rows) noexcept {
  const int64_t G = config_.group_size;
  std::lock_guard<std::mutex> alock(alloc_mu_);
  std::lock_guard<std::mutex> klock(keys_mu_);
  for (int64_t r : rows) {
    if (r < 0 || r >= config_.capacity || !row_erasing_[r]) continue;  // a reset came between
    row_erasing_[r] = 0;
    row_part_[r] = -1;
    const int64_t g = r / G;
    if (group_live_[g] > 0 && --group_live_[g] == 0 && group_allocated_[g]) {
      group_allocated_[g] = 0;
      returned_.push_back(g);
      --allocated_groups_;
    }
  }
}

void DockCore::erase_local(int p, const std::vector<int64_t>& rows) {
  (void)p;
  std::vector<std::vector<int64_t>> per_wh(warehouses_.size());
  for (int64_t r : rows) per_wh[warehouse_of(r)].push_back(r);
  const int ncols = num_columns();
  for (size_t w = 0; w < warehouses_.size(); ++w) {
    if (per_wh[w].empty()) continue;
    for (int c = 0; c < ncols; ++c)
      if (config_.columns[c].declared) warehouses_[w]->erase(c, per_wh[w].data(), per_wh[w].size());
  }
}

namespace {
class ExclusiveOps {
 public:
  ExclusiveOps(std::shared_mutex& mu, const std::atomic<int64_t>& views, const char* op) : lock_(mu, std::defer_lock) {
    MSRL_CHECK(lock_within(lock_, DockCore::kResetWaitS), kTimeout, op, " waited ", DockCore::kResetWaitS,
               " s for fetches in flight; nothing was changed");
    const int64_t v = views.load();
    MSRL_CHECK(v == 0, kInvalidArgument, op, " while ", v,
               " zero-copy fetch view(s) are alive (arrays from fetch(copy=False)); drop them first; nothing was "
               "changed");
  }

 private:
  std::unique_lock<std::shared_mutex> lock_;
};
}  // namespace

void DockCore::erase_keys(int p, const std::vector<std::string>& keys) {
  need_bytes("erase");
  std::vector<int64_t> rows;
  {
    ExclusiveOps ops(ops_mu_, live_views_, "erase");
    rows = begin_erase_keys(p, keys);
    erase_local(p, rows);
  }
  end_erase(rows);
}

void DockCore::erase_rows(int p, const int64_t* rows, size_t n) {
  need_bytes("erase");
  std::vector<int64_t> got;
  {
    ExclusiveOps ops(ops_mu_, live_views_, "erase");
    got = begin_erase_rows(p, rows, n);
    erase_local(p, got);
  }
  end_erase(got);
}

void DockCore::clear(int p) {
  need_bytes("clear");
  std::vector<int64_t> rows;
  {
    ExclusiveOps ops(ops_mu_, live_views_, "clear");
    rows = begin_clear(p);
    erase_local(p, rows);
  }
  end_erase(rows);
}

void DockCore::drop_partition(int p) {
  MSRL_CHECK(p > 0, kInvalidArgument, "the default partition cannot be dropped");
  if (config_.store_bytes) {
    clear(p);
  } else {
    end_erase(begin_clear(p));  // a metadata-only dock: the caller erased the bytes
  }
  std::lock_guard<std::mutex> lock(part_mu_);
  part(p).live = false;
}

std::vector<int64_t> DockCore::claim_dp(int p, int stage, const std::string& round, int dp_rank, int dp_size,
                                        int ranks_per_replica, int64_t max_rows, int64_t min_rows, double timeout_s,
                                        uint64_t* epoch, uint64_t* claim_id, int64_t min_version) {
  check_stage(p, stage);
  MSRL_CHECK(dp_size >= 1, kInvalidArgument, "dp_size must be >= 1, got ", dp_size);
  MSRL_CHECK(dp_rank >= 0 && dp_rank < dp_size, kInvalidArgument, "dp_rank must be in [0, ", dp_size, "), got ",
             dp_rank);
  MSRL_CHECK(ranks_per_replica >= 1, kInvalidArgument, "ranks_per_replica must be >= 1, got ", ranks_per_replica);
  MSRL_CHECK(max_rows >= config_.group_size, kInvalidArgument, "max_rows ", max_rows,
             " is smaller than one group (group_size ", config_.group_size, ")");
  const std::string key = std::to_string(p) + "/" + std::to_string(stage) + "/" + round;
  Timer timer(claim_stats);
  // The round's first call claims while holding dp_mu_: the other ranks of the round wait for its result
  // (bounded by its timeout).
  std::lock_guard<std::mutex> lock(dp_mu_);
  auto it = dp_rounds_.find(key);
  if (it == dp_rounds_.end()) {
    DpRound rd;
    std::vector<int64_t> rows = ctl(p)[stage]->claim(max_rows * dp_size, min_rows * dp_size, timeout_s, &rd.epoch, 0,
                                                     &rd.claim_id, min_version);
    // Groups to replicas, largest first onto the lightest replica: loads differ by at most one group.
    const int64_t G = config_.group_size;
    std::vector<int64_t> items = ctl(p)[stage]->items_of(rows.data(), rows.size());
    std::vector<std::pair<int64_t, size_t>> groups;  // (items, first index)
    for (size_t i = 0; i < rows.size(); i += static_cast<size_t>(G)) {
      int64_t t = 0;
      for (int64_t j = 0; j < G; ++j) t += items[i + j];
      groups.emplace_back(t, i);
    }
    std::stable_sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    rd.shares.assign(dp_size, {});
    std::vector<int64_t> load(dp_size, 0);
    std::vector<int64_t> per_rows(dp_size, 0);
    for (const auto& [t, i] : groups) {
      int best = -1;
      for (int d = 0; d < dp_size; ++d) {
        if (per_rows[d] + G > max_rows) continue;
        if (best < 0 || load[d] < load[best]) best = d;
      }
      load[best] += t;
      per_rows[best] += G;
      for (int64_t j = 0; j < G; ++j) rd.shares[best].push_back(rows[i + j]);
    }
    for (auto& sh : rd.shares) std::sort(sh.begin(), sh.end());
    rd.calls_left = dp_size * ranks_per_replica;
    it = dp_rounds_.emplace(key, std::move(rd)).first;
  }
  DpRound& rd = it->second;
  std::vector<int64_t> share = rd.shares[dp_rank];
  if (epoch != nullptr) *epoch = rd.epoch;
  if (claim_id != nullptr) *claim_id = rd.claim_id;
  if (--rd.calls_left <= 0) dp_rounds_.erase(it);
  timer.rows = static_cast<int64_t>(share.size());
  return share;
}

}  // namespace msrl::dock
