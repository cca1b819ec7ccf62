"""GPU: the expert cache's miss path (ops.moe_experts reading missing experts from pinned host
memory through its device address) inside a captured CUDA graph gives the same output as every
expert resident, whichever experts miss, including after the slot table changes between
replays; an engine on the GPU emits the same tokens with a tiny cache as without one,
serial and with engine.overlap (swaps then queue behind the window in flight), greedy and
seeded sampling; and after ExpertCache.reset an engine decodes as a freshly built one.

Skipped without a GPU or without the built extension (strata.kernels.strata_cuda).
"""

from __future__ import annotations

import pytest
import torch

from strata.kernels import cyext_ops as C

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device"),
    pytest.mark.skipif(C.gpu_platform() is None, reason="strata_cuda extension not built"),
]

DEV = "cuda"


def _case(fp8: bool, E=64, H=256, I=128, N=8, k=4, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    wgu = torch.randn(E + 1, 2 * I, H, generator=g) * 0.05  # + a folded shared expert (id E)
    wd = torch.randn(E + 1, H, I, generator=g) * 0.05
    scales, block = (), None
    if not fp8:
        wgu, wd = wgu.to(torch.bfloat16), wd.to(torch.bfloat16)
    else:
        from strata.model.fp8 import FP8_DTYPE
        wgu, wd = ((t * 2000).clamp(-448, 448).to(FP8_DTYPE) for t in (wgu, wd))
        scales = (torch.rand(E + 1, 2 * I // 128, H // 128, generator=g) / 4000,
                  torch.rand(E + 1, H // 128, I // 128, generator=g) / 4000)
        block = (128, 128)
    x = torch.randn(N, H, generator=g).to(DEV, torch.bfloat16)
    ids = torch.cat([torch.randint(0, E, (N, k), generator=g), torch.full((N, 1), E)], 1).to(DEV)
    w = torch.rand(N, k + 1, generator=g).to(DEV)
    return [wgu, wd, *scales], block, x, ids, w


def _cache(stacks, held: list[int]):
    """A cache over `stacks` whose slot s holds expert held[s] (the folded shared expert among
    them): the device slots (gate/up, down, then their scales or None, None for bf16), slot_of,
    and the pinned host store in the same order."""
    E = stacks[0].shape[0] - 1
    rows = torch.tensor(held)
    slots = [(t.view(torch.uint8)[rows].view(t.dtype) if t.element_size() == 1 else t[rows])
             .to(DEV) for t in stacks]  # FP8 rows picked as bytes
    slot_of = torch.full((E + 1,), -1, dtype=torch.int32)
    slot_of[rows] = torch.arange(len(held), dtype=torch.int32)
    host = [t[:E].contiguous().pin_memory() for t in stacks]
    return ((slots[0], slots[1], *(slots[2:] or [None, None])), slot_of.to(DEV),
            (host[0], host[1], *(host[2:] or [None, None])))


@pytest.mark.parametrize("fp8", [False, True])
def test_miss_path_in_a_graph_matches_all_resident(fp8):
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 experts need sm_89+")
    stacks, block, x, ids, w = _case(fp8)
    E = stacks[0].shape[0] - 1
    dev_full = [t.to(DEV) for t in stacks]
    full = C.gpu_moe_experts(x, dev_full[0], dev_full[1], w, ids, *(dev_full[2:] or [None, None]),
                             block)
    S = 8
    host = [t[:E].contiguous().pin_memory() for t in stacks]
    slots = [torch.empty((S + 1, *t.shape[1:]), dtype=t.dtype, device=DEV) for t in stacks]
    slot_of = torch.full((E + 1,), -1, dtype=torch.int32, device=DEV)
    out = torch.empty_like(x)
    ws = torch.empty(C.moe_workspace_numel(x.shape[0], ids.shape[1], stacks[0].shape[1] // 2),
                     device=DEV)

    def fill(resident):
        table = torch.full((E + 1,), -1, dtype=torch.int32)
        for s, e in enumerate(resident):
            table[e] = s
            for d, h in zip(slots, host):
                d[s].copy_(h[e])
        table[E] = S
        for d, t in zip(slots, stacks):
            d[S].copy_(t[E])
        slot_of.copy_(table)

    def call():
        C.gpu_moe_experts(x, slots[0], slots[1], w, ids, *(slots[2:] or [None, None]), block,
                          slot_of, host[0], host[1], *(host[2:] or [None, None]), out=out,
                          workspace=ws)

    fill(list(range(S)))
    call()  # warm: lazy initialisation outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    routed = sorted(set(ids[:, :-1].flatten().tolist()))
    for resident in (list(range(S)), routed[:S], list(range(E - S, E)), routed[-S:]):
        fill(resident)  # the slot table changes between replays; the graph stays valid
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, full), resident


@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_counts_in_a_graph(fp8):
    """The counting inside the gate/up kernel, captured: a window of two layers, one of them in
    two calls (as a window over 32 rows runs), zeroed once; routing counts, hits and misses
    match the torch reference's count, replay after replay; the output does not change."""
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 experts need sm_89+")
    from strata.kernels import reference as R

    stacks, block, x, ids, w = _case(fp8, N=12, k=6, seed=1)
    E = stacks[0].shape[0] - 1
    S, L = 16, 2
    slots, slot_of, hs = _cache(stacks, list(range(0, 2 * S, 2)) + [E])
    args, scales = slots[:2], slots[2:]
    routed = torch.zeros(L, E, device=DEV)
    state = torch.zeros(2 + L * E, dtype=torch.int32, device=DEV)
    layers = [torch.full((1,), li, dtype=torch.int32, device=DEV) for li in range(L)]
    parts = [(0, slice(0, 5)), (1, slice(0, 12)), (0, slice(5, 12))]
    outs = [torch.empty_like(x[p]) for _, p in parts]

    def window():
        state.zero_()
        for (li, p), o in zip(parts, outs):
            C.gpu_moe_experts(x[p], *args, w[p], ids[p], *scales, block, slot_of, *hs,
                              routed_counts=routed, window_state=state, count_layer=layers[li],
                              out=o)

    window()  # warm: lazy initialisation outside the capture
    torch.cuda.synchronize()
    routed.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        window()
    want_routed = torch.zeros(L, E, device=DEV)
    want_state = torch.zeros_like(state)
    for li, p in parts:
        R.count_expert_reads(ids[p], slot_of, want_routed, want_state, layers[li])
    for rep in range(1, 3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(state, want_state)
        assert torch.equal(routed, want_routed * rep)  # cumulative over windows
    hits, misses = state[:2].tolist()
    assert hits > 0 and misses > 0
    for (li, p), o in zip(parts, outs):
        plain = C.gpu_moe_experts(x[p], *args, w[p], ids[p], *scales, block, slot_of, *hs)
        assert torch.equal(o, plain)


@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_cache_holding_every_expert_runs_the_streamed_kernels(fp8, mma):
    """A cache with a slot for every expert (slots in another order than the ids) never misses:
    on sm_90+ it runs the streamed kernels as the stacks without a cache do, with the same
    bits, and their gate/up kernel counts the routing, hits and no misses, as the reference;
    FP8 with gate_up_mma runs the tensor-core gate/up so."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the streamed kernels need sm_90+")
    from torch.profiler import ProfilerActivity, profile

    from strata.kernels import reference as R

    stacks, block, x, ids, w = _case(fp8, N=6, k=4, seed=2)
    E = stacks[0].shape[0] - 1
    order = torch.randperm(E, generator=torch.Generator().manual_seed(0)).tolist() + [E]
    slots, slot_of, hs = _cache(stacks, order)
    assert (slot_of >= 0).all()
    routed = torch.zeros(1, E, device=DEV)
    state = torch.zeros(2 + E, dtype=torch.int32, device=DEV)
    layer = torch.zeros(1, dtype=torch.int32, device=DEV)
    dev_stacks = [t.to(DEV) for t in stacks]
    before = C.moe_launch_options()
    try:
        C.moe_launch_options(stream=True, stream_all=True, gate_up_mma=mma)
        plain = C.gpu_moe_experts(x, dev_stacks[0], dev_stacks[1], w, ids,
                                  *(dev_stacks[2:] or [None, None]), block)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = C.gpu_moe_experts(x, slots[0], slots[1], w, ids, *slots[2:], block, slot_of,
                                    *hs, routed_counts=routed, window_state=state,
                                    count_layer=layer)
            torch.cuda.synchronize()
    finally:
        C.moe_launch_options(**{k: before[k] for k in ("stream", "stream_all", "gate_up_mma")})
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    kernel = "moe_gate_up_mma" if fp8 and mma else "moe_gate_up_stream"
    assert any(kernel in n for n in names), sorted(names)
    assert torch.equal(got, plain)
    want_routed = torch.zeros(1, E, device=DEV)
    want_state = torch.zeros_like(state)
    R.count_expert_reads(ids, slot_of, want_routed, want_state, layer)
    assert torch.equal(routed, want_routed) and torch.equal(state, want_state)
    assert state[1].item() == 0 and state[0].item() == len(set(ids[:, :-1].flatten().tolist()))


def _tiny_model(tmp_path):
    from strata.model.tiny import make_tiny_random

    return make_tiny_random(tmp_path / "m", seed=3, tokenizer=False, num_experts=64,
                            num_experts_per_tok=4, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64, hidden_size=128,
                            dtype=torch.bfloat16)


def _engine(path, mib: int, overlap: bool, model: dict | None = None, **engine):
    """A CUDA engine over the tiny model: 3 slots, engine.expert_cache_mib=mib adapting every
    2 windows, `model` knobs and `engine` knobs."""
    from omegaconf import OmegaConf

    from strata.config import StrataConfig
    from strata.engine.llm_engine import Engine

    cfg = OmegaConf.structured(StrataConfig)
    cfg.device = "cuda"
    cfg.model.path = str(path)
    cfg.model.moe_dense_experts = 0
    cfg.engine.max_context = 256
    cfg.engine.slots = 3
    cfg.engine.expert_cache_mib = mib
    cfg.engine.expert_adapt_every = 2
    cfg.engine.overlap = overlap
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    for k, v in (model or {}).items():
        setattr(cfg.model, k, v)
    return Engine.from_config(cfg, log=lambda s: None)


def _cohort(eng, tag: str = "r") -> dict:
    """Three staggered requests from now (one greedy, two seeded samples) run to the end;
    their tokens by index."""
    from strata.engine.request import Request, SamplingParams

    for i in range(3):
        eng.add_request(Request(f"{tag}{i}", [5 + i, 9, 11 + i, 3], SamplingParams(
            max_tokens=24, stop_at_eos=False, seed=i, temperature=0.8 if i else 0.0),
            arrival_step=eng.steps + i))
    while eng.has_work():
        eng.step()
    return {r[len(tag):]: list(s.emitted) for r, s in eng.requests.items() if r.startswith(tag)}


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_engine_tokens_identical_with_a_tiny_cache(tmp_path, overlap):
    path = _tiny_model(tmp_path)

    def run(mib: int, overlap: bool):
        eng = _engine(path, mib, overlap)
        return _cohort(eng), eng

    # The same loop without the cache: in bf16 a window's shape can decide a near-tie, and the
    # overlapped loop's windows may hold a finished request's group (test_engine_backends
    # compares the loops); the cache must not change a bit of either.
    ref, _ = run(0, overlap)
    out, eng = run(1, overlap)
    c = eng.expert_cache
    assert c.plan.slots < 64 and c.misses > 0 and c.swaps > 0
    assert (eng.overlap is not None) == overlap
    assert out == ref
    windows = [ev for ev in eng.trace.events if ev["ev"] == "window"]
    assert sum(ev["hits"] for ev in windows) == c.hits
    assert sum(ev["misses"] for ev in windows) == c.misses


@pytest.mark.parametrize("fmt", ["safetensors", "dummy"])
def test_routed_experts_load_into_host_memory_never_the_device(tmp_path, fmt):
    """With the cache the loader holds the decoder's routed experts in host memory (a model
    whose experts do not fit the card loads): the device's peak through the load stays below
    the weights without half the routed experts, and the tokens are those of an engine without
    the cache, for checkpoint weights and for dummy ones (drawn on the device, then copied to
    the host)."""
    from omegaconf import OmegaConf

    from strata.config import StrataConfig
    from strata.engine.expert_cache import moe_layers
    from strata.model.loader import load_model

    path = _tiny_model(tmp_path)
    model = {"load_format": fmt}
    ref_eng = _engine(path, 0, False, model)
    weights = sum(p.numel() * p.element_size() for p in ref_eng.model.parameters())
    routed = sum(t.numel() * t.element_size() for _, m in moe_layers(ref_eng.model)
                 for t in (m.experts.w_gate_up, m.experts.w_down))
    ref = _cohort(ref_eng)
    ref_eng.close()
    del ref_eng
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cfg = OmegaConf.structured(StrataConfig)
    cfg.model.path, cfg.model.moe_dense_experts, cfg.model.load_format = str(path), 0, fmt
    loaded = load_model(cfg.model, "cuda", lambda s: None, routed_on_host=True)
    assert torch.cuda.max_memory_allocated() - base < weights - routed // 2
    assert all(m.experts.w_gate_up.device.type == "cpu" for _, m in moe_layers(loaded.model))
    del loaded
    eng = _engine(path, 1, False, model)
    assert _cohort(eng) == ref


@pytest.mark.parametrize("mib", [0, 1], ids=["resident", "cache"])
def test_padded_prompt_chunks_capture_uncompiled(tmp_path, mib):
    """A padded prompt chunk parks its padding rows on the folded shared expert, an id the
    model holds as an int: made on the device, not copied from the host, so that the chunk's
    graph captures with compile off too (with and without the cache; a copy from unpinned host
    memory had failed the capture, and the chunks ran eagerly). The tokens are those of graphs
    off."""
    from omegaconf import OmegaConf

    from strata.config import StrataConfig
    from strata.engine.llm_engine import Engine
    from strata.engine.request import Request, SamplingParams

    path = _tiny_model(tmp_path)
    outs = {}
    for graphs in (False, True):
        logs: list[str] = []
        cfg = OmegaConf.structured(StrataConfig)
        cfg.device, cfg.model.path, cfg.model.moe_dense_experts = "cuda", str(path), 0
        e = cfg.engine
        e.max_context, e.slots, e.compile, e.graphs, e.warmup = 256, 2, "off", graphs, "on"
        e.expert_cache_mib, e.prefill_buckets = mib, [16]
        eng = Engine.from_config(cfg, log=logs.append)
        for i, plen in enumerate((11, 5)):  # each chunk padded to the 16-row bucket
            eng.add_request(Request(f"r{i}", list(range(3 + i, 3 + i + plen)),
                                    SamplingParams(max_tokens=8, stop_at_eos=False)))
        while eng.has_work():
            eng.step()
        outs[graphs] = {k: list(v.emitted) for k, v in eng.requests.items()}
        assert not [m for m in logs if "capture failed" in m], logs
        if graphs:
            assert eng.runner.p_graphs, "no prompt chunk was captured"
        eng.close()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_reset_then_decode_as_a_fresh_engine_with_graphs(tmp_path, overlap):
    """ExpertCache.reset on the GPU, window graphs captured (the slots and slot table change in
    place behind them; the copies run on the side stream): after a cohort whose swaps moved the
    slots, a reset engine decodes the next cohort as a freshly built one: the same tokens and
    the same hits and misses in every window. The warm-up captures every window graph first
    (as the study's engines do), so every window of both replays one (a capture's eager warm
    run on the scratch lane would add its routing to the adapt period's counts), and a bucket
    per group count leaves no padding group (whose scratch-lane rows route from a state the
    cache does not own)."""
    path = _tiny_model(tmp_path)

    def cohort(eng, tag: str):
        since = len(eng.trace.events)
        tokens = _cohort(eng, tag)
        windows = [ev for ev in eng.trace.events[since:] if ev["ev"] == "window"]
        assert windows and all(ev["graph"] == "hit" for ev in windows), tag
        return tokens, [(ev["hits"], ev["misses"]) for ev in windows]

    # graphs on (the constraint under test); compiling is not
    knobs = dict(compile="off", warmup="on", shape_buckets=[1, 2, 3])
    fresh = _engine(path, 1, overlap, **knobs)
    want = cohort(fresh, "a")
    fresh.close()
    eng = _engine(path, 1, overlap, **knobs)
    cohort(eng, "a")
    c = eng.expert_cache
    assert c.swaps > 0 and (c.slot_expert != c.first_fill).any()
    assert c.reset() > 0
    torch.cuda.synchronize()
    assert torch.equal(c.slot_of.cpu(), torch.from_numpy(c.host_slot_of))
    for li, lc in enumerate(c.layers):
        for s, e in enumerate(c.slot_expert[li]):
            assert torch.equal(lc.gate_up[s].cpu(), lc.host_gate_up[e])
    assert cohort(eng, "b") == want


@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_streamed_kernels_read_missing_experts_from_the_host_store(fp8, mma):
    """moe_launch_options(stream_miss=True): a cache that misses runs the streamed kernels
    (sm_90+), whose bulk copies read the missing experts from the pinned host store; the same
    counts as the per-block kernels' miss path, and the same bits: the per-block kernels' with
    the CUDA-core gate/up, the streamed kernels' on the stacks without a cache with the
    tensor-core gate/up (FP8 with gate_up_mma). Last in this file: a fault of the copies would
    spoil the CUDA context for the tests after it."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the streamed kernels need sm_90+")
    from torch.profiler import ProfilerActivity, profile

    stacks, block, x, ids, w = _case(fp8, N=6, k=4, seed=3)
    E = stacks[0].shape[0] - 1
    slots, slot_of, hs = _cache(stacks, list(range(1, 32, 2)) + [E])

    def call():
        routed = torch.zeros(1, E, device=DEV)
        state = torch.zeros(2 + E, dtype=torch.int32, device=DEV)
        layer = torch.zeros(1, dtype=torch.int32, device=DEV)
        out = C.gpu_moe_experts(x, slots[0], slots[1], w, ids, *slots[2:], block, slot_of,
                                *hs, routed_counts=routed, window_state=state, count_layer=layer)
        torch.cuda.synchronize()
        return out, routed, state

    before = C.moe_launch_options()
    try:
        C.moe_launch_options(stream=False)
        want = call()
        C.moe_launch_options(stream=True, stream_all=True, stream_miss=True, gate_up_mma=mma)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = call()
        if fp8 and mma:  # its own bits: those of the stacks without a cache
            dev_stacks = [t.to(DEV) for t in stacks]
            plain = C.gpu_moe_experts(x, dev_stacks[0], dev_stacks[1], w, ids, *dev_stacks[2:],
                                      block)
            want = (plain, *want[1:])
    finally:
        C.moe_launch_options(**{k: before[k] for k in ("stream", "stream_all", "stream_miss",
                                                       "gate_up_mma")})
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    kernel = "moe_gate_up_mma" if fp8 and mma else "moe_gate_up_stream"
    assert any(kernel in n for n in names), sorted(names)
    assert want[2][1].item() > 0  # the window missed
    for a, b in zip(got, want):
        assert torch.equal(a, b)
