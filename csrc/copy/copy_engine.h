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
#include <optional>
#include <thread>
#include <vector>

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
  Ticket(std::shared_ptr<DeviceRuntime> rt, uint64_t engine_id, uint64_t id, uint64_t bytes);
  std::shared_ptr<DeviceRuntime> rt_;
  uint64_t engine_id_;
  uint64_t id_;
  uint64_t bytes_;
  // Made on the lane's issuing thread (the engine's device, a thread with a context) and recorded after the
  // copy on the lane stream; destroyed by the lane once the copy completed. Guarded by mu_.
  Event event_ = nullptr;
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
  uint64_t ordered = 0;  // jobs ordered after a caller stream (`after`)
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

  // `after`, when given, is a caller stream: the copy starts only after the work already enqueued there. A
  // null handle is the default stream (torch's default CUDA stream has handle 0: the legacy stream, which
  // the engine's non-blocking streams do not synchronise with by themselves). std::nullopt: no ordering.
  using After = std::optional<Stream>;

  // Copies nbytes. Host memory that is neither pinned (PinnedPool::is_pinned, or the runtime's own
  // knowledge: torch's pin_memory()) nor at an address the runtime can copy from (copy_alignment) goes
  // through the pinned bounce buffers.
  std::shared_ptr<Ticket> copy(void* dst, const void* src, size_t nbytes, CopyKind kind, After after = std::nullopt);
  // Copies every region as one job with one ticket: fewer runtime calls and one completion to wait for
  // when moving many buffers (a model's parameters). Regions needing staging are bounced one by one.
  // Throws InvalidArgument for a null pointer, a region whose source and destination overlap, or two
  // regions whose destinations overlap; nothing is submitted then.
  std::shared_ptr<Ticket> copy_batch(std::vector<CopyRegion> regions, CopyKind kind, After after = std::nullopt);
  // Runs a plan from src to dst (both ends bounds-checked against the plan's extents). Host memory that
  // needs staging (as in copy) is gathered into / scattered from the bounce buffers descriptor by descriptor.
  std::shared_ptr<Ticket> execute(std::shared_ptr<const CopyPlan> plan, void* dst, size_t dst_bytes, const void* src,
                                  size_t src_bytes, CopyKind kind, After after = std::nullopt);

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
  int device() const { return options_.device; }

  // One strided piece of a staged copy: `rows` rows of `row_bytes` at dst and src, with their pitches.
  struct Piece {
    char* dst;
    const char* src;
    uint64_t rows, row_bytes, src_pitch, dst_pitch;
    uint64_t bytes() const { return rows * row_bytes; }
  };

 private:
  struct Lane;
  Lane& lane_for(CopyKind kind) const;
  std::shared_ptr<Ticket> submit(CopyKind kind, uint64_t bytes, const After& after, std::function<void(Lane&)> issue);
  // Host memory at [p, p+n) can be the host side of a device copy as it is (no staging).
  bool direct_host(const void* p, size_t n) const;
  bool aligned(const void* p) const;
  void copy_staged_h2d(Lane& lane, const std::vector<Piece>& pieces);
  void copy_staged_d2h(Lane& lane, const std::vector<Piece>& pieces);
  void issue_piece(Lane& lane, const Piece& p, char* dst, const char* src, CopyKind kind);
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
