"""Predict mode and the sim's Hydra config: determinism, files, workloads, config errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from sim.config import SIM_CONF_DIR, SimConfigError, register_configs
from sim.predict import run_predict
from sim.replay import replay_file
from sim.streams import RandomStreams
from sim.workload import build_workload

REPO = Path(__file__).resolve().parent.parent
register_configs()

SMALL = ["workload.requests=12", "workload.prompt_tokens=64", "workload.prompt_tokens_max=600",
         "workload.max_tokens=8", "workload.max_tokens_max=60", "workload.rate_per_s=4"]


def cfg_of(*overrides):
    with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_compose_defaults():
    cfg = cfg_of()
    assert cfg.mode == "predict"
    assert cfg.engine.graph_key == "shape" and cfg.engine.graph_policy == "counted"
    assert cfg.workload.kind == "poisson" and cfg.acceptance.model == "fixed"
    # Same knob names and defaults as strata's engine group.
    engine_yaml = OmegaConf.load(REPO / "conf" / "engine" / "default.yaml")
    for k, v in engine_yaml.items():
        if k in cfg.engine:
            assert cfg.engine[k] == v, k


@pytest.mark.parametrize("override", ["engine.no_such_knob=1", "nonsense=3",
                                      "workload.rate=2", "engine.slots=many"])
def test_unknown_or_mistyped_override_is_an_error(override):
    with pytest.raises(ConfigCompositionException):
        cfg_of(override)


def test_groups_compose():
    assert cfg_of("workload=cohort").workload.kind == "cohort"
    assert cfg_of("workload=burst").workload.burst_size_max == 4
    assert cfg_of("acceptance=markov").acceptance.model == "markov"
    up = cfg_of("engine=upstream")
    assert (up.engine.graph_policy, up.engine.graph_key, up.engine.slots) == ("upstream", "layout", 8)


def test_invalid_value_is_a_clear_error():
    with pytest.raises(SimConfigError, match="engine.spec=9 exceeds engine.window_rows=8"):
        run_predict(cfg_of("engine.spec=9", *SMALL))
    with pytest.raises(SimConfigError, match="workload.kind"):
        run_predict(cfg_of("workload.kind=sometimes", *SMALL))


def test_predict_same_seed_same_bytes(tmp_path):
    for name in ("a", "b"):
        run_predict(cfg_of(*SMALL, "seed=7", "memory.graph_mib_jitter=2"), tmp_path / name)
    for f in ("trace.jsonl", "outputs.jsonl", "metrics.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    run_predict(cfg_of(*SMALL, "seed=8"), tmp_path / "c")
    assert (tmp_path / "a" / "trace.jsonl").read_bytes() != (tmp_path / "c" / "trace.jsonl").read_bytes()


def test_predict_files_and_metrics(tmp_path):
    res = run_predict(cfg_of(*SMALL, "acceptance=markov"), tmp_path)
    outputs = [json.loads(l) for l in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert [o["id"] for o in outputs] == [f"r{i}" for i in range(12)]
    assert all(o["text"] is None and o["token_ids"] is None for o in outputs)
    assert all(o["finish_reason"] == "length" for o in outputs)
    m = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("wall_s", "output_tokens", "aggregate_tps", "acceptance", "windows", "prefills",
                "graph", "ttft_s", "e2e_s", "requests"):
        assert key in m
    assert m["output_tokens"] == sum(o["output_tokens"] for o in outputs)
    assert set(m["graph"]) == {"hit", "capture", "eager", "evict"}
    assert 0 < m["acceptance"] < 1
    r0 = m["requests"][0]
    assert r0["ttft_s"] >= r0["queue_s"] >= 0 and r0["e2e_s"] >= r0["ttft_s"]
    assert res.metrics == m
    # A predicted trace is itself a valid engine-style trace: replaying it reproduces it.
    assert replay_file(tmp_path / "trace.jsonl").ok


def test_predict_solo_and_layout_and_upstream(tmp_path):
    solo = run_predict(cfg_of(*SMALL, "engine.mode=solo")).run
    assert {e["slot"] for e in solo.events if e["ev"] == "admit"} == {0}
    lay = run_predict(cfg_of(*SMALL, "engine.graph_key=layout", "engine.slots=8")).run
    shp = run_predict(cfg_of(*SMALL, "engine.graph_key=shape", "engine.slots=8")).run
    assert len(lay.cache.keys_seen) > len(shp.cache.keys_seen)
    crash = run_predict(cfg_of(*SMALL, "engine=upstream", "engine.vram_reserve_mib=60",
                               "memory.graph_mib_jitter=0", "engine.graph_limit=0")).run
    assert crash.stats.crashed_at_step is not None and crash.cache.captures == 2
    assert any(e["ev"] == "finish" and e["reason"] == "error" for e in crash.events)


def test_workload_kinds_and_streams():
    s = RandomStreams(1)
    w = cfg_of("workload=burst", "workload.requests=10").workload
    reqs = build_workload(w, s)
    assert len(reqs) == 10 and all(r.arrival_s is not None for r in reqs)
    assert reqs[0].arrival_s < 2.0 and reqs[-1].arrival_s >= 10.0
    cohort = build_workload(cfg_of("workload=cohort", "workload.requests=4").workload, s)
    assert [r.arrival_s for r in cohort] == [0.0] * 4
    assert {r.prompt_tokens for r in cohort} == {2048}
    stag = build_workload(cfg_of("workload=stagger", "workload.stagger_steps=3").workload, s)
    assert [r.arrival_step for r in stag] == [0, 3, 6, 9, 12, 15, 18, 21]
    # One stream per random input: changing the arrival rate leaves the sizes unchanged.
    a = build_workload(cfg_of(*SMALL).workload, RandomStreams(5))
    b = build_workload(cfg_of(*SMALL, "workload.rate_per_s=9").workload, RandomStreams(5))
    assert [r.prompt_tokens for r in a] == [r.prompt_tokens for r in b]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]


def test_filtered_share_draws_its_own_stream():
    keys = lambda run: [e["key"] for e in run.events if e["ev"] == "window"]  # noqa: E731
    base = run_predict(cfg_of(*SMALL, "seed=3")).run
    assert not any(k.endswith("+f") for k in keys(base))
    assert all(e["filtered"] is False for e in base.events if e["ev"] == "arrive")
    half = run_predict(cfg_of(*SMALL, "seed=3", "workload.filtered_share=0.5")).run
    flags = {e["req"]: e["filtered"] for e in half.events if e["ev"] == "arrive"}
    assert True in flags.values() and False in flags.values()
    # a window is keyed `+f` exactly when it holds a filtering request's slot
    by_slot = {}
    for e in half.events:
        if e["ev"] == "admit":
            by_slot[e["slot"]] = e["req"]
        elif e["ev"] == "window":
            assert e["key"].endswith("+f") == any(flags[by_slot[s]] for s in e["layout"])
    assert any(k.endswith("+f") for k in keys(half)) and not all(k.endswith("+f") for k in keys(half))
    # its own stream: sizes and arrivals do not move
    a = build_workload(cfg_of(*SMALL).workload, RandomStreams(5))
    b = build_workload(cfg_of(*SMALL, "workload.filtered_share=0.5").workload, RandomStreams(5))
    assert [(r.prompt_tokens, r.max_tokens, r.arrival_s) for r in a] == \
        [(r.prompt_tokens, r.max_tokens, r.arrival_s) for r in b]
    assert all(r.filtered for r in build_workload(
        cfg_of(*SMALL, "workload.filtered_share=1.0").workload, RandomStreams(5)))
    with pytest.raises(SimConfigError, match="workload.filtered_share"):
        run_predict(cfg_of(*SMALL, "workload.filtered_share=1.5"))


def test_request_seeds_are_the_engines_default_or_k_plus_i():
    """workload.request_seeds: null gives every request the engine's default seed 0; k gives
    request i seed k + i (what keys engine.synthetic_acceptance's decisions)."""
    assert {r.seed for r in build_workload(cfg_of(*SMALL).workload, RandomStreams(5))} == {0}
    reqs = build_workload(cfg_of(*SMALL, "workload.request_seeds=7").workload, RandomStreams(5))
    assert [r.seed for r in reqs] == [7 + i for i in range(len(reqs))]
    with pytest.raises(SimConfigError, match=r"workload.request_seeds: must be null or in"):
        run_predict(cfg_of(*SMALL, "workload.request_seeds=-1"))


@pytest.mark.slow
def test_cli_predict_and_multirun(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "sim", "mode=predict", *SMALL,
                          f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "aggregate tok/s" in out.stdout
    assert {"trace.jsonl", "outputs.jsonl", "metrics.json"} <= {p.name for p in run_dir.iterdir()}

    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "sim", "-m", "mode=predict", *SMALL,
                          "engine.slots=1,2", "engine.graph_key=layout,shape",
                          f"hydra.sweep.dir={sweep}", "print_outputs=false"],
                         cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    runs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(runs) == 4 and all((p / "metrics.json").exists() for p in runs)

    out = subprocess.run([sys.executable, "-m", "sim", "engine.bogus=1",
                          f"hydra.run.dir={tmp_path / 'x'}"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "bogus" in out.stderr


@pytest.mark.slow
def test_compare_with_engine_metrics(tmp_path):
    from sim.metrics import compare_metrics
    engine = {"aggregate_tps": 100.0, "ttft_s": {"p50": 0.5, "p95": 1.0},
              "e2e_s": {"p50": 2.0, "p95": None}, "acceptance": 0.0}
    sim = {"aggregate_tps": 110.0, "ttft_s": {"p50": 0.4, "p95": 1.0},
           "e2e_s": {"p50": 2.0, "p95": 3.0}, "acceptance": 0.5}
    rows = {r[0]: r for r in compare_metrics(engine, sim)}
    assert rows["aggregate tok/s"][3] == pytest.approx(0.1)
    assert rows["TTFT p50 (s)"][3] == pytest.approx(-0.2)
    assert rows["E2E p95 (s)"][3] is None and rows["acceptance"][3] is None
    eng = tmp_path / "engine_metrics.json"
    eng.write_text(json.dumps(engine))
    out = subprocess.run([sys.executable, "-m", "sim", *SMALL, f"compare_with={eng}",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "aggregate tok/s" in out.stdout and (tmp_path / "run" / "comparison.json").exists()


def test_position_acceptance_and_shape_costs_in_predict(tmp_path):
    # Rates [0, 1] in buckets of 8 positions: a commit starting before position 8 accepts
    # nothing, one starting at or after it accepts every draft.
    run = run_predict(cfg_of("workload=stagger", "workload.requests=2", "workload.max_tokens=40",
                             "workload.prompt_tokens=64", "acceptance=position",
                             "acceptance.position_rates=[0.0,1.0]",
                             "acceptance.position_tokens=8")).run
    emitted = {}
    for e in run.events:
        if e["ev"] == "prefill" and e["ctx"] == 64:
            emitted[e["req"]] = 1
        elif e["ev"] == "commit":
            want = 0 if emitted[e["req"]] < 8 else e["drafted"]
            assert e["accepted"] == want
            emitted[e["req"]] += e["emitted"]
    from sim.config import NOMINAL_PROFILE
    from sim.costs import CostProfile
    prof = CostProfile.load(NOMINAL_PROFILE)
    prof.acceptance = {"rate": 0.5, "markov": {"p_accept_after_accept": 0.5,
                                               "p_accept_after_reject": 0.5, "p_accept_first": 0.5}}
    with pytest.raises(ValueError, match="no `position` section"):
        run_predict(cfg_of(*SMALL, "acceptance=position", "acceptance.from_profile=true"),
                    profile=prof)
    with pytest.raises(SimConfigError, match="acceptance.position_rates"):
        run_predict(cfg_of(*SMALL, "acceptance=position", "acceptance.position_rates=[1.5]"))
    # Depth factors: a group's second and later drafts at factor 0 are never accepted.
    run = run_predict(cfg_of(*SMALL, "engine.mode=solo", "acceptance=position",
                             "acceptance.position_rates=[1.0]",
                             "acceptance.position_depth_factors=[1.0,0.0]")).run
    assert {e["accepted"] for e in run.events if e["ev"] == "commit" and e["drafted"]} == {1}
    # A profile with a shape table: a lone slot's windows (1x4) take the 1x4 column, and a
    # prompt chunk is charged at its bucket and tier.
    prof.decode_shapes = ["1x4"]
    prof.decode_shape_s = {a: [[0.5] for _ in prof.decode_tiers] for a in ("hit", "capture", "eager")}
    prof.prefill_tiers = [256.0]
    prof.prefill_table = [[7.0] * len(prof.prefill_tokens)]
    run = run_predict(cfg_of("workload=stagger", "workload.requests=1", "workload.max_tokens=20",
                             "workload.prompt_tokens=100"), profile=prof).run
    wins = [e for e in run.events if e["ev"] == "window"]
    assert all(e["dur"] == 0.5 for e in wins if e["key"].startswith("shape:1x4@"))
    assert any(e["key"].startswith("shape:1x4@") for e in wins)
    pre = [e for e in run.events if e["ev"] == "prefill"]
    assert [(e["tokens"], e["ctx"], e["dur"]) for e in pre] == [(100, 100, 7.0)]


def test_sim_check_takes_memory_facts_from_the_engine_trace():
    """scripts/sim_gpu_check.py predicts with the device the engine ran on, not the default
    24 GB card: its memory facts and measured graph size come from the held-out trace."""
    from sim.replay import memory_overrides
    from strata.trace import read_trace

    events = read_trace(REPO / "tests" / "data" / "h200_batch_mtp_n2_trace.jsonl")
    over = dict(o.split("=", 1) for o in memory_overrides(events))
    mem = events[0]["memory"]
    assert float(over["memory.total_mib"]) == mem["total_mib"] > 100_000  # the H200's
    assert float(over["memory.weights_mib"]) == mem["weights_mib"]
    assert float(over["memory.graph_mib"]) == 16.0  # written before `mib`: the estimate
    events = [dict(e) for e in events]
    caps = [e for e in events if e["ev"] == "window" and e["graph"] == "capture"]
    for e, mib in zip(caps, (10.0, 30.0)):
        e["mib"] = mib
    events.insert(1, {"ev": "warmup", "step": 0, "t": 0.0, "keys": ["shape:1x4@256"], "mib": [20.0]})
    over = dict(o.split("=", 1) for o in memory_overrides(events))
    assert float(over["memory.graph_mib"]) == 20.0  # mean of 20 (warm-up), 10 and 30


def test_the_h200_profile_predicts_a_closed_loop_with_at_most_k_in_flight():
    """The shipped H200 profile (host parts, chain acceptance) drives a closed-loop run."""
    prof = REPO / "conf" / "sim" / "profiles" / "h200_tiny_bf16.json"
    res = run_predict(cfg_of(f"profile={prof}", "memory=h200_tiny", "acceptance=chain",
                             "acceptance.from_profile=true", "engine.warmup_graphs=true",
                             "engine.max_context=1024", "engine.slots=8", "workload=stagger",
                             "workload.requests=10", "workload.prompt_tokens=128",
                             "workload.max_tokens=24", "workload.concurrency=3"))
    m = res.metrics
    assert len(m["requests"]) == 10 and all(r["finish_reason"] == "length" for r in m["requests"])
    in_flight = peak = 0
    for e in res.run.events:
        in_flight += (e["ev"] == "arrive") - (e["ev"] == "finish")
        peak = max(peak, in_flight)
    assert peak == 3
    assert 0.0 < m["acceptance"] < 1.0 and m["aggregate_tps"] > 0
