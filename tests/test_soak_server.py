"""scripts/soak_server.py against a server it starts (CPU, the embedded tiny model): a short
mixed load passes, and a per-request limit the requests cannot meet fails it with the hung
requests named. The soak itself (minutes) is a script run, not a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def soak(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak_server.py"), "--start",
                        "--concurrency", "2", "--seed", "0", "--progress", "60", "--json", str(out),
                        "--server-dir", str(tmp_path / "server"), *args],
                       capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    return p.returncode, (json.loads(out.read_text()) if out.exists() else {}), p.stdout + p.stderr


@pytest.mark.slow
def test_a_short_soak_passes_and_an_impossible_timeout_fails(tmp_path):
    rc, summary, log = soak(tmp_path, "--duration", "8")
    assert rc == 0, log[-3000:]
    assert summary["pass"] and sum(summary["requests"].values()) > 5, summary
    assert summary["drained"] and not summary["hung"] and not summary["mismatches"]
    rc, summary, log = soak(tmp_path, "--duration", "3", "--timeout", "0.001")
    assert rc == 1 and not summary["pass"], log[-3000:]
    assert summary["hung"], summary
