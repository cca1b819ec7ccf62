// strata cyext: what the routed-expert kernels share (strata_moe.cu's per-block kernels and
// strata_moe_stream.cu's streamed ones): launch errors, the weight chunk decode and the dot
// products in their fixed order, the call's parameters and where an expert's weights are.
// Everything is inline, in strata::moe, so both translation units include it.
#pragma once

#include "hip_compat.h"
#include "strata_common.h"
#include "strata_gpu_internal.h"
#include "strata_kernels.h"
#include "strata_pdl.cuh"

#include <math.h>
#include <stdint.h>

namespace strata {
namespace moe {

inline int take_launch_error(const char* name) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    gpu_set_last_kernel(name);
    return (int)e;
  }
  return 0;
}

// A call the kernels do not take: strata_gpu_last_kernel() names what is wrong.
inline int invalid(const char* what) {
  gpu_set_last_kernel(what);
  return (int)cudaErrorInvalidValue;
}

inline unsigned ceil_div_u(int64_t a, int64_t b) { return (unsigned)((a + b - 1) / b); }
// Smallest power of two >= ceil(chunks / 32): the 16-byte chunks a lane holds of a row, lane l
// taking chunks l, l + 32, ...; 0 when the row is longer than 16 per lane.
inline int chunks_per_lane(int64_t chunks) {
  const int64_t need = (chunks + 31) / 32;
  for (int c = 1; c <= 16; c <<= 1)
    if (need <= c) return c;
  return 0;
}
inline bool aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }

constexpr int MOE_MAX_PAIRS = 512;  // N * k; two pairs per thread in the block scans
constexpr int MOE_MAX_ROWS = 32;

// Weight element types: 16-byte chunk = EPC elements. FP8 = float8_e4m3fn with block scales.
struct FP8W { typedef uint8_t storage; static const int code = STRATA_DTYPE_FP8; };
template <typename W> struct WChunk;
template <> struct WChunk<F32> { static const int EPC = 4; static const bool scaled = false; };
template <> struct WChunk<BF16> { static const int EPC = 8; static const bool scaled = false; };
template <> struct WChunk<F16> { static const int EPC = 8; static const bool scaled = false; };
template <> struct WChunk<FP8W> { static const int EPC = 16; static const bool scaled = true; };

__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg((const uint4*)p); }

// Makes w's value opaque to the optimiser (no instruction): loops that decode the same weight
// registers once per member row would otherwise have the decode hoisted out (loop-invariant),
// with all the decoded floats live at once, and spill.
__device__ __forceinline__ void opaque(uint4& w) {
#if STRATA_PLATFORM_HIP
  asm volatile("" : "+v"(w.x), "+v"(w.y), "+v"(w.z), "+v"(w.w));  // vector registers on AMD
#else
  asm volatile("" : "+r"(w.x), "+r"(w.y), "+r"(w.z), "+r"(w.w));
#endif
}

__device__ __forceinline__ float half_bits_to_float(uint16_t h) {
#if !STRATA_PLATFORM_HIP
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return f16_to_float(h);
#endif
}

// Two e4m3 bytes (low byte = first element) -> two floats, exactly.
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t two) {
#if !STRATA_PLATFORM_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h2;
  const uint16_t in = (uint16_t)(two & 0xffffu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  return make_float2(half_bits_to_float((uint16_t)(h2 & 0xffffu)),
                     half_bits_to_float((uint16_t)(h2 >> 16)));
#else
  return make_float2(fp8e4m3_to_float((uint8_t)(two & 0xffu)),
                     fp8e4m3_to_float((uint8_t)((two >> 8) & 0xffu)));
#endif
}

// Decode one 16-byte weight chunk into EPC floats (no scale).
template <typename W> __device__ __forceinline__ void decode_chunk(uint4 w, float* f);
template <> __device__ __forceinline__ void decode_chunk<F32>(uint4 w, float* f) {
  f[0] = __uint_as_float(w.x); f[1] = __uint_as_float(w.y);
  f[2] = __uint_as_float(w.z); f[3] = __uint_as_float(w.w);
}
template <> __device__ __forceinline__ void decode_chunk<BF16>(uint4 w, float* f) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}
template <> __device__ __forceinline__ void decode_chunk<F16>(uint4 w, float* f) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = half_bits_to_float((uint16_t)(u[i] & 0xffffu));
    f[2 * i + 1] = half_bits_to_float((uint16_t)(u[i] >> 16));
  }
}
template <> __device__ __forceinline__ void decode_chunk<FP8W>(uint4 w, float* f) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = fp8x2_to_float2(u[i]);
    const float2 b = fp8x2_to_float2(u[i] >> 16);
    f[4 * i] = a.x; f[4 * i + 1] = a.y; f[4 * i + 2] = b.x; f[4 * i + 3] = b.y;
  }
}

// acc + (scale x) sum_e w_e * x_e over one chunk, elements in order.
template <typename W>
__device__ __forceinline__ float chunk_fma(const float* wf, const float* xf, float scale,
                                           float acc) {
  const int EPC = WChunk<W>::EPC;
  if (WChunk<W>::scaled) {
    float part = 0.f;
#pragma unroll
    for (int e = 0; e < EPC; ++e) part = fmaf(wf[e], xf[e], part);
    return fmaf(scale, part, acc);
  } else {
#pragma unroll
    for (int e = 0; e < EPC; ++e) acc = fmaf(wf[e], xf[e], acc);
    return acc;
  }
}

// chunk_fma of a chunk still in its 16 bytes, decoded a word at a time next to its FMAs, so
// that no decoded copy of the whole chunk is live (the FP8 gate/up kernel spilled with one).
// Same elements, same order, same result as decode_chunk + chunk_fma.
template <typename W>
__device__ __forceinline__ float chunk_dot(uint4 w, const float* xf, float scale, float acc) {
  float wf[WChunk<W>::EPC];
  decode_chunk<W>(w, wf);
  return chunk_fma<W>(wf, xf, scale, acc);
}
// part + the dot of 8 FP8 weights (two words, low byte first) with 8 activations, in order.
__device__ __forceinline__ float fp8_half_dot(uint32_t w0, uint32_t w1, const float* xf,
                                              float part) {
  const uint32_t u[2] = {w0, w1};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float2 a = fp8x2_to_float2(u[i]);
    const float2 b = fp8x2_to_float2(u[i] >> 16);
    part = fmaf(a.x, xf[4 * i], part);
    part = fmaf(a.y, xf[4 * i + 1], part);
    part = fmaf(b.x, xf[4 * i + 2], part);
    part = fmaf(b.y, xf[4 * i + 3], part);
  }
  return part;
}
template <>
__device__ __forceinline__ float chunk_dot<FP8W>(uint4 w, const float* xf, float scale, float acc) {
  // the same FMAs in the same order as one pass over the four words
  return fmaf(scale, fp8_half_dot(w.z, w.w, xf + 8, fp8_half_dot(w.x, w.y, xf, 0.f)), acc);
}

// EPC consecutive activations (run-time dtype) from element `off` (a multiple of 4) as floats.
// SHARED: x is in shared memory (plain loads), else global memory read through the
// read-only path.
template <int EPC, bool SHARED = false>
__device__ __forceinline__ void load_act(const void* x, int dtype, int64_t off, float* f) {
  if (dtype == STRATA_DTYPE_F32) {
    const float4* p = (const float4*)((const float*)x + off);
#pragma unroll
    for (int i = 0; i < EPC / 4; ++i) {
      const float4 v = SHARED ? p[i] : __ldg(p + i);
      f[4 * i] = v.x; f[4 * i + 1] = v.y; f[4 * i + 2] = v.z; f[4 * i + 3] = v.w;
    }
    return;
  }
  const uint16_t* base = (const uint16_t*)x + off;
  uint32_t u[EPC / 2];
  if (EPC >= 8) {
#pragma unroll
    for (int i = 0; i < EPC / 8; ++i) {
      const uint4 v = SHARED ? *(const uint4*)(base + 8 * i) : ldg16(base + 8 * i);
      u[4 * i] = v.x; u[4 * i + 1] = v.y; u[4 * i + 2] = v.z; u[4 * i + 3] = v.w;
    }
  } else {
    const uint2 v = SHARED ? *(const uint2*)base : __ldg((const uint2*)base);
    u[0] = v.x; u[1] = v.y;
  }
#pragma unroll
  for (int i = 0; i < EPC / 2; ++i) {
    if (dtype == STRATA_DTYPE_BF16) {
      f[2 * i] = __uint_as_float(u[i] << 16);
      f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    } else {
      f[2 * i] = half_bits_to_float((uint16_t)(u[i] & 0xffffu));
      f[2 * i + 1] = half_bits_to_float((uint16_t)(u[i] >> 16));
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += STRATA_SHFL_XOR(v, m, 32);
  return v;
}
// warp_sum of each of N values, the N butterflies interleaved (the same sums, in the same order,
// as N calls of warp_sum, with N independent shuffles in flight at each step).
template <int N>
__device__ __forceinline__ void butterflies(float (&v)[N]) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
#pragma unroll
    for (int r = 0; r < N; ++r) v[r] += STRATA_SHFL_XOR(v[r], m, 32);
  }
}

// Exclusive prefix sum of one int per thread over a block of THREADS threads (has a barrier;
// warp_tot: THREADS / 32 ints of shared memory, not reused before another barrier).
template <int THREADS>
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_tot, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = STRATA_SHFL_UP(x, d, 32);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_tot[warp] = x;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < THREADS / 32; ++w) {
    const int t = warp_tot[w];
    if (w < warp) before += t;
    all += t;
  }
  *total = all;
  return before + x - v;
}

// ------------------------------------------------------------------------------------------------
// moe_experts

// Wide launches (STRATA_MOE_X_GLOBAL, strata_moe_stream.cu): FP8 weights without the expert
// cache, x staged in global memory, up to this many rows and pairs (the block scans take up to
// eleven pairs per thread). Launches of up to 64 rows keep the layout they were measured with.
constexpr int MOE_WIDE_MAX_ROWS = 512;
constexpr int MOE_WIDE_MAX_PAIRS = 5984;
// Up to this many pairs (128 rows at top-11, three per thread in the scans) the down kernel keeps
// its results (P x 16 floats) in shared memory; a launch of more pairs is "big": its results go
// to the workspace (MoeParams::y_stage) and its scans take up to eleven pairs per thread. Why:
// eight slots' 64-token chunks (engine.prefill_slots) are 512 rows, and every launch reads the
// distinct experts of its rows, nearly all 512 at 128 rows, so four 128-row launches read the
// experts about four times where one launch reads them once.
constexpr int MOE_WIDE_SMEM_PAIRS = 1632;

struct MoeParams {
  const void* x;
  void* out;
  const void* w_gu;
  const void* w_down;
  const float* gu_scale;
  const float* down_scale;
  const float* topk_w;
  const int64_t* topk_ids;
  float* act;    // (P, I) float32
  // Wide launches (strata_moe_stream.cu, moe_stage_x): x as scaled f16 rows of 2H + 16 bytes
  // and each row's unscale, in the workspace past the per-block kernels' tables.
  uint8_t* x_stage;
  float* x_unscale;
  // The per-block kernels' tables (launches of up to MOE_MAX_ROWS rows; else NULL):
  int* counts;   // (P,) members of pair s's expert when s is its leader, else 0
  int* members;  // (P, P) member pairs of each leader, in pair order
  int64_t gu_expert_bytes, down_expert_bytes;     // stride between experts' weights
  int64_t gu_scale_expert, down_scale_expert;     // floats per expert in the scale tensors
  // Expert cache (strata_expert_cache.h): slot_of NULL = none (the stacks hold every expert).
  const int32_t* slot_of;
  const void* h_gu;
  const void* h_down;
  const float* h_gu_scale;
  const float* h_down_scale;
  // The cache's counting (strata_expert_cache.h): routed_counts NULL = none.
  float* routed_counts;
  int* window_state;
  const int* count_layer;
  int n_host, n_layers;
  int all_resident;  // every expert id has a device slot (no slot_of, or a cache that holds all)
  int n, k, P, E, H, I, bo, bi, x_dtype;
  // The rows are a prompt chunk's (else a decode window's): which down kernel runs
  // (STRATA_MOE_DOWN_MMA), so that a row's bits never depend on how many rows share its launch.
  int prompt;
  int nbg;           // ceil(I / bo): scale rows of the gate half (the up half follows)
  int ncb_h, ncb_i;  // scale columns of gate/up (over H) and of down (over I)
  // Big wide launches (more than MOE_WIDE_SMEM_PAIRS pairs): the down kernel's results, each
  // CTA's (P, T) floats at blockIdx.x * P * T (H * P floats in all), in the workspace past x.
  float* y_stage;
  // The fused kernel's counters (STRATA_MOE_FUSED, strata_moe_stream.cu moe_fused_mma): a
  // ticket at MOE_SYNC_TICKET and a counter per distinct expert from MOE_SYNC_DONE, zero between
  // launches (the last CTA of a launch resets them); NULL: not fused.
  int* sync;
};
constexpr int MOE_SYNC_TICKET = 0;
constexpr int MOE_SYNC_DONE = 32;  // (the counters on lines of their own)
constexpr int MOE_SYNC_INTS = MOE_SYNC_DONE + MOE_MAX_PAIRS;

#if !STRATA_PLATFORM_HIP
// What the streamed kernels (strata_moe_stream.cu, strata_linear_stream.cu) plan with, per
// device, read once (benign races: the same value is written).
struct DeviceFacts {
  int sms = 0, smem_optin = 0, major = 0;
};
inline DeviceFacts device_facts(int device) {
  static DeviceFacts cached[64];
  if (device < 0 || device >= 64) return DeviceFacts();
  if (!cached[device].sms) {
    int sms = 0, smem = 0, major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cached[device].major = major;
    cached[device].smem_optin = smem;
    cached[device].sms = sms;
  }
  return cached[device];
}

// Raises a kernel's dynamic shared-memory limit (not a stream operation, so it is allowed while
// a graph is captured); `done` remembers the largest limit already set.
template <typename K>
int allow_smem(K kernel, int bytes, int& done, const char* name) {
  if (done >= bytes) return 0;
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) {
    gpu_set_last_kernel(name);
    return (int)e;
  }
  done = bytes;
  return 0;
}

#endif

// The streamed kernels (strata_moe_stream.cu, sm_90+): launches them and sets *launched when
// they take the call (FP8 or bf16 weights, bf16 x, shapes within their limits, and unless
// every_size, the row counts where they measured faster), else leaves it false and the caller
// runs the per-block kernels. The caller decides whether an expert cache that can miss may run
// them (strata_moe.cu). plan_only: only whether they would take it. Returns 0 or a CUDA error
// code.
int launch_moe_stream(const MoeParams& p, int w_dtype, int device, bool pdl, bool every_size,
                      cudaStream_t st, bool* launched, bool plan_only = false);

// The streamed FP8 linear on tensor cores (strata_linear_stream.cu, sm_90+): whether it takes
// an (m, in) x (o, in) product with (bo, bi) blocks (any m: launches of 16 rows), and its
// launch. Returns 0 or a CUDA error code.
bool linear_stream_takes(int64_t m, int64_t in, int64_t o, int64_t bo, int64_t bi, int w_dtype,
                         int x_dtype, int device);
int launch_linear_stream(const void* x, const void* w, const float* scale, void* out, int64_t m,
                         int64_t in, int64_t o, int64_t bo, int64_t bi, int device, bool pdl,
                         cudaStream_t st);
// The small bf16 linear on tensor cores (strata_linear_stream.cu, sm_90+): whether it takes an
// (m, in) x (o, in) product of bf16 x and W (at most 16 rows, in a multiple of 32 up to 1024),
// and its launch. Returns 0 or a CUDA error code.
bool linear_bf16_mma_takes(int64_t m, int64_t in, int64_t o, int device);
int launch_linear_bf16_mma(const void* x, const void* w, void* out, int64_t m, int64_t in,
                           int64_t o, bool pdl, cudaStream_t st);

// The one place where an expert's weights are found. With the expert cache, a resident
// expert is read from its device slot and a missing one (slot -1) from the pinned host store
// through its device-visible address (zero-copy over the bus).
__device__ __forceinline__ int expert_row(const MoeParams& p, int e) {
  return p.slot_of ? __ldg(p.slot_of + e) : e;
}
__device__ __forceinline__ const uint8_t* expert_gate_up(const MoeParams& p, int e) {
  const int r = expert_row(p, e);
  if (r < 0) return (const uint8_t*)p.h_gu + (int64_t)e * p.gu_expert_bytes;
  return (const uint8_t*)p.w_gu + (int64_t)r * p.gu_expert_bytes;
}
__device__ __forceinline__ const uint8_t* expert_down(const MoeParams& p, int e) {
  const int r = expert_row(p, e);
  if (r < 0) return (const uint8_t*)p.h_down + (int64_t)e * p.down_expert_bytes;
  return (const uint8_t*)p.w_down + (int64_t)r * p.down_expert_bytes;
}
__device__ __forceinline__ const float* expert_gate_up_scale(const MoeParams& p, int e) {
  const int r = expert_row(p, e);
  if (r < 0) return p.h_gu_scale + (int64_t)e * p.gu_scale_expert;
  return p.gu_scale + (int64_t)r * p.gu_scale_expert;
}
__device__ __forceinline__ const float* expert_down_scale(const MoeParams& p, int e) {
  const int r = expert_row(p, e);
  if (r < 0) return p.h_down_scale + (int64_t)e * p.down_scale_expert;
  return p.down_scale + (int64_t)r * p.down_scale_expert;
}

// The expert cache's counting, by the leader block (tile 0) of expert e with its `members`
// pairs: the routing counts, and the window's hit or miss the first time it sees e (the seen
// flag's exchange makes the several calls of a window, and their blocks, count e once).
__device__ __forceinline__ void count_expert(const MoeParams& p, int e, int members) {
  if (e >= p.n_host) return;  // a folded shared expert: always resident, not counted
  int l = __ldg(p.count_layer);
  l = l < 0 ? 0 : (l >= p.n_layers ? p.n_layers - 1 : l);  // a kernel cannot raise
  const int64_t at = (int64_t)l * p.n_host + e;
  atomicAdd(p.routed_counts + at, (float)members);
  if (atomicExch(p.window_state + 2 + at, 1) == 0)
    atomicAdd(p.window_state + (expert_row(p, e) >= 0 ? 0 : 1), 1);
}

__device__ __forceinline__ int clamp_expert(int64_t e, int E) {
  return e < 0 ? 0 : (e >= E ? E - 1 : (int)e);  // a kernel cannot raise; the wrapper checks
}

}  // namespace moe
}  // namespace strata
