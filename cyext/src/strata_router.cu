// strata cyext: the MoE router at decode sizes as one kernel. For m <= 32 rows of bf16 x (m, H)
// and the fused router weight W (R, H) bf16 (rows 0..E-1 the experts' gate, row E the shared
// expert's gate when there is one): logits = bf16(x . W^T), plus the optional routing bias,
// softmax over the E experts in float32, the top k (descending, ties to the lower id),
// renormalised when asked, and the shared expert appended as column k with weight
// sigmoid(shared logit) and id shared_id. Semantics: strata/kernels/reference.py moe_route.
//
// Why one kernel: at a decode window the router is 2 MB of weights (512 experts x 2048) and a few
// hundred floats of work per row, yet the matmul, the softmax/top-k, the renormalisation, the
// shared gate's sigmoid and the concatenation with the shared expert were five launches, about
// 14 us per MoE layer on an H200, nearly all of it launch and latency.
//
// Layout: phase 1, every CTA: the CTA stages the m x rows in shared memory as float32; each of
// its 4 weight rows is split over 2 warps (4 above 8 rows, where the CTA has 16 warps), each
// taking a share of its 16-byte chunks (lane l holds the share's chunks l, l + 32, ..., all
// loads in flight at once: 129 CTAs at E = 512, so every SM has a part of the bytes) and dots
// them with the x rows, four at a time, summing each chunk's 8 products in order, the chunks in
// order, then a fixed butterfly over the lanes; the shares are added in order and the
// bf16-rounded logit goes to a float32 scratch (m, R). Phase 2: the CTA that finishes last (a
// ticket counted with atomics; it resets the ticket to zero, so the next launch finds it so)
// runs the softmax and top-k, one warp per row: lane l owns experts l, l + 32, ... in shared
// memory and keeps its best three in registers, and k rounds of a warp argmax (redux.sync on
// sm_80+) over the lanes' best pick the experts. At most 128 KiB
// of x per launch (16 rows at H = 2048; more rows take several launches, the later ones plain
// rather than programmatic so that none overlap on the ticket).
// No other kernel, no host sync: capturable.
// Determinism: a row's logits, softmax and picks depend only on that row, so its result is the
// same bits whatever other rows share the launch.
// The ticket: one int32 per call site (the MoE layer), zero between launches; launches that
// share a ticket must not run at the same time (one stream per layer, as the engine runs).

#include "strata_moe_common.cuh"

using namespace strata;
using namespace strata::moe;

namespace {

// Probe hooks (scripts/probe_router_stamps.cu defines STRATA_ROUTER_STAMPS and includes this
// file): clock64 stamps of the last CTA's phase 2 and each CTA's start and ticket in
// globaltimer ns. Nothing in the extension's build.
#ifdef STRATA_ROUTER_STAMPS
__device__ long long router_stamps[64];
__device__ unsigned long long router_cta_ns[2 * 1024];
#define ROUTER_STAMP(i)                                         \
  do {                                                          \
    if (threadIdx.x == 0) router_stamps[i] = clock64();         \
  } while (0)
__device__ __forceinline__ unsigned long long router_now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define ROUTER_CTA_NS(i)                                                            \
  do {                                                                              \
    if (threadIdx.x == 0) router_cta_ns[2 * blockIdx.x + (i)] = router_now_ns();    \
  } while (0)
#define ROUTER_CLOCK(v) const long long v = clock64()
#define ROUTER_SAVE(i, v)                        \
  do {                                           \
    if (threadIdx.x == 0) router_stamps[i] = v;  \
  } while (0)
#else
#define ROUTER_CLOCK(v) \
  do {                  \
  } while (0)
#define ROUTER_SAVE(i, v) \
  do {                    \
  } while (0)
#define ROUTER_STAMP(i) \
  do {                  \
  } while (0)
#define ROUTER_CTA_NS(i) \
  do {                   \
  } while (0)
#endif

// Weight rows per CTA in phase 1, each split over WARPS / RT_ROWS_PER_CTA warps (a share of its
// chunks each); WARPS is 8, or 16 for more than 8 rows, so that phase 2 (one warp per row, about
// 5 us a pass on an H200, much of it code fetched cold: see route_row) takes one pass up to 16
// rows.
constexpr int RT_ROWS_PER_CTA = 4;
constexpr int RT_MAX_WARPS = 16;
// A logit's sum, in the same order in either CTA size (so a row's routing never depends on the
// window's row count): four shares of the row's chunks, each summed over its lanes, then added
// in share order. A warp takes two shares in CTAs of 8 warps, one in CTAs of 16.
constexpr int RT_SHARES = 4;
constexpr int RT_MAX_ROWS = 32;   // x rows per launch
constexpr int RT_MAX_EXPERTS = 1024;
constexpr int RT_MAX_K = 32;
constexpr int RT_SMEM_X = 128 * 1024;  // bytes of x staged per launch, at most
constexpr int RT_GROUP = 4;            // x rows per pass over a warp's weight row

struct RouteParams {
  const uint16_t* x;   // (m, H) bf16
  const uint16_t* w;   // (R, H) bf16
  const float* bias;   // (E,) or null
  float* logits;       // (m, R) scratch
  float* weights;      // (m, k + has_shared)
  int64_t* ids;        // (m, k + has_shared)
  unsigned* ticket;
  int m, H, E, R, k, norm, shared_id, cols;
};

__device__ __forceinline__ float bf16_round(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(u | 0x00400000u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return __uint_as_float(u & 0xffff0000u);
}

// A float the other CTAs wrote in this launch (after their fence): from L2, never a stale L1.
__device__ __forceinline__ float load_l2(const float* p) {
#if STRATA_PLATFORM_HIP
  return *(volatile const float*)p;
#else
  return __ldcg(p);
#endif
}

// The warp's max (MAX) or min of an unsigned (redux.sync on sm_80+, a butterfly elsewhere).
template <bool MAX>
__device__ __forceinline__ unsigned warp_reduce_u32(unsigned v) {
#if !STRATA_PLATFORM_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return MAX ? __reduce_max_sync(0xffffffffu, v) : __reduce_min_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int s = 16; s >= 1; s >>= 1) {
    const unsigned o = (unsigned)STRATA_SHFL_XOR((int)v, s, 32);
    v = MAX ? max(v, o) : min(v, o);
  }
  return v;
#endif
}

// A lane's best three untaken experts, best first (ties to the lower id: the experts arrive in
// id order and only a strictly greater probability moves ahead; a NaN never enters).
struct Best3 {
  float v0, v1, v2;
  int i0, i1, i2;
  __device__ __forceinline__ void clear() {
    v0 = v1 = v2 = -INFINITY;
    i0 = i1 = i2 = 0x7fffffff;
  }
  // by selects, not branches, so that the lanes' different paths do not run one after another
  // (with branches the probabilities' pass measured 0.92 us against 0.34 without the insertion)
  __device__ __forceinline__ void offer(float v, int i) {
    const bool c0 = v > v0, c1 = v > v1, c2 = v > v2;  // c0 implies c1 implies c2
    v2 = c1 ? v1 : (c2 ? v : v2);
    i2 = c1 ? i1 : (c2 ? i : i2);
    v1 = c0 ? v0 : (c1 ? v : v1);
    i1 = c0 ? i0 : (c1 ? i : i1);
    v0 = c0 ? v : v0;
    i0 = c0 ? i : i0;
  }
  __device__ __forceinline__ void pop() {
    v0 = v1;
    i0 = i1;
    v1 = v2;
    i1 = i2;
    v2 = -INFINITY;
    i2 = 0x7fffffff;
  }
};

// Phase 2 for row r, in one warp: lane l owns experts l, l + 32, ... in shared memory (ps). Phase
// 2 runs once per launch on one SM, so its code is fetched cold: an instruction executed once
// costs about 4 ns there (an unrolled load of the row in registers took 3.7 us where these
// rolled loops take 1.3, and a sorting network 2.4 us), while a loop's body is fetched once.
// The k rounds of a warp argmax were 0.42 us each (4.2 of phase 2's 7.6 us at k = 10 and one
// row) while the winning lane rescanned its experts in shared memory; now each lane keeps its
// best three in registers, built in the probabilities' pass, so a round is two warp reductions
// and a pop, and a lane rescans (skipping the taken, marked in ps) only once its three are
// taken. The same picks, weights and bits as the rescans.
__device__ __forceinline__ void route_row(const RouteParams& p, int r, int lane, float* ps) {
  const float* lrow = p.logits + (int64_t)r * p.R;
  float mx = -INFINITY;
#pragma unroll 4
  for (int j = lane; j < p.E; j += 32) {
    const float l = load_l2(lrow + j) + (p.bias ? __ldg(p.bias + j) : 0.f);
    ps[j] = l;
    mx = fmaxf(mx, l);
  }
#pragma unroll
  for (int s = 16; s >= 1; s >>= 1) mx = fmaxf(mx, STRATA_SHFL_XOR(mx, s, 32));
  ROUTER_STAMP(3);
  float sum = 0.f;
#pragma unroll 4
  for (int j = lane; j < p.E; j += 32) {
    const float ex = expf(ps[j] - mx);
    ps[j] = ex;
    sum += ex;
  }
  const float inv = 1.f / warp_sum(sum);
  ROUTER_STAMP(4);
  Best3 best;
  best.clear();
#pragma unroll 2
  for (int j = lane; j < p.E; j += 32) {
    const float pr = ps[j] * inv;
    ps[j] = pr;
    best.offer(pr, j);
  }
  ROUTER_STAMP(5);
  float pick_v = 0.f;
  int pick_i = 0;
  float total = 0.f;
#pragma unroll 1
  for (int t = 0; t < p.k; ++t) {
    // Probabilities are >= 0, so their bits order as unsigned ints (+1: 0 is "none left").
    const unsigned key = best.v0 >= 0.f ? __float_as_uint(best.v0) + 1u : 0u;
    const unsigned top = warp_reduce_u32<true>(key);
    int wi = (int)warp_reduce_u32<false>(key == top && top ? (unsigned)best.i0 : 0x7fffffffu);
    float wv_ = top ? __uint_as_float(top - 1u) : -INFINITY;
    if (top && wi == best.i0) {  // this lane's best won: the next of its three
      ps[wi] = -INFINITY;        // taken, for a rescan
      best.pop();
      if (best.i0 == 0x7fffffff) {  // all three taken: rescan the untaken
        best.clear();
#pragma unroll 2
        for (int j = lane; j < p.E; j += 32) best.offer(ps[j], j);
      }
    }
    if (wi == 0x7fffffff) {  // fewer candidates than k (NaN logits): weight 0, any id
      wi = t;
      wv_ = 0.f;
    }
    if (lane == t) {
      pick_v = wv_;
      pick_i = wi;
    }
    total += wv_;
    ROUTER_STAMP(8 + t);
  }
  if (p.norm) pick_v = pick_v / total;
  if (lane < p.k) {
    p.weights[(int64_t)r * p.cols + lane] = pick_v;
    p.ids[(int64_t)r * p.cols + lane] = pick_i;
  }
  if (p.shared_id >= 0 && lane == 0) {
    const float sg = load_l2(lrow + p.E);
    p.weights[(int64_t)r * p.cols + p.k] = 1.f / (1.f + expf(-sg));
    p.ids[(int64_t)r * p.cols + p.k] = p.shared_id;
  }
  ROUTER_STAMP(6);
}

// Rows in groups of RT_GROUP: each group's MR chains run together, the groups one after
// another in a rolled loop (the code stays small: a kernel's code is fetched cold into the SM
// each time, and a long unrolled body cost microseconds).
template <int CPL, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, 1) moe_route_kernel(RouteParams p) {
  constexpr int SPLIT = WARPS / RT_ROWS_PER_CTA;  // warps per weight row
  constexpr int SPW = RT_SHARES / SPLIT;          // shares per warp
  // Dynamic shared memory: the m x rows in float32, each 16-byte chunk as two float4 in
  // separate halves of the row (lo: x_s[(2 * row) * nch + ch], hi: x_s[(2 * row + 1) * nch +
  // ch]) so that a warp's reads of consecutive chunks are consecutive 16 bytes (no bank
  // conflicts); then phase 2's probabilities, E floats per warp.
  extern __shared__ float4 x_s[];
  __shared__ float part_s[RT_ROWS_PER_CTA][RT_SHARES][RT_MAX_ROWS];  // the shares' sums
  __shared__ int last;
  ROUTER_CTA_NS(0);
  ROUTER_CLOCK(t_entry);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int er = warp / SPLIT, e = (int)blockIdx.x * RT_ROWS_PER_CTA + er;
  const int nch = p.H / 8;
  float* p_s = (float*)(x_s + 2 * p.m * nch) + warp * p.E;
  // share j of a weight row: chunks [j * share, (j + 1) * share), lane l taking the share's
  // chunks l, l + 32, ...; this warp's shares are j0 .. j0 + SPW - 1
  const int share = (nch + RT_SHARES - 1) / RT_SHARES;
  const int j0 = (warp % SPLIT) * SPW;
  pdl_launch_dependents();
  uint4 wv[SPW][CPL];
  if (e < p.R) {
    const uint16_t* wrow = p.w + (int64_t)e * p.H;
#pragma unroll
    for (int sh = 0; sh < SPW; ++sh) {
      const int c0 = (j0 + sh) * share, c1 = c0 + share < nch ? c0 + share : nch;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int ch = c0 + lane + 32 * c;
        wv[sh][c] = ch < c1 ? ldg16(wrow + 8 * ch) : make_uint4(0, 0, 0, 0);
      }
    }
  }
  // x comes from the kernel before this one; the CTA stages it once in float32 (every load in
  // flight), so the warps' dot products neither wait on a round trip per chunk nor convert x
  // again for every weight row.
  pdl_wait_primary();
  for (int i = threadIdx.x; i < p.m * nch; i += 32 * WARPS) {
    const uint4 u = ldg16(p.x + 8 * (int64_t)i);
    const int row = i / nch, ch = i - row * nch;
    x_s[2 * row * nch + ch] =
        make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                    __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
    x_s[(2 * row + 1) * nch + ch] =
        make_float4(__uint_as_float(u.z << 16), __uint_as_float(u.z & 0xffff0000u),
                    __uint_as_float(u.w << 16), __uint_as_float(u.w & 0xffff0000u));
  }
  __syncthreads();
  if (e < p.R) {
    // Each share sums its chunks in order, the 8 products of a chunk in order, then over the
    // lanes by a fixed butterfly: the same sums whichever warp (8 or 16 per CTA) takes it.
#pragma unroll 1
    for (int r0 = 0; r0 < p.m; r0 += RT_GROUP) {
#pragma unroll
      for (int sh = 0; sh < SPW; ++sh) {
        const int c0 = (j0 + sh) * share, c1 = c0 + share < nch ? c0 + share : nch;
        float acc[RT_GROUP];
#pragma unroll
        for (int r = 0; r < RT_GROUP; ++r) acc[r] = 0.f;
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          const int ch = c0 + lane + 32 * c;
          if (ch < c1) {
            const uint32_t wu[4] = {wv[sh][c].x, wv[sh][c].y, wv[sh][c].z, wv[sh][c].w};
            float wf[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              wf[2 * i] = __uint_as_float(wu[i] << 16);
              wf[2 * i + 1] = __uint_as_float(wu[i] & 0xffff0000u);
            }
#pragma unroll
            for (int r = 0; r < RT_GROUP; ++r) {
              if (r0 + r < p.m) {
                const float4 a = x_s[2 * (r0 + r) * nch + ch];
                const float4 b = x_s[(2 * (r0 + r) + 1) * nch + ch];
                float t = acc[r];
                t = fmaf(wf[0], a.x, t);
                t = fmaf(wf[1], a.y, t);
                t = fmaf(wf[2], a.z, t);
                t = fmaf(wf[3], a.w, t);
                t = fmaf(wf[4], b.x, t);
                t = fmaf(wf[5], b.y, t);
                t = fmaf(wf[6], b.z, t);
                acc[r] = fmaf(wf[7], b.w, t);
              }
            }
          }
        }
#pragma unroll
        for (int r = 0; r < RT_GROUP; ++r) {
          const float sum = warp_sum(acc[r]);
          if (lane == 0 && r0 + r < p.m) part_s[er][j0 + sh][r0 + r] = sum;
        }
      }
    }
  }
  __syncthreads();
  // the logit of (row r, weight row e) = bf16(the shares' sums added in order)
  for (int i = threadIdx.x; i < RT_ROWS_PER_CTA * p.m; i += 32 * WARPS) {
    const int rr = i / p.m, r = i - rr * p.m;
    const int ee = (int)blockIdx.x * RT_ROWS_PER_CTA + rr;
    if (ee >= p.R) continue;
    float sum = part_s[rr][0][r];
#pragma unroll
    for (int j = 1; j < RT_SHARES; ++j) sum += part_s[rr][j][r];
    p.logits[(int64_t)r * p.R + ee] = bf16_round(sum);
  }
  ROUTER_CLOCK(t_phase1);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(p.ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  ROUTER_CTA_NS(1);
  if (!last) return;
  ROUTER_SAVE(0, t_entry);
  ROUTER_SAVE(7, t_phase1);
  ROUTER_STAMP(1);
  __threadfence();
  if (threadIdx.x == 0) *p.ticket = 0u;
  ROUTER_STAMP(2);

  // Phase 2, one warp per row.
#pragma unroll 1
  for (int r = warp; r < p.m; r += WARPS) route_row(p, r, lane, p_s);
}

template <int CPL, int WARPS>
int launch_route(const RouteParams& p, int device, bool pdl, cudaStream_t st) {
  const dim3 grid(ceil_div_u(p.R, RT_ROWS_PER_CTA)), block(32 * WARPS);
  const int smem = p.m * p.H * 4 + WARPS * p.E * 4;
  const char* name = "moe_route: moe_route_kernel";
#if !STRATA_PLATFORM_HIP
  static int allowed = 0;
  if (int rc = allow_smem(moe_route_kernel<CPL, WARPS>, smem, allowed, name)) return rc;
  if (pdl && device_facts(device).major >= 9) {  // a programmatic dependent launch (sm_90+)
    launch_maybe_pdl(moe_route_kernel<CPL, WARPS>, grid, block, smem, st, true, p);
    return take_launch_error(name);
  }
#else
  (void)device;
  (void)pdl;
  if (smem > 48 * 1024) {
    if (cudaFuncSetAttribute((const void*)moe_route_kernel<CPL, WARPS>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
      return take_launch_error(name);
  }
#endif
  moe_route_kernel<CPL, WARPS><<<grid, block, smem, st>>>(p);
  return take_launch_error(name);
}

template <int WARPS>
int launch_route_chunks(const RouteParams& p, int device, bool pdl, cudaStream_t st) {
  switch (chunks_per_lane((p.H / 8 + RT_SHARES - 1) / RT_SHARES)) {  // H <= 4096: at most 4
    case 1: return launch_route<1, WARPS>(p, device, pdl, st);
    case 2: return launch_route<2, WARPS>(p, device, pdl, st);
    default: return launch_route<4, WARPS>(p, device, pdl, st);
  }
}

}  // namespace

extern "C" {

int strata_gpu_moe_route(const void* x, int64_t m, int64_t H, const void* w, int64_t R,
                         int64_t E, const float* bias, int64_t k, int norm, int64_t shared_id,
                         float* logits, float* weights, int64_t* ids, int32_t* ticket,
                         int device, uintptr_t stream) {
  int rc = gpu_use_device(device);
  if (rc) return rc;
  if (m == 0) return 0;
  if (m < 0 || m > RT_MAX_ROWS) return invalid("moe_route (1 to 32 rows per launch)");
  if (E < 1 || E > RT_MAX_EXPERTS || k < 1 || k > RT_MAX_K || k > E)
    return invalid("moe_route (1 <= k <= 32, k <= E <= 1024)");
  if (R < E + (shared_id >= 0 ? 1 : 0))
    return invalid("moe_route (the router weight has fewer rows than E plus the shared gate)");
  if (H < 8 || H % 8 || H > 16 * 32 * 8 || !aligned16(x) || !aligned16(w))
    return invalid("moe_route (H a multiple of 8 up to 4096, x and W 16-byte aligned)");
  RouteParams p;
  p.x = (const uint16_t*)x;
  p.w = (const uint16_t*)w;
  p.bias = bias;
  p.logits = logits;
  p.weights = weights;
  p.ids = ids;
  p.ticket = (unsigned*)ticket;
  p.m = (int)m;
  p.H = (int)H;
  p.E = (int)E;
  p.R = (int)(E + (shared_id >= 0 ? 1 : 0));
  p.k = (int)k;
  p.norm = norm ? 1 : 0;
  p.shared_id = (int)shared_id;
  p.cols = (int)k + (shared_id >= 0 ? 1 : 0);
  cudaStream_t st = (cudaStream_t)stream;
  // x is staged in shared memory: at most RT_SMEM_X bytes of it per launch. The launches after
  // the first are plain (not programmatic) ones, so that no two of them share the ticket at once.
  const int64_t per_launch = RT_SMEM_X / (H * 4) < m ? RT_SMEM_X / (H * 4) : m;
  for (int64_t r0 = 0; r0 < m; r0 += per_launch) {
    RouteParams q = p;
    q.m = (int)(m - r0 < per_launch ? m - r0 : per_launch);
    q.x = p.x + r0 * H;
    q.weights = p.weights + r0 * p.cols;
    q.ids = p.ids + r0 * p.cols;
    rc = q.m > 8 ? launch_route_chunks<RT_MAX_WARPS>(q, device, r0 == 0, st)
                 : launch_route_chunks<8>(q, device, r0 == 0, st);
    if (rc) return rc;
  }
  return 0;
}

}  // extern "C"
