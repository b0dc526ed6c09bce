// The one translation table from msrl::Error codes to Python exception classes.
#include <cmath>
#include <cstdlib>
#include <string>

#include "bindings/bindings.h"
#include "common/error.h"

namespace msrl::bindings {

namespace {
// Owned by the module; created in bind_errors. Classes are leaked on purpose (module lifetime).
PyObject* g_base = nullptr;
PyObject* g_by_code[8] = {};

bool debug_errors() {
  const char* v = std::getenv("MSRL_DEBUG");
  return v != nullptr && v[0] != '\0' && std::string(v) != "0";
}

PyObject* make_class(py::module_& m, const char* name, PyObject* builtin, const char* doc) {
  py::tuple bases = py::make_tuple(py::handle(g_base), py::handle(builtin));
  std::string qual = std::string("msrl_core.errors.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qual.c_str(), doc, bases.ptr(), nullptr);
  if (cls == nullptr) throw py::error_already_set();
  m.attr(name) = py::handle(cls);
  return cls;
}
}  // namespace

void bind_errors(py::module_& m) {
  g_base = PyErr_NewExceptionWithDoc("msrl_core.errors.MsrlError", "Base class of every msrl_core error.",
                                     PyExc_Exception, nullptr);
  if (g_base == nullptr) throw py::error_already_set();
  m.attr("MsrlError") = py::handle(g_base);
  auto set = [&](Code code, PyObject* cls) { g_by_code[static_cast<int>(code)] = cls; };
  set(Code::kInvalidArgument,
      make_class(m, "InvalidArgument", PyExc_ValueError, "A bad argument; nothing was changed."));
  set(Code::kNotFound, make_class(m, "NotFound", PyExc_KeyError, "An unknown name, handle or ticket."));
  set(Code::kTimeout, make_class(m, "Timeout", PyExc_TimeoutError, "A wait passed its deadline."));
  set(Code::kOutOfMemory, make_class(m, "OutOfMemory", PyExc_MemoryError, "An allocation or capacity limit failed."));
  set(Code::kDeviceError, make_class(m, "DeviceError", PyExc_RuntimeError, "The device runtime reported an error."));
  set(Code::kClosed, make_class(m, "Closed", PyExc_RuntimeError, "Use of an object after close()."));
  set(Code::kUnavailable,
      make_class(m, "Unavailable", PyExc_RuntimeError, "A backend is not present on this machine."));

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      // The class already names the error: the message alone, plus the C++ source location (and the code
      // name) only in debug mode (MSRL_DEBUG=1).
      PyObject* cls = g_by_code[static_cast<int>(e.code())];
      PyErr_SetString(cls ? cls : g_base, debug_errors() ? e.what() : e.message().c_str());
    }
  });
}

double checked_timeout(double seconds) {
  if (!(seconds >= 0) || std::isinf(seconds)) {
    MSRL_THROW(kInvalidArgument, "timeout must be a finite number of seconds >= 0, got ", seconds);
  }
  return seconds;
}

}  // namespace msrl::bindings
