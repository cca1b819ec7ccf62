"""The MoE router op (ops.moe_route): the reference against the model's routing written out,
the model's use of it, and (marker `gpu`) the one-launch router kernel of
cyext/src/strata_router.cu against the reference: the same top-k ids and weights, ties to the
lower id, the folded shared expert's column, row independence, and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import gpu_kernel_test as _gpu

from strata.kernels import cyext_ops as C
from strata.kernels import reference as R



def router_case(m, H, E, shared=True, seed=0, device="cpu", exact=True):
    """x and a router weight (E + shared rows, padded to 8) whose products sum exactly in
    float32 in any order (x in {-1, 0, 1}, weights multiples of 2^-6 up to 1/8 in size): the
    kernel's logits then equal the reference's bit for bit."""
    g = torch.Generator().manual_seed(seed)
    rows = -(-(E + int(shared)) // 8) * 8
    if exact:
        x = torch.randint(-1, 2, (m, H), generator=g).float()
        w = torch.randint(-8, 9, (rows, H), generator=g).float() / 64
    else:
        x = torch.randn(m, H, generator=g)
        w = torch.randn(rows, H, generator=g) / H ** 0.5
    w[E + int(shared):] = 0
    return x.to(torch.bfloat16).to(device), w.to(torch.bfloat16).to(device)


def test_reference_is_the_models_routing():
    """moe_route = router matmul, softmax in float32, top-k by argmax, renormalised, plus the
    shared expert's sigmoid column: the sequence SparseMoe ran before the op existed."""
    x, w = router_case(5, 64, 40, exact=False)
    bias = torch.linspace(-1, 0, 40)
    weights, ids = R.moe_route(x, w, 40, 6, True, bias, shared_id=40)
    y = F.linear(x, w)
    probs = torch.softmax(y[:, :40].float() + bias, -1)
    v, i = R.topk_by_argmax(probs, 6)
    assert torch.equal(ids[:, :6], i) and torch.equal(weights[:, :6], v / v.sum(-1, keepdim=True))
    assert torch.equal(ids[:, 6], torch.full((5,), 40))
    assert torch.equal(weights[:, 6:], torch.sigmoid(y[:, 40:41].float()))
    w2, i2 = R.moe_route(x, w, 40, 6, False)  # no bias, no renormalisation, no shared expert
    v2, want_i2 = R.topk_by_argmax(torch.softmax(y[:, :40].float(), -1), 6)
    assert w2.shape == (5, 6) and torch.equal(i2, want_i2) and torch.equal(w2, v2)


def test_reference_ties_go_to_the_lower_id():
    x = torch.zeros(2, 16, dtype=torch.bfloat16)  # every logit 0: a tie over all experts
    w = torch.randn(24, 16).to(torch.bfloat16)
    weights, ids = R.moe_route(x, w, 20, 4, True, shared_id=-1)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    assert torch.allclose(weights, torch.full((2, 4), 0.25))


def test_reference_routes_alike_with_either_topk():
    """gpu_moe_route's eager fallback (prompt chunks) takes the top-k by one sort: the same ids
    and weights as the k rounds of max."""
    for m, E, k, shared, bias in ((40, 60, 4, True, False), (64, 512, 10, True, True),
                                  (33, 16, 16, False, False)):
        x, w = router_case(m, 256, E, shared, seed=m + E, exact=False)
        b = torch.linspace(-2, 0, E) if bias else None
        sid = E if shared else -1
        want = R.moe_route(x, w, E, k, True, b, sid)
        got = R.moe_route(x, w, E, k, True, b, sid, topk=R.topk_by_sort)
        assert all(torch.equal(a, c) for a, c in zip(got, want))


def test_custom_op_fake_shapes():
    if not hasattr(torch.ops, "strata") or not hasattr(torch.ops.strata, "moe_route"):
        pytest.skip("custom ops not registered on this torch")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        w, i = torch.ops.strata.moe_route(torch.empty(3, 64), torch.empty(48, 64), 40, 6, True,
                                          None, 40)
        assert w.shape == (3, 7) and w.dtype == torch.float32
        assert i.shape == (3, 7) and i.dtype == torch.int64
        w, i = torch.ops.strata.moe_route(torch.empty(3, 64), torch.empty(48, 64), 40, 6, True,
                                          None, -1)
        assert w.shape == (3, 6)


# ---------------------------------------------------------------------------------------------
# GPU kernel

ROUTE_CASES = [
    # m, H, E, k, norm, shared, bias
    (1, 2048, 512, 10, True, True, False),   # Qwen3-Next's router, one row
    (3, 2048, 512, 10, True, True, True),    # with model.dummy_routing_skew's bias
    (16, 2048, 512, 10, True, True, False),
    (32, 2048, 512, 10, False, False, False),
    (5, 256, 60, 4, True, True, False),      # E not a multiple of 32, one chunk per lane
    (7, 4096, 1024, 32, True, False, True),  # the largest the kernel takes
    (2, 72, 8, 8, True, True, False),        # k = E; H not a multiple of 256
]


@_gpu
@pytest.mark.parametrize("m,H,E,k,norm,shared,bias", ROUTE_CASES)
def test_gpu_route_matches_reference(m, H, E, k, norm, shared, bias):
    dev = torch.device("cuda")
    x, w = router_case(m, H, E, shared, seed=m + E, device=dev)
    b = torch.linspace(-2, 0, E, device=dev) if bias else None
    sid = E if shared else -1
    assert C.route_kernel_supported(x, w, E, k)
    got_w, got_i = C.gpu_moe_route(x, w, E, k, norm, b, sid)
    want_w, want_i = R.moe_route(x, w, E, k, norm, b, sid)
    assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_i, want_i)
    assert torch.allclose(got_w, want_w, rtol=2e-6, atol=1e-7)
    assert int(C._route_ticket(w).item()) == 0  # the kernel leaves its ticket as it found it


@_gpu
def test_gpu_route_random_weights_agree():
    """Random (inexact) bf16 inputs: the logits may differ from cuBLAS's in the last bf16 bit, so
    the ids agree on all but near-ties and the weights closely."""
    dev = torch.device("cuda")
    x, w = router_case(16, 2048, 512, True, seed=11, device=dev, exact=False)
    got_w, got_i = C.gpu_moe_route(x, w, 512, 10, True, None, 512)
    want_w, want_i = R.moe_route(x, w, 512, 10, True, None, 512)
    same = (got_i == want_i).float().mean().item()
    assert same >= 0.95
    rows = (got_i == want_i).all(1)
    assert torch.allclose(got_w[rows], want_w[rows], rtol=2e-2, atol=1e-4)


@_gpu
def test_gpu_route_ties_go_to_the_lower_id():
    dev = torch.device("cuda")
    x = torch.zeros(4, 2048, dtype=torch.bfloat16, device=dev)
    w = torch.randn(520, 2048, device=dev).to(torch.bfloat16)
    weights, ids = C.gpu_moe_route(x, w, 512, 10, True, None, 512)
    assert ids[:, :10].tolist() == [list(range(10))] * 4 and (ids[:, 10] == 512).all()
    assert torch.allclose(weights[:, :10], torch.full((4, 10), 0.1, device=dev))
    assert torch.allclose(weights[:, 10], torch.full((4,), 0.5, device=dev))


@_gpu
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gpu_route_one_lanes_experts_take_every_pick(m):
    """The kernel's warp keeps each lane's best three experts (lane l owns experts l, l + 32,
    ...) and rescans a lane's experts only when its three are taken: here lane 5's experts are
    the top 16 (logits 30, 29, 28, 28, 27, ... by id, one tie), so all ten picks come from one
    lane, through three rescans; the ids, ties and weights are the reference's."""
    dev = torch.device("cuda")
    H, E, k = 2048, 512, 10
    x = torch.ones(m, H, dtype=torch.bfloat16, device=dev)
    logit = torch.zeros(E + 1)
    for c in range(16):
        logit[5 + 32 * c] = 30 - c + (c >= 3)  # c = 2 and 3 tie at 28: the lower id first
    w = (logit / H)[:, None].expand(E + 1, H).to(torch.bfloat16).to(dev)  # x . w = the logit
    got_w, got_i = C.gpu_moe_route(x, w, E, k, True, None, E)
    want_w, want_i = R.moe_route(x, w, E, k, True, None, E)
    assert got_i[0, :k].tolist() == [5 + 32 * c for c in range(k)]
    assert torch.equal(got_i, want_i)
    assert torch.allclose(got_w, want_w, rtol=2e-6, atol=1e-7)


@_gpu
def test_gpu_route_rows_are_independent():
    """A row's ids and weights are the same bits alone, in a window, at any row count."""
    dev = torch.device("cuda")
    x, w = router_case(32, 2048, 512, True, seed=5, device=dev, exact=False)
    full_w, full_i = C.gpu_moe_route(x, w, 512, 10, True, None, 512)
    for rows in (1, 2, 3, 16, 17):
        part_w, part_i = C.gpu_moe_route(x[:rows].clone(), w, 512, 10, True, None, 512)
        assert torch.equal(part_w, full_w[:rows]) and torch.equal(part_i, full_i[:rows])
    one_w, one_i = C.gpu_moe_route(x[9:10].clone(), w, 512, 10, True, None, 512)
    assert torch.equal(one_w, full_w[9:10]) and torch.equal(one_i, full_i[9:10])


@_gpu
@pytest.mark.parametrize("rows", [33, 64, 100])
def test_gpu_route_chunks_on_the_kernel(rows):
    """route_chunks: a prompt chunk's rows route on the kernel, 32 a launch, each row the bits
    it has in a window of its own (rows are independent), eager and captured; off, the
    reference (exact inputs: the same ids and weights either way)."""
    dev = torch.device("cuda")
    x, w = router_case(rows, 2048, 512, True, seed=rows, device=dev, exact=False)
    saved = C.moe_launch_options()
    try:
        assert C.moe_launch_options(route_chunks=True)["route_chunks"]
        got_w, got_i = C.gpu_moe_route(x, w, 512, 10, True, None, 512)
        for r0 in range(0, rows, 32):
            part_w, part_i = C.gpu_moe_route(x[r0:r0 + 32].clone(), w, 512, 10, True, None, 512)
            assert torch.equal(got_w[r0:r0 + 32], part_w) and torch.equal(got_i[r0:r0 + 32], part_i)
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gw, gi = C.gpu_moe_route(static, w, 512, 10, True, None, 512)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gw, got_w) and torch.equal(gi, got_i)
        assert int(C._route_ticket(w).item()) == 0
        xe, we = router_case(rows, 256, 60, True, seed=3, device=dev)
        on = C.gpu_moe_route(xe, we, 60, 4, True, None, 60)
        C.moe_launch_options(route_chunks=False)
        off = C.gpu_moe_route(xe, we, 60, 4, True, None, 60)
    finally:
        C.moe_launch_options(**saved)
    assert torch.equal(on[1], off[1]) and torch.allclose(on[0], off[0], rtol=2e-6, atol=1e-7)


@_gpu
def test_gpu_route_in_a_graph():
    """Captured once, replayed with new x: the results follow x and match eager calls."""
    dev = torch.device("cuda")
    x, w = router_case(3, 2048, 512, True, seed=1, device=dev, exact=False)
    x2, _ = router_case(3, 2048, 512, True, seed=2, device=dev, exact=False)
    static = x.clone()
    C.gpu_moe_route(static, w, 512, 10, True, None, 512)  # the ticket exists before capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        gw, gi = C.gpu_moe_route(static, w, 512, 10, True, None, 512)
    torch.cuda.current_stream().wait_stream(s)
    for inp in (x, x2, x):
        static.copy_(inp)
        graph.replay()
        want_w, want_i = C.gpu_moe_route(inp, w, 512, 10, True, None, 512)
        torch.cuda.synchronize()
        assert torch.equal(gi, want_i) and torch.equal(gw, want_w)


@_gpu
def test_gpu_route_beyond_the_kernel_runs_the_reference():
    dev = torch.device("cuda")
    x, w = router_case(40, 256, 60, True, seed=3, device=dev)
    assert not C.route_kernel_supported(x, w, 60, 4)  # 40 rows: a prompt chunk
    got = C.gpu_moe_route(x, w, 60, 4, True, None, 60)
    want = R.moe_route(x, w, 60, 4, True, None, 60)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not C.route_kernel_supported(x[:4].float(), w.float(), 60, 4)  # float32: reference


@_gpu
def test_gpu_route_rejects_bad_inputs():
    dev = torch.device("cuda")
    x, w = router_case(2, 256, 60, True, device=dev)
    wt = torch.empty(2, 5, dtype=torch.float32, device=dev)
    it = torch.empty(2, 5, dtype=torch.int64, device=dev)
    lg = torch.empty(2 * 61, dtype=torch.float32, device=dev)
    tk = torch.zeros(1, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="w_router has 256 columns|columns"):
        C._gpu.moe_route(x, w[:, :128].contiguous(), 60, 4, True, None, 60, lg, wt, it, tk, 0)
    with pytest.raises(ValueError, match="weights must have shape"):
        C._gpu.moe_route(x, w, 60, 4, True, None, -1, lg, wt, it, tk, 0)
    with pytest.raises(ValueError, match="ticket"):
        C._gpu.moe_route(x, w, 60, 4, True, None, 60, lg, wt, it, tk.long(), 0)
    with pytest.raises(TypeError, match="bfloat16"):
        C._gpu.moe_route(x.float(), w, 60, 4, True, None, 60, lg, wt, it, tk, 0)


@_gpu
def test_gpu_modes_give_the_same_tokens_with_the_router_kernel(tmp_path, monkeypatch):
    """A bf16 model with 64 experts and a shared expert of their shape (folded, so the router
    kernel runs at every decode window): solo, plain batch and batch_mtp, graphs off and on,
    emit the same greedy tokens."""
    import random

    from conftest import cpu_engine_config, run_cohort

    from strata.engine.llm_engine import Engine
    from strata.engine.request import Request, SamplingParams
    from strata.kernels import ops
    from strata.model.tiny import make_tiny_random

    path = make_tiny_random(tmp_path / "m", seed=5, tokenizer=False, num_experts=64,
                            num_experts_per_tok=4, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16)
    calls = []
    real = C._gpu.moe_route
    monkeypatch.setattr(C._gpu, "moe_route", lambda *a: calls.append(a[0].shape[0]) or real(*a))

    def run(mode, graphs):
        cfg = cpu_engine_config(path, 128, mode="solo" if mode == "solo" else "batch",
                                batch_mtp=mode == "batch_mtp", slots=3, window_rows=6, spec=3,
                                prefill_chunk=4, graphs=graphs, compile="off")
        cfg.device, cfg.model.dtype, cfg.backend.name = "cuda", "bfloat16", "auto"
        eng = Engine.from_config(cfg, log=lambda s: None)
        try:
            assert ops.implementations()["moe_route"] == "cuda"
            rng = random.Random(11)
            run_cohort(eng, [Request(f"r{i}", [rng.randrange(1, 512) for _ in range(2 + 5 * i)],
                                     SamplingParams(max_tokens=10 + 2 * i, stop_at_eos=False),
                                     arrival_step=i) for i in range(3)], 1000)
            return {rid: list(rs.emitted) for rid, rs in eng.requests.items()}
        finally:
            eng.close()
            ops.set_backend("torch", "cpu")

    ref = run("solo", False)
    assert calls, "the router kernel never ran"
    for mode in ("solo", "batch", "batch_mtp"):
        for graphs in (False, True):
            if (mode, graphs) != ("solo", False):
                assert run(mode, graphs) == ref, (mode, graphs)
