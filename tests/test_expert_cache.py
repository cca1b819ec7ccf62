"""The expert cache on the CPU (engine.expert_cache_mib): the same resident set, host store,
slot table and adaptive swaps as on a GPU, with engine.overlap on and off (window t+1 launched
before window t is read: each window's counts stay its own, and an adaptation's counts are
those of the windows launched up to the one ending its period).

A 64-expert top-4 model whose shared expert has the routed experts' shape (so it is folded
into the slots): one expert of each of its 4 MoE layers is 36 KiB, so 1 MiB holds 7 of 64
experts per layer (most reads miss), 3 MiB holds 21 and 9 MiB all 64.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from conftest import cpu_engine_config, run_cohort

from strata.config import ConfigError
from strata.engine.expert_cache import (DECAY, ExpertCache, plan_expert_cache, top_experts)
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.kernels import cyext_ops, reference
from strata.metrics import format_table, run_metrics
from strata.model.loader import load_checkpoint
from strata.model.tiny import make_tiny_random

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cached_model(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("cache-experts"), seed=7, tokenizer=False,
                            num_experts=64, num_experts_per_tok=4, moe_intermediate_size=48,
                            shared_expert_intermediate_size=48)


def cohort(sampled: bool = False) -> list[Request]:
    """Three staggered requests; `sampled`: seeded sampling (one of them filtering), else greedy."""
    rng = random.Random(3)
    return [Request(f"r{i}", [rng.randrange(1, 512) for _ in range(3 + 4 * i)],
                    SamplingParams(max_tokens=6 + 2 * i, stop_at_eos=False, seed=11 + i,
                                   temperature=0.9 if sampled else 0.0,
                                   top_k=8 if sampled and i == 1 else 0), arrival_step=i)
            for i in range(3)]


class Audit:
    """Independent host-side count of each window's distinct (layer, expert) pairs, from the
    routing every cached layer runs, against the resident set at the window's start (in launch
    order); each window's routed rows per (layer, expert); and the counts each adaptation
    decided from."""

    def __init__(self, monkeypatch):
        from strata.model.qwen3_next import Experts

        self.windows: list[tuple[int, int]] = []
        self.routed: list[np.ndarray] = []
        self.decided: list[np.ndarray] = []
        self.seen: dict[int, set] = {}
        self.in_window = False
        audit = self
        orig_forward, orig_begin, orig_end, orig_plan = (
            Experts.forward, ExpertCache.begin_window, ExpertCache.end_window,
            ExpertCache.plan_swaps)

        def forward(experts, x, weights, index, shared_weight=None, shared_in_index=False,
                    prompt=False, valid=None):
            if experts.cache is not None and audit.in_window:
                routed = index[:, :-1] if shared_in_index else index  # not the shared expert
                ids = routed.reshape(-1).tolist()
                audit.seen.setdefault(id(experts.cache), set()).update(ids)
                np.add.at(audit.window_routed[audit.layer_of[id(experts.cache)]], ids, 1)
            return orig_forward(experts, x, weights, index, shared_weight, shared_in_index,
                                prompt, valid)

        def begin_window(cache):
            audit.seen, audit.in_window = {}, True
            audit.resident = cache.resident().copy()
            audit.layer_of = {id(lc): li for li, lc in enumerate(cache.layers)}
            audit.window_routed = np.zeros((cache.plan.moe_layers, cache.plan.experts))
            orig_begin(cache)

        def end_window(cache):
            pairs = [(audit.layer_of[key], e) for key, es in audit.seen.items() for e in es]
            hits = sum(bool(audit.resident[li, e]) for li, e in pairs)
            audit.windows.append((hits, len(pairs) - hits))
            audit.routed.append(audit.window_routed)
            audit.in_window = False
            orig_end(cache)

        def plan_swaps(cache, counts):
            audit.decided.append(counts.copy())
            return orig_plan(cache, counts)

        monkeypatch.setattr(Experts, "forward", forward)
        monkeypatch.setattr(ExpertCache, "begin_window", begin_window)
        monkeypatch.setattr(ExpertCache, "end_window", end_window)
        monkeypatch.setattr(ExpertCache, "plan_swaps", plan_swaps)


def run(path, mode: str, audit=None, sampled: bool = False, **knobs):
    cfg = cpu_engine_config(path, 128, mode="solo" if mode == "solo" else "batch",
                            batch_mtp=mode == "batch_mtp", slots=3, window_rows=6, spec=3,
                            prefill_chunk=4, **knobs)
    cfg.model.moe_dense_experts = 0
    eng = Engine.from_config(cfg, log=lambda s: None)
    run_cohort(eng, cohort(sampled), 500)
    assert all(rs.reason == "length" for rs in eng.requests.values())
    return {rid: list(rs.emitted) for rid, rs in eng.requests.items()}, eng


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("mode", ["solo", "batch", "batch_mtp"])
def test_tokens_identical_at_every_budget(cached_model, mode, overlap, sampled, monkeypatch):
    """The tokens of every expert resident on the serial engine, at every budget, with
    engine.overlap on and off; the counts of each window and of each adaptation are its own."""
    ref, _ = run(cached_model, mode, sampled=sampled, overlap=False)
    budgets = ((1, 7), (3, 21), (9, 64)) if mode == "batch_mtp" else ((1, 7), (9, 64))
    if sampled:
        budgets = budgets[:1]
    for mib, slots in budgets:
        audit = Audit(monkeypatch)
        out, eng = run(cached_model, mode, sampled=sampled, overlap=overlap,
                       expert_cache_mib=mib, expert_adapt_every=2)
        c = eng.expert_cache
        assert out == ref, (mode, mib)
        assert (eng.overlap is not None) == overlap
        # an adaptation decides from the windows launched in its period (2), not the one
        # launched meanwhile (engine.overlap)
        assert len(audit.decided) == len(audit.windows) // 2
        for k, counts in enumerate(audit.decided):
            assert np.array_equal(counts, audit.routed[2 * k] + audit.routed[2 * k + 1]), k
        assert c.plan.slots == slots
        # the budget is never exceeded: slots per layer stay fixed, and fit expert_cache_mib
        assert c.plan.resident_mib() <= mib
        assert (c.resident().sum(1) == slots).all()
        assert all(lc.gate_up.shape[0] == slots + 1 for lc in c.layers)  # + the shared expert
        # hits + misses are the distinct routed (layer, expert) pairs of each window
        windows = [ev for ev in eng.trace.events if ev["ev"] == "window"]
        assert [(ev["hits"], ev["misses"]) for ev in windows] == audit.windows
        assert all(ev["bus_bytes"] == ev["misses"] * c.plan.expert_bytes for ev in windows)
        if slots == 64:
            assert c.misses == 0 and c.swaps == 0
        else:
            assert c.misses > 0
        swaps = [ev for ev in eng.trace.events if ev["ev"] == "expert_swap"]
        assert sum(ev["experts"] for ev in swaps) == c.swaps
        assert all(ev["bytes"] == ev["experts"] * c.plan.expert_bytes for ev in swaps)
        memory = eng.trace.events[0]["memory"]
        assert (memory["expert_slots"], memory["experts"], memory["moe_layers"]) == (slots, 64, 4)
        m = run_metrics(eng.requests.values(), eng.stats())
        assert m["expert_hit_rate"] == pytest.approx(c.hits / (c.hits + c.misses))
        assert "expert hit rate" in format_table(m)


def test_no_cache_reports_no_hit_rate(cached_model):
    _, eng = run(cached_model, "batch")
    assert eng.expert_cache is None
    assert run_metrics(eng.requests.values(), eng.stats())["expert_hit_rate"] is None
    assert "hits" not in next(ev for ev in eng.trace.events if ev["ev"] == "window")
    assert "expert_slots" not in eng.trace.events[0]["memory"]


def _loaded(path):
    return load_checkpoint(path, moe_dense_experts=0, log=lambda s: None)


def test_adaptive_swap_properties(cached_model):
    loaded = _loaded(cached_model)
    plan = plan_expert_cache(loaded.model, 1)
    cache = ExpertCache(loaded.model, plan, torch.device("cpu"))
    L, E, S = plan.moe_layers, plan.experts, plan.slots
    rng = np.random.default_rng(0)
    popular = np.stack([rng.permutation(E) for _ in range(L)])  # rank -> expert, per layer
    weight = 1.0 / (1.0 + np.arange(E))                          # Zipf-like by rank
    for step in range(40):
        counts = np.zeros((L, E))
        for li in range(L):
            counts[li, popular[li]] = 200 * weight + rng.uniform(0, 1, E)  # small noise
        before = cache.resident().copy()
        decayed_before = cache.decayed.copy()
        cache.routed.copy_(torch.from_numpy(counts).float())
        cache.adapt()
        after = cache.resident()
        assert (after.sum(1) == S).all()  # the budget never changes
        d = decayed_before * DECAY + counts
        for li in range(L):
            out, inn = np.flatnonzero(before[li] & ~after[li]), np.flatnonzero(~before[li] & after[li])
            assert len(out) == len(inn) <= 1
            missing, resident = np.flatnonzero(~before[li]), np.flatnonzero(before[li])
            best, worst = d[li, missing].max(), d[li, resident].min()
            if len(inn):  # the most-routed missing for the least-routed resident
                assert d[li, inn[0]] == best and d[li, out[0]] == worst and best > worst
            else:
                assert best <= worst
        # the slot table and the slots' contents agree with the host store
        for li, lc in enumerate(cache.layers):
            for s in range(S):
                e = cache.slot_expert[li, s]
                assert cache.slot_of[li, e] == s
                assert torch.equal(lc.gate_up[s], lc.host_gate_up[e])
                assert torch.equal(lc.down[s], lc.host_down[e])
    # a steady popularity converges to each layer's most popular experts
    for li in range(L):
        assert set(np.flatnonzero(cache.resident()[li])) == set(popular[li, :S].tolist())


def test_profile_chooses_the_first_fill(cached_model, tmp_path):
    loaded = _loaded(cached_model)
    plan = plan_expert_cache(loaded.model, 1)
    counts = [[(e * 7 + li) % 64 for e in range(64)] for li in range(plan.moe_layers)]
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"model": "t", "layers": plan.layers, "experts": 64, "top_k": 4,
                                "tokens": 10, "counts": counts, "windows": 1,
                                "distinct_per_window": {"1": 4.0}}))
    cache = ExpertCache(loaded.model, plan, torch.device("cpu"), profile=str(prof))
    want = top_experts(np.array(counts, dtype=float), plan.slots)
    assert (cache.slot_expert == want).all()
    for li in range(plan.moe_layers):
        assert set(np.flatnonzero(cache.resident()[li])) == set(np.argsort(counts[li])[-plan.slots:])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": [0], "experts": 32, "counts": [[1] * 32]}))
    with pytest.raises(ConfigError, match="engine.expert_profile.*32 experts"):
        ExpertCache(_loaded(cached_model).model, plan, torch.device("cpu"), profile=str(bad))


def test_budget_errors_name_the_numbers(cached_model, tiny_ckpt):
    loaded = _loaded(cached_model)
    with pytest.raises(ConfigError, match=r"expert_cache_mib=0.001.*no routed expert.*4 MoE layers"):
        plan_expert_cache(loaded.model, 1e-3)
    with pytest.raises(ConfigError, match="model.moe_dense_experts=0"):
        plan_expert_cache(load_checkpoint(tiny_ckpt, log=lambda s: None).model, 64)
    cfg = cpu_engine_config(cached_model, 128, expert_cache_mib=9, cpu_device_mib=2069,
                            vram_reserve_mib=2048)
    cfg.model.moe_dense_experts = 0
    with pytest.raises(ConfigError, match="device cannot hold the expert cache"):
        Engine.from_config(cfg, log=lambda s: None)


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_kernel_reads_slots_and_host_store(fp8):
    """Where an expert is read from (slot or host store) never changes the result: the C++
    kernel is bit-identical to the all-resident call; the reference matches it."""
    torch.manual_seed(0)
    E, H, I, N, k = 12, 32, 16, 5, 3
    wgu, wd = torch.randn(E + 1, 2 * I, H), torch.randn(E + 1, H, I)  # + a shared expert
    x, w = torch.randn(N, H), torch.rand(N, k + 1)
    ids = torch.cat([torch.randint(0, E, (N, k)), torch.full((N, 1), E)], 1)
    extra, block = (), None
    if fp8:
        from strata.model.fp8 import FP8_DTYPE
        wgu, wd = (wgu * 30).to(FP8_DTYPE), (wd * 30).to(FP8_DTYPE)
        extra, block = (torch.rand(E + 1, 2, 2), torch.rand(E + 1, 2, 1)), (16, 16)
    full = cyext_ops.cpu_moe_experts(x, wgu, wd, w, ids, *extra, block)
    resident = [1, 4, 7]
    slot_of = torch.full((E + 1,), -1, dtype=torch.int32)
    slot_of[resident + [E]] = torch.arange(4, dtype=torch.int32)
    pick = resident + [E]
    slots = [t[pick].clone() for t in (wgu, wd, *extra)]
    host = [t[:E].clone() for t in (wgu, wd, *extra)] + [None] * (2 - len(extra))
    got = cyext_ops.cpu_moe_experts(x, slots[0], slots[1], w, ids, *(slots[2:] or [None, None]),
                                    block, slot_of, *host)
    assert torch.equal(got, full)
    ref = reference.moe_experts(x, slots[0], slots[1], w, ids, *(slots[2:] or [None, None]),
                                block, slot_of, *host)
    assert torch.allclose(ref, full, atol=1e-4, rtol=1e-4)


def test_fp8_experts_identical_tokens_with_scales_on_the_device(cached_model, tmp_path):
    """FP8 experts (block scales): misses read the weights from the host store and the scales
    from the device copy every expert keeps; the tokens do not change."""
    from omegaconf import OmegaConf

    from strata.config import StrataConfig
    from strata.model.quantize import quantize_checkpoint

    fp8 = quantize_checkpoint(cached_model, tmp_path / "fp8", (16, 16), log=lambda _m: None)

    def tokens(mib: int):
        loaded = load_checkpoint(fp8, dtype="float32", fp8="keep", moe_dense_experts=0,
                                 log=lambda _m: None)
        ecfg = OmegaConf.structured(StrataConfig).engine
        ecfg.slots, ecfg.window_rows, ecfg.spec, ecfg.max_context = 3, 6, 3, 128
        ecfg.expert_cache_mib, ecfg.expert_adapt_every = mib, 2
        eng = Engine(loaded, ecfg, torch.device("cpu"), log=lambda s: None)
        for r in cohort():
            eng.add_request(r)
        while eng.has_work():
            eng.step()
        return {rid: list(rs.emitted) for rid, rs in eng.requests.items()}, eng

    ref, _ = tokens(0)
    out, eng = tokens(1)
    c = eng.expert_cache
    assert c.plan.scale_bytes > 0 and 0 < c.plan.slots < 64 and c.misses > 0
    assert c.plan.resident_mib() <= 1
    assert all(lc.host_gu_scale.shape[0] == 64 for lc in c.layers)
    assert out == ref


def _count_by_sets(calls, slot_of, n_layers, E):
    """(routed (L, E), hits, misses) of a window of moe_experts calls [(layer, ids)], counted
    independently on the host: each distinct (layer, expert < E) once."""
    routed = np.zeros((n_layers, E))
    seen: set = set()
    for li, ids in calls:
        for e in ids.reshape(-1).tolist():
            if e < E:
                routed[li, e] += 1
                seen.add((li, e))
    hits = sum(int(slot_of[e]) >= 0 for _, e in seen)
    return routed, hits, len(seen) - hits


@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_moe_kernel_counts_each_distinct_expert_once(impl):
    """The counting inside moe_experts: each layer's routed pairs add to its routing counts,
    and a window's distinct (layer, expert) pairs count once as hits or misses, also when a
    layer's rows come in several calls (as rows beyond 32 do); the shared expert is not
    counted; the output does not change."""
    torch.manual_seed(1)
    E, H, I, k, L = 10, 16, 16, 3, 2
    wgu, wd = torch.randn(E + 1, 2 * I, H), torch.randn(E + 1, H, I)
    resident = [0, 3, 4, 9]
    slot_of = torch.full((E + 1,), -1, dtype=torch.int32)
    slot_of[resident + [E]] = torch.arange(5, dtype=torch.int32)
    slots = [t[resident + [E]].clone() for t in (wgu, wd)]
    host = [t[:E].clone() for t in (wgu, wd)]
    routed = torch.zeros(L, E)
    state = torch.zeros(2 + L * E, dtype=torch.int32)
    fn = cyext_ops.cpu_moe_experts if impl == "cpu" else reference.moe_experts
    for window in range(2):
        state.zero_()
        calls = []
        for li, n in ((0, 4), (1, 3), (0, 5)):  # layer 0 twice: one window, split rows
            ids = torch.cat([torch.randint(0, E, (n, k)), torch.full((n, 1), E)], 1)
            if window == 1:
                ids[:, 0] = 2  # many rows on one expert
            x, w = torch.randn(n, H), torch.rand(n, k + 1)
            layer = torch.tensor([li], dtype=torch.int32)
            got = fn(x, slots[0], slots[1], w, ids, None, None, None, slot_of, *host, None, None,
                     routed_counts=routed, window_state=state, count_layer=layer)
            plain = cyext_ops.cpu_moe_experts(x, slots[0], slots[1], w, ids, None, None, None,
                                              slot_of, *host, None, None)
            if impl == "cpu":
                assert torch.equal(got, plain)
            else:
                assert torch.allclose(got, plain, atol=1e-3, rtol=1e-4)
            calls.append((li, ids))
        want_routed, hits, misses = _count_by_sets(calls, slot_of, L, E)
        assert state[:2].tolist() == [hits, misses]
        assert hits > 0 and misses > 0
        seen = state[2:].view(L, E)
        assert torch.equal(seen > 0, torch.from_numpy(want_routed > 0))
        if window == 0:
            first = want_routed
            assert torch.equal(routed, torch.from_numpy(want_routed).float())
        else:  # cumulative over windows
            assert torch.equal(routed, torch.from_numpy(first + want_routed).float())


def test_moe_counting_arguments_are_checked():
    E, H, I = 4, 16, 16
    wgu, wd = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    slot_of = torch.arange(E, dtype=torch.int32)
    x, w, ids = torch.randn(1, H), torch.rand(1, 2), torch.tensor([[0, 1]])
    args = (x, wgu, wd, w, ids, None, None, None, slot_of, wgu.clone(), wd.clone(), None, None)
    with pytest.raises(ValueError, match="routed_counts, window_state and count_layer go together"):
        cyext_ops.cpu_moe_experts(*args, routed_counts=torch.zeros(1, E))
    with pytest.raises(ValueError, match="window_state"):
        cyext_ops.cpu_moe_experts(*args, routed_counts=torch.zeros(1, E),
                                  window_state=torch.zeros(5, dtype=torch.int32),
                                  count_layer=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="count_layer = 3 is out of range"):
        cyext_ops.cpu_moe_experts(*args, routed_counts=torch.zeros(1, E),
                                  window_state=torch.zeros(2 + E, dtype=torch.int32),
                                  count_layer=torch.full((1,), 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="need slot_of"):
        cyext_ops.cpu_moe_experts(x, wgu, wd, w, ids, routed_counts=torch.zeros(1, E))


@pytest.mark.parametrize("counting", [False, True])
def test_moe_counting_under_torch_compile(counting):
    """torch.compile of a region with the cached MoE call: with counting it is the custom op
    strata::moe_experts_counted, whose counters are updated in place (as in eager); without,
    strata::moe_experts (a mutable argument left None broke inductor's lowering)."""
    torch.manual_seed(2)
    E, H, I, k, L = 10, 16, 16, 3, 2
    wgu, wd = torch.randn(E + 1, 2 * I, H), torch.randn(E + 1, H, I)
    slot_of = torch.arange(E + 1, dtype=torch.int32)
    slot_of[3] = -1
    host = [wgu[:E].clone(), wd[:E].clone()]
    routed = torch.zeros(L, E)
    state = torch.zeros(2 + L * E, dtype=torch.int32)
    layer = torch.ones(1, dtype=torch.int32)
    kw = {"routed_counts": routed, "window_state": state, "count_layer": layer} if counting else {}

    def region(x, w, ids):
        return cyext_ops.cpu_moe_experts(x, wgu, wd, w, ids, None, None, None, slot_of, *host,
                                         None, None, **kw) * 2

    x, w = torch.randn(4, H), torch.rand(4, k)
    ids = torch.tensor([[0, 3, 5], [3, 5, 9], [1, 2, 3], [0, 1, 2]])
    got = torch.compile(region)(x, w, ids)
    if counting:
        want_routed, hits, misses = _count_by_sets([(1, ids)], slot_of, L, E)
        assert state[:2].tolist() == [hits, misses] == [5, 1]
        assert torch.equal(routed, torch.from_numpy(want_routed).float())
        state.zero_()
        routed.zero_()
    assert torch.allclose(got, region(x, w, ids))


def test_auto_overlap_runs_a_swapping_cache_overlapped_and_its_trace_replays(cached_model):
    """engine.overlap=null (auto) overlaps a cache that misses and swaps, as without a cache,
    and a trace of the default settings replays."""
    from sim.replay import replay_trace

    _, eng = run(cached_model, "batch_mtp", expert_cache_mib=1, expert_adapt_every=2)
    assert eng.overlap is not None and eng.trace.events[0]["engine"]["overlap"] is True
    assert any(ev["ev"] == "expert_swap" for ev in eng.trace.events)
    result = replay_trace(list(eng.trace.events), name="cache, overlap auto")
    assert result.ok, str(result.first_divergence)


@pytest.mark.parametrize("mode", ["solo", "batch_mtp"])
def test_overlapped_swapping_cache_keeps_the_tokens_and_its_trace_replays(cached_model, mode):
    """engine.overlap=true with a cache that misses and swaps: the tokens of the serial loop,
    and a trace the simulator replays exactly, swaps at the reads that decided them."""
    from sim.replay import replay_trace

    ref, serial = run(cached_model, mode, expert_cache_mib=1, expert_adapt_every=2)
    out, eng = run(cached_model, mode, expert_cache_mib=1, expert_adapt_every=2, overlap=True)
    assert eng.overlap is not None and out == ref
    assert eng.expert_cache.swaps > 0 and eng.expert_cache.misses > 0
    result = replay_trace(list(eng.trace.events), name=f"{mode}, swapping cache, overlap on")
    assert result.ok, str(result.first_divergence)
    swaps = [(e["step"], e["experts"]) for e in eng.trace.events if e["ev"] == "expert_swap"]
    assert swaps and swaps == [(e["step"], e["experts"]) for e in result.sim_events
                               if e["ev"] == "expert_swap"]


@pytest.mark.parametrize("mode", ["solo", "batch_mtp"])
def test_auto_overlap_runs_a_cache_that_holds_every_expert_and_its_trace_replays(cached_model, mode):
    """A budget that holds every routed expert never misses nor swaps: engine.overlap=null
    runs it overlapped, as without the cache, with the same tokens, and its trace replays."""
    from sim.replay import replay_trace

    ref, plain = run(cached_model, mode)
    out, eng = run(cached_model, mode, expert_cache_mib=64, expert_adapt_every=2)
    c = eng.expert_cache
    assert c.plan.slots == c.plan.experts and c.misses == 0 and c.swaps == 0
    assert plain.overlap is not None and eng.overlap is not None
    assert eng.trace.events[0]["engine"]["overlap"] is True
    assert out == ref
    result = replay_trace(list(eng.trace.events), name="cache holding every expert, overlap auto")
    assert result.ok, str(result.first_divergence)


def _state(cache: ExpertCache) -> dict:
    """Everything a cache's next window and adaptation depend on, as numpy arrays."""
    out = {"slot_expert": cache.slot_expert.copy(), "host_slot_of": cache.host_slot_of.copy(),
           "slot_of": cache.slot_of.numpy().copy(), "routed": cache.routed.numpy().copy(),
           "window_state": cache.window_state.numpy().copy(), "decayed": cache.decayed.copy(),
           "counters": np.array([cache.launched, cache.unread, cache._host_at])}
    for li, lc in enumerate(cache.layers):
        out[f"gate_up{li}"], out[f"down{li}"] = lc.gate_up.numpy().copy(), lc.down.numpy().copy()
    return out


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def _profile(tmp_path, plan) -> str:
    """A routing profile whose first fill is neither the lowest ids nor sorted by id alone."""
    counts = [[(e * 13 + 5 * li) % 64 for e in range(64)] for li in range(plan.moe_layers)]
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"model": "t", "layers": plan.layers, "experts": 64, "top_k": 4,
                                "tokens": 10, "counts": counts, "windows": 1,
                                "distinct_per_window": {}}))
    return str(prof)


def test_reset_returns_the_cache_to_its_first_fill(cached_model, tmp_path):
    """ExpertCache.reset after swaps and counted windows: the slots, the slot table, their
    contents and every counter an adaptation reads are those of a freshly built cache with the
    same fill; the run's totals keep counting; it refuses mid-window and with a window unread."""
    loaded = _loaded(cached_model)
    plan = plan_expert_cache(loaded.model, 1)
    prof = _profile(tmp_path, plan)
    cache = ExpertCache(loaded.model, plan, torch.device("cpu"), profile=prof, adapt_every=2)
    fresh = _state(cache)
    assert not np.array_equal(cache.first_fill, np.arange(plan.slots)[None].repeat(plan.moe_layers, 0))
    rng = np.random.default_rng(1)
    for _ in range(6):  # swaps, and the counters of launched and read windows
        cache.routed.copy_(torch.from_numpy(rng.uniform(0, 50, (plan.moe_layers, 64))).float())
        cache.window_state[:2] = torch.tensor([3, 4], dtype=torch.int32)
        cache.after_window(cache.after_launch())
    assert cache.swaps > 0 and cache.decayed.any()
    assert not np.array_equal(cache.slot_expert, cache.first_fill)
    cache.begin_window()
    with pytest.raises(RuntimeError, match="inside a decode window"):
        cache.reset()
    cache.end_window()
    counts = cache.after_launch()
    with pytest.raises(RuntimeError, match="1 launched window"):
        cache.reset()
    cache.after_window(counts)
    cache.routed.fill_(1.0)
    totals = cache.stats_fields()
    moved = cache.reset()
    assert moved > 0
    _assert_same_state(_state(cache), fresh)
    assert cache.stats_fields() == totals  # the engine's reports are not rewound
    # the same as a cache built now on another copy of the model, with the same profile
    other = ExpertCache(_loaded(cached_model).model, plan, torch.device("cpu"), profile=prof,
                        adapt_every=2)
    _assert_same_state(_state(cache), _state(other))
    for li, lc in enumerate(cache.layers):  # each slot holds its expert's bytes (host store)
        for s, e in enumerate(cache.slot_expert[li]):
            assert torch.equal(lc.gate_up[s], lc.host_gate_up[e])
    assert cache.reset() == 0  # nothing moved since


def _cohort_again(eng):
    """cohort() once more on a used engine: ids of their own, arrivals shifted to now."""
    for r in cohort():
        r.id = f"again-{r.id}"
        r.arrival_step += eng.steps
        eng.add_request(r)
    while eng.has_work():
        eng.step()
    return {rid.removeprefix("again-"): list(rs.emitted) for rid, rs in eng.requests.items()
            if rid.startswith("again-")}


def _window_counts(eng, since: int = 0) -> list:
    """(hits, misses) of each window since event `since`; none of them padded: a padding group
    routes the scratch lane's rows, whose state the cache does not own (a reset keeps it)."""
    windows = [ev for ev in eng.trace.events[since:] if ev["ev"] == "window"]
    for ev in windows:
        bucket = int(ev["key"][6:].split("x")[0]) if ev["key"].startswith("shape:") else 0
        assert bucket <= len(set(ev["layout"])), ev
    return [(ev["hits"], ev["misses"]) for ev in windows]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_after_reset_a_decode_is_a_fresh_engines(cached_model, tmp_path, overlap):
    """An engine whose cache adapted through a cohort and was reset decodes the next cohort as
    a freshly built engine with the same first fill: the same tokens, the same hits and misses
    in every window, the same swaps."""
    prof = _profile(tmp_path, plan_expert_cache(_loaded(cached_model).model, 1))
    # one slot a chunk: the requests start apart, so no window is padded (see _window_counts)
    knobs = dict(overlap=overlap, expert_cache_mib=1, expert_adapt_every=2, expert_profile=prof,
                 prefill_slots=1)
    want, fresh = run(cached_model, "batch_mtp", **knobs)
    _, eng = run(cached_model, "batch_mtp", **knobs)
    c = eng.expert_cache
    assert c.swaps > 0 and not np.array_equal(c.slot_expert, c.first_fill)
    c.reset()
    since, totals = len(eng.trace.events), c.stats_fields()
    assert _cohort_again(eng) == want
    assert _window_counts(eng, since) == _window_counts(fresh)
    assert {k: v - totals[k] for k, v in c.stats_fields().items()} == fresh.expert_cache.stats_fields()


@pytest.mark.parametrize("rows", [16, 40])
def test_prompt_chunk_bits_do_not_depend_on_the_cache(cached_model, rows):
    """A prompt chunk whose rows x top-k reaches the expert count (16 and 40 rows of top-4 over
    64 experts) takes the grouped expert path with and without the cache, so its MoE output is
    the same bits; the dense path (model.moe_dense_prefill) is other arithmetic."""
    from strata.model.qwen3_next import SparseMoe

    loaded = _loaded(cached_model)
    moe = next(m for m in loaded.model.modules() if isinstance(m, SparseMoe))
    x = torch.randn(rows, moe.experts.w_gate_up.shape[2], generator=torch.Generator().manual_seed(rows))
    assert not moe.experts.dense_input(rows, moe.top_k, True)  # the default: grouped at every size
    plain = moe(x, prompt=True)
    moe.experts.dense_prefill = True
    assert moe.experts.dense_input(rows, moe.top_k, True)
    assert not moe.experts.dense_input(rows, moe.top_k, False)  # windows: grouped
    dense = moe(x, prompt=True)
    moe.experts.dense_prefill = False
    torch.testing.assert_close(dense, plain, rtol=1e-4, atol=1e-5)  # the same function
    ExpertCache(loaded.model, plan_expert_cache(loaded.model, 1), torch.device("cpu"))
    assert moe.experts.cache is not None and not moe.experts.dense_input(rows, moe.top_k, True)
    assert torch.equal(moe(x, prompt=True), plain)


def test_dense_prefill_is_a_model_setting(cached_model):
    from strata.model.loader import load_model
    from strata.model.qwen3_next import Experts
    from omegaconf import OmegaConf
    from strata.config import ModelConfig

    mcfg = OmegaConf.structured(ModelConfig)
    mcfg.path, mcfg.moe_dense_experts = str(cached_model), 0
    for on in (False, True):
        mcfg.moe_dense_prefill = on
        model = load_model(mcfg, "cpu", log=lambda s: None).model
        assert {m.dense_prefill for m in model.modules() if isinstance(m, Experts)} == {on}


def test_dense_prefill_with_prompt_chunks_of_several_slots_is_a_clear_error(cached_model):
    """The dense prompt path is chosen by the chunk's rows, which engine.prefill_slots > 1
    changes with the other slots' chunks: the engine refuses the pair, naming both keys."""
    cfg = cpu_engine_config(cached_model, 128, prefill_slots=2)
    cfg.model.moe_dense_experts, cfg.model.moe_dense_prefill = 0, True
    with pytest.raises(ConfigError, match="moe_dense_prefill.*prefill_slots=1"):
        Engine.from_config(cfg, log=lambda s: None)
    cfg.engine.prefill_slots = 1
    Engine.from_config(cfg, log=lambda s: None).close()
