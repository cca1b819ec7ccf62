"""The graph cache and memory budget on CPU (recording backend): DESIGN.md section 5,
SCHEDULING.md "Graph cache".

Unit level: LRU order, a hit refreshes, pinned entries survive, limit 0 is unbounded, limit vs
memory evictions, the planned size (estimate, then the last measured capture), the eager
fallback with its warning logged once, capture failures, the MemoryBudget / fit_slots
arithmetic with hand-computed numbers. Engine level: a tiny device budget forces eager windows
(warning once), a budget for exactly two graphs evicts for memory, graph_limit=2 with 8 slots
evicts for the limit, and every run's output equals graphs=false; the trace's cache actions
replay against an independent LRU model.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

import pytest
import torch

from strata.engine.graph_cache import GraphCache, RecordingBackend
from strata.engine.llm_engine import Engine
from strata.engine.memory import MemoryBudget, fit_slots
from strata.engine.request import Request, SamplingParams
from strata.model.tiny import make_tiny_random
from strata.trace import TraceWriter
from conftest import cpu_engine_config

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("STRATA_BATCH_MTP", raising=False)


# ---------------------------------------------------------------------------------------------
# GraphCache unit tests
# ---------------------------------------------------------------------------------------------

class CountingBackend(RecordingBackend):
    def __init__(self, graph_mib, fail=None):
        super().__init__(graph_mib)
        self.released: list = []
        self.captured: list = []
        self.fail = fail

    def capture(self, fn):
        if self.fail is not None:
            raise self.fail
        self.captured.append(fn)
        return super().capture(fn)

    def release(self, handle):
        self.released.append(handle())


def make_cache(limit=0, total=10_000.0, reserve=0.0, weights=0.0, slot=0.0, slots=0,
               graph_mib=16.0, estimate=16.0, fail=None):
    budget = MemoryBudget(total, reserve, weights, slot, slots)
    trace = TraceWriter()
    logs: list[str] = []
    cache = GraphCache(limit, CountingBackend(graph_mib, fail), budget, trace, estimate,
                       log=logs.append)
    return cache, trace, logs


def use(cache, key, pinned=()):
    """One window with `key`: returns the graph action, after running the chosen runner."""
    warmed = []
    run = cache.run(key, lambda: key, lambda: warmed.append(1), pinned)
    assert run.output == key  # the window's function ran, replayed or eagerly
    return run.action


def evicts(trace):
    return [(ev["key"], ev["reason"]) for ev in trace.events if ev["ev"] == "evict"]


def test_lru_order_and_limit_eviction():
    cache, trace, _ = make_cache(limit=3)
    assert [use(cache, k) for k in "abc"] == ["capture"] * 3
    assert use(cache, "d") == "capture"
    assert evicts(trace) == [("a", "limit")]
    assert list(cache.entries) == ["b", "c", "d"]
    assert use(cache, "e") == "capture"
    assert evicts(trace) == [("a", "limit"), ("b", "limit")]
    assert cache.backend.released == ["a", "b"]
    assert (cache.captures, cache.hits, cache.evictions) == (5, 0, 2)


def test_hit_refreshes_entry():
    cache, trace, _ = make_cache(limit=3)
    for k in "abc":
        use(cache, k)
    assert use(cache, "a") == "hit"
    assert list(cache.entries) == ["b", "c", "a"]
    use(cache, "d")
    assert evicts(trace) == [("b", "limit")]
    assert use(cache, "a") == "hit"
    assert use(cache, "c") == "hit"
    use(cache, "e")
    assert evicts(trace)[-1] == ("d", "limit")
    assert cache.hits == 3 and len(cache.backend.captured) == 5  # a hit never re-captures


def test_pinned_entry_survives_eviction():
    cache, trace, _ = make_cache(limit=3)
    for k in "abc":
        use(cache, k)
    use(cache, "d", pinned={"a"})  # a is least recently used but pinned: b goes
    assert evicts(trace) == [("b", "limit")]
    assert "a" in cache.entries
    # everything pinned: nothing is evicted (the cache may exceed its limit for this window)
    use(cache, "e", pinned={"a", "c", "d"})
    assert evicts(trace) == [("b", "limit")]
    assert set(cache.entries) == {"a", "c", "d", "e"}
    use(cache, "f")
    assert evicts(trace)[-1] == ("a", "limit")


def test_limit_zero_is_unbounded():
    cache, trace, _ = make_cache(limit=0)
    for i in range(60):
        assert use(cache, f"k{i}") == "capture"
    assert len(cache.entries) == 60 and evicts(trace) == []
    assert cache.graphs_mib == 60 * 16.0


def test_memory_eviction_keeps_what_fits():
    # budget for graphs = 100 - 20 - (30 + 2 x 5) = 40 MiB: two graphs of 16
    cache, trace, logs = make_cache(limit=10, total=100, reserve=20, weights=30, slot=5, slots=2)
    assert use(cache, "a") == "capture" and use(cache, "b") == "capture"
    assert cache.graphs_mib == 32
    assert use(cache, "c") == "capture"
    assert evicts(trace) == [("a", "memory")]
    assert use(cache, "b") == "hit"
    assert use(cache, "d") == "capture"
    assert evicts(trace) == [("a", "memory"), ("c", "memory")]
    assert not logs  # nothing ran eagerly


def test_limit_then_memory_eviction_in_one_miss():
    # graph budget 40 MiB, limit 2: a miss on a full cache evicts for the limit first, then
    # for memory while the planned size (the last measured capture) does not fit
    cache, trace, _ = make_cache(limit=2, total=100, reserve=20, weights=30, slot=5, slots=2,
                                 graph_mib=12, estimate=12)
    use(cache, "a")
    use(cache, "b")  # 24 MiB held, 16 left
    cache.backend.graph_mib = 24  # the next capture measures 24
    use(cache, "c")  # limit evicts a; 12 planned fits 28; the capture measures 24 (held 36)
    assert evicts(trace) == [("a", "limit")]
    use(cache, "d")  # limit evicts b: 24 held, 16 left < 24 planned: memory evicts c
    assert evicts(trace) == [("a", "limit"), ("b", "limit"), ("c", "memory")]
    assert list(cache.entries) == ["d"]


def test_planned_size_is_estimate_then_last_measured():
    # budget 40; the estimate (50) does not fit although a real capture (16) would
    cache, trace, logs = make_cache(total=100, reserve=20, weights=30, slot=5, slots=2, estimate=50)
    assert use(cache, "a") == "eager"
    # a small estimate lets the first capture happen; its measured 30 MiB plans the next
    cache, trace, logs = make_cache(total=100, reserve=20, weights=30, slot=5, slots=2,
                                    estimate=1, graph_mib=30)
    assert use(cache, "a") == "capture"
    assert use(cache, "b") == "capture"  # a (30) is evicted for memory: 30 fits 40
    assert evicts(trace) == [("a", "memory")]


def test_eager_fallback_warns_once():
    # budget 100 - 20 - 70 = 10 MiB < 16 planned: nothing is ever captured
    cache, trace, logs = make_cache(limit=4, total=100, reserve=20, weights=60, slot=5, slots=2)
    assert [use(cache, k) for k in ("a", "b", "a", "c")] == ["eager"] * 4
    assert cache.eager == 4 and not cache.entries and not cache.backend.captured
    warn = [s for s in logs if s.startswith("WARNING")]
    assert len(warn) == 1 and "graph memory" in warn[0] and "eager" in warn[0]
    assert [ev["ev"] for ev in trace.events] == ["warning"]


def test_capture_failure_runs_eagerly_and_warns_once():
    cache, trace, logs = make_cache(fail=RuntimeError("cudaErrorStreamCaptureInvalidated"))
    assert use(cache, "a") == "eager" and use(cache, "b") == "eager"
    assert not cache.entries
    warn = [s for s in logs if s.startswith("WARNING")]
    assert len(warn) == 1 and "cudaErrorStreamCaptureInvalidated" in warn[0]


def test_drop_evicts_with_reason_error():
    cache, trace, _ = make_cache()
    use(cache, "a")
    cache.drop("a")
    cache.drop("missing")  # no entry: nothing happens
    assert evicts(trace) == [("a", "error")]
    assert use(cache, "a") == "capture"


# ---------------------------------------------------------------------------------------------
# MemoryBudget and fit_slots, hand-computed
# ---------------------------------------------------------------------------------------------

def test_memory_budget_arithmetic():
    b = MemoryBudget(total_mib=24576, reserve_mib=2048, weights_mib=1.5, slot_mib=0.25, slots=4)
    assert b.planned_mib() == 2.5
    assert b.graph_budget_mib(0) == 24576 - 2048 - 2.5 == 22525.5
    assert b.graph_budget_mib(32) == 22493.5
    assert b.free_mib(32) == 24576 - 2.5 - 32 == 24541.5
    d = b.as_dict()
    assert d == {"total_mib": 24576, "weights_mib": 1.5, "slot_mib": 0.25, "slots": 4,
                 "reserve_mib": 2048}
    # on CUDA the budget is also capped by the device's free memory minus the reserve
    c = MemoryBudget(24576, 2048, 1.5, 0.25, 4, device_free_mib=lambda: 3000.0)
    assert c.graph_budget_mib(32) == 3000 - 2048 == 952
    c = MemoryBudget(24576, 2048, 1.5, 0.25, 4, device_free_mib=lambda: 1e9)
    assert c.graph_budget_mib(32) == 22493.5


def test_budget_empties_the_allocator_cache_only_when_the_device_figure_stands_in_the_way():
    """Captures leave the main pool's unused blocks cached, where the device's free figure does
    not count them: a graph that the arithmetic budget holds but the device figure refuses
    fits once the cache is emptied (reclaim), and nothing is emptied otherwise."""
    free, calls = [1000.0], []

    def reclaim():
        calls.append(1)
        free[0] = 3000.0

    b = MemoryBudget(24576, 2048, 1.5, 0.25, 4, device_free_mib=lambda: free[0], reclaim=reclaim)
    assert b.graph_fits(500, 0) and calls == [1]  # 1000 - 2048 < 500; emptied: 952 >= 500
    assert b.graph_fits(900, 0) and calls == [1]  # fits as it is
    assert not b.graph_fits(30000, 0) and calls == [1]  # the arithmetic refuses: no emptying
    assert not b.graph_fits(960, 0) and calls == [1, 1]  # emptied, still short
    assert not b.graph_fits(960, 0) and calls == [1, 1]  # not again while the graphs held stay
    assert not b.graph_fits(960, 16) and calls == [1, 1, 1]  # they changed: tried again
    free[0] = 1000.0
    plain = MemoryBudget(24576, 2048, 1.5, 0.25, 4, device_free_mib=lambda: free[0])
    assert not plain.graph_fits(500, 0)  # nothing to reclaim with


def test_cache_captures_after_the_budget_reclaims():
    free, calls = [2048.0], []

    def reclaim():
        calls.append(1)
        free[0] = 2048.0 + 64

    budget = MemoryBudget(4096, 2048, 0.0, 0.0, 1, device_free_mib=lambda: free[0], reclaim=reclaim)
    cache = GraphCache(0, CountingBackend(16.0), budget, TraceWriter(), 16.0, log=lambda s: None)
    assert cache.has_room() and calls == [1]
    assert use(cache, "a") == "capture"


def test_cuda_backend_captures_without_emptying_caches_and_retries_out_of_memory(monkeypatch):
    """A capture runs in the graph's private pool, so the allocator's caches stay as they are
    (torch.cuda.graph would empty them before every capture); a capture that runs out of
    memory empties them and is tried once more."""
    from strata.engine import device as device_mod
    from strata.engine.graph_cache import CudaGraphBackend

    events = []

    class OOM(RuntimeError):
        pass

    class Graph:
        def capture_begin(self, capture_error_mode):
            events.append("begin")

        def capture_end(self):
            events.append("end")

    class FakeCuda:
        OutOfMemoryError = OOM
        CUDAGraph = Graph

        @staticmethod
        def synchronize(device=None):
            pass

        @staticmethod
        def mem_get_info(device=None):
            return (1000, 2000)

        @staticmethod
        def memory_reserved(device=None):
            return 0

        @staticmethod
        def stream(s):
            import contextlib
            return contextlib.nullcontext()

    class FakeTorch:
        cuda = FakeCuda

    monkeypatch.setattr(device_mod, "empty_allocator_caches", lambda d: events.append("empty"))
    backend = object.__new__(CudaGraphBackend)
    backend.torch, backend.device, backend.stream = FakeTorch, "cuda", None
    backend.capture_error_mode = "global"
    handle, mib = backend.capture(lambda: events.append("fn") or "out")
    assert events == ["begin", "fn", "end"] and handle[1] == "out" and mib == 0
    events.clear()
    tries = []

    def oom_once():
        tries.append(1)
        if len(tries) == 1:
            raise OOM("out of memory")
        return "out"

    handle, _ = backend.capture(oom_once)
    assert events == ["begin", "end", "empty", "begin", "end"] and handle[1] == "out"


def test_fit_slots_arithmetic():
    # floor((total - reserve - weights - one graph) / per slot), capped at asked
    assert fit_slots(8, 1000, 200, 100, 50, 16) == 8  # room 684 -> 13
    assert fit_slots(20, 1000, 200, 100, 50, 16) == 13
    assert fit_slots(20, 1000, 200, 100, 50, 34) == 13  # room 666 -> 13.32
    assert fit_slots(20, 1000, 200, 100, 50, 35) == 13  # room 665 -> 13.3
    assert fit_slots(20, 1000, 200, 100, 50, 66) == 12  # room 634 -> 12.68
    assert fit_slots(4, 300, 200, 100, 50, 16) == 0  # nothing left
    assert fit_slots(4, 316, 200, 100, 16, 0) == 1
    assert fit_slots(3, 10, 0, 0, 0.0, 0) == 3


# ---------------------------------------------------------------------------------------------
# Engine level
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("graphs-random"), seed=7, tokenizer=False)


@pytest.fixture(scope="session")
def no_mtp_dir(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("graphs-nomtp"), seed=7, with_mtp=False,
                            tokenizer=False)


def build(model_dir, **knobs):
    # The serial loop: check_cache_trace's model has a window's evictions in its own step
    # (engine.overlap writes the window event one step after its launch's evictions).
    knobs.setdefault("overlap", False)
    cfg = cpu_engine_config(model_dir, **knobs)
    logs: list[str] = []
    eng = Engine.from_config(cfg, log=logs.append)
    eng.logs = logs
    return eng


@pytest.fixture(scope="session")
def facts(model_dir):
    """weights and per-slot MiB as the engine reports them (config trace line)."""
    mem = build(model_dir, slots=4).trace.events[0]["memory"]
    return mem["weights_mib"], mem["slot_mib"]


def workload(n=8, seed=0):
    rng = random.Random(seed)
    return [Request(f"g{i}", [rng.randrange(1, 512) for _ in range(rng.randint(2, 9))],
                    SamplingParams(max_tokens=rng.randint(4, 10), stop_at_eos=False),
                    arrival_step=rng.randint(0, 6)) for i in range(n)]


def run(eng, requests):
    for r in requests:
        eng.add_request(r)
    while eng.has_work():
        eng.step()
    return {rid: rs.emitted for rid, rs in eng.requests.items()}


def check_cache_trace(events, limit: int):
    """Replay the window/evict events against an independent LRU model of SCHEDULING.md."""
    entries: OrderedDict[str, None] = OrderedDict()
    pending: list[dict] = []
    for ev in events:
        if ev["ev"] == "evict":
            if ev["reason"] == "error":
                entries.pop(ev["key"])
            else:
                pending.append(ev)
        elif ev["ev"] == "window":
            key, action = ev["key"], ev["graph"]
            if action == "hit":
                assert key in entries and not pending
                entries.move_to_end(key)
                continue
            assert key not in entries, f"miss on a cached key {key}"
            for i, e in enumerate(pending):
                assert e["step"] == ev["step"]
                victim = next(iter(entries))
                assert e["key"] == victim, f"evicted {e['key']}, LRU is {victim}"
                if e["reason"] == "limit":
                    assert i == 0 and limit > 0 and len(entries) == limit
                entries.pop(victim)
            pending = []
            if action == "capture":
                entries[key] = None
                assert limit == 0 or len(entries) <= limit
    assert not pending
    return entries


def cache_events(eng, name, **match):
    return [ev for ev in eng.trace.events if ev["ev"] == name
            and all(ev.get(k) == v for k, v in match.items())]


@pytest.mark.parametrize("graph_key", ["layout", "shape"])
def test_graph_limit_2_with_8_slots(model_dir, graph_key):
    ref = run(build(model_dir, slots=8, graphs=False), workload())
    eng = build(model_dir, slots=8, graphs=True, graph_key=graph_key, graph_limit=2)
    out = run(eng, workload())
    assert out == ref
    assert len(eng.scheduler.slots) == 8
    ev = cache_events(eng, "evict")
    assert ev and all(e["reason"] == "limit" for e in ev)
    assert cache_events(eng, "window", graph="capture") and cache_events(eng, "window", graph="hit")
    assert len(eng.cache.entries) <= 2
    check_cache_trace(eng.trace.events, 2)
    assert eng.stats()["graph_evictions"] == len(ev)


def test_graphs_off_never_touches_the_cache(model_dir):
    eng = build(model_dir, slots=4, graphs=False)
    run(eng, workload(4))
    assert eng.cache is None
    assert {ev["graph"] for ev in cache_events(eng, "window")} == {"eager"}
    assert not cache_events(eng, "evict")


def test_budget_for_two_graphs_evicts_for_memory(model_dir, facts):
    weights, slot = facts
    reserve = 8
    total = math.ceil(reserve + weights + 4 * slot + 40)  # graph budget in [40, 41): two of 16
    eng = build(model_dir, slots=4, graphs=True, graph_key="layout", graph_limit=0,
                cpu_device_mib=total, vram_reserve_mib=reserve, cpu_graph_mib=16.0,
                graph_mib_estimate=16.0)
    assert len(eng.scheduler.slots) == 4 and eng.batch_mtp
    out = run(eng, workload(6, seed=1))
    assert out == run(build(model_dir, slots=4, graphs=False), workload(6, seed=1))
    ev = cache_events(eng, "evict")
    assert ev and all(e["reason"] == "memory" for e in ev)
    assert not cache_events(eng, "window", graph="eager")
    assert len(eng.cache.entries) <= 2
    check_cache_trace(eng.trace.events, 0)
    assert not [s for s in eng.logs if s.startswith("WARNING")]


def test_tiny_budget_forces_eager_with_one_warning(model_dir, facts):
    weights, slot = facts
    reserve = 8
    total = math.ceil(reserve + weights + 4 * slot + 16) + 1  # room for the 16 MiB estimate
    eng = build(model_dir, slots=4, graphs=True, graph_key="layout", graph_limit=8,
                cpu_device_mib=total, vram_reserve_mib=reserve, cpu_graph_mib=64.0,
                graph_mib_estimate=16.0)
    assert len(eng.scheduler.slots) == 4
    out = run(eng, workload(6, seed=2))
    assert out == run(build(model_dir, slots=4, graphs=False), workload(6, seed=2))
    eager = cache_events(eng, "window", graph="eager")
    assert len(eager) >= 3
    warn = [s for s in eng.logs if s.startswith("WARNING")]
    assert len(warn) == 1 and "graph memory exhausted" in warn[0], warn
    assert len(cache_events(eng, "warning")) == 1
    # the one capture that fitted the estimate measured 64 MiB and was evicted for memory
    assert all(e["reason"] == "memory" for e in cache_events(eng, "evict"))
    check_cache_trace(eng.trace.events, 8)
    assert eng.stats()["graph_eager"] == len(eager)


def test_slot_count_follows_memory(no_mtp_dir):
    probe = build(no_mtp_dir, slots=4, batch_mtp=False).trace.events[0]["memory"]
    weights, slot = probe["weights_mib"], probe["slot_mib"]
    reserve, total = 8, 64
    # room = total - reserve - weights - graph_mib_estimate = 2.5 slots: two slots run
    est = total - reserve - weights - 2.5 * slot
    eng = build(no_mtp_dir, slots=4, cpu_device_mib=total, vram_reserve_mib=reserve,
                graph_mib_estimate=est, batch_mtp=False)
    assert len(eng.scheduler.slots) == 2
    assert any(s.startswith("INFO slots=2 (asked 4)") for s in eng.logs), eng.logs
    assert eng.trace.events[0]["memory"]["slots"] == 2
    assert eng.trace.events[0]["engine"]["slots"] == 2
    out = run(eng, workload(4))
    assert all(len(v) == eng.requests[k].req.params.max_tokens for k, v in out.items())
    # nothing fits: a config error that says what to lower
    with pytest.raises(Exception, match="engine.slots"):
        build(no_mtp_dir, slots=4, cpu_device_mib=total, vram_reserve_mib=reserve,
              graph_mib_estimate=total - reserve - weights - 0.5 * slot, batch_mtp=False)


def test_draft_state_that_does_not_fit_turns_batch_mtp_off(model_dir, facts):
    weights, slot = facts
    reserve, total = 8, 64
    # room for 3.5 slots with their draft state, more than 4 without it
    est = total - reserve - weights - 3.5 * slot
    eng = build(model_dir, slots=4, cpu_device_mib=total, vram_reserve_mib=reserve,
                graph_mib_estimate=est, batch_mtp=True)
    assert not eng.batch_mtp and not eng.drafting
    assert len(eng.scheduler.slots) == 4
    off = [s for s in eng.logs if s.startswith("WARNING: batch_mtp is off: ")]
    assert len(off) == 1 and "draft state" in off[0]
    # the slots that run, with what is allocated and charged for them, fit beside the reserve
    # and one graph (fit_slots' rule); with drafting off no draft state should be held
    assert eng.budget.planned_mib() <= total - reserve - est + 1e-6, \
        (eng.budget.planned_mib(), total - reserve - est)
    assert not [s for s in eng.logs if "graph memory exhausted" in s]
    run(eng, workload(4))
    assert all(rs.reason == "length" for rs in eng.requests.values())


def test_prefill_graphs_one_per_bucket_and_tier_charged_to_budget(model_dir):
    """Prompt chunks padded to buckets replay one captured plan per (bucket, tier), charge each
    to the memory budget, and give the same tokens as chunks run eagerly and unpadded."""
    reqs = lambda: [Request(f"p{i}", [(7 * i + j) % 500 + 1 for j in range(n)],  # noqa: E731
                            SamplingParams(max_tokens=6, stop_at_eos=False))
                    for i, n in enumerate([3, 9, 17, 40, 12, 70])]
    plain = build(model_dir, slots=2, prefill_buckets=[1], prefill_chunk=32)  # unpadded
    want = run(plain, reqs())
    eng = build(model_dir, slots=2, prefill_buckets=[8, 16, 32], prefill_chunk=32,
                prefill_slots=1)  # one slot a chunk: graphs keyed by (bucket, tier)
    eng.runner.p_backend = RecordingBackend(3.0)
    planned = eng.budget.planned_mib()
    got = run(eng, reqs())
    assert got == want
    # chunks: 3->8, 9->16, 17->32, 40->32+8, 12->16, 70->32+32+8; all in the first tier (256);
    # greedy requests do not filter: the plain sampler's graphs
    assert sorted(eng.runner.p_graphs) == [(8, 256, False), (16, 256, False), (32, 256, False)]
    assert eng.budget.planned_mib() == pytest.approx(planned + 9.0)
    assert eng.stats()["prefill_graphs"] == 3
    eng.close()
    assert eng.budget.planned_mib() == pytest.approx(planned)


def test_a_filtering_request_gets_its_own_prompt_chunk_graph_and_the_same_tokens(model_dir):
    """The prompt chunk's sampler follows the request (`SamplingParams.filtered`, as a
    window's): a top-k request's chunk replays a graph of the sorting sampler, the greedy and
    plain-temperature ones share the plain sampler's, and every request samples as eagerly."""
    params = [SamplingParams(max_tokens=6, stop_at_eos=False),
              SamplingParams(max_tokens=6, stop_at_eos=False, temperature=0.8, seed=3),
              SamplingParams(max_tokens=6, stop_at_eos=False, temperature=0.8, top_k=20, seed=4),
              SamplingParams(max_tokens=6, stop_at_eos=False, temperature=0.9, top_p=0.7, seed=5)]
    reqs = lambda: [Request(f"f{i}", [(5 * i + j) % 400 + 1 for j in range(12)], p)  # noqa: E731
                    for i, p in enumerate(params)]
    want = run(build(model_dir, slots=2, prefill_buckets=[1], prefill_chunk=32), reqs())
    eng = build(model_dir, slots=2, prefill_buckets=[16], prefill_chunk=32, prefill_slots=1)
    eng.runner.p_backend = RecordingBackend(1.0)
    assert run(eng, reqs()) == want
    assert sorted(eng.runner.p_graphs) == [(16, 256, False), (16, 256, True)]


def test_prefill_bucket_config_is_validated(model_dir):
    from strata.config import ConfigError

    with pytest.raises(ConfigError, match="engine.prefill_buckets"):
        build(model_dir, prefill_buckets=[32, 16])


def test_cuda_backend_release_drops_the_graph_before_freeing_its_pool():
    """The CUDA backend's handle is emptied before the allocator cache is emptied, so the
    graph's private pool is free to go back to the device (no reference left alive)."""
    from strata.engine.graph_cache import CudaGraphBackend

    seen = []

    class FakeCuda:
        @staticmethod
        def empty_cache():
            seen.append(list(handle))

    class FakeTorch:
        cuda = FakeCuda

    backend = object.__new__(CudaGraphBackend)
    backend.torch = FakeTorch
    handle = [object(), object()]
    backend.release(handle)
    assert handle == [] and seen == [[]]


def test_warmup_runs_every_shape_on_scratch_and_changes_nothing(model_dir):
    """engine.warmup=on runs the window shapes and prompt buckets before any request; the
    trace gains nothing and every request decodes exactly as without it."""
    reqs = lambda: workload(n=6, seed=3)  # noqa: E731
    plain = build(model_dir, slots=4, warmup="off")
    want = run(plain, reqs())
    warm = build(model_dir, slots=4, warmup="on", graph_key="layout")
    assert [e["ev"] for e in warm.trace.events] == ["config"]
    assert any(line.startswith("INFO warm-up:") for line in warm.logs)
    assert run(warm, reqs()) == want
    assert not any(line.startswith("INFO warm-up:") for line in plain.logs)  # auto = off on CPU


def test_warmup_freezes_the_collectors_heap_and_close_thaws_it(model_dir):
    """engine.gc_freeze (on): after the warm-up every object then alive is in the collector's
    permanent generation, so serving's full passes skip the model and graphs; the engine
    decodes as before, and close() thaws them. Off: nothing is frozen."""
    import gc

    reqs = lambda: workload(n=4, seed=5)  # noqa: E731
    want = run(build(model_dir, slots=4, warmup="off"), reqs())
    gc.unfreeze()  # (an engine of an earlier test left open may have frozen them)
    warm = build(model_dir, slots=4, warmup="on", graph_key="layout")
    assert gc.get_freeze_count() > 0
    assert any(line.startswith("INFO gc:") and "objects frozen" in line for line in warm.logs)
    assert run(warm, reqs()) == want
    warm.close()
    assert gc.get_freeze_count() == 0
    off = build(model_dir, slots=4, warmup="on", graph_key="layout", gc_freeze=False)
    assert gc.get_freeze_count() == 0
    assert not any(line.startswith("INFO gc:") for line in off.logs)
    off.close()


def test_warmup_runs_chunks_of_several_slots_when_prefill_slots_asks(model_dir, monkeypatch):
    """With engine.prefill_slots > 1 the warm-up also runs every bucket as a chunk of that many
    segments (at most the slots), all on the scratch lane, so the compile of a segment count
    past 1 happens there; requests then decode as without the warm-up."""
    from strata.engine.verifier import Verifier

    grids = []
    inner = Verifier.prefill

    def spy(self, tokens, meta, *a, **kw):
        grids.append((tuple(tokens.shape), meta.reshape(-1, 4)[:, 0].tolist()))
        return inner(self, tokens, meta, *a, **kw)

    monkeypatch.setattr(Verifier, "prefill", spy)
    reqs = lambda: workload(n=5, seed=4)  # noqa: E731
    want = run(build(model_dir, slots=3, warmup="off", prefill_slots=3), reqs())
    grids.clear()
    warm = build(model_dir, slots=3, warmup="on", graph_key="layout", prefill_slots=8)
    scratch = warm.runner.scratch
    shared = [(shape, lanes) for shape, lanes in grids if len(shape) == 2]
    assert {shape for shape, _ in shared} == {(3, b) for b in warm.cfg.prefill_buckets}
    assert all(lanes == [scratch] * 3 for _, lanes in shared)
    assert any("also as chunks of 3 slots" in line for line in warm.logs)
    assert run(warm, reqs()) == want


def test_warmup_knob_is_validated(model_dir):
    from strata.config import ConfigError

    with pytest.raises(ConfigError, match="engine.warmup"):
        build(model_dir, warmup="sometimes")


def test_padding_past_the_context_end_is_harmless(model_dir):
    """A prompt chunk near the end of the context, padded to a bucket that reaches past the
    slot's last position: the padding's K/V writes clamp into the spare rows and every request
    decodes as with unpadded chunks."""
    reqs = lambda: [Request(f"e{i}", [(11 * i + j) % 500 + 1 for j in range(n)],  # noqa: E731
                            SamplingParams(max_tokens=8, stop_at_eos=False))
                    for i, n in enumerate([58, 61, 40])]
    want = run(build(model_dir, slots=2, max_context=64, prefill_buckets=[1]), reqs())
    got = run(build(model_dir, slots=2, max_context=64, prefill_buckets=[128]), reqs())
    assert got == want
    assert all(len(v) > 0 for v in got.values())


def test_warmup_captures_every_prompt_chunk_graph(model_dir):
    """With prompt-chunk graphs on, the warm-up captures one per (bucket, tier a chunk of that
    bucket can read) on the scratch lane, so no request's time to first token pays a capture."""
    eng = build(model_dir, slots=2, warmup="off", max_context=1024, context_tier_min=256)
    eng.runner.p_backend = RecordingBackend(1.0)
    eng.warmup()
    want = {(b, t, False) for b in (16, 32, 64, 128, 256) for t in (256, 512, 1024)}
    assert set(eng.runner.p_graphs) == want
    assert any("15 prompt-chunk graphs and" in line for line in eng.logs)
    before = len(eng.runner.p_graphs)
    run(eng, workload(n=3, seed=5))
    assert len(eng.runner.p_graphs) == before  # requests found every graph there


def test_run_reports_action_output_size_and_evictions():
    cache, trace, _ = make_cache(limit=2, graph_mib=12.0)
    first = cache.run("a", lambda: "out-a", lambda: None)
    assert (first.action, first.output, first.mib, first.evicted) == ("capture", "out-a", 12.0, [])
    cache.run("b", lambda: "out-b", lambda: None)
    hit = cache.run("a", lambda: "out-a", lambda: None)
    assert (hit.action, hit.mib, hit.evicted) == ("hit", None, [])
    third = cache.run("c", lambda: "out-c", lambda: None)  # the limit evicts b (LRU)
    assert third.action == "capture" and third.evicted == ["b"]
    assert evicts(trace) == [("b", "limit")]
