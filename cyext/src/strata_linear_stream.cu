// strata cyext: the FP8 dense linear at decode sizes on tensor cores, weights streamed through
// shared memory by the bulk copy engine (sm_90+). y (m, o) = x (m, in) . dequant(W)^T for a
// float8_e4m3fn W (o, in) with float32 block scales, bf16 x and y, up to 16 rows per launch.
//
// Why: a decode window multiplies 1-16 rows by each weight, so the work is bound by the bytes
// of W, and W in FP8 is half the bytes of the bf16 copy cuBLAS would read. The skinny kernel
// (strata_moe.cu) decodes FP8 into floats and runs CUDA-core FMAs, about a dozen instructions
// per weight element: it fell from 44% of the copy ceiling at one row to 8% at 16. Here a
// weight element costs about three instructions (a byte shuffle into bf16, exact, and one
// bf16x2 multiply per pair) and the products run on the tensor cores (mma.sync m16n8k16,
// float32 accumulation), so the row count matters little up to 16.
//
// Layout: one CTA per SM. Items are tiles of 8 weight rows (the MMA's n), dealt round-robin
// to the CTAs; a tile's 8 * in bytes land in one tile slot of shared memory (row-major), copied
// by the bulk copy engine. The producer warp's one thread issues every copy. Consumer warps
// form groups; each group owns a ring of tile slots and every groups-th tile of the CTA (so
// each slot is drained in order by one group: mbarrier phases are told apart by parity only);
// the warps of a group split the tile's 128-k blocks and add their partial sums through shared
// memory in a fixed order. x (m rows, padded by 16 bytes per row so a warp's reads hit distinct
// banks) is copied into shared memory once per CTA; the launch is a programmatic dependent one,
// so the first weight copies may start while the kernel before it (which writes x) finishes.
// MMA operands: A = x (16 rows, rows >= m are zero), B = 8 weight rows, D = y (16 x 8). The
// k order inside an MMA is permuted (thread t's four k slots take four consecutive k's) so a
// thread reads 16 consecutive bytes of a weight row and 32 of an x row per 64 k's; A and B use
// the same permutation, so the sum is the same. Each 128-k block of scales is applied to the
// block's partial sum: y = sum_kb scale[ob][kb] * (sum_{k in kb} w x), in a fixed order.
// Determinism: each output element's sum depends only on its row of x and column of W, so a
// row's result is the same bits whatever other rows share the launch (16-row chunks change
// nothing).
//
// The split kernel (linear_fp8_split, below; on by default where in >= 2048) splits every
// tile's k range over all 16 warps instead, with other bits. The unsplit kernel has two
// pipelines, the same bits (launch switch STRATA_LINEAR_PIPE in strata_kernels.h, off):
// - unpiped (the first version): a tile is copied whole (pieces of at most 8 KiB, whole rows)
//   on one mbarrier per slot, and x by the producer after the first fill of every ring. A warp
//   starts only when its whole tile has landed, then runs its 128-k blocks one at a time (the
//   loads of a block, then its MMAs in two chains of four, then its scale), about 180
//   instructions per block. Measured on an H200 it ran at 34-44% of the copy ceiling at one
//   row, its time growing with the 128-k blocks per warp (bound by latency per tile), and x
//   waits in the copy engine's queue behind the whole first fill.
// - piped: each tile is copied as k-range pieces, piece j holding bytes [j * kp, (j + 1) * kp)
//   of each of its 8 rows (8 bulk copies of kp = max(1 KiB, in / 4) bytes: 8 * kp bytes per
//   piece, 2 pieces at in = 2048, 4 at 4096 and 8192; a tile of in = 1024 stays whole), each
//   piece on its own mbarrier, and the first fill is issued piece-major (piece 0 of every tile,
//   then piece 1, ...): a warp starts on its tile after 1/pieces of the fill, and once the last
//   bytes land one piece per warp is left. x is copied by the consumer threads themselves
//   (16-byte loads through registers after griddepcontrol.wait, one arrival each on x's
//   barrier), so it does not queue behind the weights. Each warp's block loop is
//   software-pipelined: the block scales are read once per tile (one per lane, the next
//   tile's while the partials are reduced, then shuffled); the next block's weight bytes are
//   loaded before this block's MMAs, whose scale FMAs run one block later; the e4m3 decode
//   takes nine instructions per four bytes instead of ten; A rows whose results are never
//   stored (rows >= m, and rows 8-15 for m <= 8) are not zeroed but read row 0, and for
//   m <= 8 x is stored with the middle words of each 16 bytes swapped so half the A quads are
//   the loaded registers: about 140 instructions per block for m <= 8, 165 above.
//   The arithmetic is the same: per block, each 64-k chunk's chain of four MMAs from zero on
//   the same operands, the two chunks added, acc = fma(scale, sum, acc) over the blocks in
//   increasing order, and the split-k partials added in the same order (the plan, and so the
//   split, is the same for both).

#include "strata_bulk.cuh"
#include "strata_moe_common.cuh"
#include "strata_mma.cuh"

namespace strata {
namespace moe {

#if !STRATA_PLATFORM_HIP

namespace {

constexpr int LS_MAX_WARPS = 16;                     // consumer warps at most
constexpr int LS_THREADS = 32 * (LS_MAX_WARPS + 1);  // + the producer warp
constexpr int LS_COPY = 8192;                        // bytes per bulk copy at most
constexpr int LS_MAX_SLOTS = 64;                     // tile slots (mbarrier pairs)
// the piped kernel's k-range pieces: bytes of each of a tile's 8 rows per piece (one bulk copy
// per row) at least, and pieces per tile at most; its full barriers (slots * pieces) fit in the
// LS_MAX_SLOTS of the header
constexpr int LS_PIECE_MIN = 1024;
constexpr int LS_MAX_PIECES = 4;
constexpr int LS_ROWS = 16;                          // x rows per launch (the MMA's m)
constexpr int LS_TILE = 8;                           // weight rows per item (the MMA's n)
constexpr int LS_MAX_GROUPS = 15;  // named barriers 1..15, one per group of split-k warps
constexpr int LS_OFF_RED = 1152;   // after the full, empty and x barriers (1032 bytes)
// the split kernel: its full, empty and partials barriers (16 slots each) below x's barrier;
// its x starts at LS_OFF_RED (its partials are beside its slots)
constexpr int LS_SPLIT_MAX_SLOTS = 16;
// the split kernel's partials per slot: one float4 per lane of each consumer warp
constexpr int LS_SPLIT_PART_BYTES = LS_MAX_WARPS * 32 * 16;
// the split kernel's f16 row scales, 2^-s and 2^s (16 floats each), between its barriers and x's
constexpr int LS_OFF_ROW_SCALE = 512;
// the split-k partial sums: two tiles' worth (by tile parity) of 4 floats per lane per warp
constexpr int LS_OFF_DATA = LS_OFF_RED + 2 * LS_MAX_WARPS * 32 * 4 * 4;

struct LinStreamParams {
  const uint8_t* x;    // (m, in) bf16
  const uint8_t* w;    // (o, in) e4m3
  const float* scale;  // (ceil(o / bo), ncb)
  uint8_t* out;        // (m, o) bf16
  int m, in, o, bo, bi, ncb;
  int tiles;           // o / 8
  int tile_bytes;      // 8 * in, copied as tile_bytes / copy_bytes copies
  int copy_bytes;
  int groups;          // consumer groups: group g owns tile slots g*depth .. and every
                       // groups-th tile of the CTA
  int ksplit;          // warps per group, each taking ncb / ksplit of a tile's 128-k blocks
  int depth;           // tile slots per group
  int x_stride;        // bytes per x row in shared memory
  int ring_off;        // the tile slots in shared memory
  int pieces;          // the piped kernel: k-range pieces per tile (1: the tile whole), each
  int piece_bytes;     // piece_bytes = in / pieces of each row, on its own full barrier
  int red_off;         // the split kernel: the slots' split-k partial sums in shared memory
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
using namespace strata::bulk;

// Four e4m3 bytes (first element lowest) -> two bf16x2 words, exactly: the sign and the seven
// exponent/mantissa bits are moved into bf16 position, which reads the value times 2^-120
// (subnormals included), then one bf16x2 multiply by 2^120 (exact; bf16 keeps subnormals).
__device__ __forceinline__ void fp8x4_to_bf16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t a = __byte_perm(w, 0u, 0x1404u);  // b1 << 24 | b0 << 8
  const uint32_t b = __byte_perm(w, 0u, 0x3424u);  // b3 << 24 | b2 << 8
  const uint32_t ma = (a & 0x80008000u) | ((a >> 4) & 0x07f007f0u);
  const uint32_t mb = (b & 0x80008000u) | ((b >> 4) & 0x07f007f0u);
  const uint32_t two120 = 0x7b807b80u, neg0 = 0x80008000u;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(lo) : "r"(ma), "r"(two120), "r"(neg0));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(hi) : "r"(mb), "r"(two120), "r"(neg0));
}

// (lo, hi) -> one bf16x2 word, round to nearest even (lo in the low half).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}


// A tile's MMA result d (16 x 8: thread (g, t) holds rows g and g + 8, columns 2t and 2t + 1) as
// bf16 into y's columns o0 .. o0 + 7, rows past m not stored.
__device__ __forceinline__ void ls_store_y(const LinStreamParams& p, int o0, int g, int t,
                                           bool row_a, bool row_b, const float (&d)[4]) {
  const int col = o0 + 2 * t;
  if (row_a) *(uint32_t*)(p.out + ((int64_t)g * p.o + col) * 2) = pack_bf16x2(d[0], d[1]);
  if (row_b) *(uint32_t*)(p.out + ((int64_t)(g + 8) * p.o + col) * 2) = pack_bf16x2(d[2], d[3]);
}

// The piped kernel's e4m3 -> bf16: the same values as fp8x4_to_bf16x4 (the same bf16x2 words
// into the same multiply), in nine instructions instead of ten: the high byte of each bf16
// (sign, then the top three of the seven bits) and its low byte (the low four bits, shifted
// up) are made for the four bytes at once, then paired by two byte shuffles.
__device__ __forceinline__ void fp8x4_to_bf16x4_pipe(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t hb = ((w >> 4) & 0x07070707u) | (w & 0x80808080u);  // per byte: s 0000 eee
  const uint32_t lb = (w & 0x0f0f0f0fu) << 4;                         // per byte: emmm 0000
  const uint32_t ma = __byte_perm(lb, hb, 0x5140u);  // hb1 lb1 hb0 lb0
  const uint32_t mb = __byte_perm(lb, hb, 0x7362u);  // hb3 lb3 hb2 lb2
  const uint32_t two120 = 0x7b807b80u, neg0 = 0x80008000u;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(lo) : "r"(ma), "r"(two120), "r"(neg0));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(hi) : "r"(mb), "r"(two120), "r"(neg0));
}

// The piped kernel's operands of NQ consecutive 64-k chunks from chunk 2 * kb on: per chunk
// the thread's 16 weight bytes, and its 32 x bytes of rows g and g + 8 (rows g + 8 only without
// M8, m <= 8). No zeros for rows >= m: their lanes read row 0 (the same addresses as row 0's
// lanes: one read), and the results of those rows are never stored (each output element
// depends only on its own row of A), which saves the clears and moves zeros cost.
template <int NQ>
__device__ __forceinline__ void ls_load_w(uint4 (&wv)[NQ], const uint8_t* wrow, int kb) {
#pragma unroll
  for (int q = 0; q < NQ; ++q) wv[q] = *(const uint4*)(wrow + (2 * kb + q) * 64);
}
template <int NQ, bool M8>
__device__ __forceinline__ void ls_load_x(uint4 (&xv)[NQ][2][2], const uint8_t* xa,
                                          const uint8_t* xb, int kb) {
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
    const int k0 = (2 * kb + q) * 64;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      xv[q][0][h] = *(const uint4*)(xa + 2 * k0 + 16 * h);
      xv[q][1][h] = M8 ? xv[q][0][h] : *(const uint4*)(xb + 2 * k0 + 16 * h);
    }
  }
}

// part[q] = the chain of four MMAs of chunk q from zero, with the same operands in the same
// k order as the unpiped kernel; the chains are issued step by step across the chunks
// (independent: they overlap). With M8, x is in shared memory with the middle two words of each
// 16 bytes swapped (ua[0], ua[2], ua[1], ua[3] of the unpiped kernel's names), so the A quad of
// MMA 0 (and 2) is the loaded register quad itself (rows 8-15, never stored, take what is
// there).
// F16: x is in shared memory as f16 (scaled per row, see ls_stage_x) and the weights decode to
// f16 (one instruction per pair), the MMAs on f16 operands; else bf16 throughout.
template <int NQ, bool M8, bool F16 = false>
__device__ __forceinline__ void ls_mma(float (&part)[NQ][4], const uint4 (&wv)[NQ],
                                       const uint4 (&xv)[NQ][2][2]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const uint32_t wj[4] = {wv[q].x, wv[q].y, wv[q].z, wv[q].w};
      const uint4 a = xv[q][0][j >> 1], b = xv[q][1][j >> 1];
      uint32_t a0, a1, a2, a3;  // ua[2j], ub[2j], ua[2j + 1], ub[2j + 1]
      if (M8) {
        a0 = j & 1 ? a.y : a.x;
        a2 = j & 1 ? a.w : a.z;
        a1 = a.y;  // rows 8-15: any value
        a3 = a.w;
      } else {
        a0 = j & 1 ? a.z : a.x;
        a2 = j & 1 ? a.w : a.y;
        a1 = j & 1 ? b.z : b.x;
        a3 = j & 1 ? b.w : b.y;
      }
      uint32_t b0, b1;
      if (F16)
        fp8x4_to_f16x4(wj[j], b0, b1);
      else
        fp8x4_to_bf16x4_pipe(wj[j], b0, b1);
      mma_m16n8k16<F16>(part[q], a0, a1, a2, a3, b0, b1);
    }
  }
}

// The piped kernel's 128-k blocks kb0 .. kb1 - 1 of one tile into acc. fb: the slot's piece
// barriers (kpb blocks per piece), waited on (parity par) as the loop reaches them; s_lo / s_hi:
// lane l holds the scale of block kb0 + l / kb0 + 32 + l. Software-pipelined by one block:
// the weight bytes of block kb + 1 are loaded (where its piece has landed) before the MMAs of
// block kb are issued, and the scale FMAs of block kb - 1 (whose MMAs have finished meanwhile)
// follow them; a block's x is loaded as its step starts, and its weights' decode covers that.
template <bool M8, bool F16 = false>
__device__ __forceinline__ void ls_blocks(float (&acc)[4], const uint8_t* wrow,
                                          const uint8_t* xa, const uint8_t* xb, uint64_t* fb,
                                          uint32_t par, int kb0, int kb1, int kpb, float s_lo,
                                          float s_hi) {
  uint4 wa[2], wb[2], xv[2][2][2];  // weights of even / odd steps, x
  float pa[2][4], pb[2][4];         // the chunks' chains of even / odd steps
  int pc = kb0 / kpb, ready = pc * kpb;  // the next piece; the blocks below: landed
  auto need = [&](int kb) {              // blocks come in order: this is piece pc
    if (kb >= ready) {
      mbar_wait(fb + pc, par);
      ++pc;
      ready += kpb;
    }
  };
  bool ahead = false;  // the next block's weights are loaded
  // one step: block kb's MMAs from w, the next block's weights into w_next where landed
  auto step = [&](float (&pp)[2][4], uint4 (&w)[2], uint4 (&w_next)[2], int kb) {
    if (!ahead) {
      need(kb);
      ls_load_w<2>(w, wrow, kb);
    }
    ls_load_x<2, M8>(xv, xa, xb, kb);
    ahead = kb + 1 < kb1 && kb + 1 < ready;
    if (ahead) ls_load_w<2>(w_next, wrow, kb + 1);
#pragma unroll
    for (int c = 0; c < 2; ++c) pp[c][0] = pp[c][1] = pp[c][2] = pp[c][3] = 0.f;
    ls_mma<2, M8, F16>(pp, w, xv);
  };
  auto finish = [&](const float (&pp)[2][4], int kb) {
    const int j = kb - kb0;
    const float sc = __shfl_sync(0xffffffffu, j < 32 ? s_lo : s_hi, j & 31);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = fmaf(sc, pp[0][i] + pp[1][i], acc[i]);
  };
  step(pa, wa, wb, kb0);
  for (int kb = kb0 + 1;; kb += 2) {
    if (kb >= kb1) {
      finish(pa, kb - 1);
      break;
    }
    step(pb, wb, wa, kb);
    finish(pa, kb - 1);
    if (kb + 1 >= kb1) {
      finish(pb, kb);
      break;
    }
    step(pa, wa, wb, kb + 1);
    finish(pb, kb);
  }
}

// The split kernel's blocks kb0 .. kb1 - 1 of two tiles at once (weight rows wa and wb, block
// scales in s0 / s1 as ls_blocks takes them): each block's x is loaded once for both tiles and
// the two tiles' MMA chains are independent, so a warp has four chains in flight where
// ls_blocks has two. Per tile the same arithmetic as ls_blocks: each 64-k chunk's chain of four
// MMAs from zero, the block's two chunks added, acc = fma(scale, sum, acc) in block order.
template <bool M8, bool F16>
__device__ __forceinline__ void ls_blocks_pair(float (&acc)[2][4], const uint8_t* wa,
                                               const uint8_t* wb, const uint8_t* xa,
                                               const uint8_t* xb, int kb0, int kb1,
                                               const float (&s0)[2], const float (&s1)[2]) {
  for (int kb = kb0; kb < kb1; ++kb) {
    uint4 w0[2], w1[2], xv[2][2][2];
    ls_load_w<2>(w0, wa, kb);
    ls_load_w<2>(w1, wb, kb);
    ls_load_x<2, M8>(xv, xa, xb, kb);
    float p0[2][4], p1[2][4];
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) p0[c][i] = p1[c][i] = 0.f;
    ls_mma<2, M8, F16>(p0, w0, xv);
    ls_mma<2, M8, F16>(p1, w1, xv);
    const int j = kb - kb0;
    const float sc0 = __shfl_sync(0xffffffffu, j < 32 ? s0[0] : s0[1], j & 31);
    const float sc1 = __shfl_sync(0xffffffffu, j < 32 ? s1[0] : s1[1], j & 31);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[0][i] = fmaf(sc0, p0[0][i] + p0[1][i], acc[0][i]);
      acc[1][i] = fmaf(sc1, p1[0][i] + p1[1][i], acc[1][i]);
    }
  }
}

// A warp's block scales of its blocks kb0 .. kb1 - 1 of weight tile `tile`: lane l holds those
// of blocks kb0 + l and kb0 + 32 + l (ncb <= 64); zeros where tile < 0 (past the CTA's last).
__device__ __forceinline__ void ls_tile_scales(const LinStreamParams& p, int tile, int kb0,
                                               int kb1, int lane, float& lo, float& hi) {
  lo = hi = 0.f;
  if (tile < 0) return;
  const float* s = p.scale + (int64_t)(tile * LS_TILE / p.bo) * p.ncb + kb0;
  if (lane < kb1 - kb0) lo = __ldg(s + lane);
  if (lane + 32 < kb1 - kb0) hi = __ldg(s + lane + 32);
}

// x into shared memory by the consumer threads (tid < 32 * LS_MAX_WARPS), once the kernel
// before this one (which wrote x) has finished: through registers, eight 16-byte loads in
// flight per thread, rows x_stride apart; for m <= 8 (M8) the middle two words of each 16
// bytes swapped (see ls_mma). Then one arrival each on xbar.
//
// F16 (the split kernel's f16 operands): then each row is scaled by a power of two 2^s_n so that
// its largest magnitude lies in [2^14, 2^15) and stored as f16 (row_scale[n] = 2^-s_n, to undo
// it on y). The scaling is exact, and so is the f16 of every element within 2^28 of its row's
// largest (f16's normal range): for those rows the products, their sums and y are those of the
// bf16 operands times 2^s_n. Three passes among the consumer threads (named barrier 2): the raw
// rows stored, each row's largest magnitude by one warp, the rows converted in place.
template <bool M8, bool F16 = false>
__device__ __forceinline__ void ls_stage_x(const LinStreamParams& p, uint8_t* x_s, uint64_t* xbar,
                                           int tid, float* row_scale = nullptr) {
  // F16: row_scale[n] = 2^-s_n, and row_scale[LS_ROWS + n] = 2^s_n
  pdl_wait_primary();
  const int chunks = p.in / 8, total = p.m * chunks;  // 16-byte pieces of x
  for (int i0 = tid; i0 < total; i0 += 8 * 32 * LS_MAX_WARPS) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * 32 * LS_MAX_WARPS;
      if (i < total) v[u] = *(const uint4*)(p.x + (int64_t)i * 16);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * 32 * LS_MAX_WARPS;
      if (i >= total) break;
      const int n = i / chunks, c = i - n * chunks;
      *(uint4*)(x_s + (int64_t)n * p.x_stride + 16 * c) =
          M8 ? make_uint4(v[u].x, v[u].z, v[u].y, v[u].w) : v[u];
    }
  }
  if constexpr (F16) {
    constexpr int consumers = 32 * LS_MAX_WARPS;
    asm volatile("bar.sync 2, %0;" ::"r"(consumers) : "memory");
    const int warp = tid >> 5, lane = tid & 31;
    float* scale_s = row_scale + LS_ROWS;
    if (warp < p.m) {  // row warp's largest magnitude (float bits order as the values do)
      uint32_t mx = 0;
      for (int c = lane; c < chunks; c += 32) {
        const uint4 v = *(const uint4*)(x_s + (int64_t)warp * p.x_stride + 16 * c);
        const uint32_t wd[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) mx = max(mx, bf16x2_abs_max_bits(wd[i]));
      }
      asm("redux.sync.max.u32 %0, %0, 0xffffffff;" : "+r"(mx));
      float scale, unscale;
      f16_row_scale(mx, scale, unscale);
      if (lane == 0) {
        scale_s[warp] = scale;
        row_scale[warp] = unscale;
      }
    }
    asm volatile("bar.sync 2, %0;" ::"r"(consumers) : "memory");
    for (int i = tid; i < total; i += consumers) {
      const int n = i / chunks, c = i - n * chunks;
      uint4* q = (uint4*)(x_s + (int64_t)n * p.x_stride + 16 * c);
      *q = bf16x8_scaled_to_f16x8(*q, scale_s[n]);
    }
  }
  mbar_arrive(xbar);
}
#endif  // __CUDA_ARCH__ >= 900

// PIPE: the piped kernel (else the unpiped one, as first measured); M8: m <= 8 (piped only).
template <bool PIPE, bool M8>
__global__ void __launch_bounds__(LS_THREADS, 1) linear_fp8_stream(LinStreamParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = (uint64_t*)smem;
  uint64_t* empty = full + LS_MAX_SLOTS;
  uint64_t* xbar = empty + LS_MAX_SLOTS;
  uint8_t* x_s = smem + LS_OFF_DATA;
  uint8_t* ring = smem + p.ring_off;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int C = p.groups, D = p.depth, KS = p.ksplit;
  const int P = PIPE ? p.pieces : 1;  // full barriers per slot: slot s's piece j is s * P + j
  const int n_local =
      p.tiles > (int)blockIdx.x ? (p.tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
  if (tid == 0) {
    for (int s = 0; s < C * D; ++s) {
      for (int j = 0; j < P; ++j) mbar_init(full + s * P + j, 1);
      mbar_init(empty + s, 1);
    }
    // piped: every consumer thread arrives on it once its share of x is stored
    mbar_init(xbar, PIPE ? 32 * LS_MAX_WARPS : 1);
    mbar_init_fence();
  }
  __syncthreads();
  pdl_launch_dependents();

  if (warp == LS_MAX_WARPS) {  // the producer: one thread issues every copy
    if (lane == 0 && PIPE) {
      const uint64_t pol = l2_evict_first();
      const int kp = p.piece_bytes;
      // piece j of the CTA's tile li: 8 copies of kp bytes (one per row), or the tile whole
      auto issue = [&](int li, int j) {
        const int k = li / C, slot = (li % C) * D + k % D;
        const uint8_t* src = p.w + (int64_t)((int)blockIdx.x + li * (int)gridDim.x) * p.tile_bytes;
        uint8_t* dst = ring + (int64_t)slot * p.tile_bytes;
        uint64_t* bar = full + slot * P + j;
        if (P == 1) {
          mbar_expect_tx(bar, (uint32_t)p.tile_bytes);
          for (int off = 0; off < p.tile_bytes; off += p.copy_bytes)
            bulk::load(dst + off, src + off, (uint32_t)p.copy_bytes, bar, pol);
          return;
        }
        mbar_expect_tx(bar, (uint32_t)(LS_TILE * kp));
        for (int r = 0; r < LS_TILE; ++r) {
          const int off = r * p.in + j * kp;
          bulk::load(dst + off, src + off, (uint32_t)kp, bar, pol);
        }
      };
      // The first fill of every ring (the first D tiles of each group) at once, piece-major:
      // every warp's first piece lands after 1/P of the fill. x is the consumers' (after the
      // kernel before this one, which wrote it, has finished). Then each later tile, all its
      // pieces, as its slot is released.
      const int first = n_local < C * D ? n_local : C * D;
      for (int j = 0; j < P; ++j)
        for (int li = 0; li < first; ++li) issue(li, j);
      for (int li = first; li < n_local; ++li) {
        const int k = li / C, slot = (li % C) * D + k % D;
        mbar_wait(empty + slot, (k / D - 1) & 1);
        for (int j = 0; j < P; ++j) issue(li, j);
      }
    } else if (lane == 0) {
      const uint64_t pol = l2_evict_first();
      auto issue = [&](int li, bool wait_empty) {
        const int k = li / C, slot = (li % C) * D + k % D;
        const uint8_t* src = p.w + (int64_t)((int)blockIdx.x + li * (int)gridDim.x) * p.tile_bytes;
        uint8_t* dst = ring + (int64_t)slot * p.tile_bytes;
        if (wait_empty) mbar_wait(empty + slot, (k / D - 1) & 1);
        mbar_expect_tx(full + slot, (uint32_t)p.tile_bytes);
        for (int off = 0; off < p.tile_bytes; off += p.copy_bytes)
          bulk::load(dst + off, src + off, (uint32_t)p.copy_bytes, full + slot, pol);
      };
      // The first fill of every ring needs nothing from the kernel before this one: it is
      // issued at once (the first D tiles of each group). Then x, once that kernel (which
      // wrote x) has finished; no slot is released before x lands, so the rest waits for the
      // releases.
      const int first = n_local < C * D ? n_local : C * D;
      for (int li = 0; li < first; ++li) issue(li, false);
      pdl_wait_primary();
      const uint32_t row = (uint32_t)p.in * 2;
      mbar_expect_tx(xbar, row * (uint32_t)p.m);
      for (int n = 0; n < p.m; ++n)
        bulk::load(x_s + (int64_t)n * p.x_stride, p.x + (int64_t)n * row, row, xbar);
      for (int li = first; li < n_local; ++li) issue(li, true);
    }
    return;
  }
  if (PIPE) ls_stage_x<M8>(p, x_s, xbar, tid);
  const int grp = warp / KS, ks = warp % KS;
  if (grp >= C || n_local <= grp) return;

  const int g = lane >> 2, t = lane & 3;
  const bool row_a = g < p.m, row_b = g + 8 < p.m;
  const uint8_t* xa = x_s + (int64_t)g * p.x_stride + 32 * t;
  const uint8_t* xb = x_s + (int64_t)(g + 8) * p.x_stride + 32 * t;
  const int row_off = g * p.in + 16 * t;
  const int kb0 = ks * p.ncb / KS, kb1 = (ks + 1) * p.ncb / KS;  // this warp's 128-k blocks
  float4* red = (float4*)(smem + LS_OFF_RED);
  // piped: this warp's block scales of its li-th tile, lane l holding blocks kb0 + l and
  // kb0 + 32 + l (ncb <= 64)
  auto scales = [&](int li, float& lo, float& hi) {
    ls_tile_scales(p, li < n_local ? (int)blockIdx.x + li * (int)gridDim.x : -1, kb0, kb1, lane,
                   lo, hi);
  };
  float s_lo = 0.f, s_hi = 0.f;
  if (PIPE) scales(grp, s_lo, s_hi);
  mbar_wait(xbar, 0);
  for (int li = grp, k = 0; li < n_local; li += C, ++k) {
    const int tile = (int)blockIdx.x + li * (int)gridDim.x;
    const int o0 = tile * LS_TILE;
    // this thread's weight row: row g of the tile in slot grp*D + k % D
    const int slot = grp * D + k % D;
    const uint8_t* wrow = ring + (int64_t)slot * p.tile_bytes + row_off;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (PIPE) {
      // rows >= m read row 0 (see ls_load)
      const uint8_t* xa0 = row_a ? xa : x_s + 32 * t;
      const uint8_t* xb0 = row_b ? xb : x_s + 32 * t;
      ls_blocks<M8>(acc, wrow, xa0, xb0, full + slot * P, (k / D) & 1, kb0, kb1, p.ncb / P,
                    s_lo, s_hi);
      scales(li + C, s_lo, s_hi);  // the next tile's (a refill: its copies have not landed)
    } else {
      const float* srow = p.scale + (int64_t)(o0 / p.bo) * p.ncb;
      float sc = __ldg(srow + kb0);
      mbar_wait(full + slot, (k / D) & 1);
      // Per 128-k block: two chains of four MMAs (one per 64-k chunk; the other warps of the SM
      // hide their latency), summed, then scaled into acc.
      for (int kb = kb0; kb < kb1; ++kb) {
        const float sc_next = kb + 1 < kb1 ? __ldg(srow + kb + 1) : 0.f;
        float part_sum[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        uint4 wv[2], xv[2][2][2];  // [chunk][row a / b][low / high 16 bytes]
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int k0 = (2 * kb + c) * 64;
          wv[c] = *(const uint4*)(wrow + k0);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            xv[c][0][h] =
                row_a ? *(const uint4*)(xa + 2 * k0 + 16 * h) : make_uint4(0, 0, 0, 0);
            xv[c][1][h] =
                row_b ? *(const uint4*)(xb + 2 * k0 + 16 * h) : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint32_t wj[4] = {wv[c].x, wv[c].y, wv[c].z, wv[c].w};
          const uint32_t ua[8] = {xv[c][0][0].x, xv[c][0][0].y, xv[c][0][0].z, xv[c][0][0].w,
                                  xv[c][0][1].x, xv[c][0][1].y, xv[c][0][1].z, xv[c][0][1].w};
          const uint32_t ub[8] = {xv[c][1][0].x, xv[c][1][0].y, xv[c][1][0].z, xv[c][1][0].w,
                                  xv[c][1][1].x, xv[c][1][1].y, xv[c][1][1].z, xv[c][1][1].w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t b0, b1;
            fp8x4_to_bf16x4(wj[j], b0, b1);
            mma_m16n8k16(part_sum[c], ua[2 * j], ub[2 * j], ua[2 * j + 1], ub[2 * j + 1], b0, b1);
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
          acc[i] = fmaf(sc, part_sum[0][i] + part_sum[1][i], acc[i]);
        sc = sc_next;
      }
    }
    // The group's warps: partial sums through shared memory, added in k order by warp 0 of
    // the group (a fixed order); after the group's barrier no warp reads the tile's stages.
    float4* mine = red + ((k & 1) * LS_MAX_WARPS + warp) * 32 + lane;
    if (KS > 1) {
      if (ks) *mine = make_float4(acc[0], acc[1], acc[2], acc[3]);
      asm volatile("bar.sync %0, %1;" ::"r"(1 + grp), "r"(32 * KS) : "memory");
    } else {
      __syncwarp();
    }
    if (ks) continue;
    if (lane == 0) mbar_arrive(empty + slot);
    for (int w2 = 1; w2 < KS; ++w2) {
      const float4 v = mine[w2 * 32];
      acc[0] += v.x; acc[1] += v.y; acc[2] += v.z; acc[3] += v.w;
    }
    ls_store_y(p, o0, g, t, row_a, row_b, acc);
  }
#endif
}

// The split kernel: the k range of every tile split over all 16 consumer warps (warp w takes
// 128-k blocks w * ncb / 16 .. (w + 1) * ncb / 16 of each tile), and the CTA's tiles passing
// through one ring of slots in order. Why: in the kernels above a tile is computed by the
// warps of one group after the whole tile has landed, one block after another, so a tile costs
// its warp's whole chain of blocks; here every warp takes a share of each tile as that tile
// lands. Each warp's blocks run through ls_blocks (the piped kernel's block loop: the same
// per-block arithmetic); its partial sum goes to the slot's partials in shared memory and the
// warp arrives on the slot's "partials" barrier (an mbarrier arrival releases the warp's stores:
// no fence or atomic, nothing the consumer waits on). A reducer warp (the 18th) waits for each
// slot's 16 partials in tile order, adds them in warp order (k order: a fixed order), stores y
// and only then releases the slot to the producer, so neither the slot's weights nor its
// partials are overwritten before they are read. A row's sum depends only on its row of x (as
// in the kernels above), but the split is another order than theirs: other bits.
constexpr int LS_SPLIT_THREADS = 32 * (LS_MAX_WARPS + 2);  // + the producer and reducer warps

// PAIR: each consumer warp takes two tiles per step (ls_blocks_pair), else one (ls_blocks).
// F16: f16 operands (x scaled per row by a power of two, see ls_stage_x), else bf16.
template <bool M8, bool PAIR, bool F16>
__global__ void __launch_bounds__(LS_SPLIT_THREADS, 1) linear_fp8_split(LinStreamParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = (uint64_t*)smem;
  uint64_t* empty = full + LS_SPLIT_MAX_SLOTS;
  uint64_t* parts = empty + LS_SPLIT_MAX_SLOTS;  // per slot: the 16 warps' partials are stored
  uint64_t* xbar = full + 2 * LS_MAX_SLOTS;
  uint8_t* x_s = smem + LS_OFF_RED;
  uint8_t* ring = smem + p.ring_off;
  float4* red = (float4*)(smem + p.red_off);
  // F16: 2^-s_n of each row (ls_stage_x), applied to y; stored before x's barrier completes
  float* row_scale = (float*)(smem + LS_OFF_ROW_SCALE);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int D = p.depth;
  constexpr int KS = LS_MAX_WARPS;
  const int n_local =
      p.tiles > (int)blockIdx.x ? (p.tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
  if (tid == 0) {
    for (int s = 0; s < D; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, 1);
      mbar_init(parts + s, KS);
    }
    mbar_init(xbar, 32 * KS);
    mbar_init_fence();
  }
  __syncthreads();
  pdl_launch_dependents();

  const int g = lane >> 2, t = lane & 3;
  const bool row_a = g < p.m, row_b = g + 8 < p.m;
  if (warp == KS) {  // the producer: one thread issues every copy, in tile order
    if (lane == 0) {
      const uint64_t pol = l2_evict_first();
      for (int li = 0; li < n_local; ++li) {
        const int slot = li % D;
        const uint8_t* src = p.w + (int64_t)((int)blockIdx.x + li * (int)gridDim.x) * p.tile_bytes;
        uint8_t* dst = ring + (int64_t)slot * p.tile_bytes;
        if (li >= D) mbar_wait(empty + slot, (li / D - 1) & 1);
        mbar_expect_tx(full + slot, (uint32_t)p.tile_bytes);
        for (int off = 0; off < p.tile_bytes; off += p.copy_bytes)
          bulk::load(dst + off, src + off, (uint32_t)p.copy_bytes, full + slot, pol);
      }
    }
    return;
  }
  if (warp == KS + 1) {  // the reducer: each tile's partials in warp order, then y
    float ua = 1.f, ub = 1.f;  // F16: the rows' 2^-s
    if (F16) {
      mbar_wait(xbar, 0);
      ua = row_a ? row_scale[g] : 1.f;
      ub = row_b ? row_scale[g + 8] : 1.f;
    }
    for (int li = 0; li < n_local; ++li) {
      const int slot = li % D;
      mbar_wait(parts + slot, (li / D) & 1);
      const float4* part = red + (int64_t)slot * KS * 32 + lane;
      float4 v[KS];
#pragma unroll
      for (int w2 = 0; w2 < KS; ++w2) v[w2] = part[w2 * 32];
      float y[4] = {v[0].x, v[0].y, v[0].z, v[0].w};
#pragma unroll
      for (int w2 = 1; w2 < KS; ++w2) {
        y[0] += v[w2].x; y[1] += v[w2].y; y[2] += v[w2].z; y[3] += v[w2].w;
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + slot);  // the partials are read: the slot may refill
      if (F16) {
        y[0] *= ua; y[1] *= ua; y[2] *= ub; y[3] *= ub;
      }
      ls_store_y(p, ((int)blockIdx.x + li * (int)gridDim.x) * LS_TILE, g, t, row_a, row_b, y);
    }
    return;
  }
  ls_stage_x<M8, F16>(p, x_s, xbar, tid, row_scale);

  // rows >= m read row 0 (see ls_load_x)
  const uint8_t* xa = x_s + (int64_t)(row_a ? g : 0) * p.x_stride + 32 * t;
  const uint8_t* xb = x_s + (int64_t)(row_b ? g + 8 : 0) * p.x_stride + 32 * t;
  const int row_off = g * p.in + 16 * t;
  const int kb0 = warp * p.ncb / KS, kb1 = (warp + 1) * p.ncb / KS;  // this warp's blocks
  // this warp's block scales of the CTA's li-th tile: lane l holds blocks kb0 + l, kb0 + 32 + l
  auto scales = [&](int li, float& lo, float& hi) {
    ls_tile_scales(p, li < n_local ? (int)blockIdx.x + li * (int)gridDim.x : -1, kb0, kb1, lane,
                   lo, hi);
  };
  float sc[2][2];  // the block scales of the step's tiles (see scales)
  scales(0, sc[0][0], sc[0][1]);
  if (PAIR) scales(1, sc[1][0], sc[1][1]);
  mbar_wait(xbar, 0);
  // stores a tile's partial and arrives on its slot's partials barrier
  auto hand_in = [&](int li, const float (&acc)[4]) {
    const int slot = li % D;
    red[((int64_t)slot * KS + warp) * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncwarp();  // the warp's stores before its lane 0's arrival (which releases them)
    if (lane == 0) mbar_arrive(parts + slot);
  };
  for (int li = 0; li < n_local; li += PAIR ? 2 : 1) {
    const int slot = li % D;
    const uint8_t* wrow = ring + (int64_t)slot * p.tile_bytes + row_off;
    if (PAIR && li + 1 < n_local) {
      const int slot1 = (li + 1) % D;
      const uint8_t* wrow1 = ring + (int64_t)slot1 * p.tile_bytes + row_off;
      mbar_wait(full + slot, (li / D) & 1);
      mbar_wait(full + slot1, ((li + 1) / D) & 1);
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      ls_blocks_pair<M8, F16>(acc, wrow, wrow1, xa, xb, kb0, kb1, sc[0], sc[1]);
      scales(li + 2, sc[0][0], sc[0][1]);
      scales(li + 3, sc[1][0], sc[1][1]);
      hand_in(li, acc[0]);
      hand_in(li + 1, acc[1]);
    } else {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      ls_blocks<M8, F16>(acc, wrow, xa, xb, full + slot, (li / D) & 1, kb0, kb1, p.ncb,
                         sc[0][0], sc[0][1]);
      scales(li + 1, sc[0][0], sc[0][1]);
      hand_in(li, acc);
    }
  }
#endif
}

// The plan for in-feature count `in` and m rows: tile slots, consumer groups and the warps per
// group, or false when the shapes are outside what the kernel takes.
bool plan_linear_stream(LinStreamParams& p, const DeviceFacts& dev) {
  if (dev.major < 9 || dev.sms < 1) return false;
  if (p.in < 1024 || p.in > 8192 || (p.in & (p.in - 1))) return false;  // whole rows per copy
  if (p.o % LS_TILE || p.bo % LS_TILE || p.bi != 128) return false;
  if (p.m < 1 || p.m > LS_ROWS) return false;
  p.tiles = p.o / LS_TILE;
  p.tile_bytes = LS_TILE * p.in;
  p.copy_bytes = p.tile_bytes < LS_COPY ? p.tile_bytes : LS_COPY;
  p.ncb = p.in / p.bi;
  p.x_stride = 2 * p.in + 16;
  p.ring_off = (LS_OFF_DATA + p.m * p.x_stride + 127) & ~127;
  int slots = (dev.smem_optin - p.ring_off) / p.tile_bytes;  // tile slots that fit
  slots = slots > LS_MAX_SLOTS ? LS_MAX_SLOTS : slots;
  if (slots < 1) return false;
  // As many groups (each a ring of tile slots, computed by its own warps) as the CTA has
  // tiles, as far as the slots and the 15 named barriers go: measured on an H200, one tile per
  // warp streamed 10-35% faster than fewer groups whose warps split each tile's k range (the
  // MMA chains and the per-tile reduction then serialise); the warps left over split k.
  const int per_cta = (p.tiles + dev.sms - 1) / dev.sms;
  int groups = per_cta < LS_MAX_GROUPS ? per_cta : LS_MAX_GROUPS;
  groups = groups < slots ? groups : slots;
  const int per_group = (per_cta + groups - 1) / groups;
  int depth = slots / groups;
  depth = depth < per_group ? depth : per_group;
  int ksplit = LS_MAX_WARPS / groups;
  while (ksplit > 1 && p.ncb % ksplit) --ksplit;
  p.groups = groups;
  p.ksplit = ksplit;
  p.depth = depth;
  p.pieces = 1;
  p.piece_bytes = p.in;
  return true;
}

// The split kernel's plan (after plan_linear_stream: the tiles and copies), or false where it
// does not take the shapes: at least one 128-k block per warp (in >= 2048) and two slots of a
// tile and its partials beside x. Taken or not is decided at 16 rows (LS_ROWS) whatever m is,
// so a row's bits never depend on how many rows share its launch.
bool plan_linear_split(LinStreamParams& p, const DeviceFacts& dev) {
  if (p.ncb % LS_MAX_WARPS) return false;
  const int per_slot = p.tile_bytes + LS_SPLIT_PART_BYTES;
  const int full_off = (LS_OFF_RED + LS_ROWS * p.x_stride + 127) & ~127;
  if ((dev.smem_optin - full_off) / per_slot < 2) return false;
  p.ring_off = (LS_OFF_RED + p.m * p.x_stride + 127) & ~127;
  int slots = (dev.smem_optin - p.ring_off) / per_slot;
  slots = slots > LS_SPLIT_MAX_SLOTS ? LS_SPLIT_MAX_SLOTS : slots;
  const int per_cta = (p.tiles + dev.sms - 1) / dev.sms;
  p.depth = slots < per_cta ? slots : per_cta;
  // the launch switches' cap on the slots in flight (bits 16-19; 0: as many as fit)
  const int cap = (strata_gpu_moe_set_options(-1) >> STRATA_LINEAR_SPLIT_DEPTH_SHIFT) & 15;
  if (cap > 0 && p.depth > cap) p.depth = cap;
  p.red_off = p.ring_off + p.depth * p.tile_bytes;
  p.groups = 1;
  p.ksplit = LS_MAX_WARPS;
  return true;
}

// The piped kernel's k-range pieces (after plan_linear_stream; the plan is the same for both
// kernels, so are the bits): bytes of each row per piece max(LS_PIECE_MIN, in / LS_MAX_PIECES),
// fewer pieces where the slots' full barriers would not fit the header.
void plan_pieces(LinStreamParams& p) {
  int pieces = p.in / LS_PIECE_MIN;
  pieces = pieces > LS_MAX_PIECES ? LS_MAX_PIECES : pieces < 1 ? 1 : pieces;
  while (pieces > 1 && p.groups * p.depth * pieces > LS_MAX_SLOTS) pieces /= 2;
  p.pieces = pieces;
  p.piece_bytes = p.in / pieces;
}

// ------------------------------------------------------------------------------------------------
// The small bf16 linear on tensor cores (linear_bf16_mma): y (m, o) = x (m, in) . W^T for a
// bf16 W of few inputs (in a multiple of 32 up to LM_MAX_IN) and at most 16 rows: the GEMMs of
// a launch-bound decode window (the embedded model's), where cuBLAS takes about 2.5 us for a few
// hundred KB. A CTA owns 8 output features (the MMA's n) and all 16 rows (its m); its LM_WARPS
// warps split the k range in contiguous 32-k steps, each lane reading 16 bytes of its feature's
// row and of x's row g (and g + 8) per step, and run two MMAs a step (the lane's first and last
// four k's: the k order inside an MMA is permuted the same way for A and B, as in the FP8
// kernels above) into two accumulators. The warps' partial sums are added in warp order
// through shared memory. A programmatic dependent launch: every weight byte is loaded before
// griddepcontrol.wait, while the kernel before it (which writes x) finishes; x is read after
// it. Each output element depends only on its row of x and its row of W: a row's result is the
// same bits in any launch.
constexpr int LM_WARPS = 4;                        // warps per CTA (split k)
constexpr int LM_MAX_IN = 1024;                    // inputs at most
constexpr int LM_STEPS = LM_MAX_IN / 32 / LM_WARPS;  // 32-k steps per warp at most

struct LinMmaParams {
  const uint8_t* x;  // (m, in) bf16
  const uint8_t* w;  // (o, in) bf16
  uint8_t* out;      // (m, o) bf16
  int m, in, o;
};

template <bool HI>  // rows 8..15 present (m > 8)
__global__ void __launch_bounds__(32 * LM_WARPS) linear_bf16_mma(LinMmaParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float4 part[LM_WARPS - 1][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int o0 = blockIdx.x * 8;
  const int steps = p.in >> 5;
  const int s0 = warp * steps / LM_WARPS, ns = (warp + 1) * steps / LM_WARPS - s0;
  const int64_t row = 2 * (int64_t)p.in;  // bytes per row of W and of x
  const bool wlive = o0 + g < p.o;
  const uint8_t* wp = p.w + (int64_t)(o0 + g) * row + 64 * s0 + 16 * c;
  uint4 w[LM_STEPS];
#pragma unroll
  for (int s = 0; s < LM_STEPS; ++s)
    w[s] = wlive && s < ns ? ldg16(wp + 64 * s) : make_uint4(0, 0, 0, 0);
  pdl_wait_primary();
  pdl_launch_dependents();
  const uint8_t* xlo = p.x + (int64_t)g * row + 64 * s0 + 16 * c;
  const bool lo_live = g < p.m, hi_live = HI && g + 8 < p.m;
  uint4 a[LM_STEPS], b[LM_STEPS];
#pragma unroll
  for (int s = 0; s < LM_STEPS; ++s) {
    a[s] = lo_live && s < ns ? __ldcg((const uint4*)(xlo + 64 * s)) : make_uint4(0, 0, 0, 0);
    b[s] = hi_live && s < ns ? __ldcg((const uint4*)(xlo + 8 * row + 64 * s))
                             : make_uint4(0, 0, 0, 0);
  }
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s = 0; s < LM_STEPS; ++s) {
    if (s < ns) {
      mma_m16n8k16(d0, a[s].x, b[s].x, a[s].y, b[s].y, w[s].x, w[s].y);
      mma_m16n8k16(d1, a[s].z, b[s].z, a[s].w, b[s].w, w[s].z, w[s].w);
    }
  }
  float4 mine = make_float4(d0[0] + d1[0], d0[1] + d1[1], d0[2] + d1[2], d0[3] + d1[3]);
  if (warp) part[warp - 1][lane] = mine;
  __syncthreads();
  if (warp) return;
#pragma unroll
  for (int k = 0; k < LM_WARPS - 1; ++k) {
    const float4 q = part[k][lane];
    mine.x += q.x;
    mine.y += q.y;
    mine.z += q.z;
    mine.w += q.w;
  }
  // thread (g, c) holds y[g][o0 + 2c, + 1] and y[g + 8][o0 + 2c, + 1]
  uint16_t* y = (uint16_t*)p.out;
  const int col = o0 + 2 * c;
  const float v[4] = {mine.x, mine.y, mine.z, mine.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i >> 1), n = col + (i & 1);
    if (r < p.m && n < p.o) y[(int64_t)r * p.o + n] = float_to_bf16(v[i]);
  }
#endif
}

}  // namespace

bool linear_stream_takes(int64_t m, int64_t in, int64_t o, int64_t bo, int64_t bi, int w_dtype,
                         int x_dtype, int device) {
  if (w_dtype != STRATA_DTYPE_FP8 || x_dtype != STRATA_DTYPE_BF16) return false;
  LinStreamParams p = {};
  p.m = m < LS_ROWS ? (int)m : LS_ROWS;
  p.in = (int)in;
  p.o = (int)o;
  p.bo = (int)bo;
  p.bi = (int)bi;
  return in <= 8192 && o < (1 << 30) && plan_linear_stream(p, device_facts(device));
}

int launch_linear_stream(const void* x, const void* w, const float* scale, void* out, int64_t m,
                         int64_t in, int64_t o, int64_t bo, int64_t bi, int device, bool pdl,
                         cudaStream_t st) {
  const DeviceFacts dev = device_facts(device);
  // the launch switches (strata_gpu_moe_set_options): the split kernel where it takes the
  // shapes (in pairs, on f16 operands, its ring capped), else the piped or the unpiped one
  const int opts = strata_gpu_moe_set_options(-1);
  const bool split = (opts & STRATA_LINEAR_SPLIT) != 0;
  const bool pair = (opts & STRATA_LINEAR_SPLIT_PAIR) != 0;
  const bool f16 = (opts & STRATA_LINEAR_F16) != 0;
  const bool pipe = (opts & STRATA_LINEAR_PIPE) != 0;
  using Kernel = void (*)(LinStreamParams);
  // the split kernels by (m <= 8, pairs, f16 operands)
  static const Kernel split_kernels[8] = {
      linear_fp8_split<false, false, false>, linear_fp8_split<false, false, true>,
      linear_fp8_split<false, true, false>,  linear_fp8_split<false, true, true>,
      linear_fp8_split<true, false, false>,  linear_fp8_split<true, false, true>,
      linear_fp8_split<true, true, false>,   linear_fp8_split<true, true, true>};
  static int allowed[3 + 8] = {};  // per kernel: unpiped, piped m <= 8, piped, the split ones
  for (int64_t r0 = 0; r0 < m; r0 += LS_ROWS) {
    LinStreamParams p = {};
    p.m = (int)(m - r0 < LS_ROWS ? m - r0 : LS_ROWS);
    p.in = (int)in;
    p.o = (int)o;
    p.bo = (int)bo;
    p.bi = (int)bi;
    if (!plan_linear_stream(p, dev)) {  // callers ask linear_stream_takes first
      gpu_set_last_kernel("linear_fp8: linear_fp8_stream");
      return (int)cudaErrorInvalidValue;
    }
    p.x = (const uint8_t*)x + r0 * in * 2;
    p.w = (const uint8_t*)w;
    p.scale = scale;
    p.out = (uint8_t*)out + r0 * o * 2;
    const bool use_split = split && plan_linear_split(p, dev);
    if (pipe && !use_split) plan_pieces(p);
    const int split_which = (p.m <= 8 ? 4 : 0) + (pair ? 2 : 0) + (f16 ? 1 : 0);
    const int which = use_split ? 3 + split_which : !pipe ? 0 : p.m <= 8 ? 1 : 2;
    const Kernel kernel = which == 0   ? linear_fp8_stream<false, false>
                          : which == 1 ? linear_fp8_stream<true, true>
                          : which == 2 ? linear_fp8_stream<true, false>
                                       : split_kernels[split_which];
    const char* name = use_split ? (f16 ? "linear_fp8: linear_fp8_split (f16 operands)"
                                        : "linear_fp8: linear_fp8_split")
                       : pipe    ? "linear_fp8: linear_fp8_stream (piped)"
                                 : "linear_fp8: linear_fp8_stream";
    const int smem = use_split ? p.red_off + p.depth * LS_SPLIT_PART_BYTES
                               : p.ring_off + p.groups * p.depth * p.tile_bytes;
    if (int rc = allow_smem(kernel, smem, allowed[which], name)) return rc;
    const int grid = p.tiles < dev.sms ? p.tiles : dev.sms;
    launch_maybe_pdl(kernel, dim3((unsigned)grid), dim3(use_split ? LS_SPLIT_THREADS : LS_THREADS),
                     smem, st, pdl, p);
    if (int rc = take_launch_error(name)) return rc;
  }
  return 0;
}

bool linear_bf16_mma_takes(int64_t m, int64_t in, int64_t o, int device) {
  return m >= 1 && m <= 16 && in >= 32 && in % 32 == 0 && in <= LM_MAX_IN && o >= 1 &&
         o < (1 << 30) && device_facts(device).major >= 9;
}

int launch_linear_bf16_mma(const void* x, const void* w, void* out, int64_t m, int64_t in,
                           int64_t o, bool pdl, cudaStream_t st) {
  LinMmaParams p;
  p.x = (const uint8_t*)x;
  p.w = (const uint8_t*)w;
  p.out = (uint8_t*)out;
  p.m = (int)m;
  p.in = (int)in;
  p.o = (int)o;
  const dim3 grid((unsigned)((o + 7) / 8)), block(32 * LM_WARPS);
  if (m > 8)
    launch_maybe_pdl(linear_bf16_mma<true>, grid, block, 0, st, pdl, p);
  else
    launch_maybe_pdl(linear_bf16_mma<false>, grid, block, 0, st, pdl, p);
  return take_launch_error("linear: linear_bf16_mma");
}

#else  // HIP: no bulk copy engine; the skinny kernel runs instead.

bool linear_stream_takes(int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int) {
  return false;
}
int launch_linear_stream(const void*, const void*, const float*, void*, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int, bool, cudaStream_t) {
  return 1;  // never called: linear_stream_takes says no
}
bool linear_bf16_mma_takes(int64_t, int64_t, int64_t, int) { return false; }
int launch_linear_bf16_mma(const void*, const void*, void*, int64_t, int64_t, int64_t, bool,
                           cudaStream_t) {
  return 1;  // never called: linear_bf16_mma_takes says no
}

#endif

}  // namespace moe
}  // namespace strata
