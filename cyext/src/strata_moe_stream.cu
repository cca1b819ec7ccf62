// strata cyext: routed experts (moe_experts) with weights streamed through shared memory by the
// bulk copy engine (sm_90+). Same contract and the same bits as strata_moe.cu's per-block
// kernels (the same dot products in the same order); only how the weight bytes reach the SMs
// differs, so strata_moe.cu may pick either per call.
//
// Why: the per-block kernels hold each weight row in registers, so the bytes an SM has in flight
// are bounded by its registers and occupancy, and every short-lived block pays the ids /
// duplicate-check prologue; FP8 (half the bytes per block) reached only 29-40% of the copy
// ceiling that way. Here one CTA per SM keeps a ring of shared-memory stages filled by
// `cp.async.bulk` (one producer thread; completion on an mbarrier per stage), so an SM has
// ~150 KiB of weights in flight with no registers held, and the prologue is paid once per SM.
// Every copy is 8 KiB: a bulk copy costs mostly per copy (scripts/probe_bulk.cu on an H200:
// 4 KiB copies streamed 2.1 TB/s, 8 KiB 4.1 TB/s). Each consumer warp owns one or two stages
// and the items that land in them, so every stage is drained in order by one warp (mbarrier
// phases are told apart by parity only).
//
//   moe_gate_up_stream  grid = the SMs. Every CTA groups the window's pairs by expert in shared
//       memory (an expert's leader is its first pair; experts in leader order) and stages x
//       (float32 up to 32 KiB, else bfloat16; laid out so a warp's 16-byte reads hit distinct
//       banks). Items are (distinct expert, tile of F features): the F gate rows and the F up
//       rows, two 8 KiB copies into one stage, dealt to the CTAs round-robin. The warp that owns
//       an item loads its block scales while the stage lands, then computes act[q][i] =
//       silu(gate_i . x_n) * (up_i . x_n) for its F features and every member q = (n, j).
//   moe_down_stream     grid = H / T. CTA = T output features of every row. It streams the T
//       down rows of each item (one 8 KiB copy each, issued before it waits for the gate/up
//       grid: a programmatic dependent launch), computes y[q][h] for the item's members into
//       shared memory and ends with out[n][h] = sum_j w[n,j] * y[(n,j)][h] in j order. From 3
//       rows an item is a run of at most 2-4 of a distinct expert's members (down_items), below
//       it a whole distinct expert. In a prompt chunk's launches (STRATA_MOE_DOWN_MMA) an item
//       is a run of up to 16 members, one tensor-core pass (down_mma_pass).
// The weight copies carry an L2 evict-first hint: each weight is read once per call, and the
// activations written by gate/up and read by down should stay in L2.
// Not used with the expert cache (its misses are read over the bus through mapped host memory,
// which the per-block kernels do), on HIP, or before sm_90: strata_moe.cu keeps those paths.

#include "strata_bulk.cuh"
#include "strata_moe_common.cuh"
#include "strata_mma.cuh"

namespace strata {
namespace moe {

#if !STRATA_PLATFORM_HIP

namespace {

constexpr int ST_MAX_WARPS = 16;                     // consumer warps at most
constexpr int ST_THREADS = 32 * (ST_MAX_WARPS + 1);  // + the producer warp
constexpr int ST_MAX_STAGES = 2 * ST_MAX_WARPS;
// A bulk copy's cost is mostly per copy: measured on an H200 (scripts/probe_bulk.cu), rings of
// 4 KiB copies streamed 2.1 TB/s, 8 KiB copies 4.1 TB/s, 16 KiB 4.45 TB/s. So every copy here
// is 8 KiB: a gate/up stage is F gate rows + F up rows (two copies), a down stage T rows.
constexpr int ST_COPY_BYTES = 8192;
constexpr int ST_GU_STAGE = 2 * ST_COPY_BYTES;
constexpr int ST_DOWN_STAGE = ST_COPY_BYTES;
constexpr int ST_MAX_EXPERTS = 4096;                 // the first-pair table in shared memory
constexpr int ST_X_F32_MAX_BYTES = 32768;            // x staged as float32 up to this size
constexpr int ST_X_MAX_BYTES = 131072;               // else as bfloat16 words up to this
// Wide launches (STRATA_MOE_X_GLOBAL: FP8 on tensor cores, 17-512 rows): x staged in global
// memory by moe_stage_x, up to this many pairs, up to ST_PER_THREAD per thread in the block
// scans (pairs and distinct experts alike), ST_BIG_PER_THREAD in a big launch (more than
// MOE_WIDE_SMEM_PAIRS pairs: its own kernel instances, so that the others keep their registers).
constexpr int ST_WIDE_MAX_ROWS = MOE_WIDE_MAX_ROWS;
constexpr int ST_WIDE_MAX_PAIRS = MOE_WIDE_MAX_PAIRS;
constexpr int ST_PER_THREAD = 3;
constexpr int ST_BIG_PER_THREAD = 11;
// Launches of more rows than this take one ring stage per down warp.
constexpr int ST_DOWN_ONE_STAGE_ROWS = 32;
// Members per gate/up run (STRATA_MOE_GU_RUNS): one MMA pass of 16 A rows.
constexpr int ST_GU_RUN = 16;
static_assert(MOE_WIDE_SMEM_PAIRS <= ST_PER_THREAD * ST_THREADS, "pairs per thread in the scans");
static_assert(ST_WIDE_MAX_PAIRS <= ST_BIG_PER_THREAD * ST_THREADS, "pairs per thread, big");
static_assert(ST_WIDE_MAX_PAIRS < 65536, "down_items packs members and items in 16 bits each");
// Launches of up to 64 rows (1,024 pairs) keep the shared-memory layout they were measured with.
constexpr int ST_WIDE_64_PAIRS = 1024;

// Shared memory: barriers, ids, leaders, scan scratch, first-pair table, then x (gate/up) or
// y (down), then the stages. The ids hold sp.pair_cap pairs (MOE_MAX_PAIRS, 1,024 in a wide
// launch of up to 64 rows, else the launch's pairs rounded up to 32), so launches of up to 32
// rows keep their layout; the leaders sp.lead_cap (pair_cap, or in a big launch the most
// distinct experts it can have: at most E).
constexpr int ST_OFF_IDS = 2 * ST_MAX_STAGES * 8;

inline int align128(int v) { return (v + 127) & ~127; }

struct StreamPlan {
  int warps;           // consumer warps; warp w owns stages w, w + warps, ... (in order)
  int stages;          // warps * stages per warp
  int tiles;           // gate/up: I / F
  int data_off;        // x (gate/up) or y (down) in shared memory
  int ring_off;        // the stages
  int stage_bytes;     // gate/up: bytes per stage (2 F rows)
  int x_stride;        // gate/up on tensor cores: bytes per f16 x row in shared memory
  int scale_off;       // gate/up on tensor cores: each x row's 2^s_n (floats) in shared memory
  int items_off;       // down: the item tables (down_items) in shared memory
  int group;           // down: members per item at most; gate/up: nonzero = member tables
  int pair_cap;        // pairs the ids hold (the shared-memory layout)
  int x_global;        // gate/up on tensor cores: x and its row scales staged in global memory
  int lead_cap;        // leaders the leader table holds (pair_cap but in big launches)
  int item_cap;        // entries of each item table but memb (P but in big launches: down_items)
  int y_off;           // fused: the down results (P x T floats) in shared memory
};

__host__ __device__ inline int st_off_lead(const StreamPlan& sp) {
  return ST_OFF_IDS + 4 * sp.pair_cap;
}
// (BIG: a big launch's leader table of sp.lead_cap; the others keep the code they were measured
// with, pair_cap leaders)
template <bool BIG = false>
__host__ __device__ inline int st_off_wtot(const StreamPlan& sp) {
  return st_off_lead(sp) + 4 * (BIG ? sp.lead_cap : sp.pair_cap);
}
template <bool BIG = false>
__host__ __device__ inline int st_off_first(const StreamPlan& sp) {
  return st_off_wtot<BIG>(sp) + 128;
}

// Features per gate/up item: F rows of CPL chunks per lane fill one 8 KiB copy.
__host__ __device__ constexpr int gate_up_features(int cpl) { return 16 / cpl > 8 ? 8 : 16 / cpl; }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
using namespace strata::bulk;

// Items per thread when a block's threads take `count` of them in consecutive runs (1 up to
// ST_THREADS, then 2, then 3: wide launches of more than 1,088 pairs; up to 11 in big ones).
__device__ __forceinline__ int per_thread(int count) {
  const int per = (count + ST_THREADS - 1) / ST_THREADS;
  return per > 1 ? per : 1;
}

// The window's pairs grouped by expert, in shared memory: ids_s[q] (clamped), lead_s[d] = the
// first pair of the d-th distinct expert (leaders in pair order). Returns the distinct count.
// A thread takes pairs q0 = per * tid .. + per - 1 (per_thread: up to PT): consecutive, so the
// scan keeps the leaders in pair order.
template <int PT>
__device__ __forceinline__ int group_pairs(const MoeParams& p, int* ids_s, int* first_s,
                                           int* lead_s, int* warp_tot) {
  const int per = per_thread(p.P), q0 = per * (int)threadIdx.x;
#pragma unroll
  for (int j = 0; j < PT; ++j)
    if (j < per && q0 + j < p.P) ids_s[q0 + j] = clamp_expert(p.topk_ids[q0 + j], p.E);
  for (int e = threadIdx.x; e < p.E; e += ST_THREADS) first_s[e] = 0x7fffffff;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < PT; ++j)
    if (j < per && q0 + j < p.P) atomicMin(first_s + ids_s[q0 + j], q0 + j);
  __syncthreads();
  int lead[PT], leads = 0;
#pragma unroll
  for (int j = 0; j < PT; ++j) {
    lead[j] = (j < per && q0 + j < p.P && first_s[ids_s[q0 + j]] == q0 + j) ? 1 : 0;
    leads += lead[j];
  }
  int distinct;
  int pos = block_exclusive_scan<ST_THREADS>(leads, warp_tot, &distinct);
#pragma unroll
  for (int j = 0; j < PT; ++j)
    if (lead[j]) lead_s[pos++] = q0 + j;
  __syncthreads();
  return distinct;
}

// How every CTA of both kernels starts: its stages' barriers initialised (one arrival per
// phase: the producer's, with the bytes it expects, on "full"; the owning warp's release on
// "empty") and the window's pairs grouped (group_pairs). Returns the distinct experts.
template <bool BIG = false>
__device__ __forceinline__ int stream_start(uint8_t* smem, const MoeParams& p,
                                            const StreamPlan& sp) {
  uint64_t* full = (uint64_t*)smem;
  if (threadIdx.x == 0) {
    for (int s = 0; s < sp.stages; ++s) {
      mbar_init(full + s, 1);
      mbar_init(full + ST_MAX_STAGES + s, 1);
    }
    mbar_init_fence();
  }
  return group_pairs<BIG ? ST_BIG_PER_THREAD : ST_PER_THREAD>(
      p, (int*)(smem + ST_OFF_IDS), (int*)(smem + st_off_first<BIG>(sp)),
      (int*)(smem + st_off_lead(sp)), (int*)(smem + st_off_wtot<BIG>(sp)));
}

// The members of the expert led by pair s0 (pairs q >= s0 with its id, in pair order), a warp
// at a time: fn(q) for each, the same q on every lane.
template <typename Fn>
__device__ __forceinline__ void for_members(const int* ids_s, int P, int s0, int lane, Fn fn) {
  const int e = ids_s[s0];
  for (int base = s0 & ~31; base < P; base += 32) {
    const int q = base + lane;
    unsigned m = __ballot_sync(0xffffffffu, q >= s0 && q < P && ids_s[q] == e);
    while (m) {
      fn(base + __ffs(m) - 1);
      m &= m - 1;
    }
  }
}

// The down kernel's items: each distinct expert's members in runs of at most sp.group, one item
// per run (its own stage: the expert's rows copied again, from L2, for each run after the
// first), an expert's runs together, experts in leader order. Why: a warp takes an item's
// members one after another while its stage holds the ring, so an expert of many members (the
// folded shared expert has every row) was one warp's long chain at 16 rows. A member's sums do
// not depend on which item holds it, so the bits are those of one item per expert. Tables at
// sp.items_off, P ints each: memb (the pairs, item by item; within an expert in arrival
// order, or in pair order: ORDERED), span (an item's members: memb[lo, hi), lo | hi << 16), eid
// (its expert), cnt (scratch); memb holds P ints, the others P too (BIG: sp.item_cap, the most
// items a big launch can have). Overwrites the first-pair table with each expert's distinct
// index (ORDERED: then with its member count). Returns the item count. ORDERED: within an
// expert its members in pair order (each ranked among the expert's members after the atomics
// placed them), where the atomics' order differs from CTA to CTA: the member-run kernels deal
// one expert's runs to several CTAs, so every CTA must cut the expert into the same runs (else
// a member is in no run of one CTA's share of the tiles).
template <bool BIG = false, bool ORDERED = false>
__device__ __forceinline__ int down_items(uint8_t* smem, const MoeParams& p, const StreamPlan& sp,
                                          int distinct) {
  constexpr int PT = BIG ? ST_BIG_PER_THREAD : ST_PER_THREAD;
  const int* ids_s = (const int*)(smem + ST_OFF_IDS);
  const int* lead_s = (const int*)(smem + st_off_lead(sp));
  int* index_s = (int*)(smem + st_off_first<BIG>(sp));
  int* memb = (int*)(smem + sp.items_off);
  int* span = memb + p.P;
  int* eid = span + (BIG ? sp.item_cap : p.P);
  int* cnt = eid + (BIG ? sp.item_cap : p.P);
  const int G = sp.group;
  // pairs and distinct experts, up to PT per thread each, consecutive (as group_pairs)
  const int per = per_thread(p.P), q0 = per * (int)threadIdx.x;
  const int dper = per_thread(distinct), d0 = dper * (int)threadIdx.x;
#pragma unroll
  for (int j = 0; j < PT; ++j)
    if (j < dper && d0 + j < distinct) {
      index_s[ids_s[lead_s[d0 + j]]] = d0 + j;
      cnt[d0 + j] = 0;
    }
  __syncthreads();
  int d[PT], ord[PT];
#pragma unroll
  for (int j = 0; j < PT; ++j) {
    d[j] = ord[j] = 0;
    if (j < per && q0 + j < p.P) {
      d[j] = index_s[ids_s[q0 + j]];
      ord[j] = atomicAdd(cnt + d[j], 1);
    }
  }
  __syncthreads();
  int c[PT], runs[PT], mine = 0;
#pragma unroll
  for (int j = 0; j < PT; ++j) {
    c[j] = runs[j] = 0;
    if (j < dper && d0 + j < distinct) {
      c[j] = cnt[d0 + j];
      runs[j] = (c[j] + G - 1) / G;
    }
    mine += c[j] | (runs[j] << 16);  // (members and items stay below 2^16: ST_WIDE_MAX_PAIRS)
  }
  int total;
  const int start =
      block_exclusive_scan<ST_THREADS>(mine, (int*)(smem + st_off_wtot<BIG>(sp)), &total);
  int m0 = start & 0xffff, i0 = start >> 16;
#pragma unroll
  for (int j = 0; j < PT; ++j) {
    if (j >= dper) break;
    if (d0 + j < distinct) {
      const int e = ids_s[lead_s[d0 + j]];
      cnt[d0 + j] = m0;
      for (int r = 0; r < runs[j]; ++r) {
        const int lo = m0 + r * G, hi = lo + G < m0 + c[j] ? lo + G : m0 + c[j];
        span[i0 + r] = lo | (hi << 16);
        eid[i0 + r] = e;
      }
    }
    m0 += c[j];
    i0 += runs[j];
  }
  if (ORDERED) {  // the member counts into the first-pair table (dead once d[] holds the indices)
#pragma unroll
    for (int j = 0; j < PT; ++j)
      if (j < dper && d0 + j < distinct) index_s[d0 + j] = c[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < PT; ++j)
    if (j < per && q0 + j < p.P) memb[cnt[d[j]] + ord[j]] = q0 + j;
  __syncthreads();
  if (ORDERED) {
    // each pair's rank among its expert's members: how many of them come before it
#pragma unroll
    for (int j = 0; j < PT; ++j) {
      if (j < per && q0 + j < p.P) {
        const int lo = cnt[d[j]], hi = lo + index_s[d[j]];
        int rank = 0;
#pragma unroll 8
        for (int i = lo; i < hi; ++i) rank += memb[i] < q0 + j;  // (8 loads in flight)
        ord[j] = rank;
      }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < PT; ++j)
      if (j < per && q0 + j < p.P) memb[cnt[d[j]] + ord[j]] = q0 + j;
    __syncthreads();
  }
  return total >> 16;
}

// The first pair after q of expert e (-1 if none), the same on every lane.
__device__ __forceinline__ int next_member(const int* ids_s, int P, int q, int e, int lane) {
  for (int base = (q + 1) & ~31; base < P; base += 32) {
    const int r = base + lane;
    const unsigned m = __ballot_sync(0xffffffffu, r > q && r < P && ids_s[r] == e);
    if (m) return base + __ffs(m) - 1;
  }
  return -1;
}

// x in shared memory, by 16-byte pieces: piece pc of weight chunk c of row n sits at piece
// index n * pieces_per_row + pc * nch + c, so one piece index of consecutive chunks (what a
// warp reads at once, lane l taking chunk l + 32 j) is contiguous: no bank conflicts.
__device__ __forceinline__ int x_piece(int n, int c, int pc, int pieces_per_row, int nch) {
  return n * pieces_per_row + pc * nch + c;
}

// How both gate/up kernels start: stream_start, then the expert cache's counting, once per
// distinct expert (by the first CTA). Returns the distinct experts. Launched as a programmatic
// dependent of the router (STRATA_MOE_GU_PDL), a CTA may start before the ids exist: it waits
// for the router's grid before reading anything, and lets the down kernel (which reads the ids
// without waiting) launch only after that. In a plain launch the wait returns at once.
template <bool BIG = false>
__device__ __forceinline__ int gate_up_start(uint8_t* smem, const MoeParams& p,
                                             const StreamPlan& sp) {
  pdl_wait_primary();
  pdl_launch_dependents();
  const int distinct = stream_start<BIG>(smem, p, sp);
  if (p.routed_counts && blockIdx.x == 0) {
    const int* ids_s = (const int*)(smem + ST_OFF_IDS);
    const int* lead_s = (const int*)(smem + st_off_lead(sp));
    for (int d = threadIdx.x; d < distinct; d += ST_THREADS) {
      const int s0 = lead_s[d], e = ids_s[s0];
      int members = 0;
      for (int q = s0; q < p.P; ++q) members += ids_s[q] == e;
      count_expert(p, e, members);
    }
  }
  return distinct;
}

// This CTA's gate/up items. Items are dealt round-robin (CTA b: items b, b + grid, ...): an
// expert with many members (the folded shared expert has every row) costs more per item, and
// dealing its tiles to consecutive CTAs would leave a few CTAs with all of it.
__device__ __forceinline__ int gate_up_items(int distinct, const StreamPlan& sp) {
  const int total = distinct * sp.tiles;
  return total > (int)blockIdx.x ? (total - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
}

// The gate/up producer (one thread): item li = (distinct expert, tile of F features) into stage
// li % stages, its F gate rows then its F up rows, two copies, once the stage's owner has
// released the round before.
__device__ __forceinline__ void gate_up_produce(const MoeParams& p, const StreamPlan& sp,
                                                uint8_t* ring, uint64_t* full, const int* ids_s,
                                                const int* lead_s, int n_local, int F,
                                                int row_bytes) {
  uint64_t* empty = full + ST_MAX_STAGES;
  const uint64_t pol = l2_evict_first();
  const uint32_t half = (uint32_t)(F * row_bytes);
  const int S = sp.stages;
  for (int li = 0; li < n_local; ++li) {
    const int stage = li % S, round = li / S;
    if (round) mbar_wait(empty + stage, (round - 1) & 1);
    const int item = blockIdx.x + li * gridDim.x, d = item / sp.tiles, i0 = (item % sp.tiles) * F;
    const uint8_t* base = expert_gate_up(p, ids_s[lead_s[d]]);
    uint8_t* dst = ring + stage * sp.stage_bytes;
    mbar_expect_tx(full + stage, 2 * half);
    bulk::load(dst, base + (int64_t)i0 * row_bytes, half, full + stage, pol);
    bulk::load(dst + half, base + (int64_t)(p.I + i0) * row_bytes, half, full + stage, pol);
  }
}

// The members of a tensor-core item, 32 at a time: lane j gets member w0 + j in *my_q (-1 past
// the last); returns the item's member count M. With tables (`span_word`, down_items) they are
// memb[lo, hi); without, the pairs of expert e from its leader s0, in pair order, by ballots
// (more than 32 only where a row repeats an id).
__device__ __forceinline__ int item_members(bool tables, const int* memb, int span_word,
                                            const int* ids_s, int P, int s0, int e, int w0,
                                            int lane, int* my_q) {
  *my_q = -1;
  if (tables) {
    const int lo = span_word & 0xffff, M = (span_word >> 16) - lo;
    if (w0 + lane < M) *my_q = memb[lo + w0 + lane];
    return M;
  }
  int M = 0;
  for (int base = s0 & ~31; base < P; base += 32) {
    const int q = base + lane;
    const unsigned m = __ballot_sync(0xffffffffu, q >= s0 && q < P && ids_s[q] == e);
    const int c = __popc(m), j = w0 + lane - M;
    if (j >= 0 && j < c) *my_q = base + (int)__fns(m, 0, j + 1);
    M += c;
  }
  return M;
}

// One pass of moe_gate_up_mma over an item's 128-k blocks: acc (lane (g, t): A rows g, g + 8 at
// B columns 2t, 2t + 1) = sum over blocks kb in order of scale_kb * (chunk 0 + chunk 1), each
// chunk a chain of four MMAs from zero. wrow: the lane's weight row g at byte 16 t; xa / xb: the
// x rows of A's rows g and g + 8 at element 16 t (TWO: rows 8-15 are members; else A's rows
// 8-15 are given rows 0-7's registers and dropped). sg / su: lane l < ncb holds block l's gate
// and up scales. Blocks go four at a time (two with TWO) so that their loads and chains
// overlap.
template <bool TWO>
__device__ __forceinline__ void gate_up_mma_blocks(float (&acc)[4], const uint8_t* wrow,
                                                   const uint8_t* xa, const uint8_t* xb, int ncb,
                                                   float sg, float su, int t) {
#pragma unroll(TWO ? 2 : 4)
  for (int kb = 0; kb < ncb; ++kb) {
    float part[2][4];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int k0 = kb * 128 + c * 64;
      const uint4 wv = *(const uint4*)(wrow + k0);
      const uint4 a_lo = *(const uint4*)(xa + 2 * k0), a_hi = *(const uint4*)(xa + 2 * k0 + 16);
      uint4 b_lo = a_lo, b_hi = a_hi;
      if (TWO) {
        b_lo = *(const uint4*)(xb + 2 * k0);
        b_hi = *(const uint4*)(xb + 2 * k0 + 16);
      }
      const uint32_t wj[4] = {wv.x, wv.y, wv.z, wv.w};
      const uint32_t xa_w[8] = {a_lo.x, a_lo.y, a_lo.z, a_lo.w, a_hi.x, a_hi.y, a_hi.z, a_hi.w};
      const uint32_t xb_w[8] = {b_lo.x, b_lo.y, b_lo.z, b_lo.w, b_hi.x, b_hi.y, b_hi.z, b_hi.w};
      part[c][0] = part[c][1] = part[c][2] = part[c][3] = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t b0, b1;
        fp8x4_to_f16x4(wj[j], b0, b1);
        mma_m16n8k16<true>(part[c], xa_w[2 * j], xb_w[2 * j], xa_w[2 * j + 1], xb_w[2 * j + 1],
                           b0, b1);
      }
    }
    const float gs = __shfl_sync(0xffffffffu, sg, kb), us = __shfl_sync(0xffffffffu, su, kb);
    const float scale = t < 2 ? gs : us;
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = fmaf(scale, part[0][i] + part[1][i], acc[i]);
  }
}
// Row n of x as f16 scaled by a power of two (f16_row_scale), into xs (2H bytes), and the
// power that undoes it into *unscale, by one warp: the row's 16-byte pieces are held in
// registers (8 per lane up to H = 2048) for its largest magnitude, then converted.
__device__ __forceinline__ void stage_x_row_f16(const uint16_t* xr, uint8_t* xs, float* unscale,
                                                int H, int lane) {
  constexpr int XR = 8;
  uint4 v[XR];
  uint32_t mx = 0;
  for (int c0 = 0; c0 < H / 8; c0 += 32 * XR) {
#pragma unroll
    for (int r = 0; r < XR; ++r) {
      const int c = c0 + lane + 32 * r;
      v[r] = c < H / 8 ? ldg16(xr + 8 * c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int r = 0; r < XR; ++r) {
      const uint32_t wd[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) mx = max(mx, bf16x2_abs_max_bits(wd[i]));
    }
  }
  asm("redux.sync.max.u32 %0, %0, 0xffffffff;" : "+r"(mx));
  float sc, un;
  f16_row_scale(mx, sc, un);
  if (lane == 0) *unscale = un;
  for (int c0 = 0; c0 < H / 8; c0 += 32 * XR) {
    if (H / 8 > 32 * XR) {  // rows past 2048: read again (the registers hold the last part)
#pragma unroll
      for (int r = 0; r < XR; ++r) {
        const int c = c0 + lane + 32 * r;
        if (c < H / 8) v[r] = ldg16(xr + 8 * c);
      }
    }
#pragma unroll
    for (int r = 0; r < XR; ++r) {
      const int c = c0 + lane + 32 * r;
      if (c >= H / 8) break;
      *(uint4*)(xs + 16 * c) = bf16x8_scaled_to_f16x8(v[r], sc);
    }
  }
}
#endif  // __CUDA_ARCH__ >= 900

// CPL: 16-byte chunks per lane of a weight row (unrolled); XF32: x staged as float32, else as
// bfloat16 words.
template <typename W, int CPL, bool XF32>
__global__ void __launch_bounds__(ST_THREADS, 1)
    moe_gate_up_stream(MoeParams p, StreamPlan sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  typedef WChunk<W> C;
  constexpr int F = gate_up_features(CPL);
  constexpr int EPC = C::EPC;
  extern __shared__ __align__(128) uint8_t smem[];
  const int distinct = gate_up_start(smem, p, sp);
  uint64_t* full = (uint64_t*)smem;
  uint64_t* empty = full + ST_MAX_STAGES;
  const int* ids_s = (const int*)(smem + ST_OFF_IDS);
  const int* lead_s = (const int*)(smem + st_off_lead(sp));
  uint4* x_s = (uint4*)(smem + sp.data_off);
  uint8_t* ring = smem + sp.ring_off;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int n_local = gate_up_items(distinct, sp);
  const int row_bytes = p.H * (int)sizeof(typename W::storage);
  const int S = sp.stages;

  if (warp == ST_MAX_WARPS) {  // the producer: one thread issues every copy
    if (lane == 0) gate_up_produce(p, sp, ring, full, ids_s, lead_s, n_local, F, row_bytes);
    return;
  }
  if (warp >= sp.warps) return;

  const int nch = p.H / EPC;
  // x rows, once per CTA, while the first stages land (16-byte pieces; float32: each 16-bit
  // piece becomes two float pieces)
  {
    const int pieces = p.n * p.H / 8;
    const int ppr16 = p.H / 8;
    for (int t = tid; t < pieces; t += sp.warps * 32) {
      const int n = t / ppr16, e = (t % ppr16) * 8;
      const uint4 v = ldg16((const uint16_t*)p.x + 8 * t);
      const int c = e / EPC, k8 = (e % EPC) / 8;  // 8-element piece k8 of chunk c
      if (XF32) {
        float f[8];
        decode_chunk<BF16>(v, f);  // exact
        const int ppr = p.H / 4;
        x_s[x_piece(n, c, 2 * k8, ppr, nch)] = make_uint4(
            __float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
        x_s[x_piece(n, c, 2 * k8 + 1, ppr, nch)] = make_uint4(
            __float_as_uint(f[4]), __float_as_uint(f[5]), __float_as_uint(f[6]), __float_as_uint(f[7]));
      } else {
        x_s[x_piece(n, c, k8, ppr16, nch)] = v;
      }
    }
    sync_threads(sp.warps * 32);
  }
  const int ppr = XF32 ? p.H / 4 : p.H / 8;  // x pieces per row
  int col[CPL];
#pragma unroll
  for (int j = 0; j < CPL; ++j) col[j] = ((lane + 32 * j) * EPC) / p.bi;
  for (int li = warp; li < n_local; li += sp.warps) {
    const int stage = li % S;
    const int item = blockIdx.x + li * gridDim.x, d = item / sp.tiles, i0 = (item % sp.tiles) * F;
    const int s0 = lead_s[d], e = ids_s[s0];
    const uint8_t* rows = ring + stage * sp.stage_bytes;
    // the block scales of this lane's chunks (one gate and one up block row for the F
    // features), loaded while the stage lands
    float sg[CPL], su[CPL];
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      sg[j] = su[j] = 1.f;
      if (C::scaled && lane + 32 * j < nch) {
        const float* sc = expert_gate_up_scale(p, e);
        sg[j] = __ldg(sc + (i0 / p.bo) * p.ncb_h + col[j]);
        su[j] = __ldg(sc + (p.nbg + i0 / p.bo) * p.ncb_h + col[j]);
      }
    }
    mbar_wait(full + stage, (li / S) & 1);
    for_members(ids_s, p.P, s0, lane, [&](int q) {
      const int n = q / p.k;
      float acc[2 * F];
#pragma unroll
      for (int r = 0; r < 2 * F; ++r) acc[r] = 0.f;
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        const int c = lane + 32 * j;
        if (c < nch) {
          float xf[EPC];
#pragma unroll
          for (int pc = 0; pc < (XF32 ? EPC / 4 : EPC / 8); ++pc) {
            const uint4 v = x_s[x_piece(n, c, pc, ppr, nch)];
            if (XF32) {
              xf[4 * pc] = __uint_as_float(v.x); xf[4 * pc + 1] = __uint_as_float(v.y);
              xf[4 * pc + 2] = __uint_as_float(v.z); xf[4 * pc + 3] = __uint_as_float(v.w);
            } else {
              decode_chunk<BF16>(v, xf + 8 * pc);
            }
          }
#pragma unroll
          for (int r = 0; r < 2 * F; ++r)
            acc[r] = chunk_dot<W>(*(const uint4*)(rows + r * row_bytes + 16 * c), xf,
                                  r < F ? sg[j] : su[j], acc[r]);
        }
      }
      butterflies<2 * F>(acc);  // = warp_sum of each
#pragma unroll
      for (int f = 0; f < F; ++f) {
        const float g = acc[f], u = acc[F + f];
        if (lane == 0) p.act[(int64_t)q * p.I + i0 + f] = g / (1.f + expf(-g)) * u;
      }
    });
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + stage);
  }
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Block scales of tile i0 (4 features) of expert e for gate_up_mma_blocks: lane l < ncb holds
// block l's gate scale (sg) and up scale (su), the other lanes 0.
__device__ __forceinline__ void gate_up_block_scales(const MoeParams& p, int e, int i0, int lane,
                                                     int ncb, float& sg, float& su) {
  sg = su = 0.f;
  if (lane < ncb) {
    const float* sc = expert_gate_up_scale(p, e);
    sg = __ldg(sc + (i0 / p.bo) * p.ncb_h + lane);
    su = __ldg(sc + (p.nbg + i0 / p.bo) * p.ncb_h + lane);
  }
}
// A tensor-core gate/up pass's act: acc (lane (g, t): A rows g, g + 8 at weight rows 2t, 2t + 1)
// times the rows' 2^s_n (ua, ub); the up features (t >= 2) brought to lane t - 2 by one
// shuffle; act = silu(gate) * up stored for pair qa (row g, where a_ok) and qb (row g + 8).
__device__ __forceinline__ void gate_up_mma_store(const MoeParams& p, float (&acc)[4], float ua,
                                                  float ub, int qa, bool a_ok, int qb, bool b_ok,
                                                  int i0, int t) {
  acc[0] *= ua; acc[1] *= ua; acc[2] *= ub; acc[3] *= ub;
  float up[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) up[i] = __shfl_xor_sync(0xffffffffu, acc[i], 2);
  if (t < 2) {
    float a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = acc[i] / (1.f + expf(-acc[i])) * up[i];
    if (a_ok) *(float2*)(p.act + (int64_t)qa * p.I + i0 + 2 * t) = make_float2(a[0], a[1]);
    if (b_ok) *(float2*)(p.act + (int64_t)qb * p.I + i0 + 2 * t) = make_float2(a[2], a[3]);
  }
}

// Item li of this CTA's gate/up sequence on tensor cores (moe_gate_up_mma, below): waits for
// its stage, computes act for its 4 features and every member of its expert, and returns the
// expert's distinct index. WIDE: the members from the tables (down_items), else by ballots.
template <bool WIDE>
__device__ __forceinline__ int gate_up_mma_item(const MoeParams& p, const StreamPlan& sp, int li,
                                                const int* ids_s, const int* lead_s,
                                                const int* memb, const int* span,
                                                const uint8_t* x_s, const float* unscale_s,
                                                const uint8_t* ring, uint64_t* full) {
  constexpr int F = 4;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int H = p.H;  // bytes per FP8 weight row
  const int ncb = H / 128;
  const int S = sp.stages, stage = li % S;
  const int item = blockIdx.x + li * gridDim.x, d = item / sp.tiles, i0 = (item % sp.tiles) * F;
  const int s0 = lead_s[d], e = ids_s[s0];
  // block scales: lane l < ncb holds block l's, gate and up
  float sg, su;
  gate_up_block_scales(p, e, i0, lane, ncb, sg, su);
  mbar_wait(full + stage, (li / S) & 1);
  const uint8_t* wrow = ring + stage * sp.stage_bytes + g * H + 16 * t;
  // the expert's members, 32 at a time: lane j holds member w0 + j (a wide launch's tables
  // hold expert d's members; else ballots from its leader)
  for (int w0 = 0;; w0 += 32) {
    int my_q;
    const int M = item_members(WIDE, memb, WIDE ? span[d] : 0, ids_s, p.P, s0, e, w0, lane,
                               &my_q);
    const int Mw = M - w0 < 32 ? M - w0 : 32;
    for (int m0 = 0; m0 < Mw; m0 += 16) {
      // A's rows g and g + 8: members m0 + g and m0 + g + 8 (past the last: the first)
      const int ma = m0 + g < Mw ? m0 + g : m0, mb = m0 + g + 8 < Mw ? m0 + g + 8 : m0;
      const int qa = __shfl_sync(0xffffffffu, my_q, ma), qb = __shfl_sync(0xffffffffu, my_q, mb);
      const int na = qa / p.k, nb = qb / p.k;
      const uint8_t* xa = x_s + (int64_t)na * sp.x_stride + 32 * t;
      const uint8_t* xb = x_s + (int64_t)nb * sp.x_stride + 32 * t;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      if (Mw - m0 > 8)  // rows 8-15 are members (else they repeat rows 0-7)
        gate_up_mma_blocks<true>(acc, wrow, xa, xb, ncb, sg, su, t);
      else
        gate_up_mma_blocks<false>(acc, wrow, xa, xb, ncb, sg, su, t);
      gate_up_mma_store(p, acc, unscale_s[na], unscale_s[nb], qa, m0 + g < Mw, qb,
                        m0 + g + 8 < Mw, i0, t);
    }
    if (w0 + 32 >= M) break;
  }
  return d;
}
#endif  // __CUDA_ARCH__ >= 900

// The gate/up kernel on tensor cores (FP8 weights in 128 x 128-k blocks; STRATA_MOE_GU_MMA).
// The same ring and items as moe_gate_up_stream with F = 4: a stage is 4 gate rows and 4 up
// rows, the MMA's B (n = 8 weight rows); A is the x rows of the expert's members, 16 at a time
// (one pass for up to 16 members; where there are at most 8, A's rows 8-15 repeat rows 0-7 and
// their results are dropped); D = 16 members x 8 weight rows. So a weight element costs about
// half an instruction (its decode to f16, one cvt per pair) whatever the members, where the
// CUDA-core kernel pays a decode and an FMA per element and member.
// x is staged once per CTA as f16, each row scaled by a power of two 2^-s_n so that its largest
// magnitude lies in [2^14, 2^15) (exact for every element within 2^28 of the row's largest), and
// rows 16 bytes apart beyond 2H so that lanes reading rows an odd number apart hit distinct banks.
// k order: within each 64-k chunk, MMA step j gives lane t (of 4 in a group) the k's
// 16 t + 4 j .. + 3, so a lane reads 16 consecutive weight bytes and 32 x bytes per chunk; A and
// B use the same order, so the sums are those of k in order up to the MMA's own. Per 128-k block
// the two chunks' chains of four MMAs start from zero, are added, and acc = fma(scale, sum,
// acc) over the blocks in order; then acc * 2^s_n. Lane (g, t) holds members g and g + 8 at
// weight rows 2t, 2t + 1: gate features 2t, 2t + 1 for t < 2, the same up features for t >= 2,
// brought to lane t - 2 by one shuffle. A member's act is the same bits whatever other members
// or rows share the launch (each MMA output depends only on its own row of A and column of B).
// WIDE: a wide launch (sp.x_global, member tables); its own instance, so that the windows' kernel
// keeps its registers (the tables and the second x source cost it spills). BIG: a wide launch of
// more than MOE_WIDE_SMEM_PAIRS pairs (more pairs per thread in the scans).
template <bool WIDE, bool BIG = false>
__global__ void __launch_bounds__(ST_THREADS, 1) moe_gate_up_mma(MoeParams p, StreamPlan sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int F = 4;
  extern __shared__ __align__(128) uint8_t smem[];
  const int distinct = gate_up_start<BIG>(smem, p, sp);
  // member tables (down_items, one item per expert: sp.group >= the rows), so that an item
  // finds its members without a ballot over every pair (wide launches: up to 5,984 pairs)
  if (WIDE) down_items<BIG>(smem, p, sp, distinct);
  const int* memb = (const int*)(smem + sp.items_off);
  const int* span = memb + p.P;
  uint64_t* full = (uint64_t*)smem;
  uint64_t* empty = full + ST_MAX_STAGES;
  const int* ids_s = (const int*)(smem + ST_OFF_IDS);
  const int* lead_s = (const int*)(smem + st_off_lead(sp));
  uint8_t* x_s = WIDE ? p.x_stage : smem + sp.data_off;
  float* unscale_s = WIDE ? p.x_unscale : (float*)(smem + sp.scale_off);  // 2^s_n per row
  uint8_t* ring = smem + sp.ring_off;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int n_local = gate_up_items(distinct, sp);
  const int H = p.H;  // bytes per FP8 weight row
  const int S = sp.stages;

  if (warp == ST_MAX_WARPS) {
    if (lane == 0) gate_up_produce(p, sp, ring, full, ids_s, lead_s, n_local, F, H);
    return;
  }
  if (warp >= sp.warps) return;

  // x as scaled f16, one warp per row, while the first stages land (a wide launch reads the
  // rows moe_stage_x staged in global memory instead)
  if (!WIDE)
    for (int n = warp; n < p.n; n += sp.warps)
      stage_x_row_f16((const uint16_t*)p.x + (int64_t)n * H, x_s + (int64_t)n * sp.x_stride,
                      unscale_s + n, H, lane);
  sync_threads(sp.warps * 32);

  for (int li = warp; li < n_local; li += sp.warps) {
    gate_up_mma_item<WIDE>(p, sp, li, ids_s, lead_s, memb, span, x_s, unscale_s, ring, full);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + li % S);
  }
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The member-run kernels' common steps (moe_gate_up_runs, moe_down_runs). This CTA's contiguous
// range [*lo, *lo + returned) of `total` run-major items, the grid's CTAs taking equal shares.
__device__ __forceinline__ int runs_range(int total, int* lo) {
  *lo = (int)((int64_t)total * blockIdx.x / gridDim.x);
  return (int)((int64_t)total * (blockIdx.x + 1) / gridDim.x) - *lo;
}
// Brings the staged run up to run r: for each run boundary, every consumer warp (`threads`
// threads at named barrier 1) done with the staged run, stage(next run), all of it staged.
// Every consumer warp makes the same transitions, so none waits at a barrier another skips.
template <typename Stage>
__device__ __forceinline__ void runs_advance(int& staged, int r, int threads, Stage stage) {
  while (staged < r) {
    sync_threads(threads);
    stage(++staged);
    sync_threads(threads);
  }
}

// The run-major gate/up of a wide launch (STRATA_MOE_GU_RUNS, moe_gate_up_runs below): the
// producer's side. Item lo + li is (member run r, tile): the run's expert from the item tables
// (eid), its 4 gate and 4 up rows into stage li % S, as gate_up_produce.
__device__ __forceinline__ void gate_up_runs_produce(const MoeParams& p, const StreamPlan& sp,
                                                     uint8_t* ring, uint64_t* full,
                                                     const int* eid, int lo, int n_local) {
  constexpr int F = 4;
  uint64_t* empty = full + ST_MAX_STAGES;
  const uint64_t pol = l2_evict_first();
  const uint32_t half = (uint32_t)(F * p.H);
  const int S = sp.stages;
  for (int li = 0; li < n_local; ++li) {
    const int stage = li % S, round = li / S;
    if (round) mbar_wait(empty + stage, (round - 1) & 1);
    const int item = lo + li, r = item / sp.tiles, i0 = (item % sp.tiles) * F;
    const uint8_t* base = expert_gate_up(p, eid[r]);
    uint8_t* dst = ring + stage * sp.stage_bytes;
    mbar_expect_tx(full + stage, 2 * half);
    bulk::load(dst, base + (int64_t)i0 * p.H, half, full + stage, pol);
    bulk::load(dst + half, base + (int64_t)(p.I + i0) * p.H, half, full + stage, pol);
  }
}

// Member run r's x rows (at most 16, staged in global memory by moe_stage_x) into shared memory,
// row m at xr + m * x_stride, and their unscales, by the consumer warps (one row a warp).
__device__ __forceinline__ void gate_up_runs_stage(const MoeParams& p, const StreamPlan& sp,
                                                   const int* memb, int span_word, uint8_t* xr,
                                                   float* un, int warp, int lane) {
  const int lo = span_word & 0xffff, M = (span_word >> 16) - lo;
  for (int m = warp; m < M; m += sp.warps) {
    const int n = memb[lo + m] / p.k;
    const uint4* src = (const uint4*)(p.x_stage + (int64_t)n * sp.x_stride);
    uint4* dst = (uint4*)(xr + (int64_t)m * sp.x_stride);
    for (int c = lane; c < p.H / 8; c += 32) dst[c] = src[c];  // 2H bytes, 16 a piece
    if (lane == 0) un[m] = p.x_unscale[n];
  }
}

#endif  // __CUDA_ARCH__ >= 900

// The wide launch's gate/up items with their members' x in shared memory (STRATA_MOE_GU_RUNS).
// In moe_gate_up_mma<true> an item is (expert, tile) with all the expert's members, dealt to the
// CTAs round-robin, and each item's MMA passes read their members' f16 x rows from L2 as the A
// fragments: at 512 rows (about 11 members an expert) four times the item's weight bytes, and
// Nsight Compute found the warps waiting on those loads (docs/KERNELS.md). Here an item is
// (member run of at most 16, tile), the runs from down_items (sp.group = 16; the folded shared
// expert's members in many runs, each an item of its own as in the down kernel), and each CTA
// takes a contiguous range of the run-major items, so its consecutive items are tiles of one
// run: the run's x rows are staged once in shared memory and every warp's passes read them
// there. At each run boundary in its range the CTA's consumer warps meet at a barrier, stage
// the next run's rows and meet again (every warp makes the same transitions, items or not).
// The MMAs are moe_gate_up_mma's on the same operands (each output row depends on its own A
// row only, so the grouping of members into passes does not matter): the same bits.
template <bool BIG>
__global__ void __launch_bounds__(ST_THREADS, 1) moe_gate_up_runs(MoeParams p, StreamPlan sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int F = 4;
  extern __shared__ __align__(128) uint8_t smem[];
  const int distinct = gate_up_start<BIG>(smem, p, sp);
  const int runs = down_items<BIG, true>(smem, p, sp, distinct);
  const int* memb = (const int*)(smem + sp.items_off);
  const int* span = memb + p.P;
  const int* eid = span + (BIG ? sp.item_cap : p.P);
  uint64_t* full = (uint64_t*)smem;
  uint64_t* empty = full + ST_MAX_STAGES;
  uint8_t* xr = smem + sp.data_off;
  float* un = (float*)(smem + sp.scale_off);
  uint8_t* ring = smem + sp.ring_off;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int lo;
  const int n_local = runs_range(runs * sp.tiles, &lo);
  if (warp == ST_MAX_WARPS) {
    if (lane == 0) gate_up_runs_produce(p, sp, ring, full, eid, lo, n_local);
    return;
  }
  if (warp >= sp.warps || n_local == 0) return;
  const int g = lane >> 2, t = lane & 3;
  const int H = p.H, ncb = H / 128, S = sp.stages;
  const int r_last = (lo + n_local - 1) / sp.tiles;
  auto stage_run = [&](int r) { gate_up_runs_stage(p, sp, memb, span[r], xr, un, warp, lane); };
  int staged = lo / sp.tiles;
  stage_run(staged);
  sync_threads(sp.warps * 32);
  for (int li = warp;; li += sp.warps) {
    const int item = lo + li, r = li < n_local ? item / sp.tiles : r_last;
    runs_advance(staged, r, sp.warps * 32, stage_run);
    if (li >= n_local) break;
    const int e = eid[r], i0 = (item % sp.tiles) * F, stage = li % S;
    const int M = (span[r] >> 16) - (span[r] & 0xffff);
    float sg, su;
    gate_up_block_scales(p, e, i0, lane, ncb, sg, su);
    // A's rows g and g + 8: members g and g + 8 (past the last: the first)
    const int ma = g < M ? g : 0, mb = g + 8 < M ? g + 8 : 0;
    const uint8_t* xa = xr + ma * sp.x_stride + 32 * t;
    const uint8_t* xb = xr + mb * sp.x_stride + 32 * t;
    mbar_wait(full + stage, (li / S) & 1);
    const uint8_t* wrow = ring + stage * sp.stage_bytes + g * H + 16 * t;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (M > 8)
      gate_up_mma_blocks<true>(acc, wrow, xa, xb, ncb, sg, su, t);
    else
      gate_up_mma_blocks<false>(acc, wrow, xa, xb, ncb, sg, su, t);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + stage);
    const int mlo = span[r] & 0xffff;
    gate_up_mma_store(p, acc, un[ma], un[mb], memb[mlo + ma], g < M, memb[mlo + mb], g + 8 < M,
                      i0, t);
  }
#endif
}

// A wide launch's x (17-128 rows do not fit beside a ring in shared memory): every row staged
// once into global memory as the tensor-core gate/up reads it (stage_x_row_f16), one warp per
// row, before the gate/up grid, which then reads its A fragments from L2. The same f16 values
// and scales as a launch that stages x in shared memory: the same bits.
__global__ void __launch_bounds__(32) moe_stage_x(MoeParams p, int x_stride) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  pdl_wait_primary();  // x comes from the kernel before
  stage_x_row_f16((const uint16_t*)p.x + (int64_t)blockIdx.x * p.H,
                  p.x_stage + (int64_t)blockIdx.x * x_stride, p.x_unscale + blockIdx.x, p.H,
                  threadIdx.x);
  __threadfence();
  pdl_launch_dependents();
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The down kernel on tensor cores (STRATA_MOE_DOWN_MMA). Lane (g, t) reads act k0 + 16 t .. + 15
// of its member in each 64-k chunk k0 (the MMA's k order of gate_up_mma_blocks), so the four lanes
// of group g hold the whole chunk.
__device__ __forceinline__ void act_chunk_load(const float* arow, int k0, int t, float (&v)[16]) {
  const float4* src = (const float4*)(arow + k0 + 16 * t);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 a = __ldg(src + i);
    v[4 * i] = a.x; v[4 * i + 1] = a.y; v[4 * i + 2] = a.z; v[4 * i + 3] = a.w;
  }
}
// A chunk's sixteen values as eight f16x2 A words, scaled by the chunk's power of two 2^s (its
// largest magnitude over the four lanes, two shuffles, f16_row_scale); returns 2^-s, which
// undoes it on the chunk's sums. Why per chunk: act is float32, so its f16 needs a scale, and a
// chunk is what the four lanes hold at once (a whole row would be a second pass over it).
__device__ __forceinline__ float act_chunk_f16(const float (&v)[16], uint32_t (&w)[8]) {
  uint32_t mx = 0;
#pragma unroll
  for (int e = 0; e < 16; ++e) mx = max(mx, __float_as_uint(v[e]) & 0x7fffffffu);
  mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  float sc, un;
  f16_row_scale(mx, sc, un);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(v[2 * i + 1] * sc), "f"(v[2 * i] * sc));
  return un;
}

// Chunk c (k0 = 64 c) of a down MMA pass: the stage's two 8-row halves' chains of four MMAs
// from zero on the A words xa (rows g) and xb (rows g + 8; TWO false: xa again), then acc =
// fma(part, block scale x the rows' 2^-s (ua, ub), acc). sdn: lane l < ncb holds block l's scale.
template <bool TWO>
__device__ __forceinline__ void down_mma_chunk(float (&acc)[2][4], const uint8_t* wrow, int k0,
                                               int row_bytes, const uint32_t (&xa)[8],
                                               const uint32_t (&xb)[8], float ua, float ub,
                                               float sdn, int c) {
  const uint4 w0 = *(const uint4*)(wrow + k0), w1 = *(const uint4*)(wrow + 8 * row_bytes + k0);
  const uint32_t wj[2][4] = {{w0.x, w0.y, w0.z, w0.w}, {w1.x, w1.y, w1.z, w1.w}};
  float part[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    part[h][0] = part[h][1] = part[h][2] = part[h][3] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b0, b1;
      fp8x4_to_f16x4(wj[h][j], b0, b1);
      if (TWO)
        mma_m16n8k16<true>(part[h], xa[2 * j], xb[2 * j], xa[2 * j + 1], xb[2 * j + 1], b0, b1);
      else
        mma_m16n8k16<true>(part[h], xa[2 * j], xa[2 * j], xa[2 * j + 1], xa[2 * j + 1], b0, b1);
    }
  }
  const float s = __shfl_sync(0xffffffffu, sdn, c >> 1);  // 128-k scale blocks
  const float sa = s * ua, sb = s * ub;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    acc[h][0] = fmaf(part[h][0], sa, acc[h][0]);
    acc[h][1] = fmaf(part[h][1], sa, acc[h][1]);
    acc[h][2] = fmaf(part[h][2], sb, acc[h][2]);
    acc[h][3] = fmaf(part[h][3], sb, acc[h][3]);
  }
}

// A down MMA pass's block scales of expert e at output rows h0..: lane l < ncb holds block l's
// (of the I / bi blocks along k), the other lanes 0.
__device__ __forceinline__ float down_block_scale(const MoeParams& p, int e, int h0, int lane,
                                                  int ncb) {
  return lane < ncb ? __ldg(expert_down_scale(p, e) + (h0 / p.bo) * p.ncb_i + lane) : 0.f;
}
// A down MMA pass's results (T = 16 output rows a tile) into y_s: lane (g, t) holds members g
// and g + 8 at output rows 2t, 2t + 1 of each 8-row half; pair qa (row g, where a_ok) and qb.
__device__ __forceinline__ void down_mma_store(float* y_s, const float (&acc)[2][4], int qa,
                                               bool a_ok, int qb, bool b_ok, int t) {
  constexpr int T = 16;
  if (a_ok) {
    *(float2*)(y_s + qa * T + 2 * t) = make_float2(acc[0][0], acc[0][1]);
    *(float2*)(y_s + qa * T + 8 + 2 * t) = make_float2(acc[1][0], acc[1][1]);
  }
  if (b_ok) {
    *(float2*)(y_s + qb * T + 2 * t) = make_float2(acc[0][2], acc[0][3]);
    *(float2*)(y_s + qb * T + 8 + 2 * t) = make_float2(acc[1][2], acc[1][3]);
  }
}

// One pass of the down kernel on tensor cores over up to 16 members of an item: D (16 members x
// 16 output rows, as two m16n8 tiles: rows 0-7 and 8-15 of the stage) summed over the I / 64
// chunks in order, each chunk's chains of four MMAs from zero, then acc = fma(part, block scale
// x the member's 2^-s, acc). wrow: the stage's row g at byte 16 t; arow_a / arow_b: the act rows
// of A's rows g and g + 8 (TWO: rows 8-15 are members, else they repeat rows 0-7 and are
// dropped). sdn: lane l < ncb holds block l's scale. The act loads run a chunk ahead, the first
// before the wait for the stage (full, parity). A member's sums depend on its own act and the
// weights only.
template <bool TWO>
__device__ __forceinline__ void down_mma_pass(float (&acc)[2][4], const uint8_t* wrow,
                                              const float* arow_a, const float* arow_b, int I,
                                              int row_bytes, float sdn, int t, uint64_t* full,
                                              int parity) {
  float va[16], vb[16];
  act_chunk_load(arow_a, 0, t, va);
  if (TWO) act_chunk_load(arow_b, 0, t, vb);
  mbar_wait(full, parity);
#pragma unroll 1
  for (int c = 0; c < I / 64; ++c) {
    const int k0 = c * 64;
    uint32_t xa[8], xb[8];
    const float ua = act_chunk_f16(va, xa);
    float ub = ua;
    if (TWO) ub = act_chunk_f16(vb, xb);
    if (c + 1 < I / 64) {  // the next chunk's act while this one computes
      act_chunk_load(arow_a, k0 + 64, t, va);
      if (TWO) act_chunk_load(arow_b, k0 + 64, t, vb);
    }
    down_mma_chunk<TWO>(acc, wrow, k0, row_bytes, xa, xb, ua, ub, sdn, c);
  }
}
#endif  // __CUDA_ARCH__ >= 900

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Down item j (moe_down_stream on CUDA cores, below), its T rows in `rows` (stage li % S):
// y[q][h0 ..] of each of its members q into y_s. Members: memb[lo, hi) with tables, else the
// pairs of its expert from the leader on. L2: the act rows through L2 (ld.global.cg: written by
// other SMs in the same grid, moe_fused_mma), else the read-only path.
template <typename W, int T, int CPL, bool L2>
__device__ __forceinline__ void down_item_cc(const MoeParams& p, const StreamPlan& sp, int j,
                                             int li, const uint8_t* rows, int h0,
                                             const int* ids_s, const int* lead_s,
                                             const int* memb, const int* span, const int* eid,
                                             uint64_t* full, float* y_s) {
  typedef WChunk<W> C;
  constexpr int EPC = C::EPC;
  const int lane = threadIdx.x & 31;
  const int nch = p.I / EPC;
  const int row_bytes = p.I * (int)sizeof(typename W::storage);
  // a member's act row: lane l's chunks l, l + 32, ...
  auto load_row = [&](int q, float (&xf)[CPL][EPC]) {
    const float* arow = p.act + (int64_t)q * p.I;
#pragma unroll
    for (int c = 0; c < CPL; ++c)
      if (lane + 32 * c < nch) {
        if (L2) {
          const float4* src = (const float4*)(arow + (int64_t)(lane + 32 * c) * EPC);
#pragma unroll
          for (int i = 0; i < EPC / 4; ++i) {
            const float4 v = __ldcg(src + i);
            xf[c][4 * i] = v.x; xf[c][4 * i + 1] = v.y; xf[c][4 * i + 2] = v.z; xf[c][4 * i + 3] = v.w;
          }
        } else {
          load_act<EPC>(arow, STRATA_DTYPE_F32, (int64_t)(lane + 32 * c) * EPC, xf[c]);
        }
      }
  };
  const int lo = sp.group ? span[j] & 0xffff : 0, hi = sp.group ? span[j] >> 16 : 0;
  const int e = sp.group ? eid[j] : ids_s[lead_s[j]];
  // the T rows share one block row of scales (bo % T == 0), loaded while the stage lands
  float sc[CPL];
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    sc[c] = 1.f;
    if (C::scaled && lane + 32 * c < nch)
      sc[c] = __ldg(expert_down_scale(p, e) + (h0 / p.bo) * p.ncb_i + ((lane + 32 * c) * EPC) / p.bi);
  }
  // each member's act row loaded while the stage lands or the member before it computes
  // (one member ahead only at one chunk a lane: at two, ptxas spills)
  constexpr bool AHEAD = CPL == 1;
  float xf[CPL][EPC];
  int q = sp.group ? memb[lo] : lead_s[j];
  load_row(q, xf);
  mbar_wait(full + li % sp.stages, (li / sp.stages) & 1);
  for (int i = lo;; ++i) {
    const int q_next = sp.group ? (i + 1 < hi ? memb[i + 1] : -1)
                                : next_member(ids_s, p.P, q, e, lane);
    float xn[CPL][EPC];
    if (AHEAD && q_next >= 0) load_row(q_next, xn);
    if (!AHEAD && i > lo) load_row(q, xf);
    // every row's dot product, then their butterflies side by side: the same sums as
    // one row at a time, with T chains in flight rather than one (Nsight Compute on an
    // H200 had this loop at 15 cycles per instruction, a warp's members one long chain)
    float acc[T];
#pragma unroll
    for (int r = 0; r < T; ++r) {
      acc[r] = 0.f;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int ch = lane + 32 * c;
        if (ch < nch)
          acc[r] = chunk_dot<W>(*(const uint4*)(rows + r * row_bytes + 16 * ch), xf[c], sc[c], acc[r]);
      }
    }
    butterflies<T>(acc);  // = warp_sum of each
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < T; r += 4)
        *(float4*)(y_s + q * T + r) = make_float4(acc[r], acc[r + 1], acc[r + 2], acc[r + 3]);
    }
    if (q_next < 0) break;
    if (AHEAD) {
#pragma unroll
      for (int c = 0; c < CPL; ++c)
#pragma unroll
        for (int t = 0; t < EPC; ++t) xf[c][t] = xn[c][t];
    }
    q = q_next;
  }
}
#endif  // __CUDA_ARCH__ >= 900

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The down producer (one thread): down items j = 0 .. items - 1 as sequence items li0 + j, each
// the T rows of its expert from h0 (T * row_bytes bytes) into the first bytes of stage
// (li0 + j) % S (stages stage_bytes apart), once the stage's owner has released it.
__device__ __forceinline__ void down_produce(const MoeParams& p, const StreamPlan& sp,
                                             uint8_t* ring, int stage_bytes, uint64_t* full,
                                             int li0, int items, int h0, int T, int row_bytes,
                                             const int* ids_s, const int* lead_s,
                                             const int* eid) {
  uint64_t* empty = full + ST_MAX_STAGES;
  const uint64_t pol = l2_evict_first();
  const uint32_t piece = (uint32_t)(T * row_bytes);
  const int S = sp.stages;
  for (int j = 0; j < items; ++j) {
    const int li = li0 + j, stage = li % S, round = li / S;
    if (round) mbar_wait(empty + stage, (round - 1) & 1);
    mbar_expect_tx(full + stage, piece);
    const int e = sp.group ? eid[j] : ids_s[lead_s[j]];
    bulk::load(ring + stage * stage_bytes, expert_down(p, e) + (int64_t)h0 * row_bytes, piece,
               full + stage, pol);
  }
}
// The down kernels' combine: out[n][h0 + h] = sum_j w[n,j] * y[(n,j)][h] in j order, for the
// CTA's T features, by `threads` threads (this one tid).
__device__ __forceinline__ void down_combine(const MoeParams& p, const float* y_s, int h0, int T,
                                             int tid, int threads) {
  for (int t = tid; t < p.n * T; t += threads) {
    const int n = t / T, hh = t % T;
    float acc = 0.f;
    for (int j = 0; j < p.k; ++j) {
      const int q = n * p.k + j;
      acc = fmaf(p.topk_w[q], y_s[q * T + hh], acc);
    }
    store_from_float(p.out, p.x_dtype, (int64_t)n * p.H + h0 + hh, acc);
  }
}
#endif  // __CUDA_ARCH__ >= 900

// T output features per CTA, CPL 16-byte chunks per lane of a down row (both unrolled).
// MMA: on tensor cores (FP8 in 128-k blocks, T = 16: down_mma_pass), items of up to 16 members.
// BIG: a wide launch of more than MOE_WIDE_SMEM_PAIRS pairs, whose results (P x T floats: 360
// KiB at 512 rows) do not fit in shared memory: this CTA's go to its own part of p.y_stage, and
// the combine reads them back after the CTA's barrier (which orders its global writes too); the
// same values, summed in the same order, so the same bits.
template <typename W, int T, int CPL, bool MMA = false, bool BIG = false>
__global__ void __launch_bounds__(ST_THREADS, 1) moe_down_stream(MoeParams p, StreamPlan sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t smem[];
  // The ids come from the router, before the gate/up launch: visible without waiting for it.
  // sp.group 0: one item per expert, its members found by ballots (no tables: at 1-2 rows the
  // tables' barriers cost more than splitting saves)
  const int distinct = stream_start<BIG>(smem, p, sp);
  const int items = sp.group ? down_items<BIG>(smem, p, sp, distinct) : distinct;
  uint64_t* full = (uint64_t*)smem;
  uint64_t* empty = full + ST_MAX_STAGES;
  const int* ids_s = (const int*)(smem + ST_OFF_IDS);
  const int* lead_s = (const int*)(smem + st_off_lead(sp));
  const int* memb = (const int*)(smem + sp.items_off);
  const int* span = memb + p.P;
  const int* eid = span + (BIG ? sp.item_cap : p.P);
  float* y_s = BIG ? p.y_stage + (int64_t)blockIdx.x * p.P * T : (float*)(smem + sp.data_off);
  uint8_t* ring = smem + sp.ring_off;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int h0 = blockIdx.x * T;
  const int row_bytes = p.I * (int)sizeof(typename W::storage);
  const int S = sp.stages;

  if (warp == ST_MAX_WARPS) {  // the producer: weights need nothing from gate/up
    if (lane == 0)
      down_produce(p, sp, ring, ST_DOWN_STAGE, full, 0, items, h0, T, row_bytes, ids_s, lead_s,
                   eid);
    return;
  }
  if (MMA && warp < sp.warps) {
    pdl_wait_primary();  // the gate/up grid has finished and its act writes are visible
    const int g = lane >> 2, t = lane & 3;
    const int ncb = (p.I + p.bi - 1) / p.bi;
    for (int li = warp; li < items; li += sp.warps) {
      const int stage = li % S;
      const int e = sp.group ? eid[li] : ids_s[lead_s[li]];
      const float sdn = down_block_scale(p, e, h0, lane, ncb);
      // (the stage is waited for inside the first pass, after its first act loads)
      const uint8_t* wrow = ring + stage * ST_DOWN_STAGE + g * row_bytes + 16 * t;
      // the item's members, 32 at a time: lane j holds member w0 + j (the tables' run, or the
      // expert's pairs from its leader by ballots)
      const int s0 = sp.group ? 0 : lead_s[li];
      for (int w0 = 0;; w0 += 32) {
        int my_q;
        const int M = item_members(sp.group != 0, memb, sp.group ? span[li] : 0, ids_s, p.P, s0,
                                   e, w0, lane, &my_q);
        const int Mw = M - w0 < 32 ? M - w0 : 32;
        for (int m0 = 0; m0 < Mw; m0 += 16) {
          const int ma = m0 + g < Mw ? m0 + g : m0, mb = m0 + g + 8 < Mw ? m0 + g + 8 : m0;
          const int qa = __shfl_sync(0xffffffffu, my_q, ma), qb = __shfl_sync(0xffffffffu, my_q, mb);
          float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
          const float* arow_a = p.act + (int64_t)qa * p.I;
          const float* arow_b = p.act + (int64_t)qb * p.I;
          if (Mw - m0 > 8)
            down_mma_pass<true>(acc, wrow, arow_a, arow_b, p.I, row_bytes, sdn, t, full + stage,
                                (li / S) & 1);
          else
            down_mma_pass<false>(acc, wrow, arow_a, arow_b, p.I, row_bytes, sdn, t, full + stage,
                                 (li / S) & 1);
          down_mma_store(y_s, acc, qa, m0 + g < Mw, qb, m0 + g + 8 < Mw, t);
        }
        if (w0 + 32 >= M) break;
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + stage);
    }
  } else if (!MMA && warp < sp.warps) {  // (idle warps go straight to the combine's barrier)
    pdl_wait_primary();  // the gate/up grid has finished and its act writes are visible
    for (int li = warp; li < items; li += sp.warps) {
      down_item_cc<W, T, CPL, false>(p, sp, li, li, ring + (li % S) * ST_DOWN_STAGE, h0, ids_s,
                                     lead_s, memb, span, eid, full, y_s);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + li % S);
    }
  }
  sync_threads(ST_MAX_WARPS * 32);
  down_combine(p, y_s, h0, T, tid, ST_MAX_WARPS * 32);
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Member run r's act rows (at most 16) into shared memory as down_mma_pass makes them: each
// 64-k chunk of a member's row scaled by its power of two into f16 (act_chunk_f16, the same
// values), row m at as + m * sp.x_stride bytes, the chunk's 2^-s at un[m * (I / 64) + c]. One
// warp a member; lane l takes 16 values (chunk l / 4, quarter l % 4) of each 512 of the row.
__device__ __forceinline__ void down_runs_stage(const MoeParams& p, const StreamPlan& sp,
                                                const int* memb, int span_word, uint8_t* as,
                                                float* un, int warp, int lane) {
  const int lo = span_word & 0xffff, M = (span_word >> 16) - lo;
  for (int m = warp; m < M; m += sp.warps) {
    const float* arow = p.act + (int64_t)memb[lo + m] * p.I;
    for (int b = 0; b < p.I; b += 512) {
      const int k0 = b + 64 * (lane >> 2), t = lane & 3;
      float v[16];
      if (k0 < p.I) {
        act_chunk_load(arow, k0, t, v);
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = 0.f;
      }
      uint32_t w[8];
      const float u = act_chunk_f16(v, w);  // (whole groups of four lanes are in or out: I % 64 == 0)
      if (k0 < p.I) {
        uint4* dst = (uint4*)(as + (int64_t)m * sp.x_stride + 2 * (k0 + 16 * t));
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
        dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
        if (t == 0) un[m * (p.I / 64) + k0 / 64] = u;
      }
    }
  }
}

// The big launch's down kernel in member runs (STRATA_MOE_GU_RUNS with the tensor-core down
// kernel): as moe_gate_up_runs, items (member run of at most 16, tile of T = 16 output
// features), each CTA a contiguous range of the run-major items, the run's act staged once in
// shared memory as f16 chunks with their scales, where moe_down_stream<..., MMA, BIG> has each
// of its H / T CTAs read every member's float32 act row from L2 (at 512 rows 1.4 GB a layer,
// 2.6 times the down weights). Each item's results go to p.y_stage as that kernel's CTA of the
// same features writes them (tile h0 / T's part, y[q][h - h0]), and moe_down_runs_combine sums
// them: the same MMAs on the same operands and the same sums in the same order: the same bits.
#endif  // __CUDA_ARCH__ >= 900
__global__ void __launch_bounds__(ST_THREADS, 1) moe_down_runs(MoeParams p, StreamPlan sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int T = 16;
  extern __shared__ __align__(128) uint8_t smem[];
  const int distinct = stream_start<true>(smem, p, sp);
  const int runs = down_items<true, true>(smem, p, sp, distinct);
  const int* memb = (const int*)(smem + sp.items_off);
  const int* span = memb + p.P;
  const int* eid = span + sp.item_cap;
  uint64_t* full = (uint64_t*)smem;
  uint64_t* empty = full + ST_MAX_STAGES;
  uint8_t* as = smem + sp.data_off;
  float* un = (float*)(smem + sp.scale_off);
  uint8_t* ring = smem + sp.ring_off;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tiles = p.H / T, row_bytes = p.I, S = sp.stages;
  int lo;
  const int n_local = runs_range(runs * tiles, &lo);
  if (warp == ST_MAX_WARPS) {  // the producer: weights need nothing from gate/up
    if (lane == 0) {
      const uint64_t pol = l2_evict_first();
      const uint32_t piece = (uint32_t)(T * row_bytes);
      for (int li = 0; li < n_local; ++li) {
        const int stage = li % S, round = li / S, item = lo + li;
        if (round) mbar_wait(empty + stage, (round - 1) & 1);
        mbar_expect_tx(full + stage, piece);
        bulk::load(ring + stage * ST_DOWN_STAGE,
                   expert_down(p, eid[item / tiles]) + (int64_t)(item % tiles) * T * row_bytes,
                   piece, full + stage, pol);
      }
    }
    return;
  }
  if (warp >= sp.warps || n_local == 0) return;
  pdl_wait_primary();  // the gate/up grid has finished and its act writes are visible
  const int g = lane >> 2, t = lane & 3;
  const int ncb = (p.I + p.bi - 1) / p.bi, nch = p.I / 64;
  const int r_last = (lo + n_local - 1) / tiles;
  auto stage_run = [&](int r) { down_runs_stage(p, sp, memb, span[r], as, un, warp, lane); };
  int staged = lo / tiles;
  stage_run(staged);
  sync_threads(sp.warps * 32);
  for (int li = warp;; li += sp.warps) {
    const int item = lo + li, r = li < n_local ? item / tiles : r_last;
    runs_advance(staged, r, sp.warps * 32, stage_run);
    if (li >= n_local) break;
    const int stage = li % S, h0 = (item % tiles) * T, e = eid[r];
    const int mlo = span[r] & 0xffff, M = (span[r] >> 16) - mlo;
    const float sdn = down_block_scale(p, e, h0, lane, ncb);
    // A's rows g and g + 8: members g and g + 8 (past the last: the first)
    const int ma = g < M ? g : 0, mb = g + 8 < M ? g + 8 : 0;
    const uint8_t* xa_row = as + ma * sp.x_stride + 32 * t;
    const uint8_t* xb_row = as + mb * sp.x_stride + 32 * t;
    const uint8_t* wrow = ring + stage * ST_DOWN_STAGE + g * row_bytes + 16 * t;
    mbar_wait(full + stage, (li / S) & 1);
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll 1
    for (int c = 0; c < nch; ++c) {  // down_mma_pass's chunks, their act from shared memory
      const int k0 = c * 64;
      const uint4 a0 = *(const uint4*)(xa_row + 2 * k0), a1 = *(const uint4*)(xa_row + 2 * k0 + 16);
      const uint32_t xa[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float ua = un[ma * nch + c];
      uint32_t xb[8] = {xa[0], xa[1], xa[2], xa[3], xa[4], xa[5], xa[6], xa[7]};
      float ub = ua;
      if (M > 8) {
        const uint4 b0 = *(const uint4*)(xb_row + 2 * k0), b1 = *(const uint4*)(xb_row + 2 * k0 + 16);
        xb[0] = b0.x; xb[1] = b0.y; xb[2] = b0.z; xb[3] = b0.w;
        xb[4] = b1.x; xb[5] = b1.y; xb[6] = b1.z; xb[7] = b1.w;
        ub = un[mb * nch + c];
      }
      // (rows 8-15 repeat rows 0-7 where M <= 8: down_mma_pass<false>'s operands)
      down_mma_chunk<true>(acc, wrow, k0, row_bytes, xa, xb, ua, ub, sdn, c);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + stage);
    down_mma_store(p.y_stage + (int64_t)(h0 / T) * p.P * T, acc, memb[mlo + ma], g < M,
                   memb[mlo + mb], g + 8 < M, t);
  }
#endif
}

// moe_down_runs' combine: block b sums output features [16 b, 16 b + 16) of every row from tile
// b's part of p.y_stage, as the big down kernel's CTA b does at its end (down_combine).
__global__ void __launch_bounds__(256) moe_down_runs_combine(MoeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int T = 16;
  down_combine(p, p.y_stage + (int64_t)blockIdx.x * p.P * T, blockIdx.x * T, T, threadIdx.x, 256);
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
#endif

// A decode window's routed experts in one grid (STRATA_MOE_FUSED): the tensor-core gate/up
// (moe_gate_up_mma's items, x in shared memory) and then the CUDA-core down kernel's items
// (moe_down_stream<FP8W, 16, 1>'s, T = 16 output features a CTA) through one ring, one
// producer and one item sequence per CTA. Why: as two grids the down kernel starts streaming
// its weights only once the gate/up CTAs leave their SMs (each holds the whole shared memory),
// and its act reads wait for the whole gate/up grid, so each launch paid a ramp down and a ramp
// up between the two (at 4 and 16 rows on an H200 the pair ran at 68-74% of the copy ceiling).
// Here a CTA's producer issues its down rows as soon as its gate/up copies are out, and a down
// item waits only for its own expert: every gate/up item (a 4-feature tile) counts itself done
// in p.sync's per-expert counter (release), and the down item's warp waits until all I / 4
// tiles have (acquire). Gate/up items finish in about expert order on every CTA (they are dealt
// round-robin), and the down items go in expert order. CTAs past H / T have no down items.
// The last CTA to finish (a ticket in p.sync[0]) sets the counters back to zero for the next
// launch. The same arithmetic in the same order as the two kernels: the same bits.
__global__ void __launch_bounds__(ST_THREADS, 1) moe_fused_mma(MoeParams p, StreamPlan sp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int F = 4, T = 16;
  extern __shared__ __align__(128) uint8_t smem[];
  const int distinct = gate_up_start(smem, p, sp);
  const int items = sp.group ? down_items(smem, p, sp, distinct) : distinct;
  uint64_t* full = (uint64_t*)smem;
  uint64_t* empty = full + ST_MAX_STAGES;
  const int* ids_s = (const int*)(smem + ST_OFF_IDS);
  const int* lead_s = (const int*)(smem + st_off_lead(sp));
  const int* index_s = (const int*)(smem + st_off_first(sp));  // (down_items: expert -> d)
  const int* memb = (const int*)(smem + sp.items_off);
  const int* span = memb + p.P;
  const int* eid = span + p.P;
  uint8_t* x_s = smem + sp.data_off;
  float* unscale_s = (float*)(smem + sp.scale_off);
  float* y_s = (float*)(smem + sp.y_off);
  uint8_t* ring = smem + sp.ring_off;
  int* done = p.sync + MOE_SYNC_DONE;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int n_gu = gate_up_items(distinct, sp);
  const int h0 = blockIdx.x * T;
  const int n_dn = h0 < p.H ? items : 0;
  const int H = p.H;  // bytes per FP8 gate/up row
  const int S = sp.stages;

  if (warp == ST_MAX_WARPS) {  // the producer: the gate/up items' copies, then the down items'
    if (lane == 0) {
      gate_up_produce(p, sp, ring, full, ids_s, lead_s, n_gu, F, H);
      down_produce(p, sp, ring, sp.stage_bytes, full, n_gu, n_dn, h0, T, p.I, ids_s, lead_s,
                   eid);
    }
    return;
  }
  if (warp >= sp.warps) return;

  for (int n = warp; n < p.n; n += sp.warps)
    stage_x_row_f16((const uint16_t*)p.x + (int64_t)n * H, x_s + (int64_t)n * sp.x_stride,
                    unscale_s + n, H, lane);
  sync_threads(sp.warps * 32);

  for (int li = warp; li < n_gu + n_dn; li += sp.warps) {
    const int stage = li % S;
    if (li < n_gu) {  // a gate/up item, then its count (release: its act stores fenced first)
      const int d = gate_up_mma_item<false>(p, sp, li, ids_s, lead_s, memb, span, x_s,
                                            unscale_s, ring, full);
      __threadfence();
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(empty + stage);
        atomicAdd(done + d, 1);
      }
      continue;
    }
    // a down item, once every gate/up tile of its expert is done (acquire)
    const int j = li - n_gu;
    const int d = sp.group ? index_s[eid[j]] : j;
    if (lane == 0)
      while (ld_acquire_gpu(done + d) < sp.tiles) __nanosleep(64);
    __syncwarp();
    (void)ld_acquire_gpu(done + d);  // every lane's own acquire before its act loads
    down_item_cc<FP8W, T, 1, true>(p, sp, j, li, ring + stage * sp.stage_bytes, h0, ids_s,
                                   lead_s, memb, span, eid, full, y_s);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + stage);
  }
  sync_threads(sp.warps * 32);
  if (n_dn) down_combine(p, y_s, h0, T, tid, sp.warps * 32);
  // the last CTA out sets the counters back to zero (every CTA has read its last one)
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(p.sync + MOE_SYNC_TICKET, 1) == (int)gridDim.x - 1) {
      for (int dd = 0; dd < distinct; ++dd) done[dd] = 0;
      p.sync[MOE_SYNC_TICKET] = 0;
      __threadfence();
    }
  }
#endif
}

int launch_fused_mma(const MoeParams& p, const StreamPlan& sp, int grid, int smem, bool pdl,
                     cudaStream_t st) {
  static int allowed = 0;
  const char* name = "moe_experts: moe_fused_mma";
  if (int rc = allow_smem(moe_fused_mma, smem, allowed, name)) return rc;
  launch_maybe_pdl(moe_fused_mma, dim3((unsigned)grid), dim3(ST_THREADS), smem, st, pdl, p, sp);
  return take_launch_error(name);
}

template <typename W, int CPL, bool XF32>
int launch_gate_up(const MoeParams& p, const StreamPlan& sp, int grid, int smem, bool pdl,
                   cudaStream_t st) {
  static int allowed = 0;
  const char* name = "moe_experts: moe_gate_up_stream";
  if (int rc = allow_smem(moe_gate_up_stream<W, CPL, XF32>, smem, allowed, name)) return rc;
  launch_maybe_pdl(moe_gate_up_stream<W, CPL, XF32>, dim3((unsigned)grid), dim3(ST_THREADS), smem,
                   st, pdl, p, sp);
  return take_launch_error(name);
}

int launch_gate_up_mma(const MoeParams& p, const StreamPlan& sp, int grid, int smem, bool pdl,
                       bool big, bool runs, cudaStream_t st) {
  static int allowed = 0;
  const char* name = "moe_experts: moe_gate_up_mma";
  if (sp.x_global) {
    static int allowed_wide = 0, allowed_big = 0, allowed_runs = 0, allowed_runs_big = 0;
    launch_maybe_pdl(moe_stage_x, dim3((unsigned)p.n), dim3(32), 0, st, pdl, p, sp.x_stride);
    if (int rc = take_launch_error("moe_experts: moe_stage_x")) return rc;
    // a programmatic dependent of the staging grid: it waits for it (pdl_wait_primary) before
    // reading x
    if (runs) {
      const char* rname = "moe_experts: moe_gate_up_runs";
      if (big) {
        if (int rc = allow_smem(moe_gate_up_runs<true>, smem, allowed_runs_big, rname)) return rc;
        launch_maybe_pdl(moe_gate_up_runs<true>, dim3((unsigned)grid), dim3(ST_THREADS), smem, st,
                         true, p, sp);
      } else {
        if (int rc = allow_smem(moe_gate_up_runs<false>, smem, allowed_runs, rname)) return rc;
        launch_maybe_pdl(moe_gate_up_runs<false>, dim3((unsigned)grid), dim3(ST_THREADS), smem,
                         st, true, p, sp);
      }
      return take_launch_error(rname);
    }
    if (big) {
      if (int rc = allow_smem(moe_gate_up_mma<true, true>, smem, allowed_big, name)) return rc;
      launch_maybe_pdl(moe_gate_up_mma<true, true>, dim3((unsigned)grid), dim3(ST_THREADS), smem,
                       st, true, p, sp);
      return take_launch_error(name);
    }
    if (int rc = allow_smem(moe_gate_up_mma<true>, smem, allowed_wide, name)) return rc;
    launch_maybe_pdl(moe_gate_up_mma<true>, dim3((unsigned)grid), dim3(ST_THREADS), smem, st,
                     true, p, sp);
    return take_launch_error(name);
  }
  if (int rc = allow_smem(moe_gate_up_mma<false>, smem, allowed, name)) return rc;
  launch_maybe_pdl(moe_gate_up_mma<false>, dim3((unsigned)grid), dim3(ST_THREADS), smem, st, pdl,
                   p, sp);
  return take_launch_error(name);
}

template <typename W, int T, int CPL, bool MMA = false, bool BIG = false>
int launch_down(const MoeParams& p, const StreamPlan& sp, int smem, bool pdl, cudaStream_t st) {
  static int allowed = 0;
  const char* name = "moe_experts: moe_down_stream";
  if (int rc = allow_smem(moe_down_stream<W, T, CPL, MMA, BIG>, smem, allowed, name)) return rc;
  launch_maybe_pdl(moe_down_stream<W, T, CPL, MMA, BIG>, dim3((unsigned)(p.H / T)),
                   dim3(ST_THREADS), smem, st, pdl, p, sp);
  return take_launch_error(name);
}

int launch_down_runs(const MoeParams& p, const StreamPlan& sp, int grid, int smem, bool pdl,
                     cudaStream_t st) {
  static int allowed = 0;
  const char* name = "moe_experts: moe_down_runs";
  if (int rc = allow_smem(moe_down_runs, smem, allowed, name)) return rc;
  launch_maybe_pdl(moe_down_runs, dim3((unsigned)grid), dim3(ST_THREADS), smem, st, pdl, p, sp);
  if (int rc = take_launch_error(name)) return rc;
  moe_down_runs_combine<<<(unsigned)(p.H / 16), 256, 0, st>>>(p);  // (T = 16: checked)
  return take_launch_error("moe_experts: moe_down_runs_combine");
}

template <typename W, bool XF32>
int dispatch_gate_up(const MoeParams& p, const StreamPlan& sp, int cpl, int grid, int smem,
                     bool pdl, cudaStream_t st) {
  switch (cpl) {
    case 1: return launch_gate_up<W, 1, XF32>(p, sp, grid, smem, pdl, st);
    case 2: return launch_gate_up<W, 2, XF32>(p, sp, grid, smem, pdl, st);
    case 4: return launch_gate_up<W, 4, XF32>(p, sp, grid, smem, pdl, st);
    default: return launch_gate_up<W, 8, XF32>(p, sp, grid, smem, pdl, st);
  }
}

template <typename W>
int dispatch_down(const MoeParams& p, const StreamPlan& sp, int T, int cpl, int smem, bool pdl,
                  cudaStream_t st) {
  if (cpl == 1) {
    if (T == 16) return launch_down<W, 16, 1>(p, sp, smem, pdl, st);
    if (T == 8) return launch_down<W, 8, 1>(p, sp, smem, pdl, st);
    return launch_down<W, 4, 1>(p, sp, smem, pdl, st);
  }
  if (T == 16) return launch_down<W, 16, 2>(p, sp, smem, pdl, st);
  if (T == 8) return launch_down<W, 8, 2>(p, sp, smem, pdl, st);
  return launch_down<W, 4, 2>(p, sp, smem, pdl, st);
}

// Consumer warps and stages for a ring of `stage`-byte stages in `bytes` of shared memory:
// two stages per warp where that still gives 8 warps, else (or one_per_warp) one (each stage
// has one consumer warp, so it is filled and drained in order).
inline void size_ring(StreamPlan& sp, int bytes, int stage, bool one_per_warp = false) {
  int stages = bytes / stage;
  stages = stages > ST_MAX_STAGES ? ST_MAX_STAGES : stages;
  const int per_warp = stages >= 2 * 8 && !one_per_warp ? 2 : 1;
  sp.warps = stages / per_warp > ST_MAX_WARPS ? ST_MAX_WARPS : stages / per_warp;
  sp.stages = sp.warps * per_warp;
}

template <typename W>
int launch_stream(const MoeParams& p, const DeviceFacts& dev, bool pdl, bool every_size,
                  cudaStream_t st, bool* launched, bool plan_only) {
  typedef WChunk<W> C;
  const int esz = (int)sizeof(typename W::storage);
  const int64_t gu_row = (int64_t)p.H * esz, down_row = (int64_t)p.I * esz;
  const int options = strata_gpu_moe_set_options(-1);
  // chunks per lane of a gate/up row (at most 8) and of a down row (at most 2: a lane holds
  // its chunks of an act row as floats)
  int cpl = chunks_per_lane(p.H / C::EPC), cpl_dn = chunks_per_lane(p.I / C::EPC);
  cpl = cpl > 8 ? 0 : cpl;
  cpl_dn = cpl_dn > 2 ? 0 : cpl_dn;
  const int F = cpl ? gate_up_features(cpl) : 0;
  int T = 16;  // down: output features per CTA, dividing H, one block row of scales
  while (T > 4 && (T * down_row > ST_COPY_BYTES || p.H % T || (C::scaled && p.bo % T))) T >>= 1;
  const bool fp8 = C::scaled;
  // Where the per-block kernels are as fast (same bits either way). Measured on an H200 with the
  // engine's folded shared expert (scripts/bench_kernels.py --moe --moe-shared --moe-variants
  // stream,+db+xsmem): FP8 18-34% faster at 1-16 rows and level at 32 (x in shared memory then
  // leaves too few stages); bf16 within 6% either way, ahead at 2-8 rows.
  // gate/up on tensor cores (FP8 in 128-k blocks, 4 features per item, x as f16 rows): every
  // FP8 window of up to 32 rows, so that a row's bits never depend on the window's size (the
  // per-block kernels sum in another order)
  // STRATA_MOE_X_GLOBAL: from 17 rows (up to 512) x is staged in global memory (moe_stage_x),
  // so that the ring keeps the whole shared memory; the caller's workspace holds it.
  const bool x_global = fp8 && (options & STRATA_MOE_X_GLOBAL) && p.n > 16 && p.x_stage &&
                        !p.slot_of;  // (the cache's launches keep their measured form)
  const bool mma = fp8 && (options & STRATA_MOE_GU_MMA) && p.bi == 128 && p.bo % 4 == 0 &&
                   p.I % 4 == 0 && p.H % 128 == 0 && p.H <= 4096 &&
                   p.n <= (x_global ? ST_WIDE_MAX_ROWS : 32);
  if (!every_size && !mma && (fp8 ? p.n > 16 : (p.n < 2 || p.n > 8))) return 0;
  const bool gu_ok = mma || (cpl && F * gu_row <= ST_COPY_BYTES && p.I % F == 0 &&
                             !(fp8 && p.bo % F));
  if (!gu_ok || !cpl_dn || T * down_row > ST_COPY_BYTES || p.H % T || (fp8 && p.bo % T) ||
      p.E > ST_MAX_EXPERTS || p.P > (mma && x_global ? ST_WIDE_MAX_PAIRS : ST_THREADS) ||
      p.x_dtype != STRATA_DTYPE_BF16)
    return 0;
  // a big launch (more pairs than its down results fit in shared memory: MOE_WIDE_SMEM_PAIRS)
  // keeps them in the workspace, and runs the FP8 down kernels of T = 16 only
  const bool big = p.P > MOE_WIDE_SMEM_PAIRS;
  if (big && (!mma || !x_global || !p.y_stage || T != 16 || cpl_dn != 1)) return 0;
  const int pair_cap = p.P <= MOE_MAX_PAIRS ? MOE_MAX_PAIRS
                       : p.P <= ST_WIDE_64_PAIRS ? ST_WIDE_64_PAIRS : (p.P + 31) & ~31;
  StreamPlan gu = {};
  gu.pair_cap = pair_cap;
  // A big launch sizes its leader and item tables by what it can hold (at most E distinct
  // experts; items: an expert's members in runs of `group`), so that its ring keeps stages: at
  // 512 rows, top-11, tables of P entries each would leave the gate/up 5 stages, these 10.
  gu.lead_cap = big ? (p.E < pair_cap ? (p.E + 31) & ~31 : pair_cap) : pair_cap;
  // (lead_cap is pair_cap but in big launches: this is the offset every kernel reads)
  const int meta = align128(st_off_first<true>(gu) + 4 * p.E);
  auto item_cap = [&](int group) {
    const int most = p.E + (p.P + group - 1) / group;
    return big && most < p.P ? most : p.P;
  };
  bool x_f32 = false;
  const bool gu_runs = mma && x_global && (options & STRATA_MOE_GU_RUNS);
  if (gu_runs) {
    // items of (member run of at most 16, tile), run-major; the current run's x rows in shared
    // memory (rows 16 bytes apart beyond 2H, as in a launch that stages x there) over the ids,
    // leader and first-pair tables, which nothing reads once down_items has made the item
    // tables (at 512 rows that leaves the ring 8 stages of 16 KiB rather than 6); then the item
    // tables, the rows' scales and the ring
    gu.tiles = p.I / 4;
    gu.x_global = 1;
    gu.x_stride = 2 * p.H + 16;
    gu.group = ST_GU_RUN;
    gu.item_cap = item_cap(gu.group);
    gu.data_off = ST_OFF_IDS;
    const int x_end = align128(gu.data_off + ST_GU_RUN * gu.x_stride);
    gu.items_off = x_end > meta ? x_end : meta;
    gu.scale_off = align128(gu.items_off + 4 * p.P + 12 * gu.item_cap);
    gu.ring_off = align128(gu.scale_off + 4 * ST_GU_RUN);
    gu.stage_bytes = 8 * p.H;
  } else if (mma && x_global) {
    gu.tiles = p.I / 4;
    gu.x_global = 1;
    gu.x_stride = 2 * p.H + 16;
    // one item per expert: its members in the tables, however many (a row may repeat an id,
    // so an expert can have more members than the launch has rows)
    gu.group = ST_WIDE_MAX_PAIRS;
    gu.item_cap = item_cap(gu.group);
    gu.items_off = meta;
    gu.ring_off = align128(meta + 4 * p.P + 12 * gu.item_cap);
    gu.stage_bytes = 8 * p.H;
  } else if (mma) {
    gu.tiles = p.I / 4;
    gu.data_off = meta;
    gu.x_stride = 2 * p.H + 16;
    gu.scale_off = align128(meta + p.n * gu.x_stride);
    gu.ring_off = align128(gu.scale_off + 4 * p.n);
    gu.stage_bytes = 8 * p.H;
  } else {
    x_f32 = p.n * p.H * 4 <= ST_X_F32_MAX_BYTES;
    const int x_bytes = p.n * p.H * (x_f32 ? 4 : 2);
    if (x_bytes > ST_X_MAX_BYTES) return 0;
    gu.tiles = p.I / F;
    gu.data_off = meta;
    gu.ring_off = align128(meta + x_bytes);
    gu.stage_bytes = ST_GU_STAGE;
  }
  size_ring(gu, dev.smem_optin - gu.ring_off, gu.stage_bytes);
  StreamPlan dn = {};
  dn.pair_cap = pair_cap;
  dn.lead_cap = gu.lead_cap;
  dn.items_off = meta;
  // STRATA_MOE_DOWN_SPLIT: members per down item (down_items; the same bits at any count)
  // (0: no tables, one item per expert; below 3 rows the tables cost more than they save). Runs
  // of 2 measured best at 16 and 32 rows too (FP8 139.4 / 280.0 us against 142-143 / 284-285
  // for runs of 4, 144 / 288 for 1, 148 / 296 for 8; KERNELS.md).
  const int runs = (options >> STRATA_MOE_DOWN_RUNS_SHIFT) & 15;
  // STRATA_MOE_DOWN_MMA: a prompt chunk's launches (p.prompt) run the down kernel on tensor
  // cores (items of up to 16 members: one MMA pass), a decode window's on CUDA cores. Decided
  // by the kind of rows, not their count, because the two kernels' bits differ and a prompt
  // row shares its launch with other slots' rows under engine.prefill_slots: each row keeps
  // one set of bits in every mode. Tensor cores pay from about 32 rows (H200, 80B shapes: -6%
  // at 64 rows, level at 32, +13% at 1 row), where prompt chunks are and windows are not.
  const bool down_mma = mma && p.prompt && (options & STRATA_MOE_DOWN_MMA) && T == 16 &&
                        cpl_dn == 1 && p.I % 64 == 0;
  dn.group = !(options & STRATA_MOE_DOWN_SPLIT) || p.n <= 2 ? 0
             : down_mma ? 16 : runs ? runs : 2;
  dn.item_cap = dn.group ? item_cap(dn.group) : 0;
  dn.data_off = align128(meta + (dn.group ? 4 * p.P + 12 * dn.item_cap : 0));
  dn.ring_off = align128(dn.data_off + (big ? 0 : p.P * T * 4));
  // STRATA_MOE_GU_RUNS in a big launch on the tensor-core down kernel: moe_down_runs (member
  // runs of 16 dealt in contiguous ranges over every SM, the run's act in shared memory as f16
  // chunks; the results to the workspace, then moe_down_runs_combine)
  const bool dn_runs = big && down_mma && gu_runs && dn.group == ST_GU_RUN;
  if (dn_runs) {
    dn.x_stride = 2 * p.I + 16;  // (rows 16 bytes apart beyond 2I: distinct banks)
    dn.scale_off = align128(dn.data_off + ST_GU_RUN * dn.x_stride);
    dn.ring_off = align128(dn.scale_off + 4 * ST_GU_RUN * (p.I / 64));
  }
  // above 32 rows one stage per warp: 16 warps rather than 10 with two (the y table takes 45
  // KiB at 64 rows), measured 6% faster at 64 rows and 2% slower at 32 (the same bits)
  size_ring(dn, dev.smem_optin - dn.ring_off, ST_DOWN_STAGE, p.n > ST_DOWN_ONE_STAGE_ROWS);
  if (gu.warps < 4 || dn.warps < 4) return 0;
  // STRATA_MOE_GU_PDL: gate/up as a programmatic dependent of the kernel before it (the
  // router), so that its CTAs launch and initialise while that kernel ends. One SM fewer: the
  // SM still running the router's last CTA (its second phase) cannot take a gate/up CTA (each
  // needs the whole shared memory), and that CTA would start late and finish last.
  const bool gu_pdl = (options & STRATA_MOE_GU_PDL) != 0;
  const int gu_grid = gu_pdl && dev.sms > 1 ? dev.sms - 1 : dev.sms;
  // STRATA_MOE_FUSED: a decode window's gate/up and down in one grid (moe_fused_mma), its
  // CTAs past H / T with gate/up items only; the down kernel's plan for its items, the
  // tensor-core gate/up's for x, both tables beside one ring of gate/up stages.
  if ((options & STRATA_MOE_FUSED) && mma && !x_global && !big && !down_mma && p.sync &&
      !p.slot_of && T == 16 && cpl_dn == 1 && p.n <= 16 && p.H / T <= gu_grid) {
    StreamPlan fu = gu;
    fu.group = dn.group;
    fu.item_cap = dn.item_cap;
    fu.items_off = meta;
    fu.data_off = align128(meta + (fu.group ? 4 * p.P + 12 * fu.item_cap : 0));
    fu.scale_off = align128(fu.data_off + p.n * fu.x_stride);
    fu.y_off = align128(fu.scale_off + 4 * p.n);
    fu.ring_off = align128(fu.y_off + p.P * T * 4);
    size_ring(fu, dev.smem_optin - fu.ring_off, fu.stage_bytes);
    if (fu.warps >= 4) {
      *launched = true;
      if (plan_only) return 0;
      return launch_fused_mma(p, fu, gu_grid, fu.ring_off + fu.stages * fu.stage_bytes, gu_pdl,
                              st);
    }
  }
  *launched = true;
  if (plan_only) return 0;
  const int gu_smem = gu.ring_off + gu.stages * gu.stage_bytes;
  const int dn_smem = dn.ring_off + dn.stages * ST_DOWN_STAGE;
  int rc = mma     ? launch_gate_up_mma(p, gu, gu_grid, gu_smem, gu_pdl, big, gu_runs, st)
           : x_f32 ? dispatch_gate_up<W, true>(p, gu, cpl, gu_grid, gu_smem, gu_pdl, st)
                   : dispatch_gate_up<W, false>(p, gu, cpl, gu_grid, gu_smem, gu_pdl, st);
  if (rc) return rc;
  if (dn_runs) return launch_down_runs(p, dn, dev.sms, dn_smem, pdl, st);
  if (big)  // (T = 16, one chunk a lane: checked above)
    return down_mma ? launch_down<FP8W, 16, 1, true, true>(p, dn, dn_smem, pdl, st)
                    : launch_down<FP8W, 16, 1, false, true>(p, dn, dn_smem, pdl, st);
  if (down_mma) return launch_down<FP8W, 16, 1, true>(p, dn, dn_smem, pdl, st);
  return dispatch_down<W>(p, dn, T, cpl_dn, dn_smem, pdl, st);
}

}  // namespace

int launch_moe_stream(const MoeParams& p, int w_dtype, int device, bool pdl, bool every_size,
                      cudaStream_t st, bool* launched, bool plan_only) {
  *launched = false;
  if (p.n < 1) return 0;
  const DeviceFacts dev = device_facts(device);
  if (dev.sms < 1) return 0;
  if (w_dtype == STRATA_DTYPE_FP8)
    return launch_stream<FP8W>(p, dev, pdl, every_size, st, launched, plan_only);
  if (w_dtype == STRATA_DTYPE_BF16)
    return launch_stream<BF16>(p, dev, pdl, every_size, st, launched, plan_only);
  return 0;
}

#else  // HIP: no bulk copy engine; strata_moe.cu's per-block kernels run instead.

int launch_moe_stream(const MoeParams&, int, int, bool, bool, cudaStream_t, bool* launched,
                      bool) {
  *launched = false;
  return 0;
}

#endif

}  // namespace moe
}  // namespace strata
