# cython: language_level=3, boundscheck=False, wraparound=False
"""C++ CPU implementations of the grouped-decode operations (see strata/kernels/reference.py).

Low-level entry points: every output is passed in (allocated by the caller); the friendly
wrappers with the reference signatures live in strata.kernels.cyext_ops.
"""

from libc.stdint cimport int64_t, uintptr_t

include "_checks.pxi"

cdef extern from "strata_cpu.h" nogil:
    const char* strata_cpu_last_error()
    int strata_cpu_has_openmp()
    int strata_cpu_write_kv(void* k_cache, void* v_cache, int cache_dtype,
                            const int64_t* kc_strides, const int64_t* vc_strides, int64_t nslots,
                            int64_t T, const void* k, const void* v, int kv_dtype,
                            const int64_t* group_slot, const int64_t* group_pos, int64_t ng,
                            int64_t g, int64_t hkv, int64_t d)
    int strata_cpu_attention(const void* q, int q_dtype, const void* k_cache,
                             const void* v_cache, int cache_dtype, const int64_t* kc_strides,
                             const int64_t* vc_strides, int64_t nslots, int64_t T,
                             const int64_t* group_slot, const int64_t* group_pos, int64_t ng,
                             int64_t g, int64_t hq, int64_t hkv, int64_t d, int64_t ctx,
                             float scale, void* out)
    int strata_cpu_causal_conv(const void* x, int x_dtype, const void* conv_state,
                               int state_dtype, int64_t state_slot_stride, int64_t nslots,
                               const void* weight, int w_dtype, const int64_t* group_slot,
                               int64_t ng, int64_t g, int64_t c, int64_t kw, void* out,
                               void* snaps)
    int strata_cpu_gated_delta(const void* q, int q_dtype, const void* k, int k_dtype,
                               const void* v, int v_dtype, const void* gate, int g_dtype,
                               const void* beta, int b_dtype, const float* rec_state,
                               int64_t state_slot_stride, int64_t nslots,
                               const int64_t* group_slot, int64_t ng, int64_t g, int64_t h,
                               int64_t dk, int64_t dv, float* out, float* snaps, int mode)
    int strata_cpu_commit(const int64_t* accept, const int64_t* group_slot,
                          const int64_t* group_pos, int64_t ng, int64_t g, int64_t L,
                          const float* rec_factors, int64_t h, int64_t dk, int64_t dv,
                          const void* conv_snaps, int snap_dtype, int64_t conv_inner,
                          float* rec_state, const int64_t* rec_strides, void* conv_state,
                          int state_dtype, const int64_t* conv_strides, int64_t nslots,
                          int64_t* slot_pos)
    int strata_cpu_moe_experts(const void* x, int x_dtype, const void* w_gate_up,
                               const void* w_down, int w_dtype, const float* gu_scale,
                               const float* down_scale, int64_t bo, int64_t bi,
                               const float* topk_weight, const int64_t* topk_ids, int64_t n,
                               int64_t k, int64_t E, int64_t H, int64_t I,
                               const StrataExpertCache* cache, void* out)
    int strata_cpu_linear_fp8(const void* x, int x_dtype, int64_t m, int64_t fin, const void* w,
                              const float* scale, int64_t bo, int64_t bi, int64_t o, void* out)


def has_openmp():
    return bool(strata_cpu_has_openmp())


cdef int _all_cpu(str op, list named) except -1:
    for name, t in named:
        if t.device.type != "cpu":
            raise ValueError(f"{op}: {name} is on {t.device}; the cpu kernels need CPU tensors")
    return 0


cdef int _raise(str op, int rc) except -1:
    if rc != 0:
        raise ValueError(f"{op}: {strata_cpu_last_error().decode()}")
    return 0


def write_kv(k_cache, v_cache, k, v, group_slot, group_pos):
    """Store k, v (NG, G, Hkv, D) at (group_slot[n], group_pos[n] + j) of the caches."""
    op = "write_kv"
    cdef int cdt, kdt
    cdef int64_t nslots, T, hkv, d, ng, g
    cdt, kdt, nslots, T, hkv, d, ng, g = _args_write_kv(op, k_cache, v_cache, k, v, group_slot,
                                                         group_pos)
    _all_cpu(op, [("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                  ("group_slot", group_slot), ("group_pos", group_pos)])
    cdef int64_t kcs[3]
    cdef int64_t vcs[3]
    for i in range(3):
        kcs[i] = k_cache.stride(i)
        vcs[i] = v_cache.stride(i)
    cdef void* kc = _ptr(k_cache)
    cdef void* vc = _ptr(v_cache)
    cdef void* kp = _ptr(k)
    cdef void* vp = _ptr(v)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t* gp = <int64_t*>_ptr(group_pos)
    cdef int rc
    with nogil:
        rc = strata_cpu_write_kv(kc, vc, cdt, kcs, vcs, nslots, T, kp, vp, kdt, gs, gp, ng, g,
                                 hkv, d)
    _raise(op, rc)


def grouped_window_attention(q, k_cache, v_cache, group_slot, group_pos, int64_t ctx,
                             float scale, out):
    """out (NG, G, Hq, D), q's dtype: causal attention of each group's rows over its slot."""
    op = "grouped_window_attention"
    cdef int qdt, cdt
    cdef int64_t nslots, T, hkv, d, ng, g, hq
    qdt, cdt, nslots, T, hkv, d, ng, g, hq = _args_attention(op, q, k_cache, v_cache, group_slot,
                                                             group_pos, ctx, out)
    _all_cpu(op, [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out),
                  ("group_slot", group_slot), ("group_pos", group_pos)])
    cdef int64_t kcs[3]
    cdef int64_t vcs[3]
    for i in range(3):
        kcs[i] = k_cache.stride(i)
        vcs[i] = v_cache.stride(i)
    cdef void* qp = _ptr(q)
    cdef void* kc = _ptr(k_cache)
    cdef void* vc = _ptr(v_cache)
    cdef void* op_ = _ptr(out)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t* gp = <int64_t*>_ptr(group_pos)
    cdef int rc
    with nogil:
        rc = strata_cpu_attention(qp, qdt, kc, vc, cdt, kcs, vcs, nslots, T, gs, gp, ng, g, hq,
                                  hkv, d, ctx, scale, op_)
    _raise(op, rc)


def causal_conv_window(x, conv_state, weight, group_slot, out, snaps):
    """out (NG, G, C) and snaps (NG, G, C, K-1), both x's dtype."""
    op = "causal_conv_window"
    cdef int xdt, sdt, wdt
    cdef int64_t nslots, ng, g, c, kw
    xdt, sdt, wdt, nslots, ng, g, c, kw = _args_causal_conv(op, x, conv_state, weight, group_slot,
                                                            out, snaps)
    _all_cpu(op, [("x", x), ("conv_state", conv_state), ("weight", weight), ("out", out),
                  ("snaps", snaps), ("group_slot", group_slot)])
    cdef void* xp = _ptr(x)
    cdef void* sp = _ptr(conv_state)
    cdef void* wp = _ptr(weight)
    cdef void* outp = _ptr(out)
    cdef void* snp = _ptr(snaps)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t sss = conv_state.stride(0)
    cdef int rc
    with nogil:
        rc = strata_cpu_causal_conv(xp, xdt, sp, sdt, sss, nslots, wp, wdt, gs, ng, g, c, kw,
                                    outp, snp)
    _raise(op, rc)


def gated_delta_window(q, k, v, g, beta, rec_state, group_slot, out, snaps,
                       bint final_only=False, bint factors=False):
    """out (NG, G, H, Dv) float32, snaps (NG, G, H, Dk, Dv) float32, or with `final_only`
    (NG, H, Dk, Dv): the state after each group's last row (a prompt chunk's), or with
    `factors` (NG, G, H, Dk + Dv + 1): each row's rank-one update [k | delta | decay], which
    commit_accepted replays."""
    op = "gated_delta_window"
    cdef int mode = _gdn_mode(op, final_only, factors)
    cdef int qdt, kdt, vdt, gdt, bdt
    cdef int64_t nslots, ng, rows, h, dk, dv
    qdt, kdt, vdt, gdt, bdt, nslots, ng, rows, h, dk, dv = _args_gated_delta(
        op, q, k, v, g, beta, rec_state, group_slot, out, snaps, mode)
    _all_cpu(op, [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                  ("rec_state", rec_state), ("out", out), ("snaps", snaps),
                  ("group_slot", group_slot)])
    cdef void* qp = _ptr(q)
    cdef void* kp = _ptr(k)
    cdef void* vp = _ptr(v)
    cdef void* gp = _ptr(g)
    cdef void* bp = _ptr(beta)
    cdef float* sp = <float*>_ptr(rec_state)
    cdef float* outp = <float*>_ptr(out)
    cdef float* snp = <float*>_ptr(snaps)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t sss = rec_state.stride(0)
    cdef int rc
    with nogil:
        rc = strata_cpu_gated_delta(qp, qdt, kp, kdt, vp, vdt, gp, gdt, bp, bdt, sp, sss,
                                    nslots, gs, ng, rows, h, dk, dv, outp, snp, mode)
    _raise(op, rc)


def commit_accepted(accept, group_slot, group_pos, rec_factors, conv_snaps, rec_state,
                    conv_state, slot_pos):
    """Replay each group's rows 0..accept (their factors) onto its slot's state in place, copy
    the conv snapshot after row accept; advance slot_pos."""
    op = "commit_accepted"
    cdef int sndt, csdt
    cdef int64_t L, nslots, ng, g, h, dk, dv, c, km1
    sndt, csdt, L, nslots, ng, g, h, dk, dv, c, km1 = _args_commit(
        op, accept, group_slot, group_pos, rec_factors, conv_snaps, rec_state, conv_state,
        slot_pos)
    _all_cpu(op, [("accept", accept), ("group_slot", group_slot), ("group_pos", group_pos),
                  ("rec_factors", rec_factors), ("conv_snaps", conv_snaps),
                  ("rec_state", rec_state),
                  ("conv_state", conv_state), ("slot_pos", slot_pos)])
    cdef int64_t rs[2]
    cdef int64_t cs[2]
    rs[0] = rec_state.stride(0); rs[1] = rec_state.stride(1)
    cs[0] = conv_state.stride(0); cs[1] = conv_state.stride(1)
    cdef int64_t* ap = <int64_t*>_ptr(accept)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t* gp = <int64_t*>_ptr(group_pos)
    cdef float* rfp = <float*>_ptr(rec_factors)
    cdef void* csn = _ptr(conv_snaps)
    cdef float* rst = <float*>_ptr(rec_state)
    cdef void* cst = _ptr(conv_state)
    cdef int64_t* spos = <int64_t*>_ptr(slot_pos)
    cdef int64_t conv_inner = c * km1
    cdef int rc
    with nogil:
        rc = strata_cpu_commit(ap, gs, gp, ng, g, L, rfp, h, dk, dv, csn, sndt, conv_inner,
                               rst, rs, cst, csdt, cs, nslots, spos)
    _raise(op, rc)


def moe_experts(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale, down_scale, int64_t bo,
                int64_t bi, out, slot_of=None, host_gate_up=None, host_down=None,
                host_gu_scale=None, host_down_scale=None, routed_counts=None,
                window_state=None, count_layer=None):
    """Routed experts, grouped by expert (reference.moe_experts); writes out (N, H). With
    slot_of, the stacks are the expert cache's slots and misses read the host store; with
    routed_counts, window_state and count_layer the call also counts (strata_expert_cache.h)."""
    op = "moe_experts"
    cdef int xdt, wdt
    cdef int64_t n, k, e, hidden, inter
    xdt, wdt, n, k, e, hidden, inter = _args_moe(op, x, w_gate_up, w_down, topk_weight,
                                                 topk_ids, gu_scale, down_scale, bo, bi, out)
    named = [("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down),
             ("topk_weight", topk_weight), ("topk_ids", topk_ids), ("out", out)]
    cdef float* gsp = NULL
    cdef float* dsp = NULL
    if wdt == DTYPE_FP8:
        named += [("gu_scale", gu_scale), ("down_scale", down_scale)]
        gsp = <float*>_ptr(gu_scale)
        dsp = <float*>_ptr(down_scale)
    cdef StrataExpertCache cache
    cdef StrataExpertCache* cp = NULL
    if slot_of is not None:
        e = _args_expert_cache(op, &cache, slot_of, host_gate_up, host_down, host_gu_scale,
                               host_down_scale, w_gate_up, w_down,
                               gu_scale if wdt == DTYPE_FP8 else None, down_scale)
        named += [("slot_of", slot_of), ("host_gate_up", host_gate_up), ("host_down", host_down)]
        if wdt == DTYPE_FP8:
            named += [("host_gu_scale", host_gu_scale), ("host_down_scale", host_down_scale)]
        named += _args_expert_counting(op, &cache, routed_counts, window_state, count_layer)
        cp = &cache
    else:
        _refuse_counting_without_cache(op, routed_counts, window_state, count_layer)
    _all_cpu(op, named)
    cdef void* xp = _ptr(x)
    cdef void* wgu = _ptr(w_gate_up)
    cdef void* wd = _ptr(w_down)
    cdef float* twp = <float*>_ptr(topk_weight)
    cdef int64_t* tip = <int64_t*>_ptr(topk_ids)
    cdef void* outp = _ptr(out)
    cdef int rc
    with nogil:
        rc = strata_cpu_moe_experts(xp, xdt, wgu, wd, wdt, gsp, dsp, bo, bi, twp, tip, n, k, e,
                                    hidden, inter, cp, outp)
    _raise(op, rc)


def linear_fp8(x, weight, scale_inv, int64_t bo, int64_t bi, out):
    """out (M, O) = x (M, I) . dequant(weight)^T for an FP8 block-scaled weight."""
    op = "linear_fp8"
    cdef int xdt, wdt
    cdef int64_t m, fin, o
    xdt, wdt, m, fin, o = _args_linear(op, x, weight, scale_inv, bo, bi, out, (DTYPE_FP8,))
    _all_cpu(op, [("x", x), ("weight", weight), ("scale_inv", scale_inv), ("out", out)])
    cdef void* xp = _ptr(x)
    cdef void* wp = _ptr(weight)
    cdef float* sp = <float*>_ptr(scale_inv)
    cdef void* outp = _ptr(out)
    cdef int rc
    with nogil:
        rc = strata_cpu_linear_fp8(xp, xdt, m, fin, wp, sp, bo, bi, o, outp)
    _raise(op, rc)
