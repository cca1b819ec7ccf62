"""`python -m sim calibrate`: measure this machine's costs quickly and write a hardware preset.

Runs the real engine (in this process, sim.engine_runs) over a fixed small grid of closed-loop
runs that cover the window shapes strata's modes run (solo 1x4; batch Nx1; batch_mtp Nx2 at
W8 and W16, for N up to 8), the context tiers 256..1024 and every prompt-chunk bucket, then
(serially, and once more overlapped on CUDA: sim.profile prices host.submit_s from those),
fits a cost profile from their traces with sim.profile.fit_profile (the same fit and format
as scripts/profile_engine.py, which runs a larger grid) and writes three files:

    CONF/profiles/NAME.json     the cost profile (source.calibration: the grid, timings)
    CONF/memory/NAME.yaml       the memory facts the engine recorded in its trace
    CONF/hardware/NAME.yaml     a preset pointing at both: `python -m sim hardware=NAME ...`

CONF is conf/sim by default (the preset works at once); another directory is used with
`hydra.searchpath=[file://CONF]`. Every run uses strata's engine defaults except the cell's
own knobs (and `max_context=` when given), so the preset's engine section holds only what the
device changes: whether the warm-up captured window graphs.

    python -m sim calibrate device=cuda                     # ~80 s after the model compiled
    python -m sim calibrate device=cpu model=DIR max_context=256 grid=tiny threads=1

Keys (key=value): device (cuda), dtype (auto), model (the embedded model), name
(calibrated_<device>), conf (conf/sim), work_dir (a temporary dir: the runs' traces),
grid (quick on CUDA, tiny elsewhere), max_context (the engine's default), threads (0 = torch's
default), seed (0), twins (1 on CUDA: each run's engine runs its prompts once more untraced,
graphs warm, and the fit scales the host costs to those walls, sim.untraced_twins: an
engine as served writes no trace, and a traced H200 run was 4-12% slower; a run without a
usable twin is left out of the factor and named in the log; 0 elsewhere: on a CPU the device
work is the host's too, and an engine's second run took 20% less than the first's device
time alone, which a host factor cannot tell apart).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .config import SIM_CONF_DIR, SimConfigError

#: Keys `python -m sim calibrate` takes, with their defaults (None: chosen by device).
KEYS: dict[str, Any] = {"device": "cuda", "dtype": "auto", "model": None, "name": None,
                        "conf": SIM_CONF_DIR, "work_dir": None, "grid": None,
                        "max_context": None, "threads": 0, "seed": 0, "twins": None}


@dataclass(frozen=True)
class GridSize:
    """How big the fixed grid's runs are: slot counts N, short prompts (the short-prompt runs
    take them in turn, so every prompt-chunk bucket is measured), the long prompt, output
    tokens of a short-prompt run, closed-loop requests per N, long-prompt outputs, and how
    many times the grid runs (a second pass runs the cells in reverse order on fresh engines
    and prompts: every cell is then measured by two engines at two times, and the fit's speed
    polish judges each run against the other instead of pricing a cell at one run's speed),
    and whether one more pass runs them overlapped (engine.overlap, untimed twins off): its
    windows, queued behind each other, price host.submit_s, the part of a serial window's
    device time that its idle device waits for the window's submission (sim.profile)."""
    ns: tuple[int, ...]
    short_prompts: tuple[int, ...]
    long_prompt: int
    out: int
    requests_per_n: int
    long_out: int
    passes: int = 1
    overlapped: bool = False

    @property
    def runs_per_cell(self) -> int:
        return self.passes + int(self.overlapped)


GRIDS = {
    # One H200: 2 x 11 serial runs of a few hundred ms each (3.5 s in all, as much again for the
    # untraced twins) plus an engine start of 1-2 s each (58 s without twins at d0b2b29), then
    # the 11 once more overlapped (about 20 s more). On the H200 one engine ran a whole run
    # 5-8% faster or slower than another (window medians of one shape 361-427 us, each run
    # steady within +-3%): one run per cell priced it at that run's speed. 224 output tokens
    # take the short prompts' windows past position 256, so the 512 tier is measured and not
    # extrapolated.
    "quick": GridSize(ns=(1, 2, 4, 8), short_prompts=(100, 60, 30, 12), long_prompt=700, out=224,
                      requests_per_n=2, long_out=48, passes=2, overlapped=True),
    # A CPU engine on a tiny model: runs of a second or two.
    "tiny": GridSize(ns=(1, 2, 4), short_prompts=(24, 12, 40), long_prompt=150, out=24,
                     requests_per_n=2, long_out=8),
}


def calibration_grid(size: GridSize, seed: int = 0) -> list:
    """The RunSpecs of the grid, in run order. Prompts are random ids (strata's synthetic
    workload), each run its own draw."""
    from .engine_runs import RunSpec

    top = max(size.ns)
    turn = iter(range(1 << 30))

    def short() -> int:
        return size.short_prompts[next(turn) % len(size.short_prompts)]

    cells: list[tuple[str, dict[str, Any], int, int, int, int]] = []
    # solo (one 1x4 window per step)
    cells.append(("solo", dict(mode="solo", batch_mtp=False), 1, 2, short(), size.out))
    # An engine of N slots for N in flight, as served (bench_engine.py, a server sized to its
    # load): a window's time depends on the engine's slot count, not only on its shape (H200:
    # 4x1 and 4x2 windows 5-6% dearer in an 8-slot engine; sim.slot_speeds). N=1 runs in the
    # top slot count: its 1x4 windows, which solo measures with one slot, tie the slot counts
    # together, as 4x2 at N=4 (4 slots) and at the top N (W8 runs 4x2 groups) does.
    for n in size.ns:  # batch_mtp at W8: Nx2 groups (and the lone 1x4 while one is active)
        cells.append((f"mtp_n{n}", dict(mode="batch", batch_mtp=True,
                                        slots=top if n == 1 else n), n,
                      n * size.requests_per_n, short(), size.out))
    for n in size.ns[1:]:  # plain batch: Nx1 windows
        cells.append((f"batch_n{n}", dict(mode="batch", batch_mtp=False, slots=n), n,
                      n * size.requests_per_n, short(), size.out))
    # batch_mtp at W16 (8x2 windows when 8 are active)
    cells.append((f"mtp_w16_n{top}", dict(mode="batch", batch_mtp=True, slots=top,
                                          window_rows=16), top, top * size.requests_per_n,
                  short(), size.out))
    # Long prompts: every prompt-chunk bucket at the higher tiers, windows at the top tier.
    for n in (1, top):
        cells.append((f"long_n{n}", dict(mode="batch", batch_mtp=True, slots=top), n, n,
                      size.long_prompt, size.long_out))
    order = [(p, c) for p in range(size.runs_per_cell)
             for c in (cells if p % 2 == 0 else cells[::-1])]
    # Serial loops (engine.overlap=false): a profile prices a window's device and host parts
    # one by one, which an overlapped loop hides in each other; the simulator overlaps them
    # itself where the engine it predicts does. The overlapped pass (the last) prices only
    # what a queued window does not wait for.
    return [RunSpec(name=(f"{name}_ov" if p == size.passes else name if p == 0
                          else f"{name}_p{p + 1}"),
                    requests=reqs, prompt=prompt, out=out, concurrency=conc,
                    engine=dict(knobs, overlap=p == size.passes), seed=seed + i + 1)
            for i, (p, (name, knobs, conc, reqs, prompt, out)) in enumerate(order)]


def parse_args(argv: list[str]) -> dict[str, Any]:
    """key=value arguments over KEYS; an unknown key or a bad value is an error naming it."""
    out = dict(KEYS)
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in KEYS:
            raise SimConfigError(f"calibrate: expected key=value with key one of "
                                 f"{sorted(KEYS)}, got {arg!r}")
        if key in ("max_context", "threads", "seed", "twins"):
            try:
                out[key] = int(value)
            except ValueError:
                raise SimConfigError(f"calibrate: {key} must be an integer, got {value!r}") from None
        else:
            out[key] = value
    dev, _, index = str(out["device"]).partition(":")
    if dev not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise SimConfigError(f"calibrate: device must be cpu, cuda or cuda:N, got "
                             f"{out['device']!r}")
    if out["threads"] < 0:
        raise SimConfigError(f"calibrate: threads must be >= 0 (0 = torch's default), got "
                             f"{out['threads']}")
    out["grid"] = out["grid"] or ("quick" if dev == "cuda" else "tiny")
    if out["twins"] is None:
        out["twins"] = 1 if dev == "cuda" else 0
    if out["twins"] not in (0, 1):
        raise SimConfigError(f"calibrate: twins must be 0 or 1, got {out['twins']!r}")
    if out["grid"] not in GRIDS:
        raise SimConfigError(f"calibrate: grid must be one of {sorted(GRIDS)}, got {out['grid']!r}")
    g = GRIDS[out["grid"]]
    longest = max(g.long_prompt, *g.short_prompts)
    if out["max_context"] is not None and out["max_context"] <= longest:
        # (the engine would refuse the grid's longest prompts minutes into the calibration)
        raise SimConfigError(f"calibrate: max_context must exceed grid {out['grid']}'s longest "
                             f"prompt ({longest} tokens), got {out['max_context']}")
    out["name"] = out["name"] or f"calibrated_{dev}"
    if not out["name"].replace("_", "").replace("-", "").isalnum():
        raise SimConfigError(f"calibrate: name must be letters, digits, '_' or '-', got "
                             f"{out['name']!r}")
    return out


def memory_facts(events: list[dict[str, Any]]) -> dict[str, float]:
    """The simulator's memory facts from one engine trace: device, weights and slot sizes
    the engine recorded, and the graph size it measured (mean capture; else the CPU backend's
    fixed size or the engine's estimate)."""
    from .replay import measured_capture_mib

    cfg = next((e for e in events if e.get("ev") == "config"), None)
    if cfg is None or "memory" not in cfg:
        raise SimConfigError("calibrate: the engine's trace has no config event with memory facts")
    mem, eng = cfg["memory"], cfg["engine"]
    sizes = measured_capture_mib(events)
    graph = (sum(sizes) / len(sizes) if sizes else
             float(mem["graph_mib"]) if mem.get("graph_mib") is not None else
             float(eng["graph_mib_estimate"]))
    return {"total_mib": round(float(mem["total_mib"]), 3),
            "weights_mib": round(float(mem["weights_mib"]), 3),
            "slot_mib": round(float(mem["slot_mib"]), 6), "graph_mib": round(graph, 3)}


def write_preset(conf: Path, name: str, profile_path: Path, memory: dict[str, float],
                 warm_graphs: bool, max_context: Optional[int], source: dict[str, Any]) -> Path:
    """Write CONF/memory/NAME.yaml and CONF/hardware/NAME.yaml (the form of
    conf/sim/hardware/h200_tiny_bf16.yaml); returns the preset's path."""
    (conf / "memory").mkdir(parents=True, exist_ok=True)
    (conf / "hardware").mkdir(parents=True, exist_ok=True)
    (conf / "memory" / f"{name}.yaml").write_text(
        f"# Memory facts the engine recorded while `python -m sim calibrate` ran ({source['date']}).\n"
        "defaults:\n  - sim_memory_schema\n"
        + "".join(f"{k}: {v}\n" for k, v in memory.items())
        + "graph_mib_jitter: 0\nruntime_overhead_mib: 0\n", encoding="utf-8")
    try:
        rel = profile_path.resolve().relative_to(Path(SIM_CONF_DIR).resolve())
        profile_ref = "${sim_conf:" + rel.as_posix() + "}"
    except ValueError:
        profile_ref = str(profile_path.resolve())
    engine = [f"  warmup_graphs: {str(warm_graphs).lower()}\n"]
    if max_context is not None:
        engine.append(f"  max_context: {max_context}\n")
    desc = (f"{source['device']}, {source['dtype']}, backend {source['backend']}, calibrated "
            f"{source['date']} at {source['commit']} (grid {source['calibration']['grid']})")
    path = conf / "hardware" / f"{name}.yaml"
    path.write_text(
        "# @package _global_\n"
        "# Written by `python -m sim calibrate`: this machine's quick profile and memory facts,\n"
        "# with strata's engine defaults. The range's spread comes from the calibration runs'\n"
        "# own speed factors (measured on this machine: no machine term).\n"
        f"defaults:\n  - override /memory: {name}\n\n"
        f"profile: {profile_ref}\n"
        "engine:\n" + "".join(engine)
        + "spread:\n  machine: 0.0\n"
        f"hardware:\n  name: {name}\n  description: {json.dumps(desc)}\n", encoding="utf-8")
    return path


def calibrate(opts: dict[str, Any], log=print, runner: Any = None,
              between_passes: Optional[Callable[[int], None]] = None) -> dict[str, Path]:
    """Run the grid, fit, write the files; returns their paths (profile, memory, preset).
    `runner`: an EngineRunner already holding the model (a check that ran the engine before
    calibrating keeps its compiled model; opts' device, dtype and model are then unused).
    `between_passes(p)`: called after pass p of a grid of several passes (not after the
    last): a check runs its own engine repeats there, so any drift of the machine's speed
    over the call falls on the calibration and on what it predicts alike."""
    from .engine_runs import EngineRunner
    from .profile import fit_profile_files
    from .replay import load_trace
    from .untraced_twins import summary as twin_summary

    if runner is None and str(opts["device"]).startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise SimConfigError(f"calibrate: device={opts['device']}: no CUDA device is "
                                 "available (device=cpu measures this CPU)")
    t_start = time.perf_counter()
    if opts["threads"]:
        import torch
        torch.set_num_threads(int(opts["threads"]))
    runner = runner or EngineRunner(opts["device"], opts["dtype"], opts["model"])
    t_load = time.perf_counter() - t_start
    log(f"calibrate: model loaded on {opts['device']} in {t_load:.1f} s; grid {opts['grid']}")
    if opts["twins"] and not str(opts["device"]).startswith("cuda"):
        log(f"calibrate: warning: twins=1 on {opts['device']}: there the device work is the "
            "host's too, and a second run's speed-up of its windows (20% on a 2-core CPU) "
            "would be taken for host time the trace cost; twins=0 is the default off CUDA")
    specs = calibration_grid(GRIDS[opts["grid"]], int(opts["seed"]))
    if opts["max_context"] is not None:
        for s in specs:
            s.engine["max_context"] = int(opts["max_context"])
    work = Path(opts["work_dir"] or tempfile.mkdtemp(prefix="strata-calibrate-"))
    traces, timings = [], []
    per_pass = len(specs) // GRIDS[opts["grid"]].runs_per_cell
    for i, spec in enumerate(specs, 1):
        if between_passes is not None and i > 1 and (i - 1) % per_pass == 0:
            t_between = time.perf_counter()
            between_passes((i - 1) // per_pass - 1)
            t_start += time.perf_counter() - t_between  # (the caller's time is not ours)
        # (an overlapped run's host is hidden: it has no host share for a twin to tell)
        twins = bool(opts["twins"]) and not spec.engine["overlap"]
        m = runner.run(spec, work / spec.name, twin=twins)
        traces.append(work / spec.name / "trace.jsonl")
        timings.append({"run": spec.name, "start_s": round(m["start_s"], 3),
                        "wall_s": round(m["wall_s"], 6)})
        twin = m.get("untraced_wall_s") if twins else None
        if twin is not None:
            timings[-1]["untraced_wall_s"] = round(twin, 6)
        log(f"[{i}/{len(specs)}] {spec.name}: N={spec.concurrency} {spec.requests} x "
            f"{spec.prompt}+{spec.out} tokens, {m['output_tokens'] / m['wall_s']:.0f} tok/s "
            + ("" if not twins else "(no untraced twin) " if twin is None
               else f"(untraced {m['output_tokens'] / twin:.0f}) ")
            + f"({m['wall_s']:.2f} s, engine start {m['start_s']:.1f} s; "
            f"{time.perf_counter() - t_start:.0f} s so far)")
    source = {**runner.source(),
              "calibration": {"grid": opts["grid"], "size": GRIDS[opts["grid"]].__dict__,
                              "max_context": opts["max_context"], "runs": timings,
                              "load_s": round(t_load, 2),
                              "seconds": round(time.perf_counter() - t_start, 1)}}
    walls = ([(t["wall_s"], t.get("untraced_wall_s")) for t in timings] if opts["twins"]
             else None)
    prof = fit_profile_files(traces, source, walls)
    if opts["twins"]:
        log(f"calibrate: untraced twins: {twin_summary(prof.source['untraced_host'])}")
    else:
        log("calibrate: twins=0: no untraced twins, host parts priced as traced (the trace's "
            "recorded own time taken out)")
    conf = Path(opts["conf"])
    name = opts["name"]
    (conf / "profiles").mkdir(parents=True, exist_ok=True)
    profile_path = conf / "profiles" / f"{name}.json"
    prof.save(profile_path)
    events, _ = load_trace(traces[-1])
    warm = any(e["ev"] == "warmup" and e.get("keys") for e in events)
    preset = write_preset(conf, name, profile_path, memory_facts(events), warm,
                          opts["max_context"], source)
    log(f"calibrate: wrote {profile_path}, {conf / 'memory' / (name + '.yaml')}, {preset} "
        f"({time.perf_counter() - t_start:.0f} s in all); use: python -m sim hardware={name}"
        + ("" if conf.resolve() == Path(SIM_CONF_DIR).resolve()
           else f" 'hydra.searchpath=[file://{conf.resolve()}]'"))
    return {"profile": profile_path, "memory": conf / "memory" / f"{name}.yaml",
            "preset": preset}


def main(argv: list[str]) -> int:
    from strata.config import ConfigError
    from strata.model.config import CheckpointError

    from .profile import FitError
    from .replay import TraceError

    try:
        opts = parse_args(argv)
        calibrate(opts, log=lambda s: print(s, flush=True))
    # (ConfigError: SimConfigError's and the engine's; CheckpointError: model=, dtype=)
    except (ConfigError, CheckpointError, FitError, TraceError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
