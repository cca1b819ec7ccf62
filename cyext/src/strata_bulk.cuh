// strata cyext: the bulk copy engine (sm_90+) and its mbarriers, for kernels that stream
// weights through a ring of shared-memory stages: one thread issues `cp.async.bulk` copies into
// a stage and the stage's "full" barrier counts the bytes landing; the consumer of the stage
// releases it on its "empty" barrier. Only for device code compiled for sm_90 or later.
#pragma once

#include "hip_compat.h"

#include <stdint.h>

namespace strata {
namespace bulk {

#if !STRATA_PLATFORM_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
// After the barriers are initialised, before any thread or the copy engine uses them.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Waits until the barrier's phase of this parity has completed. A barrier's waiters must
// follow its phases in order (only the parity is compared): each stage has one consumer.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_u32(bar);
  uint32_t ok = 0;
  while (!ok) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(a), "r"(parity)
        : "memory");
  }
}
// An L2 policy for data read once per kernel (weights): evicted first.
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global memory into this CTA's
// shared memory; completion counted on bar.
__device__ __forceinline__ void load(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                     uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(pol)
      : "memory");
}
// The same without a cache hint (data read again soon, e.g. activations).
__device__ __forceinline__ void load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
// Named barrier 1 among `threads` threads (a multiple of 32) of the CTA.
__device__ __forceinline__ void sync_threads(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

#endif

}  // namespace bulk
}  // namespace strata
