// PLACEHOLDER until the acl backend lands.
#include "common/error.h"
#include "runtime/device_runtime.h"
namespace msrl {
std::shared_ptr<DeviceRuntime> make_acl_runtime(const std::string&) { MSRL_THROW(kUnavailable, "not built yet"); }
}  // namespace msrl
