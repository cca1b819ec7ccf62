"""scripts/sim_calibration_replay.py on the H200 transfer check's recorded data (issue 21): the
calibration's traces alone are refitted, every cohort cell is predicted, and the trace's own
cost is checked against the untraced runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RAW = REPO / "docs" / "bench" / "s8" / "transfer_raw.tar.gz"


@pytest.mark.slow
def test_replay_refits_the_calibration_and_predicts_every_cell(tmp_path):
    res = subprocess.run([sys.executable, "scripts/sim_calibration_replay.py", str(RAW),
                          "--out", str(tmp_path), "--no-own-acceptance"], cwd=REPO,
                         capture_output=True, text=True, env={"PYTHONPATH": str(REPO),
                                                              "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads((tmp_path / "replay.json").read_text())
    cells = {r["cell"]: r for r in out["learned_acceptance"]}
    assert set(cells) == {"solo N=1", "batch N=4", "batch N=8", "batch_mtp N=4",
                          "batch_mtp W16 N=8"}
    # The fit saw the 11 calibration traces only (no cohort run of the check).
    prof = json.loads(Path(out["profile"]).read_text())
    files = prof["source"]["files"]
    assert len(files) == 11 and all("/calibration/" in f for f in files)
    for r in cells.values():
        assert r["sim_tps"] > 0 and r["range"][0] <= r["sim_tps"] <= r["range"][1]
    # A traced run less its trace's own time lands within the untraced runs' spread (the
    # engine's run-to-run spread here: up to 25% between two runs of one cell).
    compile_pass = [r for r in out["trace_cost"] if r["run"] == "compile pass"]
    assert len(compile_pass) == 5 and all(abs(r["error"]) < 0.1 for r in compile_pass)
    # The untraced-twin check: each cell's factor from the other four, one prediction each
    # (on this noisy call some cells' untraced walls are under their traced device time: such
    # a cell's own factor is None, and the others' factor still predicts it).
    assert [r["cell"] for r in out["twin_walls"]] == [r["cell"] for r in out["twin_sims"]]
    assert len(out["twin_walls"]) == 5
    assert all(0 < r["factor_others"] < 2 and r["predicted_wall_s"] > 0
               for r in out["twin_walls"])


RAW9 = REPO / "docs" / "bench" / "s9" / "transfer_raw.tar.gz"


def _replay(tmp_path, raw, *args):
    return subprocess.run([sys.executable, "scripts/sim_calibration_replay.py", str(raw),
                           "--out", str(tmp_path), *args], cwd=REPO, capture_output=True,
                          text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_a_cohort_run_cannot_stand_in_for_a_calibration_cell(tmp_path):
    res = _replay(tmp_path, RAW9, "--stand-in", "engine/batch_N=4/traced")
    assert res.returncode != 0 and "a cohort run is held out" in res.stderr
    res = _replay(tmp_path, RAW9, "--stand-in", "no_such_run")
    assert res.returncode != 0 and "no_such_run" in res.stderr


@pytest.mark.slow
def test_s9_refit_with_a_4_slot_stand_in_prices_every_cell_within_5_percent(tmp_path):
    # The H200 call of d0b2b29: its calibration (8-slot batch cells) plus its acceptance run
    # (batch_mtp N=4 in a 4-slot engine, no cohort's prompts), each cell at its own acceptance
    # with the host factor held out from the other cells (docs/SIMULATOR.md, "The slot count").
    res = _replay(tmp_path, RAW9, "--stand-in", "acceptance_run", "--no-own-acceptance")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads((tmp_path / "replay.json").read_text())
    assert out["slot_scale"]["slots"] == [1, 4, 8]
    scale = dict(zip(out["slot_scale"]["slots"], out["slot_scale"]["scale"]))
    assert 0.94 < scale[4] / scale[8] < 0.99  # 4 slots' windows cheaper
    errors = {r["cell"]: r["error"] for r in out["twin_sims"]}
    assert len(errors) == 5 and all(abs(e) < 0.05 for e in errors.values()), errors


def test_the_refit_uses_the_calibrations_own_untraced_twins(tmp_path):
    # A transfer directory whose calibration recorded an untraced twin for one run of two:
    # the refit scales its host parts by that run's factor and names the other.
    sys.path.insert(0, str(REPO / "scripts"))
    import sim_calibration_replay as replay
    from test_sim_untraced_twins import _events

    from sim.untraced_twins import NO_TWIN

    src = tmp_path / "transfer"
    for run in ("a", "b"):
        (src / "calibration" / run).mkdir(parents=True)
        (src / "calibration" / run / "trace.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in _events(0.080, 0.005)))
    (src / "conf" / "profiles").mkdir(parents=True)
    (src / "conf" / "profiles" / "cal.json").write_text(json.dumps({"source": {
        "date": "2026-12-01", "calibration": {"grid": "quick", "runs": [
            {"run": "a", "wall_s": 0.1, "untraced_wall_s": 0.09}, {"run": "b", "wall_s": 0.1}]}}}))
    prof = json.loads(replay.refit(src, tmp_path / "conf", "r").read_text())
    twin = prof["source"]["untraced_host"]
    assert twin["factor"] == pytest.approx(0.6667, abs=1e-3) and twin["left_out"] == {"b": NO_TWIN}
