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

// Opaque vendor handles. A null Stream is the backend's default (legacy, synchronising) stream.
using Stream = void*;
using Event = void*;

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  virtual const char* name() const = 0;
  // True when "device" memory is ordinary host memory (the host backend).
  virtual bool device_is_host() const { return false; }
  virtual int device_count() = 0;
  virtual void set_device(int device) = 0;

  // Page-locked host memory, and pinning of memory the caller already owns.
  virtual void* host_alloc_pinned(size_t nbytes) = 0;
  virtual void host_free_pinned(void* ptr) = 0;
  virtual void host_register(void* ptr, size_t nbytes) = 0;
  virtual void host_unregister(void* ptr) = 0;

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

  virtual Event event_create(bool timing) = 0;
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

// Returns the process-wide runtime for `device`: "auto" (cuda, then acl, then host), "host", "cuda",
// "npu" or "acl". Throws InvalidArgument for an unknown name, Unavailable for a missing backend.
std::shared_ptr<DeviceRuntime> get_runtime(const std::string& device);

// Constructors, for tests and for code that wants a private instance.
std::shared_ptr<DeviceRuntime> make_host_runtime();
// `library` empty: MSRL_CUDART_PATH, then the usual sonames. Throws Unavailable when it cannot load.
std::shared_ptr<DeviceRuntime> make_cuda_runtime(const std::string& library = "");
// `library` empty: MSRL_ASCENDCL_PATH, then libascendcl.so. Throws Unavailable when it cannot load.
std::shared_ptr<DeviceRuntime> make_acl_runtime(const std::string& library = "");

}  // namespace msrl
