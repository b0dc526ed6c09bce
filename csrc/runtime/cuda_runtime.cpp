// PLACEHOLDER until the cuda backend lands.
#include "common/error.h"
#include "runtime/device_runtime.h"
namespace msrl {
std::shared_ptr<DeviceRuntime> make_cuda_runtime(const std::string&) { MSRL_THROW(kUnavailable, "not built yet"); }
}  // namespace msrl
