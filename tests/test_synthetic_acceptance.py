"""engine.synthetic_acceptance: accept decisions keyed by (seed, position), in every mode.

The rate holds in expectation (binomial tolerance), every window's accepted count equals the
decisions recomputed from the request's seed and the window's positions (so solo, batch_mtp,
graphs on and off all take the same decisions), the run warns, the trace's config event records
the knob, the simulator replays such a trace, and bad values are errors naming the key.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from omegaconf import OmegaConf

from conftest import cpu_engine_config, run_cohort

from strata.config import ConfigError, EngineConfig, StrataConfig, validate_engine
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.engine.sampling import SYNTHETIC_STREAM, synthetic_commit, synthetic_prefix, uniform_hash
from strata.model.tiny import make_tiny_random

torch.set_num_threads(1)


def test_rate_holds_in_expectation():
    p, g, n = 0.7, 5, 4000
    gen = torch.Generator().manual_seed(0)
    seed = torch.randint(0, 2 ** 62, (n,), generator=gen)
    pos = torch.randint(0, 100_000, (n,), generator=gen)
    rows = torch.full((n,), g)
    a = synthetic_prefix(rows, seed, pos, g, p)
    # Each draft reached is a Bernoulli(p) trial: a accepted, plus one rejection unless all passed.
    trials = (a + (a < g - 1).long()).sum().item()
    rate = a.sum().item() / trials
    sd = math.sqrt(p * (1 - p) / trials)
    assert abs(rate - p) < 4 * sd, (rate, p, sd)
    expected_a = sum(p ** j for j in range(1, g))
    sd_a = a.double().std().item() / math.sqrt(n)
    assert abs(a.double().mean().item() - expected_a) < 4 * sd_a


def test_edges_and_valid_rows():
    seed, pos = torch.tensor([5, 9]), torch.tensor([0, 1234])
    assert synthetic_prefix(torch.tensor([4, 4]), seed, pos, 4, 1.0).tolist() == [3, 3]
    assert synthetic_prefix(torch.tensor([4, 4]), seed, pos, 4, 0.0).tolist() == [0, 0]
    # rows beyond a group's valid rows are never accepted
    assert synthetic_prefix(torch.tensor([2, 1]), seed, pos, 4, 1.0).tolist() == [1, 0]


def test_commit_takes_drafts_then_the_target():
    tokens = torch.tensor([[10, 11, 12, 13]])
    targets = torch.tensor([[20, 21, 22, 23]])
    assert synthetic_commit(tokens, targets, torch.tensor([2])).tolist() == [[11, 12, 22, 23]]
    assert synthetic_commit(tokens, targets, torch.tensor([0])).tolist() == [[20, 21, 22, 23]]
    assert synthetic_commit(tokens, targets, torch.tensor([3])).tolist() == [[11, 12, 13, 23]]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_bad_values_name_the_key(bad):
    with pytest.raises(ConfigError, match="engine.synthetic_acceptance"):
        validate_engine(EngineConfig(synthetic_acceptance=bad))


def test_wrong_type_names_the_key():
    cfg = OmegaConf.structured(StrataConfig)
    with pytest.raises(Exception, match="synthetic_acceptance"):
        cfg.engine.synthetic_acceptance = "often"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("synthetic"), seed=4, tokenizer=False,
                            vocab_size=512)


def requests(n: int = 3) -> list[Request]:
    rng = random.Random(7)
    return [Request(f"r{i}", [rng.randrange(1, 512) for _ in range(3 + 4 * i)],
                    SamplingParams(max_tokens=40, seed=100 + i, stop_at_eos=False),
                    arrival_step=i)
            for i in range(n)]


def run(model_dir, mode: str, graphs: bool, p: float = 0.8, logs=None):
    cfg = cpu_engine_config(model_dir, 128, mode="solo" if mode == "solo" else "batch",
                            batch_mtp=mode == "batch_mtp", slots=4, window_rows=8, spec=4,
                            graphs=graphs, synthetic_acceptance=p)
    eng = Engine.from_config(cfg, log=(logs.append if logs is not None else lambda s: None))
    run_cohort(eng, requests(), 2000)
    return eng


def expected_accepts(seed: int, pos: int, drafted: int, p: float) -> int:
    j = torch.arange(1, drafted + 1)
    u = uniform_hash(torch.tensor(seed), pos + j, torch.full_like(j, SYNTHETIC_STREAM))
    return int((u < p).long().cumprod(0).sum())


@pytest.mark.parametrize("mode,graphs", [("solo", False), ("solo", True), ("batch_mtp", False),
                                         ("batch_mtp", True)])
def test_decisions_are_keyed_by_seed_and_position(model_dir, mode, graphs):
    p = 0.8
    eng = run(model_dir, mode, graphs, p)
    pos = {r.id: len(r.prompt_ids) for r in requests()}
    seeds = {r.id: r.params.seed for r in requests()}
    drafted = accepted = 0
    for ev in eng.trace.events:
        if ev["ev"] != "commit":
            continue
        rid = ev["req"]
        assert ev["accepted"] == expected_accepts(seeds[rid], pos[rid], ev["drafted"], p), ev
        pos[rid] += ev["accepted"] + 1
        drafted += ev["drafted"]
        accepted += ev["accepted"]
    assert drafted > 0 and accepted > 0
    assert (eng.drafted, eng.accepted) == (drafted, accepted)  # metrics: accepted / drafted
    for rid, rs in eng.requests.items():
        assert len(rs.emitted) == 40


def test_warns_and_records_the_knob(model_dir):
    logs = []
    eng = run(model_dir, "batch_mtp", False, 0.5, logs)
    warnings = [line for line in logs if line.startswith("WARNING") and "synthetic" in line]
    assert len(warnings) == 1 and "not the model's" in warnings[0]
    config = next(ev for ev in eng.trace.events if ev["ev"] == "config")
    assert config["engine"]["synthetic_acceptance"] == 0.5


def test_off_by_default(model_dir):
    assert EngineConfig().synthetic_acceptance is None


@pytest.mark.slow
def test_simulator_replays_a_synthetic_trace(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from sim.replay import load_trace, replay_trace

    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "STRATA_BATCH_MTP"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    proc = subprocess.run([sys.executable, "-m", "strata", "workload=synthetic", "workload.requests=3",
                           "workload.prompt_tokens=6", "workload.max_tokens=16",
                           "engine.synthetic_acceptance=0.8", "engine.slots=3", "device=cpu",
                           "print_outputs=false", "progress=false", f"hydra.run.dir={tmp_path}"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "synthetic" in proc.stdout + proc.stderr
    events, lines = load_trace(tmp_path / "trace.jsonl")
    assert events[0]["engine"]["synthetic_acceptance"] == 0.8
    assert sum(e["accepted"] for e in events if e["ev"] == "commit") > 0
    result = replay_trace(events, lines, name=str(tmp_path / "trace.jsonl"))
    assert result.ok, result.first_divergence


def test_simulator_takes_the_engines_decisions(model_dir):
    """sim.acceptance.SyntheticAcceptance, given a request's prompt length, seed and tokens
    emitted, accepts what the engine accepted at every commit of a batch_mtp run."""
    from sim.acceptance import SyntheticAcceptance
    from sim.workload import SimRequest

    eng = run(model_dir, "batch_mtp", False, 0.8)
    model = SyntheticAcceptance(0.8)
    sims = {r.id: SimRequest(id=r.id, index=i, prompt_tokens=len(r.prompt_ids), max_tokens=40,
                             arrival_step=0, seed=r.params.seed)
            for i, r in enumerate(requests())}
    emitted = {rid: 1 for rid in sims}  # the prompt chunk's token
    judged = 0
    for ev in eng.trace.events:
        if ev["ev"] != "commit":
            continue
        rid = ev["req"]
        assert model.accepted(sims[rid], ev["drafted"], emitted[rid]) == ev["accepted"], ev
        emitted[rid] += ev["emitted"]
        judged += ev["drafted"] > 0
    assert judged > 10


@pytest.mark.parametrize("mode, seeds", [("solo", None), ("batch_mtp", None),
                                         ("batch_mtp_deep", None), ("batch_mtp_deep", 5)])
def test_prediction_of_a_synthetic_run_takes_the_engines_windows(model_dir, mode, seeds):
    """With engine.synthetic_acceptance the simulator's prediction (not a replay: nothing of
    the trace is read) runs the engine's windows and commits, in order, accept counts included:
    requests of one seed and prompt length accept alike, as in the engine; with seeds k + i
    (workload.request_seeds=k, bench_engine.py --request-seeds) each draws its own."""
    from sim.config import register_configs
    from sim.predict import run_predict
    from hydra import compose, initialize_config_dir
    from sim.config import SIM_CONF_DIR

    n, prompt, out = 3, 6, 24
    knobs = dict(mode="solo" if mode == "solo" else "batch", batch_mtp=mode != "solo",
                 slots=n if mode != "solo" else 1, window_rows=8, spec=4, graphs=False,
                 synthetic_acceptance=0.8)
    if mode == "batch_mtp_deep":  # 3 slots in 12 rows: groups of 4 (1 + spec - 1 drafts)
        knobs.update(batch_mtp_drafts=3, window_rows=12)
    eng = Engine.from_config(cpu_engine_config(model_dir, 128, **knobs), log=lambda s: None)
    rng = random.Random(3)
    run_cohort(eng, [Request(f"r{i}", [rng.randrange(1, 512) for _ in range(prompt)],
                             SamplingParams(max_tokens=out, stop_at_eos=False,
                                            seed=0 if seeds is None else seeds + i),
                             arrival_step=0)
                     for i in range(n)], 2000)
    register_configs()
    with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "workload=cohort", f"workload.requests={n}", f"workload.prompt_tokens={prompt}",
            f"workload.max_tokens={out}", "spread.enabled=false", "engine.max_context=128",
            f"workload.request_seeds={'null' if seeds is None else seeds}",
            *(f"engine.{k}={str(v).lower() if isinstance(v, bool) else v}"
              for k, v in knobs.items())])
    result = run_predict(cfg)
    sim = result.run
    assert "synthetic decisions at 0.8" in result.info

    def schedule(events):
        return [(e["ev"], e.get("layout"), e.get("req"), e.get("accepted"))
                for e in events if e["ev"] in ("window", "commit", "prefill")]

    engine_events = schedule(eng.trace.events)
    assert sum(1 for e in engine_events if e[0] == "commit" and e[3]) > 3
    if mode == "batch_mtp_deep":
        assert any(e[0] == "window" and len(set(e[1])) > 1 and len(e[1]) > 2 * len(set(e[1]))
                   for e in engine_events), "no window of several slots' deeper groups"
    assert schedule(sim.events) == engine_events
    if mode != "solo":  # one seed: every request commits the same accept counts; k + i: not
        per_req = {}
        for e in engine_events:
            if e[0] == "commit":
                per_req.setdefault(e[2], []).append(e[3])
        assert (len({tuple(v) for v in per_req.values()}) == 1) == (seeds is None), per_req
