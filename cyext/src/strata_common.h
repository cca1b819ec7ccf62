// strata cyext: definitions shared by the CPU (C++) and GPU (CUDA/HIP) kernels.
//
// Element types are passed at run time as small integer codes (see STRATA_DTYPE_*); the Cython
// wrappers map torch dtypes onto them. bf16 and fp16 are handled as raw 16-bit words with our own
// conversions so that the same code compiles with g++, nvcc and hipcc (HIP 5.x has no
// hip_bf16.h) and so that rounding is exactly torch's (round-to-nearest-even).
#pragma once
#include <stdint.h>

#define STRATA_DTYPE_F32 0
#define STRATA_DTYPE_BF16 1
#define STRATA_DTYPE_F16 2
#define STRATA_DTYPE_FP8 3  // float8_e4m3fn (weights only, with block scales)

// What the gated delta rule writes beside its output (its `snaps` argument), by mode:
#define STRATA_GDN_SNAPS 0    // the state after every row: (ng, g, h, dk, dv)
#define STRATA_GDN_FINAL 1    // the state after each group's last row only: (ng, h, dk, dv)
#define STRATA_GDN_FACTORS 2  // every row's rank-one update: (ng, g, h, dk + dv + 1), per row and
                              // head [k (dk) | delta (dv) | decay], the values the update
                              // s = s * decay; s += k (outer) delta used, so that a commit that
                              // replays rows 0..a onto the state the window read has its bits

#if defined(__CUDACC__) || defined(__HIPCC__)
#define STRATA_HD __host__ __device__ __forceinline__
#else
#define STRATA_HD inline
#endif

namespace strata {

STRATA_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __uint_as_float(u);
#else
  union { uint32_t u; float f; } x; x.u = u; return x.f;
#endif
}
STRATA_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __float_as_uint(f);
#else
  union { uint32_t u; float f; } x; x.f = f; return x.u;
#endif
}

STRATA_HD float bf16_to_float(uint16_t h) { return bits_to_float(((uint32_t)h) << 16); }

STRATA_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (uint16_t)(u >> 16);
}

STRATA_HD float f16_to_float(uint16_t h) {
  uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // subnormal: value = man * 2^-24
    float v = (float)man * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

STRATA_HD uint16_t float_to_f16(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t au = u & 0x7fffffffu;
  if (au >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (au > 0x7f800000u ? 0x200u : 0u));
  if (au >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to >= 65520 -> inf
  if (au < 0x38800000u) {  // below 2^-14: subnormal or zero
    if (au < 0x33000000u) return (uint16_t)sign;  // < 2^-25 rounds to 0 (2^-25 ties to even 0)
    uint32_t e = au >> 23;
    uint32_t m = (au & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;  // value = m * 2^(e-150); half subnormal unit = 2^-24
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) r += 1u;
    return (uint16_t)(sign | r);
  }
  uint32_t r = au - 0x38000000u;  // rebias exponent 127 -> 15 (still with 23-bit mantissa)
  r += 0xfffu + ((r >> 13) & 1u);
  return (uint16_t)(sign | (r >> 13));
}

// Load element i of a buffer of run-time dtype as float.
STRATA_HD float load_as_float(const void* p, int dtype, int64_t i) {
  if (dtype == STRATA_DTYPE_F32) return ((const float*)p)[i];
  if (dtype == STRATA_DTYPE_BF16) return bf16_to_float(((const uint16_t*)p)[i]);
  return f16_to_float(((const uint16_t*)p)[i]);
}

// Store float into element i of a buffer of run-time dtype (round to nearest even).
STRATA_HD void store_from_float(void* p, int dtype, int64_t i, float v) {
  if (dtype == STRATA_DTYPE_F32) ((float*)p)[i] = v;
  else if (dtype == STRATA_DTYPE_BF16) ((uint16_t*)p)[i] = float_to_bf16(v);
  else ((uint16_t*)p)[i] = float_to_f16(v);
}

// Round a float through a dtype (what `.to(dtype).float()` does).
STRATA_HD float round_through(float v, int dtype) {
  if (dtype == STRATA_DTYPE_BF16) return bf16_to_float(float_to_bf16(v));
  if (dtype == STRATA_DTYPE_F16) return f16_to_float(float_to_f16(v));
  return v;
}

// Element-type tags for compile-time dispatch.
struct F32 { typedef float storage; static const int code = STRATA_DTYPE_F32; };
struct BF16 { typedef uint16_t storage; static const int code = STRATA_DTYPE_BF16; };
struct F16 { typedef uint16_t storage; static const int code = STRATA_DTYPE_F16; };

template <typename T> STRATA_HD float to_f(typename T::storage x);
template <> STRATA_HD float to_f<F32>(float x) { return x; }
template <> STRATA_HD float to_f<BF16>(uint16_t x) { return bf16_to_float(x); }
template <> STRATA_HD float to_f<F16>(uint16_t x) { return f16_to_float(x); }

template <typename T> STRATA_HD typename T::storage from_f(float x);
template <> STRATA_HD float from_f<F32>(float x) { return x; }
template <> STRATA_HD uint16_t from_f<BF16>(float x) { return float_to_bf16(x); }
template <> STRATA_HD uint16_t from_f<F16>(float x) { return float_to_f16(x); }

STRATA_HD int dtype_size(int dtype) {
  return dtype == STRATA_DTYPE_F32 ? 4 : (dtype == STRATA_DTYPE_FP8 ? 1 : 2);
}

// float8_e4m3fn byte -> float, exactly (sign, 4 exponent bits with bias 7, 3 mantissa bits;
// exponent 0 is subnormal, 0x7f / 0xff are NaN, no infinities). Portable software decode.
STRATA_HD float fp8e4m3_to_float(uint8_t b) {
  const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  float v;
  if (e == 0) v = (float)m * 0.001953125f;  // m * 2^-9
  else if (e == 15 && m == 7) v = bits_to_float(0x7fc00000u);
  else v = bits_to_float(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) ? -v : v;
}

}  // namespace strata
