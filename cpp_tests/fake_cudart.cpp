// A fake libcudart for the tests: exports the functions in MSRL_CUDART_SYMBOLS (checked at compile time below)
// plus cudaPeekAtLastError (for the tests), backed by host memory (fake_device.h), and the control functions
// of FAKE_DEFINE_CONTROLS with the prefix fake_cudart (error injection, call counters, stream holds).
// What it models of the CUDA runtime, as documented:
// - streams from cudaStreamCreateWithFlags are blocking (they synchronise with the legacy default stream,
//   handle 0) unless created with cudaStreamNonBlocking;
// - streams and events belong to the device current when they were made; cudaEventRecord fails
//   (cudaErrorInvalidResourceHandle) for an event and a stream of different devices; cudaStreamWaitEvent and
//   copies on another device's stream are allowed;
// - every failing call (cudaErrorNotReady included) sets the thread's last error, which cudaGetLastError
//   returns and clears and cudaPeekAtLastError returns;
// - cudaPointerGetAttributes: cudaMemoryTypeHost for cudaHostAlloc'd or registered memory, Device for
//   cudaMalloc'd, Unregistered (with cudaSuccess, as since CUDA 11) for any other host pointer;
// - cudaHostRegister of pages mapped read-only fails (cudaErrorInvalidValue) without cudaHostRegisterReadOnly;
// - a copy from or to pageable host memory returns only once complete (counted as pageable_copies).
// Never installed.
#include <type_traits>

#include "../csrc/runtime/cuda_abi.h"
#include "fake_device.h"

using namespace msrl::cudaabi;

namespace {
fake::Device g_dev(/*cuda=*/true);
}  // namespace

FAKE_DEFINE_CONTROLS(fake_cudart, g_dev)

// Locks the device, counts the call and returns an injected error if one is pending. Every return goes
// through RETURN, which leaves a failure as the thread's last error.
#define ENTER(fn)                               \
  std::unique_lock<std::mutex> lock_(g_dev.mu); \
  if (int injected_ = g_dev.enter(#fn)) RETURN(injected_)
#define RETURN(code) return g_dev.note(code)

extern "C" {

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorCudartUnloading: return "driver shutting down";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    default: return "fake cudart error";
  }
}

cudaError_t cudaGetLastError() {
  std::lock_guard<std::mutex> lock(g_dev.mu);
  int code = g_dev.thread().last_error;
  g_dev.thread().last_error = cudaSuccess;
  return code;
}

cudaError_t cudaPeekAtLastError() {
  std::lock_guard<std::mutex> lock(g_dev.mu);
  return g_dev.thread().last_error;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  ENTER(cudaRuntimeGetVersion);
  if (version == nullptr) RETURN(cudaErrorInvalidValue);
  *version = 13000;
  RETURN(cudaSuccess);
}

cudaError_t cudaGetDeviceCount(int* count) {
  ENTER(cudaGetDeviceCount);
  if (count == nullptr) RETURN(cudaErrorInvalidValue);
  *count = 0;
  if (g_dev.device_count == 0) RETURN(cudaErrorNoDevice);
  *count = g_dev.device_count;
  RETURN(cudaSuccess);
}

cudaError_t cudaGetDevice(int* device) {
  ENTER(cudaGetDevice);
  if (device == nullptr) RETURN(cudaErrorInvalidValue);
  *device = g_dev.current_device();
  RETURN(cudaSuccess);
}

cudaError_t cudaSetDevice(int device) {
  ENTER(cudaSetDevice);
  if (device < 0 || device >= g_dev.device_count) RETURN(cudaErrorInvalidDevice);
  g_dev.set_current_device(device);
  RETURN(cudaSuccess);
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  ENTER(cudaPointerGetAttributes);
  if (attributes == nullptr || ptr == nullptr) RETURN(cudaErrorInvalidValue);
  attributes->device = -2;  // not the device of anything
  attributes->devicePointer = nullptr;
  attributes->hostPointer = nullptr;
  if (g_dev.is_device(ptr, 1)) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = g_dev.device_of(ptr);
    attributes->devicePointer = const_cast<void*>(ptr);
  } else if (g_dev.is_pinned(ptr, 1)) {
    attributes->type = cudaMemoryTypeHost;
    attributes->hostPointer = const_cast<void*>(ptr);
  } else {
    attributes->type = cudaMemoryTypeUnregistered;
  }
  RETURN(cudaSuccess);
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned) {
  ENTER(cudaHostAlloc);
  if (ptr == nullptr) RETURN(cudaErrorInvalidValue);
  *ptr = g_dev.alloc_host(size);
  RETURN(*ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation);
}

cudaError_t cudaFreeHost(void* ptr) {
  ENTER(cudaFreeHost);
  RETURN(ptr == nullptr || g_dev.free_host(ptr) ? cudaSuccess : cudaErrorInvalidValue);
}

cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned flags) {
  ENTER(cudaHostRegister);
  if (ptr == nullptr || size == 0) RETURN(cudaErrorInvalidValue);
  if ((flags & cudaHostRegisterReadOnly) == 0 && !fake::host_range_writable(ptr, size)) {
    RETURN(cudaErrorInvalidValue);  // read-only pages are pinned for writing unless told otherwise
  }
  if (flags & cudaHostRegisterReadOnly) g_dev.count("registrations_read_only");
  RETURN(g_dev.register_range(ptr, size) == 0 ? cudaSuccess : cudaErrorHostMemoryAlreadyRegistered);
}

cudaError_t cudaHostUnregister(void* ptr) {
  ENTER(cudaHostUnregister);
  RETURN(g_dev.unregister_range(ptr) ? cudaSuccess : cudaErrorHostMemoryNotRegistered);
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  ENTER(cudaMalloc);
  if (ptr == nullptr) RETURN(cudaErrorInvalidValue);
  *ptr = g_dev.alloc_device(size);
  RETURN(*ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void* ptr) {
  ENTER(cudaFree);
  RETURN(ptr == nullptr || g_dev.free_device(ptr) ? cudaSuccess : cudaErrorInvalidValue);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
  ENTER(cudaStreamCreateWithFlags);
  if (stream == nullptr) RETURN(cudaErrorInvalidValue);
  *stream = reinterpret_cast<cudaStream_t>(g_dev.new_stream((flags & cudaStreamNonBlocking) == 0));
  RETURN(cudaSuccess);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  ENTER(cudaStreamDestroy);
  if (stream == nullptr || !g_dev.valid_stream(stream)) RETURN(cudaErrorInvalidResourceHandle);
  g_dev.destroy_stream(stream);
  RETURN(cudaSuccess);
}

// Blocks until the stream drained; a hold nobody releases within 5 s fails instead of hanging the test.
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  ENTER(cudaStreamSynchronize);
  if (!g_dev.valid_stream(stream)) RETURN(cudaErrorInvalidResourceHandle);
  if (!g_dev.drained(lock_, stream)) RETURN(cudaErrorUnknown);
  g_dev.wait_idle(lock_, stream);
  RETURN(cudaSuccess);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) {
  ENTER(cudaStreamWaitEvent);
  fake::Event* ev = g_dev.event(event);
  if (!g_dev.valid_stream(stream) || ev == nullptr) RETURN(cudaErrorInvalidResourceHandle);
  g_dev.wait(stream, ev);  // across devices too, as CUDA allows
  RETURN(cudaSuccess);
}

namespace {
cudaError_t copy(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                 cudaMemcpyKind kind, cudaStream_t stream, std::unique_lock<std::mutex>& lock) {
  if (!g_dev.kind_matches(kind, dst, dpitch, src, spitch, width, height)) return cudaErrorInvalidValue;
  bool pinned = g_dev.host_side_pinned(kind, dst, dpitch, src, spitch, width, height);
  g_dev.copy2d(dst, dpitch, src, spitch, width, height, stream);
  if (!pinned) {  // pageable: staged by the driver, the call returns once the copy is done
    g_dev.count("pageable_copies");
    g_dev.finish_synchronously(lock, stream);
  }
  return cudaSuccess;
}
}  // namespace

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
  ENTER(cudaMemcpyAsync);
  if (dst == nullptr || src == nullptr || !g_dev.valid_stream(stream)) RETURN(cudaErrorInvalidValue);
  if (count == 0) RETURN(cudaSuccess);
  RETURN(copy(dst, count, src, count, count, 1, kind, stream, lock_));
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream) {
  ENTER(cudaMemcpy2DAsync);
  if (dst == nullptr || src == nullptr || width > dpitch || width > spitch || !g_dev.valid_stream(stream)) {
    RETURN(cudaErrorInvalidValue);
  }
  if (width == 0 || height == 0) RETURN(cudaSuccess);
  RETURN(copy(dst, dpitch, src, spitch, width, height, kind, stream, lock_));
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags) {
  ENTER(cudaEventCreateWithFlags);
  if (event == nullptr) RETURN(cudaErrorInvalidValue);
  if (flags & cudaEventBlockingSync) g_dev.count("events_blocking_sync");
  *event = reinterpret_cast<cudaEvent_t>(g_dev.new_event((flags & cudaEventDisableTiming) == 0, flags));
  RETURN(cudaSuccess);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  ENTER(cudaEventDestroy);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr) RETURN(cudaErrorInvalidResourceHandle);
  g_dev.destroy_event(ev);
  RETURN(cudaSuccess);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  ENTER(cudaEventRecord);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr || !g_dev.valid_stream(stream)) RETURN(cudaErrorInvalidResourceHandle);
  // "cudaEventRecord() will fail if the input event and input stream are associated to different devices"
  if (ev->device != g_dev.device_of_stream(stream)) RETURN(cudaErrorInvalidResourceHandle);
  g_dev.record(ev, stream);
  RETURN(cudaSuccess);
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  ENTER(cudaEventQuery);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr) RETURN(cudaErrorInvalidResourceHandle);
  RETURN(g_dev.complete(ev) ? cudaSuccess : cudaErrorNotReady);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  ENTER(cudaEventSynchronize);
  fake::Event* ev = g_dev.event(event);
  if (ev == nullptr) RETURN(cudaErrorInvalidResourceHandle);
  if (!g_dev.reached(lock_, ev)) RETURN(cudaErrorUnknown);  // a hold nobody releases
  g_dev.wait_event(lock_, ev);
  RETURN(cudaSuccess);
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  ENTER(cudaEventElapsedTime);
  fake::Event* a = g_dev.event(start);
  fake::Event* b = g_dev.event(end);
  if (ms == nullptr) RETURN(cudaErrorInvalidValue);
  if (a == nullptr || b == nullptr || !a->timing || !b->timing) RETURN(cudaErrorInvalidResourceHandle);
  if (a->recorded == 0 || b->recorded == 0 || !g_dev.complete(a) || !g_dev.complete(b)) RETURN(cudaErrorNotReady);
  *ms = std::chrono::duration<float, std::milli>(b->when - a->when).count();
  RETURN(cudaSuccess);
}

}  // extern "C"

// Every symbol the backend resolves is exported here with the signature of our ABI header, which the vendor
// ABI conformance test (vendor_abi/cuda_conformance.cpp) proves equal to NVIDIA's: fake and real agree.
#define FAKE_CHECK_SIGNATURE(name, ret, params) \
  static_assert(std::is_same_v<decltype(&::name), name##_fn>, "fake " #name " does not match cuda_abi.h");
MSRL_CUDART_SYMBOLS(FAKE_CHECK_SIGNATURE)
static_assert(std::is_same_v<decltype(&::cudaPeekAtLastError), cudaGetLastError_fn>,
              "cudaPeekAtLastError has cudaGetLastError's signature");
