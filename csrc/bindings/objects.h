// RAII Python-facing wrappers of native handles (never raw integer handles).
#pragma once

#include <memory>

#include "runtime/device_runtime.h"

namespace msrl::bindings {

struct PyRuntime {
  std::shared_ptr<DeviceRuntime> rt;
};

struct PyStream {
  explicit PyStream(std::shared_ptr<DeviceRuntime> r) : rt(std::move(r)), stream(rt->stream_create()) {}
  ~PyStream() { rt->stream_destroy(stream); }
  PyStream(const PyStream&) = delete;
  PyStream& operator=(const PyStream&) = delete;
  std::shared_ptr<DeviceRuntime> rt;
  Stream stream;
};

struct PyDeviceBuffer {
  PyDeviceBuffer(std::shared_ptr<DeviceRuntime> r, size_t n) : rt(std::move(r)), ptr(rt->device_alloc(n)), nbytes(n) {}
  ~PyDeviceBuffer() { rt->device_free(ptr); }
  PyDeviceBuffer(const PyDeviceBuffer&) = delete;
  PyDeviceBuffer& operator=(const PyDeviceBuffer&) = delete;
  std::shared_ptr<DeviceRuntime> rt;
  void* ptr;
  size_t nbytes;
};

}  // namespace msrl::bindings
