#include "dock/dock.h"

#include <algorithm>
#include <chrono>
#include <cstring>

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
  MSRL_CHECK(!config_.stages.empty(), kInvalidArgument, "a dock needs at least one stage");
  const int S = config_.warehouses;
  // Warehouse w owns groups [w*groups/S, (w+1)*groups/S).
  group_warehouse_.resize(groups);
  for (int w = 0; w < S; ++w) {
    const int64_t gb = w * groups / S, ge = (w + 1) * groups / S;
    for (int64_t g = gb; g < ge; ++g) group_warehouse_[g] = w;
    warehouse_rows_.emplace_back(gb * G, (ge - gb) * G);
    if (!config_.store_bytes) continue;
    std::vector<ColumnSpec> cols = config_.columns;
    warehouses_.push_back(std::make_unique<Warehouse>(w, gb * G, (ge - gb) * G, std::move(cols)));
  }
  for (size_t s = 0; s < config_.stages.size(); ++s) {
    const StageSpec& st = config_.stages[s];
    for (size_t j = 0; j < s; ++j) {
      MSRL_CHECK(config_.stages[j].name != st.name, kInvalidArgument, "duplicate stage name '", st.name, "'");
    }
    std::vector<int> inputs;
    for (const std::string& c : st.inputs) {
      int ci = -1;
      for (size_t k = 0; k < config_.columns.size(); ++k)
        if (config_.columns[k].name == c) ci = static_cast<int>(k);
      MSRL_CHECK(ci >= 0, kNotFound, "stage '", st.name, "' reads unknown column '", c, "'");
      inputs.push_back(ci);
    }
    int len_col = -1;
    if (!st.length_column.empty()) len_col = column_index(st.length_column);
    controllers_.push_back(std::make_unique<Controller>(st.name, config_.capacity, G, std::move(inputs), len_col));
  }
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

int DockCore::column_index(const std::string& name) const {
  for (size_t c = 0; c < config_.columns.size(); ++c)
    if (config_.columns[c].name == name) return static_cast<int>(c);
  std::string known;
  for (const auto& c : config_.columns) known += (known.empty() ? "" : ", ") + c.name;
  MSRL_THROW(kNotFound, "unknown column '", name, "'; columns are: ", known);
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
  const size_t want = static_cast<size_t>(n / G);
  std::lock_guard<std::mutex> lock(alloc_mu_);
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

void DockCore::check_allocated(const int64_t* rows, size_t n) const {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  for (size_t i = 0; i < n; ++i) {
    MSRL_CHECK(rows[i] >= 0 && rows[i] < config_.capacity, kInvalidArgument, "row ", rows[i], " out of range [0, ",
               config_.capacity, ")");
    MSRL_CHECK(group_allocated_[rows[i] / config_.group_size], kInvalidArgument, "row ", rows[i],
               " was never allocated (put new rows without rows= first)");
  }
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

void DockCore::check_epoch(int64_t epoch) const {
  MSRL_CHECK(epoch < 0 || static_cast<uint64_t>(epoch) == epoch_.load(), kInvalidArgument,
             "stale claim: its rows are from iteration ", epoch, " but the dock was reset and is at iteration ",
             epoch_.load());
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
    std::lock_guard<std::mutex> lock(gate_mu_);
    auto it = puts_.find(id);
    if (it != puts_.end()) {
      it->second = PutEntry{*rows, true, alloc_epoch};
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
  MSRL_CHECK(stage >= -1 && stage < static_cast<int>(controllers_.size()), kNotFound, "stage id ", stage,
             " out of range");
  MSRL_CHECK(n > 0, kInvalidArgument, "put needs at least one row");
  const uint64_t id = register_put(put_epoch);  // registered: no reset can start until the put ends
  try {
    check_epoch(epoch);
    check_allocated(rows, n);
    if (stage >= 0 && claim_id != 0) controllers_[stage]->check_held(rows, n, claim_id);
  } catch (...) {
    abort_put(id);
    throw;
  }
  std::lock_guard<std::mutex> lock(gate_mu_);
  auto it = puts_.find(id);
  if (it != puts_.end()) it->second.rows.assign(rows, rows + n);  // else abandoned: publish refuses
  return id;
}

void DockCore::publish(uint64_t put, const std::vector<ColumnMark>& columns, const int64_t* rows, size_t n, int stage,
                       uint64_t claim_id) {
  MSRL_CHECK(stage >= -1 && stage < static_cast<int>(controllers_.size()), kNotFound, "stage id ", stage,
             " out of range");
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
    publish_locked(columns, rows, n, stage, claim_id);
  } catch (...) {
    end_put(put);  // readiness may be partly published: the rows stay allocated
    throw;
  }
  end_put(put);
  // put() and put_new() time themselves; a metadata-only dock counts the puts published here.
  if (!config_.store_bytes) put_stats.record(0, static_cast<int64_t>(n), 0);
}

void DockCore::publish_locked(const std::vector<ColumnMark>& columns, const int64_t* rows, size_t n, int stage,
                              uint64_t claim_id) {
  for (const ColumnMark& m : columns) {
    MSRL_CHECK(m.column >= 0 && m.column < static_cast<int>(config_.columns.size()), kNotFound, "column id ", m.column,
               " out of range");
  }
  // Readers get readiness; a stage balancing by a column also records its lengths.
  for (const ColumnMark& m : columns) {
    for (const auto& c : controllers_) c->mark_ready(m.column, rows, n, m.lengths);
  }
  if (stage >= 0) {
    controllers_[stage]->complete(rows, n, claim_id);
    return;
  }
  std::vector<int> ids;
  for (const ColumnMark& m : columns) ids.push_back(m.column);
  for (const auto& c : controllers_) c->complete_by_put(ids, rows, n);
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
  if (give_rows_back && entry.allocated && !entry.rows.empty()) free_groups(groups_of(entry.rows), entry.alloc_epoch);
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
  MSRL_CHECK(stage >= 0 && stage < static_cast<int>(controllers_.size()), kNotFound, "stage id ", stage,
             " out of range");
  std::shared_lock<std::shared_mutex> ops(ops_mu_);
  check_epoch(epoch);
  controllers_[stage]->complete(rows, n, claim_id);
}

int64_t store_columns(const std::vector<Warehouse*>& warehouses, const std::function<int(int64_t)>& route,
                      const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n) {
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
    MSRL_CHECK(in.column >= 0 && in.column < static_cast<int>(columns.size()), kNotFound, "column id ", in.column,
               " out of range");
    for (size_t j = 0; j < k; ++j) {
      MSRL_CHECK(inputs[j].column != in.column, kInvalidArgument, "column '", columns[in.column].name,
                 "' given twice in one put");
    }
    column_ids.push_back(in.column);
    const ColumnSpec& spec = columns[in.column];
    MSRL_CHECK(!spec.ragged || in.lengths != nullptr, kInvalidArgument, "column '", spec.name,
               "' is ragged: lengths required");
    const int64_t item = static_cast<int64_t>(spec.item_bytes());
    int64_t off = 0;
    for (size_t i = 0; i < n; ++i) {
      const int64_t len = spec.ragged ? in.lengths[i] : 1;
      MSRL_CHECK(len >= 0, kInvalidArgument, "column '", spec.name, "': negative length ", len, " at row ", rows[i]);
      const int w = wh[i];
      // Bounded by the arena before multiplying: a huge length must not wrap the byte count.
      MSRL_CHECK(item == 0 || len <= warehouses[w]->arena_capacity(in.column) / item, kOutOfMemory, "column '",
                 spec.name, "': row ", rows[i], " has ", len, " items, more than its arena holds (",
                 warehouses[w]->arena_capacity(in.column), " bytes)");
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
      reserved.emplace_back(w, warehouses[w]->reserve_columns(column_ids, r.rows.data(), r.rows.size(), lens));
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

void DockCore::store(const std::vector<ColumnInput>& inputs, const int64_t* rows, size_t n, int64_t* nbytes) {
  std::vector<Warehouse*> whs;
  for (const auto& w : warehouses_) whs.push_back(w.get());
  *nbytes += store_columns(
      whs, [this](int64_t row) { return warehouse_of(row); }, inputs, rows, n);
}

std::vector<int64_t> DockCore::claim(int stage, int64_t max_rows, int64_t min_rows, double timeout_s, uint64_t* epoch,
                                     int64_t max_items, uint64_t* claim_id) {
  MSRL_CHECK(stage >= 0 && stage < static_cast<int>(controllers_.size()), kNotFound, "stage id ", stage,
             " out of range");
  Timer timer(claim_stats);
  std::vector<int64_t> rows = controllers_[stage]->claim(max_rows, min_rows, timeout_s, epoch, max_items, claim_id);
  timer.rows = static_cast<int64_t>(rows.size());
  return rows;
}

void DockCore::release(int stage, const int64_t* rows, size_t n, int64_t epoch, uint64_t claim_id) {
  MSRL_CHECK(stage >= 0 && stage < static_cast<int>(controllers_.size()), kNotFound, "stage id ", stage,
             " out of range");
  std::shared_lock<std::shared_mutex> ops(ops_mu_);
  check_epoch(epoch);
  controllers_[stage]->release(rows, n, claim_id);
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
  MSRL_CHECK(column >= 0 && column < static_cast<int>(config_.columns.size()), kNotFound, "column id ", column,
             " out of range");
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
  MSRL_CHECK(column >= 0 && column < static_cast<int>(config_.columns.size()), kNotFound, "column id ", column,
             " out of range");
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
  MSRL_CHECK(column >= 0 && column < static_cast<int>(config_.columns.size()), kNotFound, "column id ", column,
             " out of range");
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
  if (keep_unfinished) {
    for (int64_t g = 0; g < groups; ++g) {
      if (!group_allocated_[g]) continue;
      bool finished = true;
      for (const auto& c : controllers_) finished = finished && c->group_completed(g);
      if (finished) continue;
      keep[g] = 1;
      for (int64_t r = g * G; r < (g + 1) * G; ++r) kept_rows.push_back(r);
    }
  }
  for (const auto& c : controllers_) {
    if (kept_rows.empty()) {
      c->reset();
    } else {
      c->reset(keep);
    }
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
  for (const auto& c : controllers_) c->close();
}

}  // namespace msrl::dock
