"""The model against transformers' Qwen3NextForCausalLM and against itself (issue 2 acceptance).

- prefill logits (whole-sequence and the lane prefill path) match transformers (float32, CPU);
- step-by-step cached decode (prefill, then 1-row verify windows committed with accept=0)
  matches a full no-cache recompute;
- a multi-row window equals the same rows run one by one (lanes mixed, a padding group);
- an accepted-prefix commit leaves exactly the state after the last accepted row;
- the MTP module matches a reference written here from DESIGN.md's formulas on the raw
  checkpoint tensors, through `mtp_train` and through `mtp_window` over a cached lane;
- a bfloat16 variant on CUDA (marked gpu, skipped without a device).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import CONFIGS, rel_err
from strata.kernels import ops
from strata.model.config import load_model_args
from strata.model.loader import load_checkpoint
from strata.model.state import DecodeState

transformers = pytest.importorskip("transformers")
from transformers import Qwen3NextForCausalLM  # noqa: E402

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.usefixtures("single_thread")
NAMES = list(CONFIGS)
TOL = 1e-4


def _tokens(vocab: int, shape, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ours(tiny_ckpts):
    return {n: load_checkpoint(p, dtype="float32", log=lambda _m: None) for n, p in tiny_ckpts.items()}


@pytest.fixture(scope="module")
def hf(tiny_ckpts):
    return {n: Qwen3NextForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval()
            for n, p in tiny_ckpts.items()}


@torch.no_grad()
def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, use_cache=False).logits


def _state(lm, lanes: int, ctx: int, device="cpu") -> DecodeState:
    return DecodeState(lm.args, lanes, ctx, lm.dtype, device, with_mtp=lm.has_mtp)


def _commit(accept, slots, pos, rec, conv, state, slot_pos):
    ops.commit_accepted(accept, slots, pos, rec, conv, state.rec, state.conv, slot_pos)


def test_configs_cover_the_variants(tiny_ckpts):
    args = {n: load_model_args(p) for n, p in tiny_ckpts.items()}
    assert len({a.num_attention_heads for a in args.values()}) >= 2
    assert len({tuple(a.layer_types) for a in args.values()}) >= 2
    assert len({a.num_experts for a in args.values()}) >= 2
    assert len({a.num_experts_per_tok for a in args.values()}) >= 2
    assert any(a.linear_num_value_heads > a.linear_num_key_heads for a in args.values())
    assert any(not a.norm_topk_prob for a in args.values())
    assert any(a.tie_word_embeddings for a in args.values())
    assert any(a.mlp_only_layers for a in args.values())


def test_tied_embeddings_are_tied_in_both(ours, hf):
    lm, ref = ours["tied"], hf["tied"]
    assert lm.args.tie_word_embeddings
    assert lm.model.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
    assert torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_prefill_logits_match_transformers(name, ours, hf):
    lm, ref = ours[name], hf[name]
    toks = _tokens(lm.args.vocab_size, (2, 150), seed=1)  # > 2 delta-rule chunks of 64
    want = hf_logits(ref, toks)
    got = lm.model.logits(lm.model.forward_train(toks))
    assert rel_err(got, want) <= TOL
    # The lane prefill path, in two chunks (the second continues the first's state).
    state = _state(lm, lanes=2, ctx=160)
    h1 = lm.model.prefill(toks[1, :100], 1, 0, state)
    h2 = lm.model.prefill(toks[1, 100:], 1, 100, state)
    got = lm.model.logits(torch.cat([h1, h2]))
    assert rel_err(got, want[1]) <= TOL


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,bucket,start", [(10, 16, 0), (37, 64, 0), (3, 128, 20), (70, 128, 30)])
@torch.no_grad()
def test_padded_prefill_equals_unpadded(name, ours, n, bucket, start):
    """A prompt chunk padded to a bucket (length given as a device tensor, garbage tokens after
    it) leaves the same state and hidden rows as the chunk alone; the padding writes only K/V
    rows past the chunk, which decoding overwrites before it reads them."""
    lm = ours[name]
    toks = _tokens(lm.args.vocab_size, (start + n,), seed=4)
    padded = torch.cat([toks[start:], _tokens(lm.args.vocab_size, (bucket - n,), seed=5)])
    states = [_state(lm, lanes=2, ctx=start + bucket + 8) for _ in range(2)]
    for st in states:
        if start:
            lm.model.prefill(toks[:start], 1, 0, st)
    want = lm.model.prefill(toks[start:], 1, start, states[0])
    got = lm.model.prefill(padded, torch.tensor([1]), torch.tensor([start]), states[1],
                           length=torch.tensor([n]), ctx=start + bucket)
    assert rel_err(got[:n], want) <= TOL
    a, b = states
    assert rel_err(b.rec[:, 1], a.rec[:, 1]) <= TOL
    assert rel_err(b.conv[:, 1], a.conv[:, 1]) <= TOL
    assert rel_err(b.k[:, 1, :start + n], a.k[:, 1, :start + n]) <= TOL
    assert torch.equal(b.rec[:, 0], a.rec[:, 0]) and torch.equal(b.k[:, 0], a.k[:, 0])  # other lane


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_cached_decode_matches_full_recompute(name, ours, hf):
    lm, ref = ours[name], hf[name]
    prompt, steps = 40, 24
    toks = _tokens(lm.args.vocab_size, (1, prompt + steps), seed=2)
    want = hf_logits(ref, toks)[0]
    state = _state(lm, lanes=2, ctx=prompt + steps)
    # Another lane holds another sequence: decoding lane 1 must not depend on it.
    lm.model.prefill(_tokens(lm.args.vocab_size, (30,), seed=3), 0, 0, state)
    h = lm.model.prefill(toks[0, :prompt], 1, 0, state)
    got = [lm.model.logits(h)]
    slot_pos = torch.tensor([30, prompt, 0])
    one = torch.tensor([1])
    for j in range(prompt, prompt + steps):
        pos = torch.tensor([j])
        _, logits, rec, conv = lm.model.verify_window(toks[:, j:j + 1], one, pos, j + 1, state)
        _commit(torch.zeros(1, dtype=torch.long), one, pos, rec, conv, state, slot_pos)
        got.append(logits[0])
    assert int(slot_pos[1]) == prompt + steps
    assert rel_err(torch.cat(got), want) <= TOL


def _prefilled(lm, lens, ctx, seed=10):
    state = _state(lm, lanes=len(lens), ctx=ctx)
    seqs = []
    for lane, n in enumerate(lens):
        t = _tokens(lm.args.vocab_size, (n,), seed=seed + lane)
        lm.model.prefill(t, lane, 0, state)
        seqs.append(t)
    return state, seqs


@pytest.mark.parametrize("name", ["base", "wide"])
@pytest.mark.parametrize("G", [1, 2, 3, 4, 5, 6])
@torch.no_grad()
def test_window_equals_rows_one_by_one(name, G, ours):
    lm = ours[name]
    lens = [10, 17, 5]
    state, _ = _prefilled(lm, lens, ctx=32)
    scratch = state.scratch
    # Groups: lane 2, lane 0, a padding group on the scratch lane, lane 1.
    slots = torch.tensor([2, 0, scratch, 1])
    pos = torch.tensor([lens[2], lens[0], 0, lens[1]])
    toks = _tokens(lm.args.vocab_size, (4, G), seed=20 + G)
    before = copy.deepcopy(state)
    ctx = int(pos.max()) + G
    hidden, logits, rec, conv = lm.model.verify_window(toks, slots, pos, ctx, state)
    assert logits.shape == (4, G, lm.args.vocab_size)
    # The window commits nothing: DeltaNet states of real lanes are untouched.
    assert torch.equal(state.rec[:, :scratch], before.rec[:, :scratch])
    assert torch.equal(state.conv[:, :scratch], before.conv[:, :scratch])
    for g in (0, 1, 3):
        lane, p = int(slots[g]), int(pos[g])
        # Committed K/V rows of the lane are untouched; the new rows are written.
        assert torch.equal(state.k[:, lane, :p], before.k[:, lane, :p])
        st = copy.deepcopy(before)
        sp = torch.zeros(scratch + 1, dtype=torch.long)
        for j in range(G):
            one, at = torch.tensor([lane]), torch.tensor([p + j])
            _, lg, r, c = lm.model.verify_window(toks[g:g + 1, j:j + 1], one, at, p + j + 1, st)
            assert rel_err(logits[g, j], lg[0, 0]) <= 1e-5
            _commit(torch.zeros(1, dtype=torch.long), one, at, r, c, st, sp)
            # The window committed through row j (its rows' factors replayed onto the state
            # it read) is the state after running rows 0..j one by one.
            acc = torch.zeros(len(slots), dtype=torch.long)
            acc[g] = j
            committed = copy.deepcopy(before)
            _commit(acc, slots, pos, rec, conv, committed,
                    torch.zeros(scratch + 1, dtype=torch.long))
            assert rel_err(committed.rec[:, lane], st.rec[:, lane]) <= 1e-5
            assert rel_err(committed.conv[:, lane], st.conv[:, lane]) <= 1e-6
        assert rel_err(state.k[:, lane, p:p + G], st.k[:, lane, p:p + G]) <= 1e-6
        assert rel_err(state.v[:, lane, p:p + G], st.v[:, lane, p:p + G]) <= 1e-6


@pytest.mark.parametrize("name", ["base", "tied"])
@pytest.mark.parametrize("accept", [(0, 3), (1, 2), (2, 0), (3, 1)])
@torch.no_grad()
def test_accepted_prefix_commit_then_decode_matches_recompute(name, accept, ours, hf):
    lm, ref = ours[name], hf[name]
    G, more = 4, 5
    lens = [12, 7]
    state, seqs = _prefilled(lm, lens, ctx=32, seed=30)
    slots = torch.tensor([0, 1])
    pos = torch.tensor(lens)
    window = _tokens(lm.args.vocab_size, (2, G), seed=31)
    _, _, rec, conv = lm.model.verify_window(window, slots, pos, max(lens) + G, state)
    slot_pos = torch.tensor(lens + [0])
    acc = torch.tensor(accept)
    _commit(acc, slots, pos, rec, conv, state, slot_pos)
    assert slot_pos[:2].tolist() == [lens[0] + accept[0] + 1, lens[1] + accept[1] + 1]
    # Continue each lane with fresh tokens from its committed length, one row at a time,
    # mixing both lanes in each window.
    cont = _tokens(lm.args.vocab_size, (2, more), seed=32)
    got = [[], []]
    for j in range(more):
        p = slot_pos[:2].clone()
        _, lg, r, c = lm.model.verify_window(cont[:, j:j + 1], slots, p, int(p.max()) + 1, state)
        _commit(torch.zeros(2, dtype=torch.long), slots, p, r, c, state, slot_pos)
        got[0].append(lg[0, 0])
        got[1].append(lg[1, 0])
    for lane in (0, 1):
        seq = torch.cat([seqs[lane], window[lane, :accept[lane] + 1], cont[lane]])
        want = hf_logits(ref, seq[None])[0, -more:]
        assert rel_err(torch.stack(got[lane]), want) <= TOL


# ---- the MTP module against a reference from DESIGN.md's formulas ---------------------------
def _rms(x, w, eps):
    """Zero-centred RMSNorm of Qwen3-Next: x_hat * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rotate(x, pos, rd, theta):
    inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    freqs = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, L, 1, rd)
    r, keep = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = torch.cat([-r[..., half:], r[..., :half]], -1)
    return torch.cat([r * cos + rot * sin, keep], -1)


def reference_mtp_logits(sd: dict, a, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """MTP row i (rotary position i): fc(cat[norm_e(embed(t[i+1])), norm_h(h[i])]) -> one
    full-attention decoder layer with MoE -> mtp.norm -> lm_head. Float64, raw tensors."""
    w = {k: v.double() for k, v in sd.items()}
    eps = a.rms_norm_eps
    h = h.double()
    emb = w["model.embed_tokens.weight"][tokens[:, 1:]]
    x = torch.cat([_rms(emb, w["mtp.pre_fc_norm_embedding.weight"], eps),
                   _rms(h[:, :-1], w["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
    x = x @ w["mtp.fc.weight"].T
    b, n, _ = x.shape
    P = "mtp.layers.0."
    hq, hkv, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    # Gated attention: q_proj gives per head [query | gate]; q/k RMSNorm per head; partial RoPE.
    y = _rms(x, w[P + "input_layernorm.weight"], eps)
    qg = (y @ w[P + "self_attn.q_proj.weight"].T).view(b, n, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(b, n, hq * d)
    k = (y @ w[P + "self_attn.k_proj.weight"].T).view(b, n, hkv, d)
    v = (y @ w[P + "self_attn.v_proj.weight"].T).view(b, n, hkv, d)
    q = _rms(q, w[P + "self_attn.q_norm.weight"], eps)
    k = _rms(k, w[P + "self_attn.k_norm.weight"], eps)
    pos = torch.arange(n)
    rd = int(d * a.partial_rotary_factor)
    q, k = _rotate(q, pos, rd, a.rope_theta), _rotate(k, pos, rd, a.rope_theta)
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(b, n, hq * d)
    x = x + (o * torch.sigmoid(gate)) @ w[P + "self_attn.o_proj.weight"].T
    # MoE: softmax router, top-k (renormalised when norm_topk_prob), experts, shared expert.
    y = _rms(x, w[P + "post_attention_layernorm.weight"], eps)
    probs = (y @ w[P + "mlp.gate.weight"].T).softmax(-1)
    topw, topi = probs.topk(a.num_experts_per_tok, dim=-1)
    if a.norm_topk_prob:
        topw = topw / topw.sum(-1, keepdim=True)
    moe = torch.zeros_like(y)
    for e in range(a.num_experts):
        E = f"{P}mlp.experts.{e}."
        out = (F.silu(y @ w[E + "gate_proj.weight"].T) * (y @ w[E + "up_proj.weight"].T)) @ \
            w[E + "down_proj.weight"].T
        weight = (topw * (topi == e)).sum(-1, keepdim=True)
        moe = moe + weight * out
    S = P + "mlp.shared_expert."
    shared = (F.silu(y @ w[S + "gate_proj.weight"].T) * (y @ w[S + "up_proj.weight"].T)) @ \
        w[S + "down_proj.weight"].T
    moe = moe + torch.sigmoid(y @ w[P + "mlp.shared_expert_gate.weight"].T) * shared
    x = _rms(x + moe, w["mtp.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_mtp_matches_reference(name, tiny_ckpts, ours, hf):
    lm, ref = ours[name], hf[name]
    sd = load_file(str(tiny_ckpts[name] / "model.safetensors"))
    assert any(k.startswith("mtp.") for k in sd) and lm.has_mtp
    L = 40
    toks = _tokens(lm.args.vocab_size, (2, L), seed=40)
    h = ref.model(input_ids=toks, use_cache=False).last_hidden_state  # post model.norm
    want = reference_mtp_logits(sd, lm.args, h, toks)  # (2, L-1, V)
    got = lm.model.logits(lm.model.mtp_train(h, toks))
    assert rel_err(got, want) <= TOL

    # The same rows through mtp_window over a cached lane: the first 16 rows as one group,
    # then groups of 3 rows, each window also carrying a group of the other lane.
    state = _state(lm, lanes=2, ctx=L)
    first = 16
    lane, other = torch.tensor([1]), torch.tensor([0])
    _, lg = lm.model.mtp_window(h[1:2, :first], toks[1:2, 1:first + 1], lane, torch.tensor([0]),
                                first, state)
    rows = [lg[0]]
    lm.model.mtp_window(h[0:1, :first], toks[0:1, 1:first + 1], other, torch.tensor([0]),
                        first, state)
    p = first
    while p < L - 1:
        g = min(3, L - 1 - p)
        hh = torch.stack([h[0, p:p + g], h[1, p:p + g]])
        nx = torch.stack([toks[0, p + 1:p + 1 + g], toks[1, p + 1:p + 1 + g]])
        _, lg = lm.model.mtp_window(hh, nx, torch.tensor([0, 1]), torch.tensor([p, p]), p + g, state)
        rows.append(lg[1])
        p += g
    assert rel_err(torch.cat(rows), want[1]) <= TOL


# ---- bfloat16 on CUDA ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_bf16_cuda_parity(name, tiny_ckpts, hf):
    bf16_parity(name, tiny_ckpts, hf, "cuda")


@torch.no_grad()
def bf16_parity(name, tiny_ckpts, hf, device):
    """Our bfloat16 model on `device` against transformers in float32 on CPU: rel err <= 2e-2."""
    lm = load_checkpoint(tiny_ckpts[name], dtype="bfloat16", device=device, log=lambda _m: None)
    assert lm.dtype == torch.bfloat16
    prompt, steps = 100, 12
    toks = _tokens(lm.args.vocab_size, (2, prompt + steps), seed=50)
    want = hf_logits(hf[name], toks)  # float32 CPU reference
    tc = toks.to(device)
    got = lm.model.logits(lm.model.forward_train(tc)).float()
    assert rel_err(got, want) <= 2e-2
    # Cached decode through the window path, in bfloat16.
    state = _state(lm, lanes=1, ctx=prompt + steps, device=device)
    out = [lm.model.logits(lm.model.prefill(tc[0, :prompt], 0, 0, state)).float()]
    slot_pos = torch.tensor([prompt, 0], device=device)
    one = torch.tensor([0], device=device)
    for j in range(prompt, prompt + steps):
        pos = torch.tensor([j], device=device)
        _, lg, rec, conv = lm.model.verify_window(tc[:1, j:j + 1], one, pos, j + 1, state)
        _commit(torch.zeros(1, dtype=torch.long, device=device), one, pos, rec, conv, state,
                slot_pos)
        out.append(lg[0].float())
    assert rel_err(torch.cat(out), want[0]) <= 2e-2
    if lm.has_mtp:
        h = lm.model.forward_train(tc)
        m = lm.model.logits(lm.model.mtp_train(h, tc)).float()
        h32 = hf[name].model(input_ids=toks, use_cache=False).last_hidden_state
        sd = load_file(str(tiny_ckpts[name] / "model.safetensors"))
        assert rel_err(m, reference_mtp_logits(sd, lm.args, h32, toks)) <= 2e-2


@pytest.mark.parametrize("k", [1, 2, 4, 10])
def test_topk_by_sort_is_topk_by_argmax(k):
    """The eager router's top-k (one stable sort) gives topk_by_argmax's values and ids, ties to
    the lower index included."""
    from strata.kernels.reference import topk_by_argmax, topk_by_sort

    g = torch.Generator().manual_seed(k)
    x = torch.softmax(torch.randn(37, 512, generator=g), -1)
    ties = torch.softmax(torch.randint(0, 3, (37, 512), generator=g).float(), -1)  # many ties
    for probs in (x, ties, torch.zeros(3, 16)):
        assert all(torch.equal(a, b) for a, b in zip(topk_by_sort(probs, k), topk_by_argmax(probs, k)))


@pytest.mark.parametrize("k", [1, 2, 4, 10])
def test_topk_by_argmax_matches_torch_topk(k):
    from strata.model.qwen3_next import topk_by_argmax

    g = torch.Generator().manual_seed(k)
    x = torch.softmax(torch.randn(37, 64, generator=g), -1)
    vals, idx = topk_by_argmax(x, k)
    ref_vals, ref_idx = torch.topk(x, k, dim=-1)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(vals, ref_vals)
