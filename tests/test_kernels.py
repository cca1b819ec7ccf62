"""CPU kernels of the cyext extension (strata.kernels.strata_cpu) against strata.kernels.reference,
argument checks, the ops dispatch, and that the CUDA extension is built when nvcc is present."""

from __future__ import annotations

import importlib
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import cyext_ops as C
from strata.kernels import ops
from strata.kernels import reference as R

pytestmark = pytest.mark.skipif(not C.cpu_available(),
                                reason=f"strata_cpu not built: {C.CPU_IMPORT_ERROR}")

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=5e-3, atol=5e-3)}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _slots(gen, ng, S):
    """Distinct real slots, then padding groups on the scratch slot S."""
    n_real = int(torch.randint(1, min(ng, S) + 1, (1,), generator=gen))
    real = torch.randperm(S, generator=gen)[:n_real]
    return torch.cat([real, torch.full((ng - n_real,), S, dtype=torch.int64)])


# ---------------------------------------------------------------------------------------------
# attention


def _attn_random_case(seed, dtype):
    gen = _gen(seed)
    hkv = int(torch.randint(1, 4, (1,), generator=gen))
    rep = [1, 2, 3, 4, 8][int(torch.randint(0, 5, (1,), generator=gen))]
    d = [8, 16, 24, 32, 64][int(torch.randint(0, 5, (1,), generator=gen))]
    g = int(torch.randint(1, 9, (1,), generator=gen))
    ng = int(torch.randint(1, 6, (1,), generator=gen))
    S = int(torch.randint(1, 5, (1,), generator=gen))
    T = int(torch.randint(g, 300, (1,), generator=gen))
    ctx = int(torch.randint(1, T + 1, (1,), generator=gen))
    kc = torch.randn(S + 1, T, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(S + 1, T, hkv, d, generator=gen).to(dtype)
    q = torch.randn(ng, g, hkv * rep, d, generator=gen).to(dtype)
    gs = _slots(gen, ng, S)
    gp = torch.randint(0, T - g + 1, (ng,), generator=gen)
    return q, kc, vc, gs, gp, ctx, d ** -0.5


@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_random(seed, dtype):
    q, kc, vc, gs, gp, ctx, scale = _attn_random_case(seed, dtype)
    ref = R.grouped_window_attention(q, kc, vc, gs, gp, ctx, scale)
    out = C.cpu_grouped_window_attention(q, kc, vc, gs, gp, ctx, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("g", range(1, 9))
def test_attention_window_rows(g):
    # Qwen3-Next-like geometry, every window size, rows near / past ctx, padding on scratch
    gen = _gen(100 + g)
    S, T, hkv, hq, d, ctx = 3, 200, 2, 16, 64, 180
    kc = torch.randn(S + 1, T, hkv, d, generator=gen)
    vc = torch.randn(S + 1, T, hkv, d, generator=gen)
    q = torch.randn(4, g, hq, d, generator=gen)
    gs = torch.tensor([2, 0, S, S])
    gp = torch.tensor([ctx - 1, 0, 0, 190 - g])
    ref = R.grouped_window_attention(q, kc, vc, gs, gp, ctx, 0.125)
    out = C.cpu_grouped_window_attention(q, kc, vc, gs, gp, ctx, 0.125)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_attention_float16_and_mixed_dtypes():
    q, kc, vc, gs, gp, ctx, scale = _attn_random_case(7, torch.float16)
    ref = R.grouped_window_attention(q, kc, vc, gs, gp, ctx, scale)
    out = C.cpu_grouped_window_attention(q, kc, vc, gs, gp, ctx, scale)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.float16])
    # q in float32, caches in bfloat16 (the reference upcasts both)
    q32 = q.float()
    kcb, vcb = kc.bfloat16(), vc.bfloat16()
    ref = R.grouped_window_attention(q32, kcb, vcb, gs, gp, ctx, scale)
    out = C.cpu_grouped_window_attention(q32, kcb, vcb, gs, gp, ctx, scale)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_attention_strided_cache_view():
    gen = _gen(5)
    L, S, T, hkv, d = 3, 2, 64, 2, 16
    kst = torch.randn(L, S + 1, T, hkv, d, generator=gen)
    vst = torch.randn(L, S + 1, T, hkv, d, generator=gen)
    q = torch.randn(2, 3, 4, d, generator=gen)
    gs, gp = torch.tensor([1, 0]), torch.tensor([20, 61])
    for kc, vc in ((kst[1], vst[1]), (kst[2][:, ::2], vst[2][:, ::2])):
        ctx = kc.shape[1]
        gpc = gp.clamp(max=ctx - 3)
        ref = R.grouped_window_attention(q, kc, vc, gs, gpc, ctx, 0.25)
        out = C.cpu_grouped_window_attention(q, kc, vc, gs, gpc, ctx, 0.25)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


# ---------------------------------------------------------------------------------------------
# write_kv, conv, delta rule, commit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv(dtype):
    gen = _gen(1)
    S, T, hkv, d, ng, g = 3, 20, 2, 8, 4, 5
    kc = torch.randn(S + 1, T, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(S + 1, T, hkv, d, generator=gen).to(dtype)
    k = torch.randn(ng, g, hkv, d, generator=gen)
    v = torch.randn(ng, g, hkv, d, generator=gen)
    gs = torch.tensor([0, 2, 1, S])
    gp = torch.tensor([0, 7, T - 2, 3])  # rows past T - 1 clamp onto the last position
    kr, vr = kc.clone(), vc.clone()
    R.write_kv(kr, vr, k, v, gs, gp)
    C.cpu_write_kv(kc, vc, k, v, gs, gp)
    # positions hit twice (clamped padding rows): the last row wins in both
    assert torch.equal(kc[:S], kr[:S]) and torch.equal(vc[:S], vr[:S])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv(seed, dtype):
    gen = _gen(seed)
    ng, g, c = int(torch.randint(1, 5, (1,), generator=gen)), seed % 8 + 1, 37
    kw = [2, 3, 4][seed % 3]
    S = 3
    x = torch.randn(ng, g, c, generator=gen).to(dtype)
    cs = torch.randn(S + 1, c, kw - 1, generator=gen)  # float32 state, x in model dtype
    w = torch.randn(c, kw, generator=gen).to(dtype)
    gs = _slots(gen, ng, S)
    ro, rs = R.causal_conv_window(x, cs, w, gs)
    co, csn = C.cpu_causal_conv_window(x, cs, w, gs)
    torch.testing.assert_close(co.float(), ro.float(), **TOL[dtype])
    assert torch.equal(csn, rs)


def _gdn_case(seed, dtype):
    gen = _gen(seed)
    ng = int(torch.randint(1, 5, (1,), generator=gen))
    g = int(torch.randint(1, 9, (1,), generator=gen))
    h = int(torch.randint(1, 4, (1,), generator=gen))
    dk = [4, 16, 32, 33][seed % 4]
    dv = [8, 16, 5, 32][(seed // 4) % 4]
    return _gdn_inputs(gen, ng, g, h, dk, dv, 3, dtype)


def _gdn_inputs(gen, ng, g, h, dk, dv, S, dtype):
    """The delta rule's inputs ([q, k, v, g, beta] in dtype), a float32 state of S + 1 slots and
    the groups' slots."""
    q = F.normalize(torch.randn(ng, g, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(ng, g, h, dk, generator=gen), dim=-1)
    v = torch.randn(ng, g, h, dv, generator=gen)
    gg = -torch.rand(ng, g, h, generator=gen) * 3
    beta = torch.rand(ng, g, h, generator=gen)
    st = torch.randn(S + 1, h, dk, dv, generator=gen)
    gs = _slots(gen, ng, S)
    return [t.to(dtype) for t in (q, k, v, gg, beta)], st, gs


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta(seed, dtype):
    (q, k, v, gg, beta), st, gs = _gdn_case(seed, dtype)
    st0 = st.clone()
    ro, rs = R.gated_delta_window(q, k, v, gg, beta, st, gs)
    co, cs = C.cpu_gated_delta_window(q, k, v, gg, beta, st, gs)
    assert co.dtype == torch.float32 and cs.dtype == torch.float32
    # inputs are upcast exactly, so even bf16 inputs match to float32 rounding
    torch.testing.assert_close(co, ro, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cs, rs, rtol=1e-4, atol=1e-5)
    assert torch.equal(st, st0)  # the state is read, not modified


def test_gated_delta_mixed_dtypes():
    (q, k, v, gg, beta), st, gs = _gdn_case(3, torch.float32)
    args = (q.bfloat16(), k.bfloat16(), v.bfloat16(), gg, beta.bfloat16(), st, gs)
    ro, rs = R.gated_delta_window(*args)
    co, cs = C.cpu_gated_delta_window(*args)
    torch.testing.assert_close(co, ro, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cs, rs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_gated_delta_snapshots_into_a_slice(impl):
    """snaps=: the snapshots land in the given tensor (a layer's slice of a window's stack),
    the same values as when the op allocates them; the rest of the stack is untouched; and a
    compiled region that passes a slice writes it in place."""
    (q, k, v, gg, beta), st, gs = _gdn_case(5, torch.float32)
    fn = R.gated_delta_window if impl == "reference" else C.cpu_gated_delta_window
    want_o, want_s = fn(q, k, v, gg, beta, st, gs)
    stack = torch.full((3, *want_s.shape), 7.0)
    out, snaps = fn(q, k, v, gg, beta, st, gs, snaps=stack[1])
    assert snaps.data_ptr() == stack[1].data_ptr()
    assert torch.equal(out, want_o) and torch.equal(stack[1], want_s)
    assert torch.all(stack[0] == 7.0) and torch.all(stack[2] == 7.0)
    if impl == "cpu":
        from torch import _dynamo

        _dynamo.reset()
        region = torch.compile(lambda *a, snaps: fn(*a, snaps=snaps)[0] * 2)
        stack.fill_(7.0)
        got = region(q, k, v, gg, beta, st, gs, snaps=stack[2])
        torch.testing.assert_close(got, want_o * 2)
        assert torch.equal(stack[2], want_s) and torch.all(stack[1] == 7.0)


def _chunk_case(seed, b, length, h, dk, dv, dtype=torch.float32, pad=0):
    """A prompt chunk's inputs as GatedDeltaNet.forward_seq passes them: q, k L2-normalised (q
    scaled), a padded tail of `pad` rows with zero decay and zero write strength."""
    gen = _gen(seed)
    q = F.normalize(torch.randn(b, length, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(b, length, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, length, h, dv, generator=gen).to(dtype)
    gg = -torch.rand(b, length, h, generator=gen) * 2
    beta = torch.rand(b, length, h, generator=gen)
    if pad:
        gg[:, length - pad:] = 0.0
        beta[:, length - pad:] = 0.0
    st = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, gg, beta, st


@pytest.mark.parametrize("b,length,h,dk,dv,pad", [
    (1, 1, 1, 8, 8, 0), (1, 64, 4, 64, 64, 0), (2, 70, 3, 32, 16, 6), (1, 130, 2, 33, 40, 0),
    (3, 16, 2, 16, 5, 9)])
def test_chunk_rule_by_the_recurrence_matches_the_chunked_reference(b, length, h, dk, dv, pad):
    """The prompt chunk's gated delta rule on the C++ recurrence (the decode kernel keeping only
    the final state) against the chunked reference: outputs of the real rows and the final state,
    lengths off and on the reference's 64-row chunks, a padded tail that leaves the state as the
    real rows left it."""
    q, k, v, gg, beta, st = _chunk_case(length * 7 + dk, b, length, h, dk, dv, pad=pad)
    st0 = st.clone()
    ro, rs = R.chunk_gated_delta(q, k, v, gg, beta, st)
    co, cs = C.cpu_chunk_gated_delta(q, k, v, gg, beta, st)
    assert co.shape == ro.shape and cs.shape == rs.shape and co.dtype == cs.dtype == torch.float32
    real = length - pad
    torch.testing.assert_close(co[:, :real], ro[:, :real], rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(cs, rs, rtol=1e-4, atol=2e-5)
    assert torch.equal(st, st0)  # the initial state is read, not modified
    if pad:  # the padded rows leave the state where the real rows left it
        _, cut = C.cpu_chunk_gated_delta(*(t[:, :real] for t in (q, k, v, gg, beta)), st)
        torch.testing.assert_close(cs, cut, rtol=1e-6, atol=1e-6)


def test_chunk_rule_final_state_argument_checks():
    q, k, v, gg, beta, st = _chunk_case(1, 2, 8, 2, 16, 16)
    out = torch.empty(2, 8, 2, 16)
    gs = torch.arange(2)
    with pytest.raises(ValueError, match="snaps must have shape"):
        C._cpu.gated_delta_window(q, k, v, gg, beta, st, gs, out, torch.empty(2, 2, 16, 15),
                                  final_only=True)
    with pytest.raises(ValueError, match="snaps"):
        C._cpu.gated_delta_window(q, k, v, gg, beta, st, gs, out, torch.empty(2, 8, 2, 16, 16),
                                  final_only=True)


def _commit_case(seed, conv_snap_dtype=torch.bfloat16):
    """Random factors [k | delta | decay] (decay in (0, 1]) of a window's rows to commit."""
    gen = _gen(seed)
    L, ng, g, h, dk, dv, c, km1, S = 3, 4, 5, 2, 6, 7, 9, 3, 6
    rec_factors = torch.randn(L, ng, g, h, dk + dv + 1, generator=gen)
    rec_factors[..., -1] = torch.rand(L, ng, g, h, generator=gen)
    conv_snaps = torch.randn(L, ng, g, c, km1, generator=gen).to(conv_snap_dtype)
    rec_state = torch.randn(L, S + 1, h, dk, dv, generator=gen)
    conv_state = torch.randn(L, S + 1, c, km1, generator=gen)
    slot_pos = torch.randint(0, 50, (S + 1,), generator=gen)
    gs = torch.cat([torch.randperm(S, generator=gen)[:ng - 1], torch.tensor([S])])
    gp = torch.randint(0, 100, (ng,), generator=gen)
    acc = torch.randint(0, g, (ng,), generator=gen)
    return [acc, gs, gp, rec_factors, conv_snaps, rec_state, conv_state, slot_pos]


@pytest.mark.parametrize("seed", range(4))
def test_commit_accepted(seed):
    """The C++ replay of the factors is the reference's, bit for bit (both round s * decay, then
    k * delta, then the sum); conv snapshots and positions as the reference commits them."""
    args = _commit_case(seed)
    ref = [a.clone() for a in args]
    R.commit_accepted(*ref)
    C.cpu_commit_accepted(*args)
    for a, b in zip(args[5:], ref[5:]):
        assert torch.equal(a, b)


def test_commit_into_strided_state_view():
    # state kept as one (L_all, S+1, ...) tensor; commit the linear-attention layers 1, 3, 5
    args = _commit_case(9)
    acc, gs, gp, rec_factors, conv_snaps, rec_state, conv_state, slot_pos = args
    big_rec = torch.randn(6, *rec_state.shape[1:])
    big_conv = torch.zeros(6, *conv_state.shape[1:])
    rec_view, conv_view = big_rec[1::2], big_conv[1::2]
    rec_view.copy_(rec_state)  # (the replay starts from the state)
    untouched = big_rec[0::2].clone()
    R.commit_accepted(acc, gs, gp, rec_factors, conv_snaps, rec_state, conv_state, slot_pos.clone())
    C.cpu_commit_accepted(acc, gs, gp, rec_factors, conv_snaps, rec_view, conv_view, slot_pos)
    assert torch.equal(rec_view[:, gs[:-1]], rec_state[:, gs[:-1]])
    assert torch.equal(conv_view[:, gs[:-1]], conv_state[:, gs[:-1]])
    assert torch.equal(big_rec[0::2], untouched)


# ---- the window's factors and their commit, against its snapshots (bit for bit) --------------
# A decode window writes each row's rank-one update of the DeltaNet state, [k | delta | decay],
# and the commit replays rows 0..accept onto the slot's state: the state the window had after
# row accept, the very bits its snapshot of that row holds. Every backend built here: the
# reference and the C++ twin (the GPU's in test_kernels_gpu.py).

GDN_IMPLS = {"reference": (R.gated_delta_window, R.commit_accepted),
             "cpu": (C.cpu_gated_delta_window, C.cpu_commit_accepted)}


def _commit_both(commit, accept, gs, st, factors, snaps, S):
    """(state committed from the factors, state the snapshots give) for one layer's window:
    commit_accepted over a stack of one layer, padding groups on the scratch slot S."""
    ng, g = factors.shape[:2]
    rec = st[None].clone()
    conv = torch.zeros(1, S + 1, 3, 2)
    pos = torch.zeros(S + 1, dtype=torch.int64)
    commit(accept, gs, torch.zeros(ng, dtype=torch.int64), factors[None],
           torch.zeros(1, ng, g, 3, 2), rec, conv, pos)
    want = st[None].clone()
    for n in range(ng):
        want[0, gs[n]] = snaps[n, accept[n]]
    return rec, want


def _accepts(gen, ng, g):
    """accept patterns: all 0, all G-1, mixed, random."""
    out = [torch.zeros(ng, dtype=torch.int64), torch.full((ng,), g - 1),
           torch.arange(ng) % g, torch.randint(0, g, (ng,), generator=gen)]
    return out


@pytest.mark.parametrize("impl", list(GDN_IMPLS))
@pytest.mark.parametrize("ng,g,h,dk,dv", [
    (1, 1, 1, 4, 8), (3, 2, 2, 16, 16), (4, 5, 3, 33, 5), (2, 8, 2, 128, 128),
    (5, 3, 1, 100, 40), (2, 17, 2, 8, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_from_factors_is_the_snapshot_bit_for_bit(impl, ng, g, h, dk, dv, dtype):
    window, commit = GDN_IMPLS[impl]
    gen = _gen(ng * 100 + g * 10 + dk)
    S = 4
    (q, k, v, gg, beta), st, gs = _gdn_inputs(gen, ng, g, h, dk, dv, S, dtype)
    out_s, snaps = window(q, k, v, gg, beta, st, gs)
    factors = torch.full((ng, g, h, dk + dv + 1), float("nan"))
    out_f, got = window(q, k, v, gg, beta, st, gs, factors=factors)
    assert got.data_ptr() == factors.data_ptr() and not factors.isnan().any()
    assert torch.equal(out_f, out_s)  # the same rule, only its per-row output differs
    real = gs < S
    for accept in _accepts(gen, ng, g):
        rec, want = _commit_both(commit, accept, gs, st, factors, snaps, S)
        assert torch.equal(rec[:, gs[real]], want[:, gs[real]]), accept
        untouched = [i for i in range(S) if i not in gs.tolist()]
        assert torch.equal(rec[0, untouched], st[untouched])


def test_commit_from_factors_padding_groups_share_the_scratch_slot():
    """Padding groups all read the scratch slot; the C++ commit replays only the last one's rows
    there (onto the state it read: a copy of its snapshot, as before), and the real slots are
    untouched by them."""
    window, commit = GDN_IMPLS["cpu"]
    (q, k, v, gg, beta), st, _ = _gdn_case(4, torch.float32)
    ng, g = q.shape[:2]
    S = st.shape[0] - 1
    gs = torch.full((ng,), S)
    gs[0] = 1
    _, snaps = window(q, k, v, gg, beta, st, gs)
    h, dk, dv = snaps.shape[2:]
    factors = torch.empty(ng, g, h, dk + dv + 1)
    window(q, k, v, gg, beta, st, gs, factors=factors)
    accept = torch.arange(ng) % g
    rec, want = _commit_both(commit, accept, gs, st, factors, snaps, S)
    assert torch.equal(rec[0, 1], want[0, 1])
    assert torch.equal(rec[0, S], snaps[ng - 1, accept[ng - 1]])


@pytest.mark.parametrize("ng,g,slots", [(1, 1, 2), (3, 2, 4), (2, 5, 3), (8, 2, 9)])
def test_commit_from_prepared_factors_is_the_snapshot_bit_for_bit(ng, g, slots):
    """The prepared form (reference.gated_delta_window_prep: the model's norms and gates, then
    the rule), on the embedded model's layer shapes: the factors' commit is its snapshot."""
    layer, _ = _prep_layer()
    gen = torch.Generator().manual_seed(ng * 7 + g)
    x = torch.randn(ng, g, layer.conv_dim, generator=gen)
    ba = torch.randn(ng, g, 2 * layer.nv, generator=gen) * 2
    st = torch.randn(slots + 1, layer.nv, layer.dk, layer.dv, generator=gen) * 0.1
    gs = _slots(gen, ng, slots)
    args = (x, ba, layer.neg_a, layer.dt_bias_f, st, gs, layer.nk, layer.dk, layer.dk ** -0.5,
            1e-6)
    out_s, snaps = R.gated_delta_window_prep(*args)
    factors = torch.empty(ng, g, layer.nv, layer.factor_width())
    out_f, _ = R.gated_delta_window_prep(*args, factors=factors)
    assert torch.equal(out_f, out_s)
    real = gs < slots
    for commit in (R.commit_accepted, C.cpu_commit_accepted):
        for accept in _accepts(gen, ng, g):
            rec, want = _commit_both(commit, accept, gs, st, factors, snaps, slots)
            assert torch.equal(rec[:, gs[real]], want[:, gs[real]])


@pytest.mark.parametrize("impl", list(GDN_IMPLS))
def test_gated_delta_factors_into_a_compiled_slice(impl):
    """factors=: a compiled region that passes a layer's slice of the window's stack writes it
    in place, the eager call's bits: the C++ kernel and the reference as opaque ops (the
    reference's so that inductor cannot round its state update otherwise than the replay)."""
    from torch import _dynamo

    window, _ = GDN_IMPLS[impl]
    (q, k, v, gg, beta), st, gs = _gdn_case(5, torch.float32)
    ng, g, h, dk = k.shape
    w = dk + v.shape[-1] + 1
    want = torch.empty(ng, g, h, w)
    want_o, _ = window(q, k, v, gg, beta, st, gs, factors=want)
    stack = torch.full((3, ng, g, h, w), 7.0)
    _dynamo.reset()
    region = torch.compile(lambda *a, factors: window(*a, factors=factors)[0] * 2,
                           backend="aot_eager", fullgraph=True)
    got = region(q, k, v, gg, beta, st, gs, factors=stack[1])
    assert torch.equal(got, want_o * 2)
    assert torch.equal(stack[1], want) and torch.all(stack[0] == 7.0) and torch.all(stack[2] == 7.0)
    _dynamo.reset()


def test_gated_delta_factor_argument_checks():
    (q, k, v, gg, beta), st, gs = _gdn_case(0, torch.float32)
    ng, g, h, dk = k.shape
    dv = v.shape[-1]
    out = torch.empty(ng, g, h, dv)
    with pytest.raises(ValueError, match="snaps must have shape"):
        C._cpu.gated_delta_window(q, k, v, gg, beta, st, gs, out, torch.empty(ng, g, h, dk + dv),
                                  factors=True)
    with pytest.raises(ValueError, match="exclude each other"):
        C._cpu.gated_delta_window(q, k, v, gg, beta, st, gs, out,
                                  torch.empty(ng, g, h, dk + dv + 1), final_only=True,
                                  factors=True)
    with pytest.raises(ValueError, match="exclude each other"):
        C.cpu_gated_delta_window(q, k, v, gg, beta, st, gs, snaps=torch.empty(ng, g, h, dk, dv),
                                 factors=torch.empty(ng, g, h, dk + dv + 1))
    args = _commit_case(0)
    args[3] = args[3][..., :-1].contiguous()
    with pytest.raises(ValueError, match="rec_factors must have shape"):
        C.cpu_commit_accepted(*args)


# ---------------------------------------------------------------------------------------------
# argument checks


def test_bad_arguments():
    q, kc, vc, gs, gp, ctx, scale = _attn_random_case(0, torch.float32)
    out = torch.empty_like(q)
    cpu = C._cpu
    with pytest.raises(ValueError, match="ctx"):
        cpu.grouped_window_attention(q, kc, vc, gs, gp, kc.shape[1] + 1, scale, out)
    with pytest.raises(ValueError, match="ctx"):
        cpu.grouped_window_attention(q, kc, vc, gs, gp, 0, scale, out)
    with pytest.raises(TypeError, match="group_slot"):
        cpu.grouped_window_attention(q, kc, vc, gs.int(), gp, ctx, scale, out)
    with pytest.raises(ValueError, match="group_pos must have shape"):
        cpu.grouped_window_attention(q, kc, vc, gs, gp[:0], ctx, scale, out)
    with pytest.raises(TypeError, match="out dtype"):
        cpu.grouped_window_attention(q, kc, vc, gs, gp, ctx, scale, out.double())
    with pytest.raises(TypeError, match="q has dtype torch.float64"):
        cpu.grouped_window_attention(q.double(), kc, vc, gs, gp, ctx, scale, out)
    with pytest.raises(ValueError, match="v_cache must have shape"):
        cpu.grouped_window_attention(q, kc, vc[:, :-1], gs, gp, ctx, scale, out)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        cpu.grouped_window_attention(q[0], kc, vc, gs, gp, ctx, scale, out)
    q_strided = torch.empty(*q.shape[:-1], 2 * q.shape[-1])[..., ::2]
    q_strided.copy_(q)
    with pytest.raises(ValueError, match="q must be contiguous"):
        cpu.grouped_window_attention(q_strided, kc, vc, gs, gp, ctx, scale, out)
    # the friendly wrapper makes it contiguous
    torch.testing.assert_close(C.cpu_grouped_window_attention(q_strided, kc, vc, gs, gp, ctx, scale),
                               R.grouped_window_attention(q, kc, vc, gs, gp, ctx, scale),
                               **TOL[torch.float32])
    with pytest.raises(ValueError, match="k_cache must be densely packed"):
        kc_strided = torch.empty(*kc.shape[:-1], 2 * kc.shape[-1])[..., ::2]
        cpu.grouped_window_attention(q, kc_strided, vc, gs, gp, ctx, scale, out)
    with pytest.raises(TypeError, match="k_cache must be a torch.Tensor"):
        cpu.grouped_window_attention(q, None, vc, gs, gp, ctx, scale, out)
    bad_slots = gs.clone()
    bad_slots[0] = kc.shape[0]
    with pytest.raises(ValueError, match="group_slot.*out of range"):
        C.cpu_grouped_window_attention(q, kc, vc, bad_slots, gp, ctx, scale)
    (qd, kd, vd, gd, bd), st, gsd = _gdn_case(0, torch.float32)
    with pytest.raises(TypeError, match="rec_state has dtype"):
        C.cpu_gated_delta_window(qd, kd, vd, gd, bd, st.double(), gsd)
    with pytest.raises(ValueError, match="beta must have shape"):
        C.cpu_gated_delta_window(qd, kd, vd, gd, bd[..., :0], st, gsd)
    args = _commit_case(0)
    args[0] = args[0].clone()
    args[0][0] = 5  # accept >= G
    with pytest.raises(ValueError, match="accept"):
        C.cpu_commit_accepted(*args)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="conv_state must have shape"):
        C.cpu_causal_conv_window(x, torch.randn(3, 8, 2), torch.randn(8, 4), torch.tensor([0, 1]))


# ---------------------------------------------------------------------------------------------
# dispatch


def test_set_backend_cpu_and_torch():
    try:
        assert ops.set_backend("cpu", "cpu") == "cpu"
        assert ops.backend() == "cpu"
        assert ops.grouped_window_attention is C.cpu_grouped_window_attention
        assert ops.chunk_gated_delta is C.cpu_chunk_gated_delta
        assert ops.moe_route is R.moe_route  # per-op fallback
        assert ops.implementations()["moe_route"] == "torch"
        q, kc, vc, gs, gp, ctx, scale = _attn_random_case(3, torch.float32)
        torch.testing.assert_close(ops.grouped_window_attention(q, kc, vc, gs, gp, ctx, scale),
                                   R.grouped_window_attention(q, kc, vc, gs, gp, ctx, scale),
                                   **TOL[torch.float32])
        ops.set_backend("torch", "cpu")
        assert ops.grouped_window_attention is R.grouped_window_attention
    finally:
        ops.set_backend("torch", "cpu")


def test_set_backend_errors():
    with pytest.raises(ValueError, match="backend='tpu'"):
        ops.set_backend("tpu", "cpu")
    with pytest.raises(ValueError, match="backend=cpu"):
        ops.set_backend("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend=cuda"):
            ops.set_backend("cuda", "cpu")
        with pytest.raises(ValueError, match="backend=cuda"):
            ops.set_backend("cuda", "cuda")
        with pytest.raises(ValueError, match="backend=hip"):
            ops.set_backend("hip", "cuda")
    assert ops.backend() == "torch"


# ---------------------------------------------------------------------------------------------
# the CUDA extension is compiled when nvcc is present (and imports without a GPU)


@pytest.mark.skipif(shutil.which("nvcc") is None or os.environ.get("STRATA_CUDA") == "0",
                    reason="nvcc not on PATH")
def test_cuda_extension_built_with_nvcc():
    mod = importlib.import_module("strata.kernels.strata_cuda")
    assert mod.gpu_platform() in ("cuda", "hip")
    if mod.gpu_platform() == "cuda":
        assert mod.has_mma() and mod.attn_mma_supported(256)
    for name in ("write_kv", "grouped_window_attention", "causal_conv_window",
                 "gated_delta_window", "commit_accepted"):
        assert callable(getattr(mod, name))
    assert mod.attention_workspace_numel(2, 2, 16, 256, 4) == 2 * 2 * 4 * 16 * 258
    if not torch.cuda.is_available():
        # CPU tensors are refused before any CUDA call
        q = torch.zeros(1, 1, 2, 64, dtype=torch.bfloat16)
        kc = torch.zeros(2, 8, 1, 64, dtype=torch.bfloat16)
        idx = torch.zeros(1, dtype=torch.int64)
        with pytest.raises(ValueError, match="q is on cpu"):
            mod.grouped_window_attention(q, kc, kc, idx, idx, 8, 0.1, q.clone(), None, 1, 8, 0)


def test_attention_plan():
    # split-K fills the GPU once with chunks that are multiples of 64 keys
    for ng, hkv, rows, ctx in ((1, 2, 64, 32768), (8, 2, 16, 32768), (1, 2, 16, 256),
                               (4, 2, 32, 4096), (8, 2, 64, 1000)):
        nsplit, chunk = C.attention_plan(ng, hkv, rows, ctx, 256, 132, True)
        assert chunk % 64 == 0 and nsplit * chunk >= ctx and (nsplit - 1) * chunk < ctx
        assert ng * hkv * nsplit <= 132 or nsplit == 1
    assert C.attention_plan(1, 2, 64, 32768, 256, 132, True) == (64, 512)
    assert C.attention_plan(1, 2, 16, 256, 256, 132, True)[0] == 1


# ---------------------------------------------------------------------------------------------
# torch.compile: the cyext ops are torch.library custom ops under dynamo (no graph break)


def test_ops_compile_fullgraph_without_graph_break():
    (q, k, v, gg, beta), st, gs = _gdn_case(2, torch.float32)
    ng, g = q.shape[:2]
    S = st.shape[0] - 1
    gen = _gen(3)
    x = torch.randn(ng, g, 12, generator=gen)
    conv_state = torch.randn(S + 1, 12, 3, generator=gen)
    w = torch.randn(12, 4, generator=gen)
    kc = torch.randn(S + 1, 40, 2, 16, generator=gen)
    vc = torch.randn(S + 1, 40, 2, 16, generator=gen)
    kn = torch.randn(ng, g, 2, 16, generator=gen)
    qa = torch.randn(ng, g, 4, 16, generator=gen)
    gp = torch.randint(0, 40 - g, (ng,), generator=gen)
    slot_pos = torch.zeros(S + 1, dtype=torch.int64)
    acc = torch.randint(0, g, (ng,), generator=gen)
    fw = k.shape[-1] + v.shape[-1] + 1

    def step(kc, vc, rec, conv, slot_pos):
        mixed, conv_snaps = ops.causal_conv_window(x, conv, w, gs)
        factors = torch.empty(1, ng, g, k.shape[2], fw)
        o, _ = ops.gated_delta_window(q, k, v, gg, beta, rec, gs, factors=factors[0])
        ops.write_kv(kc, vc, kn, kn * 2, gs, gp)
        a = ops.grouped_window_attention(qa, kc, vc, gs, gp, 40, 0.25)
        ops.commit_accepted(acc, gs, gp, factors, conv_snaps[None], rec[None],
                            conv[None], slot_pos)
        return mixed.sum() + o.sum() + a.sum()

    def run(fn):
        bufs = [t.clone() for t in (kc, vc, st, conv_state, slot_pos)]
        return fn(*bufs), bufs

    try:
        ops.set_backend("torch", "cpu")
        ref, ref_bufs = run(step)
        ops.set_backend("cpu", "cpu")
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        out, bufs = run(compiled)
    finally:
        ops.set_backend("torch", "cpu")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
    real = gs < S  # padding groups commit into the scratch slot in any order
    for a, b in zip(bufs, ref_bufs):
        if a.dim() >= 2 and a.shape[0] == S + 1:
            torch.testing.assert_close(a[gs[real]], b[gs[real]], rtol=1e-4, atol=1e-5)
        else:
            torch.testing.assert_close(a[gs[real]], b[gs[real]])


def _prep_layer(dtype: str = "float32"):
    """The embedded tiny model's first linear-attention layer and a window's inputs."""
    from strata.config import EMBEDDED_MODEL_DIR
    from strata.model.loader import load_checkpoint

    model = load_checkpoint(EMBEDDED_MODEL_DIR, dtype=dtype, log=lambda _m: None).model
    layer = next(m.linear_attn for m in model.layers if m.kind == "linear_attention")
    gen = torch.Generator().manual_seed(11)
    ng, g, slots = 3, 2, 4
    x = torch.randn(ng, g, model.args.hidden_size, generator=gen).to(model.dtype)
    conv = torch.randn(slots + 1, layer.conv_dim, layer.kernel - 1, generator=gen).to(model.dtype)
    rec = torch.randn(slots + 1, layer.nv, layer.dk, layer.dv, generator=gen) * 0.1
    return layer, (x, conv, rec, torch.tensor([2, 0, 4]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_delta_prep_reference_is_the_models_preparation(dtype):
    """reference.gated_delta_window_prep (what the GPU kernel computes) takes the layer's raw
    conv output and b/a columns to the same rule as GatedDeltaNet's own norms and gates (beta
    rounded to b's dtype as the model's sigmoid rounds it), bit for bit."""
    layer, (x, conv, rec, gs) = _prep_layer(dtype)
    mixed, z, ba = layer._project_raw(x)
    mixed, _ = R.causal_conv_window(mixed, conv, layer.conv1d.weight[:, 0, :], gs)
    q, k, v, gg, beta = layer._heads(mixed, *layer._split_ba(ba))
    want_o, want_s = R.gated_delta_window(q, k, v, gg, beta, rec, gs)
    got_o, got_s = R.gated_delta_window_prep(mixed, ba, layer.neg_a, layer.dt_bias_f, rec, gs,
                                             layer.nk, layer.dk, layer.dk ** -0.5, 1e-6)
    assert torch.equal(got_o, want_o) and torch.equal(got_s, want_s)


def test_window_takes_the_prepared_rule_where_the_backend_has_it(monkeypatch):
    """GatedDeltaNet.forward_window calls ops.gated_delta_window_prep where the backend runs it
    natively (the GPU), with the same result as its own preparation (the CPU)."""
    from strata.kernels import ops

    layer, (x, conv, rec, gs) = _prep_layer()
    calls = []

    def prep(*a, **kw):
        calls.append(1)
        return R.gated_delta_window_prep(*a, **kw)

    want = layer.forward_window(x, conv, rec, gs)
    assert not calls
    monkeypatch.setattr(ops, "gated_delta_window_prep", prep)
    monkeypatch.setitem(ops._IMPL, "gated_delta_window_prep", "cuda")
    got = layer.forward_window(x, conv, rec, gs)
    assert calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_conv_qkvz_reference_is_the_models_gather():
    """reference.causal_conv_window_qkvz (what the GPU kernel computes from the in_proj's
    interleaved columns) is the conv on the layer's own concatenated input, bit for bit."""
    layer, (x, conv, rec, gs) = _prep_layer()
    mixed, _, _ = layer._project_raw(x)
    qkvz, _, _ = layer._project_qkvz(x)
    w = layer.conv1d.weight[:, 0, :]
    want = R.causal_conv_window(mixed, conv, w, gs)
    got = R.causal_conv_window_qkvz(qkvz, conv, w, gs, layer.nk, layer.dk,
                                    (layer.nv // layer.nk) * layer.dv)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_window_gathers_the_conv_input_where_the_backend_can(monkeypatch):
    """GatedDeltaNet.forward_window hands the conv the in_proj's raw columns where the backend
    gathers them natively, with the result of its own concatenation."""
    from strata.kernels import ops

    layer, (x, conv, rec, gs) = _prep_layer()
    calls = []

    def conv_qkvz(*a, **kw):
        calls.append(1)
        return R.causal_conv_window_qkvz(*a, **kw)

    want = layer.forward_window(x, conv, rec, gs)
    monkeypatch.setattr(ops, "causal_conv_window_qkvz", conv_qkvz)
    monkeypatch.setitem(ops._IMPL, "causal_conv_window_qkvz", "cuda")
    got = layer.forward_window(x, conv, rec, gs)
    assert calls
    for a, b in zip(got, want):
        assert torch.equal(a, b)
def _fp8_qkvz_layer(dtype: str = "float32"):
    """_prep_layer's layer with its in_proj_qkvz in FP8 (block 16) beside the float in_proj_ba,
    unfused, as an FP8 checkpoint with model.fp8_dense=fp8 leaves it."""
    from strata.model.fp8 import to_fp8_linear
    from strata.model.quantize import quantize_block

    layer, inputs = _prep_layer(dtype)
    w = layer.in_proj_qkvz.weight.detach()
    fp8 = to_fp8_linear(layer, "in_proj_qkvz", (16, 16))
    fp8.weight.data, fp8.weight_scale_inv.data = quantize_block(w, (16, 16))
    layer.w_in = None
    return layer, inputs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_conv_qkvz_ba_reference_is_the_layers_projection(dtype):
    """reference.causal_conv_window_qkvz_ba is the gathering conv's reference plus the layer's
    own in_proj_ba on the same rows, bit for bit."""
    layer, (x, conv, rec, gs) = _fp8_qkvz_layer(dtype)
    qkvz, _, ba = layer._project_qkvz(x)
    w = layer.conv1d.weight[:, 0, :]
    args = (qkvz, conv, w, gs, layer.nk, layer.dk, layer.vpk)
    got = R.causal_conv_window_qkvz_ba(*args, x, layer.in_proj_ba.weight)
    want = R.causal_conv_window_qkvz(*args) + (ba,)
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_window_projects_ba_in_the_conv_for_fp8_qkvz(monkeypatch):
    """With an FP8 in_proj_qkvz and a float in_proj_ba, GatedDeltaNet.forward_window has the
    conv's launch project b/a where the backend runs causal_conv_window_qkvz_ba natively (no
    in_proj_ba call of its own), with the result of the separate projection; float layers
    keep their path."""
    layer, (x, conv, rec, gs) = _fp8_qkvz_layer()
    calls, ba_calls = [], []

    def conv_qkvz_ba(*a, **kw):
        calls.append(1)
        return R.causal_conv_window_qkvz_ba(*a, **kw)

    want = layer.forward_window(x, conv, rec, gs)
    assert not calls
    monkeypatch.setattr(ops, "causal_conv_window_qkvz_ba", conv_qkvz_ba)
    monkeypatch.setitem(ops._IMPL, "causal_conv_window_qkvz_ba", "cuda")
    layer.in_proj_ba.register_forward_hook(lambda *_: ba_calls.append(1))
    got = layer.forward_window(x, conv, rec, gs)
    assert calls and not ba_calls
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    float_layer, _ = _prep_layer()
    float_layer.forward_window(x, conv, rec, gs)
    assert len(calls) == 1  # fused float projections: one GEMM already


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_route_is_the_scatter_into_zeros(dtype):
    """qwen3_next.dense_route (selects, which a compiled region folds into the kernel using it)
    gives the values of zeros().scatter_ of each row's top-k weights, ties and all."""
    from strata.model.qwen3_next import dense_route

    gen = torch.Generator().manual_seed(4)
    for n_exp, k in ((8, 2), (64, 10), (5, 5)):
        idx = torch.stack([torch.randperm(n_exp, generator=gen)[:k] for _ in range(7)])
        w = torch.rand(7, k, generator=gen).to(dtype)
        w[0] = w[0, 0]  # equal weights in a row
        want = torch.zeros(7, n_exp, dtype=dtype).scatter_(1, idx, w)
        assert torch.equal(dense_route(w, idx, n_exp), want)
