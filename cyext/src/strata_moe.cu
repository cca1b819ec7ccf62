// strata cyext: routed experts (MoE) at decode sizes and the skinny FP8 / bf16 linear. Its own
// translation unit (compiled beside strata_kernels.cu); builds with nvcc and hipcc.
// Semantics: strata/kernels/reference.py (moe_experts, linear_fp8). Host API: strata_kernels.h.
//
// moe_experts: two launches per call, grids fixed by (N, k, E, I, H), so it can be captured.
//   moe_gate_up_kernel  grid (ceil(I/8), P = N*k). Block (tile, s) looks at pair s: when an
//       earlier pair routes to the same expert the block exits at once (that expert belongs to
//       its first pair, the "leader"). Otherwise it gathers the expert's member pairs (s and every
//       later pair with the same id, in pair order) and computes act[q][i] = silu(gate_e . x_n) *
//       (up_e . x_n) for its 8 features i and every member q = (n, j). One warp per feature: the
//       gate and up rows are loaded once into registers (16-byte loads, the whole row in flight)
//       and then dotted with each member's x row. Each expert's weights are therefore read
//       once. With the expert cache's counting, the leader's tile 0 also adds the expert's
//       members to the routing counts and, the first time the window sees it, one hit or miss
//       (count_expert): no other kernel or op per layer counts.
//   moe_down_kernel     grid ceil(H/8). Block = 8 output features of every row. Warps take two
//       features each and one of 4 phases over the leaders (in pair order, U leaders at a
//       time; the member lists are staged in shared memory first); each down row slice is
//       loaded once and dotted with the members' act rows; y[q][h] stays in shared memory and
//       the block ends with out[n][h] = sum_j w[n,j] * y[(n,j)][h] in j order: no atomics.
//       STRATA_MOE_DB: two half-size batches per warp, each refilled while the other computes.
//   STRATA_MOE_XSMEM: gate/up leader blocks stage the window's x rows in shared memory first.
// Determinism: every dot product sums in an order fixed by the dims alone (lane l takes the
// 16-byte chunks l, l+32, ...; the elements of a chunk in order; then a fixed butterfly over the
// 32 lanes), so a row's result is bit-identical whatever other rows share the call or an expert.
// FP8 weights (float8_e4m3fn) are decoded in registers (cvt.e4m3x2 on sm_89+, software elsewhere)
// and each 16-element chunk's partial sum is multiplied by its block scale (bi % 16 == 0).
//
// linear_skinny_kernel: y (M, O) = x (M, I) . W^T for M <= 32 rows. Warp = R output features;
// each weight chunk is loaded and decoded once and applied to all M rows (fp32 accumulators in
// registers), then one butterfly per (feature, row).

#include "strata_moe_common.cuh"

using namespace strata;
using namespace strata::moe;

namespace {

constexpr int MOE_TILE = 8;         // features per block in both kernels
constexpr int MOE_THREADS = 256;       // gate/up kernel
constexpr int MOE_DOWN_THREADS = 512;  // down kernel: 4 pairs of features x 4 leader phases
constexpr int LIN_WARPS = 4;
constexpr int LIN_GROUP = 4;        // weight chunks per lane in flight per row (linear)


// Pairs up to which the gate/up blocks issue their weight loads before the duplicate check
// (a duplicate block's loads are then wasted: few at small windows, many at 16-32 rows).
constexpr int MOE_EARLY_MAX_PAIRS = 96;

// One warp's gate and up rows of features i0 .. i0+F-1 of expert e into registers (16-byte
// loads, all in flight at once), with their block scales (FP8).
template <typename W, int CPL, int F>
__device__ __forceinline__ void load_gate_up_rows(const MoeParams& p, int e, int i0, int nch,
                                                  int64_t row_bytes, int lane,
                                                  uint4 (&wg)[F][CPL], uint4 (&wu)[F][CPL],
                                                  float (&sg)[F][CPL], float (&su)[F][CPL]) {
  typedef WChunk<W> C;
  const uint8_t* base = expert_gate_up(p, e);
#pragma unroll
  for (int f = 0; f < F; ++f) {
    const int i = i0 + f;
    const bool live = i < p.I;
    const uint8_t* g_row = base + (int64_t)i * row_bytes;
    const uint8_t* u_row = base + (int64_t)(p.I + i) * row_bytes;
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      const int c = lane + 32 * j;
      if (live && c < nch) {
        wg[f][j] = ldg16(g_row + 16 * (int64_t)c);
        wu[f][j] = ldg16(u_row + 16 * (int64_t)c);
      } else {
        wg[f][j] = make_uint4(0, 0, 0, 0);
        wu[f][j] = wg[f][j];
      }
      sg[f][j] = su[f][j] = 1.f;
      if (C::scaled && live && c < nch) {
        const float* sc = expert_gate_up_scale(p, e);
        const int col = (c * C::EPC) / p.bi;
        sg[f][j] = __ldg(sc + (int64_t)(i / p.bo) * p.ncb_h + col);
        su[f][j] = __ldg(sc + (int64_t)(p.nbg + i / p.bo) * p.ncb_h + col);
      }
    }
  }
}

// XS (STRATA_MOE_XSMEM): the gate/up block stages the window's x rows (all n, dynamic shared
// memory of n * H * x's element size, at most MOE_XS_MAX_BYTES) with asynchronous copies issued
// right after its duplicate check, so they land while the members are gathered and every
// member's dot products read x from shared memory instead of L2. Same values, same sums.
constexpr int MOE_XS_MAX_BYTES = 40 * 1024;  // + the static arrays: under the 48 KiB default

__device__ __forceinline__ void stage16(void* dst_shared, const void* src) {
#if !STRATA_PLATFORM_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst_shared);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
#else
  *(uint4*)dst_shared = ldg16(src);
#endif
}
__device__ __forceinline__ void stage_wait_all() {
#if !STRATA_PLATFORM_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// F features per warp: F = 2 doubles the bytes each warp has in flight (FP8 rows are short)
// and halves the blocks, each of which pays the ids / duplicate-check prologue.
template <typename W, int CPL, int F, bool EARLY, bool XS>
__global__ void __launch_bounds__(MOE_THREADS, (CPL * F) <= 4 ? 3 : 2)
    moe_gate_up_kernel(MoeParams p) {
  typedef WChunk<W> C;
  __shared__ int ids_s[MOE_MAX_PAIRS];
  __shared__ int mem_s[MOE_MAX_PAIRS];
  __shared__ int warp_tot[MOE_THREADS / 32];
  extern __shared__ uint4 xs_dyn[];  // XS: the window's x rows
  pdl_launch_dependents();
  const int s = blockIdx.y, tid = threadIdx.x;
  // EARLY: this pair's expert straight from global memory, so the weight loads below are in
  // flight while the ids are staged and the duplicate check runs.
  const int e_early = EARLY ? clamp_expert(__ldg(p.topk_ids + s), p.E) : 0;
  const int lane = tid & 31, warp = tid >> 5;
  const int i0 = (blockIdx.x * (MOE_THREADS / 32) + warp) * F;
  const int nch = p.H / C::EPC;
  const int64_t row_bytes = (int64_t)p.H * sizeof(typename W::storage);
  uint4 wg[F][CPL], wu[F][CPL];
  float sg[F][CPL], su[F][CPL];
  if (EARLY) load_gate_up_rows<W, CPL, F>(p, e_early, i0, nch, row_bytes, lane, wg, wu, sg, su);
  for (int q = tid; q < p.P; q += MOE_THREADS) ids_s[q] = clamp_expert(p.topk_ids[q], p.E);
  __syncthreads();
  const int e = ids_s[s];
  int dup = 0;
  for (int q = tid; q < s; q += MOE_THREADS) dup |= (ids_s[q] == e);
  if (__syncthreads_or(dup)) return;  // not the leader of its expert
  if (XS) {  // the x rows, in flight while the members are gathered
    const int x16 = p.n * p.H * (p.x_dtype == STRATA_DTYPE_F32 ? 4 : 2) / 16;
    for (int t = tid; t < x16; t += MOE_THREADS) stage16(xs_dyn + t, (const uint4*)p.x + t);
  }
  // this warp's gate and up rows: the loads are in flight while the members are gathered
  if (!EARLY) load_gate_up_rows<W, CPL, F>(p, e, i0, nch, row_bytes, lane, wg, wu, sg, su);
  const int q0 = 2 * tid;
  const int f0 = (q0 >= s && q0 < p.P && ids_s[q0] == e) ? 1 : 0;
  const int f1 = (q0 + 1 >= s && q0 + 1 < p.P && ids_s[q0 + 1] == e) ? 1 : 0;
  int total;
  const int off = block_exclusive_scan<MOE_THREADS>(f0 + f1, warp_tot, &total);
  if (f0) mem_s[off] = q0;
  if (f1) mem_s[off + f0] = q0 + 1;
  if (p.routed_counts && blockIdx.x == 0 && tid == 0) count_expert(p, e, total);
  if (XS) stage_wait_all();
  __syncthreads();
  const void* xsrc = XS ? (const void*)xs_dyn : p.x;

  if (i0 >= p.I) return;
  for (int m = 0; m < total; ++m) {
    const int q = mem_s[m];
    const int64_t xrow = (int64_t)(q / p.k) * p.H;
#pragma unroll
    for (int f = 0; f < F; ++f) {
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        opaque(wg[f][j]);
        opaque(wu[f][j]);
      }
    }
    float ag[F], au[F];
#pragma unroll
    for (int f = 0; f < F; ++f) ag[f] = au[f] = 0.f;
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      const int c = lane + 32 * j;
      if (c >= nch) continue;
      if constexpr (C::scaled) {
        // FP8: the chunk's 16 activations in two halves of 8, each decoded next to its FMAs
        // (a whole chunk of decoded x and weights made the kernel spill); same order, same sums
        float pg[F], pu[F];
#pragma unroll
        for (int f = 0; f < F; ++f) pg[f] = pu[f] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float xf[8];
          load_act<8, XS>(xsrc, p.x_dtype, xrow + (int64_t)c * 16 + 8 * h, xf);
#pragma unroll
          for (int f = 0; f < F; ++f) {
            pg[f] = fp8_half_dot(h ? wg[f][j].z : wg[f][j].x, h ? wg[f][j].w : wg[f][j].y, xf, pg[f]);
            pu[f] = fp8_half_dot(h ? wu[f][j].z : wu[f][j].x, h ? wu[f][j].w : wu[f][j].y, xf, pu[f]);
          }
        }
#pragma unroll
        for (int f = 0; f < F; ++f) {
          ag[f] = fmaf(sg[f][j], pg[f], ag[f]);
          au[f] = fmaf(su[f][j], pu[f], au[f]);
        }
      } else {
        float xf[C::EPC];
        load_act<C::EPC, XS>(xsrc, p.x_dtype, xrow + (int64_t)c * C::EPC, xf);
#pragma unroll
        for (int f = 0; f < F; ++f) {
          ag[f] = chunk_dot<W>(wg[f][j], xf, sg[f][j], ag[f]);
          au[f] = chunk_dot<W>(wu[f][j], xf, su[f][j], au[f]);
        }
      }
    }
#pragma unroll
    for (int f = 0; f < F; ++f) {
      const float g = warp_sum(ag[f]), u = warp_sum(au[f]);
      if (lane == 0 && i0 + f < p.I) p.act[(int64_t)q * p.I + i0 + f] = g / (1.f + expf(-g)) * u;
    }
  }
}

// One batch of down-row slices: for the U leaders a0 .. a0+U-1 (those < nlead), rows h0 and
// h0+1, this lane's CPL chunks, with their block scales (FP8).
template <typename W, int CPL, int U>
__device__ __forceinline__ void load_down_batch(const MoeParams& p, const int* lexp_s, int a0,
                                                int nlead, int h0, int nch, int64_t row_bytes,
                                                int lane, uint4 (&w)[U][2][CPL],
                                                float (&sc)[U][2][CPL]) {
  typedef WChunk<W> C;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool live = a0 + u < nlead;
    const int e = live ? lexp_s[a0 + u] : 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = h0 + r;
      const uint8_t* row = expert_down(p, e) + (int64_t)h * row_bytes;
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        const int c = lane + 32 * j;
        const bool ok = live && h < p.H && c < nch;
        w[u][r][j] = ok ? ldg16(row + 16 * (int64_t)c) : make_uint4(0, 0, 0, 0);
        sc[u][r][j] = 1.f;
        if (C::scaled && ok)
          sc[u][r][j] = __ldg(expert_down_scale(p, e) + (int64_t)(h / p.bo) * p.ncb_i +
                              (c * C::EPC) / p.bi);
      }
    }
  }
}

// The down dot products of one batch (leaders a0 .. a0+U-1 below nlead, this warp's two
// features h0, h0+1): y[q][h] for every member q, into shared memory.
template <typename W, int CPL, int U>
__device__ __forceinline__ void down_batch_dots(const MoeParams& p, const uint4 (&w)[U][2][CPL],
                                                const float (&sc)[U][2][CPL], int a0, int nlead,
                                                const int* lcnt_s, const int* lst_s,
                                                const int* mem_s, float* y_s, int hl, int lane,
                                                int nch) {
  typedef WChunk<W> C;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int nm = a0 + u < nlead ? lcnt_s[a0 + u] : 0;
    const int m0 = a0 + u < nlead ? lst_s[a0 + u] : 0;
    for (int m = 0; m < nm; ++m) {
      const int q = mem_s[m0 + m];
      const float* arow = p.act + (int64_t)q * p.I;
      float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        const int c = lane + 32 * j;
        if (c < nch) {
          float xf[C::EPC];
          load_act<C::EPC>(arow, STRATA_DTYPE_F32, (int64_t)c * C::EPC, xf);
          acc0 = chunk_dot<W>(w[u][0][j], xf, sc[u][0][j], acc0);
          acc1 = chunk_dot<W>(w[u][1][j], xf, sc[u][1][j], acc1);
        }
      }
      acc0 = warp_sum(acc0);
      acc1 = warp_sum(acc1);
      if (lane == 0) {
        y_s[q * MOE_TILE + hl] = acc0;
        y_s[q * MOE_TILE + hl + 1] = acc1;
      }
    }
  }
}

template <typename W, int CPL, int U, bool DB>
__global__ void __launch_bounds__(MOE_DOWN_THREADS, 2) moe_down_kernel(MoeParams p) {
  typedef WChunk<W> C;
  __shared__ int ids_s[MOE_MAX_PAIRS];    // every pair's expert
  __shared__ int lexp_s[MOE_MAX_PAIRS];   // the leaders' experts, leaders in pair order
  __shared__ int lcnt_s[MOE_MAX_PAIRS];   // their member counts
  __shared__ int lst_s[MOE_MAX_PAIRS];    // where their members start in mem_s
  __shared__ int mem_s[MOE_MAX_PAIRS];    // members, grouped by leader
  __shared__ float y_s[MOE_MAX_PAIRS * MOE_TILE];
  __shared__ int warp_tot[2][MOE_DOWN_THREADS / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // The grouping again, from the ids alone (no output of the gate/up kernel is needed before
  // the activations): pair t leads when no earlier pair has its expert; its members are the
  // pairs from t on with that expert, in pair order. One pair per thread (P <= 512).
  for (int q = tid; q < p.P; q += MOE_DOWN_THREADS) ids_s[q] = clamp_expert(p.topk_ids[q], p.E);
  __syncthreads();
  int cnt = 0;
  if (tid < p.P) {
    const int e = ids_s[tid];
    bool lead = true;
    for (int q = 0; q < tid && lead; ++q) lead = ids_s[q] != e;
    if (lead)
      for (int q = tid; q < p.P; ++q) cnt += ids_s[q] == e;
  }
  int nlead, nmem;
  const int a = block_exclusive_scan<MOE_DOWN_THREADS>(cnt > 0 ? 1 : 0, warp_tot[0], &nlead);
  const int mst = block_exclusive_scan<MOE_DOWN_THREADS>(cnt, warp_tot[1], &nmem);
  if (cnt > 0) {
    const int e = ids_s[tid];
    lexp_s[a] = e;
    lcnt_s[a] = cnt;
    lst_s[a] = mst;
    int m = 0;
    for (int q = tid; q < p.P && m < cnt; ++q)
      if (ids_s[q] == e) mem_s[mst + m++] = q;
  }
  __syncthreads();

  const int hl = (warp & 3) * 2;  // this warp's two features within the tile
  const int phase = warp >> 2;    // leaders are dealt to the 4 warp phases U at a time
  const int nphase = MOE_DOWN_THREADS / 128;
  const int h0 = blockIdx.x * MOE_TILE + hl;
  const int nch = p.I / C::EPC;
  const int64_t row_bytes = (int64_t)p.I * sizeof(typename W::storage);
  if constexpr (!DB) {
    uint4 w[U][2][CPL];
    float sc[U][2][CPL];
    // the first batch of down rows is in flight before the wait for the gate/up grid
    load_down_batch<W, CPL, U>(p, lexp_s, phase * U, nlead, h0, nch, row_bytes, lane, w, sc);
    pdl_wait_primary();
    for (int a0 = phase * U; a0 < nlead; a0 += nphase * U) {
      if (a0 != phase * U)
        load_down_batch<W, CPL, U>(p, lexp_s, a0, nlead, h0, nch, row_bytes, lane, w, sc);
      down_batch_dots<W, CPL, U>(p, w, sc, a0, nlead, lcnt_s, lst_s, mem_s, y_s, hl, lane, nch);
    }
  } else {
    // Double-buffered (STRATA_MOE_DB): two batches of U leaders in flight before the wait; each
    // batch's buffer is refilled with the batch after next as soon as its dots are done, so the
    // loads run under the other batch's compute. Leaders are dealt in batches of U (half the
    // single-buffer batch: the same registers); each y value is the same dot product.
    const int step = nphase * U, first = phase * U;
    uint4 wa[U][2][CPL], wb[U][2][CPL];
    float sa[U][2][CPL], sb[U][2][CPL];
    load_down_batch<W, CPL, U>(p, lexp_s, first, nlead, h0, nch, row_bytes, lane, wa, sa);
    load_down_batch<W, CPL, U>(p, lexp_s, first + step, nlead, h0, nch, row_bytes, lane, wb, sb);
    pdl_wait_primary();
    for (int a0 = first; a0 < nlead; a0 += 2 * step) {
      down_batch_dots<W, CPL, U>(p, wa, sa, a0, nlead, lcnt_s, lst_s, mem_s, y_s, hl, lane, nch);
      if (a0 + 2 * step < nlead)
        load_down_batch<W, CPL, U>(p, lexp_s, a0 + 2 * step, nlead, h0, nch, row_bytes, lane, wa,
                                   sa);
      down_batch_dots<W, CPL, U>(p, wb, sb, a0 + step, nlead, lcnt_s, lst_s, mem_s, y_s, hl, lane,
                                 nch);
      if (a0 + 3 * step < nlead)
        load_down_batch<W, CPL, U>(p, lexp_s, a0 + 3 * step, nlead, h0, nch, row_bytes, lane, wb,
                                   sb);
    }
  }
  __syncthreads();
  for (int t = tid; t < p.n * MOE_TILE; t += MOE_DOWN_THREADS) {
    const int n = t / MOE_TILE, hh = t % MOE_TILE;
    const int h = blockIdx.x * MOE_TILE + hh;
    if (h >= p.H) continue;
    float acc = 0.f;
    for (int j = 0; j < p.k; ++j) {
      const int q = n * p.k + j;
      acc = fmaf(p.topk_w[q], y_s[q * MOE_TILE + hh], acc);
    }
    store_from_float(p.out, p.x_dtype, (int64_t)n * p.H + h, acc);
  }
}

// Process-wide switches of the routed-expert launches (STRATA_MOE_* in strata_kernels.h). PDL,
// EARLY, DB and XSMEM are on (each measured faster on an H200, DB + XSMEM at every row count
// within noise: docs/KERNELS.md); WIDE is off: two features per warp measured 3-12% slower for
// FP8 (twice the registers, two blocks per SM instead of three), kept to measure again after
// register-lean changes. STREAM_MISS is on: with misses the streamed kernels read the host store
// as fast as the per-block ones (91-93% of the pinned copy) and their windows ran 2-5% faster.
// LINEAR_SPLIT and its PAIR are on: the split FP8 linear in pairs was faster than the unsplit
// one at every shape and row count measured (12288, 9216 x 2048 and 2048 x 4096 at 1-32 rows);
// its f16 operands (LINEAR_F16) are off: faster at 1-2 rows, slower from 4 (x's conversion).
// GU_MMA is on: the streamed gate/up on tensor cores took the FP8 experts from 53% to 66% of the
// copy ceiling at 16 rows and 39% to 49% at 32 (docs/KERNELS.md). X_GLOBAL is on: 64 rows in one
// launch 469 against 553 us for four of 16, a 64-token prompt chunk 36.0 against 41.0 ms at
// full depth (docs/KERNELS.md "Wide launches"). GU_RUNS is on: one layer's experts at 64 / 256 /
// 512 prompt rows in 452 / 697 / 752 against 488 / 856 / 1,326 us on an H100, an eight-slot
// prompt chunk at 24 layers 32.8 against 46.8 ms (docs/KERNELS.md "member runs").
int g_moe_options = STRATA_MOE_PDL | STRATA_MOE_EARLY | STRATA_MOE_DB | STRATA_MOE_XSMEM |
                    STRATA_MOE_STREAM | STRATA_LINEAR_STREAM | STRATA_MOE_STREAM_MISS |
                    STRATA_LINEAR_SPLIT | STRATA_LINEAR_SPLIT_PAIR | STRATA_MOE_GU_MMA |
                    STRATA_MOE_DOWN_SPLIT | STRATA_MOE_X_GLOBAL | STRATA_MOE_DOWN_MMA |
                    STRATA_MOE_GU_RUNS | STRATA_LINEAR_PDL | STRATA_LINEAR_MMA;
// linear_skinny's bf16 launches as programmatic dependents (STRATA_LINEAR_PDL) only up to this
// many rows: on the embedded model solo's 4-row windows run faster with them; for batch_mtp at
// N=8 (8-16 rows, the engine host-bound) one-process A/Bs went either way by more than the
// effect (docs/BENCHMARKS.md), so larger windows stay plain launches until an A/B over
// alternating processes decides.
int g_linear_pdl_rows = 4;

template <typename W, int CPL, int U, bool DB>
int launch_moe_down_kernel(const MoeParams& p, cudaStream_t st, bool pdl) {
  const dim3 grid(ceil_div_u(p.H, MOE_TILE));
#if !STRATA_PLATFORM_HIP
  if (pdl) {
    launch_maybe_pdl(moe_down_kernel<W, CPL, U, DB>, grid, dim3(MOE_DOWN_THREADS), 0, st, true, p);
    return take_launch_error("moe_experts: moe_down_kernel");
  }
#else
  (void)pdl;
#endif
  moe_down_kernel<W, CPL, U, DB><<<grid, MOE_DOWN_THREADS, 0, st>>>(p);
  return take_launch_error("moe_experts: moe_down_kernel");
}

// Single buffer: batches of U leaders, as many as 4 chunks per lane allow. Double buffer
// (STRATA_MOE_DB, where U >= 2): two batches of U / 2, the same registers.
template <typename W, int CPL>
int launch_moe_down(const MoeParams& p, cudaStream_t st, bool pdl, bool db) {
  constexpr int U = CPL >= 4 ? 1 : 4 / CPL;
  if constexpr (U >= 2) {
    if (db) return launch_moe_down_kernel<W, CPL, U / 2, true>(p, st, pdl);
  }
  return launch_moe_down_kernel<W, CPL, U, false>(p, st, pdl);
}

template <typename W, int F, bool EARLY, bool XS>
void launch_moe_gate_up(const MoeParams& p, int ch, size_t xs_bytes, cudaStream_t st) {
  const dim3 grid(ceil_div_u(p.I, (MOE_THREADS / 32) * F), (unsigned)p.P);
  const dim3 grid1(ceil_div_u(p.I, MOE_THREADS / 32), (unsigned)p.P);
  switch (ch) {
    case 1: moe_gate_up_kernel<W, 1, F, EARLY, XS><<<grid, MOE_THREADS, xs_bytes, st>>>(p); break;
    case 2: moe_gate_up_kernel<W, 2, F, EARLY, XS><<<grid, MOE_THREADS, xs_bytes, st>>>(p); break;
    case 4: moe_gate_up_kernel<W, 4, F, EARLY, XS><<<grid, MOE_THREADS, xs_bytes, st>>>(p); break;
    case 8: moe_gate_up_kernel<W, 8, 1, EARLY, XS><<<grid1, MOE_THREADS, xs_bytes, st>>>(p); break;
    default:
      moe_gate_up_kernel<W, 16, 1, EARLY, XS><<<grid1, MOE_THREADS, xs_bytes, st>>>(p); break;
  }
}

template <typename W>
int launch_moe(const MoeParams& p, int device, cudaStream_t st) {
  const int epc = WChunk<W>::EPC;
  const int ch = chunks_per_lane(p.H / epc), ci = chunks_per_lane(p.I / epc);
  // two features per warp where a warp's rows are short (at most 4 chunks per lane)
  const bool early = (g_moe_options & STRATA_MOE_EARLY) && p.P <= MOE_EARLY_MAX_PAIRS;
  const bool wide = (g_moe_options & STRATA_MOE_WIDE) && ch <= 4;
  const size_t xs_bytes = (size_t)p.n * p.H * (p.x_dtype == STRATA_DTYPE_F32 ? 4 : 2);
  // x in shared memory (one feature per warp only: WIDE is register-bound already)
  const bool xs = (g_moe_options & STRATA_MOE_XSMEM) && !wide && xs_bytes <= MOE_XS_MAX_BYTES;
  if (wide) {
    if (early) launch_moe_gate_up<W, 2, true, false>(p, ch, 0, st);
    else launch_moe_gate_up<W, 2, false, false>(p, ch, 0, st);
  } else if (xs) {
    if (early) launch_moe_gate_up<W, 1, true, true>(p, ch, xs_bytes, st);
    else launch_moe_gate_up<W, 1, false, true>(p, ch, xs_bytes, st);
  } else {
    if (early) launch_moe_gate_up<W, 1, true, false>(p, ch, 0, st);
    else launch_moe_gate_up<W, 1, false, false>(p, ch, 0, st);
  }
  int rc = take_launch_error("moe_experts: moe_gate_up_kernel");
  if (rc) return rc;
  const bool pdl = (g_moe_options & STRATA_MOE_PDL) && gpu_device_has_pdl(device);
  const bool db = (g_moe_options & STRATA_MOE_DB) != 0;
  switch (ci) {
    case 1: return launch_moe_down<W, 1>(p, st, pdl, db);
    case 2: return launch_moe_down<W, 2>(p, st, pdl, db);
    case 4: return launch_moe_down<W, 4>(p, st, pdl, db);
    case 8: return launch_moe_down<W, 8>(p, st, pdl, db);
    default: return launch_moe_down<W, 16>(p, st, pdl, db);
  }
}

// ------------------------------------------------------------------------------------------------
// skinny linear

struct LinParams {
  const void* x;
  const void* w;
  const float* scale;
  void* out;
  int m, in, o, bo, bi, ncb, x_dtype;
};

// One warp's weight chunks base + lane + 32 g (g < LIN_GROUP) of its R rows, with their block
// scales (FP8), into registers; chunks past the row or rows past o read as zero.
template <typename W, int R>
__device__ __forceinline__ void load_lin_group(const LinParams& p, int o0, int base, int nch,
                                               int64_t row_bytes, int lane,
                                               uint4 (&w)[R][LIN_GROUP], float (&sc)[R][LIN_GROUP]) {
  typedef WChunk<W> C;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const bool live = o0 + r < p.o;
    const uint8_t* row = (const uint8_t*)p.w + (int64_t)(o0 + r) * row_bytes;
#pragma unroll
    for (int g = 0; g < LIN_GROUP; ++g) {
      const int c = base + lane + 32 * g;
      const bool ok = live && c < nch;
      w[r][g] = ok ? ldg16(row + 16 * (int64_t)c) : make_uint4(0, 0, 0, 0);
      sc[r][g] = 1.f;
      if (C::scaled && ok)
        sc[r][g] = __ldg(p.scale + (int64_t)((o0 + r) / p.bo) * p.ncb + (c * C::EPC) / p.bi);
    }
  }
}

template <typename W, int MT, int R>
__global__ void __launch_bounds__(LIN_WARPS * 32) linear_skinny_kernel(LinParams p) {
  typedef WChunk<W> C;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int o0 = (blockIdx.x * LIN_WARPS + warp) * R;
  if (o0 >= p.o) return;
  const int nch = p.in / C::EPC;
  const int64_t row_bytes = (int64_t)p.in * sizeof(typename W::storage);
  float acc[R][MT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  uint4 w[R][LIN_GROUP];
  float sc[R][LIN_GROUP];
  // The weights are parameters, which no kernel of a window writes: the first group (a whole
  // row up to LIN_GROUP * 32 chunks) loads before the wait for the kernel before this one, so
  // as a programmatic dependent launch its latency overlaps that kernel's tail. x, that
  // kernel's output, is read only after the wait; so is y written (the kernel before may
  // still read the buffer y reuses).
  load_lin_group<W, R>(p, o0, 0, nch, row_bytes, lane, w, sc);
  pdl_wait_primary();
  pdl_launch_dependents();
  for (int base = 0; base < nch; base += 32 * LIN_GROUP) {
    if (base) load_lin_group<W, R>(p, o0, base, nch, row_bytes, lane, w, sc);
#pragma unroll
    for (int g = 0; g < LIN_GROUP; ++g) {
      const int c = base + lane + 32 * g;
      if (c < nch) {
        float wf[R][C::EPC];
#pragma unroll
        for (int r = 0; r < R; ++r) decode_chunk<W>(w[r][g], wf[r]);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          if (m < p.m) {
            float xf[C::EPC];
            load_act<C::EPC>(p.x, p.x_dtype, (int64_t)m * p.in + (int64_t)c * C::EPC, xf);
#pragma unroll
            for (int r = 0; r < R; ++r)
              acc[r][m] = chunk_fma<W>(wf[r], xf, sc[r][g], acc[r][m]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < p.m) {
        const float v = warp_sum(acc[r][m]);
        if (lane == m % 32 && o0 + r < p.o)
          store_from_float(p.out, p.x_dtype, (int64_t)m * p.o + o0 + r, v);
      }
    }
  }
}

template <typename W, int MT, int R>
void launch_linear_grid(const LinParams& p, unsigned blocks, cudaStream_t st, bool pdl) {
#if !STRATA_PLATFORM_HIP
  launch_maybe_pdl(linear_skinny_kernel<W, MT, R>, dim3(blocks), dim3(LIN_WARPS * 32), 0, st,
                   pdl, p);
#else
  (void)pdl;
  linear_skinny_kernel<W, MT, R><<<blocks, LIN_WARPS * 32, 0, st>>>(p);
#endif
}

template <typename W, int MT>
int launch_linear_mt(const LinParams& p, int sm_blocks, cudaStream_t st, bool pdl) {
  // Several features per warp reuse each activation load; as many as the registers allow
  // (accumulators grow with the rows), fewer when that would leave SMs idle.
  const int R = MT <= 8 ? 4 : 2;
  const int64_t warps = (p.o + R - 1) / R;
  if ((warps + LIN_WARPS - 1) / LIN_WARPS >= sm_blocks) {
    launch_linear_grid<W, MT, R>(p, ceil_div_u(warps, LIN_WARPS), st, pdl);
  } else {
    launch_linear_grid<W, MT, 1>(p, ceil_div_u(p.o, LIN_WARPS), st, pdl);
  }
  return take_launch_error("linear: linear_skinny_kernel");
}

template <typename W>
int launch_linear(const LinParams& p, int sm_blocks, cudaStream_t st, bool pdl) {
  if (p.m <= 1) return launch_linear_mt<W, 1>(p, sm_blocks, st, pdl);
  if (p.m <= 2) return launch_linear_mt<W, 2>(p, sm_blocks, st, pdl);
  if (p.m <= 4) return launch_linear_mt<W, 4>(p, sm_blocks, st, pdl);
  if (p.m <= 8) return launch_linear_mt<W, 8>(p, sm_blocks, st, pdl);
  if (p.m <= 16) return launch_linear_mt<W, 16>(p, sm_blocks, st, pdl);
  return launch_linear_mt<W, 32>(p, sm_blocks, st, pdl);
}

}  // namespace

extern "C" {

int strata_gpu_moe_set_options(int flags) {
  const int old = g_moe_options;
  if (flags >= 0) g_moe_options = flags;
  return old;
}

int strata_gpu_linear_pdl_rows(int rows) {
  const int old = g_linear_pdl_rows;
  if (rows >= 0) g_linear_pdl_rows = rows < 32 ? rows : 32;
  return old;
}

// act (P x I floats), the per-block kernels' tables (launches of up to MOE_MAX_ROWS rows: they
// take no more), then (from 17 rows, when hidden is given) a wide launch's staged x: n rows of
// 2H + 16 bytes and n row scales (strata_moe_stream.cu, moe_stage_x), then a big wide launch's
// down results (more than MOE_WIDE_SMEM_PAIRS pairs: P x H floats). Each part 16-byte aligned.
static int64_t align4(int64_t v) { return (v + 3) & ~(int64_t)3; }
static int64_t moe_x_stage_offset(int64_t n, int64_t k, int64_t inter) {
  const int64_t P = n * k;
  return align4(P * inter + (n <= MOE_MAX_ROWS ? P + P * P : 0));
}
static int64_t moe_x_stage_floats(int64_t n, int64_t hidden) {
  return n > 16 && hidden > 0 ? align4(n * (2 * hidden + 16) / 4 + n) : 0;
}
static int64_t moe_y_stage_floats(int64_t n, int64_t k, int64_t hidden) {
  return n > 16 && hidden > 0 && n * k > MOE_WIDE_SMEM_PAIRS ? n * k * hidden : 0;
}

int strata_gpu_moe_sync_ints(void) { return MOE_SYNC_INTS; }

int64_t strata_gpu_moe_workspace(int64_t n, int64_t k, int64_t inter, int64_t hidden) {
  return moe_x_stage_offset(n, k, inter) + moe_x_stage_floats(n, hidden) +
         moe_y_stage_floats(n, k, hidden);
}

// Whether a launch may run wide (STRATA_MOE_X_GLOBAL): FP8 weights without the expert cache, up
// to MOE_WIDE_MAX_ROWS rows and MOE_WIDE_MAX_PAIRS pairs; the streamed kernels' plan then
// decides (launch_moe_stream).
static bool moe_wide_allowed(int w_dtype, bool cached, int64_t n, int64_t P) {
  return (g_moe_options & STRATA_MOE_X_GLOBAL) && w_dtype == STRATA_DTYPE_FP8 && !cached &&
         n <= MOE_WIDE_MAX_ROWS && P <= MOE_WIDE_MAX_PAIRS;
}

int strata_gpu_moe_wide_takes(int64_t n, int64_t k, int64_t E, int64_t H, int64_t I, int64_t bo,
                              int64_t bi, int w_dtype, int x_dtype, int device) {
#if STRATA_PLATFORM_HIP
  (void)n; (void)k; (void)E; (void)H; (void)I; (void)bo; (void)bi; (void)w_dtype;
  (void)x_dtype; (void)device;
  return 0;
#else
  if (gpu_use_device(device) || !gpu_device_has_pdl(device)) return 0;
  if (!moe_wide_allowed(w_dtype, false, n, n * k) || !(g_moe_options & STRATA_MOE_STREAM) ||
      n < 17 || bo < 1 || bi < 1)
    return 0;
  MoeParams p = {};
  static uint8_t stage_marker;  // non-null: the plan sees staging buffers
  p.x_stage = &stage_marker;
  p.y_stage = (float*)&stage_marker;
  p.all_resident = 1;
  p.n = (int)n; p.k = (int)k; p.P = (int)(n * k); p.E = (int)E; p.H = (int)H; p.I = (int)I;
  p.bo = (int)bo; p.bi = (int)bi; p.x_dtype = x_dtype;
  bool takes = false;
  launch_moe_stream(p, w_dtype, device, false, false, nullptr, &takes, true);
  return takes ? 1 : 0;
#endif
}

int strata_gpu_moe_experts(const void* x, int x_dtype, const void* w_gate_up, const void* w_down,
                           int w_dtype, const float* gu_scale, const float* down_scale,
                           int64_t bo, int64_t bi, const float* topk_weight,
                           const int64_t* topk_ids, int64_t n, int64_t k, int64_t E, int64_t H,
                           int64_t I, const StrataExpertCache* cache, void* out,
                           float* workspace, int prompt, int device, uintptr_t stream,
                           int* sync) {
  int rc = gpu_use_device(device);
  if (rc) return rc;
  if (n == 0 || H == 0) return 0;
  const int64_t P = n * k;
  const int esz = dtype_size(w_dtype);
  // (wide launches: x staged in the workspace, on the streamed tensor-core kernels)
  const bool wide_ok = moe_wide_allowed(w_dtype, cache != nullptr, n, P);
  if ((!wide_ok && (n > MOE_MAX_ROWS || P > MOE_MAX_PAIRS)) || k < 1 || E < 1 || I < 1)
    return invalid("moe_experts (needs 1 <= N <= 32 rows and N * k <= 512; with the wide "
                   "option, FP8 weights and no expert cache, N <= 512 and N * k <= 5984)");
  if (H % 16 || I % 16 || !chunks_per_lane(H * esz / 16) || !chunks_per_lane(I * esz / 16))
    return invalid("moe_experts (H and I must be multiples of 16, rows at most 8 KiB)");
  if (!aligned16(x) || !aligned16(w_gate_up) || !aligned16(w_down) || !aligned16(workspace))
    return invalid("moe_experts (x, weights and workspace must be 16-byte aligned)");
  const bool fp8 = w_dtype == STRATA_DTYPE_FP8;
  if (fp8 && (!gu_scale || !down_scale || bo < 1 || bi < 16 || bi % 16))
    return invalid("moe_experts (FP8 weights need scales and a block (bo, bi) with bi % 16 == 0)");
  if (cache && (!cache->slot_of || !cache->host_gate_up || !cache->host_down ||
                !aligned16(cache->host_gate_up) || !aligned16(cache->host_down) ||
                (fp8 && (!cache->host_gu_scale || !cache->host_down_scale))))
    return invalid("moe_experts (the expert cache needs slot_of and a 16-byte aligned host store)");
  if (cache && cache->routed_counts &&
      (!cache->window_state || !cache->count_layer || cache->n_layers < 1))
    return invalid("moe_experts (the expert cache's counting needs routed_counts, window_state "
                   "and count_layer)");
  MoeParams p;
  p.slot_of = cache ? cache->slot_of : nullptr;
  p.h_gu = cache ? cache->host_gate_up : nullptr;
  p.h_down = cache ? cache->host_down : nullptr;
  p.h_gu_scale = cache ? cache->host_gu_scale : nullptr;
  p.h_down_scale = cache ? cache->host_down_scale : nullptr;
  p.routed_counts = cache ? cache->routed_counts : nullptr;
  p.window_state = cache ? cache->window_state : nullptr;
  p.count_layer = cache ? cache->count_layer : nullptr;
  p.n_host = cache ? (int)cache->n_host : 0;
  p.n_layers = cache ? (int)cache->n_layers : 0;
  // A cache with a slot for every expert id (the budget holds every routed expert: it never
  // misses) reads only device slots, like the stacks without a cache.
  p.all_resident = !cache || cache->n_slots >= E;
  p.x = x;
  p.out = out;
  p.w_gu = w_gate_up;
  p.w_down = w_down;
  p.gu_scale = gu_scale;
  p.down_scale = down_scale;
  p.topk_w = topk_weight;
  p.topk_ids = topk_ids;
  p.act = workspace;
  p.counts = n <= MOE_MAX_ROWS ? (int*)(workspace + P * I) : nullptr;
  p.members = n <= MOE_MAX_ROWS ? p.counts + P : nullptr;
  p.x_stage = n > 16 ? (uint8_t*)(workspace + moe_x_stage_offset(n, k, I)) : nullptr;
  p.x_unscale = n > 16 ? (float*)(p.x_stage + n * (2 * H + 16)) : nullptr;
  p.y_stage = moe_y_stage_floats(n, k, H)
                  ? workspace + moe_x_stage_offset(n, k, I) + moe_x_stage_floats(n, H)
                  : nullptr;
  p.gu_expert_bytes = 2 * I * H * esz;
  p.down_expert_bytes = H * I * esz;
  p.n = (int)n;
  p.k = (int)k;
  p.P = (int)P;
  p.E = (int)E;
  p.H = (int)H;
  p.I = (int)I;
  p.bo = fp8 ? (int)bo : 1;
  p.bi = fp8 ? (int)bi : 1;
  p.x_dtype = x_dtype;
  p.prompt = prompt ? 1 : 0;
  p.sync = sync;
  p.nbg = (int)((I + p.bo - 1) / p.bo);
  p.ncb_h = (int)((H + p.bi - 1) / p.bi);
  p.ncb_i = (int)((I + p.bi - 1) / p.bi);
  p.gu_scale_expert = (int64_t)2 * p.nbg * p.ncb_h;
  p.down_scale_expert = ((H + p.bo - 1) / p.bo) * p.ncb_i;
  cudaStream_t st = (cudaStream_t)stream;
  // A cache that can miss runs the streamed kernels too with STRATA_MOE_STREAM_MISS (on): their
  // bulk copies read missing experts from the host store; off, the per-block kernels.
  const bool stream_ok = p.all_resident || (g_moe_options & STRATA_MOE_STREAM_MISS);
  if ((g_moe_options & STRATA_MOE_STREAM) && stream_ok && gpu_device_has_pdl(device)) {
    bool launched = false;
    rc = launch_moe_stream(p, w_dtype, device, (g_moe_options & STRATA_MOE_PDL) != 0,
                           (g_moe_options & STRATA_MOE_STREAM_ALL) != 0, st, &launched);
    if (launched || rc) return rc;
  }
  if (n > MOE_MAX_ROWS || P > MOE_MAX_PAIRS)  // only the streamed kernels take these
    return invalid("moe_experts (more than 32 rows or 512 pairs need the streamed tensor-core "
                   "kernels: sm_90+, FP8 in 128-column blocks, H a multiple of 128 up to 4096)");
  switch (w_dtype) {
    case STRATA_DTYPE_F32: return launch_moe<F32>(p, device, st);
    case STRATA_DTYPE_BF16: return launch_moe<BF16>(p, device, st);
    case STRATA_DTYPE_F16: return launch_moe<F16>(p, device, st);
    default: return launch_moe<FP8W>(p, device, st);
  }
}

// Whether linear_skinny hands (m, in) x (o, in) to the streamed FP8 kernel: the switch is on
// and the kernel takes the shapes.
static bool linear_streams(int64_t m, int64_t in, int64_t o, int64_t bo, int64_t bi, int w_dtype,
                           int x_dtype, int device) {
  return (g_moe_options & STRATA_LINEAR_STREAM) &&
         linear_stream_takes(m, in, o, bo, bi, w_dtype, x_dtype, device);
}

int strata_gpu_linear_stream_takes(int64_t m, int64_t in, int64_t o, int64_t bo, int64_t bi,
                                   int w_dtype, int x_dtype, int device) {
  if (gpu_use_device(device)) return 0;
  return linear_streams(m, in, o, bo, bi, w_dtype, x_dtype, device) ? 1 : 0;
}

int strata_gpu_linear_skinny(const void* x, int x_dtype, int64_t m, int64_t in, const void* w,
                             int w_dtype, const float* scale, int64_t bo, int64_t bi, int64_t o,
                             void* out, int device, uintptr_t stream) {
  int rc = gpu_use_device(device);
  if (rc) return rc;
  if (m == 0 || o == 0) return 0;
  if (scale && aligned16(x) && aligned16(w) && aligned16(out) &&
      linear_streams(m, in, o, bo, bi, w_dtype, x_dtype, device))
    return launch_linear_stream(x, w, scale, out, m, in, o, bo, bi, device,
                                (g_moe_options & STRATA_MOE_PDL) != 0, (cudaStream_t)stream);
  const bool pdl = (g_moe_options & STRATA_LINEAR_PDL) &&
                   (w_dtype != STRATA_DTYPE_BF16 || m <= g_linear_pdl_rows) &&
                   gpu_device_has_pdl(device);
  if (w_dtype == STRATA_DTYPE_BF16 && x_dtype == STRATA_DTYPE_BF16 &&
      (g_moe_options & STRATA_LINEAR_MMA) && aligned16(x) && aligned16(w) &&
      linear_bf16_mma_takes(m, in, o, device))
    return launch_linear_bf16_mma(x, w, out, m, in, o, pdl, (cudaStream_t)stream);
  if (m > 32) return invalid("linear (the skinny kernel takes at most 32 rows)");
  if (w_dtype != STRATA_DTYPE_FP8 && w_dtype != STRATA_DTYPE_BF16)
    return invalid("linear (weights must be float8_e4m3fn or bfloat16)");
  if (in % 16 || !aligned16(x) || !aligned16(w))
    return invalid("linear (in_features must be a multiple of 16, x and W 16-byte aligned)");
  const bool fp8 = w_dtype == STRATA_DTYPE_FP8;
  if (fp8 && (!scale || bo < 1 || bi < 16 || bi % 16))
    return invalid("linear (FP8 weights need scales and a block (bo, bi) with bi % 16 == 0)");
  int sms = 132;
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) {
#if STRATA_PLATFORM_HIP
    (void)hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, dev);
#else
    (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
#endif
  }
  LinParams p;
  p.x = x;
  p.w = w;
  p.scale = scale;
  p.out = out;
  p.m = (int)m;
  p.in = (int)in;
  p.o = (int)o;
  p.bo = fp8 ? (int)bo : 1;
  p.bi = fp8 ? (int)bi : 1;
  p.ncb = (int)((in + p.bi - 1) / p.bi);
  p.x_dtype = x_dtype;
  cudaStream_t st = (cudaStream_t)stream;
  if (fp8) return launch_linear<FP8W>(p, 2 * sms, st, pdl);
  return launch_linear<BF16>(p, 2 * sms, st, pdl);
}

}  // extern "C"
