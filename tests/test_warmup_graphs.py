"""Warm-up captures the shape-keyed window graphs before any request (engine and simulator).

On CPU the recording capture backend stands in for CUDA graphs, so the cache logic, the
trace's `warmup` event and the simulator's replay and prediction of it all run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sim.config import compose_sim, register_configs
from sim.predict import run_predict
from sim.replay import replay_trace
from strata.config import StrataConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.model.tiny import make_tiny_random
from strata.trace import read_trace, warm_window_keys

register_configs()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("warm"), seed=5, tokenizer=False,
                            max_position_embeddings=512)


def run_engine(model_dir, tmp: Path, **engine) -> list[dict]:
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device, cfg.model.path = "cpu", str(model_dir)
    cfg.engine.warmup, cfg.engine.slots, cfg.engine.max_context = "on", 4, 512
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    trace = tmp / "trace.jsonl"
    eng = Engine.from_config(cfg, log=lambda s: None, trace_path=trace)
    for i in range(5):
        eng.add_request(Request(f"r{i}", list(range(5, 25 + 9 * i)),
                                SamplingParams(max_tokens=10 + 6 * i, stop_at_eos=False),
                                arrival_step=3 * i, stream_text=False))
    while eng.has_work():
        eng.step()
    eng.close()
    return read_trace(trace)


def test_warm_window_keys_order():
    keys = warm_window_keys(slots=8, most_rows=4, window_rows=8, shape_buckets=[1, 2, 4, 8, 16],
                            tier_min=256, max_context=1024)
    # Per tier: 4-row groups (2 fit: buckets 1, 2), 3-row (1, 2), 2-row (1, 2, 4), 1-row (1..8).
    per_tier = [(1, 4), (2, 4), (1, 3), (2, 3), (1, 2), (2, 2), (4, 2), (1, 1), (2, 1), (4, 1), (8, 1)]
    assert keys == [(b, g, t) for t in (256, 512, 1024) for b, g in per_tier]
    # Solo: one group of every depth; a tiny context has one tier.
    assert warm_window_keys(1, 4, 8, [1, 2, 4], 256, 128) == [(1, 4, 128), (1, 3, 128), (1, 2, 128),
                                                             (1, 1, 128)]


@pytest.mark.parametrize("limit", [0, 6])
def test_warmup_captures_then_requests_hit_and_the_sim_replays_it(model_dir, tmp_path, limit):
    events = run_engine(model_dir, tmp_path, graph_limit=limit)
    warm = [e for e in events if e["ev"] == "warmup"]
    assert len(warm) == 1
    want = warm_window_keys(4, 4, 8, [1, 2, 4, 8, 16], 256, 512)
    assert len(warm[0]["keys"]) == (len(want) if limit == 0 else limit)
    assert warm[0]["mib"] == [16.0] * len(warm[0]["keys"])
    windows = [e for e in events if e["ev"] == "window"]
    if limit == 0:  # every shape was captured: no request pays a capture
        assert {e["graph"] for e in windows} == {"hit"}
    else:
        assert windows[0]["graph"] == "hit"
    result = replay_trace(events)
    assert result.ok, str(result.first_divergence)
    # The replay rebuilt the same warm cache (its own `warmup` event) before the first step.
    assert [e for e in result.sim_events if e["ev"] == "warmup"][0]["keys"] == warm[0]["keys"]


def test_warmup_stops_where_the_budget_would_need_an_eviction(model_dir, tmp_path):
    # Room for the weights, 4 slots and a few 16 MiB graphs above the reserve.
    events = run_engine(model_dir, tmp_path, cpu_device_mib=2048 + 100, vram_reserve_mib=2048,
                        graph_limit=0)
    warm = next(e for e in events if e["ev"] == "warmup")
    assert 0 < len(warm["keys"]) < len(warm_window_keys(4, 4, 8, [1, 2, 4, 8, 16], 256, 512))
    assert not [e for e in events if e["ev"] == "evict" and e["step"] == 0]
    result = replay_trace(events)
    assert result.ok, str(result.first_divergence)


def test_layout_keys_are_not_warmed(model_dir, tmp_path):
    events = run_engine(model_dir, tmp_path, graph_key="layout")
    assert not [e for e in events if e["ev"] == "warmup"]
    assert [e for e in events if e["ev"] == "window"][0]["graph"] == "capture"
    assert replay_trace(events).ok


def test_predict_warms_the_same_keys_as_the_engine(model_dir, tmp_path):
    """The simulator's warm-up (engine.warmup_graphs=true) names the keys the engine captured."""
    events = run_engine(model_dir, tmp_path, graph_limit=0)
    engine_keys = next(e for e in events if e["ev"] == "warmup")["keys"]
    cfg = compose_sim(["engine.warmup_graphs=true", "engine.slots=4", "engine.max_context=512",
                       "engine.graph_limit=0", "workload.requests=6", "workload.max_tokens=20",
                       "workload.prompt_tokens=40"])
    run = run_predict(cfg).run
    sim_warm = next(e for e in run.events if e["ev"] == "warmup")
    assert sim_warm["keys"] == engine_keys
    assert {e["graph"] for e in run.events if e["ev"] == "window"} == {"hit"}
    cold = compose_sim(["engine.slots=4", "workload.requests=2"])
    assert not [e for e in run_predict(cold).run.events if e["ev"] == "warmup"]
