"""A decode window's own host share (cost profile `host.launch_s`): what the serial loop waits
for inside a window's wall, and engine.overlap runs while the window before is on the device."""

from __future__ import annotations

import copy

import pytest
from sim.config import NOMINAL_PROFILE, compose_sim, register_configs
from sim.costs import GRAPH_ACTIONS, CostProfile
from sim.predict import run_predict

register_configs()
LAUNCH_S = 60e-6


def _cfg(*extra):
    return compose_sim(["workload=cohort", "workload.requests=4", "workload.prompt_tokens=64",
                        "workload.max_tokens=64", "spread.enabled=false", "print_outputs=false",
                        *extra])


def _profiles() -> tuple[CostProfile, CostProfile]:
    """The same machine twice: its windows' launch share split out (`host.launch_s`, as a
    profile fitted from traces with `dev`), and folded into the decode tables (one fitted from
    `dur` alone)."""
    split = CostProfile.load(NOMINAL_PROFILE)
    split.host_launch_s = LAUNCH_S
    folded = copy.deepcopy(split)
    folded.host_launch_s = 0.0
    folded.decode_s = {a: [[x + LAUNCH_S for x in row] for row in folded.decode_s[a]]
                       for a in GRAPH_ACTIONS}
    if folded.decode_shape_s is not None:
        folded.decode_shape_s = {a: [[x + LAUNCH_S for x in row] for row in
                                     folded.decode_shape_s[a]] for a in GRAPH_ACTIONS}
    return split, folded


@pytest.mark.parametrize("mode", ["engine.mode=solo", "engine.batch_mtp=true"])
def test_the_serial_loop_pays_the_launch_share_as_it_did_inside_the_window(tmp_path, mode):
    split, folded = _profiles()
    a = run_predict(_cfg(mode, "engine.overlap=false"), tmp_path / "split", profile=split)
    b = run_predict(_cfg(mode, "engine.overlap=false"), tmp_path / "folded", profile=folded)
    assert a.metrics["aggregate_tps"] == pytest.approx(b.metrics["aggregate_tps"], rel=1e-9)
    # Its windows are traced as the engine traces a serial one: `dur` the call's wall, `dev`
    # the device's share of it.
    wins = [e for e in a.run.events if e["ev"] == "window"]
    assert wins and all(e["dur"] - e["dev"] == pytest.approx(LAUNCH_S, abs=2e-6) for e in wins)
    assert [e["dur"] for e in wins] == [e["dur"] for e in b.run.events if e["ev"] == "window"]


@pytest.mark.parametrize("mode", ["engine.mode=solo", "engine.batch_mtp=true"])
def test_overlap_hides_the_launch_share_behind_the_window_in_flight(tmp_path, mode):
    split, folded = _profiles()
    a = run_predict(_cfg(mode, "engine.overlap=true"), tmp_path / "split", profile=split)
    b = run_predict(_cfg(mode, "engine.overlap=true"), tmp_path / "folded", profile=folded)
    assert a.metrics["aggregate_tps"] > b.metrics["aggregate_tps"]
    # Overlapped windows carry their device seconds alone, as the engine's CUDA events do.
    assert all("dev" not in e for e in a.run.events if e["ev"] == "window")


def test_the_launch_share_round_trips_and_is_checked():
    split, _ = _profiles()
    again = CostProfile.from_dict(split.to_dict())
    assert again.host_launch_s == LAUNCH_S
    d = split.to_dict()
    d["host"]["launch_s"] = -1e-6
    with pytest.raises(ValueError, match="host.launch_s"):
        CostProfile.from_dict(d)
