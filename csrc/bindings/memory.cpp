// Pinned pool, pinned buffers (buffer protocol, zero-copy) and registrations of caller buffers.
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "bindings/objects.h"
#include "common/error.h"
#include "memory/pinned_pool.h"

namespace msrl::bindings {

namespace {

struct PyRegistration {
  std::shared_ptr<HostRegistration> reg;
  HostRegistration& get() const {
    MSRL_CHECK(reg != nullptr, kClosed, "registration was already released");
    return *reg;
  }
};

py::dict stats_dict(const PoolStats& s) {
  py::dict d;
  d["reserved"] = s.reserved;
  d["in_use"] = s.in_use;
  d["peak_in_use"] = s.peak_in_use;
  d["cached"] = s.cached;
  d["requested"] = s.requested;
  d["allocations"] = s.allocations;
  d["cache_hits"] = s.cache_hits;
  d["registered"] = s.registered;
  d["capacity"] = s.capacity;
  return d;
}

}  // namespace

uint64_t checked_size(int64_t value, const char* what) {
  MSRL_CHECK(value >= 0, kInvalidArgument, what, " must be >= 0, got ", value);
  return static_cast<uint64_t>(value);
}

void* checked_pointer(const py::int_& value, const char* what, bool allow_null) {
  MSRL_CHECK(value.ptr() != nullptr && PyLong_Check(value.ptr()), kInvalidArgument, what, " must be an int");
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  unsigned long long u = 0;
  if (overflow > 0) {
    u = PyLong_AsUnsignedLongLong(value.ptr());
  } else {
    MSRL_CHECK(overflow == 0 && v >= 0, kInvalidArgument, what, " must be a non-negative address, got ",
               py::str(value).cast<std::string>());
    u = static_cast<unsigned long long>(v);
  }
  MSRL_CHECK(u != 0 || allow_null, kInvalidArgument, what, " is a null pointer");
  return reinterpret_cast<void*>(static_cast<uintptr_t>(u));
}

void bind_memory(py::module_& m) {
  py::class_<PinnedBlock, std::shared_ptr<PinnedBlock>>(m, "PinnedBuffer", py::buffer_protocol())
      .def_property_readonly("ptr", [](const PinnedBlock& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &PinnedBlock::size)
      .def_property_readonly("capacity", &PinnedBlock::capacity)
      .def("__len__", &PinnedBlock::size)
      .def_buffer([](PinnedBlock& b) -> py::buffer_info {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      });

  py::class_<PyRegistration>(m, "Registration", py::dynamic_attr())
      .def_property_readonly("ptr", [](const PyRegistration& r) { return reinterpret_cast<uintptr_t>(r.get().data()); })
      .def_property_readonly("nbytes", [](const PyRegistration& r) { return r.get().size(); })
      .def_property_readonly("active", [](const PyRegistration& r) { return r.reg != nullptr; })
      .def("release", [](PyRegistration& r) {
        r.get();
        py::gil_scoped_release release;
        r.reg.reset();
      });

  py::class_<PinnedPool, std::shared_ptr<PinnedPool>>(m, "PinnedPool")
      .def(py::init([](const std::shared_ptr<PyRuntime>& runtime, int64_t capacity) {
             MSRL_CHECK(runtime != nullptr, kInvalidArgument, "runtime is None");
             return PinnedPool::create(runtime->rt, checked_size(capacity, "capacity"));
           }),
           py::arg("runtime"), py::arg("capacity") = 0)
      .def(
          "allocate",
          [](PinnedPool& pool, int64_t nbytes) {
            uint64_t n = checked_size(nbytes, "nbytes");
            py::gil_scoped_release release;  // cudaMallocHost can take milliseconds
            return pool.allocate(n);
          },
          py::arg("nbytes"))
      .def(
          "register",
          [](PinnedPool& pool, const py::int_& ptr, int64_t nbytes, bool read_only) {
            void* p = checked_pointer(ptr, "ptr");
            uint64_t n = checked_size(nbytes, "nbytes");
            py::gil_scoped_release release;
            return PyRegistration{pool.register_buffer(p, n, read_only)};
          },
          py::arg("ptr"), py::arg("nbytes"), py::arg("read_only") = false)
      .def("stats", [](const PinnedPool& pool) { return stats_dict(pool.stats()); })
      .def("trim",
           [](PinnedPool& pool) {
             py::gil_scoped_release release;
             pool.trim();
           })
      .def("close",
           [](PinnedPool& pool) {
             py::gil_scoped_release release;
             pool.close();
           })
      .def_property_readonly("closed", &PinnedPool::closed)
      .def_static("size_class", [](int64_t n) { return PinnedPool::size_class(checked_size(n, "nbytes")); })
      .def_static("is_pinned", [](const py::int_& ptr, int64_t nbytes) {
        return PinnedPool::is_pinned(checked_pointer(ptr, "ptr"), checked_size(nbytes, "nbytes"));
      });
}

}  // namespace msrl::bindings
