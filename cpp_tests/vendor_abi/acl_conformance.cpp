// Conformance of csrc/runtime/acl_abi.h with Huawei's own AscendCL headers (acl/acl_rt.h, as torch-npu ships
// them). The checks are static_asserts: if this file compiles, our header agrees with the vendor's.
//
// Our header goes first: several of our constants share their names with the vendor's macros.
#include "runtime/acl_abi.h"

// acl_rt.h only: acl_rt_api.h would add C++ template overloads (aclrtHostRegister<T>) that make
// &aclrtHostRegister ambiguous; the library exports the C functions checked here.
#include <acl/acl_rt.h>

#include "abi_match.h"

// The vendor enums our header declares its own way. aclError, aclrtStream and aclrtEvent are plain
// typedefs (int, void*, void*), identical to ours, so the function checks cover them without a mapping.
MSRL_ABI_MAP(::aclrtMemcpyKind, msrl::aclabi::aclrtMemcpyKind)
MSRL_ABI_MAP(::aclrtMemMallocPolicy, msrl::aclabi::aclrtMemMallocPolicy)
MSRL_ABI_MAP(::aclrtHostRegisterType, msrl::aclabi::aclrtHostRegisterType)
MSRL_ABI_MAP(::aclrtEventRecordedStatus, msrl::aclabi::aclrtEventRecordedStatus)

// Every enumerator of our enums.
MSRL_ABI_CHECK_ENUMERATOR(msrl::aclabi, ACL_MEMCPY_HOST_TO_HOST)
MSRL_ABI_CHECK_ENUMERATOR(msrl::aclabi, ACL_MEMCPY_HOST_TO_DEVICE)
MSRL_ABI_CHECK_ENUMERATOR(msrl::aclabi, ACL_MEMCPY_DEVICE_TO_HOST)
MSRL_ABI_CHECK_ENUMERATOR(msrl::aclabi, ACL_MEMCPY_DEVICE_TO_DEVICE)
MSRL_ABI_CHECK_ENUMERATOR(msrl::aclabi, ACL_MEM_MALLOC_HUGE_FIRST)
MSRL_ABI_CHECK_ENUMERATOR(msrl::aclabi, ACL_HOST_REGISTER_MAPPED)
MSRL_ABI_CHECK_ENUMERATOR(msrl::aclabi, ACL_EVENT_RECORDED_STATUS_NOT_READY)
MSRL_ABI_CHECK_ENUMERATOR(msrl::aclabi, ACL_EVENT_RECORDED_STATUS_COMPLETE)

// Every constant: aclrtHostRegisterV2 flags and error codes.
MSRL_ACL_CONSTANTS(MSRL_ABI_CHECK_CONSTANT)

// Every function the backend resolves, required or optional, and so every function the fake libascendcl
// exports (the fake checks its definitions against the same aclX_fn types).
#define CHECK_ACL_FUNCTION(name, ret, params) MSRL_ABI_CHECK_FUNCTION(name, #name, msrl::aclabi::name##_fn)
MSRL_ACL_SYMBOLS(CHECK_ACL_FUNCTION)
MSRL_ACL_OPTIONAL_SYMBOLS(CHECK_ACL_FUNCTION)
#undef CHECK_ACL_FUNCTION

#define COUNT(...) +1
const char* msrl_vendor_abi_acl(int* functions, int* constants) {
  *functions = 0 MSRL_ACL_SYMBOLS(COUNT) MSRL_ACL_OPTIONAL_SYMBOLS(COUNT);
  *constants = 8 MSRL_ACL_CONSTANTS(COUNT);  // 8: the enumerators above
  return "acl/acl_rt.h (torch-npu)";
}
