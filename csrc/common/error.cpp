#include "common/error.h"

namespace msrl {

const char* code_name(Code code) {
  switch (code) {
    case Code::kInvalidArgument: return "InvalidArgument";
    case Code::kNotFound: return "NotFound";
    case Code::kTimeout: return "Timeout";
    case Code::kOutOfMemory: return "OutOfMemory";
    case Code::kDeviceError: return "DeviceError";
    case Code::kClosed: return "Closed";
    case Code::kUnavailable: return "Unavailable";
  }
  return "Unknown";
}

namespace {
std::string format(Code code, const std::string& message, const char* file, int line) {
  std::string base = file;
  auto slash = base.find("csrc/");
  if (slash != std::string::npos) base = base.substr(slash);
  return std::string(code_name(code)) + ": " + message + " [" + base + ":" + std::to_string(line) + "]";
}
}  // namespace

Error::Error(Code code, const std::string& message, const char* file, int line)
    : std::runtime_error(format(code, message, file, line)), code_(code), message_(message), file_(file), line_(line) {}

}  // namespace msrl
