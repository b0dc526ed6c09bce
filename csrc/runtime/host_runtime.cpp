// The host backend: device memory is host memory, each stream is a worker thread that runs its work in
// FIFO order, and events are completion markers, so asynchronous code behaves as it does on a GPU.
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include "common/error.h"
#include "common/thread_pool.h"
#include "runtime/device_runtime.h"

namespace msrl {
namespace {

using Clock = std::chrono::steady_clock;

struct HostEvent {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // generation of the latest record()
  uint64_t completed = 0;  // generation that has been reached
  bool timing = false;
  Clock::time_point when{};

  void complete(uint64_t gen) {
    // Notify under the lock: a waiter may destroy the event as soon as it sees `completed`.
    std::lock_guard<std::mutex> lock(mu);
    if (gen > completed) {
      completed = gen;
      when = Clock::now();
    }
    cv.notify_all();
  }
  void wait_for(uint64_t gen) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return completed >= gen; });
  }
};

class HostStream {
 public:
  HostStream() : thread_([this] { loop(); }) {}
  ~HostStream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void enqueue(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
      ++enqueued_;
    }
    cv_.notify_all();
  }
  void synchronize() {
    std::unique_lock<std::mutex> lock(mu_);
    uint64_t target = enqueued_;
    done_cv_.wait(lock, [&] { return done_ >= target; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_ and drained
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();  // host tasks are memcpy and event bookkeeping; they do not throw
      lock.lock();
      ++done_;
      done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  std::deque<std::function<void()>> tasks_;
  uint64_t enqueued_ = 0;
  uint64_t done_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

constexpr uint64_t kStreamingBytes = 8u << 20;

// memcpy with non-temporal 16-byte stores for the aligned middle (SSE2 is part of x86-64).
void stream_copy(char* dst, const char* src, size_t n) {
#if defined(__x86_64__) || defined(_M_X64)
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (n < 64 || head > n) {
    std::memcpy(dst, src, n);
    return;
  }
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t body = n & ~size_t{63};
  for (size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + body, src + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

void stream_fence() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_sfence();  // make the streamed stores visible before the task reports completion
#endif
}

constexpr size_t kPageBytes = 4096;
constexpr size_t kHugeBytes = 2u << 20;

void* aligned_host_alloc(size_t nbytes) {
  MSRL_CHECK(nbytes > 0, kInvalidArgument, "allocation size must be > 0, got 0");
  size_t align = nbytes >= kHugeBytes ? kHugeBytes : kPageBytes;
  size_t rounded = (nbytes + align - 1) / align * align;
  void* ptr = std::aligned_alloc(align, rounded);
  MSRL_CHECK(ptr != nullptr, kOutOfMemory, "host allocation of ", nbytes, " bytes failed");
  return ptr;
}

class HostRuntime final : public DeviceRuntime {
 public:
  const char* name() const override { return "host"; }
  bool device_is_host() const override { return true; }
  int device_count() override { return 1; }
  void set_device(int device) override {
    MSRL_CHECK(device == 0, kInvalidArgument, "host backend has one device (0), got ", device);
  }

  void* host_alloc_pinned(size_t nbytes) override { return aligned_host_alloc(nbytes); }
  void host_free_pinned(void* ptr) override { std::free(ptr); }
  void host_register(void* ptr, size_t nbytes, bool /*read_only*/) override {
    MSRL_CHECK(ptr != nullptr, kInvalidArgument, "cannot register a null pointer");
    MSRL_CHECK(nbytes > 0, kInvalidArgument, "cannot register 0 bytes at ", ptr);
    std::lock_guard<std::mutex> lock(mu_);
    auto begin = reinterpret_cast<uintptr_t>(ptr);
    auto next = registered_.lower_bound(begin);
    if (next != registered_.end()) {
      MSRL_CHECK(next->first >= begin + nbytes, kInvalidArgument, "range ", ptr, "+", nbytes,
                 " overlaps a registered range at 0x", std::hex, next->first);
    }
    if (next != registered_.begin()) {
      auto prev = std::prev(next);
      MSRL_CHECK(prev->first + prev->second <= begin, kInvalidArgument, "range ", ptr, "+", nbytes,
                 " overlaps a registered range at 0x", std::hex, prev->first);
    }
    registered_[begin] = nbytes;
  }
  void host_unregister(void* ptr) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = registered_.find(reinterpret_cast<uintptr_t>(ptr));
    MSRL_CHECK(it != registered_.end(), kNotFound, "pointer ", ptr, " is not registered");
    registered_.erase(it);
  }

  void* device_alloc(size_t nbytes) override { return aligned_host_alloc(nbytes); }
  void device_free(void* ptr) override { std::free(ptr); }

  Stream stream_create() override {
    auto* stream = new HostStream();
    std::lock_guard<std::mutex> lock(mu_);
    streams_.insert(stream);
    return stream;
  }
  void stream_destroy(Stream stream) override {
    delete check_stream(stream);
    std::lock_guard<std::mutex> lock(mu_);
    streams_.erase(stream);
  }
  void stream_synchronize(Stream stream) override {
    if (stream != nullptr) check_stream(stream)->synchronize();
  }
  // The queued wait holds its own reference: the event may be destroyed right after this call (as CUDA
  // allows: the wait uses the state captured here).
  void stream_wait_event(Stream stream, Event event) override {
    std::shared_ptr<HostEvent> ev = check_event(event);
    uint64_t target;
    {
      std::lock_guard<std::mutex> lock(ev->mu);
      target = ev->recorded;
    }
    if (stream == nullptr) {
      ev->wait_for(target);
    } else {
      check_stream(stream)->enqueue([ev, target] { ev->wait_for(target); });
    }
  }

  void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind, Stream stream) override {
    if (nbytes == 0) return;
    submit(stream, [dst, src, nbytes] { parallel_memcpy(dst, src, nbytes); });
  }
  void memcpy_batch_async(const CopyRegion* regions, size_t count, CopyKind, Stream stream) override {
    std::vector<Segment> segs;
    segs.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      if (regions[i].nbytes == 0) continue;
      segs.push_back(
          {static_cast<uint8_t*>(regions[i].dst), static_cast<const uint8_t*>(regions[i].src), regions[i].nbytes});
    }
    if (segs.empty()) return;
    submit(stream, [segs = std::move(segs)]() mutable { copy_segments(std::move(segs)); });
  }
  void memcpy2d_async(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                      CopyKind kind, Stream stream) override {
    CopyDescriptor d{0, 0, height, width, spitch, dpitch};
    plan_async(&d, 1, static_cast<char*>(dst), static_cast<const char*>(src), kind, stream);
  }
  void plan_async(const CopyDescriptor* descs, size_t count, char* dst, const char* src, CopyKind,
                  Stream stream) override {
    if (count == 0) return;
    // The caller keeps `descs` alive only for this call, so the task owns a copy.
    std::vector<CopyDescriptor> plan(descs, descs + count);
    submit(stream, [plan = std::move(plan), dst, src] { run_plan(plan, dst, src); });
  }

  Event event_create(unsigned flags) override {
    auto ev = std::make_shared<HostEvent>();  // host waits block on a condition variable: never a spin
    ev->timing = (flags & kEventTiming) != 0;
    std::lock_guard<std::mutex> lock(mu_);
    events_[ev.get()] = ev;
    return ev.get();
  }
  // Queued records and waits keep their own references; the handle is dead from now on.
  void event_destroy(Event event) override {
    check_event(event);
    std::lock_guard<std::mutex> lock(mu_);
    events_.erase(event);
  }
  void event_record(Event event, Stream stream) override {
    if (stream != nullptr) check_stream(stream);
    std::shared_ptr<HostEvent> ev = check_event(event);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(ev->mu);
      gen = ++ev->recorded;
    }
    submit(stream, [ev, gen] { ev->complete(gen); });
  }
  bool event_query(Event event) override {
    auto ev = check_event(event);
    std::lock_guard<std::mutex> lock(ev->mu);
    return ev->completed >= ev->recorded;
  }
  void event_synchronize(Event event) override {
    auto ev = check_event(event);
    uint64_t target;
    {
      std::lock_guard<std::mutex> lock(ev->mu);
      target = ev->recorded;
    }
    ev->wait_for(target);
  }
  float event_elapsed_ms(Event start, Event end) override {
    auto a = check_event(start);
    auto b = check_event(end);
    MSRL_CHECK(a->timing && b->timing, kInvalidArgument, "elapsed time needs two events created with timing=true");
    std::lock_guard<std::mutex> la(a->mu);
    std::lock_guard<std::mutex> lb(b->mu);
    MSRL_CHECK(a->completed > 0 && a->completed >= a->recorded && b->completed > 0 && b->completed >= b->recorded,
               kInvalidArgument, "elapsed time needs two completed events");
    return std::chrono::duration<float, std::milli>(b->when - a->when).count();
  }

  // Large plans split by bytes across the shared pool; small ones run in one tight loop. Rows of large
  // plans are written with non-temporal stores: the destination will not be read back soon, and skipping
  // the read-for-ownership of every destination line saves a third of the memory traffic.
  static void run_plan(const std::vector<CopyDescriptor>& plan, char* dst, const char* src) {
    uint64_t total = 0;
    for (const auto& d : plan) total += d.bytes();
    const bool streaming = total >= kStreamingBytes;
    auto copy_rows = [&](const CopyDescriptor& d, uint64_t r0, uint64_t r1) {
      for (uint64_t r = r0; r < r1; ++r) {
        char* to = dst + d.dst_offset + r * d.dst_pitch;
        const char* from = src + d.src_offset + r * d.src_pitch;
        if (streaming) {
          stream_copy(to, from, d.row_bytes);
        } else {
          std::memcpy(to, from, d.row_bytes);
        }
      }
      if (streaming) stream_fence();
    };
    auto& pool = ThreadPool::shared();
    constexpr uint64_t kMinPiece = 4u << 20;
    size_t pieces = std::min<uint64_t>(pool.size(), std::max<uint64_t>(1, total / kMinPiece));
    if (pieces <= 1) {
      for (const auto& d : plan) copy_rows(d, 0, d.rows);
      return;
    }
    // Cut the byte stream [0, total) into equal pieces; a piece covers whole rows, and a single-row
    // descriptor larger than a piece is itself split.
    uint64_t per_piece = (total + pieces - 1) / pieces;
    pool.parallel_for(pieces, [&](size_t p) {
      uint64_t lo = p * per_piece, hi = std::min(total, lo + per_piece);
      uint64_t pos = 0;
      for (const auto& d : plan) {
        uint64_t b = d.bytes();
        if (pos + b <= lo) {
          pos += b;
          continue;
        }
        if (pos >= hi) break;
        if (d.rows == 1) {
          uint64_t s = std::max(lo, pos) - pos, e = std::min(hi, pos + b) - pos;
          // A 1-D piece this large goes to memcpy, which streams large copies itself.
          std::memcpy(dst + d.dst_offset + s, src + d.src_offset + s, e - s);
        } else {
          // Rows whose first byte falls in [lo, hi).
          uint64_t r0 = lo > pos ? (lo - pos + d.row_bytes - 1) / d.row_bytes : 0;
          uint64_t r1 = std::min<uint64_t>(d.rows, (hi - pos + d.row_bytes - 1) / d.row_bytes);
          copy_rows(d, r0, r1);
        }
        pos += b;
      }
    });
  }

 private:
  std::shared_ptr<HostEvent> check_event(Event event) {
    MSRL_CHECK(event != nullptr, kInvalidArgument, "event handle is null");
    std::lock_guard<std::mutex> lock(mu_);
    auto it = events_.find(event);
    MSRL_CHECK(it != events_.end(), kInvalidArgument, "event handle ", event,
               " is not a live event of the host backend");
    return it->second;
  }
  // Host streams are our own objects, so a handle from elsewhere (a torch stream, a freed stream) is
  // caught here instead of being dereferenced.
  HostStream* check_stream(Stream stream) {
    std::lock_guard<std::mutex> lock(mu_);
    MSRL_CHECK(streams_.count(stream) != 0, kInvalidArgument, "stream handle ", stream,
               " is not a live stream of the host backend");
    return static_cast<HostStream*>(stream);
  }
  void submit(Stream stream, std::function<void()> task) {
    if (stream == nullptr) {
      task();  // the default stream is synchronous
    } else {
      check_stream(stream)->enqueue(std::move(task));
    }
  }

  std::mutex mu_;
  std::map<uintptr_t, size_t> registered_;
  std::set<Stream> streams_;
  std::map<Event, std::shared_ptr<HostEvent>> events_;
};

}  // namespace

std::shared_ptr<DeviceRuntime> make_host_runtime() { return std::make_shared<HostRuntime>(); }

}  // namespace msrl
