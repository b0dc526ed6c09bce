// Pinned host memory: a pool that allocates page-locked blocks once and reuses them, and RAII
// registration (zero-copy pinning) of host buffers the caller already owns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "runtime/device_runtime.h"

namespace msrl {

struct PoolStats {
  uint64_t reserved = 0;  // bytes held from the runtime (in use + cached)
  uint64_t in_use = 0;    // bytes of live blocks (by size class)
  uint64_t peak_in_use = 0;
  uint64_t cached = 0;       // bytes of free blocks kept for reuse
  uint64_t requested = 0;    // bytes asked for by live blocks (<= in_use)
  uint64_t allocations = 0;  // blocks handed out
  uint64_t cache_hits = 0;   // of which reused a cached block
  uint64_t registered = 0;   // bytes of live caller-buffer registrations
  uint64_t capacity = 0;     // 0 = unlimited
};

class PinnedPool;

// A live block of pinned memory. Returns itself to the pool when destroyed (also after close()).
class PinnedBlock {
 public:
  ~PinnedBlock();
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
  void* data() const { return data_; }
  size_t size() const { return size_; }          // bytes asked for
  size_t capacity() const { return capacity_; }  // size class

 private:
  friend class PinnedPool;
  PinnedBlock(std::shared_ptr<PinnedPool> pool, void* data, size_t size, size_t capacity)
      : pool_(std::move(pool)), data_(data), size_(size), capacity_(capacity) {}
  std::shared_ptr<PinnedPool> pool_;
  void* data_;
  size_t size_;
  size_t capacity_;
};

// A caller-owned host range pinned in place; unpinned when destroyed.
class HostRegistration {
 public:
  ~HostRegistration();
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  friend class PinnedPool;
  HostRegistration(std::shared_ptr<PinnedPool> pool, void* data, size_t size)
      : pool_(std::move(pool)), data_(data), size_(size) {}
  std::shared_ptr<PinnedPool> pool_;
  void* data_;
  size_t size_;
};

class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  // capacity: the most bytes the pool may reserve (0 = unlimited).
  static std::shared_ptr<PinnedPool> create(std::shared_ptr<DeviceRuntime> runtime, uint64_t capacity = 0);
  // Frees the cached blocks. Never throws: a runtime that fails to free (one shut down at interpreter exit,
  // before the pool's owner was collected) leaves the block to the process's end.
  ~PinnedPool();

  // Size class of a request: 4 KiB pages up to 64 KiB, powers of two up to 2 MiB, then multiples of
  // 2 MiB (at most 1/16 of the size extra), so large blocks are never rounded to a power of two.
  static size_t size_class(size_t nbytes);

  // Throws InvalidArgument for 0 bytes, OutOfMemory past capacity, Closed after close().
  std::shared_ptr<PinnedBlock> allocate(size_t nbytes);
  // `read_only`: the pages may be mapped read-only (see DeviceRuntime::host_register).
  std::shared_ptr<HostRegistration> register_buffer(void* ptr, size_t nbytes, bool read_only = false);
  void trim();   // frees cached blocks
  void close();  // frees cached blocks; later allocate/register throw Closed; live blocks stay valid
  bool closed() const;
  PoolStats stats() const;
  DeviceRuntime& runtime() const { return *runtime_; }

  // True when [ptr, ptr+nbytes) lies inside one live block or registration of any pool in the process.
  static bool is_pinned(const void* ptr, size_t nbytes);

 private:
  PinnedPool(std::shared_ptr<DeviceRuntime> runtime, uint64_t capacity);
  void release(void* data, size_t size, size_t capacity) noexcept;
  void unregister(void* data, size_t size) noexcept;
  void free_cached_locked();
  void free_block(void* data) noexcept;  // host_free_pinned, errors swallowed (destructors only)
  friend class PinnedBlock;
  friend class HostRegistration;

  std::shared_ptr<DeviceRuntime> runtime_;
  mutable std::mutex mu_;
  std::multimap<size_t, void*> cache_;  // size class -> free block
  PoolStats stats_;
  bool closed_ = false;
};

}  // namespace msrl
