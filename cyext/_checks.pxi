# Argument checks shared by strata_cpu.pyx and strata_cuda.pyx (textually included).
# They work on torch tensors through their Python API only (dtype, device, shape, stride,
# data_ptr), so no torch C++ headers are needed to build the extensions.

from libc.stdint cimport int64_t, uintptr_t

import torch as _torch

cdef extern from "strata_expert_cache.h" nogil:
    ctypedef struct StrataExpertCache:
        const int* slot_of
        int64_t n_slots
        const void* host_gate_up
        const void* host_down
        const float* host_gu_scale
        const float* host_down_scale
        int64_t n_host
        float* routed_counts
        int* window_state
        const int* count_layer
        int64_t n_layers

# run-time element-type codes of strata_common.h
DTYPE_F32 = 0
DTYPE_BF16 = 1
DTYPE_F16 = 2
DTYPE_FP8 = 3  # float8_e4m3fn weights with block scales (routed experts, linear_fp8)
_CODES = {_torch.float32: 0, _torch.bfloat16: 1, _torch.float16: 2}
_NAMES = {0: "float32", 1: "bfloat16", 2: "float16", 3: "float8_e4m3fn"}
if hasattr(_torch, "float8_e4m3fn"):
    _CODES[_torch.float8_e4m3fn] = 3
FLOATS = (0, 1, 2)
WEIGHTS = (0, 1, 2, 3)


cdef int _check_tensor(str op, str name, object t, int ndim) except -1:
    if not isinstance(t, _torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    return 0


cdef int _dtype_code(str op, str name, object t, tuple allowed=FLOATS) except -1:
    code = _CODES.get(t.dtype, -1)
    if code not in allowed:
        want = ", ".join(_NAMES[c] for c in allowed)
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {want}")
    return code


cdef int _check_index(str op, str name, object t, int64_t n) except -1:
    _check_tensor(op, name, t, 1)
    if t.dtype != _torch.int64:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected int64")
    if n >= 0 and t.shape[0] != n:
        raise ValueError(f"{op}: {name} must have shape ({n},), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")
    return 0


cdef int _check_shape(str op, str name, object t, tuple shape) except -1:
    """shape entries of None match anything."""
    got = tuple(t.shape)
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
        raise ValueError(f"{op}: {name} must have shape {want}, got {got}")
    return 0


cdef int _check_contiguous(str op, str name, object t) except -1:
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (call .contiguous() first)")
    return 0


cdef int _check_inner_dense(str op, str name, object t, int first) except -1:
    """Dimensions first.. of t must be densely packed (outer dimensions may be strided)."""
    cdef int64_t expect = 1
    for i in range(t.dim() - 1, first - 1, -1):
        if t.shape[i] != 1 and t.stride(i) != expect:
            raise ValueError(
                f"{op}: {name} must be densely packed in its dimensions {first}.. "
                f"(shape {tuple(t.shape)}, strides {t.stride()})")
        expect *= t.shape[i]
    return 0


cdef int64_t _row_stride(str op, str name, object t) except -1:
    """The stride between consecutive rows of the (NG, G) grid of a 3-d t whose last dimension
    has unit stride (a column slice of a wider output may be passed as it is): row n * G + j
    at (n * G + j) times it. Raises naming the tensor when the rows are not evenly strided."""
    ng, rows = t.shape[0], t.shape[1]
    if t.stride(2) != 1 or (rows > 1 and ng > 1 and t.stride(0) != rows * t.stride(1)):
        raise ValueError(f"{op}: {name} must have unit stride in its last dimension and "
                         f"evenly strided rows (shape {tuple(t.shape)}, strides {t.stride()})")
    return t.stride(1) if rows > 1 else t.stride(0)


cdef inline void* _ptr(object t):
    return <void*><uintptr_t>t.data_ptr()


# ---- per-operation checks (everything but the device: each extension checks that itself) ----
# Each returns the dtype codes and sizes its operation's launch needs.

cdef tuple _args_write_kv(str op, k_cache, v_cache, k, v, group_slot, group_pos):
    """-> (cache dtype, k/v dtype, nslots, T, hkv, d, ng, g)"""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        _check_tensor(op, name, t, 4)
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
    return cdt, kdt, nslots, T, hkv, d, ng, g


cdef tuple _args_attention(str op, q, k_cache, v_cache, group_slot, group_pos, int64_t ctx, out):
    """-> (q dtype, cache dtype, nslots, T, hkv, d, ng, g, hq)"""
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
    if ctx < 1 or ctx > T:
        raise ValueError(f"{op}: ctx = {ctx} must be in [1, {T}] (cache length)")
    _check_contiguous(op, "q", q)
    _check_contiguous(op, "out", out)
    _check_inner_dense(op, "k_cache", k_cache, 3)
    _check_inner_dense(op, "v_cache", v_cache, 3)
    _check_index(op, "group_slot", group_slot, ng)
    _check_index(op, "group_pos", group_pos, ng)
    return qdt, cdt, nslots, T, hkv, d, ng, g, hq


cdef tuple _args_causal_conv(str op, x, conv_state, weight, group_slot, out, snaps,
                             int64_t channels=-1):
    """-> (x dtype, state dtype, weight dtype, nslots, ng, g, c, kw). channels >= 0: the conv
    has that many channels, gathered from x's wider rows (causal_conv_window_qkvz: its caller
    checks x's columns and takes its row stride), so x's last dimension is not c and x need not
    be contiguous."""
    for name, t, nd in (("x", x, 3), ("conv_state", conv_state, 3), ("weight", weight, 2),
                        ("out", out, 3), ("snaps", snaps, 4)):
        _check_tensor(op, name, t, nd)
    cdef int xdt = _dtype_code(op, "x", x)
    cdef int sdt = _dtype_code(op, "conv_state", conv_state)
    cdef int wdt = _dtype_code(op, "weight", weight)
    if out.dtype != x.dtype or snaps.dtype != x.dtype:
        raise TypeError(f"{op}: out and snaps must have x's dtype {x.dtype}")
    ng, g = x.shape[0], x.shape[1]
    c = x.shape[2] if channels < 0 else channels
    c_w, kw = weight.shape
    if c_w != c:
        raise ValueError(f"{op}: weight must have shape ({c}, K), got {tuple(weight.shape)}")
    if kw < 2:
        raise ValueError(f"{op}: weight kernel width {kw} must be at least 2")
    nslots = conv_state.shape[0]
    _check_shape(op, "conv_state", conv_state, (nslots, c, kw - 1))
    _check_shape(op, "out", out, (ng, g, c))
    _check_shape(op, "snaps", snaps, (ng, g, c, kw - 1))
    if channels < 0:
        _check_contiguous(op, "x", x)
    for name, t in (("weight", weight), ("out", out), ("snaps", snaps)):
        _check_contiguous(op, name, t)
    _check_inner_dense(op, "conv_state", conv_state, 1)
    _check_index(op, "group_slot", group_slot, ng)
    return xdt, sdt, wdt, nslots, ng, g, c, kw


cdef tuple _args_conv_ba(str op, x, x_normed, w_ba, ba):
    """causal_conv_window_qkvz_ba's b/a projection: x_normed (NG, G, H) and w_ba (2 nv, H) in
    x's dtype (the qkvz columns'), ba (NG, G, 2 nv) too; all three contiguous. -> (H, 2 nv)"""
    for name, t, nd in (("x_normed", x_normed, 3), ("w_ba", w_ba, 2), ("ba", ba, 3)):
        _check_tensor(op, name, t, nd)
        _dtype_code(op, name, t)
        if t.dtype != x.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected x's {x.dtype}")
    ng, g, hidden = x_normed.shape
    if ng != x.shape[0] or g != x.shape[1]:
        raise ValueError(f"{op}: x_normed must have shape ({x.shape[0]}, {x.shape[1]}, H) as x's "
                         f"window, got {tuple(x_normed.shape)}")
    nba = w_ba.shape[0]
    if w_ba.shape[1] != hidden or nba < 1 or hidden < 1:
        raise ValueError(f"{op}: w_ba must have shape (2 nv, H={hidden}) as x_normed's H, got "
                         f"{tuple(w_ba.shape)}")
    _check_shape(op, "ba", ba, (ng, g, nba))
    for name, t in (("x_normed", x_normed), ("w_ba", w_ba), ("ba", ba)):
        _check_contiguous(op, name, t)
    return hidden, nba


cdef int _gdn_mode(str op, bint final_only, bint factors) except -1:
    """The gated delta rule's STRATA_GDN_* mode (strata_common.h): what `snaps` holds."""
    if final_only and factors:
        raise ValueError(f"{op}: final_only and factors exclude each other")
    return 1 if final_only else (2 if factors else 0)


cdef tuple _gdn_snaps_shape(int mode, int64_t ng, int64_t rows, int64_t h, int64_t dk,
                            int64_t dv):
    """snaps' shape by mode: the state after every row, after the last, or every row's
    rank-one update factors [k | delta | decay]."""
    if mode == 1:
        return (ng, h, dk, dv)
    if mode == 2:
        return (ng, rows, h, dk + dv + 1)
    return (ng, rows, h, dk, dv)


cdef tuple _args_gated_delta(str op, q, k, v, g, beta, rec_state, group_slot, out, snaps,
                             int mode=0):
    """-> (q, k, v, g, beta dtypes, nslots, ng, rows, h, dk, dv). `mode` (_gdn_mode): snaps
    is (NG, G, H, Dk, Dv) snapshots, (NG, H, Dk, Dv) the state after each group's last row,
    or (NG, G, H, Dk + Dv + 1) factors."""
    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3),
                        ("rec_state", rec_state, 4), ("out", out, 4),
                        ("snaps", snaps, 5 if mode == 0 else 4)):
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
    nslots = rec_state.shape[0]
    _check_shape(op, "k", k, (ng, rows, h, dk))
    _check_shape(op, "v", v, (ng, rows, h, dv))
    _check_shape(op, "g", g, (ng, rows, h))
    _check_shape(op, "beta", beta, (ng, rows, h))
    _check_shape(op, "rec_state", rec_state, (nslots, h, dk, dv))
    _check_shape(op, "out", out, (ng, rows, h, dv))
    _check_shape(op, "snaps", snaps, _gdn_snaps_shape(mode, ng, rows, h, dk, dv))
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out),
                    ("snaps", snaps)):
        _check_contiguous(op, name, t)
    _check_inner_dense(op, "rec_state", rec_state, 1)
    _check_index(op, "group_slot", group_slot, ng)
    return qdt, kdt, vdt, gdt, bdt, nslots, ng, rows, h, dk, dv


cdef tuple _args_commit(str op, accept, group_slot, group_pos, rec_factors, conv_snaps,
                        rec_state, conv_state, slot_pos):
    """-> (conv snapshot dtype, conv state dtype, L, nslots, ng, g, h, dk, dv, c, km1).
    rec_factors (L, NG, G, H, Dk + Dv + 1): the window's rows' [k | delta | decay]."""
    for name, t, nd in (("rec_factors", rec_factors, 5), ("conv_snaps", conv_snaps, 5),
                        ("rec_state", rec_state, 5), ("conv_state", conv_state, 4)):
        _check_tensor(op, name, t, nd)
    _dtype_code(op, "rec_factors", rec_factors, (0,))
    _dtype_code(op, "rec_state", rec_state, (0,))
    cdef int sndt = _dtype_code(op, "conv_snaps", conv_snaps)
    cdef int csdt = _dtype_code(op, "conv_state", conv_state)
    L, ng, g, h = rec_factors.shape[:4]
    dk, dv = rec_state.shape[3], rec_state.shape[4]
    c, km1 = conv_snaps.shape[3], conv_snaps.shape[4]
    nslots = rec_state.shape[1]
    if conv_snaps.shape[0] != L:
        raise ValueError(f"{op}: conv_snaps has {conv_snaps.shape[0]} layers, rec_factors {L}")
    _check_shape(op, "rec_factors", rec_factors, (L, ng, g, h, dk + dv + 1))
    _check_shape(op, "conv_snaps", conv_snaps, (L, ng, g, c, km1))
    _check_shape(op, "rec_state", rec_state, (L, nslots, h, dk, dv))
    _check_shape(op, "conv_state", conv_state, (L, nslots, c, km1))
    _check_contiguous(op, "rec_factors", rec_factors)
    _check_contiguous(op, "conv_snaps", conv_snaps)
    _check_inner_dense(op, "rec_state", rec_state, 2)
    _check_inner_dense(op, "conv_state", conv_state, 2)
    for name, t in (("accept", accept), ("group_slot", group_slot), ("group_pos", group_pos)):
        _check_index(op, name, t, ng)
    _check_index(op, "slot_pos", slot_pos, nslots)
    return sndt, csdt, L, nslots, ng, g, h, dk, dv, c, km1


cdef int _check_scale(str op, str name, object t, tuple shape) except -1:
    if t is None:
        raise ValueError(f"{op}: FP8 weights need {name} (float32 block scales)")
    _check_tensor(op, name, t, len(shape))
    _dtype_code(op, name, t, (0,))
    _check_shape(op, name, t, shape)
    _check_contiguous(op, name, t)
    return 0


cdef tuple _args_moe(str op, x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale, down_scale,
                     int64_t bo, int64_t bi, out):
    """-> (x dtype, weight dtype, n, k, E, H, I)"""
    _check_tensor(op, "x", x, 2)
    xdt = _dtype_code(op, "x", x)
    _check_contiguous(op, "x", x)
    n, hidden = x.shape
    _check_tensor(op, "w_gate_up", w_gate_up, 3)
    wdt = _dtype_code(op, "w_gate_up", w_gate_up, WEIGHTS)
    _check_contiguous(op, "w_gate_up", w_gate_up)
    e, two_i, h2 = w_gate_up.shape
    if two_i % 2 or h2 != hidden:
        raise ValueError(f"{op}: w_gate_up must have shape (E, 2I, H={hidden}), got "
                         f"{tuple(w_gate_up.shape)}")
    inter = two_i // 2
    _check_tensor(op, "w_down", w_down, 3)
    if w_down.dtype != w_gate_up.dtype:
        raise TypeError(f"{op}: w_down has dtype {w_down.dtype}, w_gate_up {w_gate_up.dtype}")
    _check_shape(op, "w_down", w_down, (e, hidden, inter))
    _check_contiguous(op, "w_down", w_down)
    _check_tensor(op, "topk_ids", topk_ids, 2)
    if topk_ids.dtype != _torch.int64:
        raise TypeError(f"{op}: topk_ids has dtype {topk_ids.dtype}; expected int64")
    _check_shape(op, "topk_ids", topk_ids, (n, None))
    _check_contiguous(op, "topk_ids", topk_ids)
    k = topk_ids.shape[1]
    _check_tensor(op, "topk_weight", topk_weight, 2)
    _dtype_code(op, "topk_weight", topk_weight, (0,))
    _check_shape(op, "topk_weight", topk_weight, (n, k))
    _check_contiguous(op, "topk_weight", topk_weight)
    if wdt == DTYPE_FP8:
        if bo < 1 or bi < 1:
            raise ValueError(f"{op}: block ({bo}, {bi}) must be positive")
        _check_scale(op, "gu_scale", gu_scale,
                     (e, 2 * ((inter + bo - 1) // bo), (hidden + bi - 1) // bi))
        _check_scale(op, "down_scale", down_scale,
                     (e, (hidden + bo - 1) // bo, (inter + bi - 1) // bi))
    _check_tensor(op, "out", out, 2)
    if out.dtype != x.dtype:
        raise TypeError(f"{op}: out has dtype {out.dtype}, x {x.dtype}")
    _check_shape(op, "out", out, (n, hidden))
    _check_contiguous(op, "out", out)
    return xdt, wdt, n, k, e, hidden, inter


cdef int64_t _args_expert_cache(str op, StrataExpertCache* c, slot_of, host_gate_up, host_down,
                                host_gu_scale, host_down_scale, w_gate_up, w_down, gu_scale,
                                down_scale) except -1:
    """Check the expert cache's arguments of moe_experts (reference.moe_experts) against the
    slot stacks and fill `c`; returns E (the ids slot_of covers). Devices are the caller's."""
    _check_tensor(op, "slot_of", slot_of, 1)
    if slot_of.dtype != _torch.int32:
        raise TypeError(f"{op}: slot_of has dtype {slot_of.dtype}; expected int32")
    _check_contiguous(op, "slot_of", slot_of)
    if host_gate_up is None or host_down is None:
        raise ValueError(f"{op}: slot_of needs the host store (host_gate_up, host_down)")
    named = [("host_gate_up", host_gate_up, w_gate_up), ("host_down", host_down, w_down)]
    if gu_scale is not None:
        if host_gu_scale is None or host_down_scale is None:
            raise ValueError(f"{op}: FP8 slots need the host store's scales "
                             f"(host_gu_scale, host_down_scale)")
        named += [("host_gu_scale", host_gu_scale, gu_scale),
                  ("host_down_scale", host_down_scale, down_scale)]
    n_host = host_gate_up.shape[0] if isinstance(host_gate_up, _torch.Tensor) else -1
    for name, t, like in named:
        _check_tensor(op, name, t, like.dim())
        if t.dtype != like.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}, its slots {like.dtype}")
        _check_shape(op, name, t, (n_host,) + tuple(like.shape[1:]))
        _check_contiguous(op, name, t)
    if n_host > slot_of.shape[0]:
        raise ValueError(f"{op}: the host store has {n_host} experts, slot_of only "
                         f"{slot_of.shape[0]}")
    c.slot_of = <const int*>_ptr(slot_of)
    c.n_slots = w_gate_up.shape[0]
    c.host_gate_up = _ptr(host_gate_up)
    c.host_down = _ptr(host_down)
    c.host_gu_scale = <const float*>_ptr(host_gu_scale) if gu_scale is not None else NULL
    c.host_down_scale = <const float*>_ptr(host_down_scale) if gu_scale is not None else NULL
    c.n_host = n_host
    c.routed_counts = NULL
    c.window_state = NULL
    c.count_layer = NULL
    c.n_layers = 0
    return slot_of.shape[0]


cdef int _refuse_counting_without_cache(str op, routed_counts, window_state,
                                        count_layer) except -1:
    """moe_experts without slot_of: the counting arguments count the expert cache's reads."""
    if routed_counts is not None or window_state is not None or count_layer is not None:
        raise ValueError(f"{op}: routed_counts, window_state and count_layer count the expert "
                         f"cache's reads: they need slot_of")
    return 0


cdef list _args_expert_counting(str op, StrataExpertCache* c, routed_counts, window_state,
                                count_layer):
    """Check the expert cache's counting arguments of moe_experts (all three or none;
    strata_expert_cache.h) and fill `c` (after _args_expert_cache); returns them named, for the
    device check."""
    given = [t is not None for t in (routed_counts, window_state, count_layer)]
    if not any(given):
        return []
    if not all(given):
        raise ValueError(f"{op}: routed_counts, window_state and count_layer go together (the "
                         f"expert cache's counting), got only some")
    _check_tensor(op, "routed_counts", routed_counts, 2)
    n_layers = routed_counts.shape[0]
    named = [("routed_counts", routed_counts, _torch.float32, (n_layers, c.n_host)),
             ("window_state", window_state, _torch.int32, (2 + n_layers * c.n_host,)),
             ("count_layer", count_layer, _torch.int32, (1,))]
    for name, t, dt, shape in named:
        _check_tensor(op, name, t, len(shape))
        if t.dtype != dt:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {dt}")
        _check_shape(op, name, t, shape)
        _check_contiguous(op, name, t)
    c.routed_counts = <float*>_ptr(routed_counts)
    c.window_state = <int*>_ptr(window_state)
    c.count_layer = <const int*>_ptr(count_layer)
    c.n_layers = n_layers
    return [(name, t) for name, t, _, _ in named]


cdef tuple _args_linear(str op, x, weight, scale_inv, int64_t bo, int64_t bi, out, tuple wdts):
    """x (m, in), weight (o, in), out (m, o) -> (x dtype, weight dtype, m, in, o)"""
    _check_tensor(op, "x", x, 2)
    xdt = _dtype_code(op, "x", x)
    _check_contiguous(op, "x", x)
    m, fin = x.shape
    _check_tensor(op, "weight", weight, 2)
    wdt = _dtype_code(op, "weight", weight, wdts)
    _check_shape(op, "weight", weight, (None, fin))
    _check_contiguous(op, "weight", weight)
    o = weight.shape[0]
    if wdt == DTYPE_FP8:
        if bo < 1 or bi < 1:
            raise ValueError(f"{op}: block ({bo}, {bi}) must be positive")
        _check_scale(op, "scale_inv", scale_inv, ((o + bo - 1) // bo, (fin + bi - 1) // bi))
    _check_tensor(op, "out", out, 2)
    if out.dtype != x.dtype:
        raise TypeError(f"{op}: out has dtype {out.dtype}, x {x.dtype}")
    _check_shape(op, "out", out, (m, o))
    _check_contiguous(op, "out", out)
    return xdt, wdt, m, fin, o
