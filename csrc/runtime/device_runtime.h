// DeviceRuntime: the few device operations msrl_core needs, behind one interface.
//
// Backends: `host` (always available; device memory is host memory, streams are worker threads),
// `cuda` (libcudart loaded with dlopen) and `acl` (libascendcl loaded with dlopen). Every call either
// succeeds or throws msrl::Error; none of them exits or aborts.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "copy/descriptor.h"

namespace msrl {

enum class CopyKind : int {
  kHostToHost = 0,
  kHostToDevice = 1,
  kDeviceToHost = 2,
  kDeviceToDevice = 3,
};

const char* copy_kind_name(CopyKind kind);

// Opaque vendor handles. A null Stream is the backend's default stream: on CUDA the legacy default stream
// of the calling thread's current device (torch's default stream, handle 0), which our own streams
// (non-blocking) do not synchronise with.
using Stream = void*;
using Event = void*;

// event_create flags. Timing: usable for event_elapsed_ms. BlockingSync: a host wait on the event sleeps
// instead of spinning a core (CUDA's cudaEventBlockingSync; AscendCL's waits block already).
enum EventFlags : unsigned {
  kEventDefault = 0,
  kEventTiming = 1,
  kEventBlockingSync = 2,
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  virtual const char* name() const = 0;
  // True when "device" memory is ordinary host memory (the host backend).
  virtual bool device_is_host() const { return false; }
  virtual int device_count() = 0;
  // Binds the calling thread to `device` (CUDA's current device, ACL's default context of the device).
  virtual void set_device(int device) = 0;
  // The calling thread's current device; -1 when it has none yet (an ACL thread without a context).
  virtual int current_device() { return 0; }

  // Page-locked host memory, and pinning of memory the caller already owns. `read_only`: the pages may be
  // mapped read-only (a read-only mmap of a checkpoint); the device will only read them.
  virtual void* host_alloc_pinned(size_t nbytes) = 0;
  virtual void host_free_pinned(void* ptr) = 0;
  virtual void host_register(void* ptr, size_t nbytes, bool read_only) = 0;
  virtual void host_unregister(void* ptr) = 0;
  // True when the runtime itself knows [ptr, ptr+nbytes) as page-locked host memory, whoever pinned it
  // (torch's pin_memory(), another library). False when it cannot tell.
  virtual bool host_is_pinned(const void* /*ptr*/, size_t /*nbytes*/) { return false; }
  // Host and device addresses of a copy must be multiples of this (AscendCL: 64), else the copy fails.
  virtual size_t copy_alignment() const { return 1; }

  virtual void* device_alloc(size_t nbytes) = 0;
  virtual void device_free(void* ptr) = 0;

  virtual Stream stream_create() = 0;
  virtual void stream_destroy(Stream stream) = 0;
  virtual void stream_synchronize(Stream stream) = 0;
  // Work enqueued on `stream` after this call starts only once `event` has completed.
  virtual void stream_wait_event(Stream stream, Event event) = 0;

  virtual void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, Stream stream) = 0;
  virtual void memcpy2d_async(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              CopyKind kind, Stream stream) = 0;
  // Enqueues every descriptor of a plan. The default issues one 1-D or 2-D copy per descriptor;
  // backends with a cheaper fused path override it.
  virtual void plan_async(const CopyDescriptor* descs, size_t count, char* dst, const char* src, CopyKind kind,
                          Stream stream);
  // Enqueues independent 1-D copies. The default issues one copy per region; the host backend runs them
  // as one task spread over its threads.
  virtual void memcpy_batch_async(const CopyRegion* regions, size_t count, CopyKind kind, Stream stream);

  // `flags`: EventFlags, or-ed.
  virtual Event event_create(unsigned flags) = 0;
  virtual void event_destroy(Event event) = 0;
  virtual void event_record(Event event, Stream stream) = 0;
  virtual bool event_query(Event event) = 0;
  virtual void event_synchronize(Event event) = 0;
  virtual float event_elapsed_ms(Event start, Event end) = 0;
};

struct BackendInfo {
  std::string name;  // "host", "cuda", "acl"
  bool available = false;
  std::string detail;  // library path and version, or why it is unavailable
};

// Probes every backend (loads vendor libraries on first use; never throws).
std::vector<BackendInfo> probe_backends();

// Folders to search for a backend's vendor library ("cuda", "acl") after its usual sonames, e.g. the
// nvidia/cu13/lib folder of the CUDA wheels torch depends on, which is not on the loader path. Applies to
// later loads; an explicit library path or MSRL_CUDART_PATH / MSRL_ASCENDCL_PATH still wins.
void set_library_dirs(const std::string& backend, std::vector<std::string> dirs);
std::vector<std::string> library_dirs(const std::string& backend);

// Returns the process-wide runtime for `device`: "auto" (cuda, then acl, then host), "host", "cuda",
// "npu" or "acl". Throws InvalidArgument for an unknown name, Unavailable for a missing backend. A backend
// that loaded is kept; one that did not is tried again on the next call (torch may have loaded the vendor
// library since, or set_library_dirs named its folder).
std::shared_ptr<DeviceRuntime> get_runtime(const std::string& device);

// Constructors, for tests and for code that wants a private instance.
std::shared_ptr<DeviceRuntime> make_host_runtime();
// `library` empty: MSRL_CUDART_PATH, then the usual sonames, then library_dirs("cuda"). Throws Unavailable
// when it cannot load.
std::shared_ptr<DeviceRuntime> make_cuda_runtime(const std::string& library = "");
// `library` empty: MSRL_ASCENDCL_PATH, then libascendcl.so, then library_dirs("acl"). Throws Unavailable
// when it cannot load.
std::shared_ptr<DeviceRuntime> make_acl_runtime(const std::string& library = "");

}  // namespace msrl
