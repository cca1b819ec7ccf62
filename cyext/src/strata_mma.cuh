// strata cyext: the tensor-core pieces the streamed FP8 kernels share (sm_90+): one
// mma.sync m16n8k16 on bf16 or f16 operands, the exact e4m3 -> f16 pair decode, and the
// per-row power-of-two scaling that puts bf16 x into f16. Used by the dense linear
// (strata_linear_stream.cu) and the routed experts' gate/up on tensor cores
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

// x rows into f16 operands: each row is scaled by a power of two 2^s so that its largest
// magnitude lies in [2^14, 2^15). The scaling is exact, and so is the f16 of every element
// within 2^28 of the row's largest (f16's normal range); 2^-s undoes it on the result.

// The larger magnitude of a bf16x2 word's two values, as float bits (ordered as the values).
__device__ __forceinline__ uint32_t bf16x2_abs_max_bits(uint32_t w) {
  return max((w << 16) & 0x7fff0000u, w & 0x7fff0000u);
}

// A row's 2^s and 2^-s from its largest magnitude's float bits mx (0: a zero row), s within
// float's range.
__device__ __forceinline__ void f16_row_scale(uint32_t mx, float& scale, float& unscale) {
  const int e = mx ? (int)(mx >> 23) - 127 : 0;
  int sh = 14 - e;
  sh = sh > 126 ? 126 : sh < -126 ? -126 : sh;
  scale = __uint_as_float((uint32_t)(127 + sh) << 23);
  unscale = __uint_as_float((uint32_t)(127 - sh) << 23);
}

// Eight bf16 values (four words, first element lowest) times scale, as eight f16 values.
__device__ __forceinline__ uint4 bf16x8_scaled_to_f16x8(uint4 v, float scale) {
  uint32_t wd[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __uint_as_float(wd[i] << 16) * scale;
    const float hi = __uint_as_float(wd[i] & 0xffff0000u) * scale;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(wd[i]) : "f"(hi), "f"(lo));
  }
  return make_uint4(wd[0], wd[1], wd[2], wd[3]);
}

#endif

}  // namespace moe
}  // namespace strata
