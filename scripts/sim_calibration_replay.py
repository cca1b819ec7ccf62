#!/usr/bin/env python3
"""Refit a transfer check's recorded calibration with this tree's fit, and predict its cells.

No device: the input is the output directory of `scripts/sim_transfer_check.py` (or a .tar.gz
of one, e.g. docs/bench/s8/transfer_raw.tar.gz, the H200 run of `4f4e7c5`). It

1. fits a cost profile from the calibration's traces only (DIR/calibration/*/trace.jsonl,
   with sim.profile.fit_profile, as `python -m sim calibrate` does, its host parts scaled by
   the calibration's own untraced twins when it recorded them) and writes it as a hardware
   preset under OUT/conf;
2. predicts every engine cohort cell of the check from that preset, with the acceptance the
   check learned from its 8-request run (DIR/acceptance_run/trace.jsonl), and once more with
   the acceptance of the cell's own prompts (its traced run's commits, each simulated request
   at its traced twin's own difficulty: `acceptance.pin_requests`): the second isolates the
   cost model from the acceptance draw of a 1-8-request cohort;
3. compares each with the engine's untraced runs (DIR/engine/CELL/rep*/metrics.json, their
   mean; held out: no timing of a cohort run enters the fit), and checks the trace's own
   cost: each traced cohort run (the check's compile pass and traced pass) less the `trace_s`
   its trace recorded, against the untraced runs;
4. checks the untraced-twin host factor (sim.profile.untraced_host_factor) held out: each
   cell's traced run stands in for a calibration run with an untraced twin, the factor
   pooled from the other cells predicts its untraced wall, and scales the refitted profile's
   host parts (all six, in place of the calibration's own factor) for a prediction of the
   cell (`--no-twins` skips it).

    python scripts/sim_calibration_replay.py docs/bench/s8/transfer_raw.tar.gz --out /tmp/replay
    python scripts/sim_calibration_replay.py docs/bench/s9/transfer_raw.tar.gz \
        --stand-in acceptance_run --out /tmp/replay9

`--stand-in RUN` fits a non-cohort run of the check with the calibration: the recorded
calibrations ran every batch cell in an 8-slot engine, and the grid now runs N in N slots (a
window's time depends on the slot count, sim.slot_speeds); the check's acceptance run
(batch_mtp N=4 in a 4-slot engine, 8 other prompts) is what the grid's N=4 cell measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

#: The five cohort cells of the transfer check: (cell, directory name).
CELLS = ("solo N=1", "batch N=4", "batch N=8", "batch_mtp N=4", "batch_mtp W16 N=8")


def cell_dir(cell: str) -> str:
    return cell.replace(" ", "_")


def open_input(path: Path) -> Path:
    """The transfer directory: `path` itself, or the one directory a .tar.gz unpacks to."""
    if path.is_dir():
        return path
    if not path.is_file():
        raise SystemExit(f"error: {path}: no such directory or archive")
    where = Path(tempfile.mkdtemp(prefix="strata-replay-"))
    with tarfile.open(path) as tar:
        tar.extractall(where, filter="data")
    found = [p.parent for p in where.rglob("calibration") if p.is_dir()]
    if len(found) != 1:
        raise SystemExit(f"error: {path}: expected one transfer directory with calibration/ inside")
    return found[0]


def calibration_traces(src: Path) -> list[Path]:
    """The calibration's traces in the order it ran them (its profile's `source.calibration
    .runs` when recorded, else by name)."""
    runs = sorted(p.parent.name for p in (src / "calibration").glob("*/trace.jsonl"))
    recorded = sorted((src / "conf" / "profiles").glob("*.json"))
    if recorded:
        order = [r["run"] for r in json.loads(recorded[0].read_text())["source"]
                 .get("calibration", {}).get("runs", [])]
        if sorted(order) == runs:
            runs = order
    if not runs:
        raise SystemExit(f"error: {src}/calibration: no trace.jsonl")
    return [src / "calibration" / r / "trace.jsonl" for r in runs]


def stand_in_traces(src: Path, names: list[str]) -> list[Path]:
    """The traces of runs named (directories under the transfer directory) that stand in for
    grid cells the recorded calibration lacks; none is a cohort (those are held out)."""
    out = []
    for name in names:
        if name.split("/")[0] in ("engine", "compile"):
            raise SystemExit(f"error: --stand-in {name}: a cohort run is held out, not fitted")
        path = src / name / "trace.jsonl"
        if not path.is_file():
            raise SystemExit(f"error: --stand-in {name}: {path} not found")
        out.append(path)
    return out


def refit(src: Path, conf: Path, name: str, stand_ins: tuple[Path, ...] = ()) -> Path:
    """Fit the calibration traces (and `stand_ins`) with this tree's sim.profile; write the
    preset NAME under CONF (profile, memory facts, hardware) as sim.calibrate does; returns
    the profile path."""
    from sim.calibrate import memory_facts, write_preset
    from sim.profile import fit_profile_files
    from sim.replay import load_trace

    traces = calibration_traces(src) + list(stand_ins)
    recorded = sorted((src / "conf" / "profiles").glob("*.json"))
    old = json.loads(recorded[0].read_text())["source"] if recorded else {}
    source = {k: old[k] for k in ("device", "torch", "dtype", "backend", "commit", "date",
                                  "calibration") if k in old}
    source.setdefault("calibration", {"grid": "recorded"})
    source.setdefault("date", "recorded")
    for k in ("device", "dtype", "backend", "commit"):
        source.setdefault(k, "unknown")
    # The calibration's own untraced twins, when it ran them (stand-ins have none).
    runs = {r["run"]: r for r in source.get("calibration", {}).get("runs", [])
            if isinstance(r, dict)}
    walls = [(runs[p.parent.name]["wall_s"], runs[p.parent.name].get("untraced_wall_s"))
             if p.parent.name in runs and p.parent.parent.name == "calibration" else None
             for p in traces]
    if not any(w is not None and w[1] is not None for w in walls):
        walls = None
    prof = fit_profile_files(traces, {**source, "refit_of": str(src)}, walls)
    (conf / "profiles").mkdir(parents=True, exist_ok=True)
    path = conf / "profiles" / f"{name}.json"
    prof.save(path)
    events, _ = load_trace(calibration_traces(src)[-1])
    warm = any(e["ev"] == "warmup" and e.get("keys") for e in events)
    write_preset(conf, name, path, memory_facts(events), warm, None, source)
    return path


def engine_cells(src: Path) -> dict[str, dict]:
    """Per cell: the untraced runs' tok/s (held out), their acceptance, the run's requests."""
    out = {}
    for cell in CELLS:
        reps = sorted((src / "engine" / cell_dir(cell)).glob("rep*/metrics.json"))
        if not reps:
            raise SystemExit(f"error: {src}/engine/{cell_dir(cell)}: no rep*/metrics.json")
        ms = [json.loads(p.read_text()) for p in reps]
        out[cell] = {"runs": [m["aggregate_tps"] for m in ms],
                     "tps": statistics.mean(m["aggregate_tps"] for m in ms),
                     "wall_s": [m["wall_s"] for m in ms], "acceptance": ms[0]["acceptance"],
                     "requests": len(ms[0]["requests"]),
                     "prompt": ms[0]["requests"][0]["prompt_tokens"],
                     "out": ms[0]["requests"][0]["output_tokens"]}
    return out


def trace_cost_check(src: Path, engine: dict[str, dict]) -> list[dict]:
    """Each traced cohort run's wall less its trace's own time, against the untraced runs."""
    rows = []
    for cell in CELLS:
        for label, d in (("compile pass", src / "compile" / cell_dir(cell)),
                         ("traced pass", src / "engine" / cell_dir(cell) / "traced")):
            if not (d / "trace.jsonl").is_file():
                continue
            m = json.loads((d / "metrics.json").read_text())
            spent = max((json.loads(line).get("trace_s", 0.0)
                         for line in open(d / "trace.jsonl", encoding="utf-8")), default=0.0)
            untraced = statistics.mean(engine[cell]["wall_s"])
            rows.append({"cell": cell, "run": label, "wall_s": m["wall_s"], "trace_s": spent,
                         "untraced_wall_s": untraced,
                         "error": (m["wall_s"] - spent) / untraced - 1})
    return rows


#: The host parts of a cost profile (seconds), which an untraced twin's factor scales.
HOST_FIELDS = ("host_overhead_s", "host_per_commit_s", "host_per_admit_s",
               "host_per_admit_burst_s", "host_after_prefill_s", "host_per_finish_s")


def twin_runs(src: Path, engine: dict[str, dict]) -> dict[str, tuple[list, float, float]]:
    """Per cell: its traced cohort run as a stand-in for a calibration run with an untraced
    twin: (trace events, traced wall, the untraced runs' mean wall)."""
    from sim.replay import load_trace

    out = {}
    for cell in CELLS:
        d = src / "engine" / cell_dir(cell) / "traced"
        if (d / "trace.jsonl").is_file():
            m = json.loads((d / "metrics.json").read_text())
            out[cell] = (load_trace(d / "trace.jsonl")[0], m["wall_s"],
                         statistics.mean(engine[cell]["wall_s"]))
    return out


def twin_check(src: Path, conf: Path, name: str, profile: Path,
               engine: dict[str, dict]) -> tuple[list[dict], list[dict]]:
    """The untraced-twin host factor, held out: for each cell, the factor pooled from the
    OTHER cells' traced and untraced walls (sim.profile.untraced_host_factor) predicts this
    cell's untraced wall from its traced run (device + factor x host), and scales the refitted
    calibration profile's host parts to predict the cell with the simulator (at its own
    acceptance: the cost model alone). Returns (wall rows, simulator rows)."""
    from sim.calibrate import memory_facts, write_preset
    from sim.costs import CostProfile
    from sim.profile import untraced_host_factor
    from sim.replay import load_trace

    runs = twin_runs(src, engine)
    walls, sims = [], []
    base = json.loads(profile.read_text())
    mem = memory_facts(load_trace(calibration_traces(src)[-1])[0])
    for i, cell in enumerate(runs):
        others = [r for c, r in runs.items() if c != cell]
        if not others:
            continue
        f = untraced_host_factor(others)["factor"]
        if f is None:
            continue  # (no other cell's walls tell its host time)
        ev, traced, untraced = runs[cell]
        device = sum(float(e["dur"]) for e in ev
                     if e.get("ev") in ("window", "prefill") and "dur" in e)
        spent = max((float(e.get("trace_s") or 0.0) for e in ev), default=0.0)
        host, served = traced - device - spent, untraced - device
        # (its own factor; None where its untraced wall is under its traced device time)
        own = served / host if host > 0 and served > 0 else None
        pred = device + f * host
        walls.append({"cell": cell, "factor_others": f, "factor_own": own,
                      "traced_wall_s": traced, "untraced_wall_s": untraced,
                      "predicted_wall_s": pred, "error": pred / untraced - 1,
                      "traced_error": (traced - spent) / untraced - 1})
        # Every host part times f, over the calibration's own twins' factor if it had one.
        prof = CostProfile.from_dict(base)
        own_f = (base["source"].get("untraced_host") or {}).get("factor") or 1.0
        for k in HOST_FIELDS:
            setattr(prof, k, getattr(prof, k) * f / own_f)
        prof.source = {**prof.source, "untraced_host": {"factor": round(f, 4),
                                                        "from": "held-out cells"}}
        twin_name = f"{name}_twin{i}"
        path = conf / "profiles" / f"{twin_name}.json"
        prof.save(path)
        write_preset(conf, twin_name, path, mem, True, None,
                     {**base["source"], "date": base["source"].get("date", "recorded")})
        sims.extend(predict_cells(src, conf, twin_name, engine, True, only=cell))
    return walls, sims


def recorded_knobs(src: Path, cell: str) -> dict:
    """The cell's engine loop as its traced run's `config` event records it, so that the
    prediction models what was measured: whether it ran overlapped (a trace from before
    engine.overlap ran serially) and its slots a prompt chunk (one before the auto)."""
    path = src / "engine" / cell_dir(cell) / "traced" / "trace.jsonl"
    with open(path, encoding="utf-8") as f:
        engine = json.loads(f.readline()).get("engine") or {}
    return {"overlap": bool(engine.get("overlap")), "prefill_slots": engine.get("prefill_slots") or 1}


def predict_cells(src: Path, conf: Path, name: str, engine: dict[str, dict],
                  own_acceptance: bool, only: str | None = None, draws: int = 1) -> list[dict]:
    """Each cell (or the cell `only`) predicted from preset NAME; acceptance from the check's
    8-request run (a drafting cell's averaged over `draws` seeds, as the check does), or
    (own_acceptance) from the cell's traced run."""
    from types import SimpleNamespace

    import sim_transfer_check as stc
    from sim.config import SimConfigError

    rows = []
    for cell, config, n in stc.CELLS:
        if only is not None and cell != only:
            continue
        e = engine[cell]
        own = own_acceptance and e["acceptance"] is not None  # (plain batch drafts nothing)
        acc_trace = (src / "engine" / cell_dir(cell) / "traced" / "trace.jsonl" if own
                     else src / "acceptance_run" / "trace.jsonl")
        args = SimpleNamespace(prompt_tokens=e["prompt"], max_tokens=e["out"], acceptance="chain",
                               acc_trace=f"'{acc_trace.resolve()}'", conf=conf, max_context=0)
        # (quoted: the cells' directories have '=' in their names)
        knobs = {**stc.engine_knobs(config, n, args), **recorded_knobs(src, cell)}
        over = stc.sim_overrides(knobs, n, args)
        # at its own acceptance each simulated request takes its traced twin's difficulty
        # (acceptance.pin_requests, a chain setting): the cohort's own slow request, not a new
        # draw of four
        pin = ["acceptance.pin_requests=true"] if own else []
        # (pinned, a request's acceptance still varies by draw, about 0.05 over 150 drafts,
        # and the cohort lasts as long as its slowest request: drawn as often as learned)
        k = 1 if e["acceptance"] is None else draws
        try:
            m = stc.predict_drawn(name, over + pin, k)
        except SimConfigError:  # a solo trace judges no grouped drafts: no chain fit
            m = stc.predict_drawn(name, [o.replace("acceptance=chain", "acceptance=position")
                                         for o in over], k)
        lo, hi = m["range"]["aggregate_tps"]
        rows.append({"cell": cell, "engine_tps": e["tps"], "engine_runs": e["runs"],
                     "engine_acceptance": e["acceptance"], "sim_tps": m["aggregate_tps"],
                     "range": [lo, hi], "holds": lo <= e["tps"] <= hi,
                     "error": m["aggregate_tps"] / e["tps"] - 1,
                     "sim_acceptance": m["acceptance"]})
    return rows


def table(rows: list[dict], title: str) -> list[str]:
    out = [title, "", "| cell | engine tok/s (runs) | sim tok/s (range) | error | in range | "
                      "engine acc | sim acc |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        out.append(f"| {r['cell']} | {r['engine_tps']:.0f} ("
                   + ", ".join(f"{x:.0f}" for x in r["engine_runs"]) + ") | "
                   f"{r['sim_tps']:.0f} ({r['range'][0]:.0f}-{r['range'][1]:.0f}) | "
                   f"{r['error']:+.1%} | {'yes' if r['holds'] else 'NO'} | "
                   f"{acc(r['engine_acceptance'])} | {acc(r['sim_acceptance'])} |")
    return out + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("transfer", help="a sim_transfer_check output directory or a .tar.gz of one")
    ap.add_argument("--out", default="sim_calibration_replay")
    ap.add_argument("--acceptance-draws", type=int, default=64,
                    help="seeds a drafting cell's learned-acceptance prediction is averaged over "
                         "(as sim_transfer_check.py does)")
    ap.add_argument("--name", default="replayed_calibration", help="the refitted preset's name")
    ap.add_argument("--own-acceptance", action=argparse.BooleanOptionalAction, default=True,
                    help="also predict with each cell's own acceptance (the cost model alone)")
    ap.add_argument("--stand-in", action="append", default=[], metavar="RUN",
                    help="a run of the transfer directory fitted with the calibration, standing "
                         "in for a grid cell the recorded calibration lacks (e.g. acceptance_run: "
                         "batch_mtp N=4 in a 4-slot engine, which the grid now runs); repeatable")
    ap.add_argument("--twins", action=argparse.BooleanOptionalAction, default=True,
                    help="the untraced-twin host factor's held-out check on the cohort cells")
    args = ap.parse_args()
    if args.acceptance_draws < 1:
        ap.error(f"--acceptance-draws: must be >= 1, got {args.acceptance_draws}")
    from sim.untraced_twins import summary as twin_summary

    src = open_input(Path(args.transfer))
    out = Path(args.out)
    conf = out / "conf"
    profile = refit(src, conf, args.name, tuple(stand_in_traces(src, args.stand_in)))
    fitted = json.loads(profile.read_text())
    scale, twins = fitted["decode"].get("slot_scale"), fitted["source"].get("untraced_host")
    engine = engine_cells(src)
    learned = predict_cells(src, conf, args.name, engine, own_acceptance=False,
                            draws=args.acceptance_draws)
    own = predict_cells(src, conf, args.name, engine, True, draws=args.acceptance_draws) \
        if args.own_acceptance else []
    costs = trace_cost_check(src, engine)
    twin_walls, twin_sims = twin_check(src, conf, args.name, profile, engine) if args.twins \
        else ([], [])
    lines = [f"Refitted from {len(calibration_traces(src))} calibration traces"
             + (f" and the stand-in runs {', '.join(args.stand_in)}" if args.stand_in else "")
             + "; window-time scale by slot count: "
             + (", ".join(f"{n} slots x{f:.3f}" for n, f in zip(scale["slots"], scale["scale"]))
                if scale else "none (one slot count)") + "; untraced twins: "
             + (twin_summary(twins) if twins else "none recorded (host parts as traced)")
             + ".", ""]
    lines += table(learned, "Calibrated preset refitted by this tree; acceptance learned from the "
                            "check's 8-request run, drafting cells averaged over "
                            f"{args.acceptance_draws} acceptance draws (as the check "
                            "predicts):")
    if own:
        lines += table(own, "The same preset, each cell at its own prompts' acceptance, each "
                            "simulated request at its traced twin's difficulty "
                            f"(acceptance.pin_requests; drafting cells averaged over "
                            f"{args.acceptance_draws} draws): the cost model alone:")
    lines += ["The trace's own cost: traced cohort runs less their `trace_s`, against the "
              "untraced runs' mean wall:", "", "| cell | run | wall ms | trace ms | "
              "wall - trace vs untraced |", "|---|---|---|---|---|"]
    lines += [f"| {r['cell']} | {r['run']} | {r['wall_s'] * 1e3:.1f} | {r['trace_s'] * 1e3:.1f} "
              f"| {r['error']:+.1%} |" for r in costs]
    if twin_walls:
        lines += ["", "Untraced twins, held out: each cell's traced run as a calibration run with "
                  "an untraced twin; the host factor pooled from the OTHER cells predicts its "
                  "untraced wall (device + factor x host):", "",
                  "| cell | factor (others) | factor (own) | untraced wall ms | traced - trace "
                  "vs untraced | predicted vs untraced |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['cell']} | {r['factor_others']:.3f} | "
                  + ("-" if r["factor_own"] is None else f"{r['factor_own']:.3f}") + " | "
                  f"{r['untraced_wall_s'] * 1e3:.1f} | {r['traced_error']:+.1%} | "
                  f"{r['error']:+.1%} |" for r in twin_walls]
        lines += [""] + table(twin_sims, "The refitted calibration with its host parts scaled by "
                              "the held-out factor, each cell at its own acceptance:")
    text = "\n".join(lines)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.md").write_text(text + "\n", encoding="utf-8")
    (out / "replay.json").write_text(json.dumps(
        {"input": str(args.transfer), "profile": str(profile), "stand_ins": args.stand_in,
         "slot_scale": scale, "learned_acceptance": learned,
         "own_acceptance": own, "trace_cost": costs, "twin_walls": twin_walls,
         "twin_sims": twin_sims}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
