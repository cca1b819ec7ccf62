// strata cyext: host API of the CUDA/HIP kernels (strata_kernels.cu). Plain C types only, so the
// Cython wrapper needs neither CUDA nor torch headers. Every function enqueues its kernels on
// `stream` (a cudaStream_t / hipStream_t passed as an integer), allocates nothing and never
// synchronises, so it can be captured into a CUDA graph. Return value: 0 on success, else the
// cudaError_t / hipError_t code; strata_gpu_error_string() and strata_gpu_last_kernel() describe it.
// Strides are in elements. Index values that are out of range are clamped on the device (slots to
// [0, nslots-1], i.e. a bad slot lands on the scratch slot; accept to [0, g-1]; positions to
// [0, T-1]) because a kernel cannot raise; the wrapper validates them on request.
#pragma once
#include <stdint.h>

#include "strata_expert_cache.h"

#ifdef __cplusplus
extern "C" {
#endif

const char* strata_gpu_platform(void);         // "cuda" or "hip"
const char* strata_gpu_error_string(int code);  // cudaGetErrorString / hipGetErrorString
const char* strata_gpu_last_kernel(void);       // name of the kernel whose launch failed last
int strata_gpu_has_mma(void);                   // 1 when the tensor-core attention path is built
int strata_gpu_attn_mma_supported(int head_dim, int rows);  // 1 if that geometry takes the mma path

int strata_gpu_write_kv(void* k_cache, void* v_cache, int cache_dtype, const int64_t* kc_strides,
                        const int64_t* vc_strides, int64_t nslots, int64_t T, const void* k,
                        const void* v, int kv_dtype, const int64_t* group_slot,
                        const int64_t* group_pos, int64_t ng, int64_t g, int64_t hkv, int64_t d,
                        int device, uintptr_t stream);

// Split-K ("flash-decoding") attention. The key range [0, ctx) is cut into nsplit chunks of
// `chunk` keys (chunk * nsplit >= ctx). With nsplit == 1 the result is written straight to out;
// otherwise the partial results go to `workspace` (float32, at least
// strata_gpu_attention_workspace(...) elements, owned by the caller) and a second kernel merges
// them. use_mma: 1 = tensor-core path when supported (bf16/fp16, d in {64,128,256}, aligned),
// 2 = the same with one 16-row m-tile per block whatever the rows (more row blocks, but the
// keys are shared among the block's warps the same way for every window shape, so a row sums
// in one order: batch-invariant windows), 0 = CUDA-core path. Returns the path taken in
// *path_out (1 mma, 0 simt) when non-null.
int64_t strata_gpu_attention_workspace(int64_t ng, int64_t hkv, int64_t rows, int64_t d,
                                       int64_t nsplit);
int strata_gpu_attention(const void* q, int q_dtype, const void* k_cache, const void* v_cache,
                         int cache_dtype, const int64_t* kc_strides, const int64_t* vc_strides,
                         int64_t nslots, int64_t T, const int64_t* group_slot,
                         const int64_t* group_pos, int64_t ng, int64_t g, int64_t hq, int64_t hkv,
                         int64_t d, int64_t ctx, float scale, void* out, float* workspace,
                         int64_t nsplit, int64_t chunk, int use_mma, int* path_out, int device,
                         uintptr_t stream);

// Launch switch of causal_conv, process-wide: STRATA_CONV_SERIAL runs the earlier kernel (one
// thread per channel walking the rows) instead of one thread per (channel, row); the same bits
// either way. flags < 0 only reads. Returns the previous flags.
#define STRATA_CONV_SERIAL 1
// STRATA_CONV_GDN_PDL (on by default): gated_delta_window_prep's kernel as a programmatic
// dependent launch of the conv before it (sm_90+), the same bits.
#define STRATA_CONV_GDN_PDL 2
int strata_gpu_conv_set_options(int flags);
int strata_gpu_causal_conv(const void* x, int x_dtype, const void* conv_state, int state_dtype,
                           int64_t state_slot_stride, int64_t nslots, const void* weight,
                           int w_dtype, const int64_t* group_slot, int64_t ng, int64_t g,
                           int64_t c, int64_t kw, void* out, void* snaps, int device,
                           uintptr_t stream);

// causal_conv_window over the conv channels gathered from the in_proj's per-key-head
// interleaved qkvz columns (rows x_row elements apart; ConvParams in strata_kernels.cu).
int strata_gpu_causal_conv_qkvz(const void* x, int x_dtype, int64_t x_row, int64_t nk, int64_t dk,
                                int64_t vpk, const void* conv_state, int state_dtype,
                                int64_t state_slot_stride, int64_t nslots, const void* weight,
                                int w_dtype, const int64_t* group_slot, int64_t ng, int64_t g,
                                int64_t kw, void* out, void* snaps, int device, uintptr_t stream);

// causal_conv_window_qkvz and, in the same launch (blocks past the conv's), the b/a projection
// ba (NG, G, nba) = xn (NG, G, h; rows xn_row elements apart) . w_ba (nba, h)^T, xn, w_ba and ba
// in x_dtype, w_ba and ba contiguous; float32 sums in an order fixed by h alone (a row's ba is
// the same bits in any window), rounded once. For FP8 in_proj_qkvz layers whose in_proj_ba stays
// float: no GEMM launch of its own for ba.
int strata_gpu_causal_conv_qkvz_ba(const void* x, int x_dtype, int64_t x_row, int64_t nk,
                                   int64_t dk, int64_t vpk, const void* conv_state,
                                   int state_dtype, int64_t state_slot_stride, int64_t nslots,
                                   const void* weight, int w_dtype, const int64_t* group_slot,
                                   int64_t ng, int64_t g, int64_t kw, void* out, void* snaps,
                                   const void* xn, int64_t xn_row, const void* w_ba, int64_t h,
                                   int64_t nba, void* ba, int device, uintptr_t stream);

int strata_gpu_gated_delta(const void* q, int q_dtype, const void* k, int k_dtype, const void* v,
                           int v_dtype, const void* gate, int g_dtype, const void* beta,
                           int b_dtype, const float* rec_state, int64_t state_slot_stride,
                           int64_t nslots, const int64_t* group_slot, int64_t ng, int64_t g,
                           int64_t h, int64_t dk, int64_t dv, float* out, float* snaps,
                           int mode, int device, uintptr_t stream);

// The gated delta rule from the window's conv output and raw in_proj b/a rows: q and k
// L2-normalised (q times q_scale), beta = sigmoid(b), g = neg_a * softplus(a + dt_bias) in the
// kernel (GdnParams' prepared form in strata_kernels.cu for the layouts). mode: STRATA_GDN_SNAPS
// or STRATA_GDN_FACTORS (strata_common.h).
int strata_gpu_gated_delta_prep(const void* x, int x_dtype, int64_t x_row, const void* ba,
                                int ba_dtype, int64_t ba_row, const float* neg_a,
                                const float* dt_bias, int64_t rep, float q_scale, float eps,
                                const float* rec_state, int64_t state_slot_stride,
                                int64_t nslots, const int64_t* group_slot, int64_t ng, int64_t g,
                                int64_t h, int64_t dk, int64_t dv, float* out, float* snaps,
                                int mode, int device, uintptr_t stream);

// The accepted-prefix commit: each group's slot replays the factors (STRATA_GDN_FACTORS) of
// rows 0..accept onto its state in place (rec_factors (L, ng, g, h, dk + dv + 1) contiguous;
// rec_state (L, nslots, h, dk, dv) with strides (layer, slot), dk <= 256) and takes the conv
// snapshot after row accept; slot_pos advances (strata_cpu.h's strata_cpu_commit).
int strata_gpu_commit(const int64_t* accept, const int64_t* group_slot, const int64_t* group_pos,
                      int64_t ng, int64_t g, int64_t L, const float* rec_factors, int64_t h,
                      int64_t dk, int64_t dv, const void* conv_snaps, int snap_dtype,
                      int64_t conv_inner, float* rec_state, const int64_t* rec_strides,
                      void* conv_state, int state_dtype, const int64_t* conv_strides,
                      int64_t nslots, int64_t* slot_pos, int device, uintptr_t stream);

// Routed experts at decode sizes (see strata_moe.cu): x (n, H) in x_dtype, contiguous;
// w_gate_up (E, 2I, H) and w_down (E, H, I) contiguous in w_dtype (F32/BF16/F16, or
// STRATA_DTYPE_FP8 with gu_scale (E, 2*ceil(I/bo), ceil(H/bi)) and down_scale
// (E, ceil(H/bo), ceil(I/bi)) float32, bi % 16 == 0); topk_weight (n, k) float32, topk_ids (n, k)
// int64 (out-of-range ids are clamped); out (n, H) in x_dtype. workspace: float32, at least
// strata_gpu_moe_workspace(n, k, I, H) elements, 16-byte aligned, owned by the caller (no
// initialisation needed). Limits: n <= 32, n * k <= 512, H and I multiples of 16, a weight row
// at most 8 KiB. Two launches, grids fixed by the shapes. cache: NULL, or the expert cache
// (strata_expert_cache.h): the stacks are its device slots, E ids, misses read from the
// device-visible host store; the struct is copied at launch (the caller may free it after).
// With its counting pointers set, the gate/up kernel also counts (strata_expert_cache.h).
int64_t strata_gpu_moe_workspace(int64_t n, int64_t k, int64_t inter, int64_t hidden);
// 1 when a moe_experts launch of n rows (17-128) of these shapes runs wide (STRATA_MOE_X_GLOBAL
// on, FP8 weights on the streamed tensor-core kernels, no expert cache), else 0.
int strata_gpu_moe_wide_takes(int64_t n, int64_t k, int64_t E, int64_t H, int64_t I, int64_t bo,
                              int64_t bi, int w_dtype, int x_dtype, int device);
// Launch switches of moe_experts, process-wide (PDL, EARLY, DB, XSMEM and STREAM on by default):
// STRATA_MOE_PDL launches the down kernel as a programmatic dependent of the gate/up kernel
// (sm_90+; its first down rows load while gate/up finishes), STRATA_MOE_EARLY has gate/up blocks
// of small windows load their weights before the duplicate check, STRATA_MOE_WIDE gives each
// gate/up warp two features where rows are short (FP8; measured slower), STRATA_MOE_DB
// double-buffers the down kernel's weight loads (where a lane holds at most 2 chunks of a down
// row), STRATA_MOE_XSMEM has each gate/up block stage the window's x rows in shared memory
// (windows of at most 40 KiB of x; not with WIDE), STRATA_MOE_STREAM runs the streamed kernels
// instead where they are faster (strata_moe_stream.cu: sm_90+, no expert cache, FP8 or bf16
// weights; weights through shared memory by the bulk copy engine), STRATA_MOE_STREAM_ALL at
// every size they take (tests, benchmarks). Results are the same bits either way.
// flags < 0 only reads. Returns the previous flags.
#define STRATA_MOE_PDL 1
#define STRATA_MOE_EARLY 2
#define STRATA_MOE_WIDE 4
#define STRATA_MOE_DB 8
#define STRATA_MOE_XSMEM 16
#define STRATA_MOE_STREAM 32
#define STRATA_MOE_STREAM_ALL 64
// STRATA_LINEAR_STREAM (on): linear_skinny runs FP8 weights on the streamed tensor-core kernel
// where it takes them (strata_linear_stream.cu: sm_90+, bf16 x, in a power of two in
// 1024..8192, o and bo multiples of 8, bi = 128; any number of rows), else the skinny kernel.
// Not the same bits as the skinny kernel (the MMA sums in another order).
#define STRATA_LINEAR_STREAM 128
// STRATA_LINEAR_PIPE (off: measured slower at 1-4 rows, docs/KERNELS.md): that streamed kernel
// in its piped form (strata_linear_stream.cu: k-range pieces on their own barriers, x copied by
// the consumer threads, a software-pipelined block loop), else the unpiped first version (whole
// tiles). The same bits either way.
#define STRATA_LINEAR_PIPE 256
// STRATA_LINEAR_PDL (on): the skinny kernel (linear_skinny on CUDA cores: bf16 weights, and FP8
// ones the streamed kernel does not take) as a programmatic dependent launch (sm_90+): its first
// weight chunks load while the kernel before it finishes, x after griddepcontrol.wait. Callers
// must not pass a weight that the kernels just before it write (parameters: none do). The same
// bits.
#define STRATA_LINEAR_PDL 512
// STRATA_LINEAR_MMA (on): linear_skinny runs bf16 x and W of at most 16 rows, in a multiple of
// 32 up to 1024, on tensor cores (strata_linear_stream.cu, linear_bf16_mma: sm_90+; a launch-
// bound window's small GEMMs), else on the CUDA-core skinny kernel. Other bits than it; a row
// the same bits in any launch either way.
#define STRATA_LINEAR_MMA 2048
// STRATA_LINEAR_SPLIT (on): the streamed FP8 linear's split form (strata_linear_stream.cu: each tile's
// k range over all 16 warps, tiles through one ring in order, so the arithmetic runs while the
// later tiles land) where it takes the shapes (in >= 2048); before the piped switch. Other bits
// than the unsplit forms.
#define STRATA_LINEAR_SPLIT 8192
// Bits 16-19 of the switches: the split form's cap on tile slots in flight per CTA (0: as many
// as fit), for measuring how deep its ring should be. The same bits at any depth.
#define STRATA_LINEAR_SPLIT_DEPTH_SHIFT 16
// STRATA_LINEAR_SPLIT_PAIR (on): the split form's consumer warps take two tiles per step (each block's
// x loaded once for both, four MMA chains in flight instead of two). The same bits.
#define STRATA_LINEAR_SPLIT_PAIR 16384
// STRATA_LINEAR_F16 (off: slower from 4 rows, docs/KERNELS.md): the split form on f16 operands: the weights decode to f16 in one instruction
// per pair (cvt.rn.f16x2.e4m3x2) instead of a bf16 byte shuffle and multiply, x is scaled per
// row by a power of two into f16 (exact for every element within 2^28 of its row's largest).
#define STRATA_LINEAR_F16 32768
// STRATA_MOE_STREAM_MISS (on): an expert cache that can miss also runs the streamed kernels
// (sm_90+), whose bulk copies then read missing experts from the pinned host store through its
// device address; off, such a cache runs the per-block kernels. Same bits.
#define STRATA_MOE_STREAM_MISS 1024
// STRATA_MOE_GU_PDL (off: level with the plain launch at full depth, docs/KERNELS.md): the
// streamed gate/up kernel as a programmatic dependent launch of the kernel before it (the router
// in a decode window), on one SM fewer. Same bits.
#define STRATA_MOE_GU_PDL 4096
// STRATA_MOE_GU_MMA (on): the streamed gate/up kernel on tensor cores for FP8
// weights in 128-k blocks (strata_moe_stream.cu, moe_gate_up_mma): the weights decode to f16,
// x is scaled per row by a power of two into f16, the sums run in MMAs. Other bits than the
// CUDA-core kernels (the per-block ones and the C++ twin); a row's act is still the same bits in
// any launch, and it takes every FP8 window of up to 32 rows where x fits (H = 2048: all).
#define STRATA_MOE_GU_MMA (1 << 20)
// STRATA_MOE_DOWN_SPLIT (on): from 3 rows the streamed down kernel takes an expert's members in
// runs of at most 2, each run an item of its own (its stage copied again,
// from L2), so that an expert of many members (the folded shared expert) is not one warp's
// chain while its stage holds the ring. The same bits.
#define STRATA_MOE_DOWN_SPLIT (1 << 21)
// Bits 22-25 of the switches: with STRATA_MOE_DOWN_SPLIT, the members per run at 3 rows and more
// (1-15; 0: 2), for measuring what run length pays. The same bits at any.
#define STRATA_MOE_DOWN_RUNS_SHIFT 22
// STRATA_MOE_X_GLOBAL (on): FP8 launches of 17-128 rows without the expert cache on the
// tensor-core gate/up stage x in global memory (a small kernel before it, the rows in the workspace) instead of shared memory,
// so that the ring keeps the whole shared memory and a prompt chunk of 64 tokens reads its
// experts in one launch rather than four of 16 rows. The same bits.
#define STRATA_MOE_X_GLOBAL (1 << 26)
// STRATA_MOE_DOWN_MMA (on): FP8 launches of a prompt chunk's rows (the `prompt` argument of
// strata_gpu_moe_experts) run the streamed down kernel on tensor cores: each expert's down rows
// decode to f16 once per 16 members, the members' act chunks (64 k) are scaled by a power of
// two into f16, the sums run in MMAs. Other bits than the CUDA-core down kernel (act rounds to
// f16), which decode windows keep; a row's result does not depend on the other rows of its
// launch, nor on their count.
#define STRATA_MOE_DOWN_MMA (1 << 27)
// STRATA_MOE_FUSED (off): FP8 decode windows of up to 16 rows on the tensor-core gate/up run
// gate/up and down in one grid (strata_moe_stream.cu, moe_fused_mma) where the caller passes
// `sync` (strata_gpu_moe_sync_ints() int32, zero before the first launch; each launch leaves
// them zero): a down item waits for its own expert's act, not for the whole gate/up grid. The
// same bits.
#define STRATA_MOE_FUSED (1 << 28)
// STRATA_MOE_GU_RUNS (on): wide launches (STRATA_MOE_X_GLOBAL) run the tensor-core gate/up on
// items of (member run of at most 16, tile), each CTA a contiguous range of them, the current
// run's x rows staged in shared memory (strata_moe_stream.cu, moe_gate_up_runs) instead of read
// from L2 by every pass; in a big launch on the tensor-core down kernel, the down kernel so too
// (moe_down_runs, then moe_down_runs_combine). The same bits.
#define STRATA_MOE_GU_RUNS (1 << 29)
int strata_gpu_moe_set_options(int flags);
// linear_skinny's bf16 launches of more than this many rows are plain launches even with
// STRATA_LINEAR_PDL on (default 4; 0-32). Returns the previous limit; rows < 0 only reads.
int strata_gpu_linear_pdl_rows(int rows);
int strata_gpu_moe_experts(const void* x, int x_dtype, const void* w_gate_up, const void* w_down,
                           int w_dtype, const float* gu_scale, const float* down_scale,
                           int64_t bo, int64_t bi, const float* topk_weight,
                           const int64_t* topk_ids, int64_t n, int64_t k, int64_t E, int64_t H,
                           int64_t I, const StrataExpertCache* cache, void* out,
                           float* workspace, int prompt, int device, uintptr_t stream,
                           int* sync);
// int32 elements of strata_gpu_moe_experts' `sync` (STRATA_MOE_FUSED).
int strata_gpu_moe_sync_ints(void);

// 1 when linear_skinny would run (m, in) x (o, in) on the streamed FP8 kernel (which takes any
// m), else 0.
int strata_gpu_linear_stream_takes(int64_t m, int64_t in, int64_t o, int64_t bo, int64_t bi,
                                   int w_dtype, int x_dtype, int device);
// out (m, o) = x (m, in) . W^T for m <= 32 rows (any m where the streamed FP8 kernel takes it);
// W (o, in) float8_e4m3fn with scale (ceil(o/bo), ceil(in/bi)) float32 (bi % 16 == 0), or
// bfloat16 (scale NULL: on tensor cores where STRATA_LINEAR_MMA takes it). x and out in
// x_dtype, contiguous; in % 16 == 0. fp32 accumulation; a row the same bits in any launch.
int strata_gpu_linear_skinny(const void* x, int x_dtype, int64_t m, int64_t in, const void* w,
                             int w_dtype, const float* scale, int64_t bo, int64_t bi, int64_t o,
                             void* out, int device, uintptr_t stream);

// The MoE router at decode sizes (strata_router.cu; semantics: reference.moe_route): for m <= 32
// rows of bf16 x (m, H), the bf16 router weight W (R, H) whose rows 0..E-1 are the experts' gate
// and, when shared_id >= 0, row E the shared expert's gate: the top k of softmax(bf16(x W^T) +
// bias) over the E experts (ties to the lower id), renormalised when norm, into weights (m, cols)
// float32 and ids (m, cols) int64, cols = k, or k + 1 with column k the shared expert (weight
// sigmoid(its logit), id shared_id). logits: float32 scratch of m * (E + 1) elements. ticket: one
// int32, zero between launches (the kernel leaves it zero); launches sharing it must not run
// concurrently. H a multiple of 8 up to 4096, 1 <= k <= 32, k <= E <= 1024.
int strata_gpu_moe_route(const void* x, int64_t m, int64_t H, const void* w, int64_t R,
                         int64_t E, const float* bias, int64_t k, int norm, int64_t shared_id,
                         float* logits, float* weights, int64_t* ids, int32_t* ticket,
                         int device, uintptr_t stream);

// L2 prefetch (strata_prefetch.cu): a hint that the bytes will be read soon, so they stream
// into L2 while latency-bound kernels run; writes nothing, so it never breaks a dependency. A
// no-op before sm_90 and on HIP. n <= 4 ranges [bases[j], bases[j] + bytes[j]), or with ids
// the rows ids[0..nids) of n stacked tensors (row r of tensor j at bases[j] + r * bytes[j];
// ids outside [0, nrows[j]) skipped). 16-byte aligned. ctas / threads 0: the default layout
// (one warp a CTA, up to one CTA an SM); otherwise that grid, for measuring layouts.
int strata_gpu_l2_prefetch(const void* const* bases, const int64_t* bytes, const int64_t* nrows,
                           int n, const int64_t* ids, int64_t nids, int ctas, int threads,
                           int device, uintptr_t stream);

#ifdef __cplusplus
}
#endif
