// Helpers shared by the GoogleTest files.
#pragma once

#include <functional>

#include "common/error.h"

namespace msrl::testing {

// The msrl::Error code `fn` throws, or Code{0} when it returns normally.
inline Code code_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return Code{0};
}

}  // namespace msrl::testing
