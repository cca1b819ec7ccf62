"""scripts/sweep_report.py on a synthetic multirun layout and on real multiruns."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "sweep_report.py"


def _load():
    from strata.tools import sweep_report
    return sweep_report


def _run_dir(root: Path, num: int, overrides: list[str], metrics) -> None:
    d = root / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if metrics is not None:
        (d / "metrics.json").write_text(metrics if isinstance(metrics, str) else json.dumps(metrics))


def test_synthetic_multirun(tmp_path):
    sr = _load()
    root = tmp_path / "multirun" / "2026-01-01" / "12-00-00"
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    n = 0
    for slots in (1, 2, 4):
        for key in ("shape", "layout"):
            m = {"aggregate_tps": 10.0 * slots + (1 if key == "layout" else 0),
                 "ttft_s": {"p50": 0.1 * slots, "p95": 0.2 * slots}, "mode": "batch_mtp",
                 "graph": {"hit": slots, "capture": 3}, "requests": [{"id": "a"}]}
            _run_dir(root, n, [f"engine.slots={slots}", f"engine.graph_key={key}", "device=cpu"], m)
            n += 1
    _run_dir(root, n, ["engine.slots=8", "engine.graph_key=shape", "device=cpu"], None)  # crashed
    _run_dir(root, n + 1, ["engine.slots=16", "engine.graph_key=shape", "device=cpu"], "{not json")
    out = tmp_path / "report"
    assert sr.main([str(root), "--out", str(out)]) == 0
    md = (out / "sweep_report.md").read_text()
    data = json.loads((out / "sweep_report.json").read_text())
    assert data["swept"] == ["engine.slots", "engine.graph_key"]
    assert data["fixed"] == {"device": "cpu"}
    assert "requests" not in " ".join(data["metrics"])          # lists are left out
    assert {"aggregate_tps", "ttft_s.p95", "graph.hit", "mode"} <= set(data["metrics"])
    assert [r["overrides"]["engine.slots"] for r in data["rows"]] == [1, 1, 2, 2, 4, 4, 8, 16]
    assert "no metrics.json" in md and "bad metrics.json" in md
    assert md.count("\n| ") == 1 + 8                             # header + one row per run
    assert "| 4 | layout |" in md and "41" in md
    assert (out / "sweep_report.png").stat().st_size > 1000
    # errors are clear
    assert sr.main([str(tmp_path / "nothing-here")]) == 2
    assert sr.main([str(root), "--x", "engine.nope", "--no-plot"]) == 2
    # --metrics / --x select
    assert sr.main([str(root), "--out", str(out), "--metrics", "aggregate_tps",
                    "--x", "engine.graph_key"]) == 0
    assert json.loads((out / "sweep_report.json").read_text())["metrics"] == ["aggregate_tps"]


def _multirun(tmp_path: Path, module: str, *overrides: str) -> Path:
    sweep = tmp_path / f"mr-{module}"
    r = subprocess.run([sys.executable, "-m", module, "-m", *overrides, "print_outputs=false",
                        f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return sweep


@pytest.mark.slow
@pytest.mark.parametrize("module,overrides", [
    ("sim", ["engine.slots=1,2", "workload=cohort", "workload.requests=4",
             "workload.prompt_tokens=64", "workload.max_tokens=16"]),
    ("strata", ["engine.slots=1,2", "device=cpu", "progress=false", "workload.requests=2",
                "workload.max_tokens=4"]),
])
def test_real_multirun(tmp_path, module, overrides):
    sweep = _multirun(tmp_path, module, *overrides)
    r = subprocess.run([sys.executable, str(SCRIPT), str(sweep)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    data = json.loads((sweep / "sweep_report.json").read_text())
    assert data["swept"] == ["engine.slots"]
    assert [row["status"] for row in data["rows"]] == ["ok", "ok"]
    assert "aggregate_tps" in data["metrics"]
    assert "| 0 | 1 |" in r.stdout and "| 1 | 2 |" in r.stdout
    assert (sweep / "sweep_report.png").is_file()
