#!/usr/bin/env python3
"""Does the simulator hold on this machine and a workload its profile never saw? One process.

1. Engine cohorts of code prompts (scripts/bench_engine.py's prompts and configurations: 64-token
   prompts, 256 output tokens by default): solo N=1, batch N=4 and 8, batch_mtp N=4, batch_mtp
   W16 N=8; each cell `--repeats` times on a fresh engine as served (warm-up: on CUDA it
   captures the window graphs; no trace, as a server or scripts/bench_engine.py runs), and
   once more with its trace written, as the profile's runs were: the table gives both, so the
   trace's own cost is measured too.
2. A short engine run of 8 other prompts of the same workload (batch_mtp, 4 in flight): the
   acceptance model is fitted from its trace (acceptance.from_trace), as a user would from a
   few of their own requests; then the rest of the workload, 40 more prompts, in closed loops
   (batch_mtp at 4 in flight, and solo), whose acceptance the model predicts.
3. A quick calibration (sim/calibrate.py) on the model already loaded and compiled, its
   passes interleaved with the cohort repeats of step 1 (repeat 0, pass 1, repeat 1, pass 2,
   the rest), so the machine's drift over the call falls on both alike.
4. Predictions of every cell from the shipped preset (`--shipped`, no calibration) and from
   the calibrated one, each with its range, and the table: engine vs each, errors, whether
   the range holds, the ratios batch_mtp/batch (N=4) and batch_mtp/solo, and acceptance.

    python scripts/sim_transfer_check.py --device cuda --out OUT      # ~5-8 min on a bare H200
    python scripts/sim_transfer_check.py --device cuda --no-predict --out OUT   # measure only
    python scripts/sim_transfer_check.py --predict-from OUT           # steps 4 from OUT (no device)

The measurements (engine cohorts, the calibrated preset under OUT/conf, the acceptance run's
trace, the closed loops' acceptance) are in OUT/measured.json before any prediction runs, so a
call cut short in the predictions, or one run with --no-predict to spare device time, is
predicted afterwards on any machine with --predict-from (a simulator change re-checked against
the same measurements, too).
    python scripts/sim_transfer_check.py --device cpu --model DIR --shipped cpu_tiny \\
        --max-tokens 16 --repeats 1 --grid tiny --max-context 256 --out OUT   # a smoke run

Acceptance alone, on the held-out runs of a `scripts/sim_gpu_check.py` output (no device): each
run's model fitted from its first 8 requests, its other requests predicted, per model:

    python scripts/sim_transfer_check.py --acceptance-eval SIMCHK_DIR [--models chain,position]
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

#: (cell name, bench_engine configuration, N)
CELLS = (("solo N=1", "solo", 1), ("batch N=4", "batch", 4), ("batch N=8", "batch", 8),
         ("batch_mtp N=4", "batch_mtp", 4), ("batch_mtp W16 N=8", "batch_mtp_w16", 8))
#: The acceptance is learned from this many requests of the workload (not the cohorts' own).
ACCEPTANCE_REQUESTS = 8
#: ... and checked on this many others (the rest of the workload), in these closed loops:
#: (name, bench_engine configuration, requests in flight).
REST_REQUESTS = 40
REST_LOOPS = (("batch_mtp N=4", "batch_mtp", 4), ("solo", "solo", 1))


def engine_knobs(config: str, n: int, args) -> dict:
    from bench_engine import CONFIGS

    knobs = dict(CONFIGS[config])
    knobs["slots"] = n if knobs.get("mode") == "batch" else 1
    if args.max_context:
        knobs["max_context"] = args.max_context
    return knobs


def sim_overrides(knobs: dict, n: int, args) -> list[str]:
    """The simulator's overrides for one cohort cell (its engine knobs; the rest is the
    preset's)."""
    out = [f"workload=cohort", f"workload.requests={n}",
           f"workload.prompt_tokens={args.prompt_tokens}", f"workload.max_tokens={args.max_tokens}",
           f"acceptance={args.acceptance}", f"acceptance.from_trace={args.acc_trace}",
           "print_outputs=false", f"hydra.searchpath=[file://{args.conf.resolve()}]"]
    out += [f"engine.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in knobs.items()]
    return out


def predict(preset: str, overrides: list[str]) -> dict:
    from sim.config import compose_sim
    from sim.predict import run_predict

    return run_predict(compose_sim([f"hardware={preset}", *overrides])).metrics


def predict_drawn(preset: str, overrides: list[str], draws: int) -> dict:
    """predict() averaged over `draws` seeds: the point, the range's ends and the acceptance.
    A cohort's few requests are as many draws of the workload's per-request difficulty (one
    request's acceptance ranged 0.23-0.80 over seeds on the H200's code prompts), and the
    engine's prompts' own difficulty is unknown to the simulator, so a drafting cohort's
    prediction is the workload's expectation over many draws, not seed 0's."""
    from sim.config import compose_sim
    from sim.predict import run_predict

    draws = max(1, int(draws))
    # Composed once: composing takes longer than a cohort's simulation, and only the seed
    # differs between draws (run_predict reads the config, never writes it).
    cfg = compose_sim([f"hardware={preset}", *overrides])
    ms = []
    for seed in range(draws):
        if draws > 1:
            cfg.seed = seed
        ms.append(run_predict(cfg).metrics)
    accs = [m["acceptance"] for m in ms if m["acceptance"] is not None]
    return {"aggregate_tps": sum(m["aggregate_tps"] for m in ms) / draws,
            "range": {"aggregate_tps": [sum(m["range"]["aggregate_tps"][i] for m in ms) / draws
                                        for i in (0, 1)]},
            "acceptance": sum(accs) / len(accs) if accs else None, "draws": draws}


def add_predictions(rows: list[dict], specs: dict[str, dict], label: str, preset: str, args,
                    log) -> None:
    """Each cell's prediction from `preset` into row[label]: point, range, error, whether
    the range holds the engine's figure, simulated acceptance."""
    for row in rows:
        draws = args.acceptance_draws if row.get("engine_acceptance") is not None else 1
        m = predict_drawn(preset, sim_overrides(specs[row["cell"]], row["n"], args), draws)
        lo, hi = m["range"]["aggregate_tps"]
        row[label] = {"tps": m["aggregate_tps"], "range": [lo, hi],
                      "error": m["aggregate_tps"] / row["engine_tps"] - 1,
                      "holds": lo <= row["engine_tps"] <= hi, "draws": m["draws"],
                      "acceptance": m["acceptance"]}
    log(f"predicted every cell from {preset}")


def rest_predictions(rest_runs: dict, preset: str, args) -> list[dict]:
    """The acceptance the model learned from the short run predicts for each closed loop of
    the rest of the workload, against the engine's."""
    out = []
    for loop, (knobs, n, m) in rest_runs.items():
        over = [o.replace("workload=cohort", "workload=stagger") for o in sim_overrides(knobs, n, args)]
        over = [o for o in over if not o.startswith("workload.requests=")]
        sim = predict(preset, over + [f"workload.requests={REST_REQUESTS}",
                                      f"workload.concurrency={n}", "spread.enabled=false"])
        out.append({"loop": loop, "engine": m["acceptance"], "sim": sim["acceptance"],
                    "range": sim.get("acceptance_range"), "preset": preset})
    return out


def write_table(out: Path, rows: list[dict], presets: list[tuple[str, str]], args,
                cal_s, source: dict, rest: list[dict]) -> None:
    """OUT/transfer.md and OUT/transfer.json for the presets predicted so far."""
    by = {r["cell"]: r for r in rows}
    ratios = []
    for num, den in (("batch_mtp N=4", "batch N=4"), ("batch_mtp N=4", "solo N=1")):
        e = by[num]["engine_tps"] / by[den]["engine_tps"]
        ratios.append({"ratio": f"{num} / {den}", "engine": e,
                       **{lab: (by[num][lab]["tps"] / by[den][lab]["tps"]) / e - 1
                          for lab, _ in presets}})
    head = " | ".join(f"{lab} sim (range) | err | in range" for lab, _ in presets)
    traced = " | engine traced tok/s"
    lines = [f"workload: code prompts of {args.prompt_tokens} tokens, {args.max_tokens} output "
             f"tokens, cohorts; engine = mean of {args.repeats} runs; acceptance "
             f"({args.acceptance}) learned from {ACCEPTANCE_REQUESTS} other prompts; drafting "
             f"cells' sim = mean over {args.acceptance_draws} acceptance draws; presets: "
             + ", ".join(f"{lab} = {p}" for lab, p in presets)
             + ("" if cal_s is None else f"; calibration {cal_s:.0f} s"),
             "",
             f"| cell | engine tok/s{traced} | {head} | engine acc | sim acc |",
             "|---|---|---|" + "---|---|---|" * len(presets) + "---|---|"]
    for r in rows:
        cells = []
        for lab, _ in presets:
            p = r[lab]
            cells.append(f"{p['tps']:.0f} ({p['range'][0]:.0f}-{p['range'][1]:.0f}) | "
                         f"{p['error']:+.1%} | {'yes' if p['holds'] else 'NO'}")
        acc = "-" if r["engine_acceptance"] is None else f"{r['engine_acceptance']:.3f}"
        sim_acc = r[presets[-1][0]]["acceptance"]
        lines.append(f"| {r['cell']} | {r['engine_tps']:.0f} | {r['engine_traced_tps']:.0f} | "
                     + " | ".join(cells)
                     + f" | {acc} | {'-' if sim_acc is None else format(sim_acc, '.3f')} |")
    lines += ["", "| ratio | engine | " + " | ".join(f"{lab} err" for lab, _ in presets) + " |",
              "|---|---|" + "---|" * len(presets)]
    lines += [f"| {x['ratio']} | {x['engine']:.2f} | "
              + " | ".join(f"{x[lab]:+.1%}" for lab, _ in presets) + " |" for x in ratios]
    if rest:
        lines += ["", f"acceptance learned from {ACCEPTANCE_REQUESTS} requests, on the other "
                      f"{REST_REQUESTS} ({args.acceptance}; range: the workload's mean given the "
                      f"{ACCEPTANCE_REQUESTS} requests' spread, p10-p90)", "",
                  "| closed loop | engine | sim | error | sim range | in range |", "|---|---|---|---|---|---|"]
        for x in rest:
            lo, hi = x["range"] or (float("nan"), float("nan"))
            lines.append(f"| {x['loop']} | {x['engine']:.3f} | {x['sim']:.3f} | "
                         f"{x['sim'] - x['engine']:+.3f} | {lo:.3f}-{hi:.3f} | "
                         f"{'yes' if lo <= x['engine'] <= hi else 'NO'} |")
    table = "\n".join(lines)
    print(table, flush=True)
    (out / "transfer.md").write_text(table + "\n", encoding="utf-8")
    (out / "transfer.json").write_text(json.dumps(
        {"source": source, "args": {k: str(v) for k, v in vars(args).items()},
         "calibration_s": cal_s, "rows": rows, "ratios": ratios, "acceptance_rest": rest},
        indent=1) + "\n",
        encoding="utf-8")


def acceptance_eval(root: Path, models: list[str], k: int = ACCEPTANCE_REQUESTS) -> int:
    """For every held-out run under ROOT/heldout/CELL/repR: fit each model from the run's
    first k requests (acceptance.from_trace_requests), simulate the rest of its workload (the
    same closed loop) and compare with the engine's acceptance over those requests. The
    baseline is the first k requests' own measured rate: what any fit of them starts from."""
    from sim.config import SimConfigError
    from sim.replay import load_trace
    from sim.trace_acceptance import admitted_requests

    errs: dict[str, list[float]] = {m: [] for m in models + ["baseline"]}
    print(f"| run | engine (rest) | baseline (first {k}) | " + " | ".join(models) + " |")
    print("|---|---|---|" + "---|" * len(models))
    for trace in sorted(root.glob("heldout/*/rep*/trace.jsonl")):
        cell = trace.parent.parent.name  # h_n{N}_p{P}_o{O}
        n, p, o = (int(x[1:]) for x in cell.split("_")[1:])
        events, _ = load_trace(trace)
        order = admitted_requests(events)
        commits = [e for e in events if e["ev"] == "commit"]

        def rate(reqs: set) -> float:
            cs = [c for c in commits if c["req"] in reqs]
            return sum(c["accepted"] for c in cs) / max(1, sum(c["drafted"] for c in cs))

        rest = set(order[k:])
        engine, first = rate(rest), rate(set(order[:k]))
        errs["baseline"].append(first - engine)
        cells = []
        for m in models:
            model, _, flag = m.partition(":")  # chain:nospread = without per-request spread
            over = ["workload=stagger", f"workload.requests={len(rest)}",
                    f"workload.concurrency={n}", f"workload.prompt_tokens={p}",
                    f"workload.max_tokens={o}", "engine.slots=8", "engine.max_context=1024",
                    f"acceptance={model}", f"acceptance.from_trace={trace.resolve()}",
                    f"acceptance.from_trace_requests={k}", "spread.enabled=false",
                    "print_outputs=false"] + (["acceptance.request_spread=false"]
                                              if flag == "nospread" else [])
            try:
                sim = predict("h200_tiny_bf16", over)["acceptance"]
            except SimConfigError:  # e.g. no chain fit from lone windows
                cells.append("-")
                continue
            errs[m].append(sim - engine)
            cells.append(f"{sim - engine:+.3f}")
        print(f"| {cell}/{trace.parent.name} | {engine:.3f} | {first - engine:+.3f} | "
              + " | ".join(cells) + " |", flush=True)
    print()
    print("| model | runs | mean error | mean abs error | max abs error | within 0.03 |")
    print("|---|---|---|---|---|---|")
    for m, e in errs.items():
        if e:
            print(f"| {m} | {len(e)} | {statistics.mean(e):+.3f} | "
                  f"{statistics.mean(abs(x) for x in e):.3f} | {max(abs(x) for x in e):.3f} | "
                  f"{sum(abs(x) <= 0.03 for x in e)}/{len(e)} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the embedded model)")
    ap.add_argument("--out", default="sim_transfer")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=0,
                    help="engine.max_context of every run (0: the engine's default, as served)")
    ap.add_argument("--shipped", default="h200_tiny_bf16", help="the shipped hardware preset")
    ap.add_argument("--grid", default=None, help="calibration grid (default: by device)")
    ap.add_argument("--name", default="calibrated_transfer", help="the calibrated preset's name")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--acceptance", default="chain", choices=("chain", "position", "markov", "fixed"),
                    help="the acceptance model fitted from the short run's trace")
    ap.add_argument("--acceptance-eval", metavar="SIMCHK_DIR",
                    help="only the acceptance transfer on a sim_gpu_check output (no device)")
    ap.add_argument("--models", default="chain,position,fixed",
                    help="--acceptance-eval: the acceptance models compared (chain:nospread = "
                         "chain without its per-request spread)")
    ap.add_argument("--acceptance-draws", type=int, default=64,
                    help="seeds a drafting cohort's prediction is averaged over (its requests' "
                         "difficulty drawn anew each time; 1: one draw, seed 0)")
    ap.add_argument("--no-predict", action="store_true",
                    help="measure only: OUT/measured.json, for --predict-from elsewhere")
    ap.add_argument("--predict-from", metavar="OUT",
                    help="only the predictions and the table, from a finished (or --no-predict) "
                         "run's OUT/measured.json (no device)")
    args = ap.parse_args()
    if args.acceptance_draws < 1:
        ap.error(f"--acceptance-draws: must be >= 1, got {args.acceptance_draws}")
    if args.acceptance_eval:
        return acceptance_eval(Path(args.acceptance_eval), args.models.split(","))
    if args.predict_from:
        return predict_from(Path(args.predict_from), args)

    import torch

    from bench_engine import code_prompts
    from sim.calibrate import calibrate, parse_args as calibrate_args
    from sim.engine_runs import EngineRunner, RunSpec
    from strata.engine.request import Request, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", flush=True)

    runner = EngineRunner(args.device, args.dtype, args.model)
    log(f"model loaded: {runner.source()}")
    most = max(n for _, _, n in CELLS)
    prompts = code_prompts(runner.loaded.tokenizer, most + ACCEPTANCE_REQUESTS + REST_REQUESTS,
                           args.prompt_tokens)

    def requests(ps: list[list[int]], tag: str) -> list:
        return [Request(f"{tag}{i}", list(p), SamplingParams(max_tokens=args.max_tokens,
                                                             temperature=0.0, stop_at_eos=False))
                for i, p in enumerate(ps)]

    # 1. Cohorts. A first untimed pass compiles every cell's shapes (each engine's warm-up does
    # the rest); then the timed repeats, repeat by repeat so drift falls on every cell alike.
    specs = {name: RunSpec(name=name, requests=n, prompt=args.prompt_tokens, out=args.max_tokens,
                           engine=engine_knobs(config, n, args)) for name, config, n in CELLS}
    for name, _, n in CELLS:
        runner.run(specs[name], out / "compile" / name.replace(" ", "_"),
                   requests=requests(prompts[:n], "c"))
    log("compiled every cell")
    engine: dict[str, list[dict]] = {name: [] for name, _, _ in CELLS}
    traced: dict[str, dict] = {}

    def cohort_repeat(rep: int) -> None:
        """Every cell once, as served (rep < repeats) or with its trace written (the last)."""
        served = rep < args.repeats
        for name, _, n in CELLS:
            where = out / "engine" / name.replace(" ", "_") / (f"rep{rep}" if served else "traced")
            m = runner.run(specs[name], where, requests=requests(prompts[:n], "r"), trace=not served)
            if served:
                engine[name].append(m)
            else:
                traced[name] = m
            log(f"engine {name} {'rep ' + str(rep) if served else 'traced'}: "
                f"{m['aggregate_tps']:.0f} tok/s, acceptance "
                f"{m['acceptance'] if m['acceptance'] is not None else float('nan'):.3f}")

    # The quick calibration on the loaded model, its passes interleaved with the cohort
    # repeats (repeat 0, pass 1, repeat 1, pass 2, the other repeats): on the H200 (4f4e7c5) a
    # calibration run after every cohort measured the same window shapes 3-8% slower than the
    # cohorts had run, and priced every cell at that later speed. The calibrated preset goes
    # to OUT/conf (the predictions find it through hydra.searchpath; the repository's
    # conf/sim stays as it is).
    args.conf = out / "conf"
    opts = calibrate_args([f"device={args.device}", f"name={args.name}", f"conf={args.conf}",
                           f"work_dir={out / 'calibration'}"]
                          + ([f"grid={args.grid}"] if args.grid else [])
                          + ([f"max_context={args.max_context}"] if args.max_context else []))
    cohort_repeat(0)
    done = [0]

    def between(p: int) -> None:
        if done[-1] < args.repeats:
            done.append(done[-1] + 1)
            cohort_repeat(done[-1])

    files = calibrate(opts, log=log, runner=runner, between_passes=between)
    # (its own time, without the cohort repeats run between its passes)
    cal_s = json.loads(files["profile"].read_text())["source"]["calibration"]["seconds"]
    log(f"calibration took {cal_s:.0f} s: {files['preset']}")
    for rep in range(done[-1] + 1, args.repeats + 1):  # the last one writes its trace
        cohort_repeat(rep)

    # 2. Acceptance from a short run of other prompts of the workload.
    acc_dir = out / "acceptance_run"
    runner.run(RunSpec(name="acceptance", requests=ACCEPTANCE_REQUESTS, prompt=args.prompt_tokens,
                       out=args.max_tokens, concurrency=4,
                       engine=engine_knobs("batch_mtp", 4, args)),
               acc_dir, requests=requests(prompts[most:], "a"))
    args.acc_trace = str((acc_dir / "trace.jsonl").resolve())
    log(f"acceptance run of {ACCEPTANCE_REQUESTS} other prompts: {args.acc_trace}")
    rest_prompts = prompts[most + ACCEPTANCE_REQUESTS:]
    rest_runs = {}
    for loop, config, n in REST_LOOPS:
        knobs = engine_knobs(config, n, args)
        rest_runs[loop] = (knobs, n, runner.run(
            RunSpec(name=loop, requests=REST_REQUESTS, prompt=args.prompt_tokens,
                    out=args.max_tokens, concurrency=n, engine=knobs),
            out / "acceptance_rest" / loop.replace(" ", "_").replace("=", ""),
            requests=requests(rest_prompts, "x"), trace=False))
        log(f"the rest, {loop}: acceptance {rest_runs[loop][2]['acceptance']:.3f}")

    rows = []
    for name, config, n in CELLS:
        accs = [m["acceptance"] for m in engine[name] if m["acceptance"] is not None]
        rows.append({"cell": name, "n": n,
                     "engine_tps": statistics.mean(m["aggregate_tps"] for m in engine[name]),
                     "engine_runs": [m["aggregate_tps"] for m in engine[name]],
                     "engine_traced_tps": traced[name]["aggregate_tps"],
                     "engine_acceptance": statistics.mean(accs) if accs else None})
    rest = {loop: m["acceptance"] for loop, (_, _, m) in rest_runs.items()}
    (out / MEASURED).write_text(json.dumps(
        {"source": runner.source(), "args": {k: v for k, v in vars(args).items()
                                             if isinstance(v, (str, int, float, bool))},
         "calibration_s": cal_s, "rows": rows, "rest_acceptance": rest}, indent=1) + "\n",
        encoding="utf-8")
    log(f"measurements in {out / MEASURED}")
    if args.no_predict:
        return 0
    predict_and_write(out, rows, rest, args, cal_s, runner.source(), log)
    return 0


#: What a run measured, before any prediction: the input of --predict-from.
MEASURED = "measured.json"


def predict_and_write(out: Path, rows: list[dict], rest: dict, args, cal_s, source: dict,
                      log) -> None:
    """3. Predictions from the shipped preset, written at once (a call cut short in the
    calibrated predictions still brings them back); 4. predictions from the calibrated preset
    (OUT/conf) and the full table. `rest`: the closed loops' engine acceptance by loop."""
    args.conf = out / "conf"
    args.acc_trace = str((out / "acceptance_run" / "trace.jsonl").resolve())
    specs = {name: engine_knobs(config, n, args) for name, config, n in CELLS}
    loops = {loop: (engine_knobs(config, n, args), n, {"acceptance": rest[loop]})
             for loop, config, n in REST_LOOPS if loop in rest}
    presets = [("shipped", args.shipped)]
    add_predictions(rows, specs, "shipped", args.shipped, args, log)
    write_table(out, rows, presets, args, None, source, rest_predictions(loops, args.shipped, args))
    presets.append(("calibrated", args.name))
    add_predictions(rows, specs, "calibrated", args.name, args, log)
    # the calibrated profile's depth factors are this machine's: the rest predicted again
    write_table(out, rows, presets, args, cal_s, source, rest_predictions(loops, args.name, args))
    log(f"wrote {out / 'transfer.md'} and transfer.json")


def relink_profile(conf: Path, name: str) -> None:
    """The calibrated preset names its profile by the absolute path it was written at (on the
    device): point it at the run's own copy under `conf`, so that a run moved to another
    machine, or a copy of a run whose original still exists, reads its own profile."""
    preset, local = conf / "hardware" / f"{name}.yaml", conf / "profiles" / f"{name}.json"
    if not (preset.is_file() and local.is_file()):
        return
    lines = preset.read_text(encoding="utf-8").splitlines(keepends=True)
    for i, line in enumerate(lines):
        ref = line[len("profile: "):].strip() if line.startswith("profile: ") else None
        if ref and not ref.startswith("${") and Path(ref).resolve() != local.resolve():
            lines[i] = f"profile: {local.resolve()}\n"
            preset.write_text("".join(lines), encoding="utf-8")
            return


def predict_from(out: Path, args) -> int:
    """--predict-from OUT: the predictions and table of a run's OUT/measured.json, with the
    run's own workload and presets, on this machine's simulator."""
    path = out / MEASURED
    if not path.is_file():
        raise SystemExit(f"error: {path}: not found (a run of this script writes it once its "
                         "measurements are done)")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
        rows, rest, saved = m["rows"], m["rest_acceptance"], m["args"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {path}: not a measurements file of this script ({e})")
    for key in ("prompt_tokens", "max_tokens", "repeats", "max_context", "shipped", "name",
                "acceptance"):
        setattr(args, key, saved.get(key, getattr(args, key)))
    for r in rows:  # predictions of an earlier run give way to this one's
        for label in ("shipped", "calibrated"):
            r.pop(label, None)
    relink_profile(out / "conf", args.name)
    t0 = time.perf_counter()
    predict_and_write(out, rows, rest, args, m.get("calibration_s"), m.get("source") or {},
                      lambda msg: print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
