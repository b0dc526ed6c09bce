#include "dock/warehouse.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "common/error.h"
#include "common/thread_pool.h"

namespace msrl::dock {

const std::vector<DTypeInfo>& dtype_table() {
  static const std::vector<DTypeInfo> table = {
      {DType::kBool, "bool", 1},       {DType::kUInt8, "uint8", 1},     {DType::kInt32, "int32", 4},
      {DType::kInt64, "int64", 8},     {DType::kFloat16, "float16", 2}, {DType::kBFloat16, "bfloat16", 2},
      {DType::kFloat32, "float32", 4},
  };
  return table;
}

namespace {
const DTypeInfo& dtype_info(DType d) {
  for (const auto& t : dtype_table()) {
    if (t.code == d) return t;
  }
  MSRL_THROW(kInvalidArgument, "unknown dtype code ", static_cast<int>(d));
}
}  // namespace

size_t dtype_size(DType d) { return dtype_info(d).size; }

const char* dtype_name(DType d) { return dtype_info(d).name; }

DType parse_dtype(const std::string& name) {
  std::string allowed;
  for (const auto& t : dtype_table()) {
    if (name == t.name) return t.code;
    allowed += (allowed.empty() ? "" : ", ") + std::string(t.name);
  }
  MSRL_THROW(kInvalidArgument, "unsupported dtype '", name, "'; allowed: ", allowed);
}

size_t ColumnSpec::item_bytes() const {
  size_t n = dtype_size(dtype);
  for (int64_t d : inner_shape) n *= static_cast<size_t>(d);
  return n;
}

Warehouse::Warehouse(int id, int64_t row_begin, int64_t num_rows, std::vector<ColumnSpec> columns,
                     std::vector<uint8_t*> external_arenas)
    : id_(id), row_begin_(row_begin), num_rows_(num_rows) {
  MSRL_CHECK(external_arenas.empty() || external_arenas.size() == columns.size(), kInvalidArgument, "warehouse ", id,
             ": ", external_arenas.size(), " external arenas for ", columns.size(), " columns");
  MSRL_CHECK(num_rows > 0, kInvalidArgument, "warehouse ", id, ": num_rows must be > 0, got ", num_rows);
  MSRL_CHECK(row_begin >= 0, kInvalidArgument, "warehouse ", id, ": row_begin must be >= 0, got ", row_begin);
  MSRL_CHECK(columns.size() <= static_cast<size_t>(kMaxColumns), kInvalidArgument, "warehouse ", id, ": ",
             columns.size(), " columns, at most ", kMaxColumns);
  columns_.reserve(kMaxColumns);
  arenas_.reserve(kMaxColumns);
  for (size_t c = 0; c < columns.size(); ++c) {
    const ColumnSpec& spec = columns[c];
    for (size_t j = 0; j < c; ++j) {
      MSRL_CHECK(columns[j].name != spec.name, kInvalidArgument, "duplicate column name '", spec.name, "'");
    }
  }
  for (size_t c = 0; c < columns.size(); ++c) {
    Arena a;
    init_arena(a, columns[c], external_arenas.empty() ? nullptr : external_arenas[c]);
    MSRL_CHECK(external_arenas.empty() || external_arenas[c] != nullptr || a.chunks[0].capacity == 0, kInvalidArgument,
               "column '", columns[c].name, "': external arena is null");
    a.external = !external_arenas.empty();
    columns_.push_back(columns[c]);
    arenas_.push_back(std::move(a));
  }
  ncols_.store(static_cast<int>(columns_.size()), std::memory_order_release);
}

void Warehouse::init_arena(Arena& a, const ColumnSpec& spec, uint8_t* external) {
  for (int64_t d : spec.inner_shape) {
    MSRL_CHECK(d > 0, kInvalidArgument, "column '", spec.name, "': shape dims must be > 0, got ", d);
  }
  Chunk ch;
  if (spec.ragged) {
    MSRL_CHECK(spec.arena_bytes > 0, kInvalidArgument, "ragged column '", spec.name, "': arena_bytes must be > 0, got ",
               spec.arena_bytes);
    ch.capacity = spec.arena_bytes;
  } else {
    ch.capacity = num_rows_ * static_cast<int64_t>(spec.item_bytes());
  }
  ch.base = external;
  a.chunks.push_back(std::move(ch));
  a.state.assign(num_rows_, kEmpty);
  a.offset.assign(num_rows_, 0);
  a.length.assign(num_rows_, 0);
}

int Warehouse::add_column(const ColumnSpec& spec, uint8_t* external) {
  std::lock_guard<std::mutex> lock(mu_);
  const int n = ncols_.load(std::memory_order_relaxed);
  MSRL_CHECK(n < kMaxColumns, kInvalidArgument, "warehouse ", id_, ": cannot add column '", spec.name, "', at most ",
             kMaxColumns, " columns");
  for (int c = 0; c < n; ++c) {
    MSRL_CHECK(columns_[c].name != spec.name, kInvalidArgument, "duplicate column name '", spec.name, "'");
  }
  Arena a;
  init_arena(a, spec, external);
  a.external = external != nullptr;
  columns_.push_back(spec);  // reserved: no reallocation, readers of other columns are unaffected
  arenas_.push_back(std::move(a));
  ncols_.store(n + 1, std::memory_order_release);
  return n;
}

bool Warehouse::declared(int column) const {
  (void)arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  return columns_[column].declared;
}

void Warehouse::set_column(int column, const ColumnSpec& spec, uint8_t* external) {
  (void)arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  MSRL_CHECK(!columns_[column].declared && arenas_[column].rows_written == 0, kInvalidArgument, "column '",
             columns_[column].name, "' is declared already");
  const int n = num_columns();
  for (int c = 0; c < n; ++c) {  // a placeholder takes the declared name (the control plane's ids decide)
    MSRL_CHECK(c == column || columns_[c].name != spec.name, kInvalidArgument, "duplicate column name '", spec.name,
               "'");
  }
  Arena a;
  init_arena(a, spec, external);
  a.external = external != nullptr;
  arenas_[column] = std::move(a);
  columns_[column] = spec;
}

void Warehouse::resize_external(int column, uint8_t* base, int64_t capacity) {
  (void)arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  Arena& a = arenas_[column];
  const ColumnSpec& spec = columns_[column];
  MSRL_CHECK(a.external && spec.ragged && a.chunks.size() == 1, kInvalidArgument, "column '", spec.name,
             "': only a caller-provided ragged arena can be resized");
  Chunk& c = a.chunks[0];
  MSRL_CHECK(base != nullptr && capacity >= c.top && capacity >= 1, kInvalidArgument, "column '", spec.name,
             "': cannot resize its arena to ", capacity, " bytes at ", static_cast<const void*>(base), " (", c.top,
             " bytes in use)");
  c.base = base;
  c.capacity = capacity;
}

int Warehouse::column_index(const std::string& name) const {
  const int n = num_columns();
  for (int c = 0; c < n; ++c)
    if (columns_[c].name == name) return c;
  MSRL_THROW(kNotFound, "unknown column '", name, "'");
}

const Warehouse::Arena& Warehouse::arena(int column) const {
  const int n = num_columns();
  MSRL_CHECK(column >= 0 && column < n, kNotFound, "column index ", column, " out of range [0, ", n, ")");
  return arenas_[column];
}

int64_t Warehouse::max_row_bytes(int column) const {
  const Arena& a = arena(column);
  if (!columns_[column].ragged) return static_cast<int64_t>(columns_[column].item_bytes());
  std::lock_guard<std::mutex> lock(mu_);
  return a.external || !columns_[column].growable ? a.chunks[0].capacity : kMaxChunkBytes;
}

const uint8_t* Warehouse::row_ptr(const Arena& a, int64_t local) const {
  const int64_t off = a.offset[local];
  return a.chunks[chunk_of(off)].base + in_chunk(off);
}

std::pair<int, int64_t> Warehouse::place_locked(Arena& a, const ColumnSpec& spec, int64_t total) {
  auto fits = [&](Chunk& c) { return c.top + total <= c.capacity; };
  auto ensure = [&](Chunk& c) {
    if (c.base == nullptr && c.capacity > 0) {
      c.owned.reset(new (std::nothrow) uint8_t[c.capacity]);
      c.base = c.owned.get();
      MSRL_CHECK(c.base != nullptr, kOutOfMemory, "column '", spec.name, "': cannot allocate ", c.capacity,
                 " arena bytes");
    }
  };
  Chunk& cur = a.chunks[a.cur];
  if (fits(cur)) {
    ensure(cur);
    return {a.cur, cur.top};
  }
  // An empty chunk big enough is reused from its start.
  for (size_t k = 0; k < a.chunks.size(); ++k) {
    Chunk& c = a.chunks[k];
    if (c.live == 0 && c.capacity >= total && (c.base != nullptr || !a.external)) {
      c.top = 0;
      ensure(c);
      a.cur = static_cast<int>(k);
      return {a.cur, 0};
    }
  }
  MSRL_CHECK(!a.external && spec.growable, kOutOfMemory, "column '", spec.name, "' in warehouse ", id_, ": put of ",
             total, " bytes does not fit (", cur.capacity - cur.top, " of ", cur.capacity, " arena bytes free",
             a.external ? ", in caller-provided memory that cannot grow" : ", max_bytes is its bound",
             "); raise the column's max_bytes, erase or reset()");
  MSRL_CHECK(total <= kMaxChunkBytes, kOutOfMemory, "column '", spec.name, "': put of ", total,
             " bytes is more than one arena chunk may hold (", kMaxChunkBytes, ")");
  // Grow: a new chunk of at least the configured arena size (a freed slot is reused).
  Chunk fresh;
  fresh.capacity = std::max(spec.arena_bytes, total);
  ensure(fresh);
  size_t slot = a.chunks.size();
  for (size_t k = 1; k < a.chunks.size(); ++k) {
    if (a.chunks[k].base == nullptr && a.chunks[k].live == 0) {
      slot = k;
      break;
    }
  }
  MSRL_CHECK(slot < (size_t{1} << (63 - kChunkShift)), kOutOfMemory, "column '", spec.name, "': too many arena chunks");
  if (slot == a.chunks.size()) {
    a.chunks.push_back(std::move(fresh));
  } else {
    a.chunks[slot] = std::move(fresh);
  }
  a.cur = static_cast<int>(slot);
  return {a.cur, 0};
}

void Warehouse::release_bytes_locked(Arena& a, int64_t off, int64_t nbytes) {
  Chunk& c = a.chunks[chunk_of(off)];
  c.live -= nbytes;
  if (c.live == 0) c.top = 0;  // all its rows are gone: the chunk is free from its start
}

void Warehouse::free_empty_chunks_locked(Arena& a) {
  for (size_t k = 1; k < a.chunks.size(); ++k) {
    Chunk& c = a.chunks[k];
    if (c.live == 0 && c.owned) {
      c.owned.reset();
      c.base = nullptr;
      c.capacity = 0;
      c.top = 0;
      if (a.cur == static_cast<int>(k)) a.cur = 0;
    }
  }
  while (a.chunks.size() > 1 && a.chunks.back().base == nullptr && a.chunks.back().live == 0) a.chunks.pop_back();
  if (a.cur >= static_cast<int>(a.chunks.size())) a.cur = 0;
}

Reservation Warehouse::reserve(int column, const int64_t* rows, size_t n, const int64_t* lengths, bool overwrite) {
  (void)arena(column);
  const ColumnSpec& spec = columns_[column];
  const int64_t item = static_cast<int64_t>(spec.item_bytes());
  const int64_t bound = max_row_bytes(column);
  Reservation r;
  r.column = column;
  r.overwrite = overwrite;
  r.rows.assign(rows, rows + n);
  r.lengths.resize(n);
  r.nbytes.resize(n);
  r.dst_offsets.resize(n);
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    MSRL_CHECK(owns(rows[i]), kInvalidArgument, "column '", spec.name, "': row ", rows[i], " is not in warehouse ", id_,
               " rows [", row_begin_, ", ", row_begin_ + num_rows_, ")");
    int64_t len = 1;
    if (spec.ragged) {
      MSRL_CHECK(lengths != nullptr, kInvalidArgument, "column '", spec.name, "' is ragged: lengths are required");
      len = lengths[i];
      MSRL_CHECK(len >= 0, kInvalidArgument, "column '", spec.name, "': row ", rows[i], " has negative length ", len);
      // Bounded before multiplying: a huge length must not wrap the byte count.
      MSRL_CHECK(item == 0 || len <= bound / item, kOutOfMemory, "column '", spec.name, "': row ", rows[i], " has ",
                 len, " items, more than its arena holds (", bound, " bytes)");
    }
    r.lengths[i] = len;
    r.nbytes[i] = len * item;
    total += r.nbytes[i];
  }
  std::lock_guard<std::mutex> lock(mu_);
  Arena& a = arenas_[column];
  for (size_t i = 0; i < n; ++i) {
    const uint8_t st = a.state[rows[i] - row_begin_];
    MSRL_CHECK(st == kEmpty || (overwrite && st == kWritten), kInvalidArgument, "column '", spec.name, "': row ",
               rows[i],
               st == kWriting || st == kRewriting ? " is being written by another put"
                                                  : " is already written (rewrite it with overwrite=True)");
  }
  // Duplicates: mark rows one by one; a row seen twice is undone before throwing.
  std::vector<uint8_t> before(n);
  for (size_t i = 0; i < n; ++i) {
    uint8_t& st = a.state[rows[i] - row_begin_];
    if (st == kWriting || st == kRewriting) {
      for (size_t j = 0; j < i; ++j) a.state[rows[j] - row_begin_] = before[j];
      MSRL_THROW(kInvalidArgument, "column '", spec.name, "': row ", rows[i], " appears twice in one put");
    }
    before[i] = st;
    st = st == kWritten ? kRewriting : kWriting;
  }
  if (spec.ragged) {
    std::pair<int, int64_t> at;
    try {
      at = place_locked(a, spec, total);
    } catch (...) {
      for (size_t i = 0; i < n; ++i) a.state[rows[i] - row_begin_] = before[i];
      throw;
    }
    Chunk& c = a.chunks[at.first];
    r.chunk = at.first;
    r.arena_begin = at.second;
    int64_t top = at.second;
    for (size_t i = 0; i < n; ++i) {
      r.dst_offsets[i] = (static_cast<int64_t>(at.first) << kChunkShift) | top;
      top += r.nbytes[i];
    }
    c.top = top;
    c.live += total;
    r.arena_end = top;
  } else {
    Chunk& c = a.chunks[0];
    if (c.base == nullptr && c.capacity > 0) {
      c.owned.reset(new (std::nothrow) uint8_t[c.capacity]);
      c.base = c.owned.get();
      if (c.base == nullptr) {
        for (size_t i = 0; i < n; ++i) a.state[rows[i] - row_begin_] = before[i];
        MSRL_THROW(kOutOfMemory, "column '", spec.name, "': cannot allocate ", c.capacity, " arena bytes");
      }
    }
    for (size_t i = 0; i < n; ++i) r.dst_offsets[i] = (rows[i] - row_begin_) * item;
  }
  for (size_t i = 0; i < n; ++i)
    if (before[i] == kEmpty) a.bytes_used += r.nbytes[i];
  return r;
}

void Warehouse::write(const Reservation& r, const uint8_t* src, const int64_t* src_offsets) {
  uint8_t* base;
  {
    std::lock_guard<std::mutex> lock(mu_);  // the chunk list may grow meanwhile; the chunk itself stays
    base = arenas_[r.column].chunks[r.chunk].base;
  }
  std::vector<Segment> segs;
  segs.reserve(r.rows.size());
  for (size_t i = 0; i < r.rows.size(); ++i) {
    if (r.nbytes[i] > 0)
      segs.push_back({base + in_chunk(r.dst_offsets[i]), src + src_offsets[i], static_cast<size_t>(r.nbytes[i])});
  }
  copy_segments(std::move(segs));
}

void Warehouse::commit(const Reservation& r) {
  std::lock_guard<std::mutex> lock(mu_);
  Arena& a = arenas_[r.column];
  const bool ragged = columns_[r.column].ragged;
  const int64_t item = static_cast<int64_t>(columns_[r.column].item_bytes());
  for (size_t i = 0; i < r.rows.size(); ++i) {
    int64_t local = r.rows[i] - row_begin_;
    if (a.state[local] == kRewriting) {
      // The old value's bytes go (ragged: its span; fixed: rewritten in place, same slot).
      if (ragged) release_bytes_locked(a, a.offset[local], a.length[local] * item);
      a.bytes_used += (r.lengths[i] - a.length[local]) * item;
    } else {
      ++a.rows_written;
    }
    a.offset[local] = r.dst_offsets[i];
    a.length[local] = r.lengths[i];
    a.state[local] = kWritten;
  }
}

std::vector<Reservation> Warehouse::reserve_columns(const std::vector<int>& columns, const int64_t* rows, size_t n,
                                                    const std::vector<const int64_t*>& lengths, bool overwrite) {
  MSRL_CHECK(lengths.size() == columns.size(), kInvalidArgument, "reserve: ", lengths.size(), " lengths for ",
             columns.size(), " columns");
  std::vector<Reservation> res;
  res.reserve(columns.size());
  try {
    for (size_t k = 0; k < columns.size(); ++k) res.push_back(reserve(columns[k], rows, n, lengths[k], overwrite));
  } catch (...) {
    for (const Reservation& r : res) abort(r);
    throw;
  }
  return res;
}

void Warehouse::abort(const Reservation& r) {
  std::lock_guard<std::mutex> lock(mu_);
  Arena& a = arenas_[r.column];
  for (size_t i = 0; i < r.rows.size(); ++i) {
    uint8_t& st = a.state[r.rows[i] - row_begin_];
    if (st == kRewriting) {
      st = kWritten;  // the old value stays
    } else {
      st = kEmpty;
      a.bytes_used -= r.nbytes[i];
    }
  }
  if (columns_[r.column].ragged) {
    Chunk& c = a.chunks[r.chunk];
    const int64_t span = r.arena_end - r.arena_begin;
    c.live -= span;
    if (c.top == r.arena_end) c.top = r.arena_begin;  // the last span: given back at once
    if (c.live == 0) c.top = 0;
  }
}

void Warehouse::erase(int column, const int64_t* rows, size_t n) {
  (void)arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  Arena& a = arenas_[column];
  const int64_t item = static_cast<int64_t>(columns_[column].item_bytes());
  for (size_t i = 0; i < n; ++i) {
    MSRL_CHECK(owns(rows[i]), kInvalidArgument, "erase: row ", rows[i], " is not in warehouse ", id_);
  }
  for (size_t i = 0; i < n; ++i) {
    MSRL_CHECK(a.state[rows[i] - row_begin_] != kWriting && a.state[rows[i] - row_begin_] != kRewriting,
               kInvalidArgument, "erase: column '", columns_[column].name, "': row ", rows[i],
               " is being written by a put in flight; nothing was erased");
  }
  for (size_t i = 0; i < n; ++i) {
    const int64_t local = rows[i] - row_begin_;
    uint8_t& s = a.state[local];
    if (s != kWritten) continue;
    s = kEmpty;
    --a.rows_written;
    const int64_t nb = a.length[local] * item;
    a.bytes_used -= nb;
    if (columns_[column].ragged) release_bytes_locked(a, a.offset[local], nb);
  }
  if (columns_[column].ragged) free_empty_chunks_locked(a);
}

bool Warehouse::written(int column, int64_t row) const {
  const Arena& a = arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  if (!owns(row)) return false;
  const uint8_t st = a.state[row - row_begin_];
  return st == kWritten || st == kRewriting;
}

void Warehouse::put(int column, const int64_t* rows, size_t n, const void* src, const int64_t* lengths) {
  Reservation r = reserve(column, rows, n, lengths);
  std::vector<int64_t> offs(n);
  int64_t acc = 0;
  for (size_t i = 0; i < n; ++i) {
    offs[i] = acc;
    acc += r.nbytes[i];
  }
  write(r, static_cast<const uint8_t*>(src), offs.data());
  commit(r);
}

void Warehouse::check_rows_readable(const Arena& a, int column, const int64_t* rows, size_t n) const {
  for (size_t i = 0; i < n; ++i) {
    MSRL_CHECK(owns(rows[i]), kInvalidArgument, "column '", columns_[column].name, "': row ", rows[i],
               " is not in warehouse ", id_, " rows [", row_begin_, ", ", row_begin_ + num_rows_, ")");
    const uint8_t st = a.state[rows[i] - row_begin_];
    MSRL_CHECK(st == kWritten || st == kRewriting, kInvalidArgument, "column '", columns_[column].name,
               "' is not ready for row ", rows[i], " (not put, or erased, since the last reset)");
  }
}

void Warehouse::lengths(int column, const int64_t* rows, size_t n, int64_t* out) const {
  const Arena& a = arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  check_rows_readable(a, column, rows, n);
  for (size_t i = 0; i < n; ++i) out[i] = a.length[rows[i] - row_begin_];
}

bool Warehouse::ready(int column, const int64_t* rows, size_t n) const {
  const Arena& a = arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) {
    if (!owns(rows[i])) return false;
    const uint8_t st = a.state[rows[i] - row_begin_];
    if (st != kWritten && st != kRewriting) return false;
  }
  return true;
}

void Warehouse::views(int column, const int64_t* rows, size_t n, const uint8_t** ptrs, int64_t* lengths) const {
  const Arena& a = arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  check_rows_readable(a, column, rows, n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t local = rows[i] - row_begin_;
    ptrs[i] = row_ptr(a, local);
    lengths[i] = a.length[local];
  }
}

void Warehouse::gather(int column, const int64_t* rows, size_t n, void* dst, size_t dst_bytes) const {
  const Arena& a = arena(column);
  const size_t item = columns_[column].item_bytes();
  std::vector<Segment> segs;
  segs.reserve(n);
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_rows_readable(a, column, rows, n);
    size_t total = 0;
    for (size_t i = 0; i < n; ++i) total += static_cast<size_t>(a.length[rows[i] - row_begin_]) * item;
    MSRL_CHECK(total == dst_bytes, kInvalidArgument, "column '", columns_[column].name, "': gather of ", n,
               " rows needs ", total, " bytes, destination has ", dst_bytes);
    uint8_t* out = static_cast<uint8_t*>(dst);
    for (size_t i = 0; i < n; ++i) {
      int64_t local = rows[i] - row_begin_;
      size_t nb = static_cast<size_t>(a.length[local]) * item;
      if (nb > 0) segs.push_back({out, row_ptr(a, local), nb});
      out += nb;
    }
  }
  copy_segments(std::move(segs));  // written bytes are immutable until reset()
}

void Warehouse::gather_padded(int column, const int64_t* rows, size_t n, int64_t max_items, void* dst) const {
  const Arena& a = arena(column);
  const size_t item = columns_[column].item_bytes();
  const size_t row_stride = static_cast<size_t>(max_items) * item;
  std::vector<Segment> segs;
  uint8_t* out = static_cast<uint8_t*>(dst);
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_rows_readable(a, column, rows, n);
    for (size_t i = 0; i < n; ++i) {
      int64_t local = rows[i] - row_begin_;
      MSRL_CHECK(a.length[local] <= max_items, kInvalidArgument, "column '", columns_[column].name, "': row ", rows[i],
                 " has ", a.length[local], " items, more than the padded width ", max_items);
      size_t nb = static_cast<size_t>(a.length[local]) * item;
      if (nb > 0) segs.push_back({out + i * row_stride, row_ptr(a, local), nb});
      if (nb < row_stride) std::memset(out + i * row_stride + nb, 0, row_stride - nb);  // padding
    }
  }
  copy_segments(std::move(segs));
}

void Warehouse::locate(int column, const int64_t* rows, size_t n, int64_t* byte_offsets, int64_t* lengths) const {
  const Arena& a = arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  check_rows_readable(a, column, rows, n);
  for (size_t i = 0; i < n; ++i) {
    byte_offsets[i] = in_chunk(a.offset[rows[i] - row_begin_]);  // caller-mapped arenas have one chunk
    lengths[i] = a.length[rows[i] - row_begin_];
  }
}

int64_t Warehouse::arena_capacity(int column) const {
  const Arena& a = arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  return a.chunks[0].capacity;
}

ColumnStats Warehouse::column_stats(int column) const {
  const Arena& a = arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  ColumnStats st{a.rows_written, a.bytes_used, 0, 0};
  for (const Chunk& c : a.chunks) {
    if (c.base == nullptr && a.external) continue;
    st.arena_bytes += c.capacity;
    st.chunks += c.capacity > 0 ? 1 : 0;
  }
  return st;
}

int64_t Warehouse::bytes_held() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  const int n = num_columns();
  for (int c = 0; c < n; ++c) total += arenas_[c].bytes_used;
  return total;
}

void Warehouse::check_no_writes_locked() const {
  const int ncols = num_columns();
  for (int c = 0; c < ncols; ++c) {
    for (uint8_t st : arenas_[c].state) {
      MSRL_CHECK(st != kWriting && st != kRewriting, kInvalidArgument, "warehouse ", id_,
                 ": reset() while a put to column '", columns_[c].name, "' is in flight");
    }
  }
}

void Warehouse::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  const int ncols = num_columns();
  check_no_writes_locked();
  for (int c = 0; c < ncols; ++c) {
    Arena& a = arenas_[c];
    std::fill(a.state.begin(), a.state.end(), kEmpty);
    for (Chunk& ch : a.chunks) ch.top = ch.live = 0;
    a.cur = 0;
    a.rows_written = 0;
    a.bytes_used = 0;
    free_empty_chunks_locked(a);  // grown chunks go back
  }
}

void Warehouse::reset(const std::vector<int64_t>& keep_rows) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint8_t> keep(num_rows_, 0);
  for (int64_t row : keep_rows) {
    MSRL_CHECK(owns(row), kInvalidArgument, "warehouse ", id_, ": cannot keep row ", row, ", not in rows [", row_begin_,
               ", ", row_begin_ + num_rows_, ")");
    keep[row - row_begin_] = 1;
  }
  const int ncols = num_columns();
  check_no_writes_locked();
  // Validated: from here on nothing throws.
  for (int c = 0; c < ncols; ++c) {
    Arena& a = arenas_[c];
    const int64_t item = static_cast<int64_t>(columns_[c].item_bytes());
    std::vector<int64_t> kept;  // local rows kept and written
    for (int64_t r = 0; r < num_rows_; ++r) {
      if (keep[r] && a.state[r] == kWritten) {
        kept.push_back(r);
      } else {
        a.state[r] = kEmpty;
      }
    }
    a.rows_written = static_cast<int64_t>(kept.size());
    a.bytes_used = 0;
    for (int64_t r : kept) a.bytes_used += a.length[r] * item;
    if (!columns_[c].ragged) continue;  // fixed slots do not move
    // Compacted chunk by chunk: kept rows move to the front of their chunk, in offset order (a move never
    // overwrites bytes not yet moved).
    std::sort(kept.begin(), kept.end(), [&](int64_t x, int64_t y) { return a.offset[x] < a.offset[y]; });
    for (Chunk& ch : a.chunks) ch.top = ch.live = 0;
    for (int64_t r : kept) {
      const int k = chunk_of(a.offset[r]);
      Chunk& ch = a.chunks[k];
      const int64_t nb = a.length[r] * item;
      const int64_t off = in_chunk(a.offset[r]);
      if (nb > 0 && off != ch.top) std::memmove(ch.base + ch.top, ch.base + off, static_cast<size_t>(nb));
      a.offset[r] = (static_cast<int64_t>(k) << kChunkShift) | ch.top;
      ch.top += nb;
      ch.live += nb;
    }
    a.cur = 0;
    free_empty_chunks_locked(a);
  }
}

}  // namespace msrl::dock
