"""A window's time by the engine's slot count (sim/slot_speeds.py, CostProfile.for_slots): the
fit keeps the slot count's share of each run's speed apart, and a prediction applies the scale
of its own slot count (issue 21: 4-slot windows priced from 8-slot runs came out 5-6% dear)."""

from __future__ import annotations

import json
import math

import pytest
from hydra import compose, initialize_config_dir

from sim.config import SIM_CONF_DIR, register_configs
from sim.costs import CostProfile, ProfileError
from sim.predict import build_scenario
from sim.profile import fit_profile
from sim.slot_speeds import SlotFit, fit_slot_scale, trace_slots

register_configs()

KNOBS = {"prefill_buckets": [16, 32, 64, 128, 256], "context_tier_min": 256, "max_context": 1024}
W42 = ("shape:4x2@256", [0, 0, 1, 1, 2, 2, 3, 3], 256, "hit")
W41 = ("shape:4x1@256", [0, 1, 2, 3], 256, "hit")
W14 = ("shape:1x4@256", [0, 0, 0, 0], 256, "hit")


def _trace(slots, windows):
    evs = [{"ev": "config", "step": 0, "t": 0.0, "engine": {**KNOBS, "slots": slots},
            "memory": {"slots": slots}}]
    for step, (key, layout, tier, graph, dur) in enumerate(windows, 1):
        evs.append({"ev": "window", "step": step, "t": float(step), "layout": list(layout),
                    "key": key, "graph": graph, "rows": len(layout), "dur": dur, "ctx": tier})
    evs.append({"ev": "prefill", "step": len(windows) + 1, "t": len(windows) + 1.0,
                "req": "a", "slot": 0, "tokens": 64, "dur": 0.01, "ctx": 64})
    return evs


def test_a_slot_count_linked_by_a_shared_shape_prices_its_unlinked_shapes_too():
    # 8 slots: 4x2 at 10 ms and 1x4 at 20 ms. 4 slots: 4x2 5% cheaper (9.5 ms) in one run,
    # and, in a run no other slot count shares a shape with (plain batch at 4 slots), 4x1 at
    # 8 ms. At 4 slots the profile gives back what the 4-slot runs measured, at 8 slots the
    # 8-slot ones, and 4x1 in an 8-slot engine is the 4-slot price over the slots' ratio.
    eight = _trace(8, [(*W42, 0.010)] * 30 + [(*W14, 0.020)] * 30)
    four = _trace(4, [(*W42, 0.0095)] * 30)
    plain4 = _trace(4, [(*W41, 0.008)] * 30)
    prof = fit_profile([eight, four, plain4])
    assert prof.decode_slot_scale["slots"] == [4, 8]
    s4, s8 = prof.for_slots(4), prof.for_slots(8)
    assert s4.decode_time(8, 256, "hit", (4, 2)) == pytest.approx(0.0095, rel=1e-3)
    assert s8.decode_time(8, 256, "hit", (4, 2)) == pytest.approx(0.010, rel=1e-3)
    assert s4.decode_time(4, 256, "hit", (4, 1)) == pytest.approx(0.008, rel=1e-3)
    assert s8.decode_time(4, 256, "hit", (4, 1)) == pytest.approx(0.008 / 0.95, rel=1e-3)
    assert s8.decode_time(4, 256, "hit", (1, 4)) == pytest.approx(0.020, rel=1e-3)
    # clamped outside the measured counts, log2-linear between them
    assert prof.for_slots(1).decode_time(8, 256, "hit", (4, 2)) == pytest.approx(0.0095, rel=1e-3)
    lo, hi = prof.slot_factor(4), prof.slot_factor(8)
    assert prof.slot_factor(6) == pytest.approx(lo + (math.log2(6) - 2) * (hi - lo))
    # The slot count is no run-to-run noise: the runs' speeds for the range stay at 1.
    assert prof.source["trace_speeds"]["window"] == pytest.approx([1, 1, 1], rel=1e-3)
    assert prof.source["slot_scale"]["trace_slots"] == [8, 4, 4]


def test_one_slot_count_or_none_linked_leaves_no_scale():
    same = fit_profile([_trace(8, [(*W42, 0.010)] * 30), _trace(8, [(*W42, 0.011)] * 30)])
    assert same.decode_slot_scale is None and "slot_scale" not in same.source
    assert same.for_slots(4) is same
    # two slot counts that share no steady shape: nothing says what the slot count costs
    apart = fit_profile([_trace(8, [(*W42, 0.010)] * 30), _trace(4, [(*W41, 0.008)] * 30)])
    assert apart.decode_slot_scale is None


def test_slot_fit_keeps_unknown_slot_counts_as_they_are():
    fit = fit_slot_scale({0: 1.05, 1: 0.95, 2: 1.0}, {0: 0, 1: 0}, {0: 8, 1: 4, 2: None})
    assert fit.scale == pytest.approx({8: 1.05, 4: 0.95})
    assert fit.divisor[2] == 1.0 and fit.residual[2] == 1.0
    assert fit.residual[0] == pytest.approx(1.0) and fit.divisor[0] == pytest.approx(1.05)
    assert SlotFit().at(4) == 1.0 and SlotFit().as_profile_field() is None


def test_trace_slots_from_the_config_event():
    assert trace_slots({"memory": {"slots": 3}, "engine": {"slots": 8}}) == 3  # what fit
    assert trace_slots({"engine": {"mode": "solo", "slots": 8}}) == 1
    assert trace_slots({"engine": {"slots": 4}}) == 4
    assert trace_slots({}) is None


def test_slot_scale_round_trips_and_bad_ones_name_the_key(tmp_path):
    prof = fit_profile([_trace(8, [(*W42, 0.010)] * 30), _trace(4, [(*W42, 0.0095)] * 30)])
    prof.save(tmp_path / "p.json")
    back = CostProfile.load(tmp_path / "p.json")
    assert back.decode_slot_scale == prof.decode_slot_scale
    d = json.loads((tmp_path / "p.json").read_text())
    d["decode"]["slot_scale"]["scale"] = [1.0]
    with pytest.raises(ProfileError, match="decode.slot_scale.scale"):
        CostProfile.from_dict(d)
    d["decode"]["slot_scale"] = {"slots": [8, 4], "scale": [1.0, 1.0]}
    with pytest.raises(ProfileError, match="decode.slot_scale.slots"):
        CostProfile.from_dict(d)


def test_a_prediction_prices_windows_at_its_own_slot_count(tmp_path):
    prof = fit_profile([_trace(8, [(*W42, 0.010)] * 30), _trace(4, [(*W42, 0.0095)] * 30)])
    for slots, want in ((4, 0.0095), (8, 0.010)):
        with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                "workload=cohort", "workload.requests=2", f"engine.slots={slots}"])
        scenario, _ = build_scenario(cfg, prof)
        assert scenario.costs.decode_time(8, 256, "hit", (4, 2)) == pytest.approx(want, rel=1e-3)
