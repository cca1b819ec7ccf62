"""GPU parity of the cyext CUDA/HIP kernels with strata.kernels.reference, and CUDA graph capture.

Skipped without a GPU or without the built extension (strata.kernels.strata_cuda).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import cyext_ops as C
from strata.kernels import ops
from strata.kernels import reference as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device"),
    pytest.mark.skipif(C.gpu_platform() is None, reason="strata_cuda extension not built"),
]

DEV = "cuda"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def attn_case(ng, g, hq, hkv, d, S, T, dtype, seed=0, pos=None, slots=None):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    kc = torch.randn(S + 1, T, hkv, d, generator=gen).to(DEV, dtype)
    vc = torch.randn(S + 1, T, hkv, d, generator=gen).to(DEV, dtype)
    q = torch.randn(ng, g, hq, d, generator=gen).to(DEV, dtype)
    if slots is None:
        slots = torch.randperm(S, generator=gen)[:ng]
        if ng > S:
            slots = torch.cat([slots, torch.full((ng - S,), S)])
    if pos is None:
        pos = torch.randint(0, T - g + 1, (ng,), generator=gen)
    return q, kc, vc, torch.as_tensor(slots).to(DEV), torch.as_tensor(pos).to(DEV)


ATTN_CASES = [
    # ng, g, hq, hkv, d, S, T, ctx
    (1, 1, 16, 2, 256, 2, 300, 300),
    (1, 4, 16, 2, 256, 3, 2048, 2048),
    (3, 8, 16, 2, 256, 4, 1000, 777),     # rows = 64, ctx < T
    (2, 2, 16, 2, 256, 2, 5000, 4999),    # split-K
    (4, 3, 8, 2, 128, 5, 700, 700),       # rows = 12
    (2, 5, 8, 1, 128, 3, 1500, 1200),     # rows = 40 (MT = 4), MQA
    (2, 6, 32, 2, 64, 3, 640, 640),       # rows = 96 > 64: two row blocks
    (2, 3, 4, 4, 64, 2, 90, 64),          # rep = 1
    (2, 2, 6, 2, 80, 2, 200, 200),        # head dim 80: CUDA-core path
    (1, 7, 12, 3, 32, 2, 129, 129),
]


@pytest.mark.parametrize("case", ATTN_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_attention_parity(case, dtype):
    ng, g, hq, hkv, d, S, T, ctx = case
    q, kc, vc, gs, gp = attn_case(ng, g, hq, hkv, d, S, T, dtype)
    gp = gp.clamp(max=ctx - 1)
    scale = d ** -0.5
    ref = R.grouped_window_attention(q.float(), kc.float(), vc.float(), gs, gp, ctx, scale)
    for nsplit in (None, 1, 3):
        out = C.gpu_grouped_window_attention(q, kc, vc, gs, gp, ctx, scale, nsplit=nsplit)
        torch.cuda.synchronize()
        assert out.dtype == dtype and out.shape == q.shape
        err = rel_err(out, ref)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert err <= tol, (case, dtype, nsplit, err)


@pytest.mark.parametrize("ctx", [1, 2, 63, 64, 65, 257, 4096, 16384])
def test_attention_contexts_and_padding(ctx):
    # padding groups on the scratch slot, rows past ctx, a group at position 0
    ng, g, hq, hkv, d, S = 4, 4, 16, 2, 256, 3
    T = max(ctx, 8)
    q, kc, vc, _, _ = attn_case(ng, g, hq, hkv, d, S, T, torch.bfloat16, seed=ctx)
    gs = torch.tensor([1, 0, S, S], device=DEV)
    gp = torch.tensor([max(ctx - 2, 0), 0, 0, max(ctx - g, 0)], device=DEV)
    ref = R.grouped_window_attention(q.float(), kc.float(), vc.float(), gs, gp, ctx, 0.0625)
    for use_mma in (True, False):
        out = C.gpu_grouped_window_attention(q, kc, vc, gs, gp, ctx, 0.0625, use_mma=use_mma)
        torch.cuda.synchronize()
        assert rel_err(out, ref) <= 2e-2, (ctx, use_mma)


def test_attention_strided_cache_view():
    # caches as views of a (L, S+1, T, Hkv, D) stack, the layout a model would keep
    L, S, T, hkv, d = 3, 3, 512, 2, 128
    kst = torch.randn(L, S + 1, T, hkv, d, device=DEV, dtype=torch.bfloat16)
    vst = torch.randn(L, S + 1, T, hkv, d, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 8, d, device=DEV, dtype=torch.bfloat16)
    gs = torch.tensor([2, 0], device=DEV)
    gp = torch.tensor([300, 508], device=DEV)
    ref = R.grouped_window_attention(q, kst[1], vst[1], gs, gp, 512, 0.1)
    out = C.gpu_grouped_window_attention(q, kst[1], vst[1], gs, gp, 512, 0.1)
    assert rel_err(out, ref) <= 2e-2
    # a non-contiguous view in T (every other position) takes the CUDA-core path
    kv2, vv2 = kst[0][:, ::2], vst[0][:, ::2]
    ref = R.grouped_window_attention(q, kv2, vv2, gs, gp.clamp(max=250), 256, 0.1)
    out = C.gpu_grouped_window_attention(q, kv2, vv2, gs, gp.clamp(max=250), 256, 0.1)
    assert rel_err(out, ref) <= 2e-2


def test_write_kv_parity():
    S, T, hkv, d, ng, g = 3, 64, 2, 128, 4, 4
    for dtype in (torch.bfloat16, torch.float32):
        kc = torch.randn(S + 1, T, hkv, d, device=DEV, dtype=dtype)
        vc = torch.randn(S + 1, T, hkv, d, device=DEV, dtype=dtype)
        k = torch.randn(ng, g, hkv, d, device=DEV)
        v = torch.randn(ng, g, hkv, d, device=DEV)
        gs = torch.tensor([0, 2, 1, S], device=DEV)
        gp = torch.tensor([0, 10, T - 2, 5], device=DEV)  # rows past T clamp onto T-1
        kr, vr = kc.clone(), vc.clone()
        R.write_kv(kr, vr, k, v, gs, gp)
        C.gpu_write_kv(kc, vc, k, v, gs, gp)
        torch.cuda.synchronize()
        # slot 1 position T-1 is written by three clamped rows (which one wins is unordered on
        # the GPU, for the reference's index_put too): compare everything else
        for t in (kc, kr, vc, vr):
            t[1, T - 1] = 0
        assert torch.equal(kc[:S], kr[:S]) and torch.equal(vc[:S], vr[:S])


def gdn_case(ng, g, h, dk, dv, S, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = F.normalize(torch.randn(ng, g, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(ng, g, h, dk, generator=gen), dim=-1)
    v = torch.randn(ng, g, h, dv, generator=gen)
    gg = -torch.rand(ng, g, h, generator=gen) * 2
    beta = torch.rand(ng, g, h, generator=gen)
    st = torch.randn(S + 1, h, dk, dv, generator=gen) * 0.1
    slots = torch.randperm(S, generator=gen)[:ng]
    if ng > S:
        slots = torch.cat([slots, torch.full((ng - S,), S)])
    return ([t.to(DEV, dtype) for t in (q, k, v, gg, beta)], st.to(DEV), slots.to(DEV))


@pytest.mark.parametrize("shape", [(1, 1, 4, 128, 128), (3, 4, 8, 128, 128), (2, 8, 3, 64, 96),
                                   (5, 3, 2, 100, 33), (2, 2, 2, 256, 64), (1, 5, 1, 7, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_delta_parity(shape, dtype):
    ng, g, h, dk, dv = shape
    (q, k, v, gg, beta), st, gs = gdn_case(ng, g, h, dk, dv, 4, dtype)
    ro, rs = R.gated_delta_window(q, k, v, gg, beta, st, gs)
    co, cs = C.gpu_gated_delta_window(q, k, v, gg, beta, st, gs)
    torch.cuda.synchronize()
    assert rel_err(co, ro) <= 1e-5 and rel_err(cs, rs) <= 1e-5


def gdn_prep_case(ng, g, nk, nv, dk, dv, S, dtype, extra=5, seed=0):
    """A conv output x (NG, G, C) with `extra` channels past v, and b/a columns as a view into
    a wider projection output (its rows strided, as the model's split leaves them)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(ng, g, 2 * nk * dk + nv * dv + extra, generator=gen)
    proj = torch.randn(ng, g, 7 + 2 * nv + 3, generator=gen) * 3
    neg_a = -torch.rand(nv, generator=gen) * 4
    dt_bias = torch.randn(nv, generator=gen)
    st = torch.randn(S + 1, nv, dk, dv, generator=gen) * 0.1
    slots = torch.randperm(S, generator=gen)[:ng]
    return (x.to(DEV, dtype), proj.to(DEV, dtype)[..., 7:7 + 2 * nv], neg_a.to(DEV),
            dt_bias.to(DEV), st.to(DEV), slots.to(DEV))


@pytest.mark.parametrize("shape", [(1, 1, 16, 32, 128, 128), (1, 2, 16, 32, 128, 128),
                                   (8, 2, 16, 32, 128, 128), (3, 4, 2, 4, 64, 64),
                                   (2, 3, 3, 3, 100, 33), (1, 5, 1, 2, 256, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_delta_prep_parity(shape, dtype):
    ng, g, nk, nv, dk, dv = shape
    x, ba, neg_a, dt_bias, st, gs = gdn_prep_case(ng, g, nk, nv, dk, dv, max(ng, 2), dtype)
    args = (x, ba, neg_a, dt_bias, st, gs, nk, dk, dk ** -0.5, 1e-6)
    ro, rs = R.gated_delta_window_prep(*args)
    co, cs = C.gpu_gated_delta_window_prep(*args)
    torch.cuda.synchronize()
    assert rel_err(co, ro) <= 2e-5 and rel_err(cs, rs) <= 2e-5
    # a group's rows give the same bits whatever other groups share the launch
    o1, s1 = C.gpu_gated_delta_window_prep(x[:1], ba[:1], neg_a, dt_bias, st, gs[:1], nk, dk,
                                           dk ** -0.5, 1e-6)
    assert torch.equal(o1, co[:1]) and torch.equal(s1, cs[:1])


@pytest.mark.parametrize("shape", [(1, 1, 16, 128, 256, 4), (1, 2, 16, 128, 256, 4),
                                   (8, 2, 16, 128, 256, 4), (3, 4, 2, 64, 128, 4),
                                   (2, 3, 3, 20, 33, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_conv_qkvz_parity(shape, dtype):
    """The conv gathering q, k, v from the in_proj's interleaved columns (a row-strided view of
    a wider projection output) gives the bits of the conv on the concatenated channels."""
    ng, g, nk, dk, vpk, kw = shape
    gen = torch.Generator(device="cpu").manual_seed(1)
    w_qkvz = nk * (2 * dk + 2 * vpk)
    proj = torch.randn(ng, g, w_qkvz + 9, generator=gen).to(DEV, dtype)
    x = proj[..., :w_qkvz]
    c = 2 * nk * dk + nk * vpk
    cs = torch.randn(5, c, kw - 1, generator=gen).to(DEV, dtype)
    w = torch.randn(c, kw, generator=gen).to(DEV, dtype)
    gs = (torch.arange(ng, device=DEV) * 3 + 1) % 5  # conv_state's 5 slots, not in order
    want_o, want_s = C.gpu_causal_conv_window(R.qkvz_mixed(x, nk, dk, vpk).contiguous(), cs, w, gs)
    got_o, got_s = C.gpu_causal_conv_window_qkvz(x, cs, w, gs, nk, dk, vpk)
    torch.cuda.synchronize()
    assert torch.equal(got_o, want_o) and torch.equal(got_s, want_s)


def test_causal_conv_qkvz_bad_arguments():
    x = torch.randn(2, 2, 2 * (2 * 8 + 2 * 16), device=DEV, dtype=torch.bfloat16)
    cs = torch.randn(3, 2 * 2 * 8 + 2 * 16, 3, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2 * 2 * 8 + 2 * 16, 4, device=DEV, dtype=torch.bfloat16)
    gs = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="fewer than the 3 key heads"):
        C.gpu_causal_conv_window_qkvz(x, cs, w, gs, 3, 8, 16)
    with pytest.raises(ValueError, match="weight must have shape"):
        C.gpu_causal_conv_window_qkvz(x, cs, w[:-1], gs, 2, 8, 16)


def conv_ba_case(ng, g, nk, dk, vpk, kw, hidden, nba, dtype, seed=1):
    """causal_conv_window_qkvz's inputs (x a row-strided view of a wider projection output)
    and the b/a projection's: x_normed (NG, G, H), w_ba (nba, H)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    w_qkvz = nk * (2 * dk + 2 * vpk)
    c = 2 * nk * dk + nk * vpk
    proj = torch.randn(ng, g, w_qkvz + 9, generator=gen).to(DEV, dtype)
    cs = torch.randn(5, c, kw - 1, generator=gen).to(DEV, dtype)
    w = torch.randn(c, kw, generator=gen).to(DEV, dtype)
    gs = (torch.arange(ng, device=DEV) * 3 + 1) % 5
    xn = torch.randn(ng, g, hidden, generator=gen).to(DEV, dtype)
    w_ba = (torch.randn(nba, hidden, generator=gen) * hidden ** -0.5).to(DEV, dtype)
    return proj[..., :w_qkvz], cs, w, gs, xn, w_ba


CONV_BA_CASES = [
    # ng, g, nk, dk, vpk, kw, H, 2 nv
    (1, 1, 16, 128, 256, 4, 2048, 64),   # the 80B layer at one row
    (1, 2, 16, 128, 256, 4, 2048, 64),
    (8, 2, 16, 128, 256, 4, 2048, 64),
    (2, 3, 2, 16, 32, 4, 4096, 64),
    (3, 4, 2, 64, 128, 4, 64, 8),        # tiny shapes
    (2, 3, 3, 20, 33, 3, 100, 6),        # H not a multiple of 8: scalar loads, a short chunk
]


def _ba_close(got, xn, w_ba):
    """Within about one ulp of the exact product rounded once to the dtype."""
    want = (xn.double() @ w_ba.double().T).to(xn.dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if xn.dtype == torch.float32 else dict(rtol=2 ** -7,
                                                                             atol=1e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("case", CONV_BA_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_conv_qkvz_ba_parity(case, dtype):
    """The conv's outputs and snapshots are causal_conv_window_qkvz's bits; ba is the float32
    product rounded once (within an ulp: another summation order than the reference's)."""
    ng, g, nk, dk, vpk, kw, hidden, nba = case
    x, cs, w, gs, xn, w_ba = conv_ba_case(*case, dtype)
    want_o, want_s = C.gpu_causal_conv_window_qkvz(x, cs, w, gs, nk, dk, vpk)
    got_o, got_s, ba = C.gpu_causal_conv_window_qkvz_ba(x, cs, w, gs, nk, dk, vpk, xn, w_ba)
    torch.cuda.synchronize()
    assert torch.equal(got_o, want_o) and torch.equal(got_s, want_s)
    assert ba.shape == (ng, g, nba) and ba.dtype == dtype
    _ba_close(ba, xn, w_ba)
    # misaligned rows (scalar loads) sum in the same order as the 16-byte loads
    buf = torch.empty(xn.numel() + 1, device=DEV, dtype=dtype)
    xn_off = buf[1:].view_as(xn)
    xn_off.copy_(xn)
    assert torch.equal(C.gpu_causal_conv_window_qkvz_ba(x, cs, w, gs, nk, dk, vpk, xn_off,
                                                        w_ba)[2], ba)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_conv_qkvz_ba_rows_are_batch_invariant(dtype):
    """A row's ba is the same bits in every window shape that holds it (its sum's order is
    fixed by H alone): NG=8, G=2 against NG=1, G=2 and against one-row windows."""
    nk, dk, vpk = 16, 128, 256
    x, cs, w, gs, xn, w_ba = conv_ba_case(8, 2, nk, dk, vpk, 4, 2048, 64, dtype)
    o8, s8, ba8 = C.gpu_causal_conv_window_qkvz_ba(x, cs, w, gs, nk, dk, vpk, xn, w_ba)
    for n in (0, 3, 7):
        o1, s1, ba1 = C.gpu_causal_conv_window_qkvz_ba(x[n:n + 1], cs, w, gs[n:n + 1], nk, dk,
                                                       vpk, xn[n:n + 1], w_ba)
        assert torch.equal(ba1, ba8[n:n + 1]) and torch.equal(o1, o8[n:n + 1])
        assert torch.equal(s1, s8[n:n + 1])
    rows = xn.reshape(16, 1, -1)
    ba_rows = C.gpu_causal_conv_window_qkvz_ba(x.reshape(16, 1, -1), cs, w, gs.repeat_interleave(2),
                                               nk, dk, vpk, rows, w_ba)[2]
    torch.cuda.synchronize()
    assert torch.equal(ba_rows.reshape(8, 2, -1), ba8)


def test_graph_causal_conv_qkvz_ba():
    x, cs, w, gs, xn, w_ba = conv_ba_case(2, 2, 16, 128, 256, 4, 2048, 64, torch.bfloat16)
    _graph_equal(lambda: C.gpu_causal_conv_window_qkvz_ba(x, cs, w, gs, 16, 128, 256, xn, w_ba),
                 lambda o: list(o))


def test_compile_conv_qkvz_ba_gpu():
    """Under torch.compile causal_conv_window_qkvz_ba is a custom op (no graph break)."""
    x, cs, w, gs, xn, w_ba = conv_ba_case(2, 2, 2, 16, 32, 4, 64, 8, torch.bfloat16)
    try:
        ops.set_backend(C.gpu_platform(), "cuda")
        eager = ops.causal_conv_window_qkvz_ba(x, cs, w, gs, 2, 16, 32, xn, w_ba)
        compiled = torch.compile(lambda *a: ops.causal_conv_window_qkvz_ba(*a), fullgraph=True,
                                 backend="aot_eager")
        got = compiled(x, cs, w, gs, 2, 16, 32, xn, w_ba)
        assert all(torch.equal(a, b) for a, b in zip(got, eager))
    finally:
        ops.set_backend("torch", "cpu")


def test_causal_conv_qkvz_ba_bad_arguments():
    nk, dk, vpk = 2, 8, 16
    x, cs, w, gs, xn, w_ba = conv_ba_case(2, 2, nk, dk, vpk, 4, 64, 8, torch.bfloat16)
    op = C.gpu_causal_conv_window_qkvz_ba
    with pytest.raises(TypeError, match="causal_conv_window_qkvz_ba: w_ba has dtype"):
        op(x, cs, w, gs, nk, dk, vpk, xn, w_ba.float())
    with pytest.raises(TypeError, match="causal_conv_window_qkvz_ba: x_normed has dtype"):
        op(x, cs, w, gs, nk, dk, vpk, xn.half(), w_ba)
    with pytest.raises(ValueError, match=r"w_ba must have shape \(2 nv, H=64\)"):
        op(x, cs, w, gs, nk, dk, vpk, xn, w_ba[:, :32].contiguous())
    with pytest.raises(ValueError, match="x_normed must have shape"):
        op(x, cs, w, gs, nk, dk, vpk, xn[:1], w_ba)
    with pytest.raises(ValueError, match="w_ba must have 2 dimensions"):
        op(x, cs, w, gs, nk, dk, vpk, xn, w_ba[None])
    with pytest.raises(ValueError, match="x_normed must be contiguous"):
        op(x, cs, w, gs, nk, dk, vpk, torch.cat([xn, xn], -1)[..., ::2], w_ba)
    with pytest.raises(ValueError, match="w_ba must be contiguous"):
        op(x, cs, w, gs, nk, dk, vpk, xn, torch.cat([w_ba, w_ba], 0)[::2])
    with pytest.raises(ValueError, match="causal_conv_window_qkvz_ba: weight must have shape"):
        op(x, cs, w[:-1], gs, nk, dk, vpk, xn, w_ba)
    with pytest.raises(ValueError, match="x_normed is on cpu"):
        op(x, cs, w, gs, nk, dk, vpk, xn.cpu(), w_ba)


def test_graph_gated_delta_prep():
    x, ba, neg_a, dt_bias, st, gs = gdn_prep_case(2, 2, 16, 32, 128, 128, 3, torch.bfloat16)
    _graph_equal(lambda: C.gpu_gated_delta_window_prep(x, ba, neg_a, dt_bias, st, gs, 16, 128,
                                                       128 ** -0.5, 1e-6), lambda o: list(o))


def test_gated_delta_prep_programmatic_launch_same_bits_after_any_kernel():
    """gated_delta_window_prep as a programmatic dependent launch (conv_launch_options(gdn_pdl),
    on by default) gives the plain launch's bits, also where the kernel just before it is the
    caller's conversion of group_slot (int32 -> int64) or a copy of the state: it reads nothing
    before the kernel before it is done."""
    x, ba, neg_a, dt_bias, st, gs = gdn_prep_case(8, 4, 16, 32, 128, 128, 9, torch.bfloat16)
    args = (neg_a, dt_bias)
    was = C.conv_launch_options()["gdn_pdl"]
    try:
        C.conv_launch_options(gdn_pdl=False)
        ro, rs = C.gpu_gated_delta_window_prep(x, ba, *args, st, gs, 16, 128, 128 ** -0.5, 1e-6)
        C.conv_launch_options(gdn_pdl=True)
        for _ in range(20):
            busy = torch.randn(4096, 4096, device=DEV) @ torch.randn(4096, 4096, device=DEV)
            st2 = st.clone()  # a copy kernel right before the rule's launch
            o1, s1 = C.gpu_gated_delta_window_prep(x, ba, *args, st2, gs, 16, 128,
                                                   128 ** -0.5, 1e-6)
            gs32 = gs.to(torch.int32) + 0 * busy[0, 0].to(torch.int32)
            o2, s2 = C.gpu_gated_delta_window_prep(x, ba, *args, st, gs32, 16, 128,
                                                   128 ** -0.5, 1e-6)  # converted in the call
            torch.cuda.synchronize()
            assert torch.equal(o1, ro) and torch.equal(s1, rs)
            assert torch.equal(o2, ro) and torch.equal(s2, rs)
    finally:
        C.conv_launch_options(gdn_pdl=was)


def test_gated_delta_prep_bad_arguments():
    x, ba, neg_a, dt_bias, st, gs = gdn_prep_case(2, 2, 2, 4, 64, 64, 3, torch.bfloat16)
    with pytest.raises(ValueError, match="not a multiple of 3 key heads"):
        C.gpu_gated_delta_window_prep(x, ba, neg_a, dt_bias, st, gs, 3, 64, 0.125, 1e-6)
    with pytest.raises(ValueError, match="ba has"):
        C.gpu_gated_delta_window_prep(x, ba[..., :5], neg_a, dt_bias, st, gs, 2, 64, 0.125, 1e-6)
    with pytest.raises(TypeError, match="neg_a"):
        C.gpu_gated_delta_window_prep(x, ba, neg_a.bfloat16(), dt_bias, st, gs, 2, 64, 0.125,
                                      1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_conv_parity(dtype):
    ng, g, c, kw, S = 3, 5, 300, 4, 4
    x = torch.randn(ng, g, c, device=DEV, dtype=dtype)
    cs = torch.randn(S + 1, c, kw - 1, device=DEV, dtype=torch.float32)
    w = torch.randn(c, kw, device=DEV, dtype=dtype)
    gs = torch.tensor([3, 0, S], device=DEV)
    ro, rsn = R.causal_conv_window(x, cs, w, gs)
    co, csn = C.gpu_causal_conv_window(x, cs, w, gs)
    torch.cuda.synchronize()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(co, ro) <= tol
    assert torch.equal(csn, rsn)


def commit_case(L, ng, g, h, dk, dv, c, km1, S, conv_dtype):
    """Random factors [k | delta | decay] (decay in (0, 1)) of a window's rows to commit."""
    rec_factors = torch.randn(L, ng, g, h, dk + dv + 1, device=DEV)
    rec_factors[..., -1] = torch.rand(L, ng, g, h, device=DEV)
    conv_snaps = torch.randn(L, ng, g, c, km1, device=DEV, dtype=conv_dtype)
    rec_state = torch.randn(L, S + 1, h, dk, dv, device=DEV)
    conv_state = torch.randn(L, S + 1, c, km1, device=DEV, dtype=torch.bfloat16)
    slot_pos = torch.zeros(S + 1, dtype=torch.int64, device=DEV)
    gs = torch.randperm(S, device=DEV)[:ng]
    gp = torch.randint(0, 100, (ng,), device=DEV)
    acc = torch.randint(0, g, (ng,), device=DEV)
    return acc, gs, gp, rec_factors, conv_snaps, rec_state, conv_state, slot_pos


def test_commit_parity():
    """The kernel's replay against the reference's: the conv state and positions are the same
    bits; the recurrent state agrees to rounding (the kernel adds k delta in one FMA, as the
    window kernel does, where torch rounds the product first)."""
    args = commit_case(3, 4, 5, 2, 32, 48, 70, 3, 6, torch.bfloat16)
    ref = [a.clone() for a in args]
    R.commit_accepted(*ref)
    C.gpu_commit_accepted(*args)
    torch.cuda.synchronize()
    assert rel_err(args[5], ref[5]) <= 1e-6
    for a, b in zip(args[6:], ref[6:]):
        assert torch.equal(a, b)


# ---- the window's factors and their commit, against its snapshots (bit for bit) --------------
# A decode window writes each row's rank-one update [k | delta | decay] and the commit replays
# rows 0..accept onto the slot's state: the state the window's kernel held after row accept,
# the very bits its snapshot of that row holds. The GPU kernels and the torch reference on the
# GPU (the CPU backends: test_kernels.py).

GPU_FACTOR_SHAPES = [  # ng, g, h, dk, dv: KPT 1..32, partial Dv tiles, 1 to 32 rows
    (1, 1, 1, 7, 5), (3, 2, 4, 16, 32), (4, 3, 2, 33, 40), (2, 8, 3, 64, 96),
    (8, 2, 32, 128, 128), (2, 5, 2, 100, 33), (3, 4, 2, 256, 64), (2, 17, 2, 128, 128),
    (1, 32, 4, 128, 128)]


def _gpu_commit_both(commit, accept, gs, st, factors, snaps, S):
    """(state committed from the factors, state the snapshots give) for one layer's window, the
    layer at index 1 of a 3-layer state stack (a strided view, as the engine's)."""
    ng, g, h = factors.shape[:3]
    dk, dv = st.shape[-2:]
    big = torch.randn(3, S + 1, h, dk, dv, device=DEV)
    big[1] = st
    rec = big[1:2]
    conv = torch.zeros(1, S + 1, 3, 2, device=DEV)
    pos = torch.zeros(S + 1, dtype=torch.int64, device=DEV)
    before = big.clone()
    commit(accept, gs, torch.zeros(ng, dtype=torch.int64, device=DEV), factors[None],
           torch.zeros(1, ng, g, 3, 2, device=DEV), rec, conv, pos)
    torch.cuda.synchronize()
    assert torch.equal(big[0], before[0]) and torch.equal(big[2], before[2])
    want = st.clone()
    for n in range(ng):
        want[gs[n]] = snaps[n, accept[n]]
    return rec[0], want


def _gpu_accepts(ng, g, gen):
    return [torch.zeros(ng, dtype=torch.int64), torch.full((ng,), g - 1),
            torch.arange(ng) % g, torch.randint(0, g, (ng,), generator=gen)]


@pytest.mark.parametrize("shape", GPU_FACTOR_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_commit_from_factors_is_the_snapshot_bit_for_bit_gpu(shape, dtype, impl):
    ng, g, h, dk, dv = shape
    S = max(ng, 3)
    (q, k, v, gg, beta), st, gs = gdn_case(ng, g, h, dk, dv, S, dtype, seed=ng + g + dk)
    if impl == "kernel":
        window, commit = C.gpu_gated_delta_window, C.gpu_commit_accepted
    else:
        window, commit = R.gated_delta_window, R.commit_accepted
    out_s, snaps = window(q, k, v, gg, beta, st, gs)
    factors = torch.full((ng, g, h, dk + dv + 1), float("nan"), device=DEV)
    out_f, _ = window(q, k, v, gg, beta, st, gs, factors=factors)
    torch.cuda.synchronize()
    assert not factors.isnan().any()
    assert torch.equal(out_f, out_s)
    gen = torch.Generator().manual_seed(g)
    for accept in _gpu_accepts(ng, g, gen):
        got, want = _gpu_commit_both(commit, accept.to(DEV), gs, st, factors, snaps, S)
        assert torch.equal(got[gs], want[gs]), (shape, dtype, impl, accept.tolist())


def test_commit_from_factors_padding_groups_gpu():
    """Padding groups share the scratch slot: the kernel replays only the last one's rows there
    (onto the state they all read: its snapshot, bit for bit), real slots as their snapshots,
    and slot_pos advanced by the last one."""
    ng, g, h, dk, dv, S = 5, 3, 4, 128, 128, 4
    (q, k, v, gg, beta), st, _ = gdn_case(ng, g, h, dk, dv, S, torch.bfloat16, seed=3)
    gs = torch.tensor([2, S, 0, S, S], device=DEV)
    _, snaps = C.gpu_gated_delta_window(q, k, v, gg, beta, st, gs)
    factors = torch.empty(ng, g, h, dk + dv + 1, device=DEV)
    C.gpu_gated_delta_window(q, k, v, gg, beta, st, gs, factors=factors)
    accept = torch.tensor([1, 2, 0, 1, 2], device=DEV)
    rec = st[None].clone()
    pos = torch.zeros(S + 1, dtype=torch.int64, device=DEV)
    gp = torch.tensor([10, 0, 20, 0, 7], device=DEV)
    C.gpu_commit_accepted(accept, gs, gp, factors[None], torch.zeros(1, ng, g, 3, 2, device=DEV),
                          rec, torch.zeros(1, S + 1, 3, 2, device=DEV), pos)
    torch.cuda.synchronize()
    assert torch.equal(rec[0, 2], snaps[0, 1]) and torch.equal(rec[0, 0], snaps[2, 0])
    assert torch.equal(rec[0, S], snaps[4, 2])
    assert torch.equal(rec[0, [1, 3]], st[[1, 3]])
    assert pos.tolist() == [21, 0, 12, 0, 10]


@pytest.mark.parametrize("shape", [(1, 1, 16, 32, 128, 128), (8, 2, 16, 32, 128, 128),
                                   (3, 4, 2, 4, 64, 64), (2, 3, 3, 3, 100, 33),
                                   (1, 5, 1, 2, 256, 64), (2, 32, 2, 4, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_commit_from_prepared_factors_is_the_snapshot_bit_for_bit_gpu(shape, dtype):
    """The prepared kernel (norms and gates inside; its factors' k raw, the norm folded into
    delta): the factors' commit is its snapshot, bit for bit."""
    ng, g, nk, nv, dk, dv = shape
    S = max(ng, 2)
    x, ba, neg_a, dt_bias, st, gs = gdn_prep_case(ng, g, nk, nv, dk, dv, S, dtype)
    args = (x, ba, neg_a, dt_bias, st, gs, nk, dk, dk ** -0.5, 1e-6)
    out_s, snaps = C.gpu_gated_delta_window_prep(*args)
    factors = torch.full((ng, g, nv, dk + dv + 1), float("nan"), device=DEV)
    out_f, _ = C.gpu_gated_delta_window_prep(*args, factors=factors)
    torch.cuda.synchronize()
    assert not factors.isnan().any()
    assert torch.equal(out_f, out_s)
    gen = torch.Generator().manual_seed(g)
    for accept in _gpu_accepts(ng, g, gen):
        got, want = _gpu_commit_both(C.gpu_commit_accepted, accept.to(DEV), gs, st, factors,
                                     snaps, S)
        assert torch.equal(got[gs], want[gs]), (shape, dtype, accept.tolist())


def test_graph_gated_delta_factors_and_commit():
    """The factor window and the commit captured in one CUDA graph, replayed: the eager bits
    (the commit replays onto the state, so each run starts from a saved copy of it)."""
    ng, g, h, dk, dv, S = 3, 2, 8, 128, 128, 3
    (q, k, v, gg, beta), st, gs = gdn_case(ng, g, h, dk, dv, S, torch.bfloat16)
    rec = st[None].clone()
    rec0 = rec.clone()
    conv = torch.zeros(1, S + 1, 3, 2, device=DEV)
    pos = torch.zeros(S + 1, dtype=torch.int64, device=DEV)
    factors = torch.empty(1, ng, g, h, dk + dv + 1, device=DEV)
    accept = torch.tensor([1, 0, 1], device=DEV)

    def step():
        rec.copy_(rec0)
        out, _ = C.gpu_gated_delta_window(q, k, v, gg, beta, rec[0], gs, factors=factors[0])
        C.gpu_commit_accepted(accept, gs, torch.zeros(ng, dtype=torch.int64, device=DEV),
                              factors, torch.zeros(1, ng, g, 3, 2, device=DEV), rec, conv, pos)
        return out, rec, factors

    _graph_equal(step, lambda o: list(o))


def test_mma_and_simt_agree_bf16():
    q, kc, vc, gs, gp = attn_case(3, 4, 16, 2, 256, 4, 3000, torch.bfloat16, seed=7)
    a = C.gpu_grouped_window_attention(q, kc, vc, gs, gp, 3000, 0.0625, use_mma=True)
    b = C.gpu_grouped_window_attention(q, kc, vc, gs, gp, 3000, 0.0625, use_mma=False)
    assert rel_err(a, b) <= 2e-2


# ---------------------------------------------------------------------------------------------
# CUDA graph capture: capture each op, replay, compare with an eager call


def _graph_equal(fn, outputs_of):
    """fn() -> outputs; captured and replayed must equal eager."""
    eager = [t.clone() for t in outputs_of(fn())]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up on a side stream, as torch recommends before capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outputs_of(captured), eager):
        assert torch.equal(a, b)


def test_graph_attention():
    q, kc, vc, gs, gp = attn_case(2, 4, 16, 2, 256, 3, 8192, torch.bfloat16, seed=3)
    _graph_equal(lambda: C.gpu_grouped_window_attention(q, kc, vc, gs, gp, 8192, 0.0625),
                 lambda o: [o])
    q32, kc32, vc32, gs, gp = attn_case(2, 2, 4, 2, 64, 3, 600, torch.float32, seed=4)
    _graph_equal(lambda: C.gpu_grouped_window_attention(q32, kc32, vc32, gs, gp, 600, 0.125),
                 lambda o: [o])


def test_graph_gated_delta_and_conv():
    (q, k, v, gg, beta), st, gs = gdn_case(2, 4, 8, 128, 128, 3, torch.bfloat16)
    _graph_equal(lambda: C.gpu_gated_delta_window(q, k, v, gg, beta, st, gs), lambda o: list(o))
    x = torch.randn(2, 4, 256, device=DEV, dtype=torch.bfloat16)
    cs = torch.randn(4, 256, 3, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(256, 4, device=DEV, dtype=torch.bfloat16)
    _graph_equal(lambda: C.gpu_causal_conv_window(x, cs, w, gs), lambda o: list(o))


def test_graph_write_kv_and_commit():
    kc = torch.zeros(4, 64, 2, 128, device=DEV, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    k = torch.randn(2, 3, 2, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    gs = torch.tensor([0, 2], device=DEV)
    gp = torch.tensor([5, 60], device=DEV)

    def wkv():
        C.gpu_write_kv(kc, vc, k, v, gs, gp)
        return kc, vc

    _graph_equal(wkv, lambda o: list(o))
    args = commit_case(2, 3, 4, 2, 16, 16, 40, 3, 5, torch.bfloat16)
    saved = [t.clone() for t in args[5:]]

    def commit():  # (from the same state every run: the commit replays onto it)
        for t, t0 in zip(args[5:], saved):
            t.copy_(t0)
        C.gpu_commit_accepted(*args)
        return args[5], args[6], args[7]

    _graph_equal(commit, lambda o: list(o))


@pytest.mark.parametrize("b,length,h,dk,dv,pad", [
    (1, 64, 4, 64, 64, 0), (1, 64, 32, 128, 128, 10), (2, 256, 16, 128, 128, 0), (1, 5, 3, 33, 40, 2)])
def test_chunk_rule_by_the_recurrence_gpu(b, length, h, dk, dv, pad):
    """The prompt chunk's gated delta rule by the decode kernel's recurrence (final state only)
    against the chunked reference, at the tiny model's and Qwen3-Next-80B's head shapes, and
    against the CPU twin's recurrence (both float32 in row order) to float32 rounding."""
    from test_kernels import _chunk_case  # (the CPU twin's cases)

    q, k, v, gg, beta, st = _chunk_case(length + dk, b, length, h, dk, dv, torch.bfloat16, pad)
    args = [t.cuda() for t in (q, k, v, gg, beta, st)]
    ro, rs = R.chunk_gated_delta(*args)
    go, gs = C.gpu_chunk_gated_delta(*args)
    real = length - pad
    torch.testing.assert_close(go[:, :real], ro[:, :real], rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(gs, rs, rtol=1e-4, atol=5e-5)
    if C.cpu_available():  # a device run may carry the CUDA extension alone
        torch.testing.assert_close(gs.cpu(), C.cpu_chunk_gated_delta(q, k, v, gg, beta, st)[1],
                                   rtol=1e-5, atol=1e-5)


def test_set_backend_cuda_dispatch():
    platform = C.gpu_platform()
    try:
        ops.set_backend(platform, "cuda")
        assert ops.backend() == platform
        assert ops.grouped_window_attention is C.gpu_grouped_window_attention
        assert ops.chunk_gated_delta is C.gpu_chunk_gated_delta
        with pytest.raises(ValueError, match="backend="):
            ops.set_backend(platform, "cpu")
    finally:
        ops.set_backend("torch", "cpu")


def test_bad_arguments_gpu():
    q, kc, vc, gs, gp = attn_case(1, 2, 4, 2, 64, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache is on cpu"):
        C._gpu.grouped_window_attention(q, kc.cpu(), vc, gs, gp, 64, 0.1, q.clone(), None, 1, 64,
                                        0)
    with pytest.raises(ValueError, match="workspace"):
        C._gpu.grouped_window_attention(q, kc, vc, gs, gp, 64, 0.1, q.clone(), None, 2, 32, 0)
    with pytest.raises(ValueError, match="group_slot must have shape"):
        C.gpu_grouped_window_attention(q, kc, vc, torch.tensor([0, 1, 2], device=DEV), gp, 64,
                                       0.1)


def test_attention_long_context_large_groups():
    # 32K context, 8 groups of 8 rows, Qwen3-Next geometry: rows = 64 per (group, kv head)
    q, kc, vc, gs, gp = attn_case(8, 8, 16, 2, 256, 8, 32768, torch.bfloat16, seed=11)
    gp = torch.full_like(gp, 32768 - 8)
    ctx = 32768
    out = C.gpu_grouped_window_attention(q, kc, vc, gs, gp, ctx, 1 / math.sqrt(256))
    # reference on two groups only (memory)
    ref = R.grouped_window_attention(q[:2].float(), kc.float()[:, :, :, :], vc.float(), gs[:2],
                                     gp[:2], ctx, 1 / math.sqrt(256))
    assert rel_err(out[:2], ref) <= 2e-2


def test_compile_fullgraph_gpu():
    # under torch.compile the cyext ops are torch.library custom ops (no graph break)
    q, kc, vc, gs, gp = attn_case(2, 4, 16, 2, 256, 3, 2048, torch.bfloat16, seed=5)
    (gq, gk, gv, gg, gb), st, gs2 = gdn_case(2, 4, 8, 128, 128, 3, torch.bfloat16)
    platform = C.gpu_platform()

    def step(q, gq):
        a = ops.grouped_window_attention(q, kc, vc, gs, gp, 2048, 0.0625)
        o, snaps = ops.gated_delta_window(gq, gk, gv, gg, gb, st, gs2)
        return a.float().sum() + o.sum() + snaps.sum()

    try:
        ops.set_backend(platform, "cuda")
        eager = step(q, gq)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(q, gq), eager, rtol=1e-3, atol=1e-2)
    finally:
        ops.set_backend("torch", "cpu")


def test_compile_factors_and_commit_gpu():
    """The factor window (a layer's slice of a stack, as window_layers passes it) and the commit
    under torch.compile: custom ops, no graph break, the eager bits."""
    ng, g, h, dk, dv, S = 2, 2, 8, 128, 128, 3
    (q, k, v, gg, beta), st, gs = gdn_case(ng, g, h, dk, dv, S, torch.bfloat16)
    accept = torch.tensor([1, 0], device=DEV)
    platform = C.gpu_platform()

    def step(rec, stack):
        o, _ = ops.gated_delta_window(q, k, v, gg, beta, rec[0], gs, factors=stack[1])
        ops.commit_accepted(accept, gs, torch.zeros(ng, dtype=torch.int64, device=DEV),
                            stack[1:2], torch.zeros(1, ng, g, 3, 2, device=DEV), rec,
                            torch.zeros(1, S + 1, 3, 2, device=DEV),
                            torch.zeros(S + 1, dtype=torch.int64, device=DEV))
        return o * 2

    def run(fn):
        rec = st[None].clone()
        stack = torch.zeros(3, ng, g, h, dk + dv + 1, device=DEV)
        return fn(rec, stack), rec, stack

    try:
        ops.set_backend(platform, "cuda")
        want = run(step)
        got = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    finally:
        ops.set_backend("torch", "cpu")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_mma", [True, False])
@pytest.mark.parametrize("hq,hkv,d,pos,shapes", [
    # tiny model's heads; a row past the first chunk, at tiers 512..1024
    (4, 2, 64, 300, ((1, 1, 512), (1, 4, 512), (2, 4, 1024), (4, 2, 512), (8, 1, 1024),
                     (2, 2, 768))),
    # Qwen3-Next's full attention (16 q heads over 2 KV heads, head dim 256): rows = 8 x g
    # cross 16 and 32, where the tensor-core path otherwise changes its m-tiles
    (16, 2, 256, 300, ((1, 1, 512), (1, 2, 512), (1, 4, 1024), (1, 8, 512), (4, 2, 512),
                       (2, 4, 1024))),
    # a row inside the first chunk: one direct pass at tier 256 against split passes above
    (16, 2, 256, 100, ((1, 1, 256), (1, 4, 256), (2, 2, 512), (1, 8, 1024))),
])
def test_fixed_splits_make_a_row_independent_of_its_window(use_mma, hq, hkv, d, pos, shapes):
    """split_keys (engine.batch_invariant): a row's attention output is bit-identical whatever
    the context tier and however many groups and rows share its window."""
    T = 1100
    gen = torch.Generator(device="cpu").manual_seed(3)
    kc = torch.randn(9, T, hkv, d, generator=gen).to(DEV, torch.bfloat16)
    vc = torch.randn(9, T, hkv, d, generator=gen).to(DEV, torch.bfloat16)
    q_rows = torch.randn(8, hq, d, generator=gen).to(DEV, torch.bfloat16)

    def row_out(ng, g, ctx):
        # Group 0 is slot 0 at `pos` with g rows; the other groups are other slots.
        q = torch.randn(ng, g, hq, d, generator=gen).to(DEV, torch.bfloat16)
        q[0] = q_rows[:g]
        gs = torch.arange(ng, device=DEV)
        gp = torch.tensor([pos] + [17 * i for i in range(1, ng)], device=DEV)
        out = C.gpu_grouped_window_attention(q, kc, vc, gs, gp, ctx, 0.0625, use_mma=use_mma,
                                             split_keys=256)
        return out[0, 0]  # the row at `pos`

    want = row_out(*shapes[0])
    for ng, g, ctx in shapes[1:]:
        assert torch.equal(row_out(ng, g, ctx), want), (ng, g, ctx)


@pytest.mark.parametrize("dtype,state_dtype", [(torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float32)])
def test_causal_conv_rows_kernel_matches_the_serial_one_bit_for_bit(dtype, state_dtype):
    """conv_kernel (one thread per (channel, row)) sums each output in the order of the earlier
    serial kernel (STRATA_CONV_SERIAL): the same bits at 1-16 rows and several widths."""
    torch.manual_seed(0)
    S = 5
    try:
        for ng, g, c, kw in ((1, 1, 8192, 4), (1, 2, 8192, 4), (2, 4, 1000, 4), (4, 4, 8192, 4),
                             (8, 2, 300, 4), (16, 1, 8192, 4), (3, 5, 300, 2), (2, 6, 200, 7)):
            x = torch.randn(ng, g, c, device=DEV, dtype=dtype)
            cs = torch.randn(S + 1, c, kw - 1, device=DEV, dtype=state_dtype)
            w = torch.randn(c, kw, device=DEV, dtype=dtype)
            gs = torch.randint(0, S + 1, (ng,), device=DEV)
            C.conv_launch_options(serial=True)
            so, ssn = C.gpu_causal_conv_window(x, cs, w, gs)
            C.conv_launch_options(serial=False)
            ro, rsn = C.gpu_causal_conv_window(x, cs, w, gs)
            torch.cuda.synchronize()
            assert torch.equal(ro, so) and torch.equal(rsn, ssn), (ng, g, c, kw)
    finally:
        C.conv_launch_options(serial=False)
