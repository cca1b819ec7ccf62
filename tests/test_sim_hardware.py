"""Hardware presets, prediction ranges and acceptance from a trace (issue 21), all on the CPU."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sim.config import SIM_CONF_DIR, SimConfigError, register_configs
from sim.costs import CostProfile
from sim.metrics import metrics_table
from sim.predict import acceptance_inputs, run_predict
from sim.spread import end_factors, scaled, speed_quantiles
from sim.trace_acceptance import admitted_requests, fit_from_trace

REPO = Path(__file__).resolve().parent.parent
H200_TRACE = REPO / "tests" / "data" / "h200_batch_mtp_n2_trace.jsonl"

register_configs()


def cfg_of(*overrides: str):
    with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


SMALL = ("workload=cohort", "workload.requests=4", "workload.prompt_tokens=64",
         "workload.max_tokens=32", "engine.slots=4")


# --- presets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(p.stem for p in (Path(SIM_CONF_DIR) / "hardware").glob("*.yaml")))
def test_every_shipped_preset_composes_and_predicts(preset):
    cfg = cfg_of(f"hardware={preset}", *SMALL)
    assert cfg.hardware.name == preset and cfg.hardware.description
    assert Path(cfg.profile).is_file(), cfg.profile
    m = run_predict(cfg).metrics
    assert m["output_tokens"] == 4 * 32
    lo, hi = m["range"]["aggregate_tps"]
    assert lo <= m["aggregate_tps"] <= hi


def test_h200_preset_brings_profile_memory_and_served_engine_defaults():
    cfg = cfg_of("hardware=h200_tiny_bf16")
    plain = cfg_of()
    assert cfg.profile.endswith("conf/sim/profiles/h200_tiny_bf16.json")
    assert cfg.memory == cfg_of("memory=h200_tiny").memory
    assert cfg.engine.warmup_graphs is True
    # every other engine knob is strata's own default (conf/engine/default.yaml)
    from omegaconf import OmegaConf

    from strata.config import StrataConfig

    served = OmegaConf.structured(StrataConfig).engine
    for key, value in cfg.engine.items():
        if key in served and key != "warmup_graphs":
            assert served[key] == value, key
    assert {k: v for k, v in cfg.engine.items() if k != "warmup_graphs"} == \
        {k: v for k, v in plain.engine.items() if k != "warmup_graphs"}
    assert cfg.spread.machine > 0


def test_command_line_overrides_win_over_the_preset():
    cfg = cfg_of("hardware=h200_tiny_bf16", "memory=cpu", "engine.warmup_graphs=false",
                 "profile=/elsewhere.json", "spread.machine=0")
    assert cfg.memory.total_mib == cfg_of("memory=cpu").memory.total_mib
    assert cfg.engine.warmup_graphs is False
    assert cfg.profile == "/elsewhere.json" and cfg.spread.machine == 0


def test_no_preset_keeps_the_old_defaults():
    cfg = cfg_of()
    assert cfg.profile is None and cfg.hardware.name == "" and cfg.memory.total_mib == 24564


# --- ranges ----------------------------------------------------------------------------------

def test_scaled_profile_multiplies_each_kind():
    p = CostProfile.load(Path(SIM_CONF_DIR) / "profiles" / "h200_tiny_bf16.json")
    s = scaled(p, window=2.0, prefill=3.0, host=0.5)
    assert s.decode_time(8, 256, "hit", (4, 2)) == pytest.approx(2 * p.decode_time(8, 256, "hit", (4, 2)))
    assert s.decode_time(5, 300, "eager") == pytest.approx(2 * p.decode_time(5, 300, "eager"))
    assert s.prefill_time(128, 256) == pytest.approx(3 * p.prefill_time(128, 256))
    assert s.host_time(3, 1, True, 1) == pytest.approx(0.5 * p.host_time(3, 1, True, 1))
    assert p.decode_time(8, 256, "hit", (4, 2)) != s.decode_time(8, 256, "hit", (4, 2))  # a copy


def test_end_factors_come_from_trace_speeds_and_the_machine_term():
    p = CostProfile.load(Path(SIM_CONF_DIR) / "profiles" / "h200_tiny_bf16.json")
    q = speed_quantiles(p, [0.1, 0.9])
    assert all(lo < 1.0 < hi for lo, hi in q.values())
    f = end_factors(p, [0.1, 0.9], 0.2)
    assert f["fast"]["host"] == pytest.approx(q["host"][0] / 1.2)
    assert f["slow"]["window"] == pytest.approx(q["window"][1] * 1.2)
    # Runs the fit could not judge (factor 1 for want of shared cells) do not narrow it.
    p.source = {**p.source, "trace_speeds": {"window": [1.0, 1.0, 1.0, 0.8, 1.25]},
                "trace_speeds_judged": {"window": [False, False, False, True, True]}}
    assert speed_quantiles(p, [0.0, 1.0])["window"] == pytest.approx((0.8, 1.25))
    bare = CostProfile.load(Path(SIM_CONF_DIR) / "profiles" / "nominal.json")  # no speeds
    assert end_factors(bare, [0.1, 0.9], 0.0) == {"fast": {k: 1.0 for k in ("window", "prefill", "host")},
                                                 "slow": {k: 1.0 for k in ("window", "prefill", "host")}}


def test_range_is_in_metrics_json_and_the_printed_table(tmp_path, capsys):
    from sim.metrics import metrics_table

    res = run_predict(cfg_of("hardware=h200_tiny_bf16", *SMALL), tmp_path)
    m = json.loads((tmp_path / "metrics.json").read_text())
    r = m["range"]
    assert r["quantiles"] == [0.1, 0.9] and r["machine"] == pytest.approx(0.2)
    lo, hi = r["aggregate_tps"]
    assert lo < m["aggregate_tps"] < hi
    assert r["e2e_s.p50"][0] < m["e2e_s"]["p50"] < r["e2e_s.p50"][1]
    assert {run["end"] for run in r["runs"]} == {"fast", "slow"}
    assert "aggregate tok/s range (p10-p90 of runs, machines +-20%)" in metrics_table(res.metrics)


def test_range_widens_with_the_machine_term_and_other_profiles():
    narrow = run_predict(cfg_of("hardware=h200_tiny_bf16", "spread.machine=0", *SMALL)).metrics
    wide = run_predict(cfg_of("hardware=h200_tiny_bf16", "spread.machine=0.3", *SMALL)).metrics
    assert wide["range"]["aggregate_tps"][0] < narrow["range"]["aggregate_tps"][0]
    assert wide["range"]["aggregate_tps"][1] > narrow["range"]["aggregate_tps"][1]
    nominal = str(Path(SIM_CONF_DIR) / "profiles" / "nominal.json")
    both = run_predict(cfg_of("hardware=h200_tiny_bf16", "spread.machine=0",
                              f"spread.profiles=[{nominal}]", *SMALL)).metrics
    other = run_predict(cfg_of(f"profile={nominal}", "memory=h200_tiny",
                               "engine.warmup_graphs=true", *SMALL)).metrics
    lo, hi = both["range"]["aggregate_tps"]
    assert lo <= min(other["aggregate_tps"], narrow["range"]["aggregate_tps"][0])
    assert hi >= max(other["aggregate_tps"], narrow["range"]["aggregate_tps"][1])


def test_spread_disabled_or_bad():
    assert "range" not in run_predict(cfg_of("spread.enabled=false", *SMALL)).metrics
    with pytest.raises(SimConfigError, match="spread.quantiles"):
        run_predict(cfg_of("spread.quantiles=[0.9,0.1]", *SMALL))
    with pytest.raises(SimConfigError, match="spread.machine"):
        run_predict(cfg_of("spread.machine=-0.1", *SMALL))


# --- acceptance from a trace -----------------------------------------------------------------

def test_fit_from_a_real_engine_trace():
    fit = fit_from_trace(H200_TRACE)
    events = [json.loads(x) for x in H200_TRACE.read_text().splitlines()]
    commits = [e for e in events if e["ev"] == "commit"]
    assert fit["acceptance_metric"] == pytest.approx(
        sum(c["accepted"] for c in commits) / sum(c["drafted"] for c in commits))
    assert admitted_requests(events) == ["req0", "req1"]
    one = fit_from_trace(H200_TRACE, requests=1)
    assert one["commits"] == sum(1 for c in commits if c["req"] == "req0")
    with pytest.raises(SimConfigError, match="from_trace_requests: 3 requests asked"):
        fit_from_trace(H200_TRACE, requests=3)
    with pytest.raises(SimConfigError, match="acceptance.from_trace: .*not found"):
        fit_from_trace(H200_TRACE.parent / "missing.jsonl")


def test_from_trace_replaces_the_profiles_acceptance():
    base = ("hardware=h200_tiny_bf16", "workload=cohort", "workload.requests=2",
            "workload.prompt_tokens=128", "workload.max_tokens=96", "engine.slots=2",
            "engine.max_context=1024", "spread.enabled=false")
    cfg = OmegaConf.to_object(cfg_of(*base, "acceptance=fixed", f"acceptance.from_trace={H200_TRACE}"))
    prof = CostProfile.load(cfg.profile)
    acc_cfg, fit = acceptance_inputs(cfg, prof)
    assert acc_cfg.from_profile and fit == fit_from_trace(H200_TRACE, prior=prof.acceptance)
    assert fit["rate"] != prof.acceptance["rate"]
    assert run_predict(cfg).metrics["acceptance"] != run_predict(
        cfg_of(*base, "acceptance=fixed", "acceptance.from_profile=true")).metrics["acceptance"]
    with pytest.raises(SimConfigError, match="from_trace_requests: needs acceptance.from_trace"):
        run_predict(cfg_of(*base, "acceptance.from_trace_requests=2"))


def test_acceptance_learned_from_8_requests_transfers_to_the_rest(tmp_path):
    """A workload of 40 requests whose text the simulator draws from a known Markov chain
    (it writes an engine-format trace): fitted from the trace's first 8 requests, the model
    predicts the other 32 requests' acceptance within 0.03."""
    wl = ("workload=stagger", "workload.requests=40", "workload.concurrency=4",
          "workload.prompt_tokens=64", "workload.max_tokens=96", "engine.slots=4",
          "hardware=h200_tiny_bf16", "spread.enabled=false")
    truth = ("acceptance=markov", "acceptance.p_accept_after_accept=0.92",
             "acceptance.p_accept_after_reject=0.6", "acceptance.p_accept_first=0.85")
    run_predict(cfg_of(*wl, *truth, "seed=1"), tmp_path / "user")
    trace = tmp_path / "user" / "trace.jsonl"
    events = [json.loads(x) for x in trace.read_text().splitlines()]
    rest = set(admitted_requests(events)[8:])
    rest_commits = [e for e in events if e["ev"] == "commit" and e["req"] in rest]
    measured = (sum(c["accepted"] for c in rest_commits) / sum(c["drafted"] for c in rest_commits))
    pred = run_predict(cfg_of(*wl, "acceptance=markov", f"acceptance.from_trace={trace}",
                              "acceptance.from_trace_requests=8", "workload.requests=32",
                              "seed=2")).metrics
    assert abs(pred["acceptance"] - measured) < 0.03
    # the chain's per-request spread needs more than 8 requests: left out of such a fit
    few, every = fit_from_trace(trace, 8), fit_from_trace(trace)
    assert few["chain"]["spread"] == 0.0 and "spread_left_out" in few["chain"]
    assert "spread_left_out" not in every["chain"]


# --- unmeasured window shapes ----------------------------------------------------------------

def test_unmeasured_shape_takes_the_nearest_measured_shape_of_its_depth():
    p = CostProfile.load(Path(SIM_CONF_DIR) / "profiles" / "h200_tiny_bf16.json")
    assert [s for s in p.decode_shapes if s.endswith("x1")] == ["1x1"]
    # plain batch's 4x1 and 8x1 windows: priced as 1x1 (the one 1-row-group shape measured)
    for tier in (256, 512):
        assert p.decode_time(4, tier, "hit", (4, 1)) == p.decode_time(1, tier, "hit", (1, 1))
        assert p.decode_time(8, tier, "hit", (8, 1)) == p.decode_time(1, tier, "hit", (1, 1))
    # 16x2: the largest 2-row shape measured (8x2); 2x4 has no 4-deep neighbour but 1x4
    assert p.decode_time(32, 256, "hit", (16, 2)) == p.decode_time(16, 256, "hit", (8, 2))
    assert p.decode_time(8, 256, "hit", (2, 4)) == p.decode_time(4, 256, "hit", (1, 4))
    # no measured shape of that depth: carried along the depth of the nearest family with two
    # depths or more (1x3, 1x4 here), not the rows table's shallow windows of as many rows
    assert not p.unmeasured_depth((2, 4)) and p.unmeasured_depth((2, 5))


def test_a_window_deeper_than_the_profile_costs_one_step_more_per_draft():
    """A solo window one draft deeper than the profile measured (1x5 where it holds 1x1 to
    1x4): priced along the 1x3 -> 1x4 step, not as the rows table's 5-row windows (shallow
    batch shapes, cheaper than 1x4), which predicted spec 5 faster than spec 4."""
    p = CostProfile.load(Path(SIM_CONF_DIR) / "profiles" / "h200_tiny_bf16.json")
    for tier in (256, 300, 512):
        t3, t4 = (p.decode_time(d, tier, "hit", (1, d)) for d in (3, 4))
        assert p.decode_time(5, tier, "hit", (1, 5)) == pytest.approx(2 * t4 - t3)
        assert p.decode_time(6, tier, "hit", (1, 6)) == pytest.approx(3 * t4 - 2 * t3)
        assert p.decode_time(5, tier, "hit", (1, 5)) >= t4
        assert p.decode_time(5, tier, "hit", (1, 5)) > p.decode_time(5, tier, "hit")
    assert p.decode_time(10, 256, "hit", (2, 5)) == p.decode_time(5, 256, "hit", (1, 5))
    # a family whose deeper shape measured faster (noise): never below the deepest's time
    q = copy.deepcopy(p)
    k3, k4 = q.decode_shapes.index("1x3"), q.decode_shapes.index("1x4")
    for row in q.decode_shape_s["hit"]:
        row[k3], row[k4] = 0.5e-3, 0.4e-3
    assert q.decode_time(5, 256, "hit", (1, 5)) == pytest.approx(0.4e-3)


def test_no_family_of_two_depths_leaves_the_rows_table():
    p = CostProfile.load(Path(SIM_CONF_DIR) / "profiles" / "h200_tiny_bf16.json")
    keep = [k for k, n in enumerate(p.decode_shapes) if n in ("1x1", "2x2")]
    p.decode_shapes = [p.decode_shapes[k] for k in keep]
    p.decode_shape_s = {a: [[row[k] for k in keep] for row in t]
                        for a, t in p.decode_shape_s.items()}
    p.decode_shape_submit_s = None
    assert not p.unmeasured_depth((1, 5))
    assert p.decode_time(5, 256, "hit", (1, 5)) == p.decode_time(5, 256, "hit")


def test_predict_names_the_shapes_it_priced_past_the_profile(tmp_path):
    wl = ("hardware=h200_tiny_bf16", "acceptance=chain", "workload=cohort", "workload.requests=1",
          "workload.prompt_tokens=64", "workload.max_tokens=64", "engine.mode=solo",
          "spread.enabled=false")
    deep = run_predict(cfg_of(*wl, "engine.spec=5"), tmp_path / "deep").metrics
    assert deep["sim"]["extrapolated_shapes"] == ["1x5"]
    assert "1x5" in metrics_table(deep)
    assert run_predict(cfg_of(*wl, "engine.spec=4")).metrics["sim"]["extrapolated_shapes"] == []
