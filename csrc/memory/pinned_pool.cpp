#include "memory/pinned_pool.h"

#include <algorithm>

#include "common/error.h"

namespace msrl {

namespace {

// Every live block and registration of every pool, for PinnedPool::is_pinned. Keyed by begin address.
std::mutex g_pinned_mu;
std::map<uintptr_t, size_t> g_pinned;

void track(void* ptr, size_t nbytes) {
  std::lock_guard<std::mutex> lock(g_pinned_mu);
  g_pinned[reinterpret_cast<uintptr_t>(ptr)] = nbytes;
}
void untrack(void* ptr) {
  std::lock_guard<std::mutex> lock(g_pinned_mu);
  g_pinned.erase(reinterpret_cast<uintptr_t>(ptr));
}

}  // namespace

bool PinnedPool::is_pinned(const void* ptr, size_t nbytes) {
  auto begin = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(g_pinned_mu);
  auto it = g_pinned.upper_bound(begin);
  if (it == g_pinned.begin()) return false;
  --it;
  return begin >= it->first && begin + nbytes <= it->first + it->second;
}

PinnedBlock::~PinnedBlock() { pool_->release(data_, size_, capacity_); }

HostRegistration::~HostRegistration() { pool_->unregister(data_, size_); }

PinnedPool::PinnedPool(std::shared_ptr<DeviceRuntime> runtime, uint64_t capacity) : runtime_(std::move(runtime)) {
  stats_.capacity = capacity;
}

std::shared_ptr<PinnedPool> PinnedPool::create(std::shared_ptr<DeviceRuntime> runtime, uint64_t capacity) {
  MSRL_CHECK(runtime != nullptr, kInvalidArgument, "runtime is null");
  return std::shared_ptr<PinnedPool>(new PinnedPool(std::move(runtime), capacity));
}

PinnedPool::~PinnedPool() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [cls, data] : cache_) free_block(data);
  cache_.clear();
}

void PinnedPool::free_block(void* data) noexcept {
  try {
    runtime_->host_free_pinned(data);
  } catch (const std::exception&) {
    // Called from destructors: the runtime may be gone (torch_npu finalises ACL in an atexit hook before
    // module globals are collected). The memory goes back with the process.
  }
}

size_t PinnedPool::size_class(size_t nbytes) {
  constexpr size_t kPage = 4096, kSmall = 64 << 10, kHuge = 2 << 20;
  if (nbytes <= kSmall) return (nbytes + kPage - 1) / kPage * kPage;
  if (nbytes <= kHuge) {
    size_t c = kSmall;
    while (c < nbytes) c <<= 1;
    return c;
  }
  // Granule: 2 MiB, or 1/16 of the size rounded down to a power of two, whichever is larger.
  size_t granule = kHuge;
  while (granule * 32 <= nbytes) granule <<= 1;
  return (nbytes + granule - 1) / granule * granule;
}

std::shared_ptr<PinnedBlock> PinnedPool::allocate(size_t nbytes) {
  MSRL_CHECK(nbytes > 0, kInvalidArgument, "pinned allocation size must be > 0, got 0");
  MSRL_CHECK(nbytes < (uint64_t{1} << 48), kInvalidArgument, "pinned allocation size ", nbytes,
             " is negative or absurdly large");
  size_t cls = size_class(nbytes);
  void* data = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    MSRL_CHECK(!closed_, kClosed, "pinned pool is closed; cannot allocate ", nbytes, " bytes");
    auto it = cache_.find(cls);
    if (it != cache_.end()) {
      data = it->second;
      cache_.erase(it);
      stats_.cached -= cls;
      ++stats_.cache_hits;
    } else {
      if (stats_.capacity != 0 && stats_.reserved + cls > stats_.capacity) free_cached_locked();
      MSRL_CHECK(stats_.capacity == 0 || stats_.reserved + cls <= stats_.capacity, kOutOfMemory,
                 "pinned pool capacity ", stats_.capacity, " bytes exceeded: ", stats_.in_use, " in use, request of ",
                 nbytes, " bytes (size class ", cls, ")");
      stats_.reserved += cls;  // reserve before the (slow) runtime call, outside the lock
    }
    stats_.in_use += cls;
    stats_.requested += nbytes;
    stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
    ++stats_.allocations;
  }
  if (data == nullptr) {
    try {
      data = runtime_->host_alloc_pinned(cls);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.reserved -= cls;
      stats_.in_use -= cls;
      stats_.requested -= nbytes;
      --stats_.allocations;
      throw;
    }
  }
  track(data, cls);
  return std::shared_ptr<PinnedBlock>(new PinnedBlock(shared_from_this(), data, nbytes, cls));
}

void PinnedPool::release(void* data, size_t size, size_t cls) noexcept {
  untrack(data);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.in_use -= cls;
  stats_.requested -= size;
  if (closed_) {
    stats_.reserved -= cls;
    free_block(data);
    return;
  }
  cache_.emplace(cls, data);
  stats_.cached += cls;
}

std::shared_ptr<HostRegistration> PinnedPool::register_buffer(void* ptr, size_t nbytes, bool read_only) {
  MSRL_CHECK(ptr != nullptr, kInvalidArgument, "cannot register a null pointer");
  MSRL_CHECK(nbytes > 0, kInvalidArgument, "cannot register 0 bytes at ", ptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    MSRL_CHECK(!closed_, kClosed, "pinned pool is closed; cannot register ", nbytes, " bytes at ", ptr);
  }
  runtime_->host_register(ptr, nbytes, read_only);
  track(ptr, nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.registered += nbytes;
  return std::shared_ptr<HostRegistration>(new HostRegistration(shared_from_this(), ptr, nbytes));
}

void PinnedPool::unregister(void* data, size_t size) noexcept {
  untrack(data);
  try {
    runtime_->host_unregister(data);
  } catch (const std::exception&) {
    // A destructor must not throw; the range is no longer ours either way.
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.registered -= size;
}

// Each block leaves the cache (and the accounting) before its free, so a free that throws leaves no freed
// block behind in the cache.
void PinnedPool::free_cached_locked() {
  while (!cache_.empty()) {
    auto [cls, data] = *cache_.begin();
    cache_.erase(cache_.begin());
    stats_.cached -= cls;
    stats_.reserved -= cls;
    runtime_->host_free_pinned(data);
  }
}

void PinnedPool::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  free_cached_locked();
}

void PinnedPool::close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  free_cached_locked();
}

bool PinnedPool::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

PoolStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace msrl
