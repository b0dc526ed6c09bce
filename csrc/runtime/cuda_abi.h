// Our own declarations of the few CUDA runtime (libcudart) entry points msrl_core calls, so the core
// compiles without the CUDA toolkit. Values and signatures follow the CUDA Runtime API reference, and
// cpp_tests/vendor_abi proves them, at compile time in CI, equal to NVIDIA's own CUDA 12 and 13 headers.
// Never add cudaMemcpyBatchAsync here: its parameters changed in CUDA 13 under the same symbol.
//
// MSRL_CUDART_SYMBOLS(X) lists every function as X(name, return type, parameter list). The backend
// resolves each with dlsym; the fake libcudart in cpp_tests checks its exports against the same list.
#pragma once

#include <cstddef>

namespace msrl::cudaabi {

using cudaError_t = int;
using cudaStream_t = struct CUstream_st*;
using cudaEvent_t = struct CUevent_st*;

// cudaPointerGetAttributes' result. CUDA 12 has the four fields; CUDA 13 appends a locality-domain union and
// reserved[7] (96 bytes in all). Ours has CUDA 13's size with the same leading fields, so either runtime
// writes inside it (the conformance test checks the offsets against both headers); zero it before the call.
struct cudaPointerAttributes {
  int type;  // enum cudaMemoryType
  int device;
  void* devicePointer;
  void* hostPointer;
  long reserved[8];
};

enum cudaMemcpyKind : int {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

// Every constant we use, as X(type, name, value). The vendor conformance test (cpp_tests/vendor_abi)
// checks each value against NVIDIA's own header, where several of these names are macros.
#define MSRL_CUDART_CONSTANTS(X)                            \
  X(cudaError_t, cudaSuccess, 0)                            \
  X(cudaError_t, cudaErrorInvalidValue, 1)                  \
  X(cudaError_t, cudaErrorMemoryAllocation, 2)              \
  X(cudaError_t, cudaErrorCudartUnloading, 4)               \
  X(cudaError_t, cudaErrorInsufficientDriver, 35)           \
  X(cudaError_t, cudaErrorNoDevice, 100)                    \
  X(cudaError_t, cudaErrorInvalidDevice, 101)               \
  X(cudaError_t, cudaErrorInvalidResourceHandle, 400)       \
  X(cudaError_t, cudaErrorNotReady, 600)                    \
  X(cudaError_t, cudaErrorHostMemoryAlreadyRegistered, 712) \
  X(cudaError_t, cudaErrorHostMemoryNotRegistered, 713)     \
  X(cudaError_t, cudaErrorUnknown, 999)                     \
  X(unsigned, cudaHostAllocDefault, 0)                      \
  X(unsigned, cudaHostAllocPortable, 1)                     \
  X(unsigned, cudaHostRegisterDefault, 0)                   \
  X(unsigned, cudaHostRegisterPortable, 1)                  \
  X(unsigned, cudaHostRegisterReadOnly, 8)                  \
  X(unsigned, cudaStreamDefault, 0)                         \
  X(unsigned, cudaStreamNonBlocking, 1)                     \
  X(unsigned, cudaEventDefault, 0)                          \
  X(unsigned, cudaEventBlockingSync, 1)                     \
  X(unsigned, cudaEventDisableTiming, 2)                    \
  X(int, cudaMemoryTypeUnregistered, 0)                     \
  X(int, cudaMemoryTypeHost, 1)                             \
  X(int, cudaMemoryTypeDevice, 2)                           \
  X(int, cudaMemoryTypeManaged, 3)

#define MSRL_CUDART_CONSTANT(type, name, value) constexpr type name = value;
MSRL_CUDART_CONSTANTS(MSRL_CUDART_CONSTANT)
#undef MSRL_CUDART_CONSTANT

#define MSRL_CUDART_SYMBOLS(X)                                                                                   \
  X(cudaGetErrorString, const char*, (cudaError_t error))                                                        \
  X(cudaGetLastError, cudaError_t, ())                                                                           \
  X(cudaRuntimeGetVersion, cudaError_t, (int* version))                                                          \
  X(cudaGetDeviceCount, cudaError_t, (int* count))                                                               \
  X(cudaGetDevice, cudaError_t, (int* device))                                                                   \
  X(cudaSetDevice, cudaError_t, (int device))                                                                    \
  X(cudaPointerGetAttributes, cudaError_t, (cudaPointerAttributes * attributes, const void* ptr))                \
  X(cudaHostAlloc, cudaError_t, (void** ptr, size_t size, unsigned flags))                                       \
  X(cudaFreeHost, cudaError_t, (void* ptr))                                                                      \
  X(cudaHostRegister, cudaError_t, (void* ptr, size_t size, unsigned flags))                                     \
  X(cudaHostUnregister, cudaError_t, (void* ptr))                                                                \
  X(cudaMalloc, cudaError_t, (void** ptr, size_t size))                                                          \
  X(cudaFree, cudaError_t, (void* ptr))                                                                          \
  X(cudaStreamCreateWithFlags, cudaError_t, (cudaStream_t * stream, unsigned flags))                             \
  X(cudaStreamDestroy, cudaError_t, (cudaStream_t stream))                                                       \
  X(cudaStreamSynchronize, cudaError_t, (cudaStream_t stream))                                                   \
  X(cudaStreamWaitEvent, cudaError_t, (cudaStream_t stream, cudaEvent_t event, unsigned flags))                  \
  X(cudaMemcpyAsync, cudaError_t,                                                                                \
    (void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream))                        \
  X(cudaMemcpy2DAsync, cudaError_t,                                                                              \
    (void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height, cudaMemcpyKind kind, \
     cudaStream_t stream))                                                                                       \
  X(cudaEventCreateWithFlags, cudaError_t, (cudaEvent_t * event, unsigned flags))                                \
  X(cudaEventDestroy, cudaError_t, (cudaEvent_t event))                                                          \
  X(cudaEventRecord, cudaError_t, (cudaEvent_t event, cudaStream_t stream))                                      \
  X(cudaEventQuery, cudaError_t, (cudaEvent_t event))                                                            \
  X(cudaEventSynchronize, cudaError_t, (cudaEvent_t event))                                                      \
  X(cudaEventElapsedTime, cudaError_t, (float* ms, cudaEvent_t start, cudaEvent_t end))

// One function-pointer type per entry: cudaMalloc_fn, cudaFree_fn, ...
#define MSRL_CUDART_TYPEDEF(name, ret, params) using name##_fn = ret(*) params;
MSRL_CUDART_SYMBOLS(MSRL_CUDART_TYPEDEF)
#undef MSRL_CUDART_TYPEDEF

}  // namespace msrl::cudaabi
