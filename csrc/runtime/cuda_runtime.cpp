// The CUDA backend: libcudart is loaded at run time with dlopen and resolved against our own ABI header
// (cuda_abi.h), so one build runs with or without CUDA and needs no toolkit to compile. Streams and events
// are the runtime's raw handles, so handles from torch (current_stream().cuda_stream) work as they are.
//
// The library handle is never closed: pinned buffers, streams and events may outlive any one runtime
// object, and unloading libcudart under them would turn a late free into a crash.
//
// Every failed call is followed by cudaGetLastError: the runtime keeps a failure as the calling thread's
// last error, and torch checks that error after its own kernel launches (C10_CUDA_KERNEL_LAUNCH_CHECK), so
// an error we already reported would resurface at an unrelated torch op.

#include <string>
#include <vector>

#include "common/error.h"
#include "runtime/cuda_abi.h"
#include "runtime/device_runtime.h"
#include "runtime/dl_library.h"

namespace msrl {
namespace {

using namespace cudaabi;

static_assert(int(CopyKind::kHostToHost) == cudaMemcpyHostToHost &&
                  int(CopyKind::kHostToDevice) == cudaMemcpyHostToDevice &&
                  int(CopyKind::kDeviceToHost) == cudaMemcpyDeviceToHost &&
                  int(CopyKind::kDeviceToDevice) == cudaMemcpyDeviceToDevice,
              "CopyKind mirrors cudaMemcpyKind");

struct Cudart {
#define MSRL_CUDART_MEMBER(name, ret, params) name##_fn name = nullptr;
  MSRL_CUDART_SYMBOLS(MSRL_CUDART_MEMBER)
#undef MSRL_CUDART_MEMBER
};

// Loads `library`, else $MSRL_CUDART_PATH, else the first soname that loads, and resolves every symbol.
// An explicit path that fails is an error; it never falls back to some other copy of the runtime.
Cudart load_cudart(const std::string& library, std::string* path) {
  void* handle =
      open_library(library_candidates(library, "MSRL_CUDART_PATH",
                                      {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"},
                                      library_dirs("cuda")),
                   "the CUDA runtime (set MSRL_CUDART_PATH to libcudart.so)", path);
  Cudart api;
#define MSRL_CUDART_RESOLVE(name, ret, params) \
  api.name = reinterpret_cast<name##_fn>(library_symbol(handle, #name, *path, "a CUDA runtime (libcudart)", true));
  MSRL_CUDART_SYMBOLS(MSRL_CUDART_RESOLVE)
#undef MSRL_CUDART_RESOLVE
  return api;
}

// Calls api_.fn with `args`; on failure throws, naming the call and its arguments (formatted only then).
#define MSRL_CUDART_CALL(fn, args, ...)                                                                \
  do {                                                                                                 \
    cudaError_t err_ = api_.fn args;                                                                   \
    if (err_ != cudaSuccess) fail(err_, #fn, ::msrl::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

class CudaRuntime final : public DeviceRuntime {
 public:
  CudaRuntime(const Cudart& api, std::string path) : api_(api), path_(std::move(path)) {
    cudaError_t err = api_.cudaRuntimeGetVersion(&version_);
    if (err != cudaSuccess) clear_error();
    MSRL_CHECK(err == cudaSuccess, kUnavailable, path_, ": cudaRuntimeGetVersion failed with cudaError ", err);
  }

  const char* name() const override { return "cuda"; }

  int device_count() override {
    int count = 0;
    cudaError_t err = api_.cudaGetDeviceCount(&count);
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {  // no GPU, or no driver
      clear_error();
      return 0;
    }
    if (err != cudaSuccess) fail(err, "cudaGetDeviceCount", "", __FILE__, __LINE__);
    return count;
  }
  void set_device(int device) override {
    MSRL_CHECK(device >= 0, kInvalidArgument, "cuda device must be >= 0, got ", device);
    cudaError_t err = api_.cudaSetDevice(device);
    if (err == cudaErrorInvalidDevice) {
      clear_error();
      MSRL_THROW(kInvalidArgument, "cuda device ", device, " does not exist; this process sees ", device_count(),
                 " device(s)");
    }
    if (err != cudaSuccess) fail(err, "cudaSetDevice", detail::concat(device), __FILE__, __LINE__);
  }
  int current_device() override {
    int device = 0;
    MSRL_CUDART_CALL(cudaGetDevice, (&device), "");
    return device;
  }

  // Portable: pinned for every device of the process, not only the current one.
  void* host_alloc_pinned(size_t nbytes) override {
    MSRL_CHECK(nbytes > 0, kInvalidArgument, "pinned allocation size must be > 0, got 0");
    void* ptr = nullptr;
    MSRL_CUDART_CALL(cudaHostAlloc, (&ptr, nbytes, cudaHostAllocPortable), nbytes, " bytes");
    return ptr;
  }
  void host_free_pinned(void* ptr) override {
    if (ptr != nullptr) MSRL_CUDART_CALL(cudaFreeHost, (ptr), ptr);
  }
  // Read-only pages (a read-only mmap) can be pinned only with cudaHostRegisterReadOnly (CUDA 11.1+). When
  // the caller could not say (a torch tensor over a read-only mapping), a refused registration is tried
  // once more read-only before its error is reported.
  void host_register(void* ptr, size_t nbytes, bool read_only) override {
    MSRL_CHECK(ptr != nullptr, kInvalidArgument, "cannot register a null pointer");
    MSRL_CHECK(nbytes > 0, kInvalidArgument, "cannot register 0 bytes at ", ptr);
    unsigned flags = cudaHostRegisterPortable | (read_only ? cudaHostRegisterReadOnly : 0u);
    cudaError_t err = api_.cudaHostRegister(ptr, nbytes, flags);
    if (err != cudaSuccess && err != cudaErrorHostMemoryAlreadyRegistered && !read_only) {
      clear_error();
      if (api_.cudaHostRegister(ptr, nbytes, flags | cudaHostRegisterReadOnly) == cudaSuccess) return;
    }
    if (err != cudaSuccess) {
      fail(err, "cudaHostRegister", detail::concat(ptr, ", ", nbytes, " bytes", read_only ? ", read-only" : ""),
           __FILE__, __LINE__);
    }
  }
  // What torch's is_pinned() asks: cudaPointerGetAttributes says cudaMemoryTypeHost for memory from
  // cudaHostAlloc (torch's pin_memory) or cudaHostRegister, at both ends of the range.
  bool host_is_pinned(const void* ptr, size_t nbytes) override {
    if (ptr == nullptr || nbytes == 0) return false;
    auto is_host = [&](const void* p) {
      cudaPointerAttributes attr{};
      cudaError_t err = api_.cudaPointerGetAttributes(&attr, p);
      if (err != cudaSuccess) {
        clear_error();  // older runtimes fail on unregistered host memory instead of reporting it
        return false;
      }
      return attr.type == cudaMemoryTypeHost;
    };
    return is_host(ptr) && is_host(static_cast<const char*>(ptr) + nbytes - 1);
  }
  void host_unregister(void* ptr) override {
    MSRL_CHECK(ptr != nullptr, kInvalidArgument, "cannot unregister a null pointer");
    MSRL_CUDART_CALL(cudaHostUnregister, (ptr), ptr);
  }

  void* device_alloc(size_t nbytes) override {
    MSRL_CHECK(nbytes > 0, kInvalidArgument, "device allocation size must be > 0, got 0");
    void* ptr = nullptr;
    MSRL_CUDART_CALL(cudaMalloc, (&ptr, nbytes), nbytes, " bytes");
    return ptr;
  }
  void device_free(void* ptr) override {
    if (ptr != nullptr) MSRL_CUDART_CALL(cudaFree, (ptr), ptr);
  }

  // Non-blocking: our copies never serialise against the legacy default stream other libraries use.
  Stream stream_create() override {
    cudaStream_t stream = nullptr;
    MSRL_CUDART_CALL(cudaStreamCreateWithFlags, (&stream, cudaStreamNonBlocking), "non-blocking");
    return stream;
  }
  void stream_destroy(Stream stream) override {
    MSRL_CHECK(stream != nullptr, kInvalidArgument, "cannot destroy the default (null) stream");
    MSRL_CUDART_CALL(cudaStreamDestroy, (as_stream(stream)), stream);
  }
  void stream_synchronize(Stream stream) override {
    MSRL_CUDART_CALL(cudaStreamSynchronize, (as_stream(stream)), "stream=", stream);
  }
  void stream_wait_event(Stream stream, Event event) override {
    MSRL_CUDART_CALL(cudaStreamWaitEvent, (as_stream(stream), as_event(event), 0u), "stream=", stream,
                     ", event=", event);
  }

  void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, Stream stream) override {
    if (nbytes == 0) return;
    MSRL_CHECK(dst != nullptr && src != nullptr, kInvalidArgument, "memcpy of ", nbytes, " bytes with a null ",
               dst == nullptr ? "destination" : "source");
    MSRL_CUDART_CALL(cudaMemcpyAsync, (dst, src, nbytes, cudaMemcpyKind(kind), as_stream(stream)), "dst=", dst,
                     ", src=", src, ", ", nbytes, " bytes, ", copy_kind_name(kind));
  }
  void memcpy2d_async(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                      CopyKind kind, Stream stream) override {
    if (width == 0 || height == 0) return;
    MSRL_CHECK(dst != nullptr && src != nullptr, kInvalidArgument, "2-D memcpy with a null ",
               dst == nullptr ? "destination" : "source");
    MSRL_CHECK(width <= dpitch && width <= spitch, kInvalidArgument, "2-D memcpy row width ", width,
               " exceeds a pitch (dpitch ", dpitch, ", spitch ", spitch, ")");
    MSRL_CUDART_CALL(cudaMemcpy2DAsync,
                     (dst, dpitch, src, spitch, width, height, cudaMemcpyKind(kind), as_stream(stream)), "dst=", dst,
                     ", dpitch=", dpitch, ", src=", src, ", spitch=", spitch, ", ", height, " rows of ", width,
                     " bytes, ", copy_kind_name(kind));
  }

  Event event_create(unsigned flags) override {
    cudaEvent_t event = nullptr;
    unsigned cuda_flags = (flags & kEventTiming) ? cudaEventDefault : cudaEventDisableTiming;
    if (flags & kEventBlockingSync) cuda_flags |= cudaEventBlockingSync;
    MSRL_CUDART_CALL(cudaEventCreateWithFlags, (&event, cuda_flags), "flags=", cuda_flags);
    return event;
  }
  void event_destroy(Event event) override { MSRL_CUDART_CALL(cudaEventDestroy, (as_event(event)), event); }
  void event_record(Event event, Stream stream) override {
    MSRL_CUDART_CALL(cudaEventRecord, (as_event(event), as_stream(stream)), "event=", event, ", stream=", stream);
  }
  bool event_query(Event event) override {
    cudaError_t err = api_.cudaEventQuery(as_event(event));
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      clear_error();  // "not ready" is left as the thread's last error too (torch clears it the same way)
      return false;
    }
    fail(err, "cudaEventQuery", detail::concat(event), __FILE__, __LINE__);
  }
  void event_synchronize(Event event) override { MSRL_CUDART_CALL(cudaEventSynchronize, (as_event(event)), event); }
  float event_elapsed_ms(Event start, Event end) override {
    float ms = 0;
    cudaError_t err = api_.cudaEventElapsedTime(&ms, as_event(start), as_event(end));
    if (err == cudaErrorNotReady || err == cudaErrorInvalidResourceHandle) clear_error();
    MSRL_CHECK(err != cudaErrorNotReady, kInvalidArgument, "elapsed time needs two completed events");
    MSRL_CHECK(err != cudaErrorInvalidResourceHandle, kInvalidArgument,
               "elapsed time needs two live events created with timing=true");
    if (err != cudaSuccess) fail(err, "cudaEventElapsedTime", detail::concat(start, ", ", end), __FILE__, __LINE__);
    return ms;
  }

 private:
  static cudaStream_t as_stream(Stream stream) { return static_cast<cudaStream_t>(stream); }
  static cudaEvent_t as_event(Event event) {
    MSRL_CHECK(event != nullptr, kInvalidArgument, "event handle is null");
    return static_cast<cudaEvent_t>(event);
  }

  // Reads and clears the calling thread's last error, which the failed call just set.
  void clear_error() const { api_.cudaGetLastError(); }

  // Out of memory and registration clashes get the codes the host backend uses; the rest are DeviceError.
  [[noreturn]] void fail(cudaError_t err, const char* fn, const std::string& args, const char* file, int line) const {
    clear_error();
    Code code = Code::kDeviceError;
    if (err == cudaErrorMemoryAllocation) code = Code::kOutOfMemory;
    if (err == cudaErrorHostMemoryAlreadyRegistered) code = Code::kInvalidArgument;
    if (err == cudaErrorHostMemoryNotRegistered) code = Code::kNotFound;
    const char* text = api_.cudaGetErrorString(err);
    throw Error(code,
                detail::concat(fn, "(", args, ") failed: cudaError ", err, " (", text != nullptr ? text : "?", ") [",
                               path_, ", runtime ", version_, "]"),
                file, line);
  }
  Cudart api_;
  std::string path_;
  int version_ = 0;
};

#undef MSRL_CUDART_CALL

}  // namespace

std::shared_ptr<DeviceRuntime> make_cuda_runtime(const std::string& library) {
  std::string path;
  Cudart api = load_cudart(library, &path);
  return std::make_shared<CudaRuntime>(api, path);
}

}  // namespace msrl
