// strata cyext: the tensor-core pieces the streamed FP8 kernels share (sm_90+): one
// mma.sync m16n8k16 on bf16 or f16 operands, and the exact e4m3 -> f16 pair decode. Used by the
// dense linear (strata_linear_stream.cu) and the routed experts' gate/up on tensor cores
// (strata_moe_stream.cu).
#pragma once

#include "hip_compat.h"

#include <stdint.h>

namespace strata {
namespace moe {

#if !STRATA_PLATFORM_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// One mma.sync m16n8k16 with float32 accumulation (d += a b), on bf16 operands or (F16) f16.
#define STRATA_MMA(T)                                                                      \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0,%1,%2,%3}, "     \
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                    \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                            \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
template <bool F16 = false>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1,
                                             uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (F16)
    STRATA_MMA("f16");
  else
    STRATA_MMA("bf16");
}
#undef STRATA_MMA

// Four e4m3 bytes -> two f16x2 words (the same element order as fp8x4_to_bf16x4), exactly:
// every e4m3 value is an f16 value, and the conversion is one instruction per pair.
__device__ __forceinline__ void fp8x4_to_f16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

#endif

}  // namespace moe
}  // namespace strata
