// Backend selection and the parts of DeviceRuntime shared by every backend.
#include <cstdlib>
#include <map>
#include <mutex>

#include "common/error.h"
#include "runtime/device_runtime.h"

namespace msrl {

const char* copy_kind_name(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToHost: return "h2h";
    case CopyKind::kHostToDevice: return "h2d";
    case CopyKind::kDeviceToHost: return "d2h";
    case CopyKind::kDeviceToDevice: return "d2d";
  }
  return "?";
}

void DeviceRuntime::plan_async(const CopyDescriptor* descs, size_t count, char* dst, const char* src, CopyKind kind,
                               Stream stream) {
  for (size_t i = 0; i < count; ++i) {
    const auto& d = descs[i];
    if (d.rows == 1) {
      memcpy_async(dst + d.dst_offset, src + d.src_offset, d.row_bytes, kind, stream);
    } else if (d.rows > 1) {
      memcpy2d_async(dst + d.dst_offset, d.dst_pitch, src + d.src_offset, d.src_pitch, d.row_bytes, d.rows, kind,
                     stream);
    }
  }
}

void DeviceRuntime::memcpy_batch_async(const CopyRegion* regions, size_t count, CopyKind kind, Stream stream) {
  for (size_t i = 0; i < count; ++i) {
    if (regions[i].nbytes > 0) memcpy_async(regions[i].dst, regions[i].src, regions[i].nbytes, kind, stream);
  }
}

namespace {

std::mutex g_mu;
std::map<std::string, std::shared_ptr<DeviceRuntime>> g_runtimes;  // by canonical name; loaded ones only
std::mutex g_dirs_mu;
std::map<std::string, std::vector<std::string>> g_library_dirs;  // by canonical name

std::string canonical(const std::string& device) {
  if (device == "npu" || device == "acl" || device == "ascend") return "acl";
  if (device == "cuda" || device == "gpu") return "cuda";
  if (device == "host" || device == "cpu") return "host";
  if (device == "auto" || device.empty()) return "auto";
  MSRL_THROW(kInvalidArgument, "unknown device '", device, "'; allowed: auto, host, cpu, cuda, npu, acl");
}

// Loads a backend and keeps it once it loaded. A failure is not kept: the next call tries again, since
// what was missing may be there by then (torch loaded libcudart, set_library_dirs named its folder).
// Caller holds g_mu.
std::shared_ptr<DeviceRuntime> load_locked(const std::string& name) {
  auto it = g_runtimes.find(name);
  if (it != g_runtimes.end()) return it->second;
  try {
    std::shared_ptr<DeviceRuntime> rt;
    if (name == "host") rt = make_host_runtime();
    if (name == "cuda") rt = make_cuda_runtime();
    if (name == "acl") rt = make_acl_runtime();
    g_runtimes[name] = rt;
    return rt;
  } catch (const Error& e) {
    MSRL_THROW(kUnavailable, name, " backend unavailable: ", e.message());
  }
}

}  // namespace

void set_library_dirs(const std::string& backend, std::vector<std::string> dirs) {
  std::string name = canonical(backend);
  MSRL_CHECK(name == "cuda" || name == "acl", kInvalidArgument, "library folders are for the cuda and acl ",
             "backends, got '", backend, "'");
  std::lock_guard<std::mutex> lock(g_dirs_mu);
  g_library_dirs[name] = std::move(dirs);
}

std::vector<std::string> library_dirs(const std::string& backend) {
  std::string name = canonical(backend);
  std::lock_guard<std::mutex> lock(g_dirs_mu);
  auto it = g_library_dirs.find(name);
  return it == g_library_dirs.end() ? std::vector<std::string>{} : it->second;
}

std::vector<BackendInfo> probe_backends() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<BackendInfo> out;
  for (const char* name : {"host", "cuda", "acl"}) {
    BackendInfo info;
    info.name = name;
    try {
      auto rt = load_locked(name);
      int devices = rt->device_count();
      info.available = devices > 0;
      info.detail = std::string(rt->name()) + " runtime loaded, " + std::to_string(devices) + " device(s)";
    } catch (const Error& e) {
      info.available = false;
      info.detail = e.message();
    }
    out.push_back(info);
  }
  return out;
}

std::shared_ptr<DeviceRuntime> get_runtime(const std::string& device) {
  std::string name = canonical(device);
  std::lock_guard<std::mutex> lock(g_mu);
  if (name != "auto") {
    auto rt = load_locked(name);
    MSRL_CHECK(rt->device_count() > 0, kUnavailable, name,
               " runtime loaded but it sees no device; use MSRL_DEVICE=host");
    return rt;
  }
  for (const char* candidate : {"cuda", "acl"}) {
    try {
      auto rt = load_locked(candidate);
      if (rt->device_count() > 0) return rt;
    } catch (const Error&) {
    }
  }
  return load_locked("host");
}

}  // namespace msrl
