"""scripts/sim_transfer_check.py --predict-from: a run's measurements predicted on another
machine (no device), with the run's own workload and presets."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "sim_transfer_check.py"
ACC_TRACE = ROOT / "docs" / "bench" / "s18" / "transfer" / "acceptance_run" / "trace.jsonl"
CELLS = (("solo N=1", 1), ("batch N=4", 4), ("batch N=8", 8), ("batch_mtp N=4", 4),
         ("batch_mtp W16 N=8", 8))


def _measured(out: Path, name: str = "cpu_tiny") -> None:
    """A small run's measurements: the cpu_tiny preset as shipped, and as calibrated either it
    too or (`name`) a preset `sim calibrate` wrote on another machine, whose profile path is
    that machine's."""
    (out / "conf").mkdir(parents=True)
    (out / "acceptance_run").mkdir()
    shutil.copy(ACC_TRACE, out / "acceptance_run" / "trace.jsonl")
    if name != "cpu_tiny":
        from sim.calibrate import write_preset

        elsewhere = out / "device_out"
        write_preset(elsewhere, name, elsewhere / "profiles" / f"{name}.json",
                     {"total_mib": 24576, "weights_mib": 64, "slot_mib": 8, "graph_mib": 16.0},
                     False, 256, {"date": "d", "device": "cpu", "dtype": "float32",
                                  "backend": "torch", "commit": "c",
                                  "calibration": {"grid": "tiny"}})
        for sub in ("hardware", "memory"):
            shutil.copytree(elsewhere / sub, out / "conf" / sub)
        (out / "conf" / "profiles").mkdir()
        shutil.copy(ROOT / "conf" / "sim" / "profiles" / "cpu_tiny.json",
                    out / "conf" / "profiles" / f"{name}.json")
        shutil.rmtree(elsewhere)  # the path the preset names is gone, as on another machine
    rows = [{"cell": c, "n": n, "engine_tps": 100.0 * n, "engine_runs": [100.0 * n],
             "engine_traced_tps": 95.0 * n, "engine_acceptance": None} for c, n in CELLS]
    (out / "measured.json").write_text(json.dumps({
        "source": {"device": "test"}, "calibration_s": 1.0, "rows": rows,
        "rest_acceptance": {"batch_mtp N=4": 0.8, "solo": 0.6},
        "args": {"prompt_tokens": 16, "max_tokens": 8, "repeats": 1, "max_context": 256,
                 "shipped": "cpu_tiny", "name": name, "acceptance": "chain"}}))


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_predict_from_a_runs_measurements_writes_its_table(tmp_path):
    _measured(tmp_path, name="calibrated_elsewhere")
    r = _run("--predict-from", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    t = json.loads((tmp_path / "transfer.json").read_text())
    assert [row["cell"] for row in t["rows"]] == [c for c, _ in CELLS]
    for row in t["rows"]:
        for label in ("shipped", "calibrated"):
            assert row[label]["tps"] > 0
            assert row[label]["error"] == pytest.approx(row[label]["tps"] / row["engine_tps"] - 1)
    assert t["args"]["max_tokens"] == "8" and {x["loop"] for x in t["acceptance_rest"]} == {
        "batch_mtp N=4", "solo"}
    assert "calibrated sim" in (tmp_path / "transfer.md").read_text()


def test_predict_from_without_measurements_says_so(tmp_path):
    r = _run("--predict-from", str(tmp_path))
    assert r.returncode != 0 and "measured.json: not found" in r.stderr
    (tmp_path / "measured.json").write_text("{}")
    r = _run("--predict-from", str(tmp_path))
    assert r.returncode != 0 and "not a measurements file" in r.stderr
