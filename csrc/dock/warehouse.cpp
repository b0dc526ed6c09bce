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
    : id_(id), row_begin_(row_begin), num_rows_(num_rows), columns_(std::move(columns)) {
  MSRL_CHECK(external_arenas.empty() || external_arenas.size() == columns_.size(), kInvalidArgument, "warehouse ", id,
             ": ", external_arenas.size(), " external arenas for ", columns_.size(), " columns");
  MSRL_CHECK(num_rows > 0, kInvalidArgument, "warehouse ", id, ": num_rows must be > 0, got ", num_rows);
  MSRL_CHECK(row_begin >= 0, kInvalidArgument, "warehouse ", id, ": row_begin must be >= 0, got ", row_begin);
  MSRL_CHECK(!columns_.empty(), kInvalidArgument, "warehouse ", id, ": needs at least one column");
  arenas_.resize(columns_.size());
  for (size_t c = 0; c < columns_.size(); ++c) {
    const ColumnSpec& spec = columns_[c];
    for (size_t j = 0; j < c; ++j) {
      MSRL_CHECK(columns_[j].name != spec.name, kInvalidArgument, "duplicate column name '", spec.name, "'");
    }
    for (int64_t d : spec.inner_shape) {
      MSRL_CHECK(d > 0, kInvalidArgument, "column '", spec.name, "': shape dims must be > 0, got ", d);
    }
    Arena& a = arenas_[c];
    if (spec.ragged) {
      MSRL_CHECK(spec.arena_bytes > 0, kInvalidArgument, "ragged column '", spec.name,
                 "': arena_bytes must be > 0, got ", spec.arena_bytes);
      a.capacity = spec.arena_bytes;
    } else {
      a.capacity = num_rows * static_cast<int64_t>(spec.item_bytes());
    }
    if (!external_arenas.empty()) {
      MSRL_CHECK(external_arenas[c] != nullptr || a.capacity == 0, kInvalidArgument, "column '", spec.name,
                 "': external arena is null");
      a.base = external_arenas[c];
    }
    a.state.assign(num_rows, kEmpty);
    a.offset.assign(num_rows, 0);
    a.length.assign(num_rows, 0);
  }
}

int Warehouse::column_index(const std::string& name) const {
  for (size_t c = 0; c < columns_.size(); ++c)
    if (columns_[c].name == name) return static_cast<int>(c);
  MSRL_THROW(kNotFound, "unknown column '", name, "'");
}

const Warehouse::Arena& Warehouse::arena(int column) const {
  MSRL_CHECK(column >= 0 && column < static_cast<int>(columns_.size()), kNotFound, "column index ", column,
             " out of range [0, ", columns_.size(), ")");
  return arenas_[column];
}

Reservation Warehouse::reserve(int column, const int64_t* rows, size_t n, const int64_t* lengths) {
  (void)arena(column);
  const ColumnSpec& spec = columns_[column];
  const int64_t item = static_cast<int64_t>(spec.item_bytes());
  Reservation r;
  r.column = column;
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
      // Bounded by the arena before multiplying: a huge length must not wrap the byte count.
      MSRL_CHECK(item == 0 || len <= arena_capacity(column) / item, kOutOfMemory, "column '", spec.name, "': row ",
                 rows[i], " has ", len, " items, more than its arena holds (", arena_capacity(column), " bytes)");
    }
    r.lengths[i] = len;
    r.nbytes[i] = len * item;
    total += r.nbytes[i];
  }
  std::lock_guard<std::mutex> lock(mu_);
  Arena& a = arenas_[column];
  for (size_t i = 0; i < n; ++i) {
    int64_t local = rows[i] - row_begin_;
    MSRL_CHECK(a.state[local] == kEmpty, kInvalidArgument, "column '", spec.name, "': row ", rows[i],
               a.state[local] == kWriting ? " is being written by another put" : " is already written",
               " (a row is written once per iteration; reset() clears it)");
  }
  // Duplicates: mark rows one by one; a row seen twice is undone before throwing.
  for (size_t i = 0; i < n; ++i) {
    int64_t local = rows[i] - row_begin_;
    if (a.state[local] != kEmpty) {
      for (size_t j = 0; j < i; ++j) a.state[rows[j] - row_begin_] = kEmpty;
      MSRL_THROW(kInvalidArgument, "column '", spec.name, "': row ", rows[i], " appears twice in one put");
    }
    a.state[local] = kWriting;
  }
  if (spec.ragged && a.top + total > a.capacity) {
    for (size_t i = 0; i < n; ++i) a.state[rows[i] - row_begin_] = kEmpty;
    MSRL_THROW(kOutOfMemory, "column '", spec.name, "' in warehouse ", id_, ": put of ", total, " bytes does not fit (",
               a.capacity - a.top, " of ", a.capacity, " arena bytes free); raise the column's max_bytes or reset()");
  }
  if (a.base == nullptr && a.capacity > 0) {
    a.owned.reset(new (std::nothrow) uint8_t[a.capacity]);
    a.base = a.owned.get();
    if (a.base == nullptr) {
      for (size_t i = 0; i < n; ++i) a.state[rows[i] - row_begin_] = kEmpty;
      MSRL_THROW(kOutOfMemory, "column '", spec.name, "': cannot allocate ", a.capacity, " arena bytes");
    }
  }
  r.arena_begin = a.top;
  for (size_t i = 0; i < n; ++i) {
    int64_t local = rows[i] - row_begin_;
    if (spec.ragged) {
      r.dst_offsets[i] = a.top;
      a.top += r.nbytes[i];
    } else {
      r.dst_offsets[i] = local * item;
    }
  }
  r.arena_end = a.top;
  a.bytes_used += total;
  return r;
}

void Warehouse::write(const Reservation& r, const uint8_t* src, const int64_t* src_offsets) {
  uint8_t* base = arenas_[r.column].base;  // set by reserve, stable until destruction
  std::vector<Segment> segs;
  segs.reserve(r.rows.size());
  for (size_t i = 0; i < r.rows.size(); ++i) {
    if (r.nbytes[i] > 0)
      segs.push_back({base + r.dst_offsets[i], src + src_offsets[i], static_cast<size_t>(r.nbytes[i])});
  }
  copy_segments(std::move(segs));
}

void Warehouse::commit(const Reservation& r) {
  std::lock_guard<std::mutex> lock(mu_);
  Arena& a = arenas_[r.column];
  for (size_t i = 0; i < r.rows.size(); ++i) {
    int64_t local = r.rows[i] - row_begin_;
    a.offset[local] = r.dst_offsets[i];
    a.length[local] = r.lengths[i];
    a.state[local] = kWritten;
  }
  a.rows_written += static_cast<int64_t>(r.rows.size());
}

std::vector<Reservation> Warehouse::reserve_columns(const std::vector<int>& columns, const int64_t* rows, size_t n,
                                                    const std::vector<const int64_t*>& lengths) {
  MSRL_CHECK(lengths.size() == columns.size(), kInvalidArgument, "reserve: ", lengths.size(), " lengths for ",
             columns.size(), " columns");
  std::vector<Reservation> res;
  res.reserve(columns.size());
  try {
    for (size_t k = 0; k < columns.size(); ++k) res.push_back(reserve(columns[k], rows, n, lengths[k]));
  } catch (...) {
    for (const Reservation& r : res) abort(r);
    throw;
  }
  return res;
}

void Warehouse::abort(const Reservation& r) {
  std::lock_guard<std::mutex> lock(mu_);
  Arena& a = arenas_[r.column];
  for (int64_t row : r.rows) a.state[row - row_begin_] = kEmpty;
  // Give the span back when it is still the last one; otherwise it stays unused until reset().
  if (columns_[r.column].ragged && a.top == r.arena_end) {
    a.top = r.arena_begin;
    a.bytes_used -= r.arena_end - r.arena_begin;
  } else if (!columns_[r.column].ragged) {
    a.bytes_used -= static_cast<int64_t>(r.rows.size()) * static_cast<int64_t>(columns_[r.column].item_bytes());
  }
}

void Warehouse::erase(int column, const int64_t* rows, size_t n) {
  (void)arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  Arena& a = arenas_[column];
  for (size_t i = 0; i < n; ++i) {
    MSRL_CHECK(owns(rows[i]), kInvalidArgument, "erase: row ", rows[i], " is not in warehouse ", id_);
  }
  for (size_t i = 0; i < n; ++i) {
    uint8_t& s = a.state[rows[i] - row_begin_];
    if (s != kWritten) continue;
    s = kEmpty;
    --a.rows_written;
    a.bytes_used -= a.length[rows[i] - row_begin_] * static_cast<int64_t>(columns_[column].item_bytes());
  }
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
    MSRL_CHECK(a.state[rows[i] - row_begin_] == kWritten, kInvalidArgument, "column '", columns_[column].name,
               "' is not ready for row ", rows[i], " (never put since the last reset)");
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
    if (!owns(rows[i]) || a.state[rows[i] - row_begin_] != kWritten) return false;
  }
  return true;
}

void Warehouse::views(int column, const int64_t* rows, size_t n, const uint8_t** ptrs, int64_t* lengths) const {
  const Arena& a = arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  check_rows_readable(a, column, rows, n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t local = rows[i] - row_begin_;
    ptrs[i] = a.base + a.offset[local];
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
      if (nb > 0) segs.push_back({out, a.base + a.offset[local], nb});
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
      if (nb > 0) segs.push_back({out + i * row_stride, a.base + a.offset[local], nb});
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
    byte_offsets[i] = a.offset[rows[i] - row_begin_];
    lengths[i] = a.length[rows[i] - row_begin_];
  }
}

int64_t Warehouse::arena_capacity(int column) const { return arena(column).capacity; }

ColumnStats Warehouse::column_stats(int column) const {
  const Arena& a = arena(column);
  std::lock_guard<std::mutex> lock(mu_);
  return ColumnStats{a.rows_written, a.bytes_used, a.capacity};
}

int64_t Warehouse::bytes_held() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const Arena& a : arenas_) total += a.bytes_used;
  return total;
}

void Warehouse::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t c = 0; c < arenas_.size(); ++c) {
    Arena& a = arenas_[c];
    for (uint8_t s : a.state) {
      MSRL_CHECK(s != kWriting, kInvalidArgument, "warehouse ", id_, ": reset() while a put to column '",
                 columns_[c].name, "' is in flight");
    }
  }
  for (Arena& a : arenas_) {
    std::fill(a.state.begin(), a.state.end(), kEmpty);
    a.top = 0;
    a.rows_written = 0;
    a.bytes_used = 0;
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
  for (size_t c = 0; c < arenas_.size(); ++c) {
    for (uint8_t s : arenas_[c].state) {
      MSRL_CHECK(s != kWriting, kInvalidArgument, "warehouse ", id_, ": reset() while a put to column '",
                 columns_[c].name, "' is in flight");
    }
  }
  // Validated: from here on nothing throws.
  for (size_t c = 0; c < arenas_.size(); ++c) {
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
    std::sort(kept.begin(), kept.end(), [&](int64_t x, int64_t y) { return a.offset[x] < a.offset[y]; });
    int64_t top = 0;
    for (int64_t r : kept) {
      const int64_t nb = a.length[r] * item;
      if (nb > 0 && a.offset[r] != top) std::memmove(a.base + top, a.base + a.offset[r], static_cast<size_t>(nb));
      a.offset[r] = top;
      top += nb;
    }
    a.top = top;
  }
}

}  // namespace msrl::dock
