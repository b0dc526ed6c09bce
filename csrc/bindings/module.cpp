// msrl_core._core: one bind_<component>(m) per file.
#include "bindings/bindings.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "Native core of msrl_core (private; use the msrl_core package)";
  msrl::bindings::bind_errors(m);
  msrl::bindings::bind_runtime(m);
  msrl::bindings::bind_memory(m);
  msrl::bindings::bind_copy(m);
  msrl::bindings::bind_dock(m);
  msrl::bindings::bind_wire(m);
}
