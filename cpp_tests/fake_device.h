// A host-memory model of a vendor runtime, shared by the fake libcudart and libascendcl (test-only, never
// installed). "Device" memory is host memory tracked apart from pinned memory, so a copy whose pointers do
// not match its kind fails as it would on hardware. Streams run their work in order, at once unless a test
// holds the stream; an operation that waits on an event blocks its stream until the event completes.
// Every entry point counts its calls and can be made to fail once with a chosen code.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>

// Only the vendor entry points and the control functions are exported; the model itself stays internal.
#pragma GCC visibility push(hidden)
namespace fake {

using Clock = std::chrono::steady_clock;

struct Event {
  bool timing = true;
  uint64_t recorded = 0;   // generation of the latest record
  uint64_t completed = 0;  // generation reached by its stream
  Clock::time_point when{};
};

struct Op {
  Event* wait = nullptr;  // when set, the stream stalls until wait->completed >= gen
  uint64_t gen = 0;
  std::function<void()> run;
};

struct Stream {
  bool held = false;
  std::deque<Op> ops;
};

class Device {
 public:
  std::mutex mu;  // every entry point holds it for its whole body
  int device_count = 1;
  bool initialized = false;
  std::string last_error;  // text of the latest injected failure, for the vendor's "recent error" call

  // Counts a call of `fn`; returns the error injected for it (once), or 0.
  int enter(const char* fn) {
    ++calls_[fn];
    auto it = fail_next_.find(fn);
    if (it == fail_next_.end()) return 0;
    int code = it->second;
    fail_next_.erase(it);
    last_error = std::string("fake: injected error ") + std::to_string(code) + " in " + fn;
    return code;
  }
  void fail_next(const char* fn, int code) { fail_next_[fn] = code; }
  void reset() {
    calls_.clear();
    fail_next_.clear();
    last_error.clear();
  }
  // A function's call count, or a live-object count: live_host_allocs, live_device_allocs,
  // live_registrations, live_streams, live_events.
  long long stat(const std::string& key) {
    if (key == "live_host_allocs") return static_cast<long long>(host_.size());
    if (key == "live_device_allocs") return static_cast<long long>(device_.size());
    if (key == "live_registrations") return static_cast<long long>(registered_.size());
    if (key == "live_streams") return static_cast<long long>(streams_.size());
    if (key == "live_events") return static_cast<long long>(events_.size());
    auto it = calls_.find(key);
    return it == calls_.end() ? 0 : it->second;
  }

  // Memory. alloc returns nullptr when the size is 0 or the host is out of memory.
  void* alloc_host(size_t n) { return alloc(host_, n); }
  void* alloc_device(size_t n) { return alloc(device_, n); }
  bool free_host(void* p) { return release(host_, p); }
  bool free_device(void* p) { return release(device_, p); }
  bool is_device(const void* p, size_t n) const { return contains(device_, p, n); }
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
  void copy2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height, void* stream) {
    submit(stream, {nullptr, 0, [=] {
                      for (size_t r = 0; r < height; ++r) {
                        std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                                    width);
                      }
                    }});
  }

  // Streams and events. A null stream is the default stream, which a test cannot hold.
  Stream* new_stream() { return *streams_.insert(new Stream()).first; }
  bool valid_stream(void* s) const { return s == nullptr || streams_.count(static_cast<Stream*>(s)) == 1; }
  // Destroying a stream lets its queued work finish first, as the vendors document.
  void destroy_stream(void* s) {
    auto* stream = static_cast<Stream*>(s);
    stream->held = false;
    pump();
    streams_.erase(stream);
    delete stream;
  }
  void hold(void* s, bool held) {
    if (s == nullptr) return;
    static_cast<Stream*>(s)->held = held;
    pump();
  }
  bool idle(void* s) {
    pump();
    return stream(s)->ops.empty();
  }
  Event* new_event(bool timing) {
    auto* ev = new Event();
    ev->timing = timing;
    events_.insert(ev);
    return ev;
  }
  Event* event(void* e) const {
    auto* ev = static_cast<Event*>(e);
    return events_.count(ev) == 1 ? ev : nullptr;
  }
  void destroy_event(Event* ev) {
    events_.erase(ev);
    delete ev;
  }
  void record(Event* ev, void* s) {
    uint64_t gen = ++ev->recorded;
    submit(s, {nullptr, 0, [ev, gen] {
                 ev->completed = std::max(ev->completed, gen);
                 ev->when = Clock::now();
               }});
  }
  void wait(void* s, Event* ev) { submit(s, {ev, ev->recorded, nullptr}); }
  bool complete(Event* ev) {
    pump();
    return ev->completed >= ev->recorded;
  }

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
  Stream* stream(void* s) { return s == nullptr ? &default_stream_ : static_cast<Stream*>(s); }
  void submit(void* s, Op op) {
    stream(s)->ops.push_back(std::move(op));
    pump();
  }
  // Runs every operation that can run, until none can.
  void pump() {
    for (bool progress = true; progress;) {
      progress = false;
      auto drain = [&](Stream* st) {
        while (!st->held && !st->ops.empty()) {
          Op& op = st->ops.front();
          if (op.wait != nullptr && op.wait->completed < op.gen) break;
          if (op.run) op.run();
          st->ops.pop_front();
          progress = true;
        }
      };
      drain(&default_stream_);
      for (Stream* st : streams_) drain(st);
    }
  }

  std::map<std::string, long long> calls_;
  std::map<std::string, int> fail_next_;
  std::map<const void*, size_t> host_, device_;
  std::map<uintptr_t, size_t> registered_;
  std::set<Stream*> streams_;
  std::set<Event*> events_;
  Stream default_stream_;
};

}  // namespace fake
#pragma GCC visibility pop

// The control functions every fake exports (extern "C"): PREFIX_fail_next, PREFIX_stat, PREFIX_reset,
// PREFIX_hold_stream and PREFIX_set_device_count, over the fake::Device `dev`.
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
  }
