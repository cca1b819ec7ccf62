"""Routed experts (moe_experts) and the FP8 linear (linear_fp8): the cyext kernels against
strata.kernels.reference.

CPU: the C++ twin (grouped by expert) with 64+ experts, 1 to 32 rows, experts chosen by many
rows and by none, tied routing weights, float32 / bf16 / FP8 weights with blocks smaller than
the dims (I not a multiple of bo), and row independence (a row's output bit-identical alone and
inside a batch). GPU (marker `gpu`): the CUDA/HIP kernels' parity, CUDA-graph capture replayed
with new expert ids, row independence.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from conftest import gpu_kernel_test as _gpu

from strata.kernels import cyext_ops as C
from strata.kernels import ops
from strata.kernels import reference as R

FP8 = getattr(torch, "float8_e4m3fn", None)

needs_cpu = pytest.mark.skipif(not C.cpu_available(), reason="strata_cpu extension not built")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def experts(E, H, I, wdtype, block=(32, 32), seed=0, device="cpu"):
    """(w_gate_up, w_down, gu_scale, down_scale) in wdtype; FP8 with random block scales."""
    gen = torch.Generator(device=device).manual_seed(seed)
    wgu = torch.randn(E, 2 * I, H, generator=gen, device=device) / math.sqrt(H)
    wd = torch.randn(E, H, I, generator=gen, device=device) / math.sqrt(I)
    if wdtype is not FP8:
        return wgu.to(wdtype), wd.to(wdtype), None, None
    bo, bi = block
    nbg = -(-I // bo)
    gs = torch.rand(E, 2 * nbg, -(-H // bi), generator=gen, device=device) * 0.02 + 0.005
    ds = torch.rand(E, -(-H // bo), -(-I // bi), generator=gen, device=device) * 0.02 + 0.005
    # quantise so that dequant(w) ~ the float weights (values up to ~2 in FP8 units x scale)
    wq = (wgu * 50).clamp(-440, 440).to(FP8)
    dq = (wd * 50).clamp(-440, 440).to(FP8)
    return wq, dq, gs, ds


def routing(N, k, E, seed=0, hot=None, tie=False, device="cpu"):
    """topk ids (distinct per row) and renormalised weights; `hot` experts are chosen by every
    row; `tie` gives every row equal weights."""
    gen = torch.Generator().manual_seed(seed + 1)
    rows = []
    for _ in range(N):
        perm = torch.randperm(E, generator=gen)
        if hot:
            perm = torch.cat([torch.tensor(hot), perm[~torch.isin(perm, torch.tensor(hot))]])
        rows.append(perm[:k])
    ids = torch.stack(rows)
    w = torch.full((N, k), 1.0 / k) if tie else torch.rand(N, k, generator=gen) + 0.05
    w = w / w.sum(-1, keepdim=True)
    return w.to(device), ids.to(device)


def call_reference(x, weights, w, ids, block):
    wgu, wd, gs, ds = weights
    return R.moe_experts(x, wgu, wd, w, ids, gs, ds, block if gs is not None else None)


# ---------------------------------------------------------------------------------------------
# CPU twin


CPU_CASES = [
    # E, H, I, N, k, wdtype, xdtype, block
    (64, 48, 40, 1, 4, torch.float32, torch.float32, None),
    (64, 64, 48, 5, 6, torch.bfloat16, torch.bfloat16, None),
    (96, 64, 48, 32, 8, torch.float32, torch.float32, None),
    (64, 64, 48, 7, 4, FP8, torch.bfloat16, (32, 16)),   # I = 48: not a multiple of bo = 32
    (64, 80, 40, 32, 10, FP8, torch.float32, (16, 32)),  # H = 80, I = 40 not multiples of bi
]


@needs_cpu
@pytest.mark.parametrize("E,H,I,N,k,wdtype,xdtype,block", CPU_CASES)
def test_cpu_moe_matches_reference(E, H, I, N, k, wdtype, xdtype, block):
    weights = experts(E, H, I, wdtype, block or (32, 32))
    w, ids = routing(N, k, E, hot=[3, 17] if N > 1 else None)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(5)).to(xdtype)
    got = C.cpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
    ref = call_reference(x, weights, w, ids, block)
    assert got.dtype == x.dtype and got.shape == (N, H)
    tol = 1e-5 if xdtype == torch.float32 else 1e-2
    assert rel_err(got, ref) < tol
    # experts nobody routes to exist (E >> N*k for small N, and never all at 32 rows)
    assert ids.unique().numel() < E


@needs_cpu
def test_cpu_moe_tied_weights_and_shared_experts():
    E, H, I, N, k = 64, 32, 32, 12, 4
    weights = experts(E, H, I, torch.float32)
    w, ids = routing(N, k, E, hot=[0, 1, 2, 3], tie=True)  # every row: the same 4 experts
    x = torch.randn(N, H)
    got = C.cpu_moe_experts(x, *weights[:2], w, ids)
    assert rel_err(got, call_reference(x, weights, w, ids, None)) < 1e-5


@needs_cpu
@pytest.mark.parametrize("wdtype,block", [(torch.float32, None), (torch.bfloat16, None),
                                          (FP8, (32, 16))])
def test_cpu_moe_row_independence(wdtype, block):
    """A row's output is bit-identical alone and inside batches of other rows."""
    E, H, I, k = 64, 64, 48, 6
    weights = experts(E, H, I, wdtype, block or (32, 32))
    xdtype = torch.bfloat16 if wdtype is not torch.float32 else torch.float32
    w, ids = routing(32, k, E, hot=[7])
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(9)).to(xdtype)
    full = C.cpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
    for r in (0, 13, 31):
        alone = C.cpu_moe_experts(x[r:r + 1], *weights[:2], w[r:r + 1], ids[r:r + 1],
                                  *weights[2:], block)
        assert torch.equal(alone[0], full[r])
    part = C.cpu_moe_experts(x[5:9], *weights[:2], w[5:9], ids[5:9], *weights[2:], block)
    assert torch.equal(part, full[5:9])


@pytest.mark.skipif(C._gpu is None, reason="the GPU extension is not built")
def test_moe_experts_rejects_a_bad_sync_buffer():
    """The fused kernel's per-layer counters (moe_experts(sync=)) must be int32 of
    moe_sync_ints() elements: anything else is a clear error before any launch."""
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    wgu = torch.zeros(4, 32, 64, dtype=torch.bfloat16)
    wd = torch.zeros(4, 64, 16, dtype=torch.bfloat16)
    w, ids = torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int64)
    ws = torch.empty(C._gpu.moe_workspace_numel(2, 2, 16))
    for bad in (torch.zeros(3, dtype=torch.int32),
                torch.zeros(C._gpu.moe_sync_ints(), dtype=torch.int64)):
        with pytest.raises(ValueError, match="sync must be int32"):
            C._gpu.moe_experts(x, wgu, wd, w, ids, None, None, 1, 1, torch.empty_like(x), ws,
                               0, sync=bad)


@needs_cpu
def test_cpu_moe_rejects_bad_inputs():
    weights = experts(8, 16, 16, torch.float32)
    w, ids = routing(2, 2, 8)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="topk_ids"):
        C.cpu_moe_experts(x, *weights[:2], w, ids + 8)
    with pytest.raises(ValueError, match="w_down"):
        C.cpu_moe_experts(x, weights[0], weights[1][:, :8], w, ids)
    fp8 = experts(8, 16, 16, FP8, (16, 16))
    with pytest.raises(ValueError, match="block"):
        C.cpu_moe_experts(x, *fp8[:2], w, ids, *fp8[2:], None)


@needs_cpu
@pytest.mark.parametrize("lead,O,I,block", [((1,), 40, 64, (32, 32)), ((3, 5), 72, 48, (16, 32))])
def test_cpu_linear_fp8_matches_reference(lead, O, I, block):
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(O, I, generator=gen) * 30).to(FP8)
    scale = torch.rand(-(-O // block[0]), -(-I // block[1]), generator=gen) * 0.01
    x = torch.randn(*lead, I, generator=gen).to(torch.bfloat16)
    got = C.cpu_linear_fp8(x, weight, scale, block)
    ref = R.linear_fp8(x, weight, scale, block)
    assert got.shape == (*lead, O) and got.dtype == x.dtype
    assert rel_err(got, ref) < 1e-2
    # rows are independent
    x2 = x.reshape(-1, I)
    one = C.cpu_linear_fp8(x2[-1:], weight, scale, block)
    assert torch.equal(one[0], got.reshape(-1, O)[-1])


@needs_cpu
def test_ops_dispatch_cpu_backend():
    try:
        ops.set_backend("cpu", "cpu")
        impl = ops.implementations()
        assert impl["moe_experts"] == "cpu" and impl["linear_fp8"] == "cpu"
        weights = experts(64, 32, 16, torch.float32)
        w, ids = routing(3, 4, 64)
        x = torch.randn(3, 32)
        got = ops.moe_experts(x, *weights[:2], w, ids)
        assert rel_err(got, call_reference(x, weights, w, ids, None)) < 1e-5
    finally:
        ops.set_backend("torch", "cpu")


def test_custom_op_fake_shapes():
    """torch.compile sees strata::moe_experts / strata::linear_fp8 with shape-correct fakes."""
    if not hasattr(torch.ops, "strata") or not hasattr(torch.ops.strata, "moe_experts"):
        pytest.skip("custom ops not registered on this torch")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(4, 32)
        y = torch.ops.strata.moe_experts(x, torch.empty(8, 32, 32), torch.empty(8, 32, 16),
                                         torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int64),
                                         None, None, None)
        assert y.shape == (4, 32)
        E = 8  # the expert cache's counting variant: slot table, host store, counters
        y = torch.ops.strata.moe_experts_counted(
            x, torch.empty(3, 32, 32), torch.empty(3, 32, 16), torch.empty(4, 2),
            torch.empty(4, 2, dtype=torch.int64), None, None, None,
            torch.empty(E, dtype=torch.int32), torch.empty(E, 32, 32), torch.empty(E, 32, 16),
            None, None, torch.empty(2, E), torch.empty(2 + 2 * E, dtype=torch.int32),
            torch.empty(1, dtype=torch.int32))
        assert y.shape == (4, 32)
        z = torch.ops.strata.linear_fp8(torch.empty(2, 3, 64), torch.empty(40, 64),
                                        torch.empty(2, 2), [32, 32])
        assert z.shape == (2, 3, 40)


def test_bench_switch_sets_name_real_launch_switches():
    """scripts/bench_kernels.py's MoE variants and linear forms (run only on a GPU) name only
    switches moe_launch_options takes, so a misspelt one fails here rather than in a device
    call."""
    import importlib.util
    import inspect
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels_switches", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    known = set(inspect.signature(C.moe_launch_options).parameters)
    for name, switches in {**bench.MOE_VARIANTS, **bench.LINEAR_FORMS}.items():
        assert set(switches) <= known, (name, set(switches) - known)
    assert bench.MOE_VARIANTS["stream-mma"]["gate_up_mma"]
    assert not bench.MOE_VARIANTS["stream"]["gate_up_mma"]


# ---------------------------------------------------------------------------------------------
# GPU kernels


GPU_CASES = [
    # E, H, I, N, k, wdtype, xdtype, block
    (64, 64, 48, 1, 4, torch.float32, torch.float32, None),
    (64, 128, 64, 3, 8, torch.bfloat16, torch.bfloat16, None),
    (512, 2048, 512, 2, 10, torch.bfloat16, torch.bfloat16, None),  # real shapes
    (512, 2048, 512, 32, 10, FP8, torch.bfloat16, (128, 128)),      # real shapes, FP8
    (64, 64, 48, 32, 10, FP8, torch.bfloat16, (32, 16)),            # I % bo != 0
    (96, 96, 80, 17, 6, FP8, torch.float32, (16, 32)),
    (64, 64, 32, 9, 4, torch.float16, torch.float16, None),
]


@_gpu
@pytest.mark.parametrize("E,H,I,N,k,wdtype,xdtype,block", GPU_CASES)
def test_gpu_moe_matches_reference(E, H, I, N, k, wdtype, xdtype, block):
    weights = experts(E, H, I, wdtype, block or (32, 32), device="cuda")
    w, ids = routing(N, k, E, hot=[1, 2] if N > 1 else None, device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(4)).to("cuda", xdtype)
    assert C.moe_kernel_supported(x, weights[0], k, block)
    got = C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
    ref = call_reference(x, weights, w, ids, block)
    tol = 1e-5 if xdtype == torch.float32 else 1e-2
    assert rel_err(got, ref) < tol


@_gpu
@pytest.mark.parametrize("wdtype,block", [(torch.bfloat16, None), (FP8, (128, 128))])
@pytest.mark.parametrize("prompt", [False, True], ids=["window", "prompt"])
def test_gpu_moe_row_independence(wdtype, block, prompt):
    """A row's result is the same bits whatever rows share its call and however many: alone,
    in 8, 32, 35 (launches of 32 or one wide launch) and 400 rows (several wide launches), for
    a decode window's rows and for a prompt chunk's (FP8 prompt rows take the tensor-core down
    kernel on sm_90+, at every row count)."""
    E, H, I, k = 512, 2048, 512, 10
    weights = experts(E, H, I, wdtype, block or (32, 32), device="cuda")
    w, ids = routing(400, k, E, hot=[5, 6, 7], device="cuda")
    x = torch.randn(400, H, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    run = lambda a, b: C.gpu_moe_experts(x[a:b], *weights[:2], w[a:b], ids[a:b], *weights[2:],  # noqa: E731
                                         block, prompt=prompt)
    full = run(0, 32)
    for r in (0, 11, 31):
        assert torch.equal(run(r, r + 1)[0], full[r])
    assert torch.equal(run(4, 12), full[4:12])
    assert torch.equal(run(0, 35)[:32], full)
    many = run(0, 400)
    assert torch.equal(many[:32], full) and torch.equal(many[200:216], run(200, 216))


@_gpu
@pytest.mark.parametrize("wdtype,block", [(torch.bfloat16, None), (FP8, (128, 128))])
def test_gpu_moe_graph_replay_new_ids(wdtype, block):
    E, H, I, N, k = 128, 256, 128, 4, 6
    weights = experts(E, H, I, wdtype, block or (32, 32), device="cuda")
    w, ids = routing(N, k, E, seed=1, device="cuda")
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    ws = torch.empty(C.moe_workspace_numel(N, k, I), device="cuda")
    C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block, out=out, workspace=ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block, out=out, workspace=ws)
    for seed in (2, 3):
        w2, ids2 = routing(N, k, E, seed=seed, hot=[9] if seed == 3 else None, device="cuda")
        w.copy_(w2)
        ids.copy_(ids2)
        x.copy_(torch.randn(N, H, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        ref = call_reference(x, weights, w, ids, block)
        assert rel_err(out, ref) < 1e-2
        assert torch.equal(out, C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block))


@_gpu
@pytest.mark.parametrize("wdtype,block", [(torch.bfloat16, None), (FP8, (128, 128))])
@pytest.mark.parametrize("N", [1, 3, 8, 32])
def test_gpu_moe_launch_variants_same_bits(wdtype, block, N):
    """The launch switches (the streamed kernels, programmatic dependent launch of the down
    kernel, early weight loads, two features per gate/up warp, double-buffered down loads, x in
    shared memory) change when and where loads are issued, never what is summed: the same
    bits, captured too."""
    E, H, I, k = 512, 2048, 512, 11
    weights = experts(E, H, I, wdtype, block or (32, 32), device="cuda")
    w, ids = routing(N, k, E, hot=[3, 4] if N > 1 else None, device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(8)).to("cuda", torch.bfloat16)
    saved = C.moe_launch_options()
    try:
        outs = []
        for pdl, early, wide, db, xsmem, stream in (
                (False, False, False, False, False, False), (True, False, False, False, False, False),
                (False, True, False, False, False, False), (False, False, True, False, False, False),
                (True, True, True, False, False, False), (False, False, False, True, False, False),
                (False, False, False, False, True, False), (True, True, False, True, True, False),
                (True, True, True, True, True, False), (False, False, False, False, False, True),
                (True, True, False, True, True, True)):
            C.moe_launch_options(pdl=pdl, early=early, wide=wide, db=db, xsmem=xsmem,
                                 stream=stream, stream_all=stream, gate_up_mma=False)
            outs.append(C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block))
            out = torch.empty_like(x)
            ws = torch.empty(C.moe_workspace_numel(N, k, I), device="cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block, out=out,
                                  workspace=ws)
            graph.replay()
            torch.cuda.synchronize()
            outs.append(out.clone())
    finally:
        C.moe_launch_options(**saved)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert rel_err(outs[0], call_reference(x, weights, w, ids, block)) < 1e-2


@_gpu
@pytest.mark.parametrize("N,wdtype",
                         [(2, FP8), (3, FP8), (16, FP8), (32, FP8), (16, torch.bfloat16)])
def test_gpu_moe_down_split_same_bits(N, wdtype):
    """The streamed down kernel's items of at most a few members each (down_split, at its
    default run length and at 1, 3 and 8 members a run) compute every member's sums as one item
    per expert does: the same bits with hot experts (every row a member) and ids repeated
    within rows, and in a graph replayed with new ids."""
    E, H, I, k = 513, 2048, 512, 11
    block = (128, 128) if wdtype == FP8 else None
    weights = experts(E, H, I, wdtype, (128, 128), device="cuda")
    w, ids = routing(N, k, E, hot=[3, 512], device="cuda")
    ids[:, 2] = ids[:, 0]  # an id twice in a row
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    saved = C.moe_launch_options()
    try:
        outs = []
        for split, runs in ((False, 0), (True, 0), (True, 1), (True, 3), (True, 8)):
            C.moe_launch_options(stream=True, stream_all=True, down_split=split,
                                 down_split_runs=runs)
            outs.append(C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block))
            outs.append(_replay_with_new_ids(x, weights, w.clone(), ids.clone(), block, seed=4))
    finally:
        C.moe_launch_options(**saved)
    assert all(torch.equal(outs[0], o) for o in outs[2::2])
    assert all(torch.equal(outs[1], o) for o in outs[3::2])
    assert rel_err(outs[0], call_reference(x, weights, w, ids, block)) < 2e-2


@_gpu
@pytest.mark.parametrize("N", [1, 2, 3, 4, 8, 16])
def test_gpu_moe_fused_same_bits(N):
    """The fused grid (moe_launch_options(fused=True): a window's gate/up and down in one
    launch, each down item waiting for its own expert's act) sums what the two kernels sum: the
    same bits with hot experts (every row a member) and an id twice in a row, launch after
    launch (each leaves the per-layer counters zero for the next), and in a graph replayed with
    new ids. Prompt rows keep the two kernels."""
    E, H, I, k = 513, 2048, 512, 11
    block = (128, 128)
    weights = experts(E, H, I, FP8, block, device="cuda")
    w, ids = routing(N, k, E, hot=[3, 512], device="cuda")
    ids[:, 2] = ids[:, 0]
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    sync = C._moe_sync(weights[0])
    with _launch_options(fused=False):
        two = C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
        two_replay = _replay_with_new_ids(x, weights, w.clone(), ids.clone(), block, seed=4)
    with _launch_options(fused=True):
        fused = [C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
                 for _ in range(3)]
        torch.cuda.synchronize()
        assert not sync.any(), "a fused launch left its counters set"
        fused_replay = _replay_with_new_ids(x, weights, w.clone(), ids.clone(), block, seed=4)
        fused_again = C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
    assert all(torch.equal(two, f) for f in fused + [fused_again])
    assert torch.equal(two_replay, fused_replay)
    assert not sync.any()
    assert rel_err(two, call_reference(x, weights, w, ids, block)) < 2e-2
    if torch.cuda.get_device_properties(0).multi_processor_count >= H // 16:
        with _launch_options(fused=True), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
            torch.cuda.synchronize()
        names = " ".join(e.name for e in prof.events())
        assert "moe_fused_mma" in names and "moe_down_stream" not in names


@_gpu
@pytest.mark.parametrize("N", [17, 40, 64])
def test_gpu_moe_fp8_launches_of_16_rows_same_bits(N):
    """FP8 weights launch 16 rows at a time (fp8_launch16), 32 without: rows are independent, so
    a prompt chunk's rows are the same bits either way, eager and captured."""
    E, H, I, k = 513, 2048, 512, 11
    weights = experts(E, H, I, FP8, (128, 128), device="cuda")
    w, ids = routing(N, k, E, hot=[512], device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    saved = C.moe_launch_options()
    try:
        outs = []
        for on in (True, False):
            assert C.moe_launch_options(fp8_launch16=on)["fp8_launch16"] is on
            outs.append(C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128)))
            outs.append(_replay_with_new_ids(x, weights, w.clone(), ids.clone(), (128, 128), 6))
    finally:
        C.moe_launch_options(**saved)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert rel_err(outs[0], call_reference(x, weights, w, ids, (128, 128))) < 2e-2


@_gpu
@pytest.mark.parametrize("N,E,k", [(17, 513, 11), (40, 513, 11), (64, 513, 11), (100, 513, 11),
                                   (64, 1024, 16)])
@pytest.mark.parametrize("wide_rows", [64, 128])
@pytest.mark.parametrize("runs", [False, True])
def test_gpu_moe_fp8_wide_launches_same_bits(N, E, k, wide_rows, runs):
    """fp8_wide launches up to 64 rows at once, x staged in global memory: every row the same
    bits as in 16-row launches, eager and captured with new ids, with an expert every row routes
    to (the folded shared expert) and, at 1,024 pairs over 1,024 experts, more distinct experts
    than the kernels' threads (two per thread in the scans)."""
    H, I = 2048, 512
    weights = experts(E, H, I, FP8, (128, 128), device="cuda")
    w, ids = routing(N, k, E, hot=[E - 1], device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    saved = C.moe_launch_options()
    try:
        C.moe_launch_options(fp8_wide=False, fp8_launch16=True)
        run = lambda prompt: C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:],  # noqa: E731
                                               (128, 128), prompt=prompt)
        want, want_prompt = run(False), run(True)
        want_replay = _replay_with_new_ids(x, weights, w.clone(), ids.clone(), (128, 128), 8)
        assert C.moe_launch_options(fp8_wide=True, wide_rows=wide_rows,
                                    gate_up_runs=runs)["fp8_wide"]
        assert C._gpu.moe_wide_takes(min(N, wide_rows), k, E, H, I, 128, 128, 0)
        got, got_prompt = run(False), run(True)
        got_replay = _replay_with_new_ids(x, weights, w.clone(), ids.clone(), (128, 128), 8)
    finally:
        C.moe_launch_options(**saved)
    assert torch.equal(got, want) and torch.equal(got_replay, want_replay)
    assert torch.equal(got_prompt, want_prompt)  # a prompt chunk's rows too
    assert rel_err(got, call_reference(x, weights, w, ids, (128, 128))) < 2e-2


@_gpu
@pytest.mark.parametrize("N,E,k,wide_rows", [
    (128, 513, 11, 128), (300, 513, 11, 128), (120, 1024, 13, 128),
    (256, 513, 11, 256), (512, 513, 11, 512), (600, 513, 11, 512), (300, 1024, 13, 512),
    (160, 64, 16, 256)])
@pytest.mark.parametrize("runs", [False, True])
def test_gpu_moe_fp8_wide_launches_of_128_rows_and_more(N, E, k, wide_rows, runs):
    """Launches of up to wide_rows rows give every row the bits of 16-row launches, for a decode
    window's rows and a prompt chunk's, eager and captured with new ids; the launch is taken
    wide. wide_rows=128: 1,408 pairs at top-11 (three per thread in the block scans), 1,560 at
    top-13 over 1,024 experts (more distinct experts than threads). Above 1,632 pairs a launch
    is "big" (the down kernel's results in the workspace, up to eleven pairs per thread, leader
    and item tables sized by the experts): 512 rows at top-11 (5,632 pairs, an eight-slot
    prompt chunk), a launch and its remainder (600 rows), 1,024 experts at top-13, and few
    experts of many members each (64 at top-16: 40 members an expert, runs of 16 in the down
    kernel). runs: the gate/up in member runs of 16 with their x in shared memory
    (gate_up_runs; the folded shared expert's members many runs), and in big launches the
    tensor-core down kernel so too (moe_down_runs and its combine), really taken."""
    H, I = 2048, 512
    weights = experts(E, H, I, FP8, (128, 128), device="cuda")
    w, ids = routing(N, k, E, hot=[E - 1], device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(7)).to("cuda", torch.bfloat16)
    run = lambda prompt: C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:],  # noqa: E731
                                           (128, 128), prompt=prompt)
    with _launch_options(fp8_wide=False, fp8_launch16=True):
        want = [run(False), run(True)]
        want_replay = _replay_with_new_ids(x, weights, w.clone(), ids.clone(), (128, 128), 8,
                                           prompt=True)
    with _launch_options(fp8_wide=True, wide_rows=wide_rows, gate_up_runs=runs):
        assert C._gpu.moe_wide_takes(min(N, wide_rows), k, E, H, I, 128, 128, 0)
        got = [run(False), run(True)]
        got_replay = _replay_with_new_ids(x, weights, w.clone(), ids.clone(), (128, 128), 8,
                                          prompt=True)
        # every workspace value the launches read was written by them: a workspace of NaN (a
        # reused one can hold an earlier call's act, right by chance)
        ws = torch.full((C.moe_workspace_numel(N, k, I, H),), float("nan"), device="cuda")
        fresh = C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128),
                                  workspace=ws, prompt=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(True)
            torch.cuda.synchronize()
    assert torch.equal(fresh, want[1])
    names = " ".join(e.name for e in prof.events())
    assert ("moe_gate_up_runs" in names) is runs and ("moe_gate_up_mma" in names) is not runs
    big = min(N, wide_rows) * k > 1632  # (MOE_WIDE_SMEM_PAIRS: its down results in the workspace)
    assert ("moe_down_runs" in names) is (runs and big)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got_replay, want_replay)
    assert rel_err(got[1], call_reference(x, weights, w, ids, (128, 128))) < 2e-2


@_gpu
@pytest.mark.parametrize("runs", [False, True])
def test_gpu_moe_fp8_wide_launch_expert_of_more_members_than_rows(runs):
    """A wide launch whose rows repeat an id (three picks of expert 5 in each of 40 rows: 120
    members) finds all of that expert's members in one table run (gate_up_runs: in eight runs
    of 16): the bits of 16-row launches (the CUDA-core down kernel in both) and within the
    reference's tolerance."""
    E, H, I, N, k, block = 64, 2048, 512, 40, 12, (128, 128)
    weights = experts(E, H, I, FP8, block, device="cuda")
    w, ids = routing(N, k, E, device="cuda")
    ids[:, :3] = 5
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    run = lambda: C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)  # noqa: E731
    with _launch_options(fp8_wide=False, fp8_launch16=True):
        want = run()
    with _launch_options(fp8_wide=True, down_mma=False, gate_up_runs=runs):
        assert C._gpu.moe_wide_takes(N, k, E, H, I, 128, 128, 0)
        got = run()
    assert torch.equal(got, want)
    assert rel_err(got, call_reference(x, weights, w, ids, block)) < 2e-2


@_gpu
def test_gpu_moe_more_than_32_rows_without_the_wide_path_is_a_clear_error():
    E, H, I, k = 64, 256, 128, 4
    weights = experts(E, H, I, torch.bfloat16, None, device="cuda")
    w, ids = routing(40, k, E, device="cuda")
    x = torch.randn(40, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    ws = torch.empty(C.moe_workspace_numel(40, k, I, H) * 4, device="cuda")
    with pytest.raises((RuntimeError, ValueError), match="moe_experts"):
        C._gpu.moe_experts(x, *weights[:2], w, ids, None, None, 1, 1, out, ws, 0)


@_gpu
@pytest.mark.parametrize("N", [1, 2, 16])
def test_gpu_router_then_experts_with_gate_up_pdl(N):
    """The router kernel then the streamed experts, captured together as in a decode window:
    with the gate/up kernel launched as the router's programmatic dependent (gate_up_pdl), the
    experts wait for the router's ids, so every replay with new x gives the bits of the plain
    launches."""
    E, H, I, k = 512, 2048, 512, 10
    weights = experts(E + 1, H, I, FP8, (128, 128), device="cuda")
    gen = torch.Generator().manual_seed(21)
    w_router = (torch.randn(E + 8, H, generator=gen) / H ** 0.5).to("cuda", torch.bfloat16)
    xs = [torch.randn(N, H, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]

    def window(x):
        w, ids = C.gpu_moe_route(x, w_router, E, k, True, None, E)
        return C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128))

    saved = C.moe_launch_options()
    try:
        C.moe_launch_options(stream=True, gate_up_pdl=False)
        want = [window(x) for x in xs]
        C.moe_launch_options(gate_up_pdl=True)
        assert all(torch.equal(window(x), o) for x, o in zip(xs, want))
        static = xs[0].clone()
        window(static)  # the router's ticket exists before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = window(static)
        for _ in range(2):
            for x, o in zip(xs, want):
                static.copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, o)
    finally:
        C.moe_launch_options(**saved)


def _replay_with_new_ids(x, weights, w, ids, block, seed, prompt=False):
    """moe_experts captured in a graph, then w and ids replaced in place by another routing
    (`seed`) and the graph replayed: its output."""
    (N, k), E = ids.shape, weights[0].shape[0]
    out = torch.full_like(x, float("nan"))
    ws = torch.empty(C.moe_workspace_numel(N, k, weights[1].shape[2], x.shape[-1]), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block, out=out, workspace=ws,
                          prompt=prompt)
    w2, ids2 = routing(N, k, E, seed=seed, device="cuda")
    w.copy_(w2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    return out


@_gpu
@pytest.mark.parametrize("E,H,I,N,k,wdtype,xdtype,block",
                         [c for c in GPU_CASES if c[5] in (torch.bfloat16, FP8)]
                         + [(513, 2048, 512, 16, 11, FP8, torch.bfloat16, (128, 128)),
                            (256, 1024, 768, 5, 8, torch.bfloat16, torch.bfloat16, None),
                            (64, 4096, 256, 4, 6, FP8, torch.bfloat16, (128, 128))])
def test_gpu_moe_stream_same_bits_as_per_block(E, H, I, N, k, wdtype, xdtype, block):
    """The streamed kernels (sm_90+) compute the per-block kernels' dot products in their
    order: the same bits at every shape they take, hot experts (many members) and experts of
    one member alike, and inside a captured graph with new ids."""
    weights = experts(E, H, I, wdtype, block or (32, 32), device="cuda")
    w, ids = routing(N, k, E, hot=[1, 2] if N > 1 else None, device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(5)).to("cuda", xdtype)
    saved = C.moe_launch_options()
    try:
        C.moe_launch_options(stream=False)
        per_block = C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
        C.moe_launch_options(stream=True, stream_all=True, gate_up_mma=False)
        streamed = C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
        out = _replay_with_new_ids(x, weights, w, ids, block, seed=7)
        C.moe_launch_options(stream=False)
        per_block2 = C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
    finally:
        C.moe_launch_options(**saved)
    assert torch.equal(streamed, per_block)
    assert torch.equal(out, per_block2)
    tol = 1e-5 if xdtype == torch.float32 else 1e-2
    assert rel_err(out, call_reference(x, weights, w, ids, block)) < tol


def _stream_capable():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0) \
        and torch.version.hip is None


#: the gate/up kernel on tensor cores: real shapes at 1-32 rows (hot experts: past 16 members
#: two passes of the MMA's 16 rows), the folded shared expert's E = 513, H = 4096 (32 blocks
#: of scales per row), H = 1024 with I = 192
MMA_CASES = [
    # E, H, I, N, k
    (512, 2048, 512, 1, 10), (512, 2048, 512, 2, 10), (512, 2048, 512, 16, 10),
    (512, 2048, 512, 32, 10), (513, 2048, 512, 16, 11), (64, 4096, 256, 4, 6),
    (64, 1024, 192, 9, 8),
]


@_gpu
@pytest.mark.skipif(not _stream_capable(), reason="needs sm_90+ (CUDA)")
@pytest.mark.parametrize("E,H,I,N,k", MMA_CASES)
def test_gpu_moe_gate_up_mma(E, H, I, N, k):
    """gate/up on tensor cores (gate_up_mma): within the reference's tolerance, other bits than
    the CUDA-core kernels (so the switch did take it), every row the same bits alone, in a
    slice or in the whole window, and inside a captured graph with new ids."""
    block = (128, 128)
    weights = experts(E, H, I, FP8, block, device="cuda")
    w, ids = routing(N, k, E, hot=[1, 2] if N > 1 else None, device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(8)).to("cuda", torch.bfloat16)
    x[0, :7] *= 300.0  # a row whose largest elements lie far above the rest
    w0, ids0 = w.clone(), ids.clone()
    run = lambda a, ww, ii: C.gpu_moe_experts(a, *weights[:2], ww, ii, *weights[2:], block)
    with _launch_options(stream=False):
        per_block = run(x, w, ids)
    with _launch_options(stream=True, stream_all=True, gate_up_mma=True):
        got = run(x, w, ids)
        for r in sorted({0, N // 2, N - 1}):
            assert torch.equal(run(x[r:r + 1], w[r:r + 1], ids[r:r + 1])[0], got[r])
        if N > 2:
            assert torch.equal(run(x[1:N - 1], w[1:N - 1], ids[1:N - 1]), got[1:N - 1])
        out = _replay_with_new_ids(x, weights, w, ids, block, seed=9)
        again = run(x, w, ids)
    assert rel_err(got, call_reference(x, weights, w0, ids0, block)) < 1e-2
    assert torch.equal(out, again)
    assert rel_err(again, call_reference(x, weights, w, ids, block)) < 1e-2
    assert not torch.equal(got, per_block)


@_gpu
@pytest.mark.skipif(not _stream_capable(), reason="needs sm_90+ (CUDA)")
def test_gpu_moe_gate_up_mma_expert_of_many_members():
    """Ids repeated within rows give an expert more than 32 members (its members taken 32 at a
    time): within the reference's tolerance, and each row the same bits alone."""
    E, H, I, N, k, block = 64, 2048, 512, 12, 8, (128, 128)
    weights = experts(E, H, I, FP8, block, device="cuda")
    w, ids = routing(N, k, E, device="cuda")
    ids[:, :4] = 5  # 48 members of expert 5, four per row
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    with _launch_options(stream=True, stream_all=True, gate_up_mma=True):
        got = C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block)
        one = C.gpu_moe_experts(x[7:8], *weights[:2], w[7:8], ids[7:8], *weights[2:], block)
    assert torch.equal(one[0], got[7])
    assert rel_err(got, call_reference(x, weights, w, ids, block)) < 1e-2


#: E, H, I, N, k for the tensor-core down kernel (a prompt chunk's rows): wide launches of
#: 33-64 rows, and 1, 2 and 16 rows (not wide)
DOWN_MMA_CASES = [(513, 2048, 512, 64, 11), (512, 2048, 512, 40, 10), (64, 1024, 192, 33, 8),
                  (64, 4096, 256, 48, 6), (513, 2048, 512, 16, 11), (64, 1024, 192, 2, 8),
                  (513, 2048, 512, 1, 11)]


@_gpu
@pytest.mark.skipif(not _stream_capable(), reason="needs sm_90+ (CUDA)")
@pytest.mark.parametrize("E,H,I,N,k", DOWN_MMA_CASES)
@pytest.mark.parametrize("split", [True, False])
def test_gpu_moe_down_mma(E, H, I, N, k, split):
    """The down kernel on tensor cores (down_mma) for a prompt chunk's rows: within the
    reference's tolerance, other bits than the CUDA-core down kernel (so the switch did take
    it), every row the same bits in the whole launch, in its last rows alone and inside a
    captured graph with new ids; a decode window's rows keep the CUDA-core bits at any size.
    `split`: items from the member tables (runs of 16), else whole experts found by ballots."""
    block = (128, 128)
    weights = experts(E, H, I, FP8, block, device="cuda")
    w, ids = routing(N, k, E, hot=[1, 2] if N > 1 else None, device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(8)).to("cuda", torch.bfloat16)
    x[0, :7] *= 300.0  # a row whose largest elements lie far above the rest
    w0, ids0 = w.clone(), ids.clone()
    run = lambda a, ww, ii, prompt=True: C.gpu_moe_experts(  # noqa: E731
        a, *weights[:2], ww, ii, *weights[2:], block, prompt=prompt)
    with _launch_options(fp8_wide=True, down_split=split, down_mma=False):
        assert N <= 16 or C._gpu.moe_wide_takes(N, k, E, H, I, 128, 128, 0)
        cuda_cores = run(x, w, ids)
    with _launch_options(fp8_wide=True, down_split=split, down_mma=True):
        got = run(x, w, ids)
        lo = N // 2  # the last rows alone
        assert torch.equal(run(x[lo:], w[lo:], ids[lo:]), got[lo:])
        assert torch.equal(run(x, w, ids, prompt=False), cuda_cores)  # a window's rows
        out = _replay_with_new_ids(x, weights, w, ids, block, seed=9, prompt=True)
        again = run(x, w, ids)
    assert rel_err(got, call_reference(x, weights, w0, ids0, block)) < 1e-2
    assert torch.equal(out, again)
    assert rel_err(again, call_reference(x, weights, w, ids, block)) < 1e-2
    assert not torch.equal(got, cuda_cores)
    assert rel_err(got, cuda_cores) < 2e-3


@_gpu
@pytest.mark.skipif(not _stream_capable(), reason="needs sm_90+ (CUDA)")
def test_gpu_moe_down_mma_expert_of_many_members():
    """An expert chosen twice by some rows (53 members in 40 rows), so the tensor-core down
    kernel takes it in four items of up to 16: within the reference's tolerance, and each row
    the same bits in a 33-row slice (a prompt chunk's rows). (A wide launch's gate/up finds an
    expert's members in one table run however many.)"""
    E, H, I, N, k, block = 64, 2048, 512, 40, 12, (128, 128)
    weights = experts(E, H, I, FP8, block, device="cuda")
    w, ids = routing(N, k, E, device="cuda")
    ids[:, 0] = 5
    ids[:13, 1] = 5
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    with _launch_options(fp8_wide=True, down_mma=True):
        got = C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], block, prompt=True)
        some = C.gpu_moe_experts(x[5:38], *weights[:2], w[5:38], ids[5:38], *weights[2:], block,
                                 prompt=True)
    assert torch.equal(some, got[5:38])
    assert rel_err(got, call_reference(x, weights, w, ids, block)) < 1e-2


LINEAR_CASES = [
    # rows, O, I, block
    (1, 1024, 2048, (128, 128)),
    (5, 2048, 4096, (128, 128)),
    (32, 12288, 2048, (128, 128)),
    (7, 72, 48, (16, 16)),
    (40, 256, 128, (128, 128)),  # > 32 rows: reference fallback
]


@_gpu
@pytest.mark.parametrize("rows,O,I,block", LINEAR_CASES)
def test_gpu_linear_fp8(rows, O, I, block):
    gen = torch.Generator().manual_seed(6)
    weight = (torch.randn(O, I, generator=gen) * 30).to(FP8).cuda()
    scale = (torch.rand(-(-O // block[0]), -(-I // block[1]), generator=gen) * 0.01).cuda()
    x = torch.randn(rows, I, generator=gen).to("cuda", torch.bfloat16)
    got = C.gpu_linear_fp8(x, weight, scale, block)
    ref = R.linear_fp8(x, weight, scale, block)
    assert got.shape == (rows, O)
    assert rel_err(got, ref) < 1e-2
    if rows <= 32:
        one = C.gpu_linear_fp8(x[rows - 1:], weight, scale, block)
        assert torch.equal(one[0], got[-1])


STREAM_CASES = [
    # rows, O, I: a decode row, DeltaNet's in_proj_ba, out_proj at 16 and 17 rows (two
    # launches), a prompt chunk, the 80B models' LM head as an FP8 draft head
    # (engine.draft_head=fp8: 151,936 rows, 18,992 tiles)
    (1, 12288, 2048), (2, 64, 2048), (16, 2048, 4096), (17, 2048, 4096), (100, 1024, 2048),
    (4, 151936, 2048),
]


@contextlib.contextmanager
def _launch_options(**switches):
    """moe_launch_options(**switches) inside the block, the switches before restored after."""
    saved = C.moe_launch_options()
    try:
        C.moe_launch_options(**switches)
        yield
    finally:
        C.moe_launch_options(**saved)


#: the streamed FP8 linear's forms: unsplit (a tile per warp group), split (each tile's k over
#: all warps), split in pairs (two tiles per warp step: the split form's bits), each split form
#: on f16 operands (x scaled per row into f16)
LINEAR_FORMS = {"unsplit": dict(linear_split=False),
                "split": dict(linear_split=True, linear_split_pair=False),
                "split_pair": dict(linear_split=True, linear_split_pair=True),
                "split_f16": dict(linear_split=True, linear_split_pair=False, linear_f16=True),
                "split_pair_f16": dict(linear_split=True, linear_split_pair=True, linear_f16=True)}


@_gpu
@pytest.mark.parametrize("form", LINEAR_FORMS)
@pytest.mark.parametrize("rows,O,I", STREAM_CASES)
def test_gpu_linear_fp8_streamed(rows, O, I, form):
    """The streamed tensor-core kernel, in each form: close to the reference, and each row
    the same bits alone as in the batch (any row count, chunks of 16 included)."""
    if not _stream_capable():
        pytest.skip("the streamed FP8 linear needs sm_90+ (CUDA)")
    with _launch_options(**LINEAR_FORMS[form]):
        _check_linear_fp8_streamed(rows, O, I)


@_gpu
@pytest.mark.parametrize("O,I", [(12288, 2048), (2048, 4096), (1032, 2048), (8, 8192)])
def test_gpu_linear_fp8_split_pairs_same_bits(O, I):
    """The split form in pairs gives its bits taking one tile per step, with an odd number of
    tiles per CTA (the last one alone), any ring depth, at 1-40 rows."""
    if not _stream_capable():
        pytest.skip("the streamed FP8 linear needs sm_90+ (CUDA)")
    gen = torch.Generator().manual_seed(O + I)
    weight = (torch.randn(O, I, generator=gen) * 30).to(FP8).cuda()
    scale = (torch.rand(-(-O // 128), I // 128, generator=gen) * 0.01).cuda()
    for rows in (1, 5, 8, 9, 16, 40):
        x = torch.randn(rows, I, generator=gen).to("cuda", torch.bfloat16)
        if not C._gpu.linear_stream_takes(x, weight, 128, 128):
            continue
        got = {}
        for pair in (False, True):
            for depth in (0, 2, 3):
                with _launch_options(linear_split=True, linear_split_pair=pair,
                                     linear_split_depth=depth):
                    got[pair, depth] = C.gpu_linear_fp8(x, weight, scale, (128, 128))
        want = got[False, 0]
        assert all(torch.equal(v, want) for v in got.values()), rows


@_gpu
@pytest.mark.parametrize("O,I", [(12288, 2048), (2048, 4096)])
def test_gpu_linear_fp8_f16_operands(O, I):
    """The split form on f16 operands: x's rows scaled by powers of two into f16 give the bf16
    operands' bits where every element is within f16's range of its row's largest (rows of
    ordinary activations, rows scaled by 2^-60 and 2^40); a row with elements far below its
    largest is still close to the reference; zero rows give zeros."""
    if not _stream_capable():
        pytest.skip("the streamed FP8 linear needs sm_90+ (CUDA)")
    gen = torch.Generator().manual_seed(3 * O + I)
    weight = (torch.randn(O, I, generator=gen) * 30).to(FP8).cuda()
    scale = (torch.rand(-(-O // 128), I // 128, generator=gen) * 0.01).cuda()
    x = torch.randn(6, I, generator=gen)
    x[1] *= 2.0 ** -60
    x[2] *= 2.0 ** 40
    x[3, : I // 2] *= 2.0 ** -40  # half the row far below its largest: rounded in f16
    x[4] = 0
    x = x.to("cuda", torch.bfloat16)
    got = {}
    for f16 in (False, True):
        with _launch_options(linear_split=True, linear_split_pair=False, linear_f16=f16):
            got[f16] = C.gpu_linear_fp8(x, weight, scale, (128, 128))
    for r in (0, 1, 2, 5):
        assert torch.equal(got[True][r], got[False][r]), r
    assert rel_err(got[True][3:4], R.linear_fp8(x[3:4], weight, scale, (128, 128))) < 1e-2
    assert not got[True][4].any()
    # the same bits alone as in the batch
    for r in range(6):
        with _launch_options(linear_split=True, linear_f16=True):
            assert torch.equal(C.gpu_linear_fp8(x[r:r + 1], weight, scale, (128, 128))[0],
                               got[True][r]), r


def _check_linear_fp8_streamed(rows, O, I):
    block = (128, 128)
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(O, I, generator=gen) * 30).to(FP8).cuda()
    scale = (torch.rand(-(-O // 128), I // 128, generator=gen) * 0.01).cuda()
    x = torch.randn(rows, I, generator=gen).to("cuda", torch.bfloat16)
    assert C._gpu.linear_stream_takes(x, weight, *block)
    got = C.gpu_linear_fp8(x, weight, scale, block)
    assert got.shape == (rows, O)
    assert rel_err(got, R.linear_fp8(x, weight, scale, block)) < 1e-2
    for r in sorted({0, rows // 2, rows - 1}):
        assert torch.equal(C.gpu_linear_fp8(x[r:r + 1], weight, scale, block)[0], got[r])
    # an `out` that is not 16-byte aligned: still the streamed kernel's bits
    odd = torch.empty(rows * O + 1, device="cuda", dtype=torch.bfloat16)[1:].view(rows, O)
    assert torch.equal(C.gpu_linear_fp8(x, weight, scale, block, out=odd), got)
    saved = C.moe_launch_options()
    try:
        C.moe_launch_options(linear_stream=False)
        assert not C._gpu.linear_stream_takes(x, weight, *block)
        if rows <= 32:  # the skinny kernel: the same products, summed in another order
            assert rel_err(C.gpu_linear_fp8(x, weight, scale, block), got) < 1e-2
    finally:
        C.moe_launch_options(**saved)


@_gpu
@pytest.mark.parametrize("form", LINEAR_FORMS)
def test_gpu_linear_fp8_streamed_decodes_every_byte_exactly(form):
    """Every finite e4m3 value (subnormals, zeros, both signs) through the kernel's byte
    shuffle into bf16: one-hot rows of x pick single weights, so y is w * scale exactly (the
    split form takes in >= 2048)."""
    if not _stream_capable():
        pytest.skip("the streamed FP8 linear needs sm_90+ (CUDA)")
    with _launch_options(**LINEAR_FORMS[form]):
        _check_decodes_every_byte(256, 1024 if form == "unsplit" else 2048, 16)


def _check_decodes_every_byte(O, I, rows):
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # not NaN
    gen = torch.Generator().manual_seed(8)
    weight = codes[torch.randint(len(codes), (O, I), generator=gen)].view(FP8).cuda()
    scale = torch.full((O // 128, I // 128), 0.5).cuda()
    cols = torch.randperm(I, generator=gen)[:rows]
    x = torch.zeros(rows, I, dtype=torch.bfloat16)
    x[torch.arange(rows), cols] = 1
    x = x.cuda()
    got = C.gpu_linear_fp8(x, weight, scale, (128, 128))
    want = (weight.float() * 0.5)[:, cols.cuda()].T.to(torch.bfloat16)
    assert torch.equal(got, want)


@_gpu
@pytest.mark.parametrize("form", LINEAR_FORMS)
def test_gpu_linear_fp8_streamed_in_a_graph(form):
    """Captured (its launch is a programmatic dependent one) and replayed: the same bits."""
    if not _stream_capable():
        pytest.skip("the streamed FP8 linear needs sm_90+ (CUDA)")
    with _launch_options(**LINEAR_FORMS[form]):
        _check_linear_fp8_in_a_graph()


def _check_linear_fp8_in_a_graph():
    gen = torch.Generator().manual_seed(9)
    weight = (torch.randn(4096, 2048, generator=gen) * 30).to(FP8).cuda()
    scale = (torch.rand(32, 16, generator=gen) * 0.01).cuda()
    x = torch.randn(3, 2048, generator=gen).to("cuda", torch.bfloat16)
    y = torch.empty(3, 4096, device="cuda", dtype=torch.bfloat16)
    want = C.gpu_linear_fp8(x, weight, scale, (128, 128))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        C.gpu_linear_fp8(x, weight, scale, (128, 128), out=y)  # warm (smem attribute)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            x2 = x * 1  # a kernel before it in the graph, writing its input
            C.gpu_linear_fp8(x2, weight, scale, (128, 128), out=y)
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)


# o x in: DeltaNet's in_proj_qkvz, out_proj, a one-tile-per-CTA shape, in = 8192 (taken at few
# rows: x fills shared memory), and the smallest: a 64-row weight, in = 1024 (one piece a tile)
PIPE_SHAPES = [(12288, 2048), (2048, 4096), (1024, 2048), (8192, 8192), (64, 2048), (4096, 1024)]


@_gpu
@pytest.mark.parametrize("O,I", PIPE_SHAPES)
def test_gpu_linear_fp8_streamed_piped_same_bits(O, I):
    """The streamed kernel's piped form (moe_launch_options(linear_pipe=True); off by default)
    gives the same bits as its unpiped first version: at m <= 8 and above (its two variants),
    over 16-row chunks, into an `out` that is not 16-byte aligned, with weights of every finite
    e4m3 byte."""
    if not _stream_capable():
        pytest.skip("the streamed FP8 linear needs sm_90+ (CUDA)")
    block = (128, 128)
    gen = torch.Generator(device="cuda").manual_seed(11)
    raw = torch.randint(0, 256, (O, I), generator=gen, device="cuda", dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] ^= 1  # no NaN
    weight = raw.view(FP8)
    scale = torch.rand(-(-O // 128), I // 128, generator=gen, device="cuda") * 1e-3
    saved = C.moe_launch_options()
    ran = []
    try:
        C.moe_launch_options(linear_stream=True, linear_split=False)
        for rows in (1, 3, 8, 9, 16, 17, 40):
            x = torch.randn(rows, I, generator=gen, device="cuda").to(torch.bfloat16)
            if not C._gpu.linear_stream_takes(x, weight, *block):
                continue  # in = 8192 at many rows: x does not fit beside the weights
            got = {}
            for pipe in (True, False):
                C.moe_launch_options(linear_pipe=pipe)
                odd = torch.empty(rows * O + 1, device="cuda", dtype=torch.bfloat16)[1:]
                got[pipe] = (C.gpu_linear_fp8(x, weight, scale, block),
                             C.gpu_linear_fp8(x, weight, scale, block, out=odd.view(rows, O)))
            assert torch.equal(got[True][0], got[False][0]), rows
            assert torch.equal(got[True][1], got[False][1]), rows
            assert torch.equal(got[True][0], got[True][1]), rows
            assert torch.isfinite(got[True][0].float()).all()
            ran.append(rows)
    finally:
        C.moe_launch_options(**saved)
    assert 1 in ran and 3 in ran


@_gpu
def test_gpu_linear_bf16_skinny():
    weight = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) / 45
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    got = C.gpu_linear_bf16_skinny(x, weight)
    assert rel_err(got, torch.nn.functional.linear(x.float(), weight.float())) < 1e-2


#: o x in of the embedded model's window linears (the fused MoE input and output, DeltaNet's
#: fused input projection, attention's, the MTP fc, the LM head), an o not a multiple of 8, and
#: two that only the CUDA-core kernel takes (in not a multiple of 32; in above 1024)
SKINNY_SHAPES = [(1296, 256), (256, 640), (776, 256), (768, 256), (256, 512), (4096, 256),
                 (61, 1024), (40, 48), (72, 2048)]


@_gpu
@pytest.mark.parametrize("O,I", SKINNY_SHAPES)
def test_gpu_linear_skinny(O, I):
    """ops.linear_skinny on the GPU (bf16 weights, up to 16 rows on the skinny linear, on tensor
    cores or CUDA cores): close to the float32 product, each row the same bits alone as in a
    launch of up to 16 rows, with and without its programmatic dependent launch (the same
    bits); more rows run F.linear's bits."""
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(O, I, generator=gen) / I ** 0.5).to("cuda", torch.bfloat16)
    x = torch.randn(17, I, generator=gen).to("cuda", torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), weight.float())
    for mma in (True, False):
        got = {}
        for pdl in (True, False):
            with _launch_options(linear_pdl=pdl, linear_mma=mma):
                for rows in (1, 2, 4, 5, 8, 9, 16):
                    y = C.gpu_linear_skinny(x[:rows], weight)
                    assert y.shape == (rows, O) and y.dtype == torch.bfloat16
                    assert rel_err(y, want[:rows]) < 1e-2
                    assert torch.equal(y, got.setdefault(rows, y)), (mma, pdl, rows)
                    for r in {0, rows - 1}:
                        assert torch.equal(C.gpu_linear_skinny(x[r:r + 1], weight)[0], y[r])
        assert torch.equal(got[16][:9], got[9])
    assert torch.equal(C.gpu_linear_skinny(x, weight), torch.nn.functional.linear(x, weight))
    out = torch.empty(3, O, device="cuda", dtype=torch.bfloat16)
    y = C.gpu_linear_skinny(x[:3], weight, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(out, C.gpu_linear_skinny(x[:3], weight))


@_gpu
def test_gpu_linear_skinny_in_a_graph():
    """Captured behind a kernel that writes its input (its launch a programmatic dependent one)
    and replayed with new input: the eager bits."""
    gen = torch.Generator().manual_seed(12)
    weight = (torch.randn(1296, 256, generator=gen) / 16).to("cuda", torch.bfloat16)
    x = torch.randn(16, 256, generator=gen).to("cuda", torch.bfloat16)
    y = torch.empty(16, 1296, device="cuda", dtype=torch.bfloat16)
    src = torch.empty_like(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), _launch_options(linear_pdl=True):
        C.gpu_linear_skinny(x, weight, out=y)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            C.gpu_linear_skinny(src * 2, weight, out=y)
    for scale in (1.0, -3.0):
        src.copy_(x * scale)
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, C.gpu_linear_skinny(x * scale * 2, weight))


@_gpu
def test_gpu_linear_skinny_compiled():
    """The op inside a compiled function (strata::linear_skinny): the eager bits."""
    weight = (torch.randn(512, 256, device="cuda") / 16).to(torch.bfloat16)
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lambda a: C.gpu_linear_skinny(torch.relu(a), weight) * 2, dynamic=False)
    assert torch.equal(f(x), C.gpu_linear_skinny(torch.relu(x), weight) * 2)


@_gpu
def test_gpu_ops_dispatch():
    try:
        ops.set_backend("auto", "cuda")
        assert ops.implementations()["moe_experts"] in ("cuda", "hip")
        assert ops.implementations()["linear_fp8"] in ("cuda", "hip")
    finally:
        ops.set_backend("torch", "cpu")


def test_reference_slices_a_big_launch_by_rows(monkeypatch):
    """The reference gathers every row's expert weights, so a launch past its gather budget (an
    eight-slot prompt chunk at the 80B's shapes would gather ~70 GB) runs in slices of rows:
    the same result, bf16 and FP8."""
    for wdtype, block in ((torch.float32, None), (FP8, (32, 16))):
        weights = experts(64, 64, 48, wdtype, block or (32, 32))
        w, ids = routing(37, 6, 64)
        x = torch.randn(37, 64, generator=torch.Generator().manual_seed(3))
        whole = call_reference(x, weights, w, ids, block)
        monkeypatch.setattr(R, "_GATHER_ELEMENTS", 64 * 48 * 3 * 6 * 5)  # 5 rows a slice
        assert torch.equal(call_reference(x, weights, w, ids, block), whole)
        monkeypatch.undo()
