// Warehouse: columnar storage for a contiguous range of dock rows (whole prompt groups).
//
// Per column one arena: fixed-shape columns hold one slot per row; ragged columns hold the rows'
// values packed back to back (bump allocation, no padding) with an offset and a length per row.
// A ragged arena is a list of chunks: the first is the configured arena (or caller-provided memory);
// when a put does not fit, an owned arena grows by another chunk (at least the configured size) instead
// of failing, and a chunk whose rows are all erased is reused (the first) or freed (the others), so
// memory comes back after erase() and reset(). Caller-provided arenas do not grow.
// Readers copy committed bytes without holding the lock; the owner (DockCore) guarantees no copy is in
// flight while bytes are freed or rewritten in place (erase, overwrite, reset).
// A put is reserve -> write -> commit: reserve validates everything (rows in range, not yet
// written unless overwriting, arena space) and changes nothing when it fails.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
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
  // The caller's name of the type when it differs from the stored one (e.g. "object": encoded values
  // stored as uint8 rows); part of the column's identity for declare_column.
  std::string label = {};
  // Ragged, owned arenas: grow by chunks (at least arena_bytes each) when full; false: arena_bytes is a
  // stated upper bound.
  bool growable = false;
  // false: a name a stage reads, not declared yet (its type comes with its first put: declare_column).
  bool declared = true;

  size_t item_bytes() const;  // bytes of one row (fixed) or of one item along the ragged dim
};

// One column's pending write into one warehouse.
struct Reservation {
  int column = -1;
  std::vector<int64_t> rows;               // global row ids, all in this warehouse
  std::vector<int64_t> dst_offsets;        // byte offset of each row in the column arena
  std::vector<int64_t> nbytes;             // bytes of each row
  std::vector<int64_t> lengths;            // items per row (ragged) or 1 (fixed)
  int64_t arena_begin = 0, arena_end = 0;  // ragged: reserved span (in chunk `chunk`)
  int chunk = 0;
  bool overwrite = false;  // rows already written keep their old bytes readable until commit
};

struct ColumnStats {
  int64_t rows_written = 0;
  int64_t bytes_used = 0;   // bytes of committed + reserved values
  int64_t arena_bytes = 0;  // reserved arena capacity (all chunks)
  int64_t chunks = 0;       // ragged: chunks holding memory
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

  static constexpr int kMaxColumns = 1024;
  int num_columns() const { return ncols_.load(std::memory_order_acquire); }
  // A column declared at run time (ids are dense: the new one is num_columns()). Thread-safe.
  // external: caller-owned memory for the arena (arena bytes of the column; it must outlive the
  // warehouse; it does not grow), or null.
  int add_column(const ColumnSpec& spec, uint8_t* external = nullptr);
  // Gives an undeclared column (a placeholder nothing was written to) its type.
  void set_column(int column, const ColumnSpec& spec, uint8_t* external = nullptr);
  bool declared(int column) const;
  // Moves a ragged column's caller-provided arena to caller memory of `capacity` bytes holding the same
  // bytes at the same offsets (the same shared-memory file mapped again after the caller grew or shrank
  // it): puts may use all of it. Refuses (nothing changed) a fixed or owned arena, or a capacity below
  // the bytes in use (the span up to the bump pointer). Readers that copy from the old address without
  // the lock rely on the caller keeping the old memory mapped.
  void resize_external(int column, uint8_t* base, int64_t capacity);

  // Validates and reserves space; throws (state unchanged) on a row out of range, a row already
  // written (unless overwrite: its old bytes stay readable until commit), a negative length or an arena
  // that cannot grow (OutOfMemory naming column and bytes).
  // lengths: items per row for ragged columns, ignored (may be null) for fixed ones.
  Reservation reserve(int column, const int64_t* rows, size_t n, const int64_t* lengths, bool overwrite = false);
  // The same rows in several columns, all or none: on an error every reservation made is aborted.
  // lengths[k]: items per row of columns[k] (null for a fixed column).
  std::vector<Reservation> reserve_columns(const std::vector<int>& columns, const int64_t* rows, size_t n,
                                           const std::vector<const int64_t*>& lengths, bool overwrite = false);
  // The largest row a put may store in the column (bytes): the arena for caller-provided memory,
  // otherwise a bound that growth honours.
  int64_t max_row_bytes(int column) const;
  static constexpr int64_t kMaxChunkBytes = int64_t{1} << 40;
  // Copies row i's bytes from src + src_offsets[i]; no lock held (rows are reserved to the caller).
  void write(const Reservation& r, const uint8_t* src, const int64_t* src_offsets);
  void commit(const Reservation& r);  // rows become readable
  void abort(const Reservation& r);   // rows become writable again
  // Forgets written rows of a column (erase by key, or undoing a committed put whose sibling failed).
  // Rows not written are ignored. Their bytes are free at once: a chunk left empty is reused or freed.
  void erase(int column, const int64_t* rows, size_t n);
  // True when the row's column is written.
  bool written(int column, int64_t row) const;
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
  // kRewriting: written and readable, an overwrite of it is reserved.
  enum : uint8_t { kEmpty = 0, kWriting = 1, kWritten = 2, kRewriting = 3 };
  struct Chunk {
    std::unique_ptr<uint8_t[]> owned;  // allocated lazily: pages are touched only when written
    uint8_t* base = nullptr;           // owned.get() or caller-provided memory (e.g. shared memory)
    int64_t capacity = 0;
    int64_t top = 0;   // bump pointer
    int64_t live = 0;  // bytes of rows (reserved or written) in this chunk
  };
  struct Arena {
    std::vector<Chunk> chunks;    // fixed columns: one; ragged: grows (offsets carry the chunk index)
    bool external = false;        // caller-provided memory: no growth
    int cur = 0;                  // the chunk new spans go to first
    std::vector<uint8_t> state;   // per row
    std::vector<int64_t> offset;  // per row, bytes: chunk << kChunkShift | offset in the chunk
    std::vector<int64_t> length;  // per row, items
    int64_t rows_written = 0;
    int64_t bytes_used = 0;
  };
  static constexpr int kChunkShift = 40;
  static int chunk_of(int64_t off) { return static_cast<int>(off >> kChunkShift); }
  static int64_t in_chunk(int64_t off) { return off & ((int64_t{1} << kChunkShift) - 1); }
  const uint8_t* row_ptr(const Arena& a, int64_t local) const;
  const Arena& arena(int column) const;
  void check_rows_readable(const Arena& a, int column, const int64_t* rows, size_t n) const;
  void init_arena(Arena& a, const ColumnSpec& spec, uint8_t* external);
  // Finds room for `total` bytes (mu_ held): a chunk index and the span's start; grows when allowed.
  std::pair<int, int64_t> place_locked(Arena& a, const ColumnSpec& spec, int64_t total);
  void release_bytes_locked(Arena& a, int64_t off, int64_t nbytes);  // frees a row's span
  void free_empty_chunks_locked(Arena& a);
  void check_no_writes_locked() const;  // reset: InvalidArgument while a put is in flight

  int id_;
  int64_t row_begin_;
  int64_t num_rows_;
  std::vector<ColumnSpec> columns_;  // reserved to kMaxColumns: never reallocated (readers index it)
  std::atomic<int> ncols_{0};
  mutable std::mutex mu_;
  std::vector<Arena> arenas_;  // reserved to kMaxColumns
};

}  // namespace msrl::dock
