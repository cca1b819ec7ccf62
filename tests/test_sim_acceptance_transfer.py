"""Acceptance learned from 8 requests of a CPU engine run holds on the rest of the workload.

The data are real CPU engine runs of the embedded tiny model (float32, greedy) on code prompts
(scripts/bench_engine.py's `code_prompts` when they were recorded: distinct standard-library files of
Python 3.11; it now cuts them from the shipped scripts/data/code_prompts.json), each a closed loop
at `max_context` 1024 (docs/SIMULATOR.md, "Acceptance from your own prompts", gives the
commands):

- `tests/data/cpu_code_bm4_first8_trace.jsonl`: the first 8 requests (prompts 0-7) of a
  batch_mtp run of 56 prompts of 64 tokens, 256 output tokens, 4 in flight: what the model
  learns from (its config, arrive, admit, commit and finish events);
- `tests/data/cpu_code_acceptance_prior.json`: the fit of two other runs (prompts 64-79,
  96-token prompts, 128 output tokens; batch_mtp at 4 in flight and solo), standing for the
  CPU preset's profile: the drafter's depth factors the 8 requests cannot measure.

The rest of the workload, as the engine measured it (accepted / drafted), is in REST. These 8
requests are typical of the 56 (their own rate is 0.013 above the other 48's); docs/SIMULATOR.md
shows 8 that are not, and how far any 8 requests may be off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from sim.config import SIM_CONF_DIR, register_configs
from sim.costs import CostProfile
from sim.predict import run_predict
from sim.trace_acceptance import (acceptance_range, fit_from_trace, pooled_depth, range_shift,
                                  shifted_fit)

DATA = Path(__file__).resolve().parent / "data"
FIRST8 = DATA / "cpu_code_bm4_first8_trace.jsonl"
PRIOR = DATA / "cpu_code_acceptance_prior.json"

#: (what, engine overrides, requests, prompt tokens, output tokens, in flight, the engine's
#: acceptance over those requests). The first three are the other 48 prompts of the same
#: workload (prompts 8-55) in three modes; the last one prompts 0-39 at other lengths.
REST = [
    ("batch_mtp N=4", ("engine.mode=batch", "engine.batch_mtp=true", "engine.slots=4"),
     48, 64, 256, 4, 5496 / 6744),
    ("solo", ("engine.mode=solo", "engine.batch_mtp=false", "engine.slots=1"),
     48, 64, 256, 1, 7903 / 12902),
    ("batch_mtp W16 N=8", ("engine.mode=batch", "engine.batch_mtp=true", "engine.slots=8",
                           "engine.window_rows=16"), 48, 64, 256, 8, 5498 / 6750),
    ("batch_mtp N=4, 32-token prompts, 400 output tokens",
     ("engine.mode=batch", "engine.batch_mtp=true", "engine.slots=4"), 40, 32, 400, 4,
     7223 / 8777),
]


def cfg_of(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(scope="module")
def prior_profile(tmp_path_factory) -> Path:
    """The CPU preset's profile with the prior runs' acceptance section."""
    p = CostProfile.load(Path(SIM_CONF_DIR) / "profiles" / "cpu_tiny.json")
    p.acceptance = json.loads(PRIOR.read_text())
    out = tmp_path_factory.mktemp("prior") / "profile.json"
    p.save(out)
    return out


@pytest.mark.parametrize("what,engine,n,prompt,out,flight,measured", REST,
                         ids=[r[0] for r in REST])
def test_acceptance_from_8_requests_holds_on_the_rest(prior_profile, what, engine, n, prompt,
                                                      out, flight, measured):
    m = run_predict(cfg_of(
        "hardware=cpu_tiny", f"profile={prior_profile}", "acceptance=chain",
        f"acceptance.from_trace={FIRST8}", "workload=stagger", f"workload.requests={n}",
        f"workload.concurrency={flight}", f"workload.prompt_tokens={prompt}",
        f"workload.max_tokens={out}", "engine.max_context=1024", "spread.enabled=false",
        "print_outputs=false", *engine)).metrics
    assert abs(m["acceptance"] - measured) < 0.03, (what, m["acceptance"], measured)
    lo, hi = m["acceptance_range"]
    assert lo < m["acceptance"] < hi


def test_depth_factors_pool_with_the_profiles():
    # 5 deeper drafts at 0.26 against a prior of 0.82: the prior dominates
    assert pooled_depth([1.0, 0.26], [5], [1.0, 0.82, 0.88]) == pytest.approx(
        [1.0, (5 * 0.26 + 40 * 0.82) / 45, 0.88])
    # none judged: the prior's; no prior: the trace's own
    assert pooled_depth([1.0], [], [1.0, 0.8]) == [1.0, 0.8]
    assert pooled_depth([1.0, 0.9], [100], None) == [1.0, 0.9]
    fit = fit_from_trace(FIRST8, prior=json.loads(PRIOR.read_text()))
    # 8 requests at 4 in flight judge no deeper draft: the chain's depth is the prior's
    assert fit["chain"]["judged"]["deeper"] == []
    assert fit["chain"]["depth_factor"] == json.loads(PRIOR.read_text())["chain"]["depth_factor"]
    assert fit["requests"] == 8 and 0.05 < fit["request_sd"] < 0.3


def test_acceptance_range_moves_every_rate_by_the_requests_standard_error():
    fit = json.loads(PRIOR.read_text())
    fit.update(requests=8, request_sd=0.14)
    m = fit["acceptance_metric"]
    shift = range_shift(fit)
    assert shift == pytest.approx(1.2816 * 0.14 / 8 ** 0.5 / (m * (1 - m)))
    up, down = shifted_fit(fit, shift), shifted_fit(fit, -shift)
    for key in ("after_miss", "after_hit"):
        assert all(d < x < u for d, x, u in zip(down["chain"][key], fit["chain"][key],
                                                  up["chain"][key]) if 0 < x < 1)
    assert up["chain"]["depth_factor"] == fit["chain"]["depth_factor"]
    seen = []
    lo, hi = acceptance_range(lambda f: seen.append(f) or f["rate"], fit)
    assert lo < fit["rate"] < hi and len(seen) == 2
    assert range_shift({"acceptance_metric": 0.8}) is None  # a profile's fit: no range
    assert acceptance_range(lambda f: 0.5, {"acceptance_metric": 0.8}) is None


def test_a_trace_fit_is_reused_while_the_file_is_unchanged(tmp_path):
    prior = json.loads(PRIOR.read_text())
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(FIRST8.read_bytes())
    a = fit_from_trace(trace, prior=prior)
    a["chain"]["first"] = -1.0  # each call's own copy: the cached fit is not touched
    b = fit_from_trace(trace, prior=prior)
    assert b["chain"]["first"] != -1.0
    assert fit_from_trace(trace, prior=prior) == b
    # Another file (fewer requests) is fitted afresh, not served from the cache.
    lines = FIRST8.read_text().splitlines(keepends=True)
    keep = {json.loads(x)["req"] for x in lines if json.loads(x).get("ev") == "admit"}
    keep = sorted(keep)[:3]
    trace.write_text("".join(x for x in lines if json.loads(x).get("req") in (None, *keep)))
    c = fit_from_trace(trace, prior=prior)
    assert c["requests"] <= 3 < b["requests"]


def test_pinned_requests_keep_their_own_acceptance():
    """acceptance.pin_requests: each traced request's fitted shift, redrawn, accepts on average
    what that request accepted in the trace (a cohort replayed at its own difficulties), and
    the harder request gets the lower shift."""
    from sim.acceptance import ChainAcceptance, redraw_request
    from sim.replay import load_trace
    from sim.streams import RandomStreams
    from sim.trace_acceptance import admitted_requests, commit_walks

    prior = json.loads(PRIOR.read_text())
    fit = fit_from_trace(FIRST8, prior=prior, pin=True)
    chain = fit["chain"]
    events, _ = load_trace(FIRST8)
    order = admitted_requests(events)
    walks = commit_walks([e for e in events if e.get("ev") == "commit"], order)
    assert len(chain["pinned"]) == len(order) == 8
    observed = [sum(a for *_, a in w) / sum(k for _, k, _ in w) for w in walks]
    for i, w in enumerate(walks):
        acc = dr = 0
        for seed in range(24):
            model = ChainAcceptance(chain["after_miss"], chain["after_hit"], chain["first"],
                                    chain["tokens"], RandomStreams(500 + seed),
                                    chain["depth_factor"], pinned=chain["pinned"])
            a, d = redraw_request(model, i, w)
            acc, dr = acc + a, dr + d
        assert abs(acc / dr - observed[i]) < 0.04, (i, acc / dr, observed[i])
    hard, easy = observed.index(min(observed)), observed.index(max(observed))
    assert chain["pinned"][hard] < chain["pinned"][easy]
    assert "pinned" not in fit_from_trace(FIRST8, prior=prior)["chain"]  # only when asked


def test_pinned_requests_predict_and_name_what_they_need(prior_profile):
    base = ("hardware=cpu_tiny", f"profile={prior_profile}", "workload=cohort",
            "workload.requests=4", "workload.prompt_tokens=64", "workload.max_tokens=64",
            "engine.mode=batch", "engine.batch_mtp=true", "engine.slots=4",
            "spread.enabled=false", "print_outputs=false")
    m = run_predict(cfg_of(*base, "acceptance=chain", f"acceptance.from_trace={FIRST8}",
                           "acceptance.pin_requests=true")).metrics
    assert 0.3 < m["acceptance"] < 1.0
    from sim.config import SimConfigError

    for bad in (("acceptance=chain", "acceptance.pin_requests=true"),
                ("acceptance=position", f"acceptance.from_trace={FIRST8}",
                 "acceptance.pin_requests=true")):
        with pytest.raises(SimConfigError, match="acceptance.pin_requests: needs"):
            run_predict(cfg_of(*base, *bad))
