// A small fixed pool for splitting large host copies across cores.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace msrl {

class ThreadPool {
 public:
  explicit ThreadPool(size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size() + 1; }
  // Runs fn(i) for i in [0, n) on the pool and the calling thread; returns when all are done.
  // The first exception thrown by any fn is rethrown here.
  void parallel_for(size_t n, const std::function<void(size_t)>& fn);

  // The process-wide pool used by host copies: hardware threads, at most 8, or MSRL_COPY_THREADS.
  static ThreadPool& shared();

 private:
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t next_ = 0;
  size_t total_ = 0;
  size_t finished_ = 0;
  uint64_t generation_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::mutex run_mu_;  // one parallel_for at a time
};

// memcpy split into pieces of at least 4 MiB, run on the shared pool.
void parallel_memcpy(void* dst, const void* src, size_t nbytes);

// Many independent copies: pieces that continue one another are merged, and large totals are split into
// about equal byte ranges across the shared pool.
struct Segment {
  uint8_t* dst;
  const uint8_t* src;
  size_t nbytes;
};
void copy_segments(std::vector<Segment> segs);

}  // namespace msrl
