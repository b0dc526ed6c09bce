// A host-memory model of a vendor runtime, shared by the fake libcudart and libascendcl (test-only, never
// installed). It models what the real runtimes document where our code depends on it:
// - "Device" memory is host memory tracked apart from pinned memory, so a copy whose pointers do not match
//   its kind fails as it would on hardware; allocations, streams and events belong to a device (the calling
//   thread's current device when they are made).
// - Streams run their work in order, at once unless a test holds the stream (a long-running kernel); an
//   operation that waits on an event blocks its stream until the event completes. A host wait (stream or
//   event synchronize) blocks until the work is done, as on hardware, and fails after 5 s instead of hanging
//   a test whose hold is never released. The null stream is the
//   legacy default stream of the calling thread's current device: work on it waits for earlier work on every
//   blocking stream of that device, and work on a blocking stream waits for earlier work on it, while
//   non-blocking streams never synchronise with it (CUDA programming guide, "implicit synchronization").
// - Per-thread state: the current device (CUDA: 0 until cudaSetDevice; ACL: no context until aclrtSetDevice)
//   and CUDA's last error, which every failing call sets and only cudaGetLastError clears.
// - Optional timing (FAKE_DEVICE_NS_PER_BYTE in the environment, or the set_copy_cost control): a copy
//   takes that long on its stream after the host call returned, so only a host wait (stream or event
//   synchronize) covers it, as on a GPU; a copy from or to pageable host memory returns only once done.
// Every entry point counts its calls and can be made to fail once with a chosen code; shutdown(code) makes
// every later call fail (the runtime torn down under live objects, as at interpreter exit).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// Only the vendor entry points and the control functions are exported; the model itself stays internal.
#pragma GCC visibility push(hidden)
namespace fake {

using Clock = std::chrono::steady_clock;

struct Event {
  bool timing = true;
  unsigned flags = 0;
  int device = 0;
  uint64_t recorded = 0;   // generation of the latest record
  uint64_t completed = 0;  // generation reached by its stream
  Clock::time_point when{};
};

// Queued operations hold their events: an event may be destroyed right after a record or wait was queued
// (the vendors release it once the device is done with it).
struct Op {
  std::shared_ptr<Event> wait;  // when set, the stream stalls until wait->completed >= gen
  uint64_t gen = 0;
  std::vector<std::pair<uint64_t, uint64_t>> after;  // (stream id, ops): implicit default-stream ordering
  uint64_t nbytes = 0;                               // a copy's bytes, for the timing model
  std::function<void()> run;
  std::shared_ptr<Event> record;  // a record: completes `record` at generation `record_gen`
  uint64_t record_gen = 0;
};

struct Stream {
  uint64_t id = 0;
  int device = 0;
  bool blocking = false;  // synchronises with the legacy default stream
  bool legacy = false;    // a device's default (null) stream
  bool held = false;
  std::deque<Op> ops;
  uint64_t enqueued = 0, completed = 0;
  Clock::time_point busy_until{};  // when the device finishes the work run so far (timing model)
};

struct ThreadState {
  int device = 0;
  bool context = false;  // ACL: aclrtSetDevice was called on this thread
  int last_error = 0;    // CUDA: the sticky per-thread last error
};

// True when every page of [p, p+n) is mapped writable (read from /proc/self/maps).
inline bool host_range_writable(const void* p, size_t n) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return true;
  auto begin = reinterpret_cast<uintptr_t>(p), end = begin + n;
  uintptr_t covered = begin;
  bool ok = true;
  char line[512];
  while (ok && covered < end && std::fgets(line, sizeof line, maps) != nullptr) {
    unsigned long lo = 0, hi = 0;
    char perms[8] = {0};
    if (std::sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
    if (hi <= covered || lo >= end) continue;
    if (lo > covered || perms[1] != 'w') ok = false;  // a hole, or a read-only page
    covered = hi;
  }
  std::fclose(maps);
  return ok && covered >= end;
}

class Device {
 public:
  explicit Device(bool cuda) : cuda_(cuda) {
    const char* cost = std::getenv("FAKE_DEVICE_NS_PER_BYTE");
    if (cost != nullptr) ns_per_byte_ = std::atof(cost);
  }
  ~Device() { reset(); }  // at unload: what a test left behind is freed, not leaked

  std::mutex mu;  // every entry point holds it for its whole body (released only to sleep)
  int device_count = 1;
  bool initialized = false;
  std::string last_error;  // text of the latest injected failure, for the vendor's "recent error" call

  // Counts a call of `fn`; returns the error injected for it (once), the shutdown code, or 0.
  int enter(const char* fn) {
    ++calls_[fn];
    if (shutdown_ != 0) return shutdown_;
    auto it = fail_next_.find(fn);
    if (it == fail_next_.end()) return 0;
    int code = it->second;
    fail_next_.erase(it);
    last_error = std::string("fake: injected error ") + std::to_string(code) + " in " + fn;
    return code;
  }
  void fail_next(const char* fn, int code) { fail_next_[fn] = code; }
  void shutdown(int code) { shutdown_ = code; }
  void set_copy_cost(double ns_per_byte) { ns_per_byte_ = ns_per_byte; }
  // Forgets the counters and injections, and frees every object a previous test left (a test that shut
  // the runtime down cannot free its own), so live-object counts start at 0.
  void reset() {
    calls_.clear();
    fail_next_.clear();
    counters_.clear();
    last_error.clear();
    threads_.clear();
    shutdown_ = 0;
    for (auto& [p, n] : host_) std::free(const_cast<void*>(p));
    for (auto& [p, n] : device_) std::free(const_cast<void*>(p));
    host_.clear();
    device_.clear();
    device_of_.clear();
    registered_.clear();
    for (Stream* st : streams_) delete st;
    streams_.clear();
    events_.clear();
    default_streams_.clear();
  }
  void count(const std::string& key) { ++counters_[key]; }
  // A function's call count, a counter (events_blocking_sync, pageable_copies, ...) or a live-object count:
  // live_host_allocs, live_device_allocs, live_registrations, live_streams, live_events.
  long long stat(const std::string& key) {
    if (key == "live_host_allocs") return static_cast<long long>(host_.size());
    if (key == "live_device_allocs") return static_cast<long long>(device_.size());
    if (key == "live_registrations") return static_cast<long long>(registered_.size());
    if (key == "live_streams") return static_cast<long long>(streams_.size());
    if (key == "live_events") return static_cast<long long>(events_.size());
    auto c = counters_.find(key);
    if (c != counters_.end()) return c->second;
    auto it = calls_.find(key);
    return it == calls_.end() ? 0 : it->second;
  }

  // ---- per-thread state
  ThreadState& thread() { return threads_[std::this_thread::get_id()]; }
  int current_device() { return thread().device; }
  void set_current_device(int device) {
    thread().device = device;
    thread().context = true;
  }
  bool has_context() { return cuda_ || thread().context; }
  // CUDA: a failing call leaves its code as the thread's last error (cudaGetLastError reads and clears it).
  int note(int code) {
    if (cuda_ && code != 0) thread().last_error = code;
    return code;
  }

  // ---- memory. alloc returns nullptr when the size is 0 or the host is out of memory.
  void* alloc_host(size_t n) { return alloc(host_, n); }
  void* alloc_device(size_t n) {
    void* p = alloc(device_, n);
    if (p != nullptr) device_of_[p] = current_device();
    return p;
  }
  bool free_host(void* p) { return release(host_, p); }
  bool free_device(void* p) {
    device_of_.erase(p);
    return release(device_, p);
  }
  bool is_device(const void* p, size_t n) const { return contains(device_, p, n); }
  // The device owning device pointer p, or -1.
  int device_of(const void* p) const {
    auto it = device_.upper_bound(p);
    if (it == device_.begin()) return -1;
    --it;
    if (!contains(device_, p, 1)) return -1;
    auto d = device_of_.find(it->first);
    return d == device_of_.end() ? -1 : d->second;
  }
  // Page-locked: allocated by the runtime's pinned allocator or registered.
  bool is_pinned(const void* p, size_t n) const {
    if (contains(host_, p, n)) return true;
    auto begin = reinterpret_cast<uintptr_t>(p);
    auto it = registered_.upper_bound(begin);
    if (it == registered_.begin()) return false;
    --it;
    return begin >= it->first && begin + n <= it->first + it->second;
  }
  // 0 on success, 1 when the range overlaps a registered range.
  int register_range(void* p, size_t n) {
    auto begin = reinterpret_cast<uintptr_t>(p);
    auto next = registered_.lower_bound(begin);
    if (next != registered_.end() && next->first < begin + n) return 1;
    if (next != registered_.begin() && std::prev(next)->first + std::prev(next)->second > begin) return 1;
    registered_[begin] = n;
    return 0;
  }
  bool unregister_range(void* p) { return registered_.erase(reinterpret_cast<uintptr_t>(p)) == 1; }

  // A 2-D copy whose pointers match `kind` (0 h2h, 1 h2d, 2 d2h, 3 d2d): false when they do not.
  bool kind_matches(int kind, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                    size_t height) const {
    bool dst_dev = is_device(dst, (height - 1) * dpitch + width);
    bool src_dev = is_device(src, (height - 1) * spitch + width);
    bool dst_host = !contains(device_, dst, 1);
    bool src_host = !contains(device_, src, 1);
    switch (kind) {
      case 0: return dst_host && src_host;
      case 1: return dst_dev && src_host;
      case 2: return dst_host && src_dev;
      case 3: return dst_dev && src_dev;
      default: return false;
    }
  }
  // The host side of a host<->device copy is page-locked (else the vendor copies synchronously, or worse).
  bool host_side_pinned(int kind, const void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                        size_t height) const {
    if (kind == 1) return is_pinned(src, (height - 1) * spitch + width);
    if (kind == 2) return is_pinned(dst, (height - 1) * dpitch + width);
    return true;
  }
  void copy2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height, void* s) {
    Op op;
    op.nbytes = width * height;
    op.run = [=] {
      for (size_t r = 0; r < height; ++r) {
        std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
      }
    };
    submit(s, std::move(op));
  }
  // A synchronous call (a pageable copy) returns only once its stream has done everything so far.
  void finish_synchronously(std::unique_lock<std::mutex>& lock, void* s) {
    if (!drained(lock, s)) return;  // a hold nobody releases: the test sees the result
    sleep_until(lock, stream(s)->busy_until);
  }

  // ---- streams and events. The null stream is the legacy default stream of the calling thread's device.
  Stream* new_stream(bool blocking) {
    auto* s = new Stream();
    s->id = next_stream_id_++;
    s->device = current_device();
    s->blocking = blocking;
    streams_.insert(s);
    return s;
  }
  bool valid_stream(void* s) const { return s == nullptr || streams_.count(static_cast<Stream*>(s)) == 1; }
  int device_of_stream(void* s) { return stream(s)->device; }
  // Destroying a stream lets its queued work finish first, as the vendors document.
  void destroy_stream(void* s) {
    auto* st = static_cast<Stream*>(s);
    st->held = false;
    pump();
    streams_.erase(st);
    delete st;
  }
  void hold(void* s, bool held) {
    stream(s)->held = held;
    pump();
  }
  // Blocks, the lock released, until the stream has run everything queued (another thread may release a
  // hold meanwhile). False past a deadline: a hold nobody releases fails the call instead of hanging a test.
  bool drained(std::unique_lock<std::mutex>& lock, void* s) {
    return block_until(lock, [&] { return stream(s)->ops.empty(); });
  }
  void wait_idle(std::unique_lock<std::mutex>& lock, void* s) { sleep_until(lock, stream(s)->busy_until); }
  Event* new_event(bool timing, unsigned flags = 0) {
    auto ev = std::make_shared<Event>();
    ev->timing = timing;
    ev->flags = flags;
    ev->device = current_device();
    events_[ev.get()] = ev;
    return ev.get();
  }
  Event* event(void* e) const {
    auto it = events_.find(static_cast<Event*>(e));
    return it == events_.end() ? nullptr : it->second.get();
  }
  void destroy_event(Event* ev) { events_.erase(ev); }
  void record(Event* ev, void* s) {
    Op op;
    op.record = events_.at(ev);
    op.record_gen = ++ev->recorded;
    submit(s, std::move(op));
  }
  void wait(void* s, Event* ev) {
    Op op;
    op.wait = events_.at(ev);
    op.gen = ev->recorded;
    submit(s, std::move(op));
  }
  // Blocks as drained() does until the stream reached the event's latest record.
  bool reached(std::unique_lock<std::mutex>& lock, Event* ev) {
    return block_until(lock, [&] { return ev->completed >= ev->recorded; });
  }
  // Complete now: reached, and (timing model) the device has finished the work before it.
  bool complete(Event* ev) {
    pump();
    return ev->completed >= ev->recorded && Clock::now() >= ev->when;
  }
  void wait_event(std::unique_lock<std::mutex>& lock, Event* ev) { sleep_until(lock, ev->when); }

 private:
  static size_t round_up(size_t n) { return (n + 4095) / 4096 * 4096; }
  void* alloc(std::map<const void*, size_t>& table, size_t n) {
    if (n == 0) return nullptr;
    void* p = std::aligned_alloc(4096, round_up(n));
    if (p != nullptr) table[p] = n;
    return p;
  }
  bool release(std::map<const void*, size_t>& table, void* p) {
    if (table.erase(p) == 0) return false;
    std::free(p);
    return true;
  }
  static bool contains(const std::map<const void*, size_t>& table, const void* p, size_t n) {
    auto it = table.upper_bound(p);
    if (it == table.begin()) return false;
    --it;
    auto base = reinterpret_cast<uintptr_t>(it->first), addr = reinterpret_cast<uintptr_t>(p);
    return addr >= base && addr + n <= base + it->second;
  }
  Stream* legacy(int device) {
    Stream& s = default_streams_[device];
    if (s.id == 0) {
      s.id = next_stream_id_++;
      s.device = device;
      s.legacy = true;
    }
    return &s;
  }
  Stream* stream(void* s) { return s == nullptr ? legacy(current_device()) : static_cast<Stream*>(s); }
  Stream* by_id(uint64_t id) {
    for (auto& [dev, s] : default_streams_) {
      if (s.id == id) return &s;
    }
    for (Stream* s : streams_) {
      if (s->id == id) return s;
    }
    return nullptr;  // destroyed: its work is done
  }
  void submit(void* s, Op op) {
    Stream* st = stream(s);
    if (st->legacy) {
      for (Stream* other : streams_) {
        if (other->blocking && other->device == st->device) op.after.push_back({other->id, other->enqueued});
      }
    } else if (st->blocking) {
      Stream* def = legacy(st->device);
      op.after.push_back({def->id, def->enqueued});
    }
    ++st->enqueued;
    st->ops.push_back(std::move(op));
    pump();
  }
  bool ready(const Op& op) {
    if (op.wait != nullptr && op.wait->completed < op.gen) return false;
    for (auto [id, target] : op.after) {
      Stream* other = by_id(id);
      if (other != nullptr && other->completed < target) return false;
    }
    return true;
  }
  void run(Stream* st, Op& op) {
    auto now = Clock::now();
    if (op.wait != nullptr) st->busy_until = std::max(st->busy_until, op.wait->when);
    for (auto [id, target] : op.after) {
      if (Stream* other = by_id(id)) st->busy_until = std::max(st->busy_until, other->busy_until);
    }
    if (op.run) op.run();
    if (op.nbytes > 0 && ns_per_byte_ > 0) {
      auto cost = std::chrono::nanoseconds(static_cast<long long>(static_cast<double>(op.nbytes) * ns_per_byte_));
      st->busy_until = std::max(st->busy_until, now) + std::chrono::duration_cast<Clock::duration>(cost);
    }
    if (op.record != nullptr) {
      op.record->completed = std::max(op.record->completed, op.record_gen);
      op.record->when = std::max(st->busy_until, now);
    }
  }
  bool block_until(std::unique_lock<std::mutex>& lock, const std::function<bool()>& done) {
    return progress_.wait_for(lock, std::chrono::seconds(5), [&] {
      pump();
      return done();
    });
  }
  // Runs every operation that can run, until none can; wakes blocked callers when something ran.
  void pump() {
    bool any = false;
    for (bool progress = true; progress; any = any || progress) {
      progress = false;
      auto drain = [&](Stream* st) {
        while (!st->held && !st->ops.empty() && ready(st->ops.front())) {
          run(st, st->ops.front());
          st->ops.pop_front();
          ++st->completed;
          progress = true;
        }
      };
      for (auto& [dev, s] : default_streams_) drain(&s);
      for (Stream* st : streams_) drain(st);
    }
    if (any) progress_.notify_all();
  }
  void sleep_until(std::unique_lock<std::mutex>& lock, Clock::time_point t) {
    if (Clock::now() >= t) return;
    lock.unlock();
    std::this_thread::sleep_until(t);
    lock.lock();
  }

  bool cuda_;
  std::condition_variable progress_;
  double ns_per_byte_ = 0;
  int shutdown_ = 0;
  uint64_t next_stream_id_ = 1;
  std::map<std::string, long long> calls_, counters_;
  std::map<std::string, int> fail_next_;
  std::map<const void*, size_t> host_, device_;
  std::map<const void*, int> device_of_;
  std::map<uintptr_t, size_t> registered_;
  std::set<Stream*> streams_;
  std::map<Event*, std::shared_ptr<Event>> events_;
  std::map<int, Stream> default_streams_;
  std::map<std::thread::id, ThreadState> threads_;
};

}  // namespace fake
#pragma GCC visibility pop

// The control functions every fake exports (extern "C"): PREFIX_fail_next, PREFIX_stat, PREFIX_reset,
// PREFIX_hold_stream (a null stream: the calling thread's default stream), PREFIX_set_device_count,
// PREFIX_shutdown (every later call fails with the code; 0 undoes it) and PREFIX_set_copy_cost.
#define FAKE_DEFINE_CONTROLS(PREFIX, dev)                        \
  extern "C" void PREFIX##_fail_next(const char* fn, int code) { \
    std::lock_guard<std::mutex> lock(dev.mu);                    \
    dev.fail_next(fn, code);                                     \
  }                                                              \
  extern "C" long long PREFIX##_stat(const char* key) {          \
    std::lock_guard<std::mutex> lock(dev.mu);                    \
    return dev.stat(key);                                        \
  }                                                              \
  extern "C" void PREFIX##_reset() {                             \
    std::lock_guard<std::mutex> lock(dev.mu);                    \
    dev.reset();                                                 \
  }                                                              \
  extern "C" void PREFIX##_hold_stream(void* stream, int held) { \
    std::lock_guard<std::mutex> lock(dev.mu);                    \
    dev.hold(stream, held != 0);                                 \
  }                                                              \
  extern "C" void PREFIX##_set_device_count(int count) {         \
    std::lock_guard<std::mutex> lock(dev.mu);                    \
    dev.device_count = count;                                    \
  }                                                              \
  extern "C" void PREFIX##_shutdown(int code) {                  \
    std::lock_guard<std::mutex> lock(dev.mu);                    \
    dev.shutdown(code);                                          \
  }                                                              \
  extern "C" void PREFIX##_set_copy_cost(double ns_per_byte) {   \
    std::lock_guard<std::mutex> lock(dev.mu);                    \
    dev.set_copy_cost(ns_per_byte);                              \
  }
