// Error type of the native core: a code, a message that names the bad value, and where it was raised.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace msrl {

enum class Code : int {
  kInvalidArgument = 1,  // bad value from the caller; state unchanged
  kNotFound = 2,         // unknown name, handle or ticket
  kTimeout = 3,          // a wait passed its deadline
  kOutOfMemory = 4,      // an allocation or a capacity limit failed
  kDeviceError = 5,      // the vendor runtime returned an error
  kClosed = 6,           // use of an object after close()
  kUnavailable = 7,      // a backend or symbol is not present on this machine
};

const char* code_name(Code code);

class Error : public std::runtime_error {
 public:
  Error(Code code, const std::string& message, const char* file, int line);
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  Code code_;
  std::string message_;
  const char* file_;
  int line_;
};

namespace detail {
// Streams every argument into one string: MSRL_THROW(kInvalidArgument, "size ", n, " exceeds ", cap).
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace msrl

#define MSRL_THROW(code, ...) \
  throw ::msrl::Error(::msrl::Code::code, ::msrl::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

#define MSRL_CHECK(cond, code, ...)             \
  do {                                          \
    if (!(cond)) MSRL_THROW(code, __VA_ARGS__); \
  } while (0)
