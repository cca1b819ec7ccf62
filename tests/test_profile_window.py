"""scripts/profile_window.py on the CPU: a window and a prompt chunk (--prefill) are timed
eagerly and reported in its JSON (the graph replay and kernel tables need a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_window_and_prompt_chunk_reported_on_the_cpu(tmp_path):
    out = tmp_path / "prof.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "profile_window.py"), "--device", "cpu",
                    "--shapes", "1x2", "--prefill", "8,16", "--iters", "2", "--json", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert [(s["groups"], s["rows"]) for s in report["shapes"]] == [(1, 2)]
    assert [c["tokens"] for c in report["prefill"]] == [8, 16]
    assert all(c["eager_us"] > 0 and "replay_us" not in c for c in report["prefill"])
