#!/usr/bin/env python3
"""Measure a simulator cost profile on the engine: run `python -m strata` over a grid, then fit.

Each grid cell is one engine run (synthetic workload, `requests_per_slot` x slots requests so
that windows fill and prefill chunks interleave with decode) in its own Hydra run dir; the
profile is fitted from all the runs' trace.jsonl files by sim.profile.fit_profile (window `dur`
by rows, context tier and graph action; prefill `dur` by tokens; host overhead; acceptance).
Runs with `engine.graphs=false` supply the eager timings. Every run is serial (a profile
prices a window's parts one by one) but, on CUDA, one more of each graph cell's smallest
prompt overlapped (`_ov`), whose queued windows price host.submit_s (sim.profile).

    python scripts/profile_engine.py --device cuda --out profiles/h200.json
    python scripts/profile_engine.py --device cpu --slots 1,2 --prompt-tokens 32 --out p.json
    python scripts/profile_engine.py --dry-run                     # print the commands only
    python scripts/profile_engine.py --fit-only RUN/*/trace.jsonl --out p.json

A quick profile of this machine on a fixed small grid, in one process, with a hardware preset
pointing at it, is `python -m sim calibrate device=cuda` (sim/calibrate.py; the same fit).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

#: The repository root: engine runs start there (`python -m strata`).
REPO = Path(__file__).resolve().parents[2]

from sim.profile import FitError, fit_profile_files
from sim.replay import TraceError


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def grid(args) -> list[tuple[str, list[str]]]:
    """(run name, engine overrides) for every cell of the grid."""
    runs = []
    cuda = str(args.device).startswith("cuda")
    for slots in args.slots:
        for prompt in args.prompt_tokens:
            for batch_mtp in ("true", "false"):
                for graphs in ("true", "false") if slots in args.eager_slots else ("true",):
                    # overlapped only where it hides something: replayed graphs on CUDA
                    ways = ("false", "true") if (cuda and graphs == "true"
                                                 and prompt == min(args.prompt_tokens)) else ("false",)
                    for overlap in ways:
                        name = (f"s{slots}_p{prompt}_mtp{batch_mtp[0]}_g{graphs[0]}"
                                + ("_ov" if overlap == "true" else ""))
                        runs.append((name, [
                            "workload=synthetic",
                            f"workload.requests={slots * args.requests_per_slot}",
                            f"workload.prompt_tokens={prompt}",
                            f"workload.max_tokens={args.max_tokens}",
                            f"engine.slots={slots}", f"engine.batch_mtp={batch_mtp}",
                            "engine.mode=batch", f"engine.graphs={graphs}",
                            f"engine.overlap={overlap}",
                            f"device={args.device}", "print_outputs=false", "progress=false",
                            *args.extra]))
    return runs


def commit_id() -> str:
    from strata.tools.provenance import commit_id as commit

    return commit(short=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="profile.json", help="cost profile JSON to write")
    ap.add_argument("--device", default="cuda", help="the engine's device= override")
    ap.add_argument("--slots", type=int_list, default=[1, 2, 4, 8])
    ap.add_argument("--prompt-tokens", type=int_list, default=[64, 512, 2048])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--eager-slots", type=int_list, default=[1, 8],
                    help="slot counts also run with engine.graphs=false (eager timings)")
    ap.add_argument("--work-dir", help="where the run dirs go (default: a temporary dir)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    ap.add_argument("--timeout-s", type=float, default=1800, help="limit per engine run")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--fit-only", nargs="+", metavar="TRACE",
                    help="fit from existing trace.jsonl files instead of running the engine")
    args = ap.parse_args(argv)

    source = {"device": args.device, "commit": commit_id(), "date": date.today().isoformat()}
    if args.fit_only:
        traces = [Path(p) for p in args.fit_only]
    else:
        work = Path(args.work_dir or tempfile.mkdtemp(prefix="strata-profile-"))
        runs = grid(args)
        traces = []
        for i, (name, overrides) in enumerate(runs, 1):
            run_dir = work / name
            cmd = [sys.executable, "-m", "strata", *overrides, f"hydra.run.dir={run_dir}"]
            print(f"[{i}/{len(runs)}] {' '.join(cmd[1:])}", flush=True)
            if args.dry_run:
                continue
            t0 = time.perf_counter()
            env = {k: v for k, v in os.environ.items() if k != "STRATA_BATCH_MTP"}
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=args.timeout_s)
            if proc.returncode != 0:
                print(f"error: engine run {name} failed ({proc.returncode}):\n"
                      f"{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            print(f"    {time.perf_counter() - t0:.1f} s -> {run_dir}/trace.jsonl", flush=True)
            traces.append(run_dir / "trace.jsonl")
        if args.dry_run:
            return 0
        source["grid"] = {"slots": args.slots, "prompt_tokens": args.prompt_tokens,
                          "max_tokens": args.max_tokens, "eager_slots": args.eager_slots,
                          "requests_per_slot": args.requests_per_slot, "extra": args.extra}
    try:
        prof = fit_profile_files(traces, source)
    except (TraceError, FitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prof.save(args.out)
    print(f"wrote {args.out}: rows {prof.decode_rows}, tiers {prof.decode_tiers}, "
          f"prefill sizes {prof.prefill_tokens}, host overhead {prof.host_overhead_s * 1e3:.3f} ms")
    return 0

