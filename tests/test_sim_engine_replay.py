"""The simulator reproduces real engine traces, event by event.

Runs the engine CLI (`python -m strata`, tiny model, CPU) on N_RUNS small random
configurations drawn from a seeded generator (every fourth with engine.overlap), plus N_FILE_RUNS whose request files mix
requests that filter their sampling (top-k / top-p: windows holding one are keyed `+f`) with
plain-temperature and greedy ones, then replays each trace with
`sim.replay.replay_trace` and requires identity on `strata.trace.replay_view`. The runs go two
at a time (the CI machine has 2 cores); each is a few seconds, mostly interpreter start-up.
If the engine cannot be imported this test fails: it is the check that keeps the two
implementations of the scheduling rules in step.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sim.replay import load_trace, replay_trace

REPO = Path(__file__).resolve().parent.parent
N_RUNS = 20
N_FILE_RUNS = 4
SEED = 20240607
FILE_SEED = 20250101
VOCAB = 4096  # the embedded tiny model's
RUN_TIMEOUT_S = 180


def random_overrides(rng: random.Random, i: int) -> list[str]:
    # Every fifth run is solo; graph_limit stays small so the LRU evicts often. Every fourth
    # overlaps its windows (engine.overlap) and every third shares prompt chunks among up to
    # three slots (engine.prefill_slots); neither is drawn, so the drawn values stay as they were.
    mode = "solo" if i % 5 == 4 else "batch"
    return [f"engine.overlap={'true' if i % 4 == 1 else 'false'}",
        f"engine.prefill_slots={3 if i % 3 == 2 else 1}",
        "workload=synthetic",
        f"workload.requests={rng.randint(1, 9)}",
        f"workload.prompt_tokens={rng.randint(4, 40)}",
        f"workload.max_tokens={rng.randint(2, 24)}",
        f"workload.stagger_steps={rng.choice([0, 0, 1, 2, 3, 7])}",
        f"workload.seed={rng.randint(0, 1000)}",
        f"engine.slots={rng.randint(1, 8)}",
        f"engine.graph_limit={rng.randint(0, 6)}",
        f"engine.graph_key={rng.choice(['layout', 'shape'])}",
        f"engine.batch_mtp={rng.choice(['true', 'false'])}",
        f"engine.mode={mode}",
        f"engine.prefill_chunk={rng.choice([3, 8, 16, 256])}",
        "device=cpu", "print_outputs=false", "progress=false",
    ]


def file_overrides(rng: random.Random, i: int, run_dir: Path) -> list[str]:
    """A request file mixing filtered, plain-temperature and greedy requests (own generator,
    so the N_RUNS configurations above stay as they were)."""
    run_dir.mkdir(parents=True)
    path = run_dir / "requests.jsonl"
    lines = []
    for k in range(rng.randint(3, 7)):
        d = {"id": f"q{k}", "prompt_ids": [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 30))],
             "max_tokens": rng.randint(2, 20), "arrival_step": rng.choice([0, 0, 1, 3, 6]),
             "seed": rng.randint(0, 1000)}
        kind = ("top_p", "top_k", "plain", "greedy")[(k + i) % 4]
        if kind != "greedy":
            d["temperature"] = 0.8
        if kind == "top_p":
            d["top_p"] = 0.9
        elif kind == "top_k":
            d["top_k"] = 20
        lines.append(json.dumps(d))
    path.write_text("\n".join(lines) + "\n")
    return [
        "workload=file", f"workload.path={path}",
        f"engine.slots={rng.randint(2, 6)}",
        f"engine.graph_limit={rng.randint(0, 6)}",
        f"engine.graph_key={('layout', 'shape')[i % 2]}",
        f"engine.batch_mtp={rng.choice(['true', 'false'])}",
        f"engine.mode={'solo' if i == N_FILE_RUNS - 1 else 'batch'}",
        f"engine.prefill_chunk={rng.choice([3, 8, 256])}",
        "device=cpu", "print_outputs=false", "progress=false",
    ]


def run_engine(overrides: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "STRATA_BATCH_MTP"}
    # One thread per run: two runs share two cores, and torch's default of one thread per core
    # oversubscribes them (a tiny model gains nothing from threads; it ran 7x slower so).
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "strata", *overrides,
                           f"hydra.run.dir={run_dir}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


@pytest.mark.slow
def test_engine_traces_replay_identically(tmp_path):
    importlib.import_module("strata.engine")  # no engine: this test fails, it never skips
    rng = random.Random(SEED)
    runs = [(random_overrides(rng, i), tmp_path / f"run{i:02d}") for i in range(N_RUNS)]
    file_rng = random.Random(FILE_SEED)
    runs += [(file_overrides(file_rng, i, tmp_path / f"file{i:02d}"), tmp_path / f"file{i:02d}")
             for i in range(N_FILE_RUNS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda r: run_engine(*r), runs))

    failures = []
    seen = {"evict": 0, "solo": 0, "layout": 0, "finish": 0, "filtered_key": 0, "plain_key": 0,
            "overlap": 0, "shared_chunk": 0}
    for (overrides, run_dir), proc in zip(runs, procs):
        cmd = "python -m strata " + " ".join(overrides)
        if proc.returncode != 0:
            failures.append(f"engine failed ({proc.returncode}): {cmd}\n{proc.stderr[-2000:]}")
            continue
        events, lines = load_trace(run_dir / "trace.jsonl")
        result = replay_trace(events, lines, name=str(run_dir / "trace.jsonl"))
        if not result.ok:
            failures.append(f"{cmd}\n{result.first_divergence}")
        captures = [e for e in events if e["ev"] == "window" and e["graph"] == "capture"]
        if any("mib" not in e for e in captures):
            failures.append(f"{cmd}\na capture's window event lacks the measured `mib`")
        seen["evict"] += sum(e["ev"] == "evict" for e in events)
        seen["finish"] += sum(e["ev"] == "finish" for e in events)
        seen["solo"] += "engine.mode=solo" in overrides
        seen["layout"] += "engine.graph_key=layout" in overrides
        seen["overlap"] += "engine.overlap=true" in overrides
        seen["shared_chunk"] += sum(e.get("segments", 1) > 1 for e in events if e["ev"] == "prefill")
        if "workload=file" in overrides:  # keys with and without the filtered suffix
            keys = [e["key"] for e in events if e["ev"] == "window" and e["key"] != "eager"]
            seen["filtered_key"] += sum(k.endswith("+f") for k in keys)
            seen["plain_key"] += sum(not k.endswith("+f") for k in keys)
    assert not failures, f"{len(failures)} of {len(runs)} runs differ:\n\n" + "\n\n".join(failures)
    # The drawn configurations exercise what they are meant to.
    assert all(seen.values()), seen
