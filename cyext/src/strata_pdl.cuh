// strata cyext: programmatic dependent launches (sm_90+), shared by the GPU translation units:
// the launch, and the two device-side calls a dependent kernel and its primary make.
#pragma once

#include "hip_compat.h"

namespace strata {

// A primary lets its dependent start early (pdl_launch_dependents: the MoE gate/up kernel, once
// every block runs); the dependent does what needs nothing of the primary (the down kernel's
// first down rows) and then waits for the primary's grid to finish and flush before it reads
// its output (pdl_wait_primary). Elsewhere (older GPUs, HIP) both are no-ops and the launches
// are stream-ordered.
__device__ __forceinline__ void pdl_launch_dependents() {
#if !STRATA_PLATFORM_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_primary() {
#if !STRATA_PLATFORM_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#if !STRATA_PLATFORM_HIP
// kernel<<<grid, block, smem, st>>>(args...), as a programmatic dependent launch when pdl (it
// may start while the kernel before it finishes: see pdl_wait_primary), else stream-ordered.
// The caller takes the launch's error (take_launch_error).
template <typename... Params, typename... Args>
void launch_maybe_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, int smem,
                      cudaStream_t st, bool pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = (size_t)smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, kernel, args...);
}
#endif

}  // namespace strata
