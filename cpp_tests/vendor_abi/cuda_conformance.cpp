// Conformance of csrc/runtime/cuda_abi.h with NVIDIA's own cuda_runtime_api.h. Built twice, against the
// CUDA 12 and the CUDA 13 headers (MSRL_EXPECT_CUDA_MAJOR): the backend loads libcudart.so.13, else .12,
// with one table of function types, so every entry must match both. The checks are static_asserts: if
// this file compiles, our header agrees with the vendor's.
//
// Our header goes first: several of our constants share their names with the vendor's macros.
#include "runtime/cuda_abi.h"

// Plain g++, no nvcc: crt/host_defines.h then defines __host__ and friends as nothing.
#include <cuda_runtime_api.h>

#include <cstddef>

#include "abi_match.h"

static_assert(CUDART_VERSION / 1000 == MSRL_EXPECT_CUDA_MAJOR, "the include path holds another CUDA major version");

// The vendor types our header declares its own way: handles, the error enum, the copy kind.
MSRL_ABI_MAP_OPAQUE(::CUstream_st, std::remove_pointer_t<msrl::cudaabi::cudaStream_t>)
MSRL_ABI_MAP_OPAQUE(::CUevent_st, std::remove_pointer_t<msrl::cudaabi::cudaEvent_t>)
MSRL_ABI_MAP(::cudaError, msrl::cudaabi::cudaError_t)
MSRL_ABI_MAP(::cudaMemcpyKind, msrl::cudaabi::cudaMemcpyKind)
static_assert(std::is_same_v<::cudaError_t, ::cudaError> && std::is_same_v<::cudaStream_t, ::CUstream_st*> &&
                  std::is_same_v<::cudaEvent_t, ::CUevent_st*>,
              "the vendor's handle and error typedefs are not what MSRL_ABI_MAP maps");

// cudaPointerAttributes grew in CUDA 13 (a locality-domain union and reserved[7] after the four fields CUDA 12
// has): ours has CUDA 13's size, and every field we read sits where both versions put it, so either runtime
// writes inside our struct and we read what it wrote.
using OurPointerAttributes = msrl::cudaabi::cudaPointerAttributes;
static_assert(sizeof(OurPointerAttributes) >= sizeof(::cudaPointerAttributes) &&
                  alignof(OurPointerAttributes) == alignof(::cudaPointerAttributes),
              "our cudaPointerAttributes is smaller than the vendor's: the runtime would write past it");
#if MSRL_EXPECT_CUDA_MAJOR >= 13
static_assert(sizeof(OurPointerAttributes) == sizeof(::cudaPointerAttributes), "cudaPointerAttributes: CUDA 13 size");
#endif
static_assert(offsetof(OurPointerAttributes, type) == offsetof(::cudaPointerAttributes, type) &&
                  offsetof(OurPointerAttributes, device) == offsetof(::cudaPointerAttributes, device) &&
                  offsetof(OurPointerAttributes, devicePointer) == offsetof(::cudaPointerAttributes, devicePointer) &&
                  offsetof(OurPointerAttributes, hostPointer) == offsetof(::cudaPointerAttributes, hostPointer),
              "cudaPointerAttributes: a field we read is not where the vendor writes it");
static_assert(sizeof(::cudaMemoryType) == sizeof(int), "cudaPointerAttributes::type is read as an int");
template <>
struct abi_match::Ours<::cudaPointerAttributes> {
  using type = OurPointerAttributes;
};

// Every enumerator of our cudaMemcpyKind (CopyKind casts to it).
MSRL_ABI_CHECK_ENUMERATOR(msrl::cudaabi, cudaMemcpyHostToHost)
MSRL_ABI_CHECK_ENUMERATOR(msrl::cudaabi, cudaMemcpyHostToDevice)
MSRL_ABI_CHECK_ENUMERATOR(msrl::cudaabi, cudaMemcpyDeviceToHost)
MSRL_ABI_CHECK_ENUMERATOR(msrl::cudaabi, cudaMemcpyDeviceToDevice)
MSRL_ABI_CHECK_ENUMERATOR(msrl::cudaabi, cudaMemcpyDefault)

// Every constant: error codes, host-alloc, host-register, stream and event flags.
MSRL_CUDART_CONSTANTS(MSRL_ABI_CHECK_CONSTANT)

// Every function the backend resolves, and so every function the fake libcudart exports (the fake checks its
// definitions against the same cudaX_fn types).
#define CHECK_CUDART_FUNCTION(name, ret, params) MSRL_ABI_CHECK_FUNCTION(name, #name, msrl::cudaabi::name##_fn)
MSRL_CUDART_SYMBOLS(CHECK_CUDART_FUNCTION)
#undef CHECK_CUDART_FUNCTION

// cudaMemcpyBatchAsync changed its parameters between CUDA 12 and 13 under one symbol name, so one table of
// function types cannot cover both versions: our header must not list it (see cuda_abi.h).
#define NOT_BATCH(name, ret, params) &&std::string_view(#name) != "cudaMemcpyBatchAsync"
static_assert(true MSRL_CUDART_SYMBOLS(NOT_BATCH), "cudaMemcpyBatchAsync needs a per-version type");
#undef NOT_BATCH

#define MSRL_CONFORMANCE_FN_(major) msrl_vendor_abi_cuda##major
#define MSRL_CONFORMANCE_FN(major) MSRL_CONFORMANCE_FN_(major)
#define COUNT(...) +1
const char* MSRL_CONFORMANCE_FN(MSRL_EXPECT_CUDA_MAJOR)(int* functions, int* constants) {
  *functions = 0 MSRL_CUDART_SYMBOLS(COUNT);
  *constants = 5 MSRL_CUDART_CONSTANTS(COUNT);  // 5: the cudaMemcpyKind enumerators
  return "cuda_runtime_api.h CUDART_VERSION " MSRL_ABI_STR(CUDART_VERSION);
}
