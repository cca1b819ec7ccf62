"""L2 prefetch of a decode window's weights (ops.l2_prefetch, cyext/src/strata_prefetch.cu).

A prefetch is a hint: it changes no value, so the tests check where the model issues it (after
a mixer's input projection: its output projection and the router; once the router has chosen:
the chosen experts' rows), that a compiled region keeps the call (an op with no result would be
dead code to it: the op declares a token written), that prompt chunks and level 0 issue none,
and that the tokens are the same at every level. On the CPU the op does nothing, so the tests
stand a recorder in for the GPU kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from strata.kernels import cyext_ops, ops, reference
from strata.model.qwen3_next import Qwen3Next
from strata.model.state import DecodeState
from strata.model.tiny import init_random, tiny_args

torch.set_num_threads(1)


def _model():
    ops.set_backend("auto", "cpu")
    args = tiny_args(num_hidden_layers=4, num_experts=64, num_experts_per_tok=4, eos_token_id=[0])
    model = init_random(Qwen3Next(args, with_mtp=True), seed=0).eval()
    model.fuse_for_inference(16)
    return args, model


def _window(model, args, level, monkeypatch, compiled: bool):
    """One 1 x 2 verify window and the MTP window after it, then a prompt chunk, with the
    model prefetching at `level` (through the custom op, as on the GPU); returns the calls
    the op received and the window's logits."""
    calls = []
    monkeypatch.setattr(ops, "l2_prefetch_level", lambda: level)
    monkeypatch.setattr(ops, "l2_prefetch", lambda token, tensors, ids=None:
                        torch.ops.strata.l2_prefetch(token, list(tensors), ids))
    monkeypatch.setattr(reference, "l2_prefetch", lambda token, tensors, ids=None: calls.append(
        ([t.data_ptr() for t in tensors], None if ids is None else ids.clone())))
    state = DecodeState(args, 2, 64, torch.float32, torch.device("cpu"), True, spare_rows=5)
    torch._dynamo.reset()
    if compiled:  # aot_eager: what drops an op with neither result nor mutation, as inductor does
        model.compile_regions(lambda f: torch.compile(f, backend="aot_eager", dynamic=None))
    try:
        with torch.no_grad():
            tokens = torch.tensor([[5, 9]])
            gs, gp = torch.tensor([0]), torch.tensor([3])
            hidden, logits, _, _ = model.verify_window(tokens, gs, gp, 64, state)
            model.mtp_window(hidden, tokens, gs, gp, 64, state, with_logits=False)
            window_calls = list(calls)
            model.prefill(torch.arange(6) + 1, 1, 0, state, length=torch.tensor([5]), ctx=32)
    finally:
        model.compile_regions(None, None)
    return window_calls, calls[len(window_calls):], logits


def _layers(model):
    return list(model.layers) + [model.mtp.layers[0]]


@pytest.mark.parametrize("compiled", [False, True])
def test_each_layer_prefetches_what_it_reads_next(monkeypatch, compiled):
    args, model = _model()
    window, prompt, _ = _window(model, args, 3, monkeypatch, compiled)
    assert prompt == [], "a prompt chunk issued prefetches"
    dense = [c for c in window if c[1] is None]
    experts = [c for c in window if c[1] is not None]
    layers = _layers(model)
    want = []
    for layer in layers:
        mixer = (layer.linear_attn.out_proj if layer.kind == "linear_attention"
                 else layer.self_attn.o_proj)
        want.append([mixer.weight.data_ptr(), layer.mlp.w_router.data_ptr()])
    assert sorted(c[0] for c in dense) == sorted(want)
    assert len(experts) == len(layers)
    stacks = [[m.mlp.experts.w_gate_up.data_ptr(), m.mlp.experts.w_down.data_ptr()]
              for m in layers]  # (the folded shared expert's stacks begin where these do)
    for ptrs, ids in experts:
        assert ptrs in stacks
        assert ids.shape[0] == 2  # the window's rows
        assert ids.min() >= 0 and ids.max() <= args.num_experts  # a folded shared expert is E


def test_levels_choose_what_is_prefetched(monkeypatch):
    args, model = _model()
    n = len(_layers(model))
    off, _, logits0 = _window(model, args, 0, monkeypatch, compiled=True)
    assert off == []
    one, _, logits1 = _window(model, args, 1, monkeypatch, compiled=True)
    assert len(one) == n and all(ids is None for _, ids in one)
    two, _, logits2 = _window(model, args, 2, monkeypatch, compiled=True)
    down = [c for c in two if c[1] is not None]
    assert len(down) == n and all(len(ptrs) == 1 for ptrs, _ in down)  # the down weights only
    three, _, logits3 = _window(model, args, 3, monkeypatch, compiled=True)
    assert sum(c[1] is not None for c in three) == n
    # a hint: the same values at every level
    for other in (logits1, logits2, logits3):
        assert torch.equal(other, logits0)


def test_prefetch_off_the_gpu_does_nothing():
    t = torch.arange(64, dtype=torch.float32)
    ops.set_backend("auto", "cpu")
    assert ops.l2_prefetch_level() == 0  # no CPU kernel: the model never calls it
    assert ops.l2_prefetch(torch.zeros(1, dtype=torch.int32), [t], None) is None
    assert torch.equal(t, torch.arange(64, dtype=torch.float32))


@pytest.mark.skipif(cyext_ops.gpu_platform() is None, reason="needs the GPU extension built")
def test_prefetch_level_is_checked():
    with pytest.raises(ValueError, match="l2_prefetch: 4 is not a level in 0..3"):
        cyext_ops.moe_launch_options(l2_prefetch=4)
    assert cyext_ops.moe_launch_options()["l2_prefetch"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_prefetch_changes_no_value_and_takes_its_inputs():
    """The kernel runs (captured in a graph too) and writes nothing; bad ids are skipped."""
    dev = torch.device("cuda")
    w = torch.randn(8, 128, 64, device=dev, dtype=torch.bfloat16)
    before = w.clone()
    token = torch.zeros(1, dtype=torch.int32, device=dev)
    ids = torch.tensor([[0, 7, 3], [-1, 8, 100]], device=dev)
    cyext_ops.gpu_l2_prefetch(token, [w], None)
    cyext_ops.gpu_l2_prefetch(token, [w, w[:4]], ids)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cyext_ops.gpu_l2_prefetch(token, [w], ids)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before) and int(token) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_prefetch_layouts_and_their_bad_grids():
    """Every layout (the default spread, the packed one, fewer pieces than threads) runs and
    writes nothing; a grid the kernel cannot take is a clear error."""
    dev = torch.device("cuda")
    w = torch.randn(4, 1 << 20, device=dev, dtype=torch.bfloat16)  # 512 pieces
    before = w.clone()
    ids = torch.tensor([3, 0, 9], device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    for ctas, threads in ((0, 0), (4, 128), (200, 32), (1, 32)):
        cyext_ops._gpu.l2_prefetch([w], None, stream, ctas, threads)
        cyext_ops._gpu.l2_prefetch([w], ids, stream, ctas, threads)
    torch.cuda.synchronize()
    assert torch.equal(w, before)
    for ctas, threads in ((-1, 0), (0, 48), (0, 256)):
        with pytest.raises(Exception, match="l2_prefetch"):
            cyext_ops._gpu.l2_prefetch([w], None, stream, ctas, threads)
