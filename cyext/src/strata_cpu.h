// strata cyext: C++ CPU twins of the GPU kernels (see strata/kernels/reference.py for semantics).
// All functions return 0 on success or a negative code; strata_cpu_last_error() then describes it.
// Index tensors are int64. Strides are in elements. "Inner block contiguous" means the listed
// trailing dimensions are densely packed; outer dimensions may have any stride.
#pragma once
#include <stdint.h>

#include "strata_expert_cache.h"

#ifdef __cplusplus
extern "C" {
#endif

const char* strata_cpu_last_error(void);
int strata_cpu_has_openmp(void);

// k_cache/v_cache: (nslots, T, hkv, d), strides (slot, pos, head) given, d contiguous.
// k, v: (ng, g, hkv, d) contiguous, dtype kv_dtype.
int strata_cpu_write_kv(void* k_cache, void* v_cache, int cache_dtype, const int64_t* kc_strides,
                        const int64_t* vc_strides, int64_t nslots, int64_t T, const void* k,
                        const void* v, int kv_dtype, const int64_t* group_slot,
                        const int64_t* group_pos, int64_t ng, int64_t g, int64_t hkv, int64_t d);

// q, out: (ng, g, hq, d) contiguous, dtype q_dtype. Caches as in write_kv.
int strata_cpu_attention(const void* q, int q_dtype, const void* k_cache, const void* v_cache,
                         int cache_dtype, const int64_t* kc_strides, const int64_t* vc_strides,
                         int64_t nslots, int64_t T, const int64_t* group_slot,
                         const int64_t* group_pos, int64_t ng, int64_t g, int64_t hq, int64_t hkv,
                         int64_t d, int64_t ctx, float scale, void* out);

// x, out: (ng, g, c) contiguous (x_dtype); conv_state: (nslots, c, kw-1), slot stride given,
// (c, kw-1) contiguous; weight (c, kw) contiguous; snaps (ng, g, c, kw-1) contiguous, x_dtype.
int strata_cpu_causal_conv(const void* x, int x_dtype, const void* conv_state, int state_dtype,
                           int64_t state_slot_stride, int64_t nslots, const void* weight,
                           int w_dtype, const int64_t* group_slot, int64_t ng, int64_t g,
                           int64_t c, int64_t kw, void* out, void* snaps);

// q, k: (ng, g, h, dk); v: (ng, g, h, dv); gate, beta: (ng, g, h); all contiguous, each with its
// own dtype. rec_state: (nslots, h, dk, dv) float32, slot stride given, inner contiguous.
// out: (ng, g, h, dv) float32; snaps float32, contiguous, by mode (strata_common.h): the state
// after every row (ng, g, h, dk, dv), after the last (ng, h, dk, dv), or each row's rank-one
// update factors (ng, g, h, dk + dv + 1).
int strata_cpu_gated_delta(const void* q, int q_dtype, const void* k, int k_dtype, const void* v,
                           int v_dtype, const void* gate, int g_dtype, const void* beta,
                           int b_dtype, const float* rec_state, int64_t state_slot_stride,
                           int64_t nslots, const int64_t* group_slot, int64_t ng, int64_t g,
                           int64_t h, int64_t dk, int64_t dv, float* out, float* snaps,
                           int mode);

// accept, group_slot, group_pos: (ng,) int64. rec_factors (L, ng, g, h, dk + dv + 1) float32
// contiguous (STRATA_GDN_FACTORS): rows 0..accept of each group are replayed onto its slot's
// state in place; conv_snaps (L, ng, g, conv_inner) contiguous (snap_dtype): the one after row
// accept is copied; rec_state (L, nslots, h, dk, dv) float32 with strides (layer, slot), inner
// contiguous; conv_state (L, nslots, conv_inner) (state_dtype) with strides (layer, slot);
// slot_pos (nslots,) int64 advances to group_pos + accept + 1.
int strata_cpu_commit(const int64_t* accept, const int64_t* group_slot, const int64_t* group_pos,
                      int64_t ng, int64_t g, int64_t L, const float* rec_factors, int64_t h,
                      int64_t dk, int64_t dv, const void* conv_snaps, int snap_dtype,
                      int64_t conv_inner, float* rec_state, const int64_t* rec_strides,
                      void* conv_state, int state_dtype, const int64_t* conv_strides,
                      int64_t nslots, int64_t* slot_pos);

// Routed experts (reference.moe_experts): x, out (n, H) contiguous in x_dtype; w_gate_up
// (E, 2I, H), w_down (E, H, I) contiguous in w_dtype (STRATA_DTYPE_FP8 with gu_scale
// (E, 2*ceil(I/bo), ceil(H/bi)) and down_scale (E, ceil(H/bo), ceil(I/bi)) float32);
// topk_weight (n, k) float32 and topk_ids (n, k) int64, contiguous. ids out of range: error.
// cache: NULL, or the expert cache (strata_expert_cache.h): the stacks are its slots, E ids.
int strata_cpu_moe_experts(const void* x, int x_dtype, const void* w_gate_up, const void* w_down,
                           int w_dtype, const float* gu_scale, const float* down_scale,
                           int64_t bo, int64_t bi, const float* topk_weight,
                           const int64_t* topk_ids, int64_t n, int64_t k, int64_t E, int64_t H,
                           int64_t I, const StrataExpertCache* cache, void* out);

// out (m, o) = x (m, in) . W^T for W (o, in) float8_e4m3fn with scale (ceil(o/bo), ceil(in/bi)).
int strata_cpu_linear_fp8(const void* x, int x_dtype, int64_t m, int64_t in, const void* w,
                          const float* scale, int64_t bo, int64_t bi, int64_t o, void* out);

#ifdef __cplusplus
}
#endif
