"""Cost-profile fitting: a profile fitted from simulated traces gives back the profile."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from sim.config import NOMINAL_PROFILE, SIM_CONF_DIR, register_configs
from sim.costs import CostProfile
from sim.predict import run_predict
from sim.profile import FitError, fit_profile, fit_profile_files, main

register_configs()


def traces(tmp_path):
    paths = []
    for i, extra in enumerate([["engine.slots=1"], ["engine.slots=4"],
                               ["engine.slots=4", "engine.graphs=false"]]):
        with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                "workload=cohort", "workload.requests=4", "workload.prompt_tokens=600",
                "workload.max_tokens=40", "acceptance=markov", f"seed={i}", *extra])
        run_predict(cfg, tmp_path / str(i))
        paths.append(tmp_path / str(i) / "trace.jsonl")
    return paths


#: Traces carry `dur` in microseconds.
DUR_RESOLUTION_S = 1e-6


def test_fit_recovers_the_profile_that_made_the_traces(tmp_path):
    truth = CostProfile.load(NOMINAL_PROFILE)
    prof = fit_profile_files(traces(tmp_path))
    assert prof.host_overhead_s == pytest.approx(truth.host_overhead_s, abs=2 * DUR_RESOLUTION_S)
    for tier in prof.decode_tiers:
        for rows in prof.decode_rows:
            for action in ("hit", "capture", "eager"):
                if prof.source["counts"][action][prof.decode_tiers.index(tier)][
                        prof.decode_rows.index(rows)]:
                    assert prof.decode_time(rows, tier, action) == pytest.approx(
                        truth.decode_time(rows, tier, action), abs=DUR_RESOLUTION_S)
    for tokens in prof.prefill_tokens:
        assert prof.prefill_time(tokens) == pytest.approx(truth.prefill_time(tokens),
                                                          abs=DUR_RESOLUTION_S)
    acc = prof.acceptance
    assert 0 < acc["rate"] < 1 and acc["commits"] > 0
    assert set(acc["markov"]) == {"p_accept_after_accept", "p_accept_after_reject",
                                  "p_accept_first"}


def test_fit_fills_missing_actions_and_saves(tmp_path):
    paths = traces(tmp_path)[:1]  # graphs on only: no eager windows
    out = tmp_path / "p.json"
    assert main(["--out", str(out)] + [str(p) for p in paths]) == 0
    prof = CostProfile.load(out)
    assert prof.source["actions_copied"] == {"eager": "hit"}
    assert prof.decode_time(2, 256, "eager") == prof.decode_time(2, 256, "hit")


def test_fit_without_durations_is_an_error():
    with pytest.raises(FitError, match="no window event"):
        fit_profile([[{"ev": "window", "step": 0, "t": 0, "layout": [0], "key": "k",
                       "graph": "hit", "rows": 1}]])


def test_profile_engine_script_grid_and_fit_only(tmp_path, capsys):
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "profile_engine", Path(__file__).resolve().parent.parent / "scripts" / "profile_engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--dry-run", "--device", "cpu", "--slots", "1,8", "--prompt-tokens", "64",
                     "--eager-slots", "8", "--work-dir", str(tmp_path)]) == 0
    cmds = [l for l in capsys.readouterr().out.splitlines() if l.startswith("[")]
    assert len(cmds) == 6  # slots 1: mtp on/off; slots 8: mtp on/off x graphs on/off
    assert all("device=cpu" in c and "-m strata workload=synthetic" in c for c in cmds)
    assert sum("engine.graphs=false" in c for c in cmds) == 2
    out = tmp_path / "p.json"
    assert mod.main(["--fit-only", *map(str, traces(tmp_path)), "--out", str(out)]) == 0
    assert CostProfile.load(out).source["device"] == "cuda"
