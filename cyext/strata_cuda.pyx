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
    int strata_gpu_gated_delta(const void* q, int q_dtype, const void* k, int k_dtype,
                               const void* v, int v_dtype, const void* gate, int g_dtype,
                               const void* beta, int b_dtype, const float* rec_state,
                               int64_t state_slot_stride, int64_t nslots,
                               const int64_t* group_slot, int64_t ng, int64_t g, int64_t h,
                               int64_t dk, int64_t dv, float* out, float* snaps, int device,
                               uintptr_t stream)
    int strata_gpu_commit(const int64_t* accept, const int64_t* group_slot,
                          const int64_t* group_pos, int64_t ng, int64_t g, int64_t L,
                          const float* rec_snaps, int64_t rec_inner, const void* conv_snaps,
                          int snap_dtype, int64_t conv_inner, float* rec_state,
                          const int64_t* rec_strides, void* conv_state, int state_dtype,
                          const int64_t* conv_strides, int64_t nslots, int64_t* slot_pos,
                          int device, uintptr_t stream)


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
    for name, t, nd in (("k_cache", k_cache, 4), ("v_cache", v_cache, 4), ("k", k, 4),
                        ("v", v, 4)):
        _check_tensor(op, name, t, nd)
    cdef int cdt = _dtype_code(op, "k_cache", k_cache)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"{op}: v_cache dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    cdef int kdt = _dtype_code(op, "k", k)
    if v.dtype != k.dtype:
        raise TypeError(f"{op}: v dtype {v.dtype} differs from k {k.dtype}")
    nslots, T, hkv, d = k_cache.shape
    _check_shape(op, "v_cache", v_cache, (nslots, T, hkv, d))
    ng, g = k.shape[0], k.shape[1]
    _check_shape(op, "k", k, (ng, g, hkv, d))
    _check_shape(op, "v", v, (ng, g, hkv, d))
    _check_contiguous(op, "k", k)
    _check_contiguous(op, "v", v)
    _check_inner_dense(op, "k_cache", k_cache, 3)
    _check_inner_dense(op, "v_cache", v_cache, 3)
    _check_index(op, "group_slot", group_slot, ng)
    _check_index(op, "group_pos", group_pos, ng)
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
    cdef int64_t c_nslots = nslots, c_T = T, c_ng = ng, c_g = g, c_hkv = hkv, c_d = d
    cdef int rc
    with nogil:
        rc = strata_gpu_write_kv(kc, vc, cdt, kcs, vcs, c_nslots, c_T, kp, vp, kdt, gs, gp,
                                 c_ng, c_g, c_hkv, c_d, dev, stream)
    _raise(op, rc)


def grouped_window_attention(q, k_cache, v_cache, group_slot, group_pos, int64_t ctx,
                             float scale, out, workspace, int64_t nsplit, int64_t chunk,
                             uintptr_t stream, bint use_mma=True):
    """Split-K attention. workspace: float32 CUDA tensor of at least
    attention_workspace_numel(...) elements (may be None when nsplit == 1).
    Returns 'mma' or 'simt', the path taken."""
    op = "grouped_window_attention"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        _check_tensor(op, name, t, 4)
    cdef int qdt = _dtype_code(op, "q", q)
    cdef int cdt = _dtype_code(op, "k_cache", k_cache)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"{op}: v_cache dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    if out.dtype != q.dtype:
        raise TypeError(f"{op}: out dtype {out.dtype} differs from q {q.dtype}")
    nslots, T, hkv, d = k_cache.shape
    _check_shape(op, "v_cache", v_cache, (nslots, T, hkv, d))
    ng, g, hq = q.shape[0], q.shape[1], q.shape[2]
    _check_shape(op, "q", q, (ng, g, hq, d))
    _check_shape(op, "out", out, (ng, g, hq, d))
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"{op}: q has {hq} heads, not a multiple of the caches' {hkv} KV heads")
    if d > 256:
        raise ValueError(f"{op}: head dim {d} > 256 is not supported by the GPU kernels")
    if ctx < 1 or ctx > T:
        raise ValueError(f"{op}: ctx = {ctx} must be in [1, {T}] (cache length)")
    if ctx >= 2 ** 31:
        raise ValueError(f"{op}: ctx = {ctx} must be < 2**31")
    if nsplit < 1 or chunk < 1 or nsplit * chunk < ctx or nsplit > 4096:
        raise ValueError(f"{op}: nsplit = {nsplit}, chunk = {chunk} must cover ctx = {ctx} "
                         f"(nsplit <= 4096)")
    _check_contiguous(op, "q", q)
    _check_contiguous(op, "out", out)
    _check_inner_dense(op, "k_cache", k_cache, 3)
    _check_inner_dense(op, "v_cache", v_cache, 3)
    _check_index(op, "group_slot", group_slot, ng)
    _check_index(op, "group_pos", group_pos, ng)
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
    cdef int64_t c_nslots = nslots, c_T = T, c_ng = ng, c_g = g, c_hq = hq, c_hkv = hkv, c_d = d
    cdef int c_mma = 1 if use_mma else 0
    cdef int path = 0
    cdef int rc
    with nogil:
        rc = strata_gpu_attention(qp, qdt, kc, vc, cdt, kcs, vcs, c_nslots, c_T, gs, gp, c_ng,
                                  c_g, c_hq, c_hkv, c_d, ctx, scale, outp, wsp, nsplit, chunk,
                                  c_mma, &path, dev, stream)
    _raise(op, rc)
    return "mma" if path == 1 else "simt"


def causal_conv_window(x, conv_state, weight, group_slot, out, snaps, uintptr_t stream):
    op = "causal_conv_window"
    _check_tensor(op, "x", x, 3)
    _check_tensor(op, "conv_state", conv_state, 3)
    _check_tensor(op, "weight", weight, 2)
    _check_tensor(op, "out", out, 3)
    _check_tensor(op, "snaps", snaps, 4)
    cdef int xdt = _dtype_code(op, "x", x)
    cdef int sdt = _dtype_code(op, "conv_state", conv_state)
    cdef int wdt = _dtype_code(op, "weight", weight)
    if out.dtype != x.dtype or snaps.dtype != x.dtype:
        raise TypeError(f"{op}: out and snaps must have x's dtype {x.dtype}")
    ng, g, c = x.shape
    c_w, kw = weight.shape
    if c_w != c:
        raise ValueError(f"{op}: weight must have shape ({c}, K), got {tuple(weight.shape)}")
    if kw < 2 or kw > 16:
        raise ValueError(f"{op}: weight kernel width {kw} must be in [2, 16]")
    nslots = conv_state.shape[0]
    _check_shape(op, "conv_state", conv_state, (nslots, c, kw - 1))
    _check_shape(op, "out", out, (ng, g, c))
    _check_shape(op, "snaps", snaps, (ng, g, c, kw - 1))
    for name, t in (("x", x), ("weight", weight), ("out", out), ("snaps", snaps)):
        _check_contiguous(op, name, t)
    _check_inner_dense(op, "conv_state", conv_state, 1)
    _check_index(op, "group_slot", group_slot, ng)
    cdef int dev = _device_of(op, [("x", x), ("conv_state", conv_state), ("weight", weight),
                                   ("out", out), ("snaps", snaps), ("group_slot", group_slot)])
    cdef void* xp = _ptr(x)
    cdef void* sp = _ptr(conv_state)
    cdef void* wp = _ptr(weight)
    cdef void* outp = _ptr(out)
    cdef void* snp = _ptr(snaps)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t sss = conv_state.stride(0)
    cdef int64_t c_nslots = nslots, c_ng = ng, c_g = g, c_c = c, c_kw = kw
    cdef int rc
    with nogil:
        rc = strata_gpu_causal_conv(xp, xdt, sp, sdt, sss, c_nslots, wp, wdt, gs, c_ng, c_g, c_c,
                                    c_kw, outp, snp, dev, stream)
    _raise(op, rc)


def gated_delta_window(q, k, v, g, beta, rec_state, group_slot, out, snaps, uintptr_t stream):
    op = "gated_delta_window"
    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3),
                        ("rec_state", rec_state, 4), ("out", out, 4), ("snaps", snaps, 5)):
        _check_tensor(op, name, t, nd)
    cdef int qdt = _dtype_code(op, "q", q)
    cdef int kdt = _dtype_code(op, "k", k)
    cdef int vdt = _dtype_code(op, "v", v)
    cdef int gdt = _dtype_code(op, "g", g)
    cdef int bdt = _dtype_code(op, "beta", beta)
    _dtype_code(op, "rec_state", rec_state, (0,))
    _dtype_code(op, "out", out, (0,))
    _dtype_code(op, "snaps", snaps, (0,))
    ng, rows, h, dk = q.shape
    dv = v.shape[3]
    if dk > 256:
        raise ValueError(f"{op}: Dk = {dk} > 256 is not supported by the GPU kernel")
    nslots = rec_state.shape[0]
    _check_shape(op, "k", k, (ng, rows, h, dk))
    _check_shape(op, "v", v, (ng, rows, h, dv))
    _check_shape(op, "g", g, (ng, rows, h))
    _check_shape(op, "beta", beta, (ng, rows, h))
    _check_shape(op, "rec_state", rec_state, (nslots, h, dk, dv))
    _check_shape(op, "out", out, (ng, rows, h, dv))
    _check_shape(op, "snaps", snaps, (ng, rows, h, dk, dv))
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out),
                    ("snaps", snaps)):
        _check_contiguous(op, name, t)
    _check_inner_dense(op, "rec_state", rec_state, 1)
    _check_index(op, "group_slot", group_slot, ng)
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
    cdef int64_t c_nslots = nslots, c_ng = ng, c_g = rows, c_h = h, c_dk = dk, c_dv = dv
    cdef int rc
    with nogil:
        rc = strata_gpu_gated_delta(qp, qdt, kp, kdt, vp, vdt, gp, gdt, bp, bdt, sp, sss,
                                    c_nslots, gs, c_ng, c_g, c_h, c_dk, c_dv, outp, snp, dev,
                                    stream)
    _raise(op, rc)


def commit_accepted(accept, group_slot, group_pos, rec_snaps, conv_snaps, rec_state, conv_state,
                    slot_pos, uintptr_t stream):
    op = "commit_accepted"
    _check_tensor(op, "rec_snaps", rec_snaps, 6)
    _check_tensor(op, "conv_snaps", conv_snaps, 5)
    _check_tensor(op, "rec_state", rec_state, 5)
    _check_tensor(op, "conv_state", conv_state, 4)
    _dtype_code(op, "rec_snaps", rec_snaps, (0,))
    _dtype_code(op, "rec_state", rec_state, (0,))
    cdef int sndt = _dtype_code(op, "conv_snaps", conv_snaps)
    cdef int csdt = _dtype_code(op, "conv_state", conv_state)
    L, ng, g, h, dk, dv = rec_snaps.shape
    c, km1 = conv_snaps.shape[3], conv_snaps.shape[4]
    nslots = rec_state.shape[1]
    if conv_snaps.shape[0] != L:
        raise ValueError(f"{op}: conv_snaps has {conv_snaps.shape[0]} layers, rec_snaps {L}")
    _check_shape(op, "conv_snaps", conv_snaps, (L, ng, g, c, km1))
    _check_shape(op, "rec_state", rec_state, (L, nslots, h, dk, dv))
    _check_shape(op, "conv_state", conv_state, (L, nslots, c, km1))
    _check_contiguous(op, "rec_snaps", rec_snaps)
    _check_contiguous(op, "conv_snaps", conv_snaps)
    _check_inner_dense(op, "rec_state", rec_state, 2)
    _check_inner_dense(op, "conv_state", conv_state, 2)
    for name, t in (("accept", accept), ("group_slot", group_slot), ("group_pos", group_pos)):
        _check_index(op, name, t, ng)
    _check_index(op, "slot_pos", slot_pos, nslots)
    cdef int dev = _device_of(op, [("accept", accept), ("group_slot", group_slot),
                                   ("group_pos", group_pos), ("rec_snaps", rec_snaps),
                                   ("conv_snaps", conv_snaps), ("rec_state", rec_state),
                                   ("conv_state", conv_state), ("slot_pos", slot_pos)])
    cdef int64_t rs[2]
    cdef int64_t cs[2]
    rs[0] = rec_state.stride(0); rs[1] = rec_state.stride(1)
    cs[0] = conv_state.stride(0); cs[1] = conv_state.stride(1)
    cdef int64_t* ap = <int64_t*>_ptr(accept)
    cdef int64_t* gs = <int64_t*>_ptr(group_slot)
    cdef int64_t* gp = <int64_t*>_ptr(group_pos)
    cdef float* rsn = <float*>_ptr(rec_snaps)
    cdef void* csn = _ptr(conv_snaps)
    cdef float* rst = <float*>_ptr(rec_state)
    cdef void* cst = _ptr(conv_state)
    cdef int64_t* spos = <int64_t*>_ptr(slot_pos)
    cdef int64_t c_ng = ng, c_g = g, c_L = L, rec_inner = h * dk * dv, conv_inner = c * km1
    cdef int64_t c_nslots = nslots
    cdef int rc
    with nogil:
        rc = strata_gpu_commit(ap, gs, gp, c_ng, c_g, c_L, rsn, rec_inner, csn, sndt, conv_inner,
                               rst, rs, cst, csdt, cs, c_nslots, spos, dev, stream)
    _raise(op, rc)
