// A fake libascendcl for the tests: exports exactly the functions in MSRL_ACL_SYMBOLS and
// MSRL_ACL_OPTIONAL_SYMBOLS (checked at compile time below), backed by host memory (fake_device.h), plus
// the control functions of FAKE_DEFINE_CONTROLS with the prefix fake_ascendcl. What it models of AscendCL,
// as the CANN reference documents it (aclrtMemcpyAsync; "Stream and Event Behavior"):
// - a thread has no context until aclrtSetDevice: streams, events, device memory and copies need one
//   (ACL_ERROR_RT_CONTEXT_NULL), and aclrtGetDevice fails without one;
// - aclrtMemcpyAsync refuses ACL_MEMCPY_HOST_TO_HOST (ACL_ERROR_RT_FEATURE_NOT_SUPPORT) and addresses that are
//   not 64-byte aligned; copies on a stream of another device than the current one fail, and so do records
//   and stream waits between an event and a stream of different devices;
// - host<->device copies of host memory that is neither from aclrtMallocHost nor registered are refused
//   (the vendor: "does not report an error, but an unpredictable error may occur"; newer CANN: synchronous).
// Created streams never synchronise with the default (null) stream. Never installed.
#include <type_traits>

#include "../csrc/runtime/acl_abi.h"
#include "fake_device.h"

using namespace msrl::aclabi;

namespace {
fake::Device g_dev(/*cuda=*/false);
constexpr aclError kInvalidParam = ACL_ERROR_INVALID_PARAM;
constexpr aclError kBadHandle = ACL_ERROR_RT_PARAM_INVALID;
constexpr aclError kWouldBlock = ACL_ERROR_RT_INTERNAL_ERROR;  // a hold nobody releases: would never return
constexpr aclError kNotRegistered = ACL_ERROR_RT_PARAM_INVALID;
}  // namespace

FAKE_DEFINE_CONTROLS(fake_ascendcl, g_dev)

#define ENTER(fn)                               \
  std::unique_lock<std::mutex> lock_(g_dev.mu); \
  if (int injected_ = g_dev.enter(#fn)) return injected_
// The calls that need the calling thread to have a context (a device set on it).
#define NEEDS_CONTEXT() \
  if (!g_dev.has_context()) return ACL_ERROR_RT_CONTEXT_NULL

static bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % msrl::aclabi::kAclCopyAlignment == 0; }

extern "C" {

aclError aclInit(const char*) {
  ENTER(aclInit);
  if (g_dev.initialized) return ACL_ERROR_REPEAT_INITIALIZE;
  g_dev.initialized = true;
  return ACL_SUCCESS;
}

// Read-and-clear, per the AscendCL reference. The pointer stays valid until the next call. A static, not a
// thread_local: the runtime dlcloses this library, and a thread_local left in a closed module's TLS made
// LeakSanitizer's tracer crash at exit ("Tracer caught signal 11") under ctest.
const char* aclGetRecentErrMsg() {
  std::lock_guard<std::mutex> lock(g_dev.mu);
  static std::string msg;
  msg = g_dev.last_error;
  g_dev.last_error.clear();
  return msg.empty() ? nullptr : msg.c_str();
}

aclError aclrtGetDeviceCount(uint32_t* count) {
  ENTER(aclrtGetDeviceCount);
  if (count == nullptr) return kInvalidParam;
  *count = static_cast<uint32_t>(g_dev.device_count);
  return ACL_SUCCESS;
}

aclError aclrtSetDevice(int32_t device) {
  ENTER(aclrtSetDevice);
  if (device < 0 || device >= g_dev.device_count) return ACL_ERROR_RT_INVALID_DEVICEID;
  g_dev.set_current_device(device);
  return ACL_SUCCESS;
}

aclError aclrtGetDevice(int32_t* device) {
  ENTER(aclrtGetDevice);
  if (device == nullptr) return kInvalidParam;
  NEEDS_CONTEXT();
  *device = g_dev.current_device();
  return ACL_SUCCESS;
}

aclError aclrtMallocHost(void** ptr, size_t size) {
  ENTER(aclrtMallocHost);
  if (ptr == nullptr || size == 0) return kInvalidParam;
  *ptr = g_dev.alloc_host(size);
  return *ptr != nullptr ? ACL_SUCCESS : ACL_ERROR_RT_MEMORY_ALLOCATION;
}

aclError aclrtFreeHost(void* ptr) {
  ENTER(aclrtFreeHost);
  return g_dev.free_host(ptr) ? ACL_SUCCESS : kInvalidParam;
}

aclError aclrtMalloc(void** ptr, size_t size, aclrtMemMallocPolicy) {
  ENTER(aclrtMalloc);
  if (ptr == nullptr || size == 0) return kInvalidParam;
  NEEDS_CONTEXT();
  *ptr = g_dev.alloc_device(size);
  return *ptr != nullptr ? ACL_SUCCESS : ACL_ERROR_RT_MEMORY_ALLOCATION;
}

aclError aclrtFree(void* ptr) {
  ENTER(aclrtFree);
  return g_dev.free_device(ptr) ? ACL_SUCCESS : kInvalidParam;
}

aclError aclrtHostRegisterV2(void* ptr, uint64_t size, uint32_t flag) {
  ENTER(aclrtHostRegisterV2);
  if (ptr == nullptr || size == 0 || (flag & ~(ACL_HOST_REG_MAPPED | ACL_HOST_REG_PINNED)) != 0) return kInvalidParam;
  return g_dev.register_range(ptr, size) == 0 ? ACL_SUCCESS : kInvalidParam;
}

aclError aclrtHostRegister(void* ptr, uint64_t size, aclrtHostRegisterType, void** devPtr) {
  ENTER(aclrtHostRegister);
  if (ptr == nullptr || size == 0 || devPtr == nullptr) return kInvalidParam;
  if (g_dev.register_range(ptr, size) != 0) return kInvalidParam;
  *devPtr = ptr;
  return ACL_SUCCESS;
}

aclError aclrtHostUnregister(void* ptr) {
  ENTER(aclrtHostUnregister);
  return g_dev.unregister_range(ptr) ? ACL_SUCCESS : kNotRegistered;
}

aclError aclrtCreateStream(aclrtStream* stream) {
  ENTER(aclrtCreateStream);
  if (stream == nullptr) return kInvalidParam;
  NEEDS_CONTEXT();
  *stream = g_dev.new_stream(/*blocking=*/false);
  return ACL_SUCCESS;
}

aclError aclrtDestroyStream(aclrtStream stream) {
  ENTER(aclrtDestroyStream);
  if (stream == nullptr || !g_dev.valid_stream(stream)) return kBadHandle;
  g_dev.destroy_stream(stream);
  return ACL_SUCCESS;
}

aclError aclrtSynchronizeStream(aclrtStream stream) {
  ENTER(aclrtSynchronizeStream);
  if (!g_dev.valid_stream(stream)) return kBadHandle;
  if (!g_dev.drained(lock_, stream)) return kWouldBlock;
  g_dev.wait_idle(lock_, stream);
  return ACL_SUCCESS;
}

aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event) {
  ENTER(aclrtStreamWaitEvent);
  NEEDS_CONTEXT();
  fake::Event* ev = g_dev.event(event);
  if (!g_dev.valid_stream(stream) || ev == nullptr) return kBadHandle;
  if (ev->device != g_dev.device_of_stream(stream)) return kBadHandle;  // unlike CUDA: not across devices
  g_dev.wait(stream, ev);
  return ACL_SUCCESS;
}

namespace {
// The rules aclrtMemcpyAsync and aclrtMemcpy2dAsync share (see the top of this file).
aclError check_copy(int kind, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                    aclrtStream stream) {
  if (kind == ACL_MEMCPY_HOST_TO_HOST) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
  if (!aligned(dst) || !aligned(src)) return kInvalidParam;
  if (g_dev.device_of_stream(stream) != g_dev.current_device()) return kBadHandle;
  if (!g_dev.kind_matches(kind, dst, dpitch, src, spitch, width, height)) return kInvalidParam;
  if (!g_dev.host_side_pinned(kind, dst, dpitch, src, spitch, width, height)) return kInvalidParam;
  return ACL_SUCCESS;
}
}  // namespace

aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream) {
  ENTER(aclrtMemcpyAsync);
  if (dst == nullptr || src == nullptr || count == 0 || count > destMax || !g_dev.valid_stream(stream)) {
    return kInvalidParam;
  }
  NEEDS_CONTEXT();
  if (aclError err = check_copy(kind, dst, count, src, count, count, 1, stream)) return err;
  g_dev.copy2d(dst, count, src, count, count, 1, stream);
  return ACL_SUCCESS;
}

// As documented: host<->device only, width <= 5,000,000 and <= both pitches, height <= 5 * 2^20.
aclError aclrtMemcpy2dAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                            aclrtMemcpyKind kind, aclrtStream stream) {
  ENTER(aclrtMemcpy2dAsync);
  if (dst == nullptr || src == nullptr || width == 0 || height == 0 || width > dpitch || width > spitch ||
      width > kAclMemcpy2dMaxWidth || height > kAclMemcpy2dMaxHeight || !g_dev.valid_stream(stream) ||
      (kind != ACL_MEMCPY_HOST_TO_DEVICE && kind != ACL_MEMCPY_DEVICE_TO_HOST)) {
    return kInvalidParam;
  }
  NEEDS_CONTEXT();
  if (aclError err = check_copy(kind, dst, dpitch, src, spitch, width, height, stream)) return err;
  g_dev.copy2d(dst, dpitch, src, spitch, width, height, stream);
  return ACL_SUCCESS;
}

aclError aclrtCreateEvent(aclrtEvent* event) {
  ENTER(aclrtCreateEvent);
  if (event == nullptr) return kInvalidParam;
  NEEDS_CONTEXT();
  *event = g_dev.new_event(true);
  return ACL_SUCCESS;
}

aclError aclrtDestroyEvent(aclrtEvent event) {
  ENTER(aclrtDestroyEvent);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr) return kBadHandle;
  g_dev.destroy_event(ev);
  return ACL_SUCCESS;
}

aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
  ENTER(aclrtRecordEvent);
  NEEDS_CONTEXT();
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr || !g_dev.valid_stream(stream)) return kBadHandle;
  if (ev->device != g_dev.device_of_stream(stream)) return kBadHandle;
  g_dev.record(ev, stream);
  return ACL_SUCCESS;
}

// AscendCL reports a never-recorded event as not ready.
aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus* status) {
  ENTER(aclrtQueryEventStatus);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr || status == nullptr) return kBadHandle;
  bool done = ev->recorded > 0 && g_dev.complete(ev);
  *status = done ? ACL_EVENT_RECORDED_STATUS_COMPLETE : ACL_EVENT_RECORDED_STATUS_NOT_READY;
  return ACL_SUCCESS;
}

aclError aclrtSynchronizeEvent(aclrtEvent event) {
  ENTER(aclrtSynchronizeEvent);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr) return kBadHandle;
  if (!g_dev.reached(lock_, ev)) return kWouldBlock;
  g_dev.wait_event(lock_, ev);
  return ACL_SUCCESS;
}

aclError aclrtEventElapsedTime(float* ms, aclrtEvent start, aclrtEvent end) {
  ENTER(aclrtEventElapsedTime);
  fake::Event* a = g_dev.event(start);
  fake::Event* b = g_dev.event(end);
  if (ms == nullptr || a == nullptr || b == nullptr) return kBadHandle;
  if (a->recorded == 0 || b->recorded == 0 || !g_dev.complete(a) || !g_dev.complete(b)) return kInvalidParam;
  *ms = std::chrono::duration<float, std::milli>(b->when - a->when).count();
  return ACL_SUCCESS;
}

}  // extern "C"

// Every symbol the backend resolves is exported here with the signature of our ABI header, which the vendor
// ABI conformance test (vendor_abi/acl_conformance.cpp) proves equal to Huawei's: fake and real agree.
#define FAKE_CHECK_SIGNATURE(name, ret, params) \
  static_assert(std::is_same_v<decltype(&::name), name##_fn>, "fake " #name " does not match acl_abi.h");
MSRL_ACL_SYMBOLS(FAKE_CHECK_SIGNATURE)
MSRL_ACL_OPTIONAL_SYMBOLS(FAKE_CHECK_SIGNATURE)
