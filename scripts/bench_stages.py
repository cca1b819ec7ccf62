"""Layer-split benchmark (engine.stages): solo, batch and batch_mtp at each N, with the hand-off.

One engine per configuration (slots = the largest N), warmed on one cohort, then cohorts of N
random-token prompts (--repeats times, median reported). Beside each configuration and N: the
aggregate tokens/s, the mean window time per window shape, and the hand-off of that shape: one
window's messages between the stages (header, plan, tokens, hidden states, output) without
its compute, timed on the idle pipeline (FirstStageVerifier.handoff_seconds), as a share of the
window. With --stages 1 it measures the one-device engine the same way (no hand-off).

Full-depth bf16 Qwen3-Next-80B-A3B on two H200s (dummy weights; about 10 minutes per config):

    python scripts/bench_stages.py --preset qwen3_next_80b_a3b --load-format dummy --stages 2 \
        --configs batch_mtp --n 1,2,4,8 --synthetic-acceptance 0.8 --json stages_bmtp.json

Pipelined slot groups against a single group (engine.pipeline_groups off, then on; issue 19's
goal: at least 1.6x for batch_mtp at N=8):

    python scripts/bench_stages.py --preset qwen3_next_80b_a3b --load-format dummy --stages 2 \
        --configs batch_mtp,batch --n 1,2,4,8 --pipeline off,on --synthetic-acceptance 0.8 \
        --json stages_pipe.json

Both run with CUDA graphs on every stage (`--graphs true`: engine.stage_graphs=true, which
CUDA splits do not use by default yet); `--graphs false` runs every window eagerly, the
default split's way, for the comparison.

and the one-GPU FP8 figures beside it:

    python scripts/bench_stages.py --preset qwen3_next_80b_a3b_fp8 --load-format dummy --stages 1 \
        --configs batch_mtp --n 1,2,4,8 --synthetic-acceptance 0.8 --json fp8_bmtp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from bench_engine import CONFIGS, WindowTimes, add_model_args, engine_cfg, model_config, run_cohort, token_prompts  # noqa: E402
from strata.config import StrataConfig  # noqa: E402
from strata.engine.llm_engine import Engine  # noqa: E402
from strata.engine.request import Request, SamplingParams  # noqa: E402
from strata.runner import run_requests  # noqa: E402


def build_engine(a, name: str, slots: int, pipelined: bool = False) -> Engine:
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device = a.device
    cfg.backend.name = a.backend
    cfg.model = model_config(a)
    ecfg = engine_cfg(CONFIGS[name], name, slots, a)
    ecfg.stages = a.stages
    ecfg.stage_layers = a.stage_layers
    ecfg.pipeline_groups = pipelined
    if a.stages > 1 and a.graphs:
        ecfg.stage_graphs = True
    if a.prefill_buckets:  # each bucket compiles for tens of seconds at full depth
        ecfg.prefill_buckets = [int(b) for b in a.prefill_buckets.split(",")]
    cfg.engine = ecfg
    log = lambda s: s.startswith(("INFO stages", "INFO stage graphs", "INFO engine.stages",  # noqa: E731
                                  "INFO warm-up", "INFO slots", "WARNING", "ERROR")) \
        and print(s, file=sys.stderr, flush=True)  # noqa: E731
    eng = Engine.from_config(cfg, log=log)
    eng.trace.keep = False
    eng.window_times = WindowTimes()
    eng.trace.listener = eng.window_times
    return eng


def bench_config(a, name: str, ns: list[int], pipelined: bool = False) -> list[dict]:
    slots = max(ns) if CONFIGS[name]["mode"] == "batch" else 1
    t0 = time.perf_counter()
    eng = build_engine(a, name, slots, pipelined)
    label = f"{name}+pipe" if pipelined else name
    print(f"[{label}] engine ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    device = eng.device
    prompts = token_prompts(eng.args.vocab_size, max(ns), a.prompt_tokens)
    rows = []
    try:
        run_requests(eng, [Request(f"w{i}", list(p), SamplingParams(max_tokens=a.max_tokens, stop_at_eos=False))
                           for i, p in enumerate(prompts)])  # warm: compiles, first uses
        eng.requests.clear()
        for n in ns:
            eng.window_times = WindowTimes()
            eng.trace.listener = eng.window_times
            runs = [run_cohort(eng, device, prompts[:n], a.max_tokens) for _ in range(a.repeats)]
            shapes = []
            for (groups, rws, ctx), durs in sorted(eng.window_times.times.items()):
                mean = statistics.fmean(durs)
                hand = eng.verifier.handoff_seconds(groups, rws) if a.stages > 1 else 0.0
                shapes.append({"groups": groups, "rows": rws, "ctx": ctx, "windows": len(durs),
                               "mean_ms": mean * 1e3, "handoff_ms": hand * 1e3,
                               "handoff_share": hand / mean if mean else None})
            tps = statistics.median(r["aggregate_tps"] for r in runs)
            row = {"config": name, "n": n, "stages": a.stages, "pipelined": pipelined,
                   "aggregate_tps": tps,
                   "acceptance": runs[0]["acceptance"], "windows": runs[0]["windows"],
                   "shapes": shapes}
            rows.append(row)
            worst = max((s["handoff_share"] or 0.0 for s in shapes), default=0.0)
            print(f"{label:15s} N={n:<2d} stages={a.stages} {tps:8.1f} tok/s  windows {row['windows']:4d}  "
                  f"hand-off up to {worst * 100:.2f}% of a window", flush=True)
            for s in shapes:
                print(f"    {s['groups']}x{s['rows']} ctx {s['ctx']}: {s['windows']} windows, "
                      f"{s['mean_ms']:.2f} ms, hand-off {s['handoff_ms']:.3f} ms", flush=True)
    finally:
        eng.close()
    return rows


def release_compiled() -> None:
    """Free the last configuration's stage-0 weights before the next one loads its own:
    torch.compile's caches hold the model's modules, and two full-depth stage-0 halves do not
    fit one H200."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--stage-layers", default="auto")
    ap.add_argument("--configs", default="solo,batch,batch_mtp")
    ap.add_argument("--n", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--window-rows", type=int, default=8)
    ap.add_argument("--synthetic-acceptance", type=float, default=None)
    ap.add_argument("--prefill-buckets", default=None,
                    help="engine.prefill_buckets, comma separated (default: the engine's; the "
                         "benchmark's prompts need only the one holding --prompt-tokens)")
    ap.add_argument("--graphs", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                    help="engine.graphs: windows replay CUDA graphs (on a split each stage "
                         "captures its own compute, messages outside: strata/engine/"
                         "stage_graphs.py; windows of more than 2 rows per group run the last "
                         "stage eagerly, prompt chunks run eagerly); false: every window eager")
    ap.add_argument("--pipeline", default="off",
                    help="engine.pipeline_groups per run, comma separated: off, on or off,on "
                         "(both: each configuration with one window in flight, then with one "
                         "per stage, and the ratio)")
    ap.add_argument("--json")
    a = ap.parse_args()
    ns = [int(x) for x in a.n.split(",")]
    pipes = [p.strip() for p in a.pipeline.split(",")]
    if not set(pipes) <= {"off", "on"} or (a.stages < 2 and "on" in pipes):
        raise SystemExit(f"--pipeline: off, on or off,on (on needs --stages >= 2), got {a.pipeline!r}")
    rows = []
    for name in a.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"--configs: unknown configuration {name!r} (one of {', '.join(CONFIGS)})")
        for p in pipes:
            rows += bench_config(a, name, ns, pipelined=p == "on")
            release_compiled()
    for r in rows:  # pipelined against a single group, per configuration and N
        if r["pipelined"]:
            base = next((b for b in rows if not b["pipelined"] and b["config"] == r["config"]
                         and b["n"] == r["n"]), None)
            if base and base["aggregate_tps"]:
                r["speedup"] = r["aggregate_tps"] / base["aggregate_tps"]
                print(f"{r['config']:10s} N={r['n']:<2d} pipelined / single group: "
                      f"{r['speedup']:.2f}x", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
