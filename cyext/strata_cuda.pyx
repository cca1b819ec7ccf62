# cython: language_level=3, boundscheck=False, wraparound=False
"""CUDA (or, built with hipcc, HIP) kernels of the grouped-decode operations.

Low-level entry points: outputs and the attention's split-K workspace are passed in by the caller
(strata.kernels.cyext_ops allocates them with torch on the tensors' device); `stream` is the
integer handle of the stream to launch on (torch.cuda.current_stream().cuda_stream), so the calls
can be captured into CUDA graphs. No call allocates or synchronises. Launch failures raise
RuntimeError naming the kernel and the CUDA error string.

The same source builds for HIP (STRATA_BACKEND=hip); gpu_platform() tells which one this is.
"""

from libc.stdint cimport int64_t, uintptr_t

include "_checks.pxi"

cdef extern from "strata_kernels.h" nogil:
    const char* strata_gpu_platform()
    const char* strata_gpu_error_string(int code)
    const char* strata_gpu_last_kernel()
    int strata_gpu_has_mma()
    int strata_gpu_attn_mma_supported(int head_dim, int rows)
    int strata_gpu_write_kv(void* k_cache, void* v_cache, int cache_dtype,
                            const int64_t* kc_strides, const int64_t* vc_strides, int64_t nslots,
                            int64_t T, const void* k, const void* v, int kv_dtype,
                            const int64_t* group_slot, const int64_t* group_pos, int64_t ng,
                            int64_t g, int64_t hkv, int64_t d, int device, uintptr_t stream)
    int64_t strata_gpu_attention_workspace(int64_t ng, int64_t hkv, int64_t rows, int64_t d,
                                           int64_t nsplit)
    int strata_gpu_attention(const void* q, int q_dtype, const void* k_cache,
                             const void* v_cache, int cache_dtype, const int64_t* kc_strides,
                             const int64_t* vc_strides, int64_t nslots, int64_t T,
                             const int64_t* group_slot, const int64_t* group_pos, int64_t ng,
                             int64_t g, int64_t hq, int64_t hkv, int64_t d, int64_t ctx,
                             float scale, void* out, float* workspace, int64_t nsplit,
                             int64_t chunk, int use_mma, int* path_out, int device,
                             uintptr_t stream)
    int strata_gpu_causal_conv(const void* x, int x_dtype, const void* conv_state,
                               int state_dtype, int64_t state_slot_stride, int64_t nslots,
                               const void* weight, int w_dtype, const int64_t* group_slot,
                               int64_t ng, int64_t g, int64_t c, int64_t kw, void* out,
                               void* snaps, int device, uintptr_t stream)
    int strata_gpu_causal_conv_qkvz(const void* x, int x_dtype, int64_t x_row, int64_t nk,
                                    int64_t dk, int64_t vpk, const void* conv_state,
                                    int state_dtype, int64_t state_slot_stride, int64_t nslots,
                                    const void* weight, int w_dtype, const int64_t* group_slot,
                                    int64_t ng, int64_t g, int64_t kw, void* out, void* snaps,
                                    int device, uintptr_t stream)
    int strata_gpu_causal_conv_qkvz_ba(const void* x, int x_dtype, int64_t x_row, int64_t nk,
                                       int64_t dk, int64_t vpk, const void* conv_state,
                                       int state_dtype, int64_t state_slot_stride,
                                       int64_t nslots, const void* weight, int w_dtype,
                                       const int64_t* group_slot, int64_t ng, int64_t g,
                                       int64_t kw, void* out, void* snaps, const void* xn,
                                       int64_t xn_row, const void* w_ba, int64_t h, int64_t nba,
                                       void* ba, int device, uintptr_t stream)
    int strata_gpu_gated_delta(const void* q, int q_dtype, const void* k, int k_dtype,
                               const void* v, int v_dtype, const void* gate, int g_dtype,
                               const void* beta, int b_dtype, const float* rec_state,
                               int64_t state_slot_stride, int64_t nslots,
                               const int64_t* group_slot, int64_t ng, int64_t g, int64_t h,
                               int64_t dk, int64_t dv, float* out, float* snaps,
                               int mode, int device,
                               uintptr_t stream)
    int strata_gpu_gated_delta_prep(const void* x, int x_dtype, int64_t x_row, const void* ba,
                                    int ba_dtype, int64_t ba_row, const float* neg_a,
                                    const float* dt_bias, int64_t rep, float q_scale,
                                    float eps, const float* rec_state,
                                    int64_t state_slot_stride, int64_t nslots,
                                    const int64_t* group_slot, int64_t ng, int64_t g,
                                    int64_t h, int64_t dk, int64_t dv, float* out,
                                    float* snaps, int mode, int device, uintptr_t stream)
    int strata_gpu_commit(const int64_t* accept, const int64_t* group_slot,
                          const int64_t* group_pos, int64_t ng, int64_t g, int64_t L,
                          const float* rec_factors, int64_t h, int64_t dk, int64_t dv,
                          const void* conv_snaps, int snap_dtype, int64_t conv_inner,
                          float* rec_state, const int64_t* rec_strides, void* conv_state,
                          int state_dtype, const int64_t* conv_strides, int64_t nslots,
                          int64_t* slot_pos, int device, uintptr_t stream)
    int64_t strata_gpu_moe_workspace(int64_t n, int64_t k, int64_t inter, int64_t hidden)
    int strata_gpu_moe_wide_takes(int64_t n, int64_t k, int64_t E, int64_t H, int64_t I,
                                  int64_t bo, int64_t bi, int w_dtype, int x_dtype, int device)
    int strata_gpu_moe_set_options(int flags)
    int strata_gpu_linear_pdl_rows(int rows)
    int strata_gpu_conv_set_options(int flags)
    int strata_gpu_moe_experts(const void* x, int x_dtype, const void* w_gate_up,
                               const void* w_down, int w_dtype, const float* gu_scale,
                               const float* down_scale, int64_t bo, int64_t bi,
                               const float* topk_weight, const int64_t* topk_ids, int64_t n,
                               int64_t k, int64_t E, int64_t H, int64_t I,
                               const StrataExpertCache* cache, void* out,
                               float* workspace, int prompt, int device, uintptr_t stream,
                               int* sync)
    int strata_gpu_moe_sync_ints()
    int strata_gpu_linear_stream_takes(int64_t m, int64_t fin, int64_t o, int64_t bo,
                                       int64_t bi, int w_dtype, int x_dtype, int device)
    int strata_gpu_linear_skinny(const void* x, int x_dtype, int64_t m, int64_t fin,
                                 const void* w, int w_dtype, const float* scale, int64_t bo,
                                 int64_t bi, int64_t o, void* out, int device, uintptr_t stream)
    int strata_gpu_moe_route(const void* x, int64_t m, int64_t H, const void* w, int64_t R,
                             int64_t E, const float* bias, int64_t k, int norm,
                             int64_t shared_id, float* logits, float* weights, int64_t* ids,
                             int* ticket, int device, uintptr_t stream)
    int strata_gpu_l2_prefetch(const void* const* bases, const int64_t* nbytes,
                               const int64_t* nrows, int n, const int64_t* ids, int64_t nids,
                               int ctas, int threads, int device, uintptr_t stream)

def gpu_platform():
    """'cuda' or 'hip': the toolchain this module's kernels were built with."""
    return strata_gpu_platform().decode()


def has_mma():
    """True when the tensor-core attention path is compiled in (NVIDIA builds)."""
    return bool(strata_gpu_has_mma())


def attn_mma_supported(int head_dim, int rows=16):
    return bool(strata_gpu_attn_mma_supported(head_dim, rows))


def attention_workspace_numel(int64_t ng, int64_t hkv, int64_t rows, int64_t d, int64_t nsplit):
    """float32 elements of split-K scratch that grouped_window_attention needs (0 if nsplit==1)."""
    return strata_gpu_attention_workspace(ng, hkv, rows, d, nsplit)


cdef int _device_of(str op, list named) except -2:
    """All tensors on one CUDA device; returns its index."""
    cdef int dev = -1
    for name, t in named:
        if t.device.type != "cuda":
            raise ValueError(f"{op}: {name} is on {t.device}; the {gpu_platform()} kernels need "
                             f"tensors on a GPU")
        idx = t.device.index if t.device.index is not None else 0
        if dev < 0:
            dev = idx
        elif idx != dev:
            raise ValueError(f"{op}: {name} is on {t.device}, other arguments on cuda:{dev}")
    return dev


cdef int _raise(str op, int rc) except -1:
    if rc != 0:
        raise RuntimeError(f"{op}: {strata_gpu_last_kernel().decode()} failed: "
                           f"{strata_gpu_error_string(rc).decode()} (error {rc})")
    return 0


def write_kv(k_cache, v_cache, k, v, group_slot, group_pos, uintptr_t stream):
    op = "write_kv"
    cdef int cdt, kdt
    cdef int64_t nslots, T, hkv, d, ng, g
    cdt, kdt, nslots, T, hkv, d, ng, g = _args_write_kv(op, k_cache, v_cache, k, v, group_slot,
                                                         group_pos)
    cdef int dev = _device_of(op, [("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
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
        rc = strata_gpu_write_kv(kc, vc, cdt, kcs, vcs, nslots, T, kp, vp, kdt, gs, gp, ng, g,
                                 hkv, d, dev, stream)
    _raise(op, rc)


def grouped_window_attention(q, k_cache, v_cache, group_slot, group_pos, int64_t ctx,
                             float scale, out, workspace, int64_t nsplit, int64_t chunk,
                             uintptr_t stream, int use_mma=1):
    """Split-K attention. workspace: float32 CUDA tensor of at least
    attention_workspace_numel(...) elements (may be None when nsplit == 1). use_mma: 0 CUDA
    cores, 1 tensor cores when supported, 2 the same with one m-tile per block (fixed summation
    order for every window shape). Returns 'mma' or 'simt', the path taken."""
    op = "grouped_window_attention"
    cdef int qdt, cdt
    cdef int64_t nslots, T, hkv, d, ng, g, hq
    qdt, cdt, nslots, T, hkv, d, ng, g, hq = _args_attention(op, q, k_cache, v_cache, group_slot,
                                                             group_pos, ctx, out)
    if d > 256:
        raise ValueError(f"{op}: head dim {d} > 256 is not supported by the GPU kernels")
    if ctx >= 2 ** 31:
        raise ValueError(f"{op}: ctx = {ctx} must be < 2**31")
    if nsplit < 1 or chunk < 1 or nsplit * chunk < ctx or nsplit > 4096:
        raise ValueError(f"{op}: nsplit = {nsplit}, chunk = {chunk} must cover ctx = {ctx} "
                         f"(nsplit <= 4096)")
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out),
             ("group_slot", group_slot), ("group_pos", group_pos)]
    cdef int64_t need = strata_gpu_attention_workspace(ng, hkv, (hq // hkv) * g, d, nsplit)
    cdef float* wsp = NULL
    if need > 0:
        if workspace is None:
            raise ValueError(f"{op}: workspace is required when nsplit > 1 ({need} float32)")
        _check_tensor(op, "workspace", workspace, workspace.dim())
        _dtype_code(op, "workspace", workspace, (0,))
        _check_contiguous(op, "workspace", workspace)
        if workspace.numel() < need:
            raise ValueError(f"{op}: workspace has {workspace.numel()} elements, needs {need}")
        named.append(("workspace", workspace))
        wsp = <float*>_ptr(workspace)
    cdef int dev = _device_of(op, named)
    cdef int64_t kcs[3]
    cdef int64_t vcs[3]
    for i in range(3):
        kcs[i] = k_cache.stride(i)
        vcs[i] = v_cache.stride(i)
    cdef void* qp = _ptr(q)
    cdef void* kc = _ptr(k_cache)
    cdef void* vc = _ptr(v_cache)
    cdef void* outp = _ptr(out)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t* gp = <int64_t*>_ptr(group_pos)
    if use_mma not in (0, 1, 2):
        raise ValueError(f"{op}: use_mma = {use_mma} must be 0, 1 or 2")
    cdef int c_mma = use_mma
    cdef int path = 0
    cdef int rc
    with nogil:
        rc = strata_gpu_attention(qp, qdt, kc, vc, cdt, kcs, vcs, nslots, T, gs, gp, ng, g, hq,
                                  hkv, d, ctx, scale, outp, wsp, nsplit, chunk, c_mma, &path, dev,
                                  stream)
    _raise(op, rc)
    return "mma" if path == 1 else "simt"


def causal_conv_window(x, conv_state, weight, group_slot, out, snaps, uintptr_t stream):
    op = "causal_conv_window"
    cdef int xdt, sdt, wdt
    cdef int64_t nslots, ng, g, c, kw
    xdt, sdt, wdt, nslots, ng, g, c, kw = _args_causal_conv(op, x, conv_state, weight, group_slot,
                                                            out, snaps)
    if kw > 16:
        raise ValueError(f"{op}: weight kernel width {kw} must be in [2, 16] for the GPU kernel")
    cdef int dev = _device_of(op, [("x", x), ("conv_state", conv_state), ("weight", weight),
                                   ("out", out), ("snaps", snaps), ("group_slot", group_slot)])
    cdef void* xp = _ptr(x)
    cdef void* sp = _ptr(conv_state)
    cdef void* wp = _ptr(weight)
    cdef void* outp = _ptr(out)
    cdef void* snp = _ptr(snaps)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t sss = conv_state.stride(0)
    cdef int rc
    with nogil:
        rc = strata_gpu_causal_conv(xp, xdt, sp, sdt, sss, nslots, wp, wdt, gs, ng, g, c, kw,
                                    outp, snp, dev, stream)
    _raise(op, rc)


def _check_qkvz_columns(str op, x, int64_t nk, int64_t dk, int64_t vpk):
    """The gathering convs' x: (NG, G, >= nk (2 dk + 2 vpk)) columns, the heads' widths >= 1."""
    if nk < 1 or dk < 1 or vpk < 1:
        raise ValueError(f"{op}: nk, dk and vpk must be >= 1, got {nk}, {dk}, {vpk}")
    _check_tensor(op, "x", x, 3)
    if x.shape[2] < nk * (2 * dk + 2 * vpk):
        raise ValueError(f"{op}: x has {x.shape[2]} columns, fewer than the {nk} key heads' "
                         f"{nk * (2 * dk + 2 * vpk)}")


def causal_conv_window_qkvz(x, conv_state, weight, group_slot, out, snaps, int64_t nk,
                            int64_t dk, int64_t vpk, uintptr_t stream):
    """causal_conv_window over channels [q | k | v] gathered from x (NG, G, >= nk W), the
    in_proj's qkvz columns, per key head [q (dk) | k (dk) | v (vpk) | z (vpk)] (W = 2 dk +
    2 vpk): C = 2 nk dk + nk vpk channels; out (NG, G, C) and snaps (NG, G, C, K-1) as
    causal_conv_window's."""
    op = "causal_conv_window_qkvz"
    _check_qkvz_columns(op, x, nk, dk, vpk)
    cdef int xdt, sdt, wdt
    cdef int64_t nslots, ng, g, c, kw
    xdt, sdt, wdt, nslots, ng, g, c, kw = _args_causal_conv(op, x, conv_state, weight, group_slot,
                                                            out, snaps, 2 * nk * dk + nk * vpk)
    if kw > 16:
        raise ValueError(f"{op}: weight kernel width {kw} must be in [2, 16] for the GPU kernel")
    cdef int64_t x_row = _row_stride(op, "x", x)
    cdef int dev = _device_of(op, [("x", x), ("conv_state", conv_state), ("weight", weight),
                                   ("out", out), ("snaps", snaps), ("group_slot", group_slot)])
    cdef void* xp = _ptr(x)
    cdef void* sp = _ptr(conv_state)
    cdef void* wp = _ptr(weight)
    cdef void* outp = _ptr(out)
    cdef void* snp = _ptr(snaps)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t sss = conv_state.stride(0)
    cdef int rc
    with nogil:
        rc = strata_gpu_causal_conv_qkvz(xp, xdt, x_row, nk, dk, vpk, sp, sdt, sss, nslots, wp,
                                         wdt, gs, ng, g, kw, outp, snp, dev, stream)
    _raise(op, rc)


def causal_conv_window_qkvz_ba(x, conv_state, weight, group_slot, out, snaps, int64_t nk,
                               int64_t dk, int64_t vpk, x_normed, w_ba, ba, uintptr_t stream):
    """causal_conv_window_qkvz and, in the same launch, ba (NG, G, 2 nv) = x_normed (NG, G, H)
    . w_ba (2 nv, H)^T, all three in x's dtype and contiguous: float32 sums in an order that
    depends on H alone, so a row's ba is the same bits in any window."""
    op = "causal_conv_window_qkvz_ba"
    _check_qkvz_columns(op, x, nk, dk, vpk)
    cdef int xdt, sdt, wdt
    cdef int64_t nslots, ng, g, c, kw, h, nba
    xdt, sdt, wdt, nslots, ng, g, c, kw = _args_causal_conv(op, x, conv_state, weight, group_slot,
                                                            out, snaps, 2 * nk * dk + nk * vpk)
    if kw > 16:
        raise ValueError(f"{op}: weight kernel width {kw} must be in [2, 16] for the GPU kernel")
    h, nba = _args_conv_ba(op, x, x_normed, w_ba, ba)
    if h >= 2 ** 31 or nba >= 2 ** 31:
        raise ValueError(f"{op}: w_ba's shape {tuple(w_ba.shape)} must be below 2**31 each")
    cdef int64_t x_row = _row_stride(op, "x", x)
    cdef int dev = _device_of(op, [("x", x), ("conv_state", conv_state), ("weight", weight),
                                   ("out", out), ("snaps", snaps), ("group_slot", group_slot),
                                   ("x_normed", x_normed), ("w_ba", w_ba), ("ba", ba)])
    cdef void* xp = _ptr(x)
    cdef void* sp = _ptr(conv_state)
    cdef void* wp = _ptr(weight)
    cdef void* outp = _ptr(out)
    cdef void* snp = _ptr(snaps)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef void* xnp = _ptr(x_normed)
    cdef void* wbp = _ptr(w_ba)
    cdef void* bap = _ptr(ba)
    cdef int64_t sss = conv_state.stride(0)
    cdef int rc
    with nogil:
        rc = strata_gpu_causal_conv_qkvz_ba(xp, xdt, x_row, nk, dk, vpk, sp, sdt, sss, nslots,
                                            wp, wdt, gs, ng, g, kw, outp, snp, xnp, h, wbp, h,
                                            nba, bap, dev, stream)
    _raise(op, rc)


def gated_delta_window(q, k, v, g, beta, rec_state, group_slot, out, snaps, uintptr_t stream,
                       bint final_only=False, bint factors=False):
    """out (NG, G, H, Dv) float32; snaps (NG, G, H, Dk, Dv) float32, or with `final_only`
    (NG, H, Dk, Dv): the state after each group's last row (a prompt chunk's), or with
    `factors` (NG, G, H, Dk + Dv + 1): each row's rank-one update [k | delta | decay], which
    commit_accepted replays."""
    op = "gated_delta_window"
    cdef int mode = _gdn_mode(op, final_only, factors)
    cdef int qdt, kdt, vdt, gdt, bdt
    cdef int64_t nslots, ng, rows, h, dk, dv
    qdt, kdt, vdt, gdt, bdt, nslots, ng, rows, h, dk, dv = _args_gated_delta(
        op, q, k, v, g, beta, rec_state, group_slot, out, snaps, mode)
    if dk > 256:
        raise ValueError(f"{op}: Dk = {dk} > 256 is not supported by the GPU kernel")
    cdef int dev = _device_of(op, [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
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
        rc = strata_gpu_gated_delta(qp, qdt, kp, kdt, vp, vdt, gp, gdt, bp, bdt, sp, sss,
                                    nslots, gs, ng, rows, h, dk, dv, outp, snp, mode,
                                    dev, stream)
    _raise(op, rc)


def gated_delta_window_prep(x, ba, neg_a, dt_bias, rec_state, group_slot, out, snaps,
                            int64_t nk, int64_t dk, double q_scale, double eps,
                            uintptr_t stream, bint factors=False):
    """The gated delta rule from the conv output x (NG, G, C), C >= 2 nk Dk + H Dv, laid out
    [q | k | v ...], and the raw in_proj rows ba (NG, G, >= 2 H), per key head [b (rep) | a
    (rep)], rep = H / nk: q and k L2-normalised (eps; q times q_scale), beta = sigmoid(b)
    (in ba's dtype), g = neg_a * softplus(a + dt_bias) (neg_a = -exp(A_log), both float32
    (H,)). out (NG, G, H, Dv) and snaps (NG, G, H, Dk, Dv) float32, as gated_delta_window's,
    or with `factors` (NG, G, H, Dk + Dv + 1): each row's [k | delta | decay] as the update
    used them (k raw: the kernel folds its norm into delta)."""
    op = "gated_delta_window_prep"
    cdef int mode = _gdn_mode(op, False, factors)
    for name, t, nd in (("x", x, 3), ("ba", ba, 3), ("neg_a", neg_a, 1), ("dt_bias", dt_bias, 1),
                        ("rec_state", rec_state, 4), ("out", out, 4),
                        ("snaps", snaps, 4 if factors else 5)):
        _check_tensor(op, name, t, nd)
    cdef int xdt = _dtype_code(op, "x", x)
    cdef int badt = _dtype_code(op, "ba", ba)
    for name, t in (("neg_a", neg_a), ("dt_bias", dt_bias), ("rec_state", rec_state),
                    ("out", out), ("snaps", snaps)):
        _dtype_code(op, name, t, (0,))
    cdef int64_t ng = x.shape[0], rows = x.shape[1]
    cdef int64_t h = neg_a.shape[0], dv = out.shape[3], nslots = rec_state.shape[0]
    if nk < 1 or h % nk:
        raise ValueError(f"{op}: {h} value heads are not a multiple of {nk} key heads")
    if dk < 1 or dk > 256:
        raise ValueError(f"{op}: Dk = {dk} is not in [1, 256] (the GPU kernel's range)")
    _check_shape(op, "x", x, (ng, rows, None))
    if x.shape[2] < 2 * nk * dk + h * dv:
        raise ValueError(f"{op}: x has {x.shape[2]} channels, fewer than q, k and v's "
                         f"{2 * nk * dk + h * dv}")
    _check_shape(op, "ba", ba, (ng, rows, None))
    if ba.shape[2] < 2 * h:
        raise ValueError(f"{op}: ba has {ba.shape[2]} columns, fewer than b and a's {2 * h}")
    _check_shape(op, "dt_bias", dt_bias, (h,))
    _check_shape(op, "rec_state", rec_state, (nslots, h, dk, dv))
    _check_shape(op, "out", out, (ng, rows, h, dv))
    _check_shape(op, "snaps", snaps, _gdn_snaps_shape(mode, ng, rows, h, dk, dv))
    cdef int64_t x_row = _row_stride(op, "x", x)
    cdef int64_t ba_row = _row_stride(op, "ba", ba)
    for name, t in (("neg_a", neg_a), ("dt_bias", dt_bias), ("out", out), ("snaps", snaps)):
        _check_contiguous(op, name, t)
    _check_inner_dense(op, "rec_state", rec_state, 1)
    _check_index(op, "group_slot", group_slot, ng)
    cdef int dev = _device_of(op, [("x", x), ("ba", ba), ("neg_a", neg_a), ("dt_bias", dt_bias),
                                   ("rec_state", rec_state), ("out", out), ("snaps", snaps),
                                   ("group_slot", group_slot)])
    cdef void* xp = _ptr(x)
    cdef void* bap = _ptr(ba)
    cdef float* nap = <float*>_ptr(neg_a)
    cdef float* dtp = <float*>_ptr(dt_bias)
    cdef float* sp = <float*>_ptr(rec_state)
    cdef float* outp = <float*>_ptr(out)
    cdef float* snp = <float*>_ptr(snaps)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t sss = rec_state.stride(0)
    cdef int64_t rep = h // nk
    cdef float qs = q_scale
    cdef float ep = eps
    cdef int rc
    with nogil:
        rc = strata_gpu_gated_delta_prep(xp, xdt, x_row, bap, badt, ba_row, nap, dtp, rep, qs, ep,
                                         sp, sss, nslots, gs, ng, rows, h, dk, dv, outp, snp,
                                         mode, dev, stream)
    _raise(op, rc)


def commit_accepted(accept, group_slot, group_pos, rec_factors, conv_snaps, rec_state,
                    conv_state, slot_pos, uintptr_t stream):
    """Replay each group's rows 0..accept (their factors) onto its slot's state in place, copy
    the conv snapshot after row accept; advance slot_pos. Dk <= 256."""
    op = "commit_accepted"
    cdef int sndt, csdt
    cdef int64_t L, nslots, ng, g, h, dk, dv, c, km1
    sndt, csdt, L, nslots, ng, g, h, dk, dv, c, km1 = _args_commit(
        op, accept, group_slot, group_pos, rec_factors, conv_snaps, rec_state, conv_state,
        slot_pos)
    if dk > 256:
        raise ValueError(f"{op}: Dk = {dk} > 256 is not supported by the GPU kernel")
    cdef int dev = _device_of(op, [("accept", accept), ("group_slot", group_slot),
                                   ("group_pos", group_pos), ("rec_factors", rec_factors),
                                   ("conv_snaps", conv_snaps), ("rec_state", rec_state),
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
        rc = strata_gpu_commit(ap, gs, gp, ng, g, L, rfp, h, dk, dv, csn, sndt, conv_inner,
                               rst, rs, cst, csdt, cs, nslots, spos, dev, stream)
    _raise(op, rc)


#: Limits of the routed-expert kernel (strata_moe.cuh): rows, rows x top-k, bytes of a weight row.
MOE_MAX_ROWS = 32
MOE_MAX_PAIRS = 512
MOE_MAX_ROW_BYTES = 8192


def conv_set_options(int flags=-1):
    """causal_conv_window's launch switches (bit 1: the earlier serial kernel, one thread per
    channel walking the rows; bit 2, on by default: gated_delta_window_prep's kernel as a
    programmatic dependent launch on sm_90+; the results are the same bits). flags < 0 only
    reads. Returns the previous flags."""
    return strata_gpu_conv_set_options(flags)


def moe_set_options(int flags=-1):
    """moe_experts' launch switches (bit 1: programmatic dependent launch of the down kernel,
    bit 2: early weight loads at small windows, bit 4: two features per gate/up warp where rows
    are short, bit 8: double-buffered down weight loads, bit 16: x rows in shared memory in
    gate/up, bit 32: the streamed kernels on sm_90+ without the expert cache where they are
    faster, bit 64: at every size they take; 1, 2, 8, 16 and 32 on by default; the results are
    the same bits) and of linear_skinny (bit 128, on: FP8 weights on the streamed tensor-core
    kernel where it takes them; other bits than the skinny kernel's; bit 512, on: the skinny
    kernel as a programmatic dependent launch, the same bits; bit 2048, on: bf16 weights of at
    most 16 rows and in a multiple of 32 up to 1024 on tensor cores, other bits; the rest:
    cyext/src/strata_kernels.h). flags < 0 only reads. Returns the previous flags."""
    return strata_gpu_moe_set_options(flags)


def linear_pdl_rows(int rows=-1):
    """linear_skinny's bf16 launches of more than `rows` rows (0-32; default 4) are plain
    launches even with bit 512 of moe_set_options on; the same bits either way. rows < 0 only
    reads. Returns the previous limit."""
    return strata_gpu_linear_pdl_rows(rows)


def moe_workspace_numel(int64_t n, int64_t k, int64_t inter, int64_t hidden=0):
    """float32 elements of scratch that moe_experts needs for n rows, top-k, I = inter and
    H = hidden (from 17 rows a wide launch stages x there; 0 leaves that out)."""
    return strata_gpu_moe_workspace(n, k, inter, hidden)


def moe_sync_ints():
    """int32 elements of moe_experts' `sync` (the fused kernel's ticket and counters)."""
    return strata_gpu_moe_sync_ints()


def moe_wide_takes(int64_t n, int64_t k, int64_t e, int64_t hidden, int64_t inter, int64_t bo,
                   int64_t bi, int device):
    """Whether a moe_experts launch of n rows (17-512) of FP8 weights (no expert cache) with
    bf16 x runs wide on this device (the wide option on, the streamed tensor-core kernels)."""
    return strata_gpu_moe_wide_takes(n, k, e, hidden, inter, bo, bi, DTYPE_FP8, DTYPE_BF16,
                                     device) == 1


def moe_experts(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale, down_scale, int64_t bo,
                int64_t bi, out, workspace, uintptr_t stream, slot_of=None, host_gate_up=None,
                host_down=None, host_gu_scale=None, host_down_scale=None, routed_counts=None,
                window_state=None, count_layer=None, bint prompt=False, sync=None):
    """Routed experts grouped by expert on the device (two launches, no allocation, no sync).
    workspace: float32, at least moe_workspace_numel(N, k, I) elements, 16-byte aligned.
    With slot_of (on the device), the stacks are the expert cache's slots and misses read the
    host store: pinned CPU tensors (read through their device-visible address) or tensors on
    the same GPU. With routed_counts, window_state and count_layer (on the device) the gate/up
    kernel also counts the routing and the window's hits and misses (strata_expert_cache.h).
    prompt: the rows are a prompt chunk's, else a decode window's; FP8 prompt rows take the down
    kernel on tensor cores where the switch is on (other bits; each kind's bits never depend on
    the other rows of the launch).
    sync: int32, moe_sync_ints() elements on the device, zero before its first launch (each
    launch leaves it zero): where given, a decode window's experts may run in one fused grid
    (moe_launch_options(fused=)); one per layer, never shared by launches that could overlap."""
    op = "moe_experts"
    cdef int xdt, wdt
    cdef int64_t n, k, e, hidden, inter
    xdt, wdt, n, k, e, hidden, inter = _args_moe(op, x, w_gate_up, w_down, topk_weight,
                                                 topk_ids, gu_scale, down_scale, bo, bi, out)
    _check_tensor(op, "workspace", workspace, workspace.dim())
    _dtype_code(op, "workspace", workspace, (0,))
    _check_contiguous(op, "workspace", workspace)
    cdef int64_t need = strata_gpu_moe_workspace(n, k, inter, hidden)
    if workspace.numel() < need:
        raise ValueError(f"{op}: workspace has {workspace.numel()} elements, needs {need}")
    named = [("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down),
             ("topk_weight", topk_weight), ("topk_ids", topk_ids), ("out", out),
             ("workspace", workspace)]
    cdef float* gsp = NULL
    cdef float* dsp = NULL
    if wdt == DTYPE_FP8:
        named += [("gu_scale", gu_scale), ("down_scale", down_scale)]
        gsp = <float*>_ptr(gu_scale)
        dsp = <float*>_ptr(down_scale)
    cdef int* syp = NULL
    if sync is not None:
        _check_tensor(op, "sync", sync, 1)
        if sync.dtype != _torch.int32 or sync.numel() < strata_gpu_moe_sync_ints():
            raise ValueError(f"{op}: sync must be int32 with at least "
                             f"{strata_gpu_moe_sync_ints()} elements")
        _check_contiguous(op, "sync", sync)
        named.append(("sync", sync))
        syp = <int*>_ptr(sync)
    cdef StrataExpertCache cache
    cdef StrataExpertCache* cp = NULL
    if slot_of is not None:
        e = _args_expert_cache(op, &cache, slot_of, host_gate_up, host_down, host_gu_scale,
                               host_down_scale, w_gate_up, w_down,
                               gu_scale if wdt == DTYPE_FP8 else None, down_scale)
        named.append(("slot_of", slot_of))
        host = [("host_gate_up", host_gate_up), ("host_down", host_down)]
        if wdt == DTYPE_FP8:
            host += [("host_gu_scale", host_gu_scale), ("host_down_scale", host_down_scale)]
        for name, t in host:
            if t.device.type == "cpu" and not t.is_pinned():
                raise ValueError(f"{op}: {name} is in pageable host memory; the kernels read a "
                                 f"host store through its device address: pin it (pin_memory())")
            if t.device.type != "cpu":
                named.append((name, t))
        named += _args_expert_counting(op, &cache, routed_counts, window_state, count_layer)
        cp = &cache
    else:
        _refuse_counting_without_cache(op, routed_counts, window_state, count_layer)
    cdef int dev = _device_of(op, named)
    cdef void* xp = _ptr(x)
    cdef void* wgu = _ptr(w_gate_up)
    cdef void* wd = _ptr(w_down)
    cdef float* twp = <float*>_ptr(topk_weight)
    cdef int64_t* tip = <int64_t*>_ptr(topk_ids)
    cdef void* outp = _ptr(out)
    cdef float* wsp = <float*>_ptr(workspace)
    cdef int rc
    with nogil:
        rc = strata_gpu_moe_experts(xp, xdt, wgu, wd, wdt, gsp, dsp, bo, bi, twp, tip, n, k, e,
                                    hidden, inter, cp, outp, wsp, 1 if prompt else 0, dev,
                                    stream, syp)
    _raise(op, rc)


def linear_stream_takes(x, weight, int64_t bo, int64_t bi):
    """Whether linear_skinny runs x (M, I) . weight^T on the streamed FP8 tensor-core kernel
    (sm_90+, bf16 x; it takes any M), on x's device."""
    if not (x.is_cuda and x.dim() == 2 and weight.dim() == 2):
        return False
    xdt = DTYPE_BF16 if x.dtype == _torch.bfloat16 else -1
    wdt = DTYPE_FP8 if weight.dtype == getattr(_torch, "float8_e4m3fn", None) else -1
    return strata_gpu_linear_stream_takes(x.shape[0], x.shape[1], weight.shape[0], bo, bi, wdt,
                                          xdt, x.device.index or 0) == 1


def linear_skinny(x, weight, scale_inv, int64_t bo, int64_t bi, out, uintptr_t stream):
    """out (M, O) = x (M, I) . W^T for M <= 32 (any M on the streamed FP8 kernel, see
    linear_stream_takes): W float8_e4m3fn with block scales (scale_inv, block (bo, bi)) or
    bfloat16 (scale_inv None). fp32 accumulation."""
    op = "linear_skinny"
    cdef int xdt, wdt
    cdef int64_t m, fin, o
    xdt, wdt, m, fin, o = _args_linear(op, x, weight, scale_inv, bo, bi, out, (1, DTYPE_FP8))
    named = [("x", x), ("weight", weight), ("out", out)]
    cdef float* sp = NULL
    if wdt == DTYPE_FP8:
        named.append(("scale_inv", scale_inv))
        sp = <float*>_ptr(scale_inv)
    cdef int dev = _device_of(op, named)
    cdef void* xp = _ptr(x)
    cdef void* wp = _ptr(weight)
    cdef void* outp = _ptr(out)
    cdef int rc
    with nogil:
        rc = strata_gpu_linear_skinny(xp, xdt, m, fin, wp, wdt, sp, bo, bi, o, outp, dev, stream)
    _raise(op, rc)


def moe_route(x, w_router, int64_t num_experts, int64_t top_k, bint norm, bias,
              int64_t shared_id, logits, weights, ids, ticket, uintptr_t stream):
    """The MoE router in one launch (strata_router.cu): weights (M, C) float32 and ids (M, C)
    int64 = the top_k experts of softmax(bf16(x . w_router[:E]^T) + bias) (ties to the lower id,
    renormalised when norm), C = top_k, or top_k + 1 with the shared expert (w_router row E its
    gate; weight sigmoid, id shared_id) when shared_id >= 0. x (M, H) bf16, M <= 32; logits: float32
    scratch of at least M * (E + 1) elements; ticket: int32 (1,), zero (left zero)."""
    op = "moe_route"
    _check_tensor(op, "x", x, 2)
    _check_tensor(op, "w_router", w_router, 2)
    for name, t in (("x", x), ("w_router", w_router)):
        _dtype_code(op, name, t, (DTYPE_BF16,))
        _check_contiguous(op, name, t)
    cdef int64_t m = x.shape[0]
    cdef int64_t hidden = x.shape[1]
    cdef int64_t cols = top_k + (1 if shared_id >= 0 else 0)
    if w_router.shape[1] != hidden:
        raise ValueError(f"{op}: w_router has {w_router.shape[1]} columns, x has {hidden}")
    if w_router.shape[0] < num_experts + (1 if shared_id >= 0 else 0):
        raise ValueError(f"{op}: w_router has {w_router.shape[0]} rows, needs {num_experts} "
                         f"experts" + (" and the shared gate" if shared_id >= 0 else ""))
    for name, t, dt in (("weights", weights, _torch.float32), ("ids", ids, _torch.int64)):
        _check_tensor(op, name, t, 2)
        if t.dtype != dt:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {dt}")
        _check_shape(op, name, t, (m, cols))
        _check_contiguous(op, name, t)
    if logits.dtype != _torch.float32 or logits.numel() < m * (num_experts + 1):
        raise ValueError(f"{op}: logits must be float32 with at least {m * (num_experts + 1)} "
                         f"elements")
    if ticket.dtype != _torch.int32 or ticket.numel() != 1:
        raise ValueError(f"{op}: ticket must be one int32")
    named = [("x", x), ("w_router", w_router), ("logits", logits), ("weights", weights),
             ("ids", ids), ("ticket", ticket)]
    cdef float* bp = NULL
    if bias is not None:
        if bias.dtype != _torch.float32 or bias.dim() != 1 or bias.shape[0] != num_experts:
            raise ValueError(f"{op}: bias must be float32 of shape ({num_experts},)")
        _check_contiguous(op, "bias", bias)
        named.append(("bias", bias))
        bp = <float*>_ptr(bias)
    cdef int dev = _device_of(op, named)
    cdef void* xp = _ptr(x)
    cdef void* wp = _ptr(w_router)
    cdef float* lp = <float*>_ptr(logits)
    cdef float* owp = <float*>_ptr(weights)
    cdef int64_t* oip = <int64_t*>_ptr(ids)
    cdef int* tp = <int*>_ptr(ticket)
    cdef int64_t rows = w_router.shape[0]
    cdef int rc
    with nogil:
        rc = strata_gpu_moe_route(xp, m, hidden, wp, rows, num_experts, bp, top_k, norm,
                                  shared_id, lp, owp, oip, tp, dev, stream)
    _raise(op, rc)



def l2_prefetch(tensors, ids, uintptr_t stream, int ctas=0, int threads=0):
    """Prefetch into L2 (strata_prefetch.cu) the bytes of up to 4 contiguous tensors, or with
    ids (int64 on the device, any shape) their rows t[ids] (ids outside [0, t.shape[0])
    skipped): a hint for the kernels that read them next; nothing is written. ctas / threads:
    the launch's grid (0: the default layout), for measuring."""
    op = "l2_prefetch"
    cdef int n = len(tensors)
    if n > 4:
        raise ValueError(f"{op}: at most 4 tensors a call, got {n}")
    named = [(f"tensors[{j}]", t) for j, t in enumerate(tensors)]
    for name, t in named:
        _check_contiguous(op, name, t)
    cdef const int64_t* ip = NULL
    cdef int64_t nids = 0
    if ids is not None:
        _check_contiguous(op, "ids", ids)
        if ids.dtype != _torch.int64:
            raise TypeError(f"{op}: ids has dtype {ids.dtype}; expected torch.int64")
        named.append(("ids", ids))
        ip = <const int64_t*>_ptr(ids)
        nids = ids.numel()
    if not named:
        return
    cdef int dev = _device_of(op, named)
    cdef const void* bases[4]
    cdef int64_t nbytes[4]
    cdef int64_t nrows[4]
    for j, t in enumerate(tensors):
        bases[j] = _ptr(t)
        if ids is None:
            nbytes[j] = t.numel() * t.element_size()
            nrows[j] = 1
        else:
            nbytes[j] = (t.numel() // t.shape[0]) * t.element_size() if t.shape[0] else 0
            nrows[j] = t.shape[0]
    cdef int rc
    with nogil:
        rc = strata_gpu_l2_prefetch(bases, nbytes, nrows, n, ip, nids, ctas, threads, dev, stream)
    _raise(op, rc)
