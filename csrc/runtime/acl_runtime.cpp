// The Ascend backend: libascendcl is loaded at run time with dlopen and resolved against our own ABI
// header (acl_abi.h), so one build runs with or without CANN. Streams and events are AscendCL's raw
// handles, so torch_npu's stream handles work as they are.
//
// AscendCL specifics handled here:
// - aclInit is called once per runtime object with no config; "repeat initialize" (another runtime object,
//   or torch_npu, got there first) counts as success. aclFinalize is never called, and the library handle is
//   never closed, because buffers, streams and events may outlive any one runtime object.
// - Registration pins with aclrtHostRegisterV2(ACL_HOST_REG_PINNED) where it exists (CANN 8.x and later),
//   else falls back to aclrtHostRegister(ACL_HOST_REGISTER_MAPPED), the only registration older CANN has.
// - aclrtMemcpy2dAsync is documented for host<->device copies only (device-to-device on some chips), with
//   width <= 5,000,000 bytes and height <= 5 * 2^20 rows: taller copies are split, and other kinds or wider
//   rows become one 1-D copy per row.
// - Events come from aclrtCreateEvent, which supports timing, stream waits and host waits alike, so the
//   `timing` flag needs no special event. Unlike CUDA, an event that was never recorded queries as not ready.
// - Error text comes from aclGetRecentErrMsg (per thread, read-and-clear) when the library has it.
// - aclrtMemcpyAsync does not copy within the host ("ACL_MEMCPY_HOST_TO_HOST ... returns
//   ACL_ERROR_RT_FEATURE_NOT_SUPPORT"): a host-to-host copy waits for its stream, then runs on the calling
//   thread (the engine's issuing thread), so it stays ordered with the stream's other work.
// - Its addresses must be 64-byte aligned (CANN 8.0 reference, all models): a copy at other addresses is
//   refused here with InvalidArgument before it reaches the vendor. The copy engine stages host memory at an
//   unaligned address through its aligned pinned buffers (copy_alignment()), so only device addresses can
//   meet the refusal.
// - Contexts are per thread; current_device() is -1 on a thread that has none (never set a device).
// - Registration has no read-only flag (aclrtHostRegisterV2 flags: mapped, pinned); read-only pages are
//   registered as any other.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/error.h"
#include "common/thread_pool.h"
#include "runtime/acl_abi.h"
#include "runtime/device_runtime.h"
#include "runtime/dl_library.h"

namespace msrl {
namespace {

using namespace aclabi;

static_assert(int(CopyKind::kHostToHost) == ACL_MEMCPY_HOST_TO_HOST &&
                  int(CopyKind::kHostToDevice) == ACL_MEMCPY_HOST_TO_DEVICE &&
                  int(CopyKind::kDeviceToHost) == ACL_MEMCPY_DEVICE_TO_HOST &&
                  int(CopyKind::kDeviceToDevice) == ACL_MEMCPY_DEVICE_TO_DEVICE,
              "CopyKind mirrors aclrtMemcpyKind");

struct AscendCL {
#define MSRL_ACL_MEMBER(name, ret, params) name##_fn name = nullptr;
  MSRL_ACL_SYMBOLS(MSRL_ACL_MEMBER)
  MSRL_ACL_OPTIONAL_SYMBOLS(MSRL_ACL_MEMBER)
#undef MSRL_ACL_MEMBER
};

// Loads `library`, else $MSRL_ASCENDCL_PATH, else libascendcl.so, and resolves every symbol. Required
// symbols that are missing make the backend unavailable; optional ones stay null.
AscendCL load_ascendcl(const std::string& library, std::string* path) {
  void* handle =
      open_library(library_candidates(library, "MSRL_ASCENDCL_PATH", {"libascendcl.so"}, library_dirs("acl")),
                   "AscendCL (set MSRL_ASCENDCL_PATH to libascendcl.so)", path);
  constexpr const char* kWhat = "AscendCL (libascendcl)";
  AscendCL api;
#define MSRL_ACL_RESOLVE(name, ret, params) \
  api.name = reinterpret_cast<name##_fn>(library_symbol(handle, #name, *path, kWhat, true));
  MSRL_ACL_SYMBOLS(MSRL_ACL_RESOLVE)
#undef MSRL_ACL_RESOLVE
#define MSRL_ACL_RESOLVE_OPTIONAL(name, ret, params) \
  api.name = reinterpret_cast<name##_fn>(library_symbol(handle, #name, *path, kWhat, false));
  MSRL_ACL_OPTIONAL_SYMBOLS(MSRL_ACL_RESOLVE_OPTIONAL)
#undef MSRL_ACL_RESOLVE_OPTIONAL
  return api;
}

// Calls api_.fn with `args`; on failure throws, naming the call and its arguments (formatted only then).
#define MSRL_ACL_CALL(fn, args, ...)                                                                   \
  do {                                                                                                 \
    aclError err_ = api_.fn args;                                                                      \
    if (err_ != ACL_SUCCESS) fail(err_, #fn, ::msrl::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

class AclRuntime final : public DeviceRuntime {
 public:
  AclRuntime(const AscendCL& api, std::string path) : api_(api), path_(std::move(path)) {
    aclError err = api_.aclInit(nullptr);
    MSRL_CHECK(err == ACL_SUCCESS || err == ACL_ERROR_REPEAT_INITIALIZE, kUnavailable, path_,
               ": aclInit failed with aclError ", err, " (", recent_error(), ")");
  }

  const char* name() const override { return "acl"; }

  int device_count() override {
    uint32_t count = 0;
    MSRL_ACL_CALL(aclrtGetDeviceCount, (&count), "");
    return static_cast<int>(count);
  }
  void set_device(int device) override {
    MSRL_CHECK(device >= 0, kInvalidArgument, "npu device must be >= 0, got ", device);
    aclError err = api_.aclrtSetDevice(device);
    if (err == ACL_ERROR_RT_INVALID_DEVICEID) {
      recent_error();  // clear the vendor's message queue
      MSRL_THROW(kInvalidArgument, "npu device ", device, " does not exist; this process sees ", device_count(),
                 " device(s)");
    }
    if (err != ACL_SUCCESS) fail(err, "aclrtSetDevice", detail::concat(device), __FILE__, __LINE__);
  }
  int current_device() override {
    int32_t device = -1;
    aclError err = api_.aclrtGetDevice(&device);
    if (err == ACL_ERROR_RT_CONTEXT_NULL) {
      recent_error();  // clear the vendor's message queue
      return -1;
    }
    if (err != ACL_SUCCESS) fail(err, "aclrtGetDevice", "", __FILE__, __LINE__);
    return device;
  }
  size_t copy_alignment() const override { return kAclCopyAlignment; }

  void* host_alloc_pinned(size_t nbytes) override {
    MSRL_CHECK(nbytes > 0, kInvalidArgument, "pinned allocation size must be > 0, got 0");
    void* ptr = nullptr;
    MSRL_ACL_CALL(aclrtMallocHost, (&ptr, nbytes), nbytes, " bytes");
    return ptr;
  }
  void host_free_pinned(void* ptr) override {
    if (ptr != nullptr) MSRL_ACL_CALL(aclrtFreeHost, (ptr), ptr);
  }
  void host_register(void* ptr, size_t nbytes, bool /*read_only*/) override {
    MSRL_CHECK(ptr != nullptr, kInvalidArgument, "cannot register a null pointer");
    MSRL_CHECK(nbytes > 0, kInvalidArgument, "cannot register 0 bytes at ", ptr);
    if (api_.aclrtHostRegisterV2 != nullptr) {
      MSRL_ACL_CALL(aclrtHostRegisterV2, (ptr, nbytes, ACL_HOST_REG_PINNED), ptr, ", ", nbytes, " bytes, pinned");
      return;
    }
    MSRL_CHECK(api_.aclrtHostRegister != nullptr, kUnavailable, path_,
               " has neither aclrtHostRegisterV2 nor aclrtHostRegister; this CANN cannot register host memory");
    void* mapped = nullptr;  // device-side alias; we copy from the host address, so it is not kept
    MSRL_ACL_CALL(aclrtHostRegister, (ptr, nbytes, ACL_HOST_REGISTER_MAPPED, &mapped), ptr, ", ", nbytes,
                  " bytes, mapped");
  }
  void host_unregister(void* ptr) override {
    MSRL_CHECK(ptr != nullptr, kInvalidArgument, "cannot unregister a null pointer");
    MSRL_ACL_CALL(aclrtHostUnregister, (ptr), ptr);
  }

  void* device_alloc(size_t nbytes) override {
    MSRL_CHECK(nbytes > 0, kInvalidArgument, "device allocation size must be > 0, got 0");
    void* ptr = nullptr;
    MSRL_ACL_CALL(aclrtMalloc, (&ptr, nbytes, ACL_MEM_MALLOC_HUGE_FIRST), nbytes, " bytes");
    return ptr;
  }
  void device_free(void* ptr) override {
    if (ptr != nullptr) MSRL_ACL_CALL(aclrtFree, (ptr), ptr);
  }

  Stream stream_create() override {
    aclrtStream stream = nullptr;
    MSRL_ACL_CALL(aclrtCreateStream, (&stream), "");
    return stream;
  }
  void stream_destroy(Stream stream) override {
    MSRL_CHECK(stream != nullptr, kInvalidArgument, "cannot destroy the default (null) stream");
    MSRL_ACL_CALL(aclrtDestroyStream, (stream), stream);
  }
  void stream_synchronize(Stream stream) override {
    MSRL_ACL_CALL(aclrtSynchronizeStream, (stream), "stream=", stream);
  }
  void stream_wait_event(Stream stream, Event event) override {
    MSRL_ACL_CALL(aclrtStreamWaitEvent, (stream, check_event(event)), "stream=", stream, ", event=", event);
  }

  void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, Stream stream) override {
    if (nbytes == 0) return;
    MSRL_CHECK(dst != nullptr && src != nullptr, kInvalidArgument, "memcpy of ", nbytes, " bytes with a null ",
               dst == nullptr ? "destination" : "source");
    copy_1d(dst, src, nbytes, kind, stream);
  }
  void memcpy2d_async(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                      CopyKind kind, Stream stream) override {
    if (width == 0 || height == 0) return;
    MSRL_CHECK(dst != nullptr && src != nullptr, kInvalidArgument, "2-D memcpy with a null ",
               dst == nullptr ? "destination" : "source");
    MSRL_CHECK(width <= dpitch && width <= spitch, kInvalidArgument, "2-D memcpy row width ", width,
               " exceeds a pitch (dpitch ", dpitch, ", spitch ", spitch, ")");
    auto* d = static_cast<char*>(dst);
    auto* s = static_cast<const char*>(src);
    if (dpitch == width && spitch == width) {  // contiguous on both sides: one 1-D copy
      copy_1d(d, s, width * height, kind, stream);
      return;
    }
    if (kind == CopyKind::kHostToHost) {
      host_copy_2d(d, dpitch, s, spitch, width, height, stream);
      return;
    }
    bool native = (kind == CopyKind::kHostToDevice || kind == CopyKind::kDeviceToHost) && width <= kAclMemcpy2dMaxWidth;
    if (!native) {
      for (size_t r = 0; r < height; ++r) copy_1d(d + r * dpitch, s + r * spitch, width, kind, stream);
      return;
    }
    check_aligned(d, s, kind);
    for (size_t r = 0; r < height; r += kAclMemcpy2dMaxHeight) {
      size_t rows = std::min(height - r, kAclMemcpy2dMaxHeight);
      MSRL_ACL_CALL(aclrtMemcpy2dAsync,
                    (d + r * dpitch, dpitch, s + r * spitch, spitch, width, rows, aclrtMemcpyKind(kind), stream),
                    "dst=", static_cast<void*>(d + r * dpitch), ", dpitch=", dpitch,
                    ", src=", static_cast<const void*>(s + r * spitch), ", spitch=", spitch, ", ", rows, " rows of ",
                    width, " bytes, ", copy_kind_name(kind));
    }
  }

  // aclrtCreateEvent events serve timing, stream waits and host waits alike, and aclrtSynchronizeEvent
  // blocks (no spinning flag to ask for), so the flags need no special event.
  Event event_create(unsigned /*flags*/) override {
    aclrtEvent event = nullptr;
    MSRL_ACL_CALL(aclrtCreateEvent, (&event), "");
    return event;
  }
  void event_destroy(Event event) override { MSRL_ACL_CALL(aclrtDestroyEvent, (check_event(event)), event); }
  void event_record(Event event, Stream stream) override {
    MSRL_ACL_CALL(aclrtRecordEvent, (check_event(event), stream), "event=", event, ", stream=", stream);
  }
  bool event_query(Event event) override {
    aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
    MSRL_ACL_CALL(aclrtQueryEventStatus, (check_event(event), &status), event);
    return status == ACL_EVENT_RECORDED_STATUS_COMPLETE;
  }
  void event_synchronize(Event event) override { MSRL_ACL_CALL(aclrtSynchronizeEvent, (check_event(event)), event); }
  float event_elapsed_ms(Event start, Event end) override {
    float ms = 0;
    MSRL_ACL_CALL(aclrtEventElapsedTime, (&ms, check_event(start), check_event(end)), start, ", ", end);
    return ms;
  }

 private:
  static aclrtEvent check_event(Event event) {
    MSRL_CHECK(event != nullptr, kInvalidArgument, "event handle is null");
    return event;
  }
  void copy_1d(void* dst, const void* src, size_t nbytes, CopyKind kind, Stream stream) {
    if (kind == CopyKind::kHostToHost) {
      host_copy_2d(static_cast<char*>(dst), nbytes, static_cast<const char*>(src), nbytes, nbytes, 1, stream);
      return;
    }
    check_aligned(dst, src, kind);
    MSRL_ACL_CALL(aclrtMemcpyAsync, (dst, nbytes, src, nbytes, aclrtMemcpyKind(kind), stream), "dst=", dst,
                  ", src=", src, ", ", nbytes, " bytes, ", copy_kind_name(kind));
  }
  // Within the host: after the stream's earlier work (which may produce the source), on this thread.
  void host_copy_2d(char* d, size_t dpitch, const char* s, size_t spitch, size_t width, size_t height, Stream stream) {
    stream_synchronize(stream);
    if (dpitch == width && spitch == width) {
      parallel_memcpy(d, s, width * height);
      return;
    }
    for (size_t r = 0; r < height; ++r) std::memcpy(d + r * dpitch, s + r * spitch, width);
  }
  static void check_aligned(const void* dst, const void* src, CopyKind kind) {
    auto off = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % kAclCopyAlignment; };
    MSRL_CHECK(off(dst) == 0 && off(src) == 0, kInvalidArgument, "AscendCL copies need ", kAclCopyAlignment,
               "-byte aligned addresses (aclrtMemcpyAsync); this ", copy_kind_name(kind), " copy has ",
               off(dst) != 0 ? "dst=" : "src=", off(dst) != 0 ? dst : src, ", ", off(dst) != 0 ? off(dst) : off(src),
               " bytes past a ", kAclCopyAlignment, "-byte boundary");
  }

  // The vendor's text for the latest failure on this thread, when the library provides it.
  std::string recent_error() const {
    const char* msg = api_.aclGetRecentErrMsg != nullptr ? api_.aclGetRecentErrMsg() : nullptr;
    return msg != nullptr && *msg != '\0' ? msg : "no error text";
  }
  [[noreturn]] void fail(aclError err, const char* fn, const std::string& args, const char* file, int line) const {
    Code code = Code::kDeviceError;
    if (err == ACL_ERROR_BAD_ALLOC || err == ACL_ERROR_RT_MEMORY_ALLOCATION) code = Code::kOutOfMemory;
    throw Error(code,
                detail::concat(fn, "(", args, ") failed: aclError ", err, " (", recent_error(), ") [", path_, "]"),
                file, line);
  }

  AscendCL api_;
  std::string path_;
};

#undef MSRL_ACL_CALL

}  // namespace

std::shared_ptr<DeviceRuntime> make_acl_runtime(const std::string& library) {
  std::string path;
  AscendCL api = load_ascendcl(library, &path);
  return std::make_shared<AclRuntime>(api, path);
}

}  // namespace msrl
