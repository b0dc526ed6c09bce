#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "common/error.h"
#include "runtime/device_runtime.h"

using namespace msrl;

TEST(HostRuntime, CopiesRunInStreamOrderAndEventsMarkCompletion) {
  auto rt = make_host_runtime();
  Stream s = rt->stream_create();
  std::vector<int> a(1 << 20), b(1 << 20, 0), c(1 << 20, 0);
  std::iota(a.begin(), a.end(), 0);
  Event ev = rt->event_create(true);
  // b <- a then c <- b: FIFO order on one stream makes c equal a.
  rt->memcpy_async(b.data(), a.data(), a.size() * sizeof(int), CopyKind::kHostToDevice, s);
  rt->memcpy_async(c.data(), b.data(), b.size() * sizeof(int), CopyKind::kDeviceToHost, s);
  rt->event_record(ev, s);
  rt->event_synchronize(ev);
  EXPECT_TRUE(rt->event_query(ev));
  EXPECT_EQ(c, a);
  rt->event_destroy(ev);
  rt->stream_destroy(s);
}

TEST(HostRuntime, StreamWaitEventOrdersAcrossStreams) {
  auto rt = make_host_runtime();
  Stream s1 = rt->stream_create(), s2 = rt->stream_create();
  Event gate = rt->event_create(false);
  std::atomic<int> step{0};
  std::vector<char> src(64, 'x'), dst(64, 0);
  // s1 is held busy by a large copy; s2's copy must wait for s1's event.
  std::vector<char> big_src(64 << 20, 1), big_dst(64 << 20, 0);
  rt->memcpy_async(big_dst.data(), big_src.data(), big_src.size(), CopyKind::kHostToHost, s1);
  rt->event_record(gate, s1);
  rt->stream_wait_event(s2, gate);
  rt->memcpy_async(dst.data(), src.data(), src.size(), CopyKind::kHostToHost, s2);
  rt->stream_synchronize(s2);
  EXPECT_TRUE(rt->event_query(gate));  // s2 finished, so the gate had completed
  EXPECT_EQ(big_dst[big_dst.size() - 1], 1);
  EXPECT_EQ(dst, src);
  rt->event_destroy(gate);
  rt->stream_destroy(s1);
  rt->stream_destroy(s2);
}

TEST(HostRuntime, Memcpy2DCopiesPitchedRows) {
  auto rt = make_host_runtime();
  std::vector<uint8_t> src(10 * 16), dst(10 * 8, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i);
  rt->memcpy2d_async(dst.data(), 8, src.data() + 4, 16, 8, 10, CopyKind::kHostToHost, nullptr);
  for (size_t r = 0; r < 10; ++r)
    for (size_t c = 0; c < 8; ++c) EXPECT_EQ(dst[r * 8 + c], src[r * 16 + 4 + c]);
}

TEST(HostRuntime, ElapsedTimeIsNonNegativeAndNeedsTimingEvents) {
  auto rt = make_host_runtime();
  Stream s = rt->stream_create();
  Event a = rt->event_create(true), b = rt->event_create(true), c = rt->event_create(false);
  rt->event_record(a, s);
  std::vector<char> x(8 << 20, 1), y(8 << 20);
  rt->memcpy_async(y.data(), x.data(), x.size(), CopyKind::kHostToHost, s);
  rt->event_record(b, s);
  rt->event_record(c, s);
  rt->stream_synchronize(s);
  EXPECT_GE(rt->event_elapsed_ms(a, b), 0.0f);
  try {
    rt->event_elapsed_ms(a, c);
    FAIL() << "expected InvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
  }
  for (Event e : {a, b, c}) rt->event_destroy(e);
  rt->stream_destroy(s);
}

TEST(HostRuntime, RegisterRejectsOverlapAndUnknownPointers) {
  auto rt = make_host_runtime();
  std::vector<char> buf(8192);
  rt->host_register(buf.data(), 4096, false);
  EXPECT_THROW(rt->host_register(buf.data() + 100, 100, false), Error);
  rt->host_register(buf.data() + 4096, 4096, false);  // adjacent is fine
  rt->host_unregister(buf.data());
  try {
    rt->host_unregister(buf.data());
    FAIL() << "expected NotFound";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
  }
  rt->host_unregister(buf.data() + 4096);
  EXPECT_THROW(rt->host_register(nullptr, 10, false), Error);
}

TEST(HostRuntime, ForeignStreamHandleIsRejected) {
  auto rt = make_host_runtime();
  int not_a_stream = 0;
  char a = 1, b = 0;
  try {
    rt->memcpy_async(&b, &a, 1, CopyKind::kHostToHost, &not_a_stream);
    FAIL() << "expected InvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("not a live stream"), std::string::npos);
  }
}

TEST(RuntimeSelection, UnknownDeviceNameIsInvalidArgument) {
  try {
    get_runtime("tpu");
    FAIL() << "expected InvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(e.message().find("tpu"), std::string::npos);
  }
  EXPECT_STREQ(get_runtime("host")->name(), "host");
  EXPECT_STREQ(get_runtime("cpu")->name(), "host");
  auto infos = probe_backends();
  ASSERT_EQ(infos.size(), 3u);
  EXPECT_EQ(infos[0].name, "host");
  EXPECT_TRUE(infos[0].available);
}
