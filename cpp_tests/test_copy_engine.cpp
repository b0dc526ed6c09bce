#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <numeric>
#include <vector>

#include "common/error.h"
#include "copy/copy_engine.h"
#include "memory/pinned_pool.h"
#include "test_util.h"

using namespace msrl;
using msrl::testing::code_of;

TEST(CopyEngine, PageableRoundTripThroughPinned) {
  auto rt = make_host_runtime();
  auto pool = PinnedPool::create(rt);
  CopyEngine engine(rt);
  std::vector<uint32_t> src(5'000'000), back(src.size(), 0);
  std::iota(src.begin(), src.end(), 1);
  size_t n = src.size() * 4;
  auto pinned = pool->allocate(n);
  auto t1 = engine.copy(pinned->data(), src.data(), n, CopyKind::kHostToDevice);
  engine.wait(*t1, 30);
  auto t2 = engine.copy(back.data(), pinned->data(), n, CopyKind::kDeviceToHost);
  engine.wait(*t2, 30);
  EXPECT_EQ(back, src);
  EXPECT_TRUE(t1->done());
  EXPECT_GE(t2->seconds(), 0.0);
  EXPECT_EQ(engine.stats().completed, 2u);
  EXPECT_EQ(engine.stats().bounced_bytes, 0u);  // host backend: no staging needed
}

TEST(CopyEngine, BouncedPathsAreExactForOddSizes) {
  auto rt = make_host_runtime();
  EngineOptions o;
  o.chunk_bytes = 4096;
  o.force_bounce = true;
  CopyEngine engine(rt, o);
  for (size_t n : {size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, size_t{3 * 4096 + 5}, size_t{1 << 20}}) {
    std::vector<uint8_t> src(n), mid(n, 0), back(n, 0);
    for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(i * 13 + n);
    engine.wait(*engine.copy(mid.data(), src.data(), n, CopyKind::kHostToDevice), 30);
    engine.wait(*engine.copy(back.data(), mid.data(), n, CopyKind::kDeviceToHost), 30);
    EXPECT_EQ(back, src) << n;
  }
  EXPECT_GT(engine.stats().bounced_bytes, 0u);
}

TEST(CopyEngine, ExecutesPlansAndChecksBounds) {
  auto rt = make_host_runtime();
  CopyEngine engine(rt);
  std::vector<uint8_t> src(1 << 16), dst(1 << 15, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i);
  auto plan = std::make_shared<CopyPlan>(std::vector<CopyDescriptor>{{0, 0, 128, 128, 256, 128}});
  engine.wait(*engine.execute(plan, dst.data(), dst.size(), src.data(), src.size(), CopyKind::kHostToDevice), 30);
  for (size_t r = 0; r < 128; ++r) EXPECT_EQ(dst[r * 128 + 5], static_cast<uint8_t>(r * 256 + 5));
  EXPECT_EQ(code_of([&] { engine.execute(plan, dst.data(), 100, src.data(), src.size(), CopyKind::kHostToDevice); }),
            Code::kInvalidArgument);
}

TEST(CopyEngine, RejectsBadInputAndForeignTickets) {
  auto rt = make_host_runtime();
  CopyEngine a(rt), b(rt);
  std::vector<char> x(100), y(100);
  EXPECT_EQ(code_of([&] { a.copy(nullptr, x.data(), 10, CopyKind::kHostToHost); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] { a.copy(x.data() + 10, x.data(), 20, CopyKind::kHostToHost); }), Code::kInvalidArgument);
  auto t = a.copy(y.data(), x.data(), 100, CopyKind::kHostToHost);
  EXPECT_EQ(code_of([&] { b.wait(*t, 1); }), Code::kInvalidArgument);
  a.wait(*t, 10);
}

TEST(CopyEngine, AfterStreamOrdersTheCopyBehindCallerWork) {
  auto rt = make_host_runtime();
  CopyEngine engine(rt);
  Stream caller = rt->stream_create();
  std::vector<uint8_t> big(96 << 20, 3), staged(96 << 20, 0), out(96 << 20, 0);
  // Caller enqueues big -> staged on its own stream; the engine copies staged -> out after it.
  rt->memcpy_async(staged.data(), big.data(), big.size(), CopyKind::kHostToHost, caller);
  auto t = engine.copy(out.data(), staged.data(), staged.size(), CopyKind::kHostToDevice, caller);
  engine.wait(*t, 60);
  EXPECT_EQ(out[out.size() - 1], 3);
  EXPECT_EQ(out[0], 3);
  // And the reverse: the caller's stream waits for the engine's ticket.
  std::vector<uint8_t> z(out.size(), 0);
  auto t2 = engine.copy(staged.data(), big.data(), big.size(), CopyKind::kHostToDevice);
  engine.order_stream(*t2, caller, 10);
  rt->memcpy_async(z.data(), staged.data(), staged.size(), CopyKind::kHostToHost, caller);
  rt->stream_synchronize(caller);
  EXPECT_EQ(z[z.size() - 1], 3);
  rt->stream_destroy(caller);
}

// Host runtime whose copies block until the test opens a gate: makes "not done yet" deterministic.
class GatedRuntime : public DeviceRuntime {
 public:
  explicit GatedRuntime(std::shared_ptr<DeviceRuntime> inner) : in_(std::move(inner)) {}
  void open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  const char* name() const override { return in_->name(); }
  bool device_is_host() const override { return true; }
  int device_count() override { return 1; }
  void set_device(int d) override { in_->set_device(d); }
  void* host_alloc_pinned(size_t n) override { return in_->host_alloc_pinned(n); }
  void host_free_pinned(void* p) override { in_->host_free_pinned(p); }
  void host_register(void* p, size_t n, bool ro) override { in_->host_register(p, n, ro); }
  void host_unregister(void* p) override { in_->host_unregister(p); }
  void* device_alloc(size_t n) override { return in_->device_alloc(n); }
  void device_free(void* p) override { in_->device_free(p); }
  Stream stream_create() override { return in_->stream_create(); }
  void stream_destroy(Stream s) override { in_->stream_destroy(s); }
  void stream_synchronize(Stream s) override { in_->stream_synchronize(s); }
  void stream_wait_event(Stream s, Event e) override { in_->stream_wait_event(s, e); }
  void memcpy_async(void* d, const void* s, size_t n, CopyKind k, Stream st) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
    in_->memcpy_async(d, s, n, k, st);
  }
  void memcpy2d_async(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, CopyKind k,
                      Stream st) override {
    in_->memcpy2d_async(d, dp, s, sp, w, h, k, st);
  }
  Event event_create(unsigned f) override { return in_->event_create(f); }
  void event_destroy(Event e) override { in_->event_destroy(e); }
  void event_record(Event e, Stream s) override { in_->event_record(e, s); }
  bool event_query(Event e) override { return in_->event_query(e); }
  void event_synchronize(Event e) override { in_->event_synchronize(e); }
  float event_elapsed_ms(Event a, Event b) override { return in_->event_elapsed_ms(a, b); }

 private:
  std::shared_ptr<DeviceRuntime> in_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

TEST(CopyEngine, WaitTimesOutWithoutLosingTheCopy) {
  auto gated = std::make_shared<GatedRuntime>(make_host_runtime());
  CopyEngine engine(gated);
  std::vector<char> x(1 << 20, 9), y(1 << 20, 0);
  auto t = engine.copy(y.data(), x.data(), x.size(), CopyKind::kHostToHost);
  EXPECT_EQ(code_of([&] { engine.wait(*t, 0.05); }), Code::kTimeout);
  EXPECT_EQ(code_of([&] { engine.synchronize(0.05); }), Code::kTimeout);
  EXPECT_FALSE(t->done());
  gated->open();
  engine.wait(*t, 60);
  EXPECT_EQ(y[y.size() - 1], 9);
  engine.synchronize(10);
}

TEST(CopyEngine, CopyBatchMovesManyBuffersAsOneTicket) {
  auto rt = make_host_runtime();
  for (bool bounce : {false, true}) {
    EngineOptions o;
    o.chunk_bytes = 4096;
    o.force_bounce = bounce;
    CopyEngine engine(rt, o);
    std::vector<std::vector<uint8_t>> src, dst;
    std::vector<CopyRegion> regions;
    for (size_t i = 0; i < 50; ++i) {
      size_t n = 1 + i * 997;  // odd sizes, some larger than a bounce chunk
      src.emplace_back(n);
      dst.emplace_back(n, 0);
      for (size_t b = 0; b < n; ++b) src.back()[b] = static_cast<uint8_t>(b * 7 + i);
    }
    for (size_t i = 0; i < src.size(); ++i) regions.push_back({dst[i].data(), src[i].data(), src[i].size()});
    regions.push_back({nullptr, nullptr, 0});  // empty regions are skipped
    auto t = engine.copy_batch(regions, CopyKind::kHostToDevice);
    engine.wait(*t, 30);
    EXPECT_EQ(dst, src) << "bounce=" << bounce;
    EXPECT_EQ(engine.stats().submitted, 1u);
    EXPECT_EQ(engine.stats().bounced_bytes > 0, bounce);
  }
}

TEST(CopyEngine, CopyBatchRejectsBadRegionsAndSubmitsNothing) {
  auto rt = make_host_runtime();
  CopyEngine engine(rt);
  std::vector<char> a(100), b(100);
  EXPECT_EQ(code_of([&] {
              engine.copy_batch({{b.data(), a.data(), 50}, {b.data() + 40, a.data(), 20}}, CopyKind::kHostToHost);
            }),
            Code::kInvalidArgument);  // destinations overlap
  EXPECT_EQ(code_of([&] {
              engine.copy_batch({{nullptr, a.data(), 5}}, CopyKind::kHostToHost);
            }),
            Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] {
              engine.copy_batch({{a.data() + 1, a.data(), 5}}, CopyKind::kHostToHost);
            }),
            Code::kInvalidArgument);  // source and destination overlap
  EXPECT_EQ(engine.stats().submitted, 0u);
}

TEST(CopyEngine, BackToBackBouncedCopiesDoNotReuseABusyBounceBuffer) {
  auto rt = make_host_runtime();
  EngineOptions o;
  o.chunk_bytes = 4096;
  o.force_bounce = true;
  CopyEngine engine(rt, o);
  std::vector<std::vector<uint8_t>> src, dst;
  std::vector<std::shared_ptr<Ticket>> tickets;
  for (int i = 0; i < 20; ++i) {
    src.emplace_back(4096 * 3 + 17, static_cast<uint8_t>(i + 1));
    dst.emplace_back(src.back().size(), 0);
  }
  for (int i = 0; i < 20; ++i)
    tickets.push_back(engine.copy(dst[i].data(), src[i].data(), src[i].size(), CopyKind::kHostToDevice));
  for (auto& t : tickets) engine.wait(*t, 30);
  EXPECT_EQ(dst, src);
}
