// Warehouse: columnar storage for a contiguous range of dock rows (whole prompt groups).
//
// Per column one arena: fixed-shape columns hold one slot per row; ragged columns hold the rows'
// values packed back to back (bump allocation, no padding) with an offset and a length per row.
// Bytes are immutable from commit until reset(), so readers copy them without holding the lock.
// A put is reserve -> write -> commit: reserve validates everything (rows in range, not yet
// written, arena space) and changes nothing when it fails.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/thread_pool.h"

namespace msrl::dock {

enum class DType : int { kBool = 0, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kUInt8 };
// The one dtype table of the dock (both backends; Python builds its own names and storage from it).
struct DTypeInfo {
  DType code;
  const char* name;
  size_t size;
};
const std::vector<DTypeInfo>& dtype_table();
size_t dtype_size(DType d);
const char* dtype_name(DType d);
DType parse_dtype(const std::string& name);  // kInvalidArgument naming the allowed ones

struct ColumnSpec {
  std::string name;
  DType dtype = DType::kFloat32;
  bool ragged = false;
  // Fixed columns: the per-row shape. Ragged columns: the shape after the ragged first dim.
  std::vector<int64_t> inner_shape;
  // Ragged columns only: arena bytes per warehouse (0 = capacity rows x max_items items).
  int64_t arena_bytes = 0;

  size_t item_bytes() const;  // bytes of one row (fixed) or of one item along the ragged dim
};

// One column's pending write into one warehouse.
struct Reservation {
  int column = -1;
  std::vector<int64_t> rows;               // global row ids, all in this warehouse
  std::vector<int64_t> dst_offsets;        // byte offset of each row in the column arena
  std::vector<int64_t> nbytes;             // bytes of each row
  std::vector<int64_t> lengths;            // items per row (ragged) or 1 (fixed)
  int64_t arena_begin = 0, arena_end = 0;  // ragged: reserved span
};

struct ColumnStats {
  int64_t rows_written = 0;
  int64_t bytes_used = 0;   // bytes of committed + reserved values
  int64_t arena_bytes = 0;  // reserved arena capacity
};

// Copies of (dst, src, nbytes) segments: the shared implementation of common/thread_pool.h.
using ::msrl::copy_segments;
using ::msrl::Segment;

class Warehouse {
 public:
  // external_arenas: optional caller-owned memory per column (e.g. a shared-memory mapping other
  // processes read), arena_capacity(c) bytes each; it must outlive the warehouse.
  Warehouse(int id, int64_t row_begin, int64_t num_rows, std::vector<ColumnSpec> columns,
            std::vector<uint8_t*> external_arenas = {});
  Warehouse(const Warehouse&) = delete;
  Warehouse& operator=(const Warehouse&) = delete;

  int id() const { return id_; }
  int64_t row_begin() const { return row_begin_; }
  int64_t num_rows() const { return num_rows_; }
  bool owns(int64_t row) const { return row >= row_begin_ && row < row_begin_ + num_rows_; }
  const std::vector<ColumnSpec>& columns() const { return columns_; }
  int column_index(const std::string& name) const;  // throws NotFound

  // Validates and reserves space; throws (state unchanged) on a row out of range, a row already
  // written, a negative length or an arena overflow (OutOfMemory naming column and bytes).
  // lengths: items per row for ragged columns, ignored (may be null) for fixed ones.
  Reservation reserve(int column, const int64_t* rows, size_t n, const int64_t* lengths);
  // The same rows in several columns, all or none: on an error every reservation made is aborted.
  // lengths[k]: items per row of columns[k] (null for a fixed column).
  std::vector<Reservation> reserve_columns(const std::vector<int>& columns, const int64_t* rows, size_t n,
                                           const std::vector<const int64_t*>& lengths);
  // Copies row i's bytes from src + src_offsets[i]; no lock held (rows are reserved to the caller).
  void write(const Reservation& r, const uint8_t* src, const int64_t* src_offsets);
  void commit(const Reservation& r);  // rows become readable
  void abort(const Reservation& r);   // rows become writable again
  // Forgets written rows of a column (undoes a committed put whose sibling put failed elsewhere).
  // Rows not written are ignored; arena space is reclaimed only at reset().
  void erase(int column, const int64_t* rows, size_t n);
  // reserve + write + commit with the source packed in row order.
  void put(int column, const int64_t* rows, size_t n, const void* src, const int64_t* lengths);

  // Items per row (1 for fixed columns); throws InvalidArgument when a row is not written.
  void lengths(int column, const int64_t* rows, size_t n, int64_t* out) const;
  // Pointers to each row's bytes and its item count, valid until reset() (bytes are immutable once
  // written). Throws InvalidArgument when a row is not written.
  void views(int column, const int64_t* rows, size_t n, const uint8_t** ptrs, int64_t* lengths) const;
  // Copies the rows packed in the given order into dst (dst_bytes must equal their total size).
  void gather(int column, const int64_t* rows, size_t n, void* dst, size_t dst_bytes) const;
  // Copies the rows padded: dst is [n, max_items, inner...], the tail of each row zero-filled.
  void gather_padded(int column, const int64_t* rows, size_t n, int64_t max_items, void* dst) const;
  // True when every row is written for the column.
  bool ready(int column, const int64_t* rows, size_t n) const;

  // Byte offsets of each row inside the column arena and its item count (readiness checked), for
  // readers that map the arena themselves.
  void locate(int column, const int64_t* rows, size_t n, int64_t* byte_offsets, int64_t* lengths) const;
  // Bytes of a column's arena: rows x row bytes (fixed) or arena_bytes (ragged).
  int64_t arena_capacity(int column) const;

  ColumnStats column_stats(int column) const;
  int64_t bytes_held() const;  // committed + reserved value bytes over all columns
  void reset();                // forget every row (arenas are kept for reuse)
  // Partial reset: forgets every row except keep_rows (global ids in this warehouse), whose written
  // columns stay readable. Ragged arenas are compacted: kept rows' bytes move to the front of the
  // arena (in offset order, so a move never overwrites bytes not yet moved) and their offsets are
  // updated; the rest of the arena is free again. Throws (nothing changed) on a row not in this
  // warehouse or while a put is in flight. Views handed out before are invalid afterwards.
  void reset(const std::vector<int64_t>& keep_rows);

 private:
  enum : uint8_t { kEmpty = 0, kWriting = 1, kWritten = 2 };
  struct Arena {
    std::unique_ptr<uint8_t[]> owned;  // allocated lazily: pages are touched only when written
    uint8_t* base = nullptr;           // owned.get() or caller-provided memory (e.g. shared memory)
    int64_t capacity = 0;
    int64_t top = 0;              // ragged: bump pointer
    std::vector<uint8_t> state;   // per row
    std::vector<int64_t> offset;  // per row, bytes
    std::vector<int64_t> length;  // per row, items
    int64_t rows_written = 0;
    int64_t bytes_used = 0;
  };
  const Arena& arena(int column) const;
  void check_rows_readable(const Arena& a, int column, const int64_t* rows, size_t n) const;

  int id_;
  int64_t row_begin_;
  int64_t num_rows_;
  std::vector<ColumnSpec> columns_;
  mutable std::mutex mu_;
  std::vector<Arena> arenas_;
};

}  // namespace msrl::dock
