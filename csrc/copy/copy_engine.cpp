#include "copy/copy_engine.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>

#include "common/error.h"
#include "common/thread_pool.h"
#include "memory/pinned_pool.h"

namespace msrl {

namespace {
std::atomic<uint64_t> g_next_engine_id{1};
using Clock = std::chrono::steady_clock;
}  // namespace

// ---------------------------------------------------------------------------------------------- Ticket

Ticket::Ticket(std::shared_ptr<DeviceRuntime> rt, uint64_t engine_id, uint64_t id, uint64_t bytes, Event event)
    : rt_(std::move(rt)), engine_id_(engine_id), id_(id), bytes_(bytes), event_(event), submitted_(Clock::now()) {}

Ticket::~Ticket() {
  try {
    rt_->event_destroy(event_);
  } catch (const Error&) {
  }
}

bool Ticket::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

double Ticket::seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_) return 0.0;
  return std::chrono::duration<double>(finished_ - submitted_).count();
}

// ------------------------------------------------------------------------------------------------ Lane

// One direction: a stream, an issuing thread that runs jobs in FIFO order (enqueueing device work,
// staging pageable memory), and a completing thread that waits for each job's event and wakes waiters.
struct CopyEngine::Lane {
  struct Job {
    std::shared_ptr<Ticket> ticket;
    Event after = nullptr;  // recorded on the caller's stream at submission
    std::function<void(Lane&)> issue;
  };

  // The vendor device (CUDA) or context (ACL) is per thread: each lane thread binds `device` first, and
  // the stream is created on the issuing thread so that it belongs to that device.
  Lane(CopyEngine* engine, std::shared_ptr<DeviceRuntime> rt, int device)
      : engine(engine), rt(std::move(rt)), device(device) {
    std::promise<void> ready;
    auto started = ready.get_future();
    issuer = std::thread([this, &ready] {
      try {
        bind_device();
        stream = this->rt->stream_create();
        ready.set_value();
      } catch (...) {
        ready.set_exception(std::current_exception());
        return;
      }
      issue_loop();
    });
    try {
      started.get();
    } catch (...) {
      issuer.join();
      throw;
    }
    completer = std::thread([this] {
      try {
        bind_device();
      } catch (const Error&) {
        // event_synchronize below then fails, and the tickets carry that error.
      }
      complete_loop();
    });
  }

  void bind_device() {
    if (!rt->device_is_host()) rt->set_device(device);
  }

  ~Lane() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    issuer.join();
    completer.join();
    for (int i = 0; i < 2; ++i) {
      if (bounce[i] != nullptr) rt->host_free_pinned(bounce[i]);
      if (bounce_free[i] != nullptr) rt->event_destroy(bounce_free[i]);
    }
    rt->stream_destroy(stream);
  }

  void push(Job job) {
    {
      std::lock_guard<std::mutex> lock(mu);
      jobs.push_back(std::move(job));
    }
    cv.notify_all();
  }

  void issue_loop() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || !jobs.empty(); });
      if (jobs.empty()) {  // stop, and everything issued
        inflight_closed = true;
        cv.notify_all();
        return;
      }
      Job job = std::move(jobs.front());
      jobs.pop_front();
      lock.unlock();
      std::exception_ptr error;
      try {
        if (job.after != nullptr) rt->stream_wait_event(stream, job.after);
        job.issue(*this);
        rt->event_record(job.ticket->event_, stream);
        {
          std::lock_guard<std::mutex> tlock(job.ticket->mu_);
          job.ticket->issued_ = true;
        }
        job.ticket->cv_.notify_all();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      inflight.push_back({std::move(job), error});
      cv.notify_all();
    }
  }

  void complete_loop() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return !inflight.empty() || inflight_closed; });
      if (inflight.empty()) return;
      auto [job, error] = std::move(inflight.front());
      inflight.pop_front();
      lock.unlock();
      if (!error) {
        try {
          rt->event_synchronize(job.ticket->event_);
        } catch (...) {
          error = std::current_exception();
        }
      }
      if (job.after != nullptr) {
        // The stream has passed the wait (its own event completed after it), so `after` is unused now.
        try {
          rt->event_destroy(job.after);
        } catch (const Error&) {
        }
      }
      engine->finish(*job.ticket, error);
      lock.lock();
    }
  }

  // Lazily allocated double buffer for staging pageable memory.
  void ensure_bounce(size_t chunk) {
    if (bounce[0] != nullptr) return;
    for (int i = 0; i < 2; ++i) {
      bounce[i] = rt->host_alloc_pinned(chunk);
      bounce_free[i] = rt->event_create(false);
    }
  }

  CopyEngine* engine;
  std::shared_ptr<DeviceRuntime> rt;
  int device;
  Stream stream = nullptr;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Job> jobs;
  std::deque<std::pair<Job, std::exception_ptr>> inflight;
  bool stop = false;
  bool inflight_closed = false;
  void* bounce[2] = {nullptr, nullptr};
  Event bounce_free[2] = {nullptr, nullptr};
  bool bounce_recorded[2] = {false, false};  // an event never recorded must not be waited on (ACL)
  std::thread issuer, completer;
};

// ------------------------------------------------------------------------------------------ CopyEngine

CopyEngine::CopyEngine(std::shared_ptr<DeviceRuntime> runtime, EngineOptions options)
    : rt_(std::move(runtime)), options_(options), id_(g_next_engine_id++) {
  MSRL_CHECK(rt_ != nullptr, kInvalidArgument, "runtime is null");
  MSRL_CHECK(options_.device >= 0, kInvalidArgument, "device index must be >= 0, got ", options_.device);
  MSRL_CHECK(options_.chunk_bytes >= 4096 && options_.chunk_bytes <= (size_t{1} << 32), kInvalidArgument,
             "chunk_bytes must be in [4096, 2^32], got ", options_.chunk_bytes);
}

CopyEngine::~CopyEngine() {
  for (auto& lane : lanes_) lane.reset();  // joins after draining submitted work
}

CopyEngine::Lane& CopyEngine::lane_for(CopyKind kind) const {
  int index = kind == CopyKind::kDeviceToHost ? 1 : kind == CopyKind::kDeviceToDevice ? 2 : 0;
  std::lock_guard<std::mutex> lock(mu_);
  auto& lane = const_cast<std::unique_ptr<Lane>&>(lanes_[index]);
  if (!lane) lane = std::make_unique<Lane>(const_cast<CopyEngine*>(this), rt_, options_.device);
  return *lane;
}

Stream CopyEngine::stream(CopyKind kind) const { return lane_for(kind).stream; }

std::shared_ptr<Ticket> CopyEngine::submit(CopyKind kind, uint64_t bytes, Stream after,
                                           std::function<void(Lane&)> issue) {
  Lane& lane = lane_for(kind);
  Event event = rt_->event_create(false);
  Event after_event = nullptr;
  if (after != nullptr) {
    try {
      after_event = rt_->event_create(false);
      rt_->event_record(after_event, after);  // captures the caller's work enqueued so far
    } catch (...) {
      if (after_event != nullptr) rt_->event_destroy(after_event);
      rt_->event_destroy(event);
      throw;
    }
  }
  std::shared_ptr<Ticket> ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ticket.reset(new Ticket(rt_, id_, next_ticket_++, bytes, event));
    ++stats_.submitted;
    (kind == CopyKind::kHostToDevice   ? stats_.bytes_h2d
     : kind == CopyKind::kDeviceToHost ? stats_.bytes_d2h
                                       : stats_.bytes_other) += bytes;
  }
  lane.push({ticket, after_event, std::move(issue)});
  return ticket;
}

void CopyEngine::finish(Ticket& ticket, std::exception_ptr error) {
  // Stats first, so a caller woken by the ticket sees them already counted.
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++(error ? stats_.failed : stats_.completed);
  }
  {
    std::lock_guard<std::mutex> lock(ticket.mu_);
    ticket.done_ = true;
    ticket.error_ = error;
    ticket.finished_ = Clock::now();
  }
  ticket.cv_.notify_all();
  idle_cv_.notify_all();
}

std::shared_ptr<Ticket> CopyEngine::copy(void* dst, const void* src, size_t nbytes, CopyKind kind, Stream after) {
  MSRL_CHECK(dst != nullptr || nbytes == 0, kInvalidArgument, "copy destination is a null pointer");
  MSRL_CHECK(src != nullptr || nbytes == 0, kInvalidArgument, "copy source is a null pointer");
  MSRL_CHECK(nbytes < (uint64_t{1} << 48), kInvalidArgument, "copy size ", nbytes, " is negative or too large");
  auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  MSRL_CHECK(nbytes == 0 || d + nbytes <= s || s + nbytes <= d, kInvalidArgument, "source ", src, " and destination ",
             dst, " overlap within ", nbytes, " bytes");
  bool host_device = !rt_->device_is_host() || options_.force_bounce;
  bool bounce_in = host_device && kind == CopyKind::kHostToDevice && !PinnedPool::is_pinned(src, nbytes);
  bool bounce_out = host_device && kind == CopyKind::kDeviceToHost && !PinnedPool::is_pinned(dst, nbytes);
  if (bounce_in || bounce_out) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bounced_bytes += nbytes;
  }
  auto* dstc = static_cast<char*>(dst);
  auto* srcc = static_cast<const char*>(src);
  return submit(kind, nbytes, after, [this, dstc, srcc, nbytes, kind, bounce_in, bounce_out](Lane& lane) {
    if (nbytes == 0) return;
    if (bounce_in) {
      copy_bounced_h2d(lane, dstc, srcc, nbytes);
    } else if (bounce_out) {
      copy_bounced_d2h(lane, dstc, srcc, nbytes);
    } else {
      rt_->memcpy_async(dstc, srcc, nbytes, kind, lane.stream);
    }
  });
}

std::shared_ptr<Ticket> CopyEngine::copy_batch(std::vector<CopyRegion> regions, CopyKind kind, Stream after) {
  bool host_device = !rt_->device_is_host() || options_.force_bounce;
  std::vector<CopyRegion> direct, bounced;
  std::vector<std::pair<uintptr_t, uintptr_t>> dst_spans;
  uint64_t total = 0, staged = 0;
  for (size_t i = 0; i < regions.size(); ++i) {
    const CopyRegion& r = regions[i];
    if (r.nbytes == 0) continue;
    MSRL_CHECK(r.nbytes < (uint64_t{1} << 48), kInvalidArgument, "region ", i, ": size ", r.nbytes,
               " is negative or too large");
    MSRL_CHECK(r.dst != nullptr && r.src != nullptr, kInvalidArgument, "region ", i, ": ",
               r.dst == nullptr ? "destination" : "source", " is a null pointer");
    auto d = reinterpret_cast<uintptr_t>(r.dst), s = reinterpret_cast<uintptr_t>(r.src);
    MSRL_CHECK(d + r.nbytes <= s || s + r.nbytes <= d, kInvalidArgument, "region ", i, ": source ", r.src,
               " and destination ", r.dst, " overlap within ", r.nbytes, " bytes");
    dst_spans.push_back({d, d + r.nbytes});
    bool bounce = host_device && ((kind == CopyKind::kHostToDevice && !PinnedPool::is_pinned(r.src, r.nbytes)) ||
                                  (kind == CopyKind::kDeviceToHost && !PinnedPool::is_pinned(r.dst, r.nbytes)));
    (bounce ? bounced : direct).push_back(r);
    total += r.nbytes;
    if (bounce) staged += r.nbytes;
  }
  std::sort(dst_spans.begin(), dst_spans.end());
  for (size_t k = 1; k < dst_spans.size(); ++k) {
    MSRL_CHECK(dst_spans[k].first >= dst_spans[k - 1].second, kInvalidArgument,
               "two regions write overlapping destination bytes at 0x", std::hex, dst_spans[k].first);
  }
  if (staged > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bounced_bytes += staged;
  }
  return submit(kind, total, after, [this, kind, direct = std::move(direct), bounced = std::move(bounced)](Lane& lane) {
    if (!direct.empty()) rt_->memcpy_batch_async(direct.data(), direct.size(), kind, lane.stream);
    for (const CopyRegion& r : bounced) {
      auto* dst = static_cast<char*>(r.dst);
      auto* src = static_cast<const char*>(r.src);
      if (kind == CopyKind::kHostToDevice) {
        copy_bounced_h2d(lane, dst, src, r.nbytes);
      } else {
        copy_bounced_d2h(lane, dst, src, r.nbytes);
      }
    }
  });
}

std::shared_ptr<Ticket> CopyEngine::execute(std::shared_ptr<const CopyPlan> plan, void* dst, size_t dst_bytes,
                                            const void* src, size_t src_bytes, CopyKind kind, Stream after) {
  MSRL_CHECK(plan != nullptr, kInvalidArgument, "plan is null");
  MSRL_CHECK(dst != nullptr, kInvalidArgument, "plan destination is a null pointer");
  MSRL_CHECK(src != nullptr, kInvalidArgument, "plan source is a null pointer");
  plan->check_bounds(src_bytes, dst_bytes);
  auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  MSRL_CHECK(d + dst_bytes <= s || s + src_bytes <= d, kInvalidArgument, "plan source ", src, "+", src_bytes,
             " and destination ", dst, "+", dst_bytes, " overlap");
  auto* dstc = static_cast<char*>(dst);
  auto* srcc = static_cast<const char*>(src);
  return submit(kind, plan->bytes(), after, [this, plan, dstc, srcc, kind](Lane& lane) {
    const auto& descs = plan->descriptors();
    rt_->plan_async(descs.data(), descs.size(), dstc, srcc, kind, lane.stream);
  });
}

// Pageable → device: the CPU stages chunk i+1 into one pinned buffer while the DMA engine drains chunk i
// from the other.
void CopyEngine::copy_bounced_h2d(Lane& lane, char* dst, const char* src, size_t nbytes) {
  size_t chunk = options_.chunk_bytes;
  lane.ensure_bounce(chunk);
  for (size_t off = 0, i = 0; off < nbytes; off += chunk, ++i) {
    size_t len = std::min(chunk, nbytes - off);
    int b = static_cast<int>(i % 2);
    // The buffer's previous DMA (of this copy or an earlier one on the lane) must be done.
    if (lane.bounce_recorded[b]) rt_->event_synchronize(lane.bounce_free[b]);
    parallel_memcpy(lane.bounce[b], src + off, len);
    rt_->memcpy_async(dst + off, lane.bounce[b], len, CopyKind::kHostToDevice, lane.stream);
    rt_->event_record(lane.bounce_free[b], lane.stream);
    lane.bounce_recorded[b] = true;
  }
}

// Device → pageable: DMA of chunk i+1 into one pinned buffer overlaps the CPU draining chunk i.
void CopyEngine::copy_bounced_d2h(Lane& lane, char* dst, const char* src, size_t nbytes) {
  size_t chunk = options_.chunk_bytes;
  lane.ensure_bounce(chunk);
  size_t chunks = (nbytes + chunk - 1) / chunk;
  auto issue = [&](size_t i) {
    size_t off = i * chunk, len = std::min(chunk, nbytes - off);
    int b = static_cast<int>(i % 2);
    rt_->memcpy_async(lane.bounce[b], src + off, len, CopyKind::kDeviceToHost, lane.stream);
    rt_->event_record(lane.bounce_free[b], lane.stream);
  };
  issue(0);
  for (size_t i = 0; i < chunks; ++i) {
    if (i + 1 < chunks) issue(i + 1);
    int b = static_cast<int>(i % 2);
    rt_->event_synchronize(lane.bounce_free[b]);
    size_t off = i * chunk, len = std::min(chunk, nbytes - off);
    parallel_memcpy(dst + off, lane.bounce[b], len);
  }
}

void CopyEngine::wait(const Ticket& ticket, double timeout_seconds) const {
  MSRL_CHECK(ticket.engine_id_ == id_, kInvalidArgument, "ticket ", ticket.id_, " belongs to engine ",
             ticket.engine_id_, ", not to this engine (", id_, ")");
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(std::max(0.0, timeout_seconds)));
  std::unique_lock<std::mutex> lock(ticket.mu_);
  if (!ticket.cv_.wait_until(lock, deadline, [&] { return ticket.done_; })) {
    MSRL_THROW(kTimeout, "copy ticket ", ticket.id_, " (", ticket.bytes_, " bytes) not done after ", timeout_seconds,
               " s");
  }
  if (ticket.error_) std::rethrow_exception(ticket.error_);
}

void CopyEngine::order_stream(const Ticket& ticket, Stream stream, double timeout_seconds) const {
  MSRL_CHECK(ticket.engine_id_ == id_, kInvalidArgument, "ticket ", ticket.id_, " belongs to engine ",
             ticket.engine_id_, ", not to this engine (", id_, ")");
  // The ticket's event is recorded once its job is issued; wait for that (not for the copy itself).
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(std::max(0.0, timeout_seconds)));
  std::unique_lock<std::mutex> lock(ticket.mu_);
  if (!ticket.cv_.wait_until(lock, deadline, [&] { return ticket.done_ || ticket.issued_; })) {
    MSRL_THROW(kTimeout, "copy ticket ", ticket.id_, " was not issued within ", timeout_seconds, " s");
  }
  if (ticket.done_) return;
  lock.unlock();
  rt_->stream_wait_event(stream, ticket.event_);
}

void CopyEngine::synchronize(double timeout_seconds) {
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(std::max(0.0, timeout_seconds)));
  std::unique_lock<std::mutex> lock(mu_);
  if (!idle_cv_.wait_until(lock, deadline, [&] { return stats_.completed + stats_.failed == stats_.submitted; })) {
    MSRL_THROW(kTimeout, "copy engine has ", stats_.submitted - stats_.completed - stats_.failed,
               " copies still running after ", timeout_seconds, " s");
  }
}

EngineStats CopyEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace msrl
