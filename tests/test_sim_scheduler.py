"""Scheduler rules: decode_share, group sizing, graph cache (LRU, limit, memory), acceptance,
cost interpolation. Small direct checks of each component against docs/SCHEDULING.md."""

from __future__ import annotations

import pytest

from sim.acceptance import (FixedRateAcceptance, MarkovAcceptance, RecordedAcceptance,
                            fit_acceptance)
from sim.config import SimEngineConfig
from sim.costs import CostProfile, ProfileError
from sim.graph_cache import GraphCache, MemoryFacts
from sim.scheduler import SimEngine
from sim.streams import RandomStreams
from sim.workload import SimRequest


def kinds(share, n):
    """The kind of the first n mixed iterations under decode_share `share`."""
    eng = SimEngine.__new__(SimEngine)
    eng.knobs = SimEngineConfig(decode_share=share)
    eng._mixed_iterations = eng._mixed_decodes = 0
    return "".join(eng._iteration_kind(True, True)[0].upper() for _ in range(n))


def test_decode_share_half_alternates_decode_first():
    assert kinds(0.5, 8) == "DPDPDPDP"


def test_decode_share_patterns():
    assert kinds(0.75, 8) == "DDDPDDDP"
    assert kinds(0.25, 8) == "DPPPDPPP"
    assert kinds(1.0, 5) == "DDDDD"
    # 1/3: d < n/3 -> D at n=1, then P P, D at n=4 (1 < 1.33) ...
    assert kinds(1 / 3, 9) == "DPPDPPDPP"


def test_single_kind_runs_without_touching_counters():
    eng = SimEngine.__new__(SimEngine)
    eng.knobs = SimEngineConfig(decode_share=0.5)
    eng._mixed_iterations = eng._mixed_decodes = 0
    assert eng._iteration_kind(False, True) == "decode"
    assert eng._iteration_kind(True, False) == "prefill"
    assert eng._iteration_kind(False, False) == "idle"
    assert (eng._mixed_iterations, eng._mixed_decodes) == (0, 0)
    # The counters never reset: the next mixed iteration is still the first one.
    assert eng._iteration_kind(True, True) == "decode"


@pytest.mark.parametrize("mode,batch_mtp,drafting,lone,expected", [
    ("solo", False, True, True, 4),
    ("solo", True, False, True, 1),
    ("batch", True, True, True, 4),     # lone slot runs the solo window
    ("batch", False, True, True, 4),    # with or without batch_mtp
    ("batch", True, False, True, 1),
    ("batch", True, True, False, 2),
    ("batch", False, True, False, 1),
    ("batch", True, False, False, 1),   # batch_mtp without drafting batches as usual
])
def test_base_rows(mode, batch_mtp, drafting, lone, expected):
    eng = SimEngine.__new__(SimEngine)
    eng.knobs = SimEngineConfig(mode=mode, batch_mtp=batch_mtp, drafting=drafting, spec=4)
    eng.drafting = drafting
    assert eng._base_rows(lone) == expected


@pytest.mark.parametrize("drafts,window_rows,decoding,expected", [
    (1, 16, 2, 2),      # the default: one draft whatever the room
    (None, 16, 2, 4),   # up to spec - 1 drafts
    (None, 16, 5, 3),   # 16 // 5
    (None, 8, 5, 2),    # never fewer than 2: the ring rotates the rest
    (2, 16, 2, 3),      # at most 2 drafts
])
def test_base_rows_of_deeper_batch_mtp_groups(drafts, window_rows, decoding, expected):
    """engine.batch_mtp_drafts: W // D rows a group, between 2 and 1 + the drafts."""
    eng = SimEngine.__new__(SimEngine)
    eng.knobs = SimEngineConfig(mode="batch", batch_mtp=True, drafting=True, spec=4,
                                window_rows=window_rows, batch_mtp_drafts=drafts)
    eng.drafting = True
    assert eng._base_rows(False, decoding) == expected


# --- graph cache -----------------------------------------------------------------------------

def memory(total=10_000.0, reserve=0.0, weights=0.0, slot=0.0, slots=0, estimate=16.0,
           overhead=0.0):
    return MemoryFacts(total_mib=total, weights_mib=weights, slot_mib=slot, slots=slots,
                       reserve_mib=reserve, graph_mib_estimate=estimate,
                       runtime_overhead_mib=overhead)


def test_lru_limit_evicts_least_recently_used():
    c = GraphCache(limit=2, policy="counted", memory=memory(), measure_capture=lambda: 16.0)
    assert c.window("a").action == "capture"
    assert c.window("b").action == "capture"
    assert c.window("a").action == "hit"  # a is now most recent
    d = c.window("c")
    assert d.action == "capture" and d.evictions == [("b", "limit")]
    assert c.keys_lru_first == ["a", "c"]


def test_limit_zero_is_unbounded():
    c = GraphCache(limit=0, policy="counted", memory=memory(), measure_capture=lambda: 1.0)
    for i in range(100):
        assert c.window(f"k{i}").evictions == []
    assert len(c) == 100


def test_memory_eviction_then_capture():
    # Budget 40 MiB: two 16 MiB graphs fit, the third evicts the LRU for memory.
    c = GraphCache(limit=0, policy="counted",
                   memory=memory(total=100, reserve=20, weights=30, slot=5, slots=2),
                   measure_capture=lambda: 16.0)
    assert c.budget_mib() == 40
    c.window("a"), c.window("b")
    d = c.window("c")
    assert d.action == "capture" and d.evictions == [("a", "memory")]
    assert c.held_mib == 32


def test_limit_then_memory_eviction_in_one_miss():
    c = GraphCache(limit=2, policy="counted", memory=memory(total=40),
                   measure_capture=lambda: 16.0)
    c.window("a"), c.window("b")
    # Limit evicts a; then measured 16 > 40 - 16 - ... fits (24 >= 16): no memory eviction.
    assert c.window("c").evictions == [("a", "limit")]
    c2 = GraphCache(limit=2, policy="counted", memory=memory(total=40),
                    measure_capture=iter([16.0, 16.0, 30.0, 30.0]).__next__)
    c2.window("a"), c2.window("b"), c2.window("c")  # c measured 30: held 16 + 30 = 46 > 40
    d = c2.window("d")  # limit evicts b; planned 30 > 40 - 30: evict c (memory); capture
    assert d.evictions == [("b", "limit"), ("c", "memory")] and d.action == "capture"


def test_eager_when_nothing_left_to_evict():
    c = GraphCache(limit=0, policy="counted", memory=memory(total=20, estimate=16),
                   measure_capture=lambda: 24.0)
    assert c.window("a").action == "capture"  # the estimate fit; the capture measured 24
    d = c.window("b")
    assert d.evictions == [("a", "memory")]
    assert d.action == "eager" and "cannot hold" in d.eager_reason
    assert c.window("b").action == "eager" and len(c) == 0


def test_estimate_too_big_runs_eager_from_the_start():
    c = GraphCache(limit=0, policy="counted", memory=memory(total=10, estimate=16),
                   measure_capture=lambda: 1.0)
    assert c.window("a").action == "eager" and c.captures == 0


def test_upstream_policy_fails_capture_when_reserve_runs_out():
    # Reserve 100, overhead 20: 80 MiB for graphs; 22 MiB each: 3 fit, the 4th fails.
    c = GraphCache(limit=32, policy="upstream", memory=memory(reserve=100, overhead=20),
                   measure_capture=lambda: 22.0)
    assert [c.window(k).action for k in "abc"] == ["capture"] * 3
    d = c.window("d")
    assert d.capture_failed and c.captures == 3


def test_upstream_policy_levels_off_with_limit_evictions():
    c = GraphCache(limit=3, policy="upstream", memory=memory(reserve=100),
                   measure_capture=lambda: 22.0)
    for i in range(20):
        assert not c.window(f"k{i}").capture_failed
    assert c.held_mib == 66


# --- acceptance ------------------------------------------------------------------------------

def req(i):
    return SimRequest(id=f"r{i}", index=i, prompt_tokens=1, max_tokens=1, arrival_step=0)


def test_fixed_rate_edges_and_determinism():
    s = RandomStreams(3)
    assert FixedRateAcceptance(1.0, s).accepted(req(0), 3) == 3
    assert FixedRateAcceptance(0.0, s).accepted(req(0), 3) == 0
    a = FixedRateAcceptance(0.6, RandomStreams(3))
    b = FixedRateAcceptance(0.6, RandomStreams(3))
    # Per-request streams: the outcome of a request does not depend on the interleaving.
    seq_a = [a.accepted(req(0), 3) for _ in range(20)] + [a.accepted(req(1), 3) for _ in range(20)]
    r1 = [b.accepted(req(1), 3) for _ in range(20)]
    r0 = [b.accepted(req(0), 3) for _ in range(20)]
    assert seq_a == r0 + r1


def test_fixed_rate_mean():
    a = FixedRateAcceptance(0.7, RandomStreams(1))
    n = 4000
    judged = accepted = 0
    for i in range(n):
        k = a.accepted(req(i), 1)
        judged += 1
        accepted += k
    assert abs(accepted / judged - 0.7) < 0.03


@pytest.mark.slow
def test_markov_fit_recovers_parameters():
    m = MarkovAcceptance(0.9, 0.3, 0.6, RandomStreams(5))
    commits = []
    for i in range(300):
        for _ in range(30):
            commits.append({"req": i, "drafted": 1, "accepted": m.accepted(req(i), 1)})
    fit = fit_acceptance(commits)
    assert abs(fit.p_accept_after_accept - 0.9) < 0.03
    assert abs(fit.p_accept_after_reject - 0.3) < 0.04
    assert abs(fit.p_accept_first - 0.6) < 0.1


def test_fit_counts_only_judged_drafts():
    # drafted 3, accepted 1: accept then reject; the third draft is never judged.
    fit = fit_acceptance([{"req": "a", "drafted": 3, "accepted": 1},
                          {"req": "a", "drafted": 0, "accepted": 0},
                          {"req": "a", "drafted": 1, "accepted": 1}])
    assert fit.judged == 3 and fit.rate == pytest.approx(2 / 3)
    assert fit.acceptance_metric == pytest.approx(2 / 4)
    # Sequence A R A: after accept -> reject once; after reject -> accept once.
    assert fit.p_accept_after_accept == 0.0 and fit.p_accept_after_reject == 1.0


def test_recorded_acceptance_clamps_and_runs_out():
    r = RecordedAcceptance({"r0": [2, 5]})
    assert r.accepted(req(0), 3) == 2
    assert r.accepted(req(0), 1) == 1  # recorded 5 cannot exceed the drafts
    assert r.accepted(req(0), 1) == 0  # nothing recorded: 0


# --- costs -----------------------------------------------------------------------------------

def profile():
    return CostProfile.from_dict({
        "schema": "strata-sim-cost-profile/1", "host_overhead_s": 0.001,
        "prefill": {"tokens": [100, 200], "s": [1.0, 1.5]},
        "decode": {"rows": [1, 3], "tiers": [256, 1024],
                   "hit": [[1.0, 3.0], [2.0, 4.0]],
                   "capture": [[10.0, 30.0], [20.0, 40.0]],
                   "eager": [[1.5, 3.5], [2.5, 4.5]]}})


def test_cost_interpolation():
    p = profile()
    assert p.decode_time(1, 256, "hit") == 1.0
    assert p.decode_time(2, 256, "hit") == 2.0           # linear in rows
    assert p.decode_time(2, 512, "hit") == 2.5           # halfway in log2(tier)
    assert p.decode_time(5, 256, "hit") == 5.0           # last-segment slope past the end
    assert p.decode_time(1, 64, "eager") == 1.5          # tiers clamp
    assert p.decode_time(1, 8192, "capture") == 20.0
    assert p.prefill_time(150) == 1.25
    assert p.prefill_time(50) == 0.5                     # proportional below the first point
    assert p.prefill_time(300) == 2.0


def test_profile_errors_name_the_problem(tmp_path):
    d = profile().to_dict()
    d["decode"]["hit"] = [[1.0]]
    with pytest.raises(ProfileError, match="decode.hit must be"):
        CostProfile.from_dict(d)
    p = tmp_path / "bad.json"
    p.write_text("{\n \"schema\": \n")
    with pytest.raises(ProfileError, match=f"{p}:3: not JSON"):
        CostProfile.load(p)
    with pytest.raises(ProfileError, match="not found"):
        CostProfile.load(tmp_path / "nope.json")
