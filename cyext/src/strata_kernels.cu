// strata cyext: CUDA kernels of the grouped decode (builds with nvcc, and with hipcc through
// hip_compat.h). Semantics and layouts: strata/kernels/reference.py. Host API: strata_kernels.h.
//
// Every entry point launches on the caller's stream, allocates nothing and never synchronises,
// so the calls can be captured into CUDA graphs. Launch errors are read with cudaGetLastError and
// returned as an error code (the Cython wrapper turns them into RuntimeError).
//
// Kernels
//   write_kv_kernel          scatter the window's K/V rows into the caches (dtype conversion).
//   attn_mma_kernel          split-K grouped window attention on tensor cores (sm_80+ mma.sync,
//                            bf16/fp16, head dim 64/128/256). One block = (split, kv head,
//                            group, row block): the rep*G query rows of one (group, kv head) share
//                            every K/V tile, which is streamed through shared memory with 16-byte
//                            cp.async in a 2-4 stage pipeline. fp32 accumulation and online softmax.
//   attn_simt_kernel         the same on CUDA cores (fp32, HIP, other head dims, misaligned views).
//   attn_combine_kernel      merges the nsplit partial (max, sum, O) of each row (second pass).
//   gdn_kernel               gated delta rule over a group's rows; block = (Dv tile of 32, head,
//                            group); the state slice lives in registers; per row its rank-one
//                            update factors (decode windows) or the whole state (snapshots),
//                            or (prompt chunks) the state after the last row.
//   conv_kernel              depthwise causal conv + SiLU, one thread per (channel, row), with
//                            snapshots (conv_serial_kernel: the earlier walk over the rows);
//                            with ba blocks past the conv's, also DeltaNet's b/a projection.
//   commit_kernel            replays each group's accepted rows' factors onto its slot's state
//                            in place, copies the accepted conv snapshot, advances pos.
//   moe_* / linear_skinny_*  routed experts and the skinny FP8/bf16 linear: strata_moe.cu.

#include "hip_compat.h"
#include "strata_common.h"
#include "strata_kernels.h"
#include "strata_gpu_internal.h"
#include "strata_pdl.cuh"

#include <math.h>
#include <stdint.h>

#include <type_traits>

using namespace strata;

namespace {

// ------------------------------------------------------------------------------------------------
// host helpers

thread_local const char* g_last_kernel = "";

int take_launch_error(const char* name) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    g_last_kernel = name;
    return (int)e;
  }
  return 0;
}

int use_device(int device) {
  int cur = -1;
  cudaError_t e = cudaGetDevice(&cur);
  if (e == cudaSuccess && cur != device) e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    g_last_kernel = "cudaSetDevice";
    return (int)e;
  }
  (void)cudaGetLastError();  // do not blame our launch for an older error
  return 0;
}

inline unsigned ceil_div_u(int64_t a, int64_t b) { return (unsigned)((a + b - 1) / b); }
inline bool aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }

// ------------------------------------------------------------------------------------------------
// device helpers

__device__ __forceinline__ int64_t clamp_slot(int64_t s, int64_t nslots) {
  return (s < 0 || s >= nslots) ? nslots - 1 : s;  // a bad slot lands on the scratch slot
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// ------------------------------------------------------------------------------------------------
// write_kv

struct WriteKvParams {
  void* kc;
  void* vc;
  const void* k;
  const void* v;
  const int64_t* group_slot;
  const int64_t* group_pos;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  int64_t nslots, T;
  int g, hkv, d, cache_dtype, kv_dtype;
};

__global__ void write_kv_kernel(WriteKvParams p) {
  const int row = blockIdx.x;  // n * g + j
  const int n = row / p.g, j = row % p.g;
  const int64_t slot = clamp_slot(p.group_slot[n], p.nslots);
  const int64_t pos = min64(max64(p.group_pos[n] + j, 0), p.T - 1);
  const bool is_v = blockIdx.y == 1;
  const void* src = is_v ? p.v : p.k;
  void* dst = is_v ? p.vc : p.kc;
  const int64_t s0 = is_v ? p.vs0 : p.ks0, s1 = is_v ? p.vs1 : p.ks1, s2 = is_v ? p.vs2 : p.ks2;
  const int64_t total = (int64_t)p.hkv * p.d;
  for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t hh = i / p.d, dd = i % p.d;
    float x = load_as_float(src, p.kv_dtype, (int64_t)row * total + i);
    store_from_float(dst, p.cache_dtype, slot * s0 + pos * s1 + hh * s2 + dd, x);
  }
}

// ------------------------------------------------------------------------------------------------
// attention: shared parameters

struct AttnParams {
  const void* q;
  void* out;
  const void* kc;
  const void* vc;
  float* ws_o;   // (ng, hkv, nsplit, rows, d) partial numerators
  float* ws_ml;  // (ng, hkv, nsplit, rows, 2) partial (max in log2 units, sum)
  const int64_t* group_slot;
  const int64_t* group_pos;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  int64_t nslots, ctx, chunk;
  int g, hq, hkv, d, rep, rows, nsplit, nrg, q_dtype;
  float scale_log2;  // softmax scale * log2(e): scores live in log2 units
};

__device__ __forceinline__ int64_t q_row_offset(const AttnParams& p, int n, int h, int r) {
  const int j = r / p.rep, ri = r % p.rep;  // row r of a (group, kv head) = (window row, rep)
  return (((int64_t)n * p.g + j) * p.hq + (int64_t)h * p.rep + ri) * p.d;
}

__device__ __forceinline__ int64_t ws_row(const AttnParams& p, int n, int h, int split, int r) {
  return (((int64_t)n * p.hkv + h) * p.nsplit + split) * p.rows + r;
}

// Last key (exclusive) that any of rows [r0, r1) of group n may see, bounded by ctx.
__device__ __forceinline__ int64_t key_end(const AttnParams& p, int64_t pos0, int r_last) {
  return min64(p.ctx, pos0 + r_last / p.rep + 1);
}

// Writes the result for a block whose key range is empty (zeros, or an empty partial).
__device__ void attn_write_empty(const AttnParams& p, int n, int h, int split, int row0,
                                 int nrows) {
  for (int i = threadIdx.x; i < nrows * p.d; i += blockDim.x) {
    const int r = row0 + i / p.d, dd = i % p.d;
    if (r >= p.rows) continue;
    if (p.nsplit == 1) {
      store_from_float(p.out, p.q_dtype, q_row_offset(p, n, h, r) + dd, 0.f);
    } else if (dd == 0) {
      float* ml = p.ws_ml + 2 * ws_row(p, n, h, split, r);
      ml[0] = -INFINITY;
      ml[1] = 0.f;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// attention on CUDA cores (any dtype, head dim <= 256, any strides)
//
// Block: 128 threads = 16 rows x 8 lanes; tiles of 8 keys. Lane (row i, sub) scores key `sub` of
// the tile for row i, then accumulates output dims sub, sub+8, ... of row i.

constexpr int SIMT_ROWS = 16;
constexpr int SIMT_KEYS = 8;

template <int NPT, typename TC>
__global__ void __launch_bounds__(128) attn_simt_kernel(AttnParams p) {
  typedef typename TC::storage cstore;
  extern __shared__ float smem_f[];
  const int d = p.d;
  const int qstr = d + 1;                               // padded: rows read at the same d
  float* Qs = smem_f;                                   // [16][d+1]
  float* Kt = Qs + SIMT_ROWS * qstr;                    // [d][8]
  float* Vs = Kt + d * SIMT_KEYS;                       // [8][d]
  float* Ps = Vs + d * SIMT_KEYS;                       // [16][8]

  const int split = blockIdx.x, h = blockIdx.y;
  const int n = blockIdx.z / p.nrg, rg = blockIdx.z % p.nrg;
  const int row0 = rg * SIMT_ROWS;
  const int tid = threadIdx.x, i = tid >> 3, sub = tid & 7;
  const int64_t slot = clamp_slot(p.group_slot[n], p.nslots);
  const int64_t pos0 = p.group_pos[n];
  const int r_last = min(p.rows, row0 + SIMT_ROWS) - 1;
  const int64_t kstart = (int64_t)split * p.chunk;
  const int64_t kstop = min64(kstart + p.chunk, key_end(p, pos0, r_last));
  if (kstart >= kstop) {
    attn_write_empty(p, n, h, split, row0, SIMT_ROWS);
    return;
  }
  const cstore* kc = (const cstore*)p.kc;
  const cstore* vc = (const cstore*)p.vc;

  for (int idx = tid; idx < SIMT_ROWS * d; idx += 128) {
    const int r = idx / d, dd = idx % d;
    const int gr = row0 + r;
    float x = 0.f;
    if (gr < p.rows) x = load_as_float(p.q, p.q_dtype, q_row_offset(p, n, h, gr) + dd);
    Qs[r * qstr + dd] = x * p.scale_log2;
  }
  const int grow = row0 + i;
  // the last key this row may see (padding rows see the whole range, their output is dropped)
  const int64_t lim = grow < p.rows ? min64(pos0 + grow / p.rep, kstop - 1) : kstop - 1;

  float m = -INFINITY, l = 0.f;
  float o[NPT];
#pragma unroll
  for (int u = 0; u < NPT; ++u) o[u] = 0.f;

  for (int64_t key0 = kstart; key0 < kstop; key0 += SIMT_KEYS) {
    __syncthreads();  // previous tile fully consumed (and Qs written, first time)
    for (int idx = tid; idx < SIMT_KEYS * d; idx += 128) {
      const int kk = idx / d, dd = idx % d;
      const int64_t key = key0 + kk;
      float kx = 0.f, vx = 0.f;
      if (key < kstop) {
        kx = to_f<TC>(kc[slot * p.ks0 + key * p.ks1 + h * p.ks2 + dd]);
        vx = to_f<TC>(vc[slot * p.vs0 + key * p.vs1 + h * p.vs2 + dd]);
      }
      Kt[dd * SIMT_KEYS + kk] = kx;
      Vs[kk * d + dd] = vx;
    }
    __syncthreads();
    float s = 0.f;
    const float* qrow = Qs + i * qstr;
    for (int dd = 0; dd < d; ++dd) s += qrow[dd] * Kt[dd * SIMT_KEYS + sub];
    const int64_t key = key0 + sub;
    s = key <= lim ? s : -INFINITY;
    float mx = s;
    mx = fmaxf(mx, STRATA_SHFL_XOR(mx, 1, 8));
    mx = fmaxf(mx, STRATA_SHFL_XOR(mx, 2, 8));
    mx = fmaxf(mx, STRATA_SHFL_XOR(mx, 4, 8));
    const float mn = fmaxf(m, mx);
    const float mu = mn == -INFINITY ? 0.f : mn;
    const float corr = exp2f(m - mu);
    const float pr = exp2f(s - mu);
    float ps = pr;
    ps += STRATA_SHFL_XOR(ps, 1, 8);
    ps += STRATA_SHFL_XOR(ps, 2, 8);
    ps += STRATA_SHFL_XOR(ps, 4, 8);
    l = l * corr + ps;
    m = mn;
    Ps[i * SIMT_KEYS + sub] = pr;
    __syncthreads();
#pragma unroll
    for (int u = 0; u < NPT; ++u) {
      const int dd = sub + 8 * u;
      if (dd < d) {
        float acc = o[u] * corr;
#pragma unroll
        for (int kk = 0; kk < SIMT_KEYS; ++kk) acc += Ps[i * SIMT_KEYS + kk] * Vs[kk * d + dd];
        o[u] = acc;
      }
    }
  }
  if (grow >= p.rows) return;
  if (p.nsplit == 1) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t off = q_row_offset(p, n, h, grow);
#pragma unroll
    for (int u = 0; u < NPT; ++u) {
      const int dd = sub + 8 * u;
      if (dd < d) store_from_float(p.out, p.q_dtype, off + dd, o[u] * inv);
    }
  } else {
    const int64_t wr = ws_row(p, n, h, split, grow);
#pragma unroll
    for (int u = 0; u < NPT; ++u) {
      const int dd = sub + 8 * u;
      if (dd < d) p.ws_o[wr * d + dd] = o[u];
    }
    if (sub == 0) {
      p.ws_ml[2 * wr] = m;
      p.ws_ml[2 * wr + 1] = l;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// attention on tensor cores (NVIDIA sm_80+)

#if STRATA_HAVE_MMA

constexpr int MMA_WARPS = 4;
constexpr int MMA_BK = 64;  // keys per pipeline stage

template <int D> struct MmaCfg {
  static constexpr int STAGES = D >= 128 ? 3 : 4;  // D=256: 3 x 64 KB + Q <= 224 KB
  static constexpr int CH = D / 8;  // 16-byte chunks per row
};

template <int D, int MT> constexpr size_t mma_smem_bytes() {
  return (size_t)MT * 16 * D * 2 + (size_t)MmaCfg<D>::STAGES * 2 * MMA_BK * D * 2;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                        uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
#endif
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                          uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
#endif
}

template <typename T>
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<BF16>(float* c, const uint32_t* a, uint32_t b0,
                                               uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
template <>
__device__ __forceinline__ void mma16816<F16>(float* c, const uint32_t* a, uint32_t b0,
                                              uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// pack two floats into one 32-bit register of 2 x 16-bit (lo = first element)
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<BF16>(float lo, float hi) {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
template <> __device__ __forceinline__ uint32_t pack2<F16>(float lo, float hi) {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

// Shared-memory tiles are rows of D 16-bit elements split in 16-byte chunks; chunk c of row r is
// stored at chunk c ^ (r & 7) so that the 8 row addresses of one ldmatrix hit distinct banks.
template <int D> __device__ __forceinline__ int swz(int r, int c) {
  return r * D + ((c ^ (r & 7)) << 3);
}

// MT: 16-row m-tiles per block (1, 2 or 4). The 4 warps split as MT m-tiles x (4/MT) key slices
// of each 64-key stage; warps of one m-tile but different key slices merge at the end.
template <int D, int MT, typename T>
__global__ void __launch_bounds__(128, 1) attn_mma_kernel(AttnParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int STAGES = MmaCfg<D>::STAGES;
  constexpr int CH = MmaCfg<D>::CH;
  constexpr int QROWS = MT * 16;
  constexpr int NKS = MMA_WARPS / MT;  // key slices
  constexpr int KW = MMA_BK / NKS;     // keys of a stage per warp: 16, 32, 64
  constexpr int KSUB = KW < 32 ? KW : 32;  // keys per softmax step (bounds the score registers)
  constexpr int NT = KSUB / 8;             // score n-tiles per step
  constexpr int DT = D / 8;                // output n-tiles
  typedef uint16_t elem;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  elem* Qs = (elem*)smem_raw;     // [QROWS][D]
  elem* KVs = Qs + QROWS * D;     // STAGES x ([BK][D] K, [BK][D] V)

  const int split = blockIdx.x, h = blockIdx.y;
  const int n = blockIdx.z / p.nrg, rg = blockIdx.z % p.nrg;
  const int row0 = rg * QROWS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t slot = clamp_slot(p.group_slot[n], p.nslots);
  const int64_t pos0 = p.group_pos[n];
  const int r_last = min(p.rows, row0 + QROWS) - 1;
  const int64_t kstart = (int64_t)split * p.chunk;
  const int64_t kstop = min64(kstart + p.chunk, key_end(p, pos0, r_last));
  if (kstart >= kstop) {
    attn_write_empty(p, n, h, split, row0, QROWS);
    return;
  }
  const elem* qg = (const elem*)p.q;
  const elem* kg = (const elem*)p.kc;
  const elem* vg = (const elem*)p.vc;
  const uint32_t q_sm = smem_addr(Qs);
  const uint32_t kv_sm = smem_addr(KVs);
  constexpr uint32_t ROWB = D * 2;                       // bytes per smem row
  constexpr uint32_t STAGEB = 2 * MMA_BK * ROWB;         // bytes per stage (K then V)

  // Q tile (rows past p.rows are zero-filled)
  for (int idx = tid; idx < QROWS * CH; idx += 128) {
    const int r = idx / CH, c = idx % CH;
    const int gr = row0 + r;
    const bool ok = gr < p.rows;
    const elem* src = ok ? qg + q_row_offset(p, n, h, gr) + c * 8 : qg;
    cp_async16(q_sm + r * ROWB + ((c ^ (r & 7)) << 4), src, ok ? 16 : 0);
  }

  // K/V tile loader: 128 % CH == 0, so each thread always copies chunk `ld_c` of rows
  // ld_r0, ld_r0 + RSTEP, ...; the global addresses advance by a constant stride.
  constexpr int RSTEP = 128 / CH;
  const int ld_c = tid % CH, ld_r0 = tid / CH;
  const int ntiles = (int)((kstop - kstart + MMA_BK - 1) / MMA_BK);
  const elem* kld = kg + slot * p.ks0 + (int64_t)h * p.ks2 + (kstart + ld_r0) * p.ks1 + ld_c * 8;
  const elem* vld = vg + slot * p.vs0 + (int64_t)h * p.vs2 + (kstart + ld_r0) * p.vs1 + ld_c * 8;
  const int64_t kstep = (int64_t)RSTEP * p.ks1, vstep = (int64_t)RSTEP * p.vs1;
  const int kspan = (int)(kstop - kstart) - ld_r0;  // rows of this thread below kstop: r < kspan
  auto load_tile = [&](int it) {
    const uint32_t ks_sm = kv_sm + (uint32_t)(it % STAGES) * STAGEB;
    const int rbase = it * MMA_BK;
    const elem* kp = kld + (int64_t)rbase * p.ks1;
    const elem* vp = vld + (int64_t)rbase * p.vs1;
#pragma unroll
    for (int u = 0; u < MMA_BK / RSTEP; ++u) {
      const int r = ld_r0 + u * RSTEP;  // row in the stage
      const bool ok = rbase + u * RSTEP < kspan;
      const uint32_t off = r * ROWB + ((ld_c ^ (r & 7)) << 4);
      cp_async16(ks_sm + off, ok ? (const void*)kp : (const void*)kg, ok ? 16 : 0);
      cp_async16(ks_sm + MMA_BK * ROWB + off, ok ? (const void*)vp : (const void*)vg, ok ? 16 : 0);
      kp += kstep;
      vp += vstep;
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ntiles) load_tile(s);
    cp_async_commit();
  }

  const int mt = warp % MT, ksl = warp / MT;
  const int gq = lane >> 2, tq = lane & 3;
  // rows held by this thread: m-tile rows gq and gq + 8; keys are block-relative ints
  const int gr0 = row0 + mt * 16 + gq, gr1 = gr0 + 8;
  const int kspan_all = (int)(kstop - kstart);
  const int lim0 =
      gr0 < p.rows ? (int)max64(min64(pos0 + gr0 / p.rep - kstart, kspan_all - 1), -1)
                   : kspan_all - 1;
  const int lim1 =
      gr1 < p.rows ? (int)max64(min64(pos0 + gr1 / p.rep - kstart, kspan_all - 1), -1)
                   : kspan_all - 1;

  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  float o[DT][4];
#pragma unroll
  for (int t = 0; t < DT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;

  // ldmatrix lane roles. Every row index used below is == lane & 7 (mod 8), so the swizzled
  // chunk of logical chunk 2*i + bit is (2*(i&3) + bit) ^ (lane&7) + 8*(i>>2): 4 offsets each.
  const int x7 = lane & 7;
  const int a_bit = lane >> 4;         // Q (A operand) and V (transposed B): chunk bit
  const int b_bit = (lane >> 3) & 1;   // K (B operand): chunk bit
  uint32_t offA[4], offB[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    offA[i] = (uint32_t)(((2 * i + a_bit) ^ x7) << 4);
    offB[i] = (uint32_t)(((2 * i + b_bit) ^ x7) << 4);
  }
  const uint32_t a_base = q_sm + (uint32_t)(mt * 16 + x7 + b_bit * 8) * ROWB;  // Q rows
  const int b_key = x7 + a_bit * 8;   // K rows (non-transposed B): matrices 2,3 = keys 8-15
  const int v_key = x7 + b_bit * 8;   // V rows (transposed B): matrices 1,3 = keys 8-15

  for (int it = 0; it < ntiles; ++it) {
    {
      const int nx = it + STAGES - 1;
      if (nx < ntiles) load_tile(nx);
      cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const uint32_t ks_sm = kv_sm + (uint32_t)(it % STAGES) * STAGEB;
    const uint32_t vs_sm = ks_sm + MMA_BK * ROWB;

#pragma unroll
    for (int sub = 0; sub < KW / KSUB; ++sub) {
      const int krow0 = ksl * KW + sub * KSUB;  // first key row (in the stage) of this step
      const uint32_t k_base = ks_sm + (uint32_t)(krow0 + b_key) * ROWB;
      const uint32_t v_base = vs_sm + (uint32_t)(krow0 + v_key) * ROWB;
      float s[NT][4];
#pragma unroll
      for (int t = 0; t < NT; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t a[4];
        ldsm_x4(a[0], a[1], a[2], a[3], a_base + offA[kc & 3] + (kc >> 2) * 128);
#pragma unroll
        for (int jj = 0; jj < NT / 2; ++jj) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(b0, b1, b2, b3, k_base + jj * 16 * ROWB + offB[kc & 3] + (kc >> 2) * 128);
          mma16816<T>(s[2 * jj], a, b0, b1);
          mma16816<T>(s[2 * jj + 1], a, b2, b3);
        }
      }
      // mask, online softmax (log2 units)
      const int key_base = it * MMA_BK + krow0 + 2 * tq;  // block-relative key of s[0][0]
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key_base + t * 8 + e;
          s[t][e] = key <= lim0 ? s[t][e] * p.scale_log2 : -INFINITY;
          s[t][2 + e] = key <= lim1 ? s[t][2 + e] * p.scale_log2 : -INFINITY;
          mx0 = fmaxf(mx0, s[t][e]);
          mx1 = fmaxf(mx1, s[t][2 + e]);
        }
      }
      mx0 = fmaxf(mx0, STRATA_SHFL_XOR(mx0, 1, 32));
      mx0 = fmaxf(mx0, STRATA_SHFL_XOR(mx0, 2, 32));
      mx1 = fmaxf(mx1, STRATA_SHFL_XOR(mx1, 1, 32));
      mx1 = fmaxf(mx1, STRATA_SHFL_XOR(mx1, 2, 32));
      const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
      const float mu0 = mn0 == -INFINITY ? 0.f : mn0;
      const float mu1 = mn1 == -INFINITY ? 0.f : mn1;
      const float c0 = exp2f(m0 - mu0), c1 = exp2f(m1 - mu1);
      m0 = mn0;
      m1 = mn1;
      float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[t][e] = exp2f(s[t][e] - mu0);
          s[t][2 + e] = exp2f(s[t][2 + e] - mu1);
          rs0 += s[t][e];
          rs1 += s[t][2 + e];
        }
      }
      l0 = l0 * c0 + rs0;
      l1 = l1 * c1 + rs1;
      if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
        for (int t = 0; t < DT; ++t) {
          o[t][0] *= c0;
          o[t][1] *= c0;
          o[t][2] *= c1;
          o[t][3] *= c1;
        }
      }
      // O += P V
#pragma unroll
      for (int jj = 0; jj < NT / 2; ++jj) {
        uint32_t a[4];
        a[0] = pack2<T>(s[2 * jj][0], s[2 * jj][1]);
        a[1] = pack2<T>(s[2 * jj][2], s[2 * jj][3]);
        a[2] = pack2<T>(s[2 * jj + 1][0], s[2 * jj + 1][1]);
        a[3] = pack2<T>(s[2 * jj + 1][2], s[2 * jj + 1][3]);
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(b0, b1, b2, b3, v_base + jj * 16 * ROWB + offA[dn & 3] + (dn >> 2) * 128);
          mma16816<T>(o[2 * dn], a, b0, b1);
          mma16816<T>(o[2 * dn + 1], a, b2, b3);
        }
      }
    }
    __syncthreads();  // this stage may be refilled next iteration
  }
  cp_async_wait<0>();
  __syncthreads();

  // per-thread row sums -> full row sums (the 4 lanes of a quad hold one row)
  l0 += STRATA_SHFL_XOR(l0, 1, 32);
  l0 += STRATA_SHFL_XOR(l0, 2, 32);
  l1 += STRATA_SHFL_XOR(l1, 1, 32);
  l1 += STRATA_SHFL_XOR(l1, 2, 32);

  // merge the key slices through shared memory (reusing the K/V stages); rows padded by 8
  // floats so the fragment stores of the 8 row-groups of a warp spread over the banks
  constexpr int OSTR = D + 8;
  static_assert(sizeof(float) * (MMA_WARPS * 16 * OSTR + MMA_WARPS * 32) <=
                    (size_t)STAGES * 2 * MMA_BK * D * 2,
                "merge buffer must fit in the K/V stages");
  float* Ob = (float*)KVs;                    // [4 warps][16][OSTR]
  float* MLb = Ob + MMA_WARPS * 16 * OSTR;    // [4 warps][16][2]
  {
    float* ow = Ob + warp * 16 * OSTR;
#pragma unroll
    for (int t = 0; t < DT; ++t) {
      const int dd = t * 8 + 2 * tq;
      *(float2*)(ow + gq * OSTR + dd) = make_float2(o[t][0], o[t][1]);
      *(float2*)(ow + (gq + 8) * OSTR + dd) = make_float2(o[t][2], o[t][3]);
    }
    if (tq == 0) {
      float* mlw = MLb + warp * 32;
      mlw[2 * gq] = m0;
      mlw[2 * gq + 1] = l0;
      mlw[2 * (gq + 8)] = m1;
      mlw[2 * (gq + 8) + 1] = l1;
    }
  }
  __syncthreads();
  // each thread: 4 consecutive outputs of rows rsub, rsub + RPP, ...
  constexpr int UPR = D / 4;     // 4-element units per row
  constexpr int RPP = 128 / UPR; // rows per pass
  const int u = tid % UPR;
  for (int r = tid / UPR; r < QROWS; r += RPP) {
    const int gr = row0 + r;
    if (gr >= p.rows) break;  // later rows are past p.rows too
    const int tmt = r >> 4, rr = r & 15;
    float M = -INFINITY;
#pragma unroll
    for (int k = 0; k < NKS; ++k) M = fmaxf(M, MLb[(k * MT + tmt) * 32 + 2 * rr]);
    const float Mu = M == -INFINITY ? 0.f : M;
    float L = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < NKS; ++k) {
      const int w = k * MT + tmt;
      const float e = exp2f(MLb[w * 32 + 2 * rr] - Mu);
      L += e * MLb[w * 32 + 2 * rr + 1];
      const float4 v = *(const float4*)(Ob + (w * 16 + rr) * OSTR + 4 * u);
      acc.x += e * v.x;
      acc.y += e * v.y;
      acc.z += e * v.z;
      acc.w += e * v.w;
    }
    if (p.nsplit == 1) {
      const float inv = L > 0.f ? 1.f / L : 0.f;
      uint2 packed;
      packed.x = (uint32_t)from_f<T>(acc.x * inv) | ((uint32_t)from_f<T>(acc.y * inv) << 16);
      packed.y = (uint32_t)from_f<T>(acc.z * inv) | ((uint32_t)from_f<T>(acc.w * inv) << 16);
      *(uint2*)((elem*)p.out + q_row_offset(p, n, h, gr) + 4 * u) = packed;  // 8-byte aligned
    } else {
      const int64_t wr = ws_row(p, n, h, split, gr);
      *(float4*)(p.ws_o + wr * D + 4 * u) = acc;
      if (u == 0) {
        p.ws_ml[2 * wr] = M;
        p.ws_ml[2 * wr + 1] = L;
      }
    }
  }
#else
  // built for an architecture without mma.sync: the host never selects this path there
  __trap();
#endif
}

#endif  // STRATA_HAVE_MMA

// ------------------------------------------------------------------------------------------------
// attention: merge of the split-K partials

// Block-wide max or sum; `red` holds one float per 32 threads. Shuffles of width 32 split a
// 64-lane HIP wavefront the same way, so this is portable.
__device__ float block_reduce(float v, float* red, bool is_max) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float t = STRATA_SHFL_XOR(v, o, 32);
    v = is_max ? fmaxf(v, t) : v + t;
  }
  const int nw = (blockDim.x + 31) >> 5;
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = red[0];
  for (int i = 1; i < nw; ++i) r = is_max ? fmaxf(r, red[i]) : r + red[i];
  __syncthreads();
  return r;
}

constexpr int COMBINE_THREADS = 256;
constexpr int MAX_SPLITS = 4096;

// One block per output row. Thread t accumulates output elements [4u, 4u+4) (u = t % units) over
// the splits s = lane, lane + lanes, ... (lane = t / units); the lanes are summed in shared memory.
// Splits that saw no key have weight 0 and their (never written) partials are not used.
__global__ void __launch_bounds__(COMBINE_THREADS) attn_combine_kernel(AttnParams p) {
  extern __shared__ float csm[];  // [nsplit] weights, then [lanes][d] lane sums
  __shared__ float red[COMBINE_THREADS / 32];
  const int r = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int tid = threadIdx.x;
  float* wsm = csm;
  float* part = csm + p.nsplit;
  float M = -INFINITY;
  for (int s = tid; s < p.nsplit; s += COMBINE_THREADS) {
    const int64_t wr = ws_row(p, n, h, s, r);
    if (p.ws_ml[2 * wr + 1] > 0.f) M = fmaxf(M, p.ws_ml[2 * wr]);
  }
  M = block_reduce(M, red, true);
  float L = 0.f;
  for (int s = tid; s < p.nsplit; s += COMBINE_THREADS) {
    const int64_t wr = ws_row(p, n, h, s, r);
    const float lw = p.ws_ml[2 * wr + 1];
    const float w = (lw > 0.f && M != -INFINITY) ? exp2f(p.ws_ml[2 * wr] - M) : 0.f;
    wsm[s] = w;
    L += w * lw;
  }
  L = block_reduce(L, red, false);  // also orders the wsm writes before the reads below
  const float inv = L > 0.f ? 1.f / L : 0.f;
  const int64_t off = q_row_offset(p, n, h, r);
  const int64_t row_stride = (int64_t)p.rows * p.d;  // between consecutive splits
  const float* base = p.ws_o + ws_row(p, n, h, 0, r) * p.d;
  if ((p.d & 3) == 0) {
    const int units = p.d >> 2;
    const int lanes = COMBINE_THREADS / units > 0 ? COMBINE_THREADS / units : 1;
    const int u = tid % units, lane = tid / units;
    if (lane < lanes && u < units) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
      for (int s = lane; s < p.nsplit; s += lanes) {
        const float w = wsm[s];
        const float4 v = *(const float4*)(base + s * row_stride + 4 * u);
        const bool use = w != 0.f;  // select, not multiply: unwritten partials may hold NaN
        acc.x += use ? w * v.x : 0.f;
        acc.y += use ? w * v.y : 0.f;
        acc.z += use ? w * v.z : 0.f;
        acc.w += use ? w * v.w : 0.f;
      }
      *(float4*)(part + lane * p.d + 4 * u) = acc;
    }
    __syncthreads();
    for (int dd = tid; dd < p.d; dd += COMBINE_THREADS) {
      float acc = 0.f;
      for (int l = 0; l < lanes; ++l) acc += part[l * p.d + dd];
      store_from_float(p.out, p.q_dtype, off + dd, acc * inv);
    }
  } else {
    for (int dd = tid; dd < p.d; dd += COMBINE_THREADS) {
      float acc = 0.f;
      for (int s = 0; s < p.nsplit; ++s) {
        const float w = wsm[s];
        const float v = base[s * row_stride + dd];
        acc += w != 0.f ? w * v : 0.f;
      }
      store_from_float(p.out, p.q_dtype, off + dd, acc * inv);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// gated delta rule over a group's rows

struct GdnParams {
  const void* q;
  const void* k;
  const void* v;
  const void* gate;
  const void* beta;
  const float* state;
  float* out;
  float* snaps;  // by mode (STRATA_GDN_*): snapshots, the final state, or the rows' factors
  const int64_t* group_slot;
  int64_t state_slot_stride, nslots;
  int g, h, dk, dv, q_dtype, k_dtype, v_dtype, g_dtype, b_dtype;
  int mode;
  // The prepared form (gdn_kernel<KPT, true>, gated_delta_window_prep): q points at the conv
  // output, rows of x_row elements [q (H / rep key heads x Dk) | k (the same) | v (H x Dv) ...];
  // beta and gate at the raw in_proj rows of ba_row elements, per key head [b (rep) | a (rep)];
  // the kernel L2-normalises q and k (q also times q_scale), and takes beta = sigmoid(b) (in
  // b's dtype) and g = neg_a[h] * softplus(a + dt_bias[h]), which the model's own ops did in
  // five kernels.
  int rep;
  int64_t x_row, ba_row;
  const float* neg_a;    // (H,) -exp(A_log)
  const float* dt_bias;  // (H,)
  float q_scale, eps;
};

constexpr int GDN_GROUPS = 8;  // 8 groups of 32 threads split Dk; 32 lanes = 32 Dv columns
// Rows staged in shared memory at a time: = GDN_GROUPS, so warp w loads chunk row w's v and
// reduces its output.
constexpr int GDN_CHUNK = GDN_GROUPS;

// The prepared form is launched as a programmatic dependent of the kernel before it (the conv,
// in a window) and waits (pdl_wait_primary) before its first read: its blocks are resident and
// started while the conv ends, and nothing is read early (a caller's conversion of group_slot,
// or a copy of the state, may be the kernel just before).

// A row's inputs come from shared memory, staged GDN_CHUNK rows at a time: each chunk's global
// loads are issued before the chunk before it runs its rows and land in shared memory after
// them, so their latency is paid once per chunk and mostly hidden (a row waited on its loads,
// two barriers and its gates' math). Per row one barrier remains (the Dk reduction, red double
// buffered); each row's output is reduced once per chunk. Every element's arithmetic and its
// order are those of the row-by-row kernel (same expressions, same threads' shares of Dk).
// Three blocks an SM up to Dk 128 (80 registers, no spills; without the bound ptxas took up
// to 127, two blocks).
template <int KPT, bool PREP>
__global__ void __launch_bounds__(256, (KPT <= 16 && !STRATA_PLATFORM_HIP) ? 3 : 1)
    gdn_kernel(GdnParams p) {
  constexpr int KT = GDN_GROUPS * KPT;
  constexpr int CH = GDN_CHUNK;
  __shared__ __align__(16) float qs[2][CH][KT];
  __shared__ __align__(16) float ks[2][CH][KT];
  __shared__ float vs[2][CH][32];
  __shared__ float decs[2][CH];  // expf(g)
  __shared__ float bs[2][CH];    // beta
  __shared__ float iqs[2][CH];   // PREP: the rows' norms (q's times q_scale)
  __shared__ float iks[2][CH];
  __shared__ float sumsq[CH][2][GDN_GROUPS];  // PREP: each warp's sums of q^2 and k^2
  __shared__ float red[2][GDN_GROUPS][32];
  __shared__ float outs[CH][GDN_GROUPS][32];
  const int vt = blockIdx.x, hh = blockIdx.y, n = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int v = vt * 32 + lane;
  const bool vok = v < p.dv;
  pdl_wait_primary();
  const int64_t slot = clamp_slot(p.group_slot[n], p.nslots);
  const float* st = p.state + slot * p.state_slot_stride + (int64_t)hh * p.dk * p.dv;
  // STRATA_GDN_FACTORS: row r's [k | delta | decay] at snaps + r * fw, each written once:
  // k by the first Dv tile's threads tid < Dk, delta by warp 0 (lane = column v), decay by
  // one thread. A few hundred bytes a row and head where a snapshot is Dk x Dv floats.
  const bool factors = p.mode == STRATA_GDN_FACTORS;
  const int64_t fw = (int64_t)p.dk + p.dv + 1;
  float s[KPT];
#pragma unroll
  for (int i = 0; i < KPT; ++i) {
    const int kk = w * KPT + i;
    s[i] = (vok && kk < p.dk) ? st[(int64_t)kk * p.dv + v] : 0.f;
  }
  // Staging registers: thread tid's q and k element of each chunk row (zero at and past Dk),
  // warp w's v of chunk row w, and thread tid < CH's raw beta and gate of chunk row tid.
  float qn[CH], kn[CH], vn = 0.f, bn = 0.f, gn = 0.f;
  const int kh = PREP ? hh / p.rep : 0, nk = PREP ? p.h / p.rep : 0;
  auto load = [&](int j0) {
    const bool ok = tid < p.dk;
#pragma unroll
    for (int r = 0; r < CH; ++r) {
      const int j = j0 + r;
      const bool rok = ok && j < p.g;
      if (PREP) {
        const int64_t x0 = ((int64_t)n * p.g + j) * p.x_row;
        qn[r] = rok ? load_as_float(p.q, p.q_dtype, x0 + (int64_t)kh * p.dk + tid) : 0.f;
        kn[r] = rok ? load_as_float(p.q, p.q_dtype, x0 + (int64_t)(nk + kh) * p.dk + tid) : 0.f;
      } else {
        const int64_t r0 = (((int64_t)n * p.g + j) * p.h + hh) * p.dk;
        qn[r] = rok ? load_as_float(p.q, p.q_dtype, r0 + tid) : 0.f;
        kn[r] = rok ? load_as_float(p.k, p.k_dtype, r0 + tid) : 0.f;
      }
    }
    const int jv = j0 + w;
    if (PREP) {
      const int64_t x0 = ((int64_t)n * p.g + jv) * p.x_row;
      vn = (vok && jv < p.g) ? load_as_float(p.q, p.q_dtype, x0 + 2ll * nk * p.dk +
                                             (int64_t)hh * p.dv + v) : 0.f;
    } else {
      vn = (vok && jv < p.g)
               ? load_as_float(p.v, p.v_dtype, (((int64_t)n * p.g + jv) * p.h + hh) * p.dv + v)
               : 0.f;
    }
    const int jb = j0 + tid;
    if (tid < CH && jb < p.g) {
      if (PREP) {
        const int64_t b0 = ((int64_t)n * p.g + jb) * p.ba_row + (int64_t)kh * 2 * p.rep +
                           (hh - kh * p.rep);
        bn = load_as_float(p.beta, p.b_dtype, b0);
        gn = load_as_float(p.gate, p.g_dtype, b0 + p.rep);
      } else {
        const int64_t r = ((int64_t)n * p.g + jb) * p.h + hh;
        gn = load_as_float(p.gate, p.g_dtype, r);
        bn = load_as_float(p.beta, p.b_dtype, r);
      }
    }
  };
  // The staged rows into buffer b (their k factors and decays too); PREP: each warp's sums of
  // squares for norms(), after a barrier.
  auto store = [&](int b, int j0) {
#pragma unroll
    for (int r = 0; r < CH; ++r) {
      if (tid < KT) {
        qs[b][r][tid] = qn[r];
        ks[b][r][tid] = kn[r];
      }
      const int64_t row = ((int64_t)n * p.g + j0 + r) * p.h + hh;
      if (factors && vt == 0 && tid < p.dk && j0 + r < p.g)
        p.snaps[row * fw + tid] = kn[r];  // (PREP: raw, as ks)
      if (PREP) {  // (threads at and past Dk hold zeros)
        float sq = qn[r] * qn[r], sk = kn[r] * kn[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          sq += STRATA_SHFL_XOR(sq, o, 32);
          sk += STRATA_SHFL_XOR(sk, o, 32);
        }
        if (lane == 0) {
          sumsq[r][0][w] = sq;
          sumsq[r][1][w] = sk;
        }
      }
    }
    vs[b][w][lane] = vn;
    const int jb = j0 + tid;
    if (tid < CH && jb < p.g) {
      float beta = bn, g = gn;
      if (PREP) {
        // beta in b's dtype, as the model's sigmoid(b) (and transformers') rounds it
        beta = round_through(1.f / (1.f + expf(-bn)), p.b_dtype);
        const float a = gn + p.dt_bias[hh];
        g = p.neg_a[hh] * (a > 20.f ? a : log1pf(expf(a)));  // softplus, torch's threshold
      }
      const float decay = expf(g);
      bs[b][tid] = beta;
      decs[b][tid] = decay;
      if (factors && vt == 0)
        p.snaps[(((int64_t)n * p.g + jb) * p.h + hh) * fw + p.dk + p.dv] = decay;
    }
  };
  // PREP: row tid's norms from sumsq (after the barrier past store; read after the next one)
  auto norms = [&](int b) {
    if (PREP && tid < CH) {
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int ww = 0; ww < GDN_GROUPS; ++ww) {
        sq += sumsq[tid][0][ww];
        sk += sumsq[tid][1][ww];
      }
      iqs[b][tid] = rsqrtf(sq + p.eps) * p.q_scale;
      iks[b][tid] = rsqrtf(sk + p.eps);
    }
  };
  load(0);
  store(0, 0);
  __syncthreads();
  norms(0);
  for (int j0 = 0; j0 < p.g; j0 += CH) {
    const int b = (j0 / CH) & 1;
    const int rows = p.g - j0 < CH ? p.g - j0 : CH;
    const bool more = j0 + CH < p.g;
    // in flight while this chunk's rows run (PREP, whose windows are rarely past one chunk:
    // loaded after them, which kept its registers at the plain form's)
    if (more && !PREP) load(j0 + CH);
    for (int r = 0; r < rows; ++r) {
      const int j = j0 + r;
      const int64_t row = ((int64_t)n * p.g + j) * p.h + hh;
      const float decay = decs[b][r];
      // The state update's two roundings are spelled out (s * decay rounded, then one FMA of
      // k delta onto it): commit_kernel replays it from the factors with the same two calls.
      // As plain `s *= decay; s += k * delta` nvcc contracted it here to fma(k, delta,
      // s * decay) (s * decay also feeds kvp) but in the replay, where s * decay has no other
      // use, to fma(s, decay, k * delta): other bits (PTX of both, CUDA 13.0).
      float kvp = 0.f;
#pragma unroll
      for (int i = 0; i < KPT; ++i) {
        s[i] = __fmul_rn(s[i], decay);
        kvp += ks[b][r][w * KPT + i] * s[i];
      }
      red[j & 1][w][lane] = kvp;
      __syncthreads();  // red complete (and the chunk's norms visible)
      float kvm = 0.f;
#pragma unroll
      for (int ww = 0; ww < GDN_GROUPS; ++ww) kvm += red[j & 1][ww][lane];
      // PREP: q and k are used raw and the row's norms applied to the sums they enter
      if (PREP) kvm *= iks[b][r];
      float delta = (vs[b][r][lane] - kvm) * bs[b][r];
      if (PREP) delta *= iks[b][r];  // s += (k ik) delta
      if (factors && w == 0 && vok) p.snaps[row * fw + p.dk + v] = delta;
      float op = 0.f;
      float* snap = p.snaps + row * (int64_t)p.dk * p.dv;
      const bool write_snap = vok && p.mode == STRATA_GDN_SNAPS;
#pragma unroll
      for (int i = 0; i < KPT; ++i) {
        const int kk = w * KPT + i;
        s[i] = __fmaf_rn(ks[b][r][kk], delta, s[i]);
        op += qs[b][r][kk] * s[i];
        if (write_snap && kk < p.dk) snap[(int64_t)kk * p.dv + v] = s[i];
      }
      outs[r][w][lane] = PREP ? op * iqs[b][r] : op;
    }
    if (more) {
      if (PREP) load(j0 + CH);
      store(b ^ 1, j0 + CH);
    }
    __syncthreads();  // outs complete; the next chunk staged
    if (w < rows && vok) {
      float acc = 0.f;
#pragma unroll
      for (int ww = 0; ww < GDN_GROUPS; ++ww) acc += outs[w][ww][lane];
      p.out[(((int64_t)n * p.g + j0 + w) * p.h + hh) * p.dv + v] = acc;
    }
    if (more) norms(b ^ 1);
  }
  if (p.mode == STRATA_GDN_FINAL && vok) {
    float* fin = p.snaps + ((int64_t)n * p.h + hh) * p.dk * p.dv;
#pragma unroll
    for (int i = 0; i < KPT; ++i) {
      const int kk = w * KPT + i;
      if (kk < p.dk) fin[(int64_t)kk * p.dv + v] = s[i];
    }
  }
}

// ------------------------------------------------------------------------------------------------
// causal depthwise conv + SiLU over a group's rows

constexpr int CONV_MAX_K = 16;
int g_conv_options = STRATA_CONV_GDN_PDL;  // STRATA_CONV_* (strata_kernels.h)

struct ConvParams {
  const void* x;
  const void* state;
  const void* weight;
  void* out;
  void* snaps;
  const int64_t* group_slot;
  int64_t state_slot_stride, nslots;
  int g, c, kw, x_dtype, s_dtype, w_dtype;
  // x's rows: x_row elements apart (c when x is the contiguous (NG, G, C) input). With gdk > 0
  // (causal_conv_window_qkvz) x is the in_proj's qkvz columns, per key head [q (gdk) | k (gdk)
  // | v (gvpk) | z (gvpk)], and channel ch reads its column there: the conv's q, k, v channels
  // gathered in the kernel rather than concatenated by a kernel of their own.
  int64_t x_row;
  int gnk, gdk, gvpk;
  // causal_conv_window_qkvz_ba: blocks conv_bx.. of grid x compute ba = xn . w_ba^T for their
  // row (blockIdx.y) instead of conv channels (ConvBa); xn rows xn_row elements apart, w_ba
  // (ba_n, ba_h) contiguous, ba (NG, G, ba_n) contiguous, all three in x's dtype.
  const void* xn;
  const void* w_ba;
  void* ba;
  int64_t xn_row;
  int conv_bx, ba_h, ba_n, ba_vec;
};

// The column of x that conv channel ch reads (see ConvParams).
__device__ __forceinline__ int64_t conv_column(const ConvParams& p, int ch) {
  if (p.gdk == 0) return ch;
  const int qk = p.gnk * p.gdk, wh = 2 * p.gdk + 2 * p.gvpk;
  if (ch < qk) return (int64_t)(ch / p.gdk) * wh + ch % p.gdk;
  if (ch < 2 * qk) return (int64_t)((ch - qk) / p.gdk) * wh + p.gdk + (ch - qk) % p.gdk;
  const int cv = ch - 2 * qk;
  return (int64_t)(cv / p.gvpk) * wh + 2 * p.gdk + cv % p.gvpk;
}

// One thread per (channel, window row): nothing is serial across rows. Row j of group n reads
// its window ext[j .. j+kw-1] of ext = [the slot's state (km1 values, rounded through x's dtype),
// x rows 0 .. g-1 of the group] and sums w[i] * ext[j+i] in i order, term for term the sum of
// conv_serial_kernel (bit-identical results); snaps[n, j, ch, i] = ext[j+1+i]. Only the first
// km1 rows read the state, whose slot is the one dependent load. KW: the kernel width when it is
// known at compile time (4, Qwen3-Next's), else 0 (read from p.kw).
constexpr int CONV_THREADS = 128;

// ba in the conv's launch (causal_conv_window_qkvz_ba): each warp of a ba block computes one
// output o of its row, a dot of length ba_h in float32. Lane l takes the 8-element chunks
// l, l + 32, ... of the row in order, one fma per element, and the lanes' sums meet in a fixed
// xor butterfly, so a row's ba is the same bits in every window shape (no split depends on the
// rows). ba_vec: 16-byte loads (aligned rows, ba_h % 8 == 0), the same arithmetic as scalar ones.
constexpr int BA_WARPS = CONV_THREADS / 32;
constexpr int BA_CHUNK = 8;

// The 8 elements of a chunk as floats: one 16-byte load (two for float32), or n <= 8 scalar ones.
template <typename T>
__device__ __forceinline__ void load_chunk_vec(const typename T::storage* src, float* v) {
  if constexpr (sizeof(typename T::storage) == 2) {
    const uint4 u = *(const uint4*)src;
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[2 * e] = to_f<T>((typename T::storage)(w[e] & 0xffffu));
      v[2 * e + 1] = to_f<T>((typename T::storage)(w[e] >> 16));
    }
  } else {
    const float4 a = *(const float4*)src, b = *(const float4*)(src + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
}

template <typename T>
__device__ __forceinline__ void load_chunk_scalar(const typename T::storage* src, int n,
                                                  float* v) {
#pragma unroll
  for (int e = 0; e < BA_CHUNK; ++e) v[e] = e < n ? to_f<T>(src[e]) : 0.f;
}

template <typename T>
__device__ __forceinline__ void conv_ba_block(const ConvParams& p) {
  typedef typename T::storage S;
  const int lane = threadIdx.x % 32;
  const int o = (blockIdx.x - p.conv_bx) * BA_WARPS + threadIdx.x / 32;
  if (o >= p.ba_n) return;  // the whole warp
  const int64_t row = blockIdx.y;
  const S* xr = (const S*)p.xn + row * p.xn_row;
  const S* wr = (const S*)p.w_ba + (int64_t)o * p.ba_h;
  float acc = 0.f;
  float xv[BA_CHUNK], wv[BA_CHUNK];
  if (p.ba_vec) {
    // unrolled so that a lane's loads (8 chunks at H = 2048) are in flight together: the weight
    // comes from DRAM once a window, and one latency rather than eight bounds the block
#pragma unroll 8
    for (int i = lane * BA_CHUNK; i < p.ba_h; i += 32 * BA_CHUNK) {
      load_chunk_vec<T>(xr + i, xv);
      load_chunk_vec<T>(wr + i, wv);
#pragma unroll
      for (int e = 0; e < BA_CHUNK; ++e) acc = fmaf(xv[e], wv[e], acc);
    }
  } else {
    for (int i = lane * BA_CHUNK; i < p.ba_h; i += 32 * BA_CHUNK) {
      const int n = p.ba_h - i < BA_CHUNK ? p.ba_h - i : BA_CHUNK;
      load_chunk_scalar<T>(xr + i, n, xv);
      load_chunk_scalar<T>(wr + i, n, wv);
#pragma unroll
      for (int e = 0; e < BA_CHUNK; ++e)
        if (e < n) acc = fmaf(xv[e], wv[e], acc);
    }
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) acc += STRATA_SHFL_XOR(acc, m, 32);
  if (lane == 0) ((S*)p.ba)[row * p.ba_n + o] = from_f<T>(acc);
}

// BT: void (the conv alone), or F32 / BF16 / F16, x's type, for the ba blocks past conv_bx;
// the conv blocks run the same code either way (the same bits).
template <int KW, typename BT = void>
__global__ void __launch_bounds__(CONV_THREADS) conv_kernel(ConvParams p) {
  if constexpr (!std::is_void<BT>::value) {
    if ((int)blockIdx.x >= p.conv_bx) {
      conv_ba_block<BT>(p);
      return;
    }
  }
  const int ch = blockIdx.x * CONV_THREADS + threadIdx.x;
  const int n = blockIdx.y / p.g, j = blockIdx.y % p.g;
  if (ch >= p.c) return;
  const int kw = KW ? KW : p.kw, km1 = kw - 1;
  const int64_t x0 = (int64_t)n * p.g * p.c + ch;  // out[n, 0, ch]
  const int64_t xin0 = (int64_t)n * p.g * p.x_row + conv_column(p, ch);  // x[n, 0, ch]
  int64_t sbase = 0;
  if (j < km1)
    sbase = clamp_slot(p.group_slot[n], p.nslots) * p.state_slot_stride + (int64_t)ch * km1;
  float win[CONV_MAX_K];
  float w[CONV_MAX_K];
#pragma unroll
  for (int i = 0; i < CONV_MAX_K; ++i) {
    w[i] = 0.f;
    win[i] = 0.f;
    if (i < kw) {
      w[i] = load_as_float(p.weight, p.w_dtype, (int64_t)ch * kw + i);
      const int t = j + i;  // position in ext
      win[i] = t < km1 ? round_through(load_as_float(p.state, p.s_dtype, sbase + t), p.x_dtype)
                       : load_as_float(p.x, p.x_dtype, xin0 + (int64_t)(t - km1) * p.x_row);
    }
  }
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < CONV_MAX_K; ++i)
    if (i < kw) acc += win[i] * w[i];
  const int64_t xi = x0 + (int64_t)j * p.c;
  store_from_float(p.out, p.x_dtype, xi, acc / (1.f + expf(-acc)));
#pragma unroll
  for (int i = 0; i < CONV_MAX_K - 1; ++i)
    if (i < km1) store_from_float(p.snaps, p.x_dtype, xi * km1 + i, win[i + 1]);
}

// The earlier kernel, kept behind STRATA_CONV_SERIAL to measure against: one thread per channel
// walks the group's rows in order, shifting its window.
__global__ void conv_serial_kernel(ConvParams p) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  const int n = blockIdx.y;
  if (ch >= p.c) return;
  const int km1 = p.kw - 1;
  const int64_t slot = clamp_slot(p.group_slot[n], p.nslots);
  float win[CONV_MAX_K];
  float w[CONV_MAX_K];
#pragma unroll
  for (int i = 0; i < CONV_MAX_K; ++i) {
    w[i] = i < p.kw ? load_as_float(p.weight, p.w_dtype, (int64_t)ch * p.kw + i) : 0.f;
    win[i] = i < km1 ? round_through(load_as_float(p.state, p.s_dtype,
                                                   slot * p.state_slot_stride +
                                                       (int64_t)ch * km1 + i),
                                     p.x_dtype)
                     : 0.f;
  }
  for (int j = 0; j < p.g; ++j) {
    const int64_t xi = ((int64_t)n * p.g + j) * p.c + ch;
    const float xv = load_as_float(p.x, p.x_dtype, xi);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < CONV_MAX_K; ++i) {
      if (i < km1) acc += win[i] * w[i];
      else if (i == km1) acc += xv * w[i];
    }
    store_from_float(p.out, p.x_dtype, xi, acc / (1.f + expf(-acc)));
    // shift the window: the state after this row is the last km1 inputs
#pragma unroll
    for (int i = 0; i < CONV_MAX_K - 1; ++i) {
      if (i < km1) {
        const float nv = (i + 1 < km1) ? win[i + 1] : xv;
        win[i] = nv;
        store_from_float(p.snaps, p.x_dtype, xi * km1 + i, nv);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// accepted-prefix commit

struct CommitParams {
  const int64_t* accept;
  const int64_t* group_slot;
  const int64_t* group_pos;
  const float* factors;  // (L, NG, G, H, Dk + Dv + 1): each row's [k | delta | decay]
  const void* conv_snaps;
  float* rec_state;
  void* conv_state;
  int64_t* slot_pos;
  int64_t conv_inner, rs0, rs1, cs0, cs1, nslots;
  int ng, g, h, dk, dv, nvt, snap_dtype, state_dtype;
};

// Block = (Dv tile of 32 x head, group, layer), gdn_kernel's tiling of a head's state: lane =
// column v, warp w = state rows w * KPT + i. The slot's state is read once, rows 0..a of the
// window replayed onto it in registers and written once: gdn_kernel's update call for call
// (s = __fmul_rn(s, decay); s = __fmaf_rn(k, delta, s)) on the values it used, so the slot
// takes the bits the window's state had after row a. The factors (about 1 KB a row
// and head) are read from global, where the window wrote them a moment ago (L2).
// A group whose slot a later group of the window also names commits nothing: only padding
// groups share a slot (the scratch one), and replaying one's rows onto another's result would
// compound them; the last one commits, as a copy of its state would have left the slot.
template <int KPT>
__global__ void __launch_bounds__(256) commit_kernel(CommitParams p) {
  const int n = blockIdx.y, l = blockIdx.z;
  const int64_t slot = clamp_slot(p.group_slot[n], p.nslots);
  for (int m = n + 1; m < p.ng; ++m)
    if (clamp_slot(p.group_slot[m], p.nslots) == slot) return;
  int64_t a = p.accept[n];
  a = a < 0 ? 0 : (a >= p.g ? p.g - 1 : a);
  const int vt = blockIdx.x % p.nvt, hh = blockIdx.x / p.nvt;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int v = vt * 32 + lane;
  const bool vok = v < p.dv;
  if (p.dk > 0 && hh < p.h) {
    float* st = p.rec_state + l * p.rs0 + slot * p.rs1 + (int64_t)hh * p.dk * p.dv;
    float s[KPT];
#pragma unroll
    for (int i = 0; i < KPT; ++i) {
      const int kk = w * KPT + i;
      s[i] = (vok && kk < p.dk) ? st[(int64_t)kk * p.dv + v] : 0.f;
    }
    const int64_t fw = (int64_t)p.dk + p.dv + 1;
    const float* f = p.factors + ((((int64_t)l * p.ng + n) * p.g) * p.h + hh) * fw;
    for (int64_t j = 0; j <= a; ++j, f += (int64_t)p.h * fw) {
      const float decay = f[p.dk + p.dv];
      const float delta = vok ? f[p.dk + v] : 0.f;
#pragma unroll
      for (int i = 0; i < KPT; ++i) {
        const int kk = w * KPT + i;
        const float k = kk < p.dk ? f[kk] : 0.f;
        s[i] = __fmul_rn(s[i], decay);  // gdn_kernel's update, call for call
        s[i] = __fmaf_rn(k, delta, s[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < KPT; ++i) {
      const int kk = w * KPT + i;
      if (vok && kk < p.dk) st[(int64_t)kk * p.dv + v] = s[i];
    }
  }
  const int64_t gtid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t nthr = (int64_t)gridDim.x * blockDim.x;
  const int64_t csrc = (((int64_t)l * p.ng + n) * p.g + a) * p.conv_inner;
  const int64_t cdst = l * p.cs0 + slot * p.cs1;
  for (int64_t i = gtid; i < p.conv_inner; i += nthr)
    store_from_float(p.conv_state, p.state_dtype, cdst + i,
                     load_as_float(p.conv_snaps, p.snap_dtype, csrc + i));
  if (l == 0 && gtid == 0) p.slot_pos[slot] = p.group_pos[n] + a + 1;
}

// ------------------------------------------------------------------------------------------------
// launch helpers

#if STRATA_HAVE_MMA
constexpr int MAX_DEVICES = 64;

// Raises the dynamic shared-memory limit of one kernel instantiation once per device.
template <int D, int MT, typename T>
int prepare_mma_kernel(int device) {
  static bool done[MAX_DEVICES] = {false};
  if (device >= 0 && device < MAX_DEVICES && done[device]) return 0;
  cudaError_t e = cudaFuncSetAttribute(attn_mma_kernel<D, MT, T>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)mma_smem_bytes<D, MT>());
  if (e != cudaSuccess) {
    g_last_kernel = "cudaFuncSetAttribute(attn_mma_kernel)";
    return (int)e;
  }
  if (device >= 0 && device < MAX_DEVICES) done[device] = true;
  return 0;
}

// 1 when the device can run the mma kernel for head dim d: sm_80+ and enough opt-in shared
// memory for its pipeline (Hopper: 227 KB; an A100's 163 KB is too little for d = 256).
int device_mma_ok(int device, int d) {
  static int cc[MAX_DEVICES] = {0};
  static int smem[MAX_DEVICES] = {0};
  if (device < 0 || device >= MAX_DEVICES) return 0;
  if (cc[device] == 0) {
    int major = 0, optin = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
            cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    smem[device] = optin;
    cc[device] = major;
  }
  size_t need = d == 64 ? mma_smem_bytes<64, 4>() : d == 128 ? mma_smem_bytes<128, 4>()
                                                             : mma_smem_bytes<256, 4>();
  return cc[device] >= 8 && (size_t)smem[device] >= need;
}

template <int D, typename T>
int launch_mma_d(AttnParams& p, int ng, int device, cudaStream_t stream, bool fixed_tiles) {
  // m-tiles per block by rows; fixed_tiles (use_mma == 2): always one, so that how the keys
  // are split among the block's warps, and so a row's summation order, never depends on rows.
  int mt = fixed_tiles ? 1 : (p.rows <= 16 ? 1 : (p.rows <= 32 ? 2 : 4));
  p.nrg = (p.rows + mt * 16 - 1) / (mt * 16);
  dim3 grid((unsigned)p.nsplit, (unsigned)p.hkv, (unsigned)(ng * p.nrg));
  int rc = 0;
  if (mt == 1) {
    rc = prepare_mma_kernel<D, 1, T>(device);
    if (!rc) attn_mma_kernel<D, 1, T><<<grid, 128, mma_smem_bytes<D, 1>(), stream>>>(p);
  } else if (mt == 2) {
    rc = prepare_mma_kernel<D, 2, T>(device);
    if (!rc) attn_mma_kernel<D, 2, T><<<grid, 128, mma_smem_bytes<D, 2>(), stream>>>(p);
  } else {
    rc = prepare_mma_kernel<D, 4, T>(device);
    if (!rc) attn_mma_kernel<D, 4, T><<<grid, 128, mma_smem_bytes<D, 4>(), stream>>>(p);
  }
  if (rc) return rc;
  return take_launch_error("grouped_window_attention: attn_mma_kernel");
}
#endif  // STRATA_HAVE_MMA

template <typename TC>
int launch_simt(AttnParams& p, int ng, cudaStream_t stream) {
  p.nrg = (p.rows + SIMT_ROWS - 1) / SIMT_ROWS;
  dim3 grid((unsigned)p.nsplit, (unsigned)p.hkv, (unsigned)(ng * p.nrg));
  const size_t smem =
      sizeof(float) * ((size_t)SIMT_ROWS * (p.d + 1) + 2 * (size_t)SIMT_KEYS * p.d +
                       SIMT_ROWS * SIMT_KEYS);
  if (p.d <= 32) attn_simt_kernel<4, TC><<<grid, 128, smem, stream>>>(p);
  else if (p.d <= 64) attn_simt_kernel<8, TC><<<grid, 128, smem, stream>>>(p);
  else if (p.d <= 128) attn_simt_kernel<16, TC><<<grid, 128, smem, stream>>>(p);
  else attn_simt_kernel<32, TC><<<grid, 128, smem, stream>>>(p);
  return take_launch_error("grouped_window_attention: attn_simt_kernel");
}

// The fields both gated-delta entry points set alike (the plain form's prep fields neutral).
GdnParams gdn_params(const float* rec_state, int64_t sss, int64_t nslots, const int64_t* group_slot,
                     int64_t g, int64_t h, int64_t dk, int64_t dv, float* out, float* snaps,
                     int mode) {
  GdnParams p;
  p.state = rec_state;
  p.out = out;
  p.snaps = snaps;
  p.group_slot = group_slot;
  p.state_slot_stride = sss;
  p.nslots = nslots;
  p.g = (int)g;
  p.h = (int)h;
  p.dk = (int)dk;
  p.dv = (int)dv;
  p.mode = mode;
  p.rep = 1;
  p.x_row = p.ba_row = 0;
  p.neg_a = p.dt_bias = nullptr;
  p.q_scale = 1.f;
  p.eps = 0.f;
  return p;
}

// The ba projection computed by causal_conv_window_qkvz_ba's extra blocks (ConvParams).
struct ConvBa {
  const void* xn;
  const void* w_ba;
  void* ba;
  int64_t xn_row, h, n;
};

template <int KW>
void launch_conv_ba(const ConvParams& p, int x_dtype, dim3 grid, cudaStream_t st) {
  if (x_dtype == STRATA_DTYPE_BF16) conv_kernel<KW, BF16><<<grid, CONV_THREADS, 0, st>>>(p);
  else if (x_dtype == STRATA_DTYPE_F16) conv_kernel<KW, F16><<<grid, CONV_THREADS, 0, st>>>(p);
  else conv_kernel<KW, F32><<<grid, CONV_THREADS, 0, st>>>(p);
}

// The conv entry points: gnk = 0 reads x's channels in place (the earlier serial kernel may
// stand in, STRATA_CONV_SERIAL), else gathers them (ConvParams); ba non-null adds its blocks.
int launch_conv(const void* x, int x_dtype, int64_t x_row, int gnk, int gdk, int gvpk,
                const void* conv_state, int state_dtype, int64_t sss, int64_t nslots,
                const void* weight, int w_dtype, const int64_t* group_slot, int64_t ng, int64_t g,
                int64_t c, int64_t kw, void* out, void* snaps, uintptr_t stream,
                const char* what, const ConvBa* ba = nullptr) {
  ConvParams p;
  p.x = x;
  p.state = conv_state;
  p.weight = weight;
  p.out = out;
  p.snaps = snaps;
  p.group_slot = group_slot;
  p.state_slot_stride = sss;
  p.nslots = nslots;
  p.g = (int)g;
  p.c = (int)c;
  p.kw = (int)kw;
  p.x_dtype = x_dtype;
  p.s_dtype = state_dtype;
  p.w_dtype = w_dtype;
  p.x_row = x_row;
  p.gnk = gnk;
  p.gdk = gdk;
  p.gvpk = gvpk;
  p.xn = p.w_ba = nullptr;
  p.ba = nullptr;
  p.xn_row = 0;
  p.conv_bx = (int)ceil_div_u(c, CONV_THREADS);
  p.ba_h = p.ba_n = p.ba_vec = 0;
  cudaStream_t st = (cudaStream_t)stream;
  if (gnk == 0 && (g_conv_options & STRATA_CONV_SERIAL)) {
    conv_serial_kernel<<<dim3(ceil_div_u(c, 128), (unsigned)ng), 128, 0, st>>>(p);
    return take_launch_error("causal_conv_window: conv_serial_kernel");
  }
  if (ba != nullptr) {
    p.xn = ba->xn;
    p.w_ba = ba->w_ba;
    p.ba = ba->ba;
    p.xn_row = ba->xn_row;
    p.ba_h = (int)ba->h;
    p.ba_n = (int)ba->n;
    p.ba_vec = aligned16(ba->xn) && aligned16(ba->w_ba) && ba->h % BA_CHUNK == 0 &&
               ba->xn_row % BA_CHUNK == 0;
    const dim3 grid(p.conv_bx + ceil_div_u(ba->n, BA_WARPS), (unsigned)(ng * g));
    if (kw == 4) launch_conv_ba<4>(p, x_dtype, grid, st);
    else launch_conv_ba<0>(p, x_dtype, grid, st);
    return take_launch_error(what);
  }
  const dim3 grid(p.conv_bx, (unsigned)(ng * g));
  if (kw == 4) conv_kernel<4><<<grid, CONV_THREADS, 0, st>>>(p);
  else conv_kernel<0><<<grid, CONV_THREADS, 0, st>>>(p);
  return take_launch_error(what);
}

template <int KPT, bool PREP>
void launch_gdn_kpt(const GdnParams& p, dim3 grid, cudaStream_t st, bool pdl) {
#if !STRATA_PLATFORM_HIP
  launch_maybe_pdl(gdn_kernel<KPT, PREP>, grid, dim3(256), 0, st, pdl, p);
#else
  (void)pdl;
  gdn_kernel<KPT, PREP><<<grid, 256, 0, st>>>(p);
#endif
}

// pdl: a programmatic dependent launch (pdl_wait_primary, before any read): the prepared form,
// whose kernel before it in a window is the conv.
template <bool PREP>
int launch_gdn(const GdnParams& p, int64_t ng, uintptr_t stream, const char* what, bool pdl) {
  dim3 grid(ceil_div_u(p.dv, 32), (unsigned)p.h, (unsigned)ng);
  cudaStream_t st = (cudaStream_t)stream;
  const int kpt = (p.dk + GDN_GROUPS - 1) / GDN_GROUPS;
  if (kpt <= 1) launch_gdn_kpt<1, PREP>(p, grid, st, pdl);
  else if (kpt <= 2) launch_gdn_kpt<2, PREP>(p, grid, st, pdl);
  else if (kpt <= 4) launch_gdn_kpt<4, PREP>(p, grid, st, pdl);
  else if (kpt <= 8) launch_gdn_kpt<8, PREP>(p, grid, st, pdl);
  else if (kpt <= 16) launch_gdn_kpt<16, PREP>(p, grid, st, pdl);
  else launch_gdn_kpt<32, PREP>(p, grid, st, pdl);
  return take_launch_error(what);
}

}  // namespace

// ================================================================================================
// C API

extern "C" {

const char* strata_gpu_platform(void) { return STRATA_PLATFORM_HIP ? "hip" : "cuda"; }

const char* strata_gpu_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

const char* strata_gpu_last_kernel(void) { return g_last_kernel; }

int strata_gpu_has_mma(void) { return STRATA_HAVE_MMA; }

int strata_gpu_attn_mma_supported(int head_dim, int rows) {
  (void)rows;
  return STRATA_HAVE_MMA && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

int strata_gpu_write_kv(void* k_cache, void* v_cache, int cache_dtype, const int64_t* kcs,
                        const int64_t* vcs, int64_t nslots, int64_t T, const void* k,
                        const void* v, int kv_dtype, const int64_t* group_slot,
                        const int64_t* group_pos, int64_t ng, int64_t g, int64_t hkv, int64_t d,
                        int device, uintptr_t stream) {
  int rc = use_device(device);
  if (rc) return rc;
  if (ng * g == 0) return 0;
  WriteKvParams p;
  p.kc = k_cache;
  p.vc = v_cache;
  p.k = k;
  p.v = v;
  p.group_slot = group_slot;
  p.group_pos = group_pos;
  p.ks0 = kcs[0]; p.ks1 = kcs[1]; p.ks2 = kcs[2];
  p.vs0 = vcs[0]; p.vs1 = vcs[1]; p.vs2 = vcs[2];
  p.nslots = nslots;
  p.T = T;
  p.g = (int)g;
  p.hkv = (int)hkv;
  p.d = (int)d;
  p.cache_dtype = cache_dtype;
  p.kv_dtype = kv_dtype;
  write_kv_kernel<<<dim3((unsigned)(ng * g), 2), 256, 0, (cudaStream_t)stream>>>(p);
  return take_launch_error("write_kv: write_kv_kernel");
}

int64_t strata_gpu_attention_workspace(int64_t ng, int64_t hkv, int64_t rows, int64_t d,
                                       int64_t nsplit) {
  if (nsplit <= 1) return 0;
  return ng * hkv * nsplit * rows * (d + 2);
}

int strata_gpu_attention(const void* q, int q_dtype, const void* k_cache, const void* v_cache,
                         int cache_dtype, const int64_t* kcs, const int64_t* vcs, int64_t nslots,
                         int64_t T, const int64_t* group_slot, const int64_t* group_pos,
                         int64_t ng, int64_t g, int64_t hq, int64_t hkv, int64_t d, int64_t ctx,
                         float scale, void* out, float* workspace, int64_t nsplit, int64_t chunk,
                         int use_mma, int* path_out, int device, uintptr_t stream) {
  int rc = use_device(device);
  if (rc) return rc;
  (void)T;
  if (ng * g == 0) return 0;
  if (hkv <= 0 || hq % hkv != 0 || d <= 0 || d > 256 || ctx < 1 || nsplit < 1 || chunk < 1 ||
      nsplit * chunk < ctx || nsplit > MAX_SPLITS || (nsplit > 1 && workspace == nullptr)) {
    g_last_kernel = "grouped_window_attention (bad arguments)";
    return (int)cudaErrorInvalidValue;
  }
  cudaStream_t st = (cudaStream_t)stream;
  AttnParams p;
  p.q = q;
  p.out = out;
  p.kc = k_cache;
  p.vc = v_cache;
  const int64_t rows = (hq / hkv) * g;
  p.ws_o = workspace;
  p.ws_ml = workspace ? workspace + ng * hkv * nsplit * rows * d : nullptr;
  p.group_slot = group_slot;
  p.group_pos = group_pos;
  p.ks0 = kcs[0]; p.ks1 = kcs[1]; p.ks2 = kcs[2];
  p.vs0 = vcs[0]; p.vs1 = vcs[1]; p.vs2 = vcs[2];
  p.nslots = nslots;
  p.ctx = ctx;
  p.chunk = chunk;
  p.g = (int)g;
  p.hq = (int)hq;
  p.hkv = (int)hkv;
  p.d = (int)d;
  p.rep = (int)(hq / hkv);
  p.rows = (int)rows;
  p.nsplit = (int)nsplit;
  p.nrg = 1;
  p.q_dtype = q_dtype;
  p.scale_log2 = scale * 1.4426950408889634f;

  int path = 0;
#if STRATA_HAVE_MMA
  const bool mma_ok =
      use_mma && q_dtype == cache_dtype && q_dtype != STRATA_DTYPE_F32 &&
      (d == 64 || d == 128 || d == 256) && aligned16(q) && aligned16(k_cache) &&
      aligned16(v_cache) && aligned16(out) && (kcs[0] % 8 == 0) && (kcs[1] % 8 == 0) &&
      (kcs[2] % 8 == 0) && (vcs[0] % 8 == 0) && (vcs[1] % 8 == 0) && (vcs[2] % 8 == 0) &&
      device_mma_ok(device, (int)d);
  if (mma_ok) {
    path = 1;
    if (q_dtype == STRATA_DTYPE_BF16) {
      if (d == 64) rc = launch_mma_d<64, BF16>(p, (int)ng, device, st, use_mma == 2);
      else if (d == 128) rc = launch_mma_d<128, BF16>(p, (int)ng, device, st, use_mma == 2);
      else rc = launch_mma_d<256, BF16>(p, (int)ng, device, st, use_mma == 2);
    } else {
      if (d == 64) rc = launch_mma_d<64, F16>(p, (int)ng, device, st, use_mma == 2);
      else if (d == 128) rc = launch_mma_d<128, F16>(p, (int)ng, device, st, use_mma == 2);
      else rc = launch_mma_d<256, F16>(p, (int)ng, device, st, use_mma == 2);
    }
  }
#endif
  if (path == 0) {
    if (cache_dtype == STRATA_DTYPE_F32) rc = launch_simt<F32>(p, (int)ng, st);
    else if (cache_dtype == STRATA_DTYPE_BF16) rc = launch_simt<BF16>(p, (int)ng, st);
    else rc = launch_simt<F16>(p, (int)ng, st);
  }
  if (path_out) *path_out = path;
  if (rc) return rc;
  if (nsplit > 1) {
    const int lanes = (d % 4 == 0) ? (int)(COMBINE_THREADS / (d / 4)) : 1;
    const size_t smem = sizeof(float) * ((size_t)nsplit + (size_t)(lanes > 0 ? lanes : 1) * d);
    attn_combine_kernel<<<dim3((unsigned)rows, (unsigned)hkv, (unsigned)ng), COMBINE_THREADS,
                          smem, st>>>(p);
    rc = take_launch_error("grouped_window_attention: attn_combine_kernel");
  }
  return rc;
}

int strata_gpu_conv_set_options(int flags) {
  const int old = g_conv_options;
  if (flags >= 0) g_conv_options = flags;
  return old;
}

int strata_gpu_causal_conv(const void* x, int x_dtype, const void* conv_state, int state_dtype,
                           int64_t sss, int64_t nslots, const void* weight, int w_dtype,
                           const int64_t* group_slot, int64_t ng, int64_t g, int64_t c,
                           int64_t kw, void* out, void* snaps, int device, uintptr_t stream) {
  int rc = use_device(device);
  if (rc) return rc;
  if (ng * g * c == 0) return 0;
  if (kw < 2 || kw > CONV_MAX_K) {
    g_last_kernel = "causal_conv_window (kernel width must be in [2, 16])";
    return (int)cudaErrorInvalidValue;
  }
  return launch_conv(x, x_dtype, c, 0, 0, 0, conv_state, state_dtype, sss, nslots, weight,
                     w_dtype, group_slot, ng, g, c, kw, out, snaps, stream,
                     "causal_conv_window: conv_kernel");
}

int strata_gpu_causal_conv_qkvz(const void* x, int x_dtype, int64_t x_row, int64_t nk, int64_t dk,
                                int64_t vpk, const void* conv_state, int state_dtype, int64_t sss,
                                int64_t nslots, const void* weight, int w_dtype,
                                const int64_t* group_slot, int64_t ng, int64_t g, int64_t kw,
                                void* out, void* snaps, int device, uintptr_t stream) {
  int rc = use_device(device);
  if (rc) return rc;
  const int64_t c = 2 * nk * dk + nk * vpk;
  if (ng * g * c == 0) return 0;
  if (kw < 2 || kw > CONV_MAX_K || nk < 1 || dk < 1 || vpk < 1) {
    g_last_kernel = "causal_conv_window_qkvz (kernel width in [2, 16], heads and widths >= 1)";
    return (int)cudaErrorInvalidValue;
  }
  return launch_conv(x, x_dtype, x_row, (int)nk, (int)dk, (int)vpk, conv_state, state_dtype, sss,
                     nslots, weight, w_dtype, group_slot, ng, g, c, kw, out, snaps, stream,
                     "causal_conv_window_qkvz: conv_kernel");
}

int strata_gpu_causal_conv_qkvz_ba(const void* x, int x_dtype, int64_t x_row, int64_t nk,
                                   int64_t dk, int64_t vpk, const void* conv_state,
                                   int state_dtype, int64_t sss, int64_t nslots,
                                   const void* weight, int w_dtype, const int64_t* group_slot,
                                   int64_t ng, int64_t g, int64_t kw, void* out, void* snaps,
                                   const void* xn, int64_t xn_row, const void* w_ba, int64_t h,
                                   int64_t nba, void* ba, int device, uintptr_t stream) {
  int rc = use_device(device);
  if (rc) return rc;
  const int64_t c = 2 * nk * dk + nk * vpk;
  if (ng * g * c == 0) return 0;
  if (kw < 2 || kw > CONV_MAX_K || nk < 1 || dk < 1 || vpk < 1 || h < 1 || nba < 1 ||
      h > INT32_MAX || nba > INT32_MAX) {
    g_last_kernel = "causal_conv_window_qkvz_ba (kernel width in [2, 16], heads, widths and "
                    "the ba projection's sizes >= 1)";
    return (int)cudaErrorInvalidValue;
  }
  const ConvBa cb{xn, w_ba, ba, xn_row, h, nba};
  return launch_conv(x, x_dtype, x_row, (int)nk, (int)dk, (int)vpk, conv_state, state_dtype, sss,
                     nslots, weight, w_dtype, group_slot, ng, g, c, kw, out, snaps, stream,
                     "causal_conv_window_qkvz_ba: conv_kernel", &cb);
}

int strata_gpu_gated_delta(const void* q, int q_dtype, const void* k, int k_dtype, const void* v,
                           int v_dtype, const void* gate, int g_dtype, const void* beta,
                           int b_dtype, const float* rec_state, int64_t sss, int64_t nslots,
                           const int64_t* group_slot, int64_t ng, int64_t g, int64_t h,
                           int64_t dk, int64_t dv, float* out, float* snaps, int mode,
                           int device, uintptr_t stream) {
  int rc = use_device(device);
  if (rc) return rc;
  if (ng * g * h == 0) return 0;
  if (dk < 1 || dk > 32 * GDN_GROUPS || dv < 1) {
    g_last_kernel = "gated_delta_window (Dk must be in [1, 256])";
    return (int)cudaErrorInvalidValue;
  }
  GdnParams p = gdn_params(rec_state, sss, nslots, group_slot, g, h, dk, dv, out, snaps, mode);
  p.q = q;
  p.k = k;
  p.v = v;
  p.gate = gate;
  p.beta = beta;
  p.q_dtype = q_dtype;
  p.k_dtype = k_dtype;
  p.v_dtype = v_dtype;
  p.g_dtype = g_dtype;
  p.b_dtype = b_dtype;
  return launch_gdn<false>(p, ng, stream, "gated_delta_window: gdn_kernel", false);
}

int strata_gpu_gated_delta_prep(const void* x, int x_dtype, int64_t x_row, const void* ba,
                                int ba_dtype, int64_t ba_row, const float* neg_a,
                                const float* dt_bias, int64_t rep, float q_scale, float eps,
                                const float* rec_state, int64_t sss, int64_t nslots,
                                const int64_t* group_slot, int64_t ng, int64_t g, int64_t h,
                                int64_t dk, int64_t dv, float* out, float* snaps, int mode,
                                int device, uintptr_t stream) {
  int rc = use_device(device);
  if (rc) return rc;
  if (ng * g * h == 0) return 0;
  if (dk < 1 || dk > 32 * GDN_GROUPS || dv < 1 || rep < 1 || h % rep ||
      mode == STRATA_GDN_FINAL) {
    g_last_kernel = "gated_delta_window_prep (Dk must be in [1, 256], H a multiple of rep, "
                    "snapshots or factors)";
    return (int)cudaErrorInvalidValue;
  }
  GdnParams p = gdn_params(rec_state, sss, nslots, group_slot, g, h, dk, dv, out, snaps, mode);
  p.q = p.k = p.v = x;
  p.gate = p.beta = ba;
  p.q_dtype = p.k_dtype = p.v_dtype = x_dtype;
  p.g_dtype = p.b_dtype = ba_dtype;
  p.rep = (int)rep;
  p.x_row = x_row;
  p.ba_row = ba_row;
  p.neg_a = neg_a;
  p.dt_bias = dt_bias;
  p.q_scale = q_scale;
  p.eps = eps;
  const bool pdl = (g_conv_options & STRATA_CONV_GDN_PDL) && gpu_device_has_pdl(device);
  return launch_gdn<true>(p, ng, stream, "gated_delta_window_prep: gdn_kernel", pdl);
}

int strata_gpu_commit(const int64_t* accept, const int64_t* group_slot, const int64_t* group_pos,
                      int64_t ng, int64_t g, int64_t L, const float* rec_factors, int64_t h,
                      int64_t dk, int64_t dv, const void* conv_snaps, int snap_dtype,
                      int64_t conv_inner, float* rec_state, const int64_t* rs, void* conv_state,
                      int state_dtype, const int64_t* cs, int64_t nslots, int64_t* slot_pos,
                      int device, uintptr_t stream) {
  int rc = use_device(device);
  if (rc) return rc;
  if (ng == 0) return 0;
  if (dk < 0 || dk > 32 * GDN_GROUPS || dv < 0 || h < 0) {
    g_last_kernel = "accepted commit (Dk must be in [0, 256])";
    return (int)cudaErrorInvalidValue;
  }
  CommitParams p;
  p.accept = accept;
  p.group_slot = group_slot;
  p.group_pos = group_pos;
  p.factors = rec_factors;
  p.conv_snaps = conv_snaps;
  p.rec_state = rec_state;
  p.conv_state = conv_state;
  p.slot_pos = slot_pos;
  p.conv_inner = conv_inner;
  p.rs0 = rs[0]; p.rs1 = rs[1];
  p.cs0 = cs[0]; p.cs1 = cs[1];
  p.nslots = nslots;
  p.ng = (int)ng;
  p.g = (int)g;
  p.h = (int)h;
  p.dk = (int)dk;
  p.dv = (int)dv;
  p.nvt = (int)ceil_div_u(dv > 0 ? dv : 1, 32);
  p.snap_dtype = snap_dtype;
  p.state_dtype = state_dtype;
  if (L < 1) {  // no layers: only slot_pos advances
    L = 1;
    p.dk = 0;
    p.conv_inner = 0;
  }
  const int64_t blocks = (int64_t)p.nvt * (h > 0 ? h : 1);
  const dim3 grid((unsigned)blocks, (unsigned)ng, (unsigned)L);
  cudaStream_t st = (cudaStream_t)stream;
  const int kpt = (p.dk + GDN_GROUPS - 1) / GDN_GROUPS;
  if (kpt <= 1) commit_kernel<1><<<grid, 256, 0, st>>>(p);
  else if (kpt <= 2) commit_kernel<2><<<grid, 256, 0, st>>>(p);
  else if (kpt <= 4) commit_kernel<4><<<grid, 256, 0, st>>>(p);
  else if (kpt <= 8) commit_kernel<8><<<grid, 256, 0, st>>>(p);
  else if (kpt <= 16) commit_kernel<16><<<grid, 256, 0, st>>>(p);
  else commit_kernel<32><<<grid, 256, 0, st>>>(p);
  return take_launch_error("accepted commit: commit_kernel");
}

}  // extern "C"

// Shared with the other GPU translation unit (strata_moe.cu), see strata_gpu_internal.h.
namespace strata {
void gpu_set_last_kernel(const char* name) { g_last_kernel = name; }
int gpu_use_device(int device) { return use_device(device); }

// Cached per device: the launch paths ask on every call.
bool gpu_device_has_pdl(int device) {
#if STRATA_PLATFORM_HIP
  (void)device;
  return false;
#else
  static int cached[64];  // 0 unknown, 1 no, 2 yes; benign race (same value written)
  if (device < 0 || device >= 64) return false;
  if (!cached[device]) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cached[device] = major >= 9 ? 2 : 1;
  }
  return cached[device] == 2;
#endif
}
}  // namespace strata
