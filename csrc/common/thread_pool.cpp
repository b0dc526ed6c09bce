#include "common/thread_pool.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace msrl {

ThreadPool::ThreadPool(size_t threads) {
  for (size_t i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    while (job_ != nullptr && next_ < total_) {
      size_t i = next_++;
      const auto* job = job_;
      lock.unlock();
      try {
        (*job)(i);
      } catch (...) {
        lock.lock();
        if (!error_) error_ = std::current_exception();
        lock.unlock();
      }
      lock.lock();
      if (++finished_ == total_) done_cv_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (n == 1 || workers_.empty()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> run(run_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  job_ = &fn;
  next_ = 0;
  total_ = n;
  finished_ = 0;
  error_ = nullptr;
  ++generation_;
  cv_.notify_all();
  while (next_ < total_) {
    size_t i = next_++;
    lock.unlock();
    try {
      fn(i);
    } catch (...) {
      lock.lock();
      if (!error_) error_ = std::current_exception();
      lock.unlock();
    }
    lock.lock();
    ++finished_;
  }
  done_cv_.wait(lock, [&] { return finished_ == total_; });
  job_ = nullptr;
  auto error = error_;
  error_ = nullptr;
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

ThreadPool& ThreadPool::shared() {
  // MSRL_COPY_THREADS overrides the size: with one process per device on a node, each process may want
  // only its share of the cores.
  static ThreadPool pool([] {
    size_t n = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
    if (const char* env = std::getenv("MSRL_COPY_THREADS")) {
      long v = std::strtol(env, nullptr, 10);
      if (v >= 1 && v <= 256) n = static_cast<size_t>(v);
    }
    return n;
  }());
  return pool;
}

void parallel_memcpy(void* dst, const void* src, size_t nbytes) {
  constexpr size_t kMinPiece = 4u << 20;  // below this, threads cost more than they give
  auto& pool = ThreadPool::shared();
  size_t pieces = std::min(pool.size(), std::max<size_t>(1, nbytes / kMinPiece));
  if (pieces <= 1) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  size_t piece = (nbytes / pieces + 63) & ~size_t{63};
  pool.parallel_for(pieces, [&](size_t i) {
    size_t begin = i * piece;
    if (begin >= nbytes) return;
    size_t len = std::min(piece, nbytes - begin);
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, len);
  });
}

void copy_segments(std::vector<Segment> segs) {
  constexpr size_t kParallelBytes = 1u << 20;  // below this a copy stays on the calling thread
  if (segs.empty()) return;
  std::vector<Segment> merged;
  merged.reserve(segs.size());
  size_t total = 0;
  for (const Segment& s : segs) {
    total += s.nbytes;
    if (!merged.empty()) {
      Segment& b = merged.back();
      if (b.dst + b.nbytes == s.dst && b.src + b.nbytes == s.src) {
        b.nbytes += s.nbytes;
        continue;
      }
    }
    merged.push_back(s);
  }
  if (total < kParallelBytes) {
    for (const Segment& s : merged) std::memcpy(s.dst, s.src, s.nbytes);
    return;
  }
  if (merged.size() == 1) {
    parallel_memcpy(merged[0].dst, merged[0].src, merged[0].nbytes);
    return;
  }
  // Many segments: split into roughly equal byte chunks across the pool.
  size_t parts = std::max<size_t>(1, std::min(ThreadPool::shared().size() * 2, merged.size()));
  size_t per = (total + parts - 1) / parts;
  std::vector<size_t> starts{0};
  size_t acc = 0;
  for (size_t i = 0; i < merged.size(); ++i) {
    acc += merged[i].nbytes;
    if (acc >= per && i + 1 < merged.size()) {
      starts.push_back(i + 1);
      acc = 0;
    }
  }
  starts.push_back(merged.size());
  ThreadPool::shared().parallel_for(starts.size() - 1, [&](size_t k) {
    for (size_t i = starts[k]; i < starts[k + 1]; ++i) std::memcpy(merged[i].dst, merged[i].src, merged[i].nbytes);
  });
}

}  // namespace msrl
