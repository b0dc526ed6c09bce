// Shared declarations of the pybind11 layer. Only files under bindings/ include pybind11.
#pragma once

#include <pybind11/pybind11.h>

namespace msrl::bindings {

namespace py = pybind11;

void bind_errors(py::module_& m);
void bind_runtime(py::module_& m);
void bind_memory(py::module_& m);
void bind_copy(py::module_& m);

// Converts a Python deadline in seconds (None = wait forever is not allowed: every wait has a deadline).
double checked_timeout(double seconds);

}  // namespace msrl::bindings
