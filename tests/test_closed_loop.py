"""Closed-loop workloads (`workload.concurrency=k`): k clients, each sending its next request
when its last one finished. The engine's runner and the simulator release the next request in
the same iteration, so the simulator predicts a closed-loop run without its trace's arrivals."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from sim.config import SimConfigError, validate_workload
from sim.replay import compare, scenario_from_trace
from sim.simulation import simulate
from sim.workload import SimRequest
from strata.config import EMBEDDED_MODEL_DIR, StrataConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, RequestError, SamplingParams
from strata.model.loader import load_checkpoint
from strata.runner import run_requests
from strata.trace import read_trace
from strata.workload import WorkloadError, load_workload

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def loaded():
    return load_checkpoint(EMBEDDED_MODEL_DIR, "float32", CPU, log=lambda s: None)


def closed_run(loaded, tmp_path, concurrency: int, requests: int = 7, slots: int = 4,
               batch_mtp: bool = True):
    ecfg = OmegaConf.structured(StrataConfig).engine
    ecfg.slots, ecfg.mode, ecfg.batch_mtp, ecfg.graph_limit = slots, "batch", batch_mtp, 3
    w = OmegaConf.structured(StrataConfig).workload
    w.kind, w.requests, w.prompt_tokens, w.max_tokens = "synthetic", requests, 12, 9
    w.concurrency, w.temperature = concurrency, 0.8
    path = tmp_path / f"trace_{concurrency}.jsonl"
    eng = Engine(loaded, ecfg, CPU, log=lambda s: None, trace_path=path)
    try:
        reqs = load_workload(w, loaded.tokenizer, loaded.args.vocab_size)
        for r in reqs:
            r.params.max_tokens = 5 + 3 * (int(r.id[3:]) % 3)  # finishes at different steps
        metrics = run_requests(eng, reqs, concurrency=concurrency)
    finally:
        eng.close()
    return read_trace(path), metrics


def in_flight_by_step(events) -> dict[int, int]:
    """Requests arrived and not finished at each step's end."""
    delta = Counter()
    for e in events:
        if e["ev"] == "arrive":
            delta[e["step"]] += 1
        elif e["ev"] == "finish":
            delta[e["step"] + 1] -= 1
    out, n = {}, 0
    for step in range(max(e["step"] for e in events) + 1):
        n += delta[step]
        out[step] = n
    return out


def test_engine_keeps_at_most_k_in_flight_and_refills_the_next_iteration(loaded, tmp_path):
    events, metrics = closed_run(loaded, tmp_path, concurrency=2)
    arrivals = [e for e in events if e["ev"] == "arrive"]
    finishes = [e for e in events if e["ev"] == "finish"]
    assert len(arrivals) == len(finishes) == 7 and len(metrics["requests"]) == 7
    assert [e["step"] for e in arrivals[:2]] == [0, 0]
    # Every later arrival comes in the iteration after a finish, one per finish, in order.
    assert [e["step"] for e in arrivals[2:]] == [e["step"] + 1 for e in finishes[:5]]
    assert max(in_flight_by_step(events).values()) == 2
    assert all(f["reason"] == "length" for f in finishes)


@pytest.mark.slow
def test_the_simulator_releases_the_same_requests_in_the_same_iterations(loaded, tmp_path):
    for k in (1, 3):
        events, _ = closed_run(loaded, tmp_path, concurrency=k)
        scenario = scenario_from_trace(events)
        # Forget the arrival steps of the closed loop's requests: the simulator must find them.
        scenario.requests = [r if r.index < k else
                             SimRequest(id=r.id, index=r.index, prompt_tokens=r.prompt_tokens,
                                        max_tokens=r.max_tokens, after_finish=True,
                                        filtered=r.filtered)
                             for r in scenario.requests]
        run = simulate(scenario)
        divergence, compared = compare(events, run.events)
        assert divergence is None, f"concurrency={k}: {divergence}"
        assert compared > 20


def test_all_at_once_is_unchanged(loaded, tmp_path):
    events, _ = closed_run(loaded, tmp_path, concurrency=0)
    assert {e["step"] for e in events if e["ev"] == "arrive"} == {0}


def test_bad_concurrency_and_duplicate_ids_are_named(loaded):
    w = OmegaConf.structured(StrataConfig).workload
    w.kind, w.concurrency = "synthetic", -1
    with pytest.raises(WorkloadError, match="workload.concurrency"):
        load_workload(w, loaded.tokenizer, loaded.args.vocab_size)
    sw = OmegaConf.create({"kind": "cohort", "requests": 4, "prompt_tokens": 8,
                           "prompt_tokens_max": None, "max_tokens": 8, "max_tokens_max": None,
                           "rate_per_s": 1.0, "burst_size": 1, "burst_size_max": None,
                           "burst_gap_s": 0.0, "burst_spread_s": 0.0, "stagger_steps": 0,
                           "filtered_share": 0.0, "concurrency": -2})
    with pytest.raises(SimConfigError, match="workload.concurrency"):
        validate_workload(sw)
    ecfg = OmegaConf.structured(StrataConfig).engine
    eng = Engine(loaded, ecfg, CPU, log=lambda s: None)
    try:
        reqs = [Request("a", [5, 6], SamplingParams(max_tokens=2)),
                Request("a", [7, 8], SamplingParams(max_tokens=2))]
        with pytest.raises(RequestError, match="duplicate request id 'a'"):
            run_requests(eng, reqs, concurrency=1)
        # A bad request waiting for a client fails the run before anything runs.
        reqs = [Request("b", [5, 6], SamplingParams(max_tokens=2)), Request("c", [], SamplingParams())]
        with pytest.raises(RequestError, match="prompt"):
            run_requests(eng, reqs, concurrency=1)
        assert not eng.requests
    finally:
        eng.close()


@pytest.mark.slow
@pytest.mark.parametrize("override, key", [("workload.concurrency=-1", "workload.concurrency"),
                                           ("workload.requests=0", "workload.requests"),
                                           ("workload.stagger_steps=-2", "workload.stagger_steps")])
def test_bad_workload_knobs_fail_before_the_checkpoint_is_read(tmp_path, override, key):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "strata", override, "device=cpu",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert f"error: {key}" in res.stderr
    assert "INFO kernels" not in res.stderr  # nothing was loaded
