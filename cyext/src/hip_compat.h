// strata cyext: the few CUDA runtime names strata_kernels.cu uses, mapped onto HIP so that one
// kernel source builds with nvcc and with hipcc (HIP_PLATFORM=amd).
#pragma once

#if defined(__HIPCC__) || defined(STRATA_USE_HIP)
#include <hip/hip_runtime.h>
#define STRATA_PLATFORM_HIP 1

#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaErrorInvalidValue hipErrorInvalidValue
#define cudaStream_t hipStream_t
#define cudaGetLastError hipGetLastError
#define cudaGetErrorString hipGetErrorString
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaFuncSetAttribute hipFuncSetAttribute
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize

// Warp-level shuffles: HIP has no *_sync variants (wavefronts run in lock step); `width`
// partitions the wavefront (64 lanes on CDNA) the same way as on CUDA.
#define STRATA_SHFL_XOR(v, m, w) __shfl_xor((v), (m), (w))
#define STRATA_SHFL(v, src, w) __shfl((v), (src), (w))
#define STRATA_SHFL_UP(v, d, w) __shfl_up((v), (d), (w))
#else
#include <cuda_runtime.h>
#define STRATA_PLATFORM_HIP 0
#define STRATA_SHFL_XOR(v, m, w) __shfl_xor_sync(0xffffffffu, (v), (m), (w))
#define STRATA_SHFL(v, src, w) __shfl_sync(0xffffffffu, (v), (src), (w))
#define STRATA_SHFL_UP(v, d, w) __shfl_up_sync(0xffffffffu, (v), (d), (w))
#endif

// The tensor-core (mma.sync / ldmatrix / cp.async) attention path exists only for NVIDIA sm_80+.
#if !STRATA_PLATFORM_HIP
#define STRATA_HAVE_MMA 1
#else
#define STRATA_HAVE_MMA 0
#endif
