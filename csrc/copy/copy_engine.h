// The async copy engine: one stream per direction, chunked pipelining of pageable host memory through
// double-buffered pinned bounce buffers, and tickets that callers wait on (with a deadline) or order
// their own streams after.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "copy/copy_plan.h"
#include "runtime/device_runtime.h"

namespace msrl {

class CopyEngine;

// Completion of one submitted copy. Owned by the caller; safe to drop before completion.
class Ticket {
 public:
  ~Ticket();
  uint64_t id() const { return id_; }
  uint64_t bytes() const { return bytes_; }
  bool done() const;
  // Seconds from submission to completion (valid once done).
  double seconds() const;

 private:
  friend class CopyEngine;
  Ticket(std::shared_ptr<DeviceRuntime> rt, uint64_t engine_id, uint64_t id, uint64_t bytes, Event event);
  std::shared_ptr<DeviceRuntime> rt_;
  uint64_t engine_id_;
  uint64_t id_;
  uint64_t bytes_;
  Event event_;  // recorded after the copy on the engine stream
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool issued_ = false;  // event_ recorded on the engine stream
  bool done_ = false;
  std::exception_ptr error_;
  std::chrono::steady_clock::time_point submitted_, finished_;
};

struct EngineOptions {
  size_t chunk_bytes = 8u << 20;  // bounce-buffer chunk for pageable memory
  bool force_bounce = false;      // stage pageable copies even on the host backend (tests)
  int device = 0;                 // device index the engine's threads bind to
};

struct EngineStats {
  uint64_t submitted = 0;
  uint64_t completed = 0;
  uint64_t failed = 0;
  uint64_t bytes_h2d = 0, bytes_d2h = 0, bytes_other = 0;
  uint64_t bounced_bytes = 0;  // bytes that went through a bounce buffer
};

class CopyEngine {
 public:
  CopyEngine(std::shared_ptr<DeviceRuntime> runtime, EngineOptions options = {});
  ~CopyEngine();  // drains submitted work
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Copies nbytes. `after`, when not null, is a caller stream: the copy starts only after work already
  // enqueued there. Pinnedness of host pointers is looked up in PinnedPool::is_pinned.
  std::shared_ptr<Ticket> copy(void* dst, const void* src, size_t nbytes, CopyKind kind, Stream after = nullptr);
  // Copies every region as one job with one ticket: fewer runtime calls and one completion to wait for
  // when moving many buffers (a model's parameters). Regions needing staging are bounced one by one.
  // Throws InvalidArgument for a null pointer, a region whose source and destination overlap, or two
  // regions whose destinations overlap; nothing is submitted then.
  std::shared_ptr<Ticket> copy_batch(std::vector<CopyRegion> regions, CopyKind kind, Stream after = nullptr);
  // Runs a plan from src to dst (both ends bounds-checked against the plan's extents).
  std::shared_ptr<Ticket> execute(std::shared_ptr<const CopyPlan> plan, void* dst, size_t dst_bytes, const void* src,
                                  size_t src_bytes, CopyKind kind, Stream after = nullptr);

  // Waits for the ticket; rethrows its error. Throws InvalidArgument for another engine's ticket,
  // Timeout past the deadline (the copy goes on).
  void wait(const Ticket& ticket, double timeout_seconds) const;
  // Makes work enqueued on `stream` after this call wait for the ticket's copy. Waits (up to the
  // deadline) until the copy has been issued on the engine stream.
  void order_stream(const Ticket& ticket, Stream stream, double timeout_seconds) const;
  // Waits for everything submitted so far.
  void synchronize(double timeout_seconds);

  Stream stream(CopyKind kind) const;
  EngineStats stats() const;
  DeviceRuntime& runtime() const { return *rt_; }

 private:
  struct Lane;
  Lane& lane_for(CopyKind kind) const;
  std::shared_ptr<Ticket> submit(CopyKind kind, uint64_t bytes, Stream after, std::function<void(Lane&)> issue);
  void copy_bounced_h2d(Lane& lane, char* dst, const char* src, size_t nbytes);
  void copy_bounced_d2h(Lane& lane, char* dst, const char* src, size_t nbytes);
  void finish(Ticket& ticket, std::exception_ptr error);

  std::shared_ptr<DeviceRuntime> rt_;
  EngineOptions options_;
  uint64_t id_;
  std::unique_ptr<Lane> lanes_[3];  // h2d (and h2h), d2h, d2d
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  EngineStats stats_;
  uint64_t next_ticket_ = 1;
};

}  // namespace msrl
