"""Where a run's wall time goes: prefill, decode windows (replay vs host), and the rest.

Runs one cohort per configuration (after a warm-up cohort), with the trace on, and splits the
timed run's wall time into prefill iterations, decode windows and everything else; then times
the graph replay of the most common window alone, so the host share of a window shows.

    python scripts/step_breakdown.py --device cuda --n 1,4,8 --configs solo,batch_mtp [--overlap both]

Under engine.overlap a window's `dur` is its device time (CUDA events), and the host's planning
runs meanwhile: "other" is then the host time the device did not hide.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_engine import (OVERLAP_CHOICES, code_prompts, config_of, engine_cfg,  # noqa: E402
                          set_kernel_options, with_overlap)
from strata.config import EMBEDDED_MODEL_DIR  # noqa: E402
from strata.engine.llm_engine import Engine  # noqa: E402
from strata.engine.request import Request, SamplingParams  # noqa: E402
from strata.kernels import ops  # noqa: E402
from strata.model.loader import load_checkpoint  # noqa: E402
from strata.runner import run_requests  # noqa: E402
from strata.trace import read_trace  # noqa: E402


def breakdown(loaded, device, ecfg, prompts, max_tokens, sync, profile_top: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as d:
        eng = Engine(loaded, ecfg, device, log=lambda s: None)
        mk = lambda tag: [Request(f"{tag}{i}", list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      stop_at_eos=False))
                          for i, p in enumerate(prompts)]
        run_requests(eng, mk("w"))
        eng.requests.clear()
        path = Path(d) / "t.jsonl"
        from strata.trace import TraceWriter
        eng.trace = TraceWriter(path)
        eng.scheduler.trace = eng.trace
        if eng.cache is not None:
            eng.cache.trace = eng.trace
        sync()
        prof = None
        if profile_top:  # where the host's time goes (device waits show as the syncs' time)
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        m = run_requests(eng, mk("r"))
        sync()
        wall = time.perf_counter() - t0
        host_top = None
        if prof is not None:
            import io
            import pstats
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(profile_top)
            host_top = buf.getvalue()
        eng.trace.close()
        ev = read_trace(path)
        pre = sum(e["dur"] for e in ev if e["ev"] == "prefill")
        wins = [e for e in ev if e["ev"] == "window"]
        win = sum(e["dur"] for e in wins)
        actions = collections.Counter(e["graph"] for e in wins)
        # replay-only time of the most common key
        replay_us = None
        keys = collections.Counter(e["key"] for e in wins)
        if eng.cache is not None and keys and device.type == "cuda":
            k = keys.most_common(1)[0][0]
            ent = eng.cache.entries.get(k)
            if ent is not None:
                g = ent.handle[0] if isinstance(ent.handle, (tuple, list)) else ent.handle
                try:
                    for _ in range(3):
                        g.replay()
                    sync()
                    t1 = time.perf_counter()
                    for _ in range(100):
                        g.replay()
                    sync()
                    replay_us = (time.perf_counter() - t1) / 100 * 1e6
                except Exception as e:  # noqa: BLE001
                    replay_us = f"{type(e).__name__}: {e}"
        out = {"wall_s": wall, "tokens": m["output_tokens"], "tps": m["output_tokens"] / wall,
               "prefill_s": pre, "prefills": sum(1 for e in ev if e["ev"] == "prefill"),
               "windows": len(wins), "window_s": win, "window_us": win / max(len(wins), 1) * 1e6,
               "other_s": wall - pre - win, "tokens_per_window": m["output_tokens"] / max(len(wins), 1),
               "actions": dict(actions), "replay_us_common_key": replay_us,
               "acceptance": m["acceptance"], "host_profile": host_top}
        eng.close()
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=EMBEDDED_MODEL_DIR)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--n", default="1,4,8")
    ap.add_argument("--configs", default="solo,batch_mtp")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--window-rows", type=int, default=8)
    ap.add_argument("--graphs", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--profile-host", type=int, default=0, metavar="K",
                    help="profile the timed run with cProfile (which slows the host: the time "
                         "split is then not the plain run's) and print its K costliest functions")
    ap.add_argument("--synthetic-acceptance", type=float, default=None,
                    help="engine.synthetic_acceptance (dummy weights)")
    ap.add_argument("--overlap", choices=OVERLAP_CHOICES, default="off",
                    help="engine.overlap; both: each configuration also overlapped "
                         "(NAME+overlap), side by side")
    ap.add_argument("--kernel-options", default="",
                    help="the GPU extension's launch switches, NAME=0|1,... (as bench_engine.py)")
    ap.add_argument("--json")
    a = ap.parse_args()
    options = set_kernel_options(a.kernel_options)
    if options:
        print("kernel options", options)
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print("backend", ops.set_backend(a.backend, device.type))
    loaded = load_checkpoint(a.model, a.dtype, device, log=lambda s: None)
    prompts_all = code_prompts(loaded.tokenizer, max(int(x) for x in a.n.split(",")), a.prompt_tokens)
    res = {}
    for n in (int(x) for x in a.n.split(",")):
        for name in with_overlap(a.configs.split(","), a.overlap):
            r = breakdown(loaded, device, engine_cfg(config_of(name), name, n, a), prompts_all[:n],
                          a.max_tokens, sync, a.profile_host)
            res[f"{name}@{n}"] = r
            print(f"{name}@{n}: {r['tps']:.0f} tok/s wall {r['wall_s']*1e3:.1f} ms = prefill "
                  f"{r['prefill_s']*1e3:.1f} ({r['prefills']}) + windows {r['window_s']*1e3:.1f} "
                  f"({r['windows']} x {r['window_us']:.0f} us, replay {r['replay_us_common_key']}) + other "
                  f"{r['other_s']*1e3:.1f}; {r['tokens_per_window']:.2f} tok/window acc {r['acceptance']} "
                  f"{r['actions']}", flush=True)
            if r["host_profile"]:
                print(r["host_profile"], flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main()
