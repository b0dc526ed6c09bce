// Shared declarations of the pybind11 layer. Only files under bindings/ include pybind11.
#pragma once

#include <pybind11/pybind11.h>

namespace msrl::bindings {

namespace py = pybind11;

void bind_errors(py::module_& m);
void bind_runtime(py::module_& m);
void bind_memory(py::module_& m);
void bind_copy(py::module_& m);
void bind_dock(py::module_& m);
void bind_wire(py::module_& m);  // the dock's same-node wire encoding

// Argument checks shared by the binding files: clear InvalidArgument instead of pybind's TypeError.
uint64_t checked_size(int64_t value, const char* what);
void* checked_pointer(const py::int_& value, const char* what, bool allow_null = false);

// Converts a Python deadline in seconds (None = wait forever is not allowed: every wait has a deadline).
double checked_timeout(double seconds);

}  // namespace msrl::bindings
