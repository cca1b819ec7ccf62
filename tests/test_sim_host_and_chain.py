"""The cost profile's host-time parts and the chain acceptance model: the simulator charges
them, and a fit of its own traces gives them back."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from sim.acceptance import ChainAcceptance
from sim.config import NOMINAL_PROFILE, SIM_CONF_DIR, register_configs
from sim.costs import CostProfile
from sim.predict import run_predict
from sim.profile import _host_samples, fit_profile
from sim.streams import RandomStreams

register_configs()


def cfg_of(*overrides):
    with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


class Req:
    def __init__(self, index: int = 0):
        self.index = index


def host_profile() -> CostProfile:
    prof = CostProfile.load(NOMINAL_PROFILE)
    prof.host_overhead_s = 50e-6
    prof.host_per_commit_s = 20e-6
    prof.host_per_admit_s = 60e-6
    prof.host_per_admit_burst_s = 300e-6
    prof.host_after_prefill_s = 40e-6
    prof.host_per_finish_s = 80e-6
    return prof


def test_host_time_adds_commits_admissions_and_prompt_chunks():
    prof = host_profile()
    assert prof.host_time() == pytest.approx(50e-6)
    assert prof.host_time(prev_commits=4, admitted=2, after_prefill=True) == pytest.approx(
        50e-6 + 4 * 20e-6 + 2 * 60e-6 + 300e-6 + 40e-6)
    # Split at the arrivals: the earlier iteration's tail (commits, finishes, a prompt
    # chunk's bookkeeping) comes before them, the later one's head (fixed part, binding) after.
    assert prof.host_tail_time(commits=4, finishes=2, after_prefill=True) == pytest.approx(
        4 * 20e-6 + 2 * 80e-6 + 40e-6)
    assert prof.host_head_time(admitted=2) == pytest.approx(50e-6 + 2 * 60e-6 + 300e-6)
    assert prof.host_time(prev_commits=4, admitted=2, prev_finishes=2) == pytest.approx(
        prof.host_tail_time(4, 2) + prof.host_head_time(2))
    # One burst: the per-burst part once, however many requests it binds.
    assert prof.host_time(admitted=8) - prof.host_time(admitted=1) == pytest.approx(7 * 60e-6)
    back = CostProfile.from_dict(prof.to_dict())
    assert (back.host_per_commit_s, back.host_per_admit_s, back.host_per_admit_burst_s,
            back.host_after_prefill_s, back.host_per_finish_s) == (20e-6, 60e-6, 300e-6, 40e-6,
                                                                     80e-6)
    bad = prof.to_dict()
    bad["host"]["per_admit_s"] = -1.0
    with pytest.raises(ValueError, match="host.per_admit_s must be >= 0"):
        CostProfile.from_dict(bad)
    bad["host"]["per_admit_s"], bad["host"]["per_admit_burst_s"] = 0.0, -1.0
    with pytest.raises(ValueError, match="host.per_admit_burst_s must be >= 0"):
        CostProfile.from_dict(bad)


def test_fit_gives_back_the_host_parts(tmp_path):
    prof = host_profile()
    traces = []
    for i, slots in enumerate((1, 4, 8)):
        run = run_predict(cfg_of("workload=cohort", "workload.requests=12",
                                 "workload.prompt_tokens=300", "workload.max_tokens=30",
                                 f"engine.slots={slots}", "acceptance=markov", f"seed={i}",
                                 "engine.overlap=false"),  # the fit reads serial loops
                          tmp_path / str(i), profile=prof).run
        traces.append(run.events)
    # The first iteration's host time runs from the arrivals: it binds the admitted slots.
    first = _host_samples(traces[2])[0]
    assert first[:4] == (0, 0, 8, False)
    assert first[4] == pytest.approx(50e-6 + 300e-6 + 8 * 60e-6, abs=2e-6)
    fit = fit_profile(traces)
    assert fit.host_overhead_s == pytest.approx(50e-6, abs=2e-6)
    assert fit.host_per_commit_s == pytest.approx(20e-6, abs=1e-6)
    assert fit.host_per_admit_s == pytest.approx(60e-6, abs=2e-6)
    assert fit.host_per_admit_burst_s == pytest.approx(300e-6, abs=3e-6)
    assert fit.host_after_prefill_s == pytest.approx(40e-6, abs=2e-6)
    assert fit.host_per_finish_s == pytest.approx(80e-6, abs=3e-6)


def test_one_burst_size_charges_binding_per_burst():
    from sim.profile import fit_host

    # Every admitting iteration binds 2: per request and per burst cannot be told apart.
    samples = ([(1, 0, 0, False, 70e-6)] * 5 + [(2, 0, 0, False, 90e-6)] * 5
               + [(3, 0, 0, False, 110e-6)] * 5 + [(0, 0, 2, False, 450e-6)] * 3)
    fixed, per_commit, per_admit, per_burst, _, per_finish = fit_host(samples)
    assert per_admit == 0.0
    assert fixed + per_burst == pytest.approx(450e-6)
    assert per_commit == pytest.approx(20e-6)
    assert per_finish == 0.0  # no finish in any sample


def test_finishes_that_always_come_with_admissions_are_charged_to_them():
    from sim.profile import fit_host

    # A closed loop seen only mid-run: every finish is followed by one admission, so the
    # two cannot be told apart; the finish's part goes with the admission's.
    samples = ([(1, 0, 0, False, 70e-6)] * 5 + [(2, 0, 0, False, 90e-6)] * 5
               + [(3, 0, 0, False, 110e-6)] * 5 + [(1, 1, 1, False, 70e-6 + 380e-6)] * 5)
    fixed, per_commit, per_admit, per_burst, _, per_finish = fit_host(samples)
    assert per_finish == 0.0
    assert per_admit + per_burst == pytest.approx(380e-6)


def test_a_profile_without_host_parts_charges_a_fixed_host_time(tmp_path):
    run = run_predict(cfg_of("workload=cohort", "workload.requests=4", "workload.max_tokens=20",
                             "engine.slots=4", "engine.overlap=false"), tmp_path).run
    prof = CostProfile.load(NOMINAL_PROFILE)
    gaps = [gap for *_, gap in _host_samples(run.events)]
    assert gaps and all(g == pytest.approx(prof.host_overhead_s, abs=2e-6) for g in gaps)


def test_chain_model_draws_the_text_not_the_windows():
    # Every position draftable after the first: every draft accepted, in any window shape.
    always = ChainAcceptance([1.0], [1.0], 1.0, 16, RandomStreams(0))
    assert always.accepted(Req(), 3, position=1) == 3
    assert always.accepted(Req(), 1, position=5) == 1
    # Never draftable.
    never = ChainAcceptance([0.0], [0.0], 0.0, 16, RandomStreams(0))
    assert never.accepted(Req(), 3, position=1) == 0
    # Draftable only after a draftable position, and the first one is: runs forever.
    sticky = ChainAcceptance([0.0], [1.0], 1.0, 16, RandomStreams(0))
    assert sticky.accepted(Req(), 3, position=1) == 3 and sticky.accepted(Req(), 1, position=9) == 1
    with pytest.raises(ValueError, match="only move forward"):
        sticky.accepted(Req(), 1, position=2)
    # A deeper draft needs its depth factor too.
    shallow = ChainAcceptance([1.0], [1.0], 1.0, 16, RandomStreams(0), depth_factors=[1.0, 0.0])
    assert shallow.accepted(Req(), 3, position=1) == 1
    # Same seed, same outcomes; requests draw from their own streams.
    def draws(seed):
        m = ChainAcceptance([0.3], [0.8], 0.5, 16, RandomStreams(seed), [1.0, 0.7])
        return [m.accepted(Req(i % 3), 3, position=1 + 4 * (i // 3)) for i in range(60)]
    assert draws(1) == draws(1) and draws(1) != draws(2)
    with pytest.raises(ValueError, match="one rate per bucket"):
        ChainAcceptance([0.3, 0.4], [0.8], 0.5, 16, RandomStreams(0))


def chain_truth(**chain) -> CostProfile:
    """The nominal profile with a known chain acceptance (after_miss 0.3, after_hit 0.85,
    first 0.5, depth factor 0.8), plus `chain`'s extra keys."""
    truth = CostProfile.load(NOMINAL_PROFILE)
    truth.acceptance = {"rate": 0.7, "markov": {"p_accept_after_accept": 0.7,
                                                "p_accept_after_reject": 0.7,
                                                "p_accept_first": 0.7},
                        "chain": {"tokens": 16, "after_miss": [0.3], "after_hit": [0.85],
                                  "first": 0.5, "depth_factor": [1.0, 0.8], **chain}}
    return truth


@pytest.mark.slow
def test_fit_gives_back_the_chain_from_grouped_and_lone_windows(tmp_path):
    truth = chain_truth()
    traces = []
    # Grouped windows (2-row groups) tell after_miss from after_hit; lone windows (one slot,
    # 4 rows) give the depth factors.
    for i, slots in enumerate((4, 1)):
        run = run_predict(cfg_of("workload=cohort", "workload.requests=40",
                                 "workload.prompt_tokens=64", "workload.max_tokens=200",
                                 f"engine.slots={slots}", "acceptance=chain", f"seed={i}"),
                          tmp_path / str(i), profile=truth).run
        traces.append(run.events)
    chain = fit_profile(traces).acceptance["chain"]

    def mean(rates, judged):  # over the buckets (each bucket's rate is noisy on its own)
        return sum(r * n for r, n in zip(rates, judged)) / sum(judged)
    assert mean(chain["after_miss"], chain["judged"]["after_miss"]) == pytest.approx(0.3, abs=0.03)
    assert mean(chain["after_hit"], chain["judged"]["two_after_hit"]) == pytest.approx(0.85, abs=0.03)
    assert chain["depth_factor"][1] == pytest.approx(0.8, abs=0.08)


def test_chain_needs_a_fitted_chain():
    small = ("workload.requests=2", "workload.max_tokens=8", "acceptance=chain")
    with pytest.raises(ValueError, match="no `acceptance` section"):
        run_predict(cfg_of(*small))
    prof = CostProfile.load(NOMINAL_PROFILE)
    prof.acceptance = {"rate": 0.5, "markov": {"p_accept_after_accept": 0.5,
                                               "p_accept_after_reject": 0.5, "p_accept_first": 0.5}}
    with pytest.raises(ValueError, match="acceptance.model=chain needs"):
        run_predict(cfg_of(*small), profile=prof)
    # Traces of one window shape only cannot tell the two states apart: no chain section.
    run = run_predict(cfg_of("workload.requests=4", "workload.max_tokens=40", "engine.mode=solo",
                             "acceptance=markov")).run
    assert "chain" not in fit_profile([run.events]).acceptance


def test_chain_spread_gives_each_request_its_own_difficulty():
    def ratios(spread, offset=0.0, seed=3):
        m = ChainAcceptance([0.3], [0.8], 0.5, 16, RandomStreams(seed), [1.0, 0.8],
                            spread=spread, offset=offset)
        out = []
        for i in range(200):
            acc, pos = 0, 1
            for _ in range(40):
                a = m.accepted(Req(i), 1, pos)
                acc, pos = acc + a, pos + a + 1
            out.append(acc / 40)
        return out
    import statistics as st
    flat, wide = ratios(0.0), ratios(1.5)
    # No spread: the rates as given, draw for draw (the spread's stream is never touched).
    m = ChainAcceptance([0.3], [0.8], 0.5, 16, RandomStreams(3), [1.0, 0.8])
    assert m._request_rates(0) == (0.5, [0.3], [0.8])
    assert st.pstdev(wide) > 1.5 * st.pstdev(flat)
    assert ratios(1.5) == wide                      # same seed, same requests, same outcomes
    # An offset moves every request's rates one way.
    assert st.mean(ratios(0.0, offset=1.0)) > st.mean(flat) + 0.05
    with pytest.raises(ValueError, match="spread must be finite and >= 0"):
        ChainAcceptance([0.3], [0.8], 0.5, 16, RandomStreams(0), spread=-1.0)


@pytest.mark.slow
def test_fit_gives_back_the_requests_spread(tmp_path):
    def traces_with(spread):
        truth = chain_truth(spread=spread, offset=0.0)
        return [run_predict(cfg_of("workload=cohort", "workload.requests=60",
                                   "workload.prompt_tokens=64", "workload.max_tokens=160",
                                   f"engine.slots={slots}", "acceptance=chain", f"seed={i}"),
                            tmp_path / f"{spread}_{i}", profile=truth).run.events
                for i, slots in enumerate((4, 1))]
    wide = fit_profile(traces_with(1.2)).acceptance["chain"]
    flat = fit_profile(traces_with(0.0)).acceptance["chain"]
    assert wide["spread"] > 0.6 and wide["request_sd"] > flat["request_sd"]
    assert flat["spread"] < 0.35
    # The knob turns it off: every request sees the fitted rates.
    prof = CostProfile.load(NOMINAL_PROFILE)
    prof.acceptance = fit_profile(traces_with(1.2)).acceptance
    on = run_predict(cfg_of("workload.requests=6", "workload.max_tokens=40", "acceptance=chain"),
                     tmp_path / "on", profile=prof).run
    off = run_predict(cfg_of("workload.requests=6", "workload.max_tokens=40", "acceptance=chain",
                             "acceptance.request_spread=false"), tmp_path / "off", profile=prof).run
    commits = lambda run: [e["accepted"] for e in run.events if e["ev"] == "commit"]
    assert commits(on) != commits(off)


def test_a_dependent_column_goes_not_merely_the_last_one():
    from sim.profile import fit_host

    # One request at a time: every commit follows a window (not a prompt chunk) and the
    # fixed part is commits + after-prefill; finishes are their own column and must stay.
    samples = []
    for f in (0, 1):
        for c, p in ((1, False), (0, True)):
            gap = 50e-6 + 20e-6 * c + 40e-6 * p + 80e-6 * f
            samples += [(c, f, 0, p, gap)] * 4
    per_finish = fit_host(samples)[5]
    assert per_finish == pytest.approx(80e-6)


@pytest.mark.parametrize("host_s", [100e-6, 30e-3])
def test_overlap_costs_a_window_max_of_host_plus_sync_and_device(tmp_path, host_s):
    """engine.overlap: consecutive windows are read max(host + sync, device) apart (the sync
    is the host's wait: a device-bound loop has launched the next window before it); serially
    they are host + device apart."""
    prof = CostProfile.load(NOMINAL_PROFILE)
    prof.host_overhead_s, prof.host_sync_s = host_s, 10e-6
    gaps = {}
    for overlap in (False, True):
        run = run_predict(cfg_of("workload=cohort", "workload.requests=1", "engine.mode=solo",
                                 "workload.prompt_tokens=8", "workload.max_tokens=40",
                                 f"engine.overlap={str(overlap).lower()}"),
                          tmp_path / str(overlap), profile=prof).run
        wins = [e for e in run.events if e["ev"] == "window"]
        assert len(wins) > 6
        # steady state: the middle windows, each read one window's period after the last
        gaps[overlap] = [(b["t"] - a["t"], b["dur"]) for a, b in zip(wins[2:-3], wins[3:-2])]
    for gap, dur in gaps[False]:
        assert gap == pytest.approx(host_s + dur, abs=2e-6)
    for gap, dur in gaps[True]:
        assert gap == pytest.approx(max(host_s + 10e-6, dur), abs=2e-6)
