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


def test_prompt_chunk_of_several_slots_on_the_cpu(tmp_path):
    """--prefill-slots S: each prompt chunk holds S slots' chunks (engine.prefill_slots), the
    report says how many; a count below 1 is refused by name."""
    out = tmp_path / "prof.json"
    script = str(REPO / "scripts" / "profile_window.py")
    subprocess.run([sys.executable, script, "--device", "cpu", "--shapes", "1x2", "--prefill", "8",
                    "--prefill-slots", "3", "--iters", "2", "--json", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert [(c["tokens"], c["slots"]) for c in report["prefill"]] == [(8, 3)]
    assert report["prefill"][0]["eager_us"] > 0
    bad = subprocess.run([sys.executable, script, "--device", "cpu", "--prefill", "8",
                          "--prefill-slots", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--prefill-slots must be >= 1" in bad.stderr
