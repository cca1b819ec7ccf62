"""Measure what the simulator's prediction is checked against, in one process on the GPU.

Runs the engine over two sets of cells with the model loaded and compiled once:
  profile cells  -> their traces are fitted into a cost profile (sim.profile), and
  held-out cells -> trace.jsonl and metrics.json per cell, never used for the fit,
then writes the profile and a manifest. Afterwards, anywhere (CPU is fine):

    python scripts/sim_gpu_check.py --predict OUT   # sim predict per held-out cell, error table

    python scripts/sim_gpu_check.py --device cuda --out OUT   # on the GPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cells(args) -> tuple[list[dict], list[dict]]:
    """Every cell is a closed loop: `requests` prompts, of which N are in flight at once (as N
    clients, each sending its next request when its last one finished). One run then covers
    many prompts, whose acceptance varies several-fold from one to the next (0.1 to 0.9 on the
    H200), for one engine start-up; a cell of one-request runs paid 1.3 s of start-up per
    prompt.

    Profile cells cover what the held-out grid runs, without running its workloads: every
    window shape (lone 1x4, 2x2, 4x2 and the odd ones as requests come and go), the context
    tiers 256..1024, each prompt-chunk bucket the held-out prompts pad to at the tiers they
    read, output positions up to the longest held-out output (acceptance drifts with
    position), and admissions mid-run. They run on the held-out engine's slot count: a user
    profiles the engine they will run."""
    prof = []
    # A short prompt decoding far (tiers 256-512, positions to 160) and a long one crossing
    # into tier 1024 (its prompt chunks: 256 at tier 256, then 256 at tier 512). Ordered so
    # that every N has a cell early in the run and one late (the run interleaves them with
    # the held-out runs, and device speed drifts).
    for n_short, n_long in zip((1, 2, 4, 8), (8, 4, 2, 1)):
        for n, prompt, out in ((n_short, 100, 160), (n_long, 480, 64)):
            prof.append(dict(name=f"p_n{n}_p{prompt}_o{out}", slots=args.heldout_slots,
                             graphs=True, concurrency=n, requests=args.profile_requests,
                             prompt=prompt, out=out))
    # The short-prompt cells once more overlapped (engine.overlap, as served): their windows,
    # queued behind each other, price host.submit_s (sim.profile); every other part of the
    # profile comes from the serial cells.
    for n in (1, 2, 4, 8):
        prof.append(dict(name=f"p_n{n}_p100_o160_ov", slots=args.heldout_slots, graphs=True,
                         concurrency=n, requests=args.profile_requests // 2, prompt=100, out=160,
                         overlap=True))
    # Prompt-chunk shapes the cells above miss (64 at tier 256; 128 at tier 512), cheaply.
    for prompt in (40, 352):
        prof.append(dict(name=f"p_s8_p{prompt}_o16", slots=8, graphs=True, concurrency=4,
                         requests=4, prompt=prompt, out=16))
    for slots in (1, 8):
        prof.append(dict(name=f"p_s{slots}_p64_eager", slots=slots, graphs=False,
                         concurrency=2 * slots, requests=2 * slots, prompt=64, out=64))
    held = []
    for prompt, out in ((128, 96), (384, 160)):
        for n in (1, 2, 4, 8):
            held.append(dict(name=f"h_n{n}_p{prompt}_o{out}", slots=args.heldout_slots, graphs=True,
                             concurrency=n, requests=args.heldout_requests, prompt=prompt, out=out,
                             repeats=args.heldout_repeats))
    return prof, held


HELDOUT_SEED = 1000
PROFILE_SEED = 1  # profile cell i draws prompts with seed PROFILE_SEED + i (< HELDOUT_SEED)


def interleave(prof: list[dict], held: list[dict]) -> list[tuple[str, dict]]:
    """Profile and held-out cells spread evenly through the run, by their share of the work:
    device speed drifts over a long run (clocks, allocator state; on a CPU by up to ~10 %),
    which must not bias the profile against the cells it predicts."""
    def work(c: dict) -> float:  # rough: decoded tokens plus a share for prompt tokens, by speed
        return c["requests"] * (c["out"] + c["prompt"] / 8) / min(c["concurrency"], 4)

    lists = {"profile": list(prof), "heldout": list(held)}
    total = {k: sum(work(c) for c in v) or 1.0 for k, v in lists.items()}
    done = {k: 0.0 for k in lists}
    order: list[tuple[str, dict]] = []
    while lists["profile"] or lists["heldout"]:
        # The list whose next cell's midpoint comes earliest in its own share of the work.
        kind = min((k for k in lists if lists[k]),
                   key=lambda k: ((done[k] + work(lists[k][0]) / 2) / total[k], k != "profile"))
        c = lists[kind].pop(0)
        done[kind] += work(c)
        order.append((kind, c))
    return order


def measure(args) -> None:
    import torch
    from omegaconf import OmegaConf

    from provenance import commit_id
    from sim.profile import fit_profile_files
    from strata.config import EMBEDDED_MODEL_DIR, StrataConfig
    from strata.engine.llm_engine import Engine
    from strata.kernels import ops
    from strata.model.loader import load_checkpoint
    from strata.runner import run_requests
    from strata.workload import load_workload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    base = OmegaConf.structured(StrataConfig)
    backend = ops.set_backend("auto", dev.type)
    loaded = load_checkpoint(EMBEDDED_MODEL_DIR, args.dtype, dev, log=lambda s: None,
                             moe_dense_experts=int(base.model.moe_dense_experts))
    prof, held = cells(args)

    def run_cell(c: dict, where: Path, seed: int = 0) -> dict:
        where.mkdir(parents=True, exist_ok=True)
        ecfg = OmegaConf.structured(StrataConfig).engine
        ecfg.slots, ecfg.graphs, ecfg.max_context = c["slots"], c["graphs"], args.max_context
        ecfg.mode, ecfg.batch_mtp = "batch", True
        ecfg.overlap = c.get("overlap")
        w = OmegaConf.structured(StrataConfig).workload
        w.kind, w.requests, w.prompt_tokens, w.max_tokens = "synthetic", c["requests"], c["prompt"], c["out"]
        w.seed = seed
        t_init = time.perf_counter()
        eng = Engine(loaded, ecfg, dev, log=lambda s: None, trace_path=where / "trace.jsonl")
        t_init = time.perf_counter() - t_init
        try:
            reqs = load_workload(w, loaded.tokenizer, loaded.args.vocab_size)
            for r in reqs:  # the simulator runs every request to max_tokens
                r.params.stop_at_eos = False
            t0 = time.perf_counter()
            m = run_requests(eng, reqs, concurrency=c["concurrency"])
            wall = time.perf_counter() - t0
        finally:
            eng.close()
        m["device"], m["mode"] = str(dev), "batch_mtp" if eng.batch_mtp else "batch"
        (where / "metrics.json").write_text(json.dumps(m, indent=2) + "\n")
        print(f"{c['name']}: {m['output_tokens'] / wall:.0f} tok/s ({wall:.2f} s; engine start and "
              f"warm-up {t_init:.1f} s)", flush=True)
        return m

    # Compile and warm every shape once, outside anything measured.
    for c in prof[:1] + held[-1:]:
        run_cell(dict(c, name="warm-" + c["name"], requests=2 * c["concurrency"]), out / "warm")
    # Held-out cells run `heldout_repeats` times on fresh prompts (seeds HELDOUT_SEED + r):
    # the engine's figure for a cell is the mean over its runs.
    # Repeat by repeat (every cell's first run, then every cell's second, ...): each part of
    # the run holds every cell, so drift over the run does not fall on some cells only.
    reps = [dict(c, rep=r) for r in range(max(c["repeats"] for c in held)) for c in held
            if r < c["repeats"]]
    # Each profile cell draws its own prompts (seeds 1, 2, ...): acceptance varies a lot from
    # prompt to prompt, and cells sharing one seed would fit it to the same few prompts (on
    # the H200 that fit came out 10-29% below the held-out acceptance).
    # Profile cells run serially but for the `_ov` ones, as sim.calibrate's do: a serial
    # window's trace prices its parts one by one (device time by CUDA events, the host's share
    # as host.launch_s), which an overlapped window hides. Held-out cells run as served
    # (engine.overlap's default).
    prof = [dict(c, seed=PROFILE_SEED + i, overlap=c.get("overlap", False))
            for i, c in enumerate(prof)]
    source = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(loaded.dtype), "backend": backend,
              "commit": commit_id(),
              "date": time.strftime("%Y-%m-%d")}
    # The manifest first and the profile as soon as its cells are done: a run cut by a time
    # limit in its last held-out runs still predicts the runs that finished.
    (out / "manifest.json").write_text(json.dumps({"source": source, "profile_cells": prof,
                                                   "heldout_cells": held,
                                                   "heldout_repeats": args.heldout_repeats}, indent=2))
    # The short cells for shapes the grid-like ones miss run first, so that the interleaved
    # order ends with held-out runs.
    extra = [c for c in prof if not c["name"].startswith("p_n")]
    order = [("profile", c) for c in extra] + interleave([c for c in prof if c not in extra], reps)
    last_profile = max(i for i, (kind, _) in enumerate(order) if kind == "profile")
    for i, (kind, c) in enumerate(order):
        if kind == "heldout":
            run_cell(c, out / kind / c["name"] / f"rep{c['rep']}", seed=HELDOUT_SEED + c["rep"])
        else:
            run_cell(c, out / kind / c["name"], seed=c["seed"])
        if i == last_profile:
            traces = [out / "profile" / p["name"] / "trace.jsonl" for p in prof]
            fit_profile_files(traces, source).save(out / "profile.json")
            print(f"profile fitted from {len(traces)} traces: {out / 'profile.json'}", flush=True)


def predict(args) -> None:
    """sim predict for every held-out cell and repeat against the engine's metrics of that
    repeat; per cell, the mean over repeats of each figure, engine vs simulator."""
    from sim.replay import memory_overrides
    from strata.trace import read_trace

    out = Path(args.predict)
    man = json.loads((out / "manifest.json").read_text())
    rows = []
    for c in man["heldout_cells"]:
        per_rep = []
        for r in range(c.get("repeats", man.get("heldout_repeats", 1))):
            cell = out / "heldout" / c["name"] / f"rep{r}"
            pred = out / "predict" / c["name"] / f"rep{r}"
            if not (cell / "metrics.json").is_file():
                print(f"{c['name']} run {r}: not measured (the run was cut): left out", flush=True)
                continue
            # Did the engine's warm-up capture the window graphs (CUDA, shape keys)? Its
            # trace says so; the simulator then starts from the same warm cache.
            events = read_trace(cell / "trace.jsonl")
            warm = any(e["ev"] == "warmup" and e["keys"] for e in events)
            cmd = [sys.executable, "-m", "sim", "mode=predict", f"profile={out / 'profile.json'}",
                   f"engine.warmup_graphs={str(warm).lower()}", *memory_overrides(events),
                   "workload=stagger", f"workload.requests={c['requests']}",
                   # A manifest before closed loops (no `concurrency`) sent every request at once.
                   f"workload.concurrency={c.get('concurrency', 0)}",
                   f"workload.prompt_tokens={c['prompt']}", f"workload.max_tokens={c['out']}",
                   f"engine.slots={c['slots']}", f"engine.max_context={args.max_context}",
                   f"acceptance={args.acceptance}", "acceptance.from_profile=true", f"seed={r}",
                   f"compare_with={cell / 'metrics.json'}", f"hydra.run.dir={pred}"]
            res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"sim predict failed for {c['name']} repeat {r}")
            per_rep.append(json.loads((pred / "comparison.json").read_text()))
        if not per_rep:
            print(f"{c['name']}: no run measured: left out of the table", flush=True)
            continue
        mean = []
        for i, fig in enumerate(per_rep[0]):
            eng = [p[i]["engine"] for p in per_rep if p[i]["engine"] is not None]
            sim = [p[i]["sim"] for p in per_rep if p[i]["sim"] is not None]
            e = sum(eng) / len(eng) if eng else None
            m = sum(sim) / len(sim) if sim else None
            err = (m - e) / e if e and m is not None else None
            mean.append({"figure": fig["figure"], "engine": e, "sim": m, "error": err})
        rows.append((c, mean, per_rep))
    if not rows:
        raise SystemExit(f"{out}: no held-out run was measured")
    figs = [r["figure"] for r in rows[0][1]]
    print("means over each cell's runs (fresh prompts each; at least "
          f"{min(len(p) * c['requests'] for c, _, p in rows)} prompts per cell; N = requests in "
          "flight)")
    print("| cell | engine tok/s | sim tok/s | " + " | ".join(f"{f} err" for f in figs) + " |")
    print("|---|---|---|" + "---|" * len(figs))
    for c, mean, per in rows:
        by = {r["figure"]: r for r in mean}
        agg = by["aggregate tok/s"]
        errs = ["-" if by[f]["error"] is None else f"{by[f]['error'] * 100:+.1f}%" for f in figs]
        runs = "" if len(per) == c.get("repeats", len(per)) else f" ({len(per)} of {c['repeats']} runs)"
        print(f"| N={c.get('concurrency') or c['requests']} P={c['prompt']} O={c['out']}{runs} | "
              f"{agg['engine']:.0f} | "
              f"{agg['sim']:.0f} | " + " | ".join(errs) + " |")
    (out / "predict" / "summary.json").write_text(json.dumps(
        [{"cell": c, "mean": mean, "repeats": per_rep} for c, mean, per_rep in rows], indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="sim_check")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--heldout-slots", type=int, default=8)
    # Acceptance varies several-fold from prompt to prompt: a cell's mean over 24 prompts
    # still moved 8% (one standard error) from one draw to the next on the H200. Closed-loop
    # runs make prompts cheap, so every cell holds heldout_repeats x heldout_requests of them.
    # Each run is also its own engine, and runs go at speeds up to 30% apart as the host slows
    # (seen on the H200, docs/CHANGELOG.md): four runs average that out better than three.
    ap.add_argument("--heldout-repeats", type=int, default=4,
                    help="runs of each held-out cell on fresh prompts (the figure is their mean)")
    ap.add_argument("--heldout-requests", type=int, default=48,
                    help="prompts per held-out run, N of them in flight at once (closed loop)")
    ap.add_argument("--profile-requests", type=int, default=48,
                    help="prompts per profile cell, N of them in flight at once (closed loop)")
    ap.add_argument("--acceptance", default="chain", choices=("chain", "position", "markov", "fixed"),
                    help="the simulator's acceptance model, fitted from the profile cells")
    ap.add_argument("--predict", metavar="OUT", help="run the predictions for a measured OUT dir")
    a = ap.parse_args()
    if a.predict:
        predict(a)
    else:
        measure(a)


if __name__ == "__main__":
    main()
