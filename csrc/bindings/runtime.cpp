// Runtime selection, streams and device buffers.
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "bindings/objects.h"
#include "common/error.h"

namespace msrl::bindings {

void bind_runtime(py::module_& m) {
  m.def(
      "probe_backends",
      [] {
        std::vector<BackendInfo> infos;
        {
          py::gil_scoped_release release;  // may dlopen vendor libraries
          infos = probe_backends();
        }
        py::list out;
        for (const auto& i : infos) out.append(py::make_tuple(i.name, i.available, i.detail));
        return out;
      },
      "List of (name, available, detail) for host, cuda and acl.");

  m.def(
      "set_library_dirs",
      [](const std::string& backend, std::vector<std::string> dirs) { set_library_dirs(backend, std::move(dirs)); },
      py::arg("backend"), py::arg("dirs"), "Folders to search for the backend's vendor library after its sonames.");
  m.def(
      "library_dirs", [](const std::string& backend) { return library_dirs(backend); }, py::arg("backend"));

  py::class_<PyRuntime, std::shared_ptr<PyRuntime>>(m, "Runtime")
      .def_property_readonly("name", [](const PyRuntime& r) { return std::string(r.rt->name()); })
      .def_property_readonly("device_is_host", [](const PyRuntime& r) { return r.rt->device_is_host(); })
      .def_property_readonly("device_count", [](const PyRuntime& r) { return r.rt->device_count(); })
      .def("set_device", [](const PyRuntime& r, int device) { r.rt->set_device(device); })
      .def_property_readonly("current_device", [](const PyRuntime& r) { return r.rt->current_device(); })
      .def("create_stream", [](const PyRuntime& r) { return std::make_shared<PyStream>(r.rt); })
      .def("device_alloc", [](const PyRuntime& r, int64_t nbytes) {
        MSRL_CHECK(nbytes > 0, kInvalidArgument, "nbytes must be > 0, got ", nbytes);
        return std::make_shared<PyDeviceBuffer>(r.rt, static_cast<size_t>(nbytes));
      });

  m.def(
      "get_runtime",
      [](const std::string& device) {
        std::shared_ptr<DeviceRuntime> rt;
        {
          py::gil_scoped_release release;
          rt = get_runtime(device);
        }
        return std::make_shared<PyRuntime>(PyRuntime{rt});
      },
      py::arg("device") = "auto");

  py::class_<PyStream, std::shared_ptr<PyStream>>(m, "Stream")
      .def_property_readonly("handle", [](const PyStream& s) { return reinterpret_cast<uintptr_t>(s.stream); })
      .def("synchronize", [](const PyStream& s) {
        py::gil_scoped_release release;
        s.rt->stream_synchronize(s.stream);
      });

  py::class_<PyDeviceBuffer, std::shared_ptr<PyDeviceBuffer>>(m, "DeviceBuffer", py::buffer_protocol())
      .def_property_readonly("ptr", [](const PyDeviceBuffer& b) { return reinterpret_cast<uintptr_t>(b.ptr); })
      .def_property_readonly("nbytes", [](const PyDeviceBuffer& b) { return b.nbytes; })
      .def_buffer([](PyDeviceBuffer& b) -> py::buffer_info {
        MSRL_CHECK(b.rt->device_is_host(), kInvalidArgument, "device memory of the '", b.rt->name(),
                   "' backend is not host-addressable; copy it to host first");
        return py::buffer_info(b.ptr, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes)}, {1});
      });
}

}  // namespace msrl::bindings
