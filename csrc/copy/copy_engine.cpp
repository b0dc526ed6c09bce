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

// Binds the calling thread to `device` for its scope and restores its previous device after: the caller's
// thread belongs to the caller (torch keeps its own current device there). A thread without a device yet
// (an ACL thread with no context) keeps the engine's.
class DeviceGuard {
 public:
  DeviceGuard(DeviceRuntime& rt, int device) : rt_(rt) {
    if (rt.device_is_host()) return;
    prev_ = rt.current_device();
    if (prev_ != device) {
      rt.set_device(device);
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (!switched_ || prev_ < 0) return;
    try {
      rt_.set_device(prev_);
    } catch (const std::exception&) {
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  DeviceRuntime& rt_;
  int prev_ = -1;
  bool switched_ = false;
};

// Runs `fn`, which may call the runtime, from a destructor: a runtime torn down before us (torch_npu
// finalises ACL in an atexit hook, before module globals are collected) must not turn a passing run into
// std::terminate.
template <typename Fn>
void quietly(Fn&& fn) noexcept {
  try {
    fn();
  } catch (const std::exception&) {
  }
}

// Splits `p` so that every piece fits in `chunk` bytes: groups of whole rows, or 1-D slices of a row longer
// than a chunk.
void split_piece(std::vector<CopyEngine::Piece>& out, const CopyEngine::Piece& p, uint64_t chunk) {
  if (p.rows == 0 || p.row_bytes == 0) return;
  if (p.row_bytes > chunk) {
    for (uint64_t r = 0; r < p.rows; ++r) {
      for (uint64_t off = 0; off < p.row_bytes; off += chunk) {
        uint64_t len = std::min(chunk, p.row_bytes - off);
        out.push_back({p.dst + r * p.dst_pitch + off, p.src + r * p.src_pitch + off, 1, len, len, len});
      }
    }
    return;
  }
  uint64_t per = chunk / p.row_bytes;
  for (uint64_t r = 0; r < p.rows; r += per) {
    uint64_t rows = std::min(per, p.rows - r);
    out.push_back({p.dst + r * p.dst_pitch, p.src + r * p.src_pitch, rows, p.row_bytes, p.src_pitch, p.dst_pitch});
  }
}

// Pieces packed into bounce-buffer batches of at most `chunk` bytes; each piece starts at an offset aligned
// to `align` inside its batch.
struct Batch {
  size_t first = 0, count = 0;
  std::vector<uint64_t> offsets;
};
std::vector<Batch> pack(const std::vector<CopyEngine::Piece>& pieces, uint64_t chunk, uint64_t align) {
  std::vector<Batch> out;
  uint64_t used = chunk + 1;  // forces a first batch
  for (size_t i = 0; i < pieces.size(); ++i) {
    uint64_t at = (used + align - 1) / align * align;
    if (out.empty() || at + pieces[i].bytes() > chunk) {
      out.push_back({i, 0, {}});
      at = 0;
    }
    out.back().offsets.push_back(at);
    ++out.back().count;
    used = at + pieces[i].bytes();
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------- Ticket

Ticket::Ticket(std::shared_ptr<DeviceRuntime> rt, uint64_t engine_id, uint64_t id, uint64_t bytes)
    : rt_(std::move(rt)), engine_id_(engine_id), id_(id), bytes_(bytes), submitted_(Clock::now()) {}

Ticket::~Ticket() {
  if (event_ != nullptr) quietly([&] { rt_->event_destroy(event_); });  // the lane destroys it normally
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
// Both threads bind the engine's device first: vendor devices (CUDA) and contexts (ACL) are per thread, and
// the lane's stream and events must belong to the engine's device.
struct CopyEngine::Lane {
  struct Job {
    std::shared_ptr<Ticket> ticket;
    Event after = nullptr;  // recorded on the caller's stream at submission
    std::function<void(Lane&)> issue;
  };

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
      if (bounce[i] != nullptr) quietly([&] { rt->host_free_pinned(bounce[i]); });
      if (bounce_free[i] != nullptr) quietly([&] { rt->event_destroy(bounce_free[i]); });
    }
    quietly([&] { rt->stream_destroy(stream); });
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
        // A host wait on the ticket (the completer's) sleeps rather than spinning a core.
        Event event = rt->event_create(kEventBlockingSync);
        {
          std::lock_guard<std::mutex> tlock(job.ticket->mu_);
          job.ticket->event_ = event;
        }
        if (job.after != nullptr) rt->stream_wait_event(stream, job.after);
        job.issue(*this);
        rt->event_record(event, stream);
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
      Ticket& t = *job.ticket;
      if (!error) {
        try {
          rt->event_synchronize(t.event_);  // event_ is only replaced by this thread, below
        } catch (...) {
          error = std::current_exception();
        }
      } else {
        // Part of the job may be on the stream still: let it drain before the caller reuses the buffers.
        quietly([&] { rt->stream_synchronize(stream); });
      }
      {
        std::lock_guard<std::mutex> tlock(t.mu_);  // order_stream uses the event under this lock
        if (t.event_ != nullptr) quietly([&] { rt->event_destroy(t.event_); });
        t.event_ = nullptr;
      }
      if (job.after != nullptr) {
        // The stream has passed the wait (its own event completed after it), so `after` is unused now.
        quietly([&] { rt->event_destroy(job.after); });
      }
      engine->finish(t, error);
      lock.lock();
    }
  }

  // Lazily allocated double buffer for staging host memory.
  void ensure_bounce(size_t chunk) {
    if (bounce[0] != nullptr) return;
    for (int i = 0; i < 2; ++i) {
      bounce[i] = static_cast<char*>(rt->host_alloc_pinned(chunk));
      bounce_free[i] = rt->event_create(kEventBlockingSync);
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
  char* bounce[2] = {nullptr, nullptr};
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

bool CopyEngine::aligned(const void* p) const {
  size_t a = rt_->copy_alignment();
  return a <= 1 || reinterpret_cast<uintptr_t>(p) % a == 0;
}

bool CopyEngine::direct_host(const void* p, size_t n) const {
  if (rt_->device_is_host() && !options_.force_bounce) return true;
  if (options_.force_bounce && rt_->device_is_host()) return PinnedPool::is_pinned(p, n);
  return aligned(p) && (PinnedPool::is_pinned(p, n) || rt_->host_is_pinned(p, n));
}

std::shared_ptr<Ticket> CopyEngine::submit(CopyKind kind, uint64_t bytes, const After& after,
                                           std::function<void(Lane&)> issue) {
  Lane& lane = lane_for(kind);
  Event after_event = nullptr;
  if (after.has_value()) {
    // On the engine's device: the caller's stream belongs to it, and an event recorded on a stream of
    // another device fails (CUDA and ACL alike).
    DeviceGuard guard(*rt_, options_.device);
    after_event = rt_->event_create(kEventDefault);
    try {
      rt_->event_record(after_event, *after);  // captures the caller's work enqueued so far
    } catch (...) {
      rt_->event_destroy(after_event);
      throw;
    }
  }
  std::shared_ptr<Ticket> ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ticket.reset(new Ticket(rt_, id_, next_ticket_++, bytes));
    ++stats_.submitted;
    if (after.has_value()) ++stats_.ordered;
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

std::shared_ptr<Ticket> CopyEngine::copy(void* dst, const void* src, size_t nbytes, CopyKind kind, After after) {
  MSRL_CHECK(dst != nullptr || nbytes == 0, kInvalidArgument, "copy destination is a null pointer");
  MSRL_CHECK(src != nullptr || nbytes == 0, kInvalidArgument, "copy source is a null pointer");
  MSRL_CHECK(nbytes < (uint64_t{1} << 48), kInvalidArgument, "copy size ", nbytes, " is negative or too large");
  auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  MSRL_CHECK(nbytes == 0 || d + nbytes <= s || s + nbytes <= d, kInvalidArgument, "source ", src, " and destination ",
             dst, " overlap within ", nbytes, " bytes");
  bool staged = nbytes > 0 && ((kind == CopyKind::kHostToDevice && !direct_host(src, nbytes)) ||
                               (kind == CopyKind::kDeviceToHost && !direct_host(dst, nbytes)));
  if (staged) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bounced_bytes += nbytes;
  }
  auto* dstc = static_cast<char*>(dst);
  auto* srcc = static_cast<const char*>(src);
  return submit(kind, nbytes, after, [this, dstc, srcc, nbytes, kind, staged](Lane& lane) {
    if (nbytes == 0) return;
    if (!staged) {
      rt_->memcpy_async(dstc, srcc, nbytes, kind, lane.stream);
      return;
    }
    std::vector<Piece> pieces;
    split_piece(pieces, {dstc, srcc, 1, nbytes, nbytes, nbytes}, options_.chunk_bytes);
    kind == CopyKind::kHostToDevice ? copy_staged_h2d(lane, pieces) : copy_staged_d2h(lane, pieces);
  });
}

std::shared_ptr<Ticket> CopyEngine::copy_batch(std::vector<CopyRegion> regions, CopyKind kind, After after) {
  std::vector<CopyRegion> direct;
  std::vector<Piece> staged;
  std::vector<std::pair<uintptr_t, uintptr_t>> dst_spans;
  uint64_t total = 0, staged_bytes = 0;
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
    bool stage = (kind == CopyKind::kHostToDevice && !direct_host(r.src, r.nbytes)) ||
                 (kind == CopyKind::kDeviceToHost && !direct_host(r.dst, r.nbytes));
    if (stage) {
      split_piece(staged, {static_cast<char*>(r.dst), static_cast<const char*>(r.src), 1, r.nbytes, r.nbytes, r.nbytes},
                  options_.chunk_bytes);
      staged_bytes += r.nbytes;
    } else {
      direct.push_back(r);
    }
    total += r.nbytes;
  }
  std::sort(dst_spans.begin(), dst_spans.end());
  for (size_t k = 1; k < dst_spans.size(); ++k) {
    MSRL_CHECK(dst_spans[k].first >= dst_spans[k - 1].second, kInvalidArgument,
               "two regions write overlapping destination bytes at 0x", std::hex, dst_spans[k].first);
  }
  if (staged_bytes > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bounced_bytes += staged_bytes;
  }
  return submit(kind, total, after, [this, kind, direct = std::move(direct), staged = std::move(staged)](Lane& lane) {
    if (!direct.empty()) rt_->memcpy_batch_async(direct.data(), direct.size(), kind, lane.stream);
    if (staged.empty()) return;
    kind == CopyKind::kHostToDevice ? copy_staged_h2d(lane, staged) : copy_staged_d2h(lane, staged);
  });
}

std::shared_ptr<Ticket> CopyEngine::execute(std::shared_ptr<const CopyPlan> plan, void* dst, size_t dst_bytes,
                                            const void* src, size_t src_bytes, CopyKind kind, After after) {
  MSRL_CHECK(plan != nullptr, kInvalidArgument, "plan is null");
  MSRL_CHECK(dst != nullptr, kInvalidArgument, "plan destination is a null pointer");
  MSRL_CHECK(src != nullptr, kInvalidArgument, "plan source is a null pointer");
  plan->check_bounds(src_bytes, dst_bytes);
  auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  MSRL_CHECK(d + dst_bytes <= s || s + src_bytes <= d, kInvalidArgument, "plan source ", src, "+", src_bytes,
             " and destination ", dst, "+", dst_bytes, " overlap");
  auto* dstc = static_cast<char*>(dst);
  auto* srcc = static_cast<const char*>(src);
  // The host side of a host<->device plan must be pinned and at addresses the runtime can copy (every
  // descriptor's rows), else every descriptor is staged through the bounce buffers.
  bool staged = false;
  if (kind == CopyKind::kHostToDevice || kind == CopyKind::kDeviceToHost) {
    bool h2d = kind == CopyKind::kHostToDevice;
    const char* host = h2d ? srcc : dstc;
    staged = !direct_host(host, h2d ? src_bytes : dst_bytes);
    for (size_t i = 0; !staged && rt_->copy_alignment() > 1 && i < plan->descriptors().size(); ++i) {
      const auto& dd = plan->descriptors()[i];
      uint64_t off = h2d ? dd.src_offset : dd.dst_offset, pitch = h2d ? dd.src_pitch : dd.dst_pitch;
      staged = !aligned(host + off) || (dd.rows > 1 && pitch % rt_->copy_alignment() != 0);
    }
  }
  if (staged) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bounced_bytes += plan->bytes();
  }
  return submit(kind, plan->bytes(), after, [this, plan, dstc, srcc, kind, staged](Lane& lane) {
    const auto& descs = plan->descriptors();
    if (!staged) {
      rt_->plan_async(descs.data(), descs.size(), dstc, srcc, kind, lane.stream);
      return;
    }
    std::vector<Piece> pieces;
    for (const auto& dd : descs) {
      split_piece(pieces,
                  {dstc + dd.dst_offset, srcc + dd.src_offset, dd.rows, dd.row_bytes, dd.src_pitch, dd.dst_pitch},
                  options_.chunk_bytes);
    }
    kind == CopyKind::kHostToDevice ? copy_staged_h2d(lane, pieces) : copy_staged_d2h(lane, pieces);
  });
}

// One device copy of a piece between its device side and its packed image in a bounce buffer.
void CopyEngine::issue_piece(Lane& lane, const Piece& p, char* dst, const char* src, CopyKind kind) {
  bool h2d = kind == CopyKind::kHostToDevice;
  if (p.rows == 1) {
    rt_->memcpy_async(dst, src, p.row_bytes, kind, lane.stream);
  } else {
    rt_->memcpy2d_async(dst, h2d ? p.dst_pitch : p.row_bytes, src, h2d ? p.row_bytes : p.src_pitch, p.row_bytes, p.rows,
                        kind, lane.stream);
  }
}

// Host -> device: the CPU packs batch i+1 into one pinned buffer while the DMA engine drains batch i from
// the other.
void CopyEngine::copy_staged_h2d(Lane& lane, const std::vector<Piece>& pieces) {
  size_t chunk = options_.chunk_bytes;
  lane.ensure_bounce(chunk);
  auto batches = pack(pieces, chunk, std::max<size_t>(64, rt_->copy_alignment()));
  for (size_t i = 0; i < batches.size(); ++i) {
    int b = static_cast<int>(i % 2);
    const Batch& batch = batches[i];
    // The buffer's previous DMA (of this copy or an earlier one on the lane) must be done.
    if (lane.bounce_recorded[b]) rt_->event_synchronize(lane.bounce_free[b]);
    for (size_t k = 0; k < batch.count; ++k) {
      const Piece& p = pieces[batch.first + k];
      char* img = lane.bounce[b] + batch.offsets[k];
      if (p.rows == 1) {
        parallel_memcpy(img, p.src, p.row_bytes);
      } else {
        for (uint64_t r = 0; r < p.rows; ++r) std::memcpy(img + r * p.row_bytes, p.src + r * p.src_pitch, p.row_bytes);
      }
    }
    for (size_t k = 0; k < batch.count; ++k) {
      const Piece& p = pieces[batch.first + k];
      issue_piece(lane, p, p.dst, lane.bounce[b] + batch.offsets[k], CopyKind::kHostToDevice);
    }
    rt_->event_record(lane.bounce_free[b], lane.stream);
    lane.bounce_recorded[b] = true;
  }
}

// Device -> host: the DMA of batch i+1 into one pinned buffer overlaps the CPU unpacking batch i.
void CopyEngine::copy_staged_d2h(Lane& lane, const std::vector<Piece>& pieces) {
  size_t chunk = options_.chunk_bytes;
  lane.ensure_bounce(chunk);
  auto batches = pack(pieces, chunk, std::max<size_t>(64, rt_->copy_alignment()));
  auto issue = [&](size_t i) {
    int b = static_cast<int>(i % 2);
    const Batch& batch = batches[i];
    for (size_t k = 0; k < batch.count; ++k) {
      const Piece& p = pieces[batch.first + k];
      issue_piece(lane, p, lane.bounce[b] + batch.offsets[k], p.src, CopyKind::kDeviceToHost);
    }
    rt_->event_record(lane.bounce_free[b], lane.stream);
    lane.bounce_recorded[b] = true;
  };
  if (batches.empty()) return;
  issue(0);
  for (size_t i = 0; i < batches.size(); ++i) {
    if (i + 1 < batches.size()) issue(i + 1);
    int b = static_cast<int>(i % 2);
    rt_->event_synchronize(lane.bounce_free[b]);
    const Batch& batch = batches[i];
    for (size_t k = 0; k < batch.count; ++k) {
      const Piece& p = pieces[batch.first + k];
      const char* img = lane.bounce[b] + batch.offsets[k];
      if (p.rows == 1) {
        parallel_memcpy(p.dst, img, p.row_bytes);
      } else {
        for (uint64_t r = 0; r < p.rows; ++r) std::memcpy(p.dst + r * p.dst_pitch, img + r * p.row_bytes, p.row_bytes);
      }
    }
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
  if (ticket.done_ || ticket.event_ == nullptr) return;
  // Under the ticket's lock: the lane destroys the event (once the copy is done) only under it.
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
