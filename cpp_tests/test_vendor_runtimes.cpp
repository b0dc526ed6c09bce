// The cuda and acl backends, run against the fake vendor libraries built beside the tests (fake_cudart.cpp,
// fake_ascendcl.cpp): one parameterised suite covers both. The fakes model device memory as tracked host
// memory, count every vendor call and fail one chosen call on request, so the tests check what the backend
// sent to the vendor as well as the bytes that arrived. A last suite runs the cuda backend on a real
// libcudart and GPU when the machine has them, and skips itself otherwise.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "copy/descriptor.h"
#include "fake_control.h"
#include "runtime/device_runtime.h"

namespace msrl {
namespace {

struct VendorCase {
  const char* backend;  // name() of the runtime, and the test-name suffix
  const char* library;  // path of the fake
  const char* prefix;   // prefix of the fake's control functions
  std::shared_ptr<DeviceRuntime> (*make)(const std::string&);
  const char* env;           // environment variable naming the library
  const char* first_symbol;  // the first symbol the loader resolves
  // Vendor entry points behind each operation.
  const char* host_alloc;
  const char* host_register;
  const char* host_unregister;
  const char* device_alloc;
  const char* memcpy;
  const char* memcpy2d;
  int oom_code;              // the vendor's out-of-memory code
  int failure_code;          // some other vendor error
  const char* failure_text;  // what the vendor's error text says for it
  Code overlap_code;         // registering an overlapping range
  Code unregistered_code;    // unregistering a pointer never registered
  bool d2d_native_2d;        // device-to-device 2-D copies use the vendor's 2-D call
  bool h2h_on_host;          // host-to-host copies run on the host (AscendCL's async copy refuses them)
};

const VendorCase kCuda{"cuda",
                       MSRL_FAKE_CUDART,
                       "fake_cudart",
                       make_cuda_runtime,
                       "MSRL_CUDART_PATH",
                       "cudaGetErrorString",
                       "cudaHostAlloc",
                       "cudaHostRegister",
                       "cudaHostUnregister",
                       "cudaMalloc",
                       "cudaMemcpyAsync",
                       "cudaMemcpy2DAsync",
                       2,
                       700,
                       "fake cudart error",
                       Code::kInvalidArgument,
                       Code::kNotFound,
                       true,
                       false};
const VendorCase kAcl{"acl",
                      MSRL_FAKE_ASCENDCL,
                      "fake_ascendcl",
                      make_acl_runtime,
                      "MSRL_ASCENDCL_PATH",
                      "aclInit",
                      "aclrtMallocHost",
                      "aclrtHostRegisterV2",
                      "aclrtHostUnregister",
                      "aclrtMalloc",
                      "aclrtMemcpyAsync",
                      "aclrtMemcpy2dAsync",
                      207001,
                      507011,
                      "fake: injected error 507011",
                      Code::kDeviceError,
                      Code::kDeviceError,
                      false,
                      true};

// gtest prints the parameter of a failing test with this, instead of a byte dump.
void PrintTo(const VendorCase& c, std::ostream* os) { *os << c.backend; }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Runs `f`, which must throw msrl::Error, and returns the error.
Error error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected an msrl::Error";
  return Error(Code::kNotFound, "<no error thrown>", __FILE__, __LINE__);
}

std::vector<unsigned char> pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed) % 251);
  return v;
}

class VendorRuntime : public ::testing::TestWithParam<VendorCase> {
 protected:
  // AscendCL needs a device (context) on the calling thread before streams, events and copies; CUDA's
  // current device is 0 until set. Both backends are used as a framework would: set the device first.
  void SetUp() override {
    const VendorCase& c = GetParam();
    fake_ = std::make_unique<msrl::testing::FakeLibrary>(c.library, c.prefix);
    ASSERT_TRUE(fake_->loaded());
    fake_->reset();
    fake_->set_device_count(2);
    rt_ = c.make(c.library);
    rt_->set_device(0);
  }
  void TearDown() override {
    rt_.reset();
    fake_.reset();
  }

  long long stat(const std::string& key) { return fake_->stat(key); }

  // A pinned buffer filled with `bytes`.
  char* pinned_with(const std::vector<unsigned char>& bytes) {
    auto* p = static_cast<char*>(rt_->host_alloc_pinned(bytes.size()));
    std::memcpy(p, bytes.data(), bytes.size());
    return p;
  }
  std::vector<unsigned char> read_device(const void* dev, size_t n) {
    auto* host = static_cast<char*>(rt_->host_alloc_pinned(n));
    rt_->memcpy_async(host, dev, n, CopyKind::kDeviceToHost, nullptr);
    rt_->stream_synchronize(nullptr);
    std::vector<unsigned char> out(host, host + n);
    rt_->host_free_pinned(host);
    return out;
  }

  std::unique_ptr<msrl::testing::FakeLibrary> fake_;
  std::shared_ptr<DeviceRuntime> rt_;
};

TEST_P(VendorRuntime, LoadsAndReportsDevices) {
  EXPECT_STREQ(rt_->name(), GetParam().backend);
  EXPECT_FALSE(rt_->device_is_host());
  EXPECT_EQ(rt_->device_count(), 2);
  rt_->set_device(1);
  EXPECT_EQ(error_of([&] { rt_->set_device(2); }).code(), Code::kInvalidArgument);
  EXPECT_EQ(error_of([&] { rt_->set_device(-1); }).code(), Code::kInvalidArgument);
  fake_->set_device_count(0);
  EXPECT_EQ(rt_->device_count(), 0);
}

TEST_P(VendorRuntime, PinnedAllocAndFree) {
  void* p = rt_->host_alloc_pinned(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(stat("live_host_allocs"), 1);
  EXPECT_EQ(stat(GetParam().host_alloc), 1);
  std::memset(p, 0x5a, 1000);
  EXPECT_EQ(static_cast<unsigned char*>(p)[999], 0x5a);
  rt_->host_free_pinned(p);
  EXPECT_EQ(stat("live_host_allocs"), 0);
  rt_->host_free_pinned(nullptr);  // a no-op, like free()
  EXPECT_EQ(error_of([&] { rt_->host_alloc_pinned(0); }).code(), Code::kInvalidArgument);
  EXPECT_EQ(stat(GetParam().host_alloc), 1) << "a zero-byte request must not reach the vendor";
}

TEST_P(VendorRuntime, RegisterAndUnregister) {
  const VendorCase& c = GetParam();
  void* buf = std::aligned_alloc(4096, 4 * 4096);
  rt_->host_register(buf, 4 * 4096, false);
  EXPECT_EQ(stat("live_registrations"), 1);
  EXPECT_EQ(stat(c.host_register), 1);
  Error overlap = error_of([&] { rt_->host_register(static_cast<char*>(buf) + 4096, 4096, false); });
  EXPECT_EQ(overlap.code(), c.overlap_code);
  EXPECT_TRUE(contains(overlap.message(), c.host_register)) << overlap.message();
  EXPECT_EQ(stat("live_registrations"), 1);
  rt_->host_unregister(buf);
  EXPECT_EQ(stat("live_registrations"), 0);
  Error again = error_of([&] { rt_->host_unregister(buf); });
  EXPECT_EQ(again.code(), c.unregistered_code);
  EXPECT_TRUE(contains(again.message(), c.host_unregister)) << again.message();
  std::free(buf);
}

TEST_P(VendorRuntime, DeviceAllocAndFree) {
  void* a = rt_->device_alloc(4096);
  void* b = rt_->device_alloc(1);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a, b);
  EXPECT_EQ(stat("live_device_allocs"), 2);
  rt_->device_free(a);
  rt_->device_free(b);
  rt_->device_free(nullptr);
  EXPECT_EQ(stat("live_device_allocs"), 0);
  EXPECT_EQ(error_of([&] { rt_->device_alloc(0); }).code(), Code::kInvalidArgument);
}

// Host -> device -> device -> host -> host on one stream; the fake rejects pointers that do not match the kind.
TEST_P(VendorRuntime, Copy1DInEveryDirection) {
  const size_t n = 3000;
  auto bytes = pattern(n, 7);
  char* src = pinned_with(bytes);
  char* mid = pinned_with(std::vector<unsigned char>(n, 0));
  char* dst = pinned_with(std::vector<unsigned char>(n, 0));
  void* d1 = rt_->device_alloc(n);
  void* d2 = rt_->device_alloc(n);
  Stream s = rt_->stream_create();
  rt_->memcpy_async(d1, src, n, CopyKind::kHostToDevice, s);
  rt_->memcpy_async(d2, d1, n, CopyKind::kDeviceToDevice, s);
  rt_->memcpy_async(mid, d2, n, CopyKind::kDeviceToHost, s);
  rt_->memcpy_async(dst, mid, n, CopyKind::kHostToHost, s);
  rt_->memcpy_async(dst, src, 0, CopyKind::kHostToHost, s);  // zero bytes: nothing to do
  rt_->stream_synchronize(s);
  EXPECT_EQ(stat(GetParam().memcpy), GetParam().h2h_on_host ? 3 : 4);
  EXPECT_EQ(std::memcmp(mid, bytes.data(), n), 0);
  EXPECT_EQ(std::memcmp(dst, bytes.data(), n), 0);
  // A copy whose kind does not match its pointers is the vendor's error, reported with the call.
  Error wrong = error_of([&] { rt_->memcpy_async(d1, src, n, CopyKind::kDeviceToHost, s); });
  EXPECT_EQ(wrong.code(), Code::kDeviceError);
  EXPECT_TRUE(contains(wrong.message(), GetParam().memcpy)) << wrong.message();
  rt_->stream_destroy(s);
  for (void* p : {d1, d2}) rt_->device_free(p);
  for (char* p : {src, mid, dst}) rt_->host_free_pinned(p);
  EXPECT_EQ(stat("live_streams"), 0);
}

// Rows and pitches are multiples of 64 bytes: AscendCL copies only between 64-byte aligned addresses.
TEST_P(VendorRuntime, Copy2DPitched) {
  const size_t rows = 5, width = 64, spitch = 128, dpitch = 192;
  auto bytes = pattern(rows * spitch, 3);
  char* src = pinned_with(bytes);
  auto* dev = static_cast<char*>(rt_->device_alloc(rows * dpitch));
  char* fill = pinned_with(std::vector<unsigned char>(rows * dpitch, 0xEE));
  rt_->memcpy_async(dev, fill, rows * dpitch, CopyKind::kHostToDevice, nullptr);
  Stream s = rt_->stream_create();
  rt_->memcpy2d_async(dev, dpitch, src, spitch, width, rows, CopyKind::kHostToDevice, s);
  rt_->stream_synchronize(s);
  EXPECT_EQ(stat(GetParam().memcpy2d), 1);
  auto got = read_device(dev, rows * dpitch);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t i = 0; i < dpitch; ++i) {
      unsigned char want = i < width ? bytes[r * spitch + i] : 0xEE;  // the padding is untouched
      ASSERT_EQ(got[r * dpitch + i], want) << "row " << r << " byte " << i;
    }
  }
  // Back to a packed host buffer, 2-D again.
  char* packed = pinned_with(std::vector<unsigned char>(rows * width, 0));
  rt_->memcpy2d_async(packed, width, dev, dpitch, width, rows, CopyKind::kDeviceToHost, s);
  rt_->stream_synchronize(s);
  EXPECT_EQ(stat(GetParam().memcpy2d), 2);
  for (size_t r = 0; r < rows; ++r) {
    EXPECT_EQ(std::memcmp(packed + r * width, bytes.data() + r * spitch, width), 0) << "row " << r;
  }
  // Device to device: the acl backend copies row by row, the cuda one in one 2-D call.
  auto* dev2 = static_cast<char*>(rt_->device_alloc(rows * width));
  long long copies_before = stat(GetParam().memcpy);
  rt_->memcpy2d_async(dev2, width, dev, dpitch, width, rows, CopyKind::kDeviceToDevice, s);
  rt_->stream_synchronize(s);
  if (GetParam().d2d_native_2d) {
    EXPECT_EQ(stat(GetParam().memcpy2d), 3);
  } else {
    EXPECT_EQ(stat(GetParam().memcpy2d), 2);
    EXPECT_EQ(stat(GetParam().memcpy) - copies_before, static_cast<long long>(rows));
  }
  auto got2 = read_device(dev2, rows * width);
  for (size_t r = 0; r < rows; ++r) {
    EXPECT_EQ(std::memcmp(got2.data() + r * width, bytes.data() + r * spitch, width), 0) << "row " << r;
  }
  rt_->stream_destroy(s);
  rt_->device_free(dev);
  rt_->device_free(dev2);
  for (char* p : {src, fill, packed}) rt_->host_free_pinned(p);
}

// The default DeviceRuntime::plan_async: one 1-D copy per single-row descriptor, one 2-D copy per strided one.
TEST_P(VendorRuntime, PlanAsyncIssuesEveryDescriptor) {
  std::vector<CopyDescriptor> plan(3);
  plan[0] = {0, 0, 1, 100, 0, 0};
  plan[1] = {128, 128, 4, 16, 32, 24};  // offsets on 64-byte boundaries (AscendCL's rule)
  plan[2] = {320, 320, 1, 50, 0, 0};
  const size_t n = 512;
  auto bytes = pattern(n, 11);
  char* src = pinned_with(bytes);
  auto* dev = static_cast<char*>(rt_->device_alloc(n));
  char* zeros = pinned_with(std::vector<unsigned char>(n, 0));
  rt_->memcpy_async(dev, zeros, n, CopyKind::kHostToDevice, nullptr);
  long long copies = stat(GetParam().memcpy), copies2d = stat(GetParam().memcpy2d);
  Stream s = rt_->stream_create();
  rt_->plan_async(plan.data(), plan.size(), dev, src, CopyKind::kHostToDevice, s);
  rt_->stream_synchronize(s);
  EXPECT_EQ(stat(GetParam().memcpy) - copies, 2);
  EXPECT_EQ(stat(GetParam().memcpy2d) - copies2d, 1);
  std::vector<unsigned char> want(n, 0);
  for (const auto& d : plan) {
    for (uint64_t r = 0; r < d.rows; ++r) {
      std::memcpy(want.data() + d.dst_offset + r * d.dst_pitch, bytes.data() + d.src_offset + r * d.src_pitch,
                  d.row_bytes);
    }
  }
  EXPECT_EQ(read_device(dev, n), want);
  rt_->stream_destroy(s);
  rt_->device_free(dev);
  rt_->host_free_pinned(src);
  rt_->host_free_pinned(zeros);
}

TEST_P(VendorRuntime, EventsRecordQuerySynchronizeAndTime) {
  Stream s = rt_->stream_create();
  Event start = rt_->event_create(true);
  Event end = rt_->event_create(true);
  EXPECT_EQ(stat("live_events"), 2);
  rt_->event_record(start, s);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  rt_->event_record(end, s);
  rt_->event_synchronize(end);
  EXPECT_TRUE(rt_->event_query(start));
  EXPECT_TRUE(rt_->event_query(end));
  float ms = rt_->event_elapsed_ms(start, end);
  EXPECT_GE(ms, 15.0f);
  EXPECT_LT(ms, 10000.0f);
  // Work queued behind a held stream: the event is pending until the stream runs.
  fake_->hold(s, true);
  rt_->event_record(end, s);
  EXPECT_FALSE(rt_->event_query(end));
  fake_->hold(s, false);
  EXPECT_TRUE(rt_->event_query(end));
  rt_->event_synchronize(end);
  rt_->event_destroy(start);
  rt_->event_destroy(end);
  rt_->stream_destroy(s);
  EXPECT_EQ(stat("live_events"), 0);
}

TEST_P(VendorRuntime, StreamWaitsForEvent) {
  const size_t n = 256;
  auto bytes = pattern(n, 5);
  char* src = pinned_with(bytes);
  auto* dst = static_cast<char*>(rt_->device_alloc(n));
  char* zeros = pinned_with(std::vector<unsigned char>(n, 0));
  rt_->memcpy_async(dst, zeros, n, CopyKind::kHostToDevice, nullptr);
  Stream producer = rt_->stream_create();
  Stream consumer = rt_->stream_create();
  Event ready = rt_->event_create(false);
  fake_->hold(producer, true);
  rt_->event_record(ready, producer);
  rt_->stream_wait_event(consumer, ready);
  rt_->memcpy_async(dst, src, n, CopyKind::kHostToDevice, consumer);
  EXPECT_FALSE(rt_->event_query(ready));
  EXPECT_EQ(read_device(dst, n)[0], 0) << "the copy ran before the event it waits for";
  fake_->hold(producer, false);
  rt_->stream_synchronize(consumer);
  EXPECT_TRUE(rt_->event_query(ready));
  EXPECT_EQ(read_device(dst, n), bytes);
  rt_->event_destroy(ready);
  rt_->stream_destroy(producer);
  rt_->stream_destroy(consumer);
  rt_->device_free(dst);
  rt_->host_free_pinned(src);
  rt_->host_free_pinned(zeros);
}

TEST_P(VendorRuntime, VendorErrorIsDeviceErrorNamingTheCall) {
  const VendorCase& c = GetParam();
  char* src = pinned_with(pattern(64, 1));
  void* dev = rt_->device_alloc(64);
  fake_->fail_next(c.memcpy, c.failure_code);
  Error e = error_of([&] { rt_->memcpy_async(dev, src, 64, CopyKind::kHostToDevice, nullptr); });
  EXPECT_EQ(e.code(), Code::kDeviceError);
  EXPECT_TRUE(contains(e.message(), c.memcpy)) << e.message();
  EXPECT_TRUE(contains(e.message(), std::to_string(c.failure_code))) << e.message();
  EXPECT_TRUE(contains(e.message(), c.failure_text)) << e.message();
  EXPECT_TRUE(contains(e.what(), "DeviceError")) << e.what();
  rt_->memcpy_async(dev, src, 64, CopyKind::kHostToDevice, nullptr);  // injection is one-shot
  EXPECT_EQ(read_device(dev, 64), pattern(64, 1));
  rt_->device_free(dev);
  rt_->host_free_pinned(src);
}

TEST_P(VendorRuntime, VendorOutOfMemoryIsOutOfMemory) {
  const VendorCase& c = GetParam();
  fake_->fail_next(c.device_alloc, c.oom_code);
  Error dev = error_of([&] { rt_->device_alloc(1 << 20); });
  EXPECT_EQ(dev.code(), Code::kOutOfMemory);
  EXPECT_TRUE(contains(dev.message(), c.device_alloc)) << dev.message();
  EXPECT_TRUE(contains(dev.message(), "1048576")) << dev.message();
  fake_->fail_next(c.host_alloc, c.oom_code);
  EXPECT_EQ(error_of([&] { rt_->host_alloc_pinned(4096); }).code(), Code::kOutOfMemory);
  EXPECT_EQ(stat("live_device_allocs"), 0);
  EXPECT_EQ(stat("live_host_allocs"), 0);
}

TEST_P(VendorRuntime, NullAndEmptyArgumentsNeverReachTheVendor) {
  const VendorCase& c = GetParam();
  char* buf = pinned_with(std::vector<unsigned char>(64, 1));
  Stream s = rt_->stream_create();
  auto invalid = [](const std::function<void()>& f) { return error_of(f).code() == Code::kInvalidArgument; };
  EXPECT_TRUE(invalid([&] { rt_->memcpy_async(nullptr, buf, 8, CopyKind::kHostToHost, s); }));
  EXPECT_TRUE(invalid([&] { rt_->memcpy_async(buf, nullptr, 8, CopyKind::kHostToHost, s); }));
  EXPECT_TRUE(invalid([&] { rt_->memcpy2d_async(nullptr, 8, buf, 8, 8, 2, CopyKind::kHostToHost, s); }));
  EXPECT_TRUE(invalid([&] { rt_->memcpy2d_async(buf, 8, buf + 32, 16, 12, 2, CopyKind::kHostToHost, s); }));
  EXPECT_TRUE(invalid([&] { rt_->host_register(nullptr, 4096, false); }));
  EXPECT_TRUE(invalid([&] { rt_->host_register(buf, 0, false); }));
  EXPECT_TRUE(invalid([&] { rt_->host_unregister(nullptr); }));
  EXPECT_TRUE(invalid([&] { rt_->device_alloc(0); }));
  EXPECT_TRUE(invalid([&] { rt_->stream_destroy(nullptr); }));
  EXPECT_TRUE(invalid([&] { rt_->event_record(nullptr, s); }));
  EXPECT_TRUE(invalid([&] { rt_->event_query(nullptr); }));
  EXPECT_TRUE(invalid([&] { rt_->event_synchronize(nullptr); }));
  EXPECT_TRUE(invalid([&] { rt_->stream_wait_event(s, nullptr); }));
  EXPECT_TRUE(invalid([&] { rt_->event_destroy(nullptr); }));
  for (const char* fn : {c.memcpy, c.memcpy2d, c.host_register, c.host_unregister, c.device_alloc}) {
    EXPECT_EQ(stat(fn), 0) << fn;
  }
  rt_->memcpy2d_async(buf, 8, buf + 32, 8, 0, 4, CopyKind::kHostToHost, s);  // empty: nothing to do
  EXPECT_EQ(stat(c.memcpy2d), 0);
  rt_->stream_destroy(s);
  rt_->host_free_pinned(buf);
}

TEST_P(VendorRuntime, MissingLibraryIsUnavailable) {
  Error e = error_of([&] { GetParam().make("/nonexistent/libvendor.so"); });
  EXPECT_EQ(e.code(), Code::kUnavailable);
  EXPECT_TRUE(contains(e.message(), "/nonexistent/libvendor.so")) << e.message();
}

TEST_P(VendorRuntime, LibraryWithoutTheSymbolsIsUnavailable) {
  Error e = error_of([&] { GetParam().make("libm.so.6"); });
  EXPECT_EQ(e.code(), Code::kUnavailable);
  EXPECT_TRUE(contains(e.message(), GetParam().first_symbol)) << e.message();
  EXPECT_TRUE(contains(e.message(), "libm.so.6")) << e.message();
}

TEST_P(VendorRuntime, EnvironmentVariableNamesTheLibrary) {
  const VendorCase& c = GetParam();
  const char* saved = std::getenv(c.env);
  std::string restore = saved != nullptr ? saved : "";
  setenv(c.env, c.library, 1);
  auto rt = c.make("");
  EXPECT_STREQ(rt->name(), c.backend);
  EXPECT_EQ(rt->device_count(), 2);
  // An explicit path that does not load is an error, never a silent fallback to another copy.
  setenv(c.env, "/nonexistent/from-env.so", 1);
  Error e = error_of([&] { c.make(""); });
  EXPECT_EQ(e.code(), Code::kUnavailable);
  EXPECT_TRUE(contains(e.message(), "/nonexistent/from-env.so")) << e.message();
  if (saved != nullptr) {
    setenv(c.env, restore.c_str(), 1);
  } else {
    unsetenv(c.env);
  }
}

INSTANTIATE_TEST_SUITE_P(Fake, VendorRuntime, ::testing::Values(kCuda, kAcl),
                         [](const ::testing::TestParamInfo<VendorCase>& info) { return info.param.backend; });

// The cuda backend on the machine's own libcudart. Skips without one, or without a GPU and driver; on a
// machine with the library but no driver it still proves every symbol resolves and device_count() is 0.
TEST(VendorRuntimeRealCuda, CopiesOnTheGpu) {
  std::shared_ptr<DeviceRuntime> rt;
  try {
    rt = make_cuda_runtime();
  } catch (const Error& e) {
    ASSERT_EQ(e.code(), Code::kUnavailable) << e.what();
    GTEST_SKIP() << "no libcudart: " << e.message();
  }
  EXPECT_STREQ(rt->name(), "cuda");
  int devices = rt->device_count();
  ASSERT_GE(devices, 0);
  if (devices == 0) GTEST_SKIP() << "libcudart loaded, but no GPU or driver";
  rt->set_device(0);
  const size_t rows = 64, width = 1000, pitch = 1024;
  auto bytes = pattern(rows * pitch, 9);
  auto* src = static_cast<char*>(rt->host_alloc_pinned(rows * pitch));
  auto* dst = static_cast<char*>(rt->host_alloc_pinned(rows * width));
  std::memcpy(src, bytes.data(), rows * pitch);
  std::memset(dst, 0, rows * width);
  void* dev = rt->device_alloc(rows * width);
  Stream s = rt->stream_create();
  Event start = rt->event_create(true);
  Event end = rt->event_create(true);
  rt->event_record(start, s);
  rt->memcpy2d_async(dev, width, src, pitch, width, rows, CopyKind::kHostToDevice, s);
  rt->memcpy_async(dst, dev, rows * width, CopyKind::kDeviceToHost, s);
  rt->event_record(end, s);
  rt->event_synchronize(end);
  EXPECT_TRUE(rt->event_query(end));
  EXPECT_GE(rt->event_elapsed_ms(start, end), 0.0f);
  for (size_t r = 0; r < rows; ++r) {
    ASSERT_EQ(std::memcmp(dst + r * width, bytes.data() + r * pitch, width), 0) << "row " << r;
  }
  rt->event_destroy(start);
  rt->event_destroy(end);
  rt->stream_destroy(s);
  rt->device_free(dev);
  rt->host_free_pinned(src);
  rt->host_free_pinned(dst);
}

}  // namespace
}  // namespace msrl
