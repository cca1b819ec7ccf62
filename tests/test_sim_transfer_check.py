"""scripts/sim_transfer_check.py: a run that only measures (--no-predict) writes its
measurements, and --predict-from predicts them on another machine (no device), with the run's
own workload and presets: the CPU smoke run of the script's docstring, moved between the two."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "sim_transfer_check.py"
CELLS = ["solo N=1", "batch N=4", "batch N=8", "batch_mtp N=4", "batch_mtp W16 N=8"]


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_measure_here_predict_elsewhere(tmp_path):
    device_out, moved = tmp_path / "device", tmp_path / "moved"
    r = _run("--device", "cpu", "--shipped", "cpu_tiny", "--max-tokens", "16", "--repeats", "1",
             "--grid", "tiny", "--max-context", "256", "--threads", "1", "--no-predict",
             "--out", str(device_out))
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((device_out / "measured.json").read_text())
    assert [row["cell"] for row in m["rows"]] == CELLS and not (device_out / "transfer.md").exists()
    assert set(m["rest_acceptance"]) == {"batch_mtp N=4", "solo"}
    # Another machine: the calibrated preset names a profile path that is not there.
    shutil.move(str(device_out), str(moved))
    # (4 acceptance draws a drafting cell, not the default 64: the same code, a minute less)
    r = _run("--predict-from", str(moved), "--acceptance-draws", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    t = json.loads((moved / "transfer.json").read_text())
    for row, measured in zip(t["rows"], m["rows"]):
        assert row["engine_tps"] == measured["engine_tps"]
        for label in ("shipped", "calibrated"):
            assert row[label]["tps"] > 0
            assert row[label]["error"] == pytest.approx(row[label]["tps"] / row["engine_tps"] - 1)
    assert t["args"]["max_tokens"] == "16" and len(t["acceptance_rest"]) == 2
    preset = (moved / "conf" / "hardware" / "calibrated_transfer.yaml").read_text()
    assert f"profile: {(moved / 'conf' / 'profiles').resolve()}" in preset
    # Drafting cells are averaged over acceptance draws, the others are one simulation.
    draws = {row["cell"]: row["calibrated"]["draws"] for row in t["rows"]}
    assert draws["solo N=1"] == 4 and draws["batch N=4"] == 1
    # A copy of a run whose original is still there reads its own profile.
    copied = tmp_path / "copied"
    shutil.copytree(moved, copied)
    r = _run("--predict-from", str(copied), "--acceptance-draws", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    preset = (copied / "conf" / "hardware" / "calibrated_transfer.yaml").read_text()
    assert f"profile: {(copied / 'conf' / 'profiles').resolve()}" in preset


def test_predict_from_without_measurements_says_so(tmp_path):
    r = _run("--predict-from", str(tmp_path))
    assert r.returncode != 0 and "measured.json: not found" in r.stderr
    (tmp_path / "measured.json").write_text("{}")
    r = _run("--predict-from", str(tmp_path))
    assert r.returncode != 0 and "not a measurements file" in r.stderr
    r = _run("--predict-from", str(tmp_path), "--acceptance-draws", "0")
    assert r.returncode != 0 and "--acceptance-draws: must be >= 1" in r.stderr
