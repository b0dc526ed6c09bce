// Our own declarations of the few AscendCL (libascendcl) entry points msrl_core calls, so the core
// compiles without the CANN toolkit. Values and signatures follow Huawei's public AscendCL API reference
// (hiascend.com, "AscendCL API", CANN 8.x/9.x), and cpp_tests/vendor_abi proves them, at compile time in CI,
// equal to Huawei's own headers (acl/acl_rt.h as torch-npu ships it).
//
// MSRL_ACL_SYMBOLS(X) lists the required functions and MSRL_ACL_OPTIONAL_SYMBOLS(X) those that older
// CANN releases lack, each as X(name, return type, parameter list). The backend resolves them with
// dlsym; the fake libascendcl in cpp_tests checks its exports against the same lists.
#pragma once

#include <cstddef>
#include <cstdint>

namespace msrl::aclabi {

using aclError = int;
using aclrtStream = void*;
using aclrtEvent = void*;

enum aclrtMemcpyKind : int {
  ACL_MEMCPY_HOST_TO_HOST = 0,
  ACL_MEMCPY_HOST_TO_DEVICE = 1,
  ACL_MEMCPY_DEVICE_TO_HOST = 2,
  ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
};

enum aclrtMemMallocPolicy : int {
  ACL_MEM_MALLOC_HUGE_FIRST = 0,
};

enum aclrtHostRegisterType : int {
  ACL_HOST_REGISTER_MAPPED = 0,
};

enum aclrtEventRecordedStatus : int {
  ACL_EVENT_RECORDED_STATUS_NOT_READY = 0,
  ACL_EVENT_RECORDED_STATUS_COMPLETE = 1,
};

// Every constant we use, as X(type, name, value). The vendor conformance test (cpp_tests/vendor_abi)
// checks each value against Huawei's own headers, where several of these names are macros.
// ACL_HOST_REG_*: aclrtHostRegisterV2 flags. ACL_ERROR_RT_PARAM_INVALID and _INTERNAL_ERROR: the fake's.
#define MSRL_ACL_CONSTANTS(X)                           \
  X(uint32_t, ACL_HOST_REG_MAPPED, 0x2u)                \
  X(uint32_t, ACL_HOST_REG_PINNED, 0x10000000u)         \
  X(aclError, ACL_SUCCESS, 0)                           \
  X(aclError, ACL_ERROR_INVALID_PARAM, 100000)          \
  X(aclError, ACL_ERROR_UNINITIALIZE, 100001)           \
  X(aclError, ACL_ERROR_REPEAT_INITIALIZE, 100002)      \
  X(aclError, ACL_ERROR_BAD_ALLOC, 200000)              \
  X(aclError, ACL_ERROR_RT_PARAM_INVALID, 107000)       \
  X(aclError, ACL_ERROR_RT_INVALID_DEVICEID, 107001)    \
  X(aclError, ACL_ERROR_RT_CONTEXT_NULL, 107002)        \
  X(aclError, ACL_ERROR_RT_FEATURE_NOT_SUPPORT, 207000) \
  X(aclError, ACL_ERROR_RT_MEMORY_ALLOCATION, 207001)   \
  X(aclError, ACL_ERROR_RT_INTERNAL_ERROR, 507000)

#define MSRL_ACL_CONSTANT(type, name, value) constexpr type name = value;
MSRL_ACL_CONSTANTS(MSRL_ACL_CONSTANT)
#undef MSRL_ACL_CONSTANT

// aclrtMemcpyAsync: "the source address and destination address must be 64-byte aligned" (CANN 8.0
// reference, all models; newer headers say so for on-chip device-to-device copies only).
constexpr size_t kAclCopyAlignment = 64;

// aclrtMemcpy2dAsync limits (same page): width <= 5,000,000 bytes, height <= 5 * 1024 * 1024 rows.
constexpr size_t kAclMemcpy2dMaxWidth = 5000000;
constexpr size_t kAclMemcpy2dMaxHeight = 5u * 1024 * 1024;

#define MSRL_ACL_SYMBOLS(X)                                                                                       \
  X(aclInit, aclError, (const char* configPath))                                                                  \
  X(aclrtGetDeviceCount, aclError, (uint32_t * count))                                                            \
  X(aclrtSetDevice, aclError, (int32_t deviceId))                                                                 \
  X(aclrtGetDevice, aclError, (int32_t * deviceId))                                                               \
  X(aclrtMallocHost, aclError, (void** hostPtr, size_t size))                                                     \
  X(aclrtFreeHost, aclError, (void* hostPtr))                                                                     \
  X(aclrtMalloc, aclError, (void** devPtr, size_t size, aclrtMemMallocPolicy policy))                             \
  X(aclrtFree, aclError, (void* devPtr))                                                                          \
  X(aclrtHostUnregister, aclError, (void* ptr))                                                                   \
  X(aclrtCreateStream, aclError, (aclrtStream * stream))                                                          \
  X(aclrtDestroyStream, aclError, (aclrtStream stream))                                                           \
  X(aclrtSynchronizeStream, aclError, (aclrtStream stream))                                                       \
  X(aclrtStreamWaitEvent, aclError, (aclrtStream stream, aclrtEvent event))                                       \
  X(aclrtMemcpyAsync, aclError,                                                                                   \
    (void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind, aclrtStream stream))         \
  X(aclrtMemcpy2dAsync, aclError,                                                                                 \
    (void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height, aclrtMemcpyKind kind, \
     aclrtStream stream))                                                                                         \
  X(aclrtCreateEvent, aclError, (aclrtEvent * event))                                                             \
  X(aclrtDestroyEvent, aclError, (aclrtEvent event))                                                              \
  X(aclrtRecordEvent, aclError, (aclrtEvent event, aclrtStream stream))                                           \
  X(aclrtQueryEventStatus, aclError, (aclrtEvent event, aclrtEventRecordedStatus * status))                       \
  X(aclrtSynchronizeEvent, aclError, (aclrtEvent event))                                                          \
  X(aclrtEventElapsedTime, aclError, (float* ms, aclrtEvent startEvent, aclrtEvent endEvent))

// Optional: pinning registration (V2 on CANN 8.x+, the mapped-only variant before) and error text.
#define MSRL_ACL_OPTIONAL_SYMBOLS(X)                                                                    \
  X(aclrtHostRegisterV2, aclError, (void* ptr, uint64_t size, uint32_t flag))                           \
  X(aclrtHostRegister, aclError, (void* ptr, uint64_t size, aclrtHostRegisterType type, void** devPtr)) \
  X(aclGetRecentErrMsg, const char*, ())

#define MSRL_ACL_TYPEDEF(name, ret, params) using name##_fn = ret(*) params;
MSRL_ACL_SYMBOLS(MSRL_ACL_TYPEDEF)
MSRL_ACL_OPTIONAL_SYMBOLS(MSRL_ACL_TYPEDEF)
#undef MSRL_ACL_TYPEDEF

}  // namespace msrl::aclabi
