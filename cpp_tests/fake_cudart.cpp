// A fake libcudart for the tests: exports exactly the functions in MSRL_CUDART_SYMBOLS (checked at compile
// time below), backed by host memory (fake_device.h), plus the control functions of FAKE_DEFINE_CONTROLS
// with the prefix fake_cudart (error injection, call counters, stream holds). Never installed.
#include <type_traits>

#include "../csrc/runtime/cuda_abi.h"
#include "fake_device.h"

using namespace msrl::cudaabi;

namespace {
fake::Device g_dev;
}  // namespace

FAKE_DEFINE_CONTROLS(fake_cudart, g_dev)

// Locks the device, counts the call and returns an injected error if one is pending.
#define ENTER(fn)                              \
  std::lock_guard<std::mutex> lock_(g_dev.mu); \
  if (int injected_ = g_dev.enter(#fn)) return injected_

extern "C" {

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    default: return "fake cudart error";
  }
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  ENTER(cudaRuntimeGetVersion);
  if (version == nullptr) return cudaErrorInvalidValue;
  *version = 13000;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  ENTER(cudaGetDeviceCount);
  if (count == nullptr) return cudaErrorInvalidValue;
  *count = 0;
  if (g_dev.device_count == 0) return cudaErrorNoDevice;
  *count = g_dev.device_count;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  ENTER(cudaSetDevice);
  return device >= 0 && device < g_dev.device_count ? cudaSuccess : cudaErrorInvalidDevice;
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned) {
  ENTER(cudaHostAlloc);
  if (ptr == nullptr) return cudaErrorInvalidValue;
  *ptr = g_dev.alloc_host(size);
  return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeHost(void* ptr) {
  ENTER(cudaFreeHost);
  return ptr == nullptr || g_dev.free_host(ptr) ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned) {
  ENTER(cudaHostRegister);
  if (ptr == nullptr || size == 0) return cudaErrorInvalidValue;
  return g_dev.register_range(ptr, size) == 0 ? cudaSuccess : cudaErrorHostMemoryAlreadyRegistered;
}

cudaError_t cudaHostUnregister(void* ptr) {
  ENTER(cudaHostUnregister);
  return g_dev.unregister_range(ptr) ? cudaSuccess : cudaErrorHostMemoryNotRegistered;
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  ENTER(cudaMalloc);
  if (ptr == nullptr) return cudaErrorInvalidValue;
  *ptr = g_dev.alloc_device(size);
  return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFree(void* ptr) {
  ENTER(cudaFree);
  return ptr == nullptr || g_dev.free_device(ptr) ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  ENTER(cudaStreamCreateWithFlags);
  if (stream == nullptr) return cudaErrorInvalidValue;
  *stream = reinterpret_cast<cudaStream_t>(g_dev.new_stream());
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  ENTER(cudaStreamDestroy);
  if (stream == nullptr || !g_dev.valid_stream(stream)) return cudaErrorInvalidResourceHandle;
  g_dev.destroy_stream(stream);
  return cudaSuccess;
}

// A held stream never drains; report that instead of hanging the test.
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  ENTER(cudaStreamSynchronize);
  if (!g_dev.valid_stream(stream)) return cudaErrorInvalidResourceHandle;
  return g_dev.idle(stream) ? cudaSuccess : cudaErrorUnknown;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) {
  ENTER(cudaStreamWaitEvent);
  fake::Event* ev = g_dev.event(event);
  if (!g_dev.valid_stream(stream) || ev == nullptr) return cudaErrorInvalidResourceHandle;
  g_dev.wait(stream, ev);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
  ENTER(cudaMemcpyAsync);
  if (dst == nullptr || src == nullptr || !g_dev.valid_stream(stream)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  if (!g_dev.kind_matches(kind, dst, count, src, count, count, 1)) return cudaErrorInvalidValue;
  g_dev.copy2d(dst, count, src, count, count, 1, stream);
  return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream) {
  ENTER(cudaMemcpy2DAsync);
  if (dst == nullptr || src == nullptr || width > dpitch || width > spitch || !g_dev.valid_stream(stream)) {
    return cudaErrorInvalidValue;
  }
  if (width == 0 || height == 0) return cudaSuccess;
  if (!g_dev.kind_matches(kind, dst, dpitch, src, spitch, width, height)) return cudaErrorInvalidValue;
  g_dev.copy2d(dst, dpitch, src, spitch, width, height, stream);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags) {
  ENTER(cudaEventCreateWithFlags);
  if (event == nullptr) return cudaErrorInvalidValue;
  *event = reinterpret_cast<cudaEvent_t>(g_dev.new_event((flags & cudaEventDisableTiming) == 0));
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  ENTER(cudaEventDestroy);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr) return cudaErrorInvalidResourceHandle;
  g_dev.destroy_event(ev);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  ENTER(cudaEventRecord);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr || !g_dev.valid_stream(stream)) return cudaErrorInvalidResourceHandle;
  g_dev.record(ev, stream);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  ENTER(cudaEventQuery);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr) return cudaErrorInvalidResourceHandle;
  return g_dev.complete(ev) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  ENTER(cudaEventSynchronize);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr) return cudaErrorInvalidResourceHandle;
  return g_dev.complete(ev) ? cudaSuccess : cudaErrorUnknown;  // held stream: would block forever
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  ENTER(cudaEventElapsedTime);
  fake::Event* a = g_dev.event(start);
  fake::Event* b = g_dev.event(end);
  if (ms == nullptr) return cudaErrorInvalidValue;
  if (a == nullptr || b == nullptr || !a->timing || !b->timing) return cudaErrorInvalidResourceHandle;
  if (a->recorded == 0 || b->recorded == 0 || !g_dev.complete(a) || !g_dev.complete(b)) return cudaErrorNotReady;
  *ms = std::chrono::duration<float, std::milli>(b->when - a->when).count();
  return cudaSuccess;
}

}  // extern "C"

// Every symbol the backend resolves is exported here with the signature of our ABI header, which the vendor
// ABI conformance test (vendor_abi/cuda_conformance.cpp) proves equal to NVIDIA's: fake and real agree.
#define FAKE_CHECK_SIGNATURE(name, ret, params) \
  static_assert(std::is_same_v<decltype(&::name), name##_fn>, "fake " #name " does not match cuda_abi.h");
MSRL_CUDART_SYMBOLS(FAKE_CHECK_SIGNATURE)
