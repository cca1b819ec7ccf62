"""Fit a cost profile from engine traces.

From each trace: `window` events give (rows, window shape, `ctx` tier, graph action, `dur`
seconds); `prefill` events give (tokens, `ctx`, `dur`); consecutive iterations that both ran
device work give the host overhead (the time between their events minus the later one's
`dur`); `commit` events give the acceptance models (sim.acceptance.fit_acceptance).

Window shape: (groups as run, most rows of a group), from a `shape:NxG@T` key (N is the padded
group count the engine ran) or else from the layout (its runs of one slot). Prefill: when the
trace's `config` lists `engine.prefill_buckets`, a chunk of n tokens covering positions up to
`ctx` is charged at its padded length b (the smallest bucket >= n) and the tier of `ctx - n + b`
(what the engine's attention reads), so prefill time is a step function of the bucket.

Each measured cell is the median of its samples, or their minimum when there are fewer than
MEDIAN_MIN_SAMPLES (interference only ever slows a sample down, and a median of two is their
mean). Gaps are filled so every query has an answer:
- rows table: within a tier, unmeasured row counts interpolate linearly between measured ones
  (constant past the ends); a tier with no sample copies the nearest measured tier (in log2);
- shape and prefill tables (`_fill_grid`): a cell between two measured tiers interpolates in
  log2(tier); one outside the measured tiers takes the nearest measured tier scaled by the
  median ratio between the two tiers over the columns measured at both;
- a (tier, shape) cell of fewer than SPARSE_CELL_SAMPLES samples whose shape has that many
  at another tier is filled as if unmeasured (a run's few transitional windows are not
  the shape's steady cost);
- a shape never measured for an action takes another action's value scaled by the median
  ratio of the two actions over shapes measured for both;
- an action with no sample at all copies another action's tables (FALLBACK_ACTIONS).
Each engine run goes at its own speed: on the H200, the same window shape measured in two runs
differed by up to 30% in window time and 2x in host time, one run slow or fast throughout (the
machine's host CPU slows down for stretches of seconds; docs/CHANGELOG.md, 2026-11-29,
the simulator check). A cell measured by one slow run would price every prediction that uses it at
that speed. So before the cells are taken, each trace's samples are divided by the trace's
speed factor (`_trace_speeds`: a median polish of log seconds into cell and trace effects,
separately for windows, prompt chunks and host gaps, over the cells two or more traces share),
and the factors of traces linked through shared cells are centred on their mean, so every cell
is priced at the profile runs' average speed: what a prediction of a mean over runs needs
(the H200 profile's runs fell into a fast and a slow cluster, 12 and 9; centred on the median,
its held-out grid came out 3-8% fast). A run is judged only on cells it measured
SPEED_CELL_MIN_SAMPLES times, and windows right after a prompt chunk (5-15% slower than the
same shape otherwise) are left out of the judging, and out of any cell that has
MEDIAN_MIN_SAMPLES other samples. A trace with fewer than SPEED_MIN_SAMPLES
samples in shared cells keeps factor 1.
Overlapped traces (engine.overlap) given beside serial ones whose windows carry `dev` price
only host.submit_s, the part of a serial window's device seconds that its idle device waits
for the window's submission (`_fit_submit`); the rest comes from the serial traces.
Runs timed again untraced on the same engine (`walls`, sim.calibrate's twins) scale the
host parts by one pooled factor (sim.untraced_twins): an engine as served writes no trace.
A window's time also depends on the engine's slot count: the window speeds' slot share is
kept apart as `decode.slot_scale` (sim.slot_speeds).
The profile's `source` records the samples behind every cell (`counts`, `shape_counts`,
`prefill_counts`, `prefill_table_counts`), so filled cells can be told apart.

    python -m sim.profile --out profile.json TRACE.jsonl [TRACE.jsonl ...]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional

from strata.trace import context_tier, prefill_bucket

from .acceptance import fit_acceptance
from .costs import GRAPH_ACTIONS, CostProfile, same_depth_shape
from .replay import TraceError, load_trace
from .slot_speeds import fit_slot_scale, trace_slots
from .untraced_twins import untraced_host_factor  # noqa: F401 (sim.profile's API)

#: Where an action with no samples takes its table from, in order of preference.
FALLBACK_ACTIONS = {"hit": ("eager", "capture"), "eager": ("hit", "capture"),
                    "capture": ("eager", "hit")}


class FitError(ValueError):
    pass


#: Cells with fewer samples than this take their minimum rather than their median.
MEDIAN_MIN_SAMPLES = 3


#: A (tier, shape) cell with fewer samples than this is filled from the shape's other tiers
#: when one of them has this many.
SPARSE_CELL_SAMPLES = 10

#: A trace needs this many samples of a kind before its speed factor for that kind is judged.
SPEED_MIN_SAMPLES = 20
#: ... and a cell tells a trace's speed only where that trace has this many samples of it: a
#: run's few transitional windows of a shape (ramp-up, drain) are not its steady speed (the
#: issue-21 calibration's W16 run: its 11 2x2 windows 16% slower than another run's, its 8x2
#: windows, the run's own shape, at the cohorts' speed).
SPEED_CELL_MIN_SAMPLES = 10
#: The median polish stops when no trace effect moves more than this (log units), or after
#: SPEED_POLISH_ROUNDS rounds.
SPEED_POLISH_TOL = 1e-6
SPEED_POLISH_ROUNDS = 100

#: host.submit_s compares a (tier, shape) cell's serial and overlapped windows only where each
#: way has this many samples.
SUBMIT_MIN_SAMPLES = 20


def _trace_speeds(samples: dict[int, list[tuple[Any, float]]],
                  judged_out: Optional[set[int]] = None,
                  groups_out: Optional[dict[int, int]] = None) -> dict[int, float]:
    """Per trace, the factor its samples ran at against the others': `samples` maps a trace to
    its (cell, seconds) pairs; log seconds are split by median polish into a cell effect and a
    trace effect. Only cells that two or more judged traces measured say anything about speed
    (a cell one trace alone measured would take on that trace's speed as its own), so a trace
    is judged on its samples in shared cells, and needs SPEED_MIN_SAMPLES of them; the others
    keep factor 1. Traces linked through shared cells form a group whose effects are centred
    on their mean (`groups_out`: each judged trace's group, named by one of its traces)."""
    logs = {n: [(k, math.log(max(v, 1e-9))) for k, v in xs] for n, xs in samples.items()}
    for n, xs in logs.items():  # only the cells each trace measured steadily
        per_cell: dict[Any, int] = defaultdict(int)
        for k, _ in xs:
            per_cell[k] += 1
        logs[n] = [(k, lv) for k, lv in xs if per_cell[k] >= SPEED_CELL_MIN_SAMPLES]
    judged = set(logs)
    while True:  # drop traces with too few shared samples until the shared cells settle
        owners: dict[Any, set[int]] = defaultdict(set)
        for n in judged:
            for k, _ in logs[n]:
                owners[k].add(n)
        shared = {k for k, ns in owners.items() if len(ns) >= 2}
        keep = {n for n in judged if sum(k in shared for k, _ in logs[n]) >= SPEED_MIN_SAMPLES}
        if keep == judged:
            break
        judged = keep
    eff = {n: 0.0 for n in logs}
    if len(judged) < 2:
        return {n: 1.0 for n in logs}
    if judged_out is not None:  # (the traces whose factor says something: the range's spread)
        judged_out.update(judged)
    use = {n: [(k, lv) for k, lv in logs[n] if k in shared] for n in judged}
    # Groups of traces linked by shared cells (union-find over the cells' owners).
    parent = {n: n for n in judged}

    def root(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for k in shared:
        first, *rest = sorted(owners[k])
        for n in rest:
            parent[root(n)] = root(first)
    groups: dict[int, list[int]] = defaultdict(list)
    for n in judged:
        groups[root(n)].append(n)
    if groups_out is not None:
        groups_out.update({n: root(n) for n in judged})
    for _ in range(SPEED_POLISH_ROUNDS):
        by_cell: dict[Any, list[float]] = defaultdict(list)
        for n, xs in use.items():
            for k, lv in xs:
                by_cell[k].append(lv - eff[n])
        cell = {k: _median(v) for k, v in by_cell.items()}
        new = {n: _median([lv - cell[k] for k, lv in use[n]]) for n in judged}
        for members in groups.values():
            centre = sum(new[n] for n in members) / len(members)
            for n in members:
                new[n] -= centre
        moved = max(abs(new[n] - eff[n]) for n in judged)
        eff.update(new)
        if moved < SPEED_POLISH_TOL:
            break
    return {n: math.exp(eff[n]) for n in logs}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _cell(xs: list[float]) -> float:
    """One cell's value from its samples: the median, or the minimum of one or two samples."""
    return _median(xs) if len(xs) >= MEDIAN_MIN_SAMPLES else float(min(xs))


def window_shape(e: dict[str, Any]) -> tuple[int, int]:
    """(groups as run, most rows of a group) of a `window` event."""
    key = str(e.get("key", ""))
    if key.startswith("shape:"):
        n, _, g = key[len("shape:"):].split("@")[0].partition("x")
        return int(n), int(g)
    runs: list[int] = []
    prev = object()
    for slot in e["layout"]:
        if slot == prev:
            runs[-1] += 1
        else:
            runs.append(1)
            prev = slot
    return len(runs), max(runs)


def _log2_ratio_scale(known: dict[tuple[float, Any], float], t: float, t_ref: float,
                      cols: Iterable[Any]) -> float:
    """Median over columns measured at both tiers of value(t) / value(t_ref); 1 when none."""
    ratios = [known[(t, c)] / known[(t_ref, c)] for c in cols
              if (t, c) in known and (t_ref, c) in known and known[(t_ref, c)] > 0]
    return _median(ratios) if ratios else 1.0


def _fill_grid(known: dict[tuple[float, Any], float], tiers: list[float],
               cols: list[Any]) -> list[list[Optional[float]]]:
    """[tier][col] from measured cells; every column measured at some tier is filled at all
    tiers (log2 interpolation between measured tiers, ratio-scaled nearest tier outside)."""
    out: list[list[Optional[float]]] = [[known.get((t, c)) for c in cols] for t in tiers]
    for ci, c in enumerate(cols):
        have = [t for t in tiers if (t, c) in known]
        if not have:
            continue
        for ti, t in enumerate(tiers):
            if (t, c) in known:
                continue
            if have[0] < t < have[-1]:
                lo = max(x for x in have if x < t)
                hi = min(x for x in have if x > t)
                w = (math.log2(t) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
                out[ti][ci] = known[(lo, c)] + w * (known[(hi, c)] - known[(lo, c)])
            else:
                ref = have[0] if t < have[0] else have[-1]
                out[ti][ci] = known[(ref, c)] * _log2_ratio_scale(known, t, ref, cols)
    return out


#: One host sample: (commits of the previous iteration, its finishes, admissions of this
#: one, previous one ran a prompt chunk, host seconds between the two's device work).
HostSample = tuple[int, int, int, bool, float]


def _host_samples(events: list[dict[str, Any]]) -> list[HostSample]:
    """A HostSample per iteration with device work. The host seconds run from the end of
    the previous iteration's device work, or for a trace's first one, from the first event
    of its iteration (the arrivals). The trace's own time in between (the `trace_s` stamps
    of the two device events, strata.trace.DEVICE_EVENTS) is taken out: the profile prices
    an engine as served, which writes no trace. (Traces written before the stamp keep it.)"""
    steps: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["ev"] in ("config", "warmup"):
            continue
        st = steps.setdefault(e["step"], {"first_t": float(e["t"]), "dev": None, "kind": None,
                                          "trace_s": None, "commits": 0, "admits": 0,
                                          "finishes": 0})
        if e["ev"] in ("window", "prefill") and "dur" in e and st["dev"] is None:
            st["dev"], st["kind"] = (float(e["t"]), float(e["dur"])), e["ev"]
            st["trace_s"] = e.get("trace_s")
        elif e["ev"] == "commit":
            st["commits"] += 1
        elif e["ev"] == "admit":
            st["admits"] += 1
        elif e["ev"] == "finish" and e.get("reason") != "cancel":
            # (a cancel finishes at its iteration's start, before the arrivals: not tail work)
            st["finishes"] += 1
    out: list[HostSample] = []
    last: Optional[int] = None  # the latest step with device work
    for step in sorted(steps):
        st = steps[step]
        if st["dev"] is None:
            continue
        start = st["dev"][0] - st["dev"][1]
        if last is None:  # the trace's first device iteration: from its arrivals
            out.append((0, 0, st["admits"], False, max(0.0, start - st["first_t"])))
        elif last == step - 1:  # idle iterations between would add their own waits
            p_st = steps[last]
            tracing = (0.0 if st["trace_s"] is None or p_st["trace_s"] is None
                       else float(st["trace_s"]) - float(p_st["trace_s"]))
            out.append((p_st["commits"], p_st["finishes"], st["admits"],
                        p_st["kind"] == "prefill", max(0.0, start - p_st["dev"][0] - tracing)))
        last = step
    return out


#: The parts fit_host returns, in order.
HOST_PARTS = ("fixed", "per_commit", "per_admit", "per_admit_burst", "after_prefill",
              "per_finish")


def fit_host(samples: list[HostSample]) -> tuple[float, ...]:
    """The HOST_PARTS in seconds: least squares over the medians of each (commits, finishes,
    admissions, after-chunk) cell, weighted by how many iterations each holds (medians: a
    garbage collection or a page fault is not host time of the engine's iteration). The
    engine binds all of an iteration's admissions in one batched step, so binding costs a
    part per burst besides a part per request; where the traces admit only one burst size
    the two cannot be told apart and the whole cost is charged per burst. Finishing a request
    is a part of its own (in a closed loop every finish is followed by an admission; the
    loop's start and end tell them apart). A part that comes out negative, or that no two
    cells tell apart, is left out and the rest refitted; with too few distinct cells it is
    the median of all samples, fixed."""
    import numpy as np

    n_parts = len(HOST_PARTS)
    if not samples:
        return (0.0,) * n_parts
    cells: dict[tuple[int, int, int, bool], list[float]] = defaultdict(list)
    for c, f, a, p, gap in samples:
        cells[(c, f, a, p)].append(gap)
    keys = sorted(cells)
    x = np.array([[1.0, c, a, float(a > 0), float(p), f] for c, f, a, p in keys])
    y = np.array([_median(cells[k]) for k in keys])
    w = np.sqrt(np.array([len(cells[k]) for k in keys], dtype=float))
    use = list(range(n_parts))
    if len({a for _, _, a, _ in keys if a > 0}) < 2:
        use.remove(2)  # one burst size: per request and per burst are the same column
    while True:
        cols = [i for i in use if np.any(x[:, i] != x[0, i]) or i == 0]
        rank = np.linalg.matrix_rank(x[:, cols])
        if rank < len(cols):
            # Columns no cell tells apart (finishes always with admissions): the last one
            # whose loss leaves the rank as it is goes, its cost stays with the others.
            drop = next(c for c in reversed(cols) if c != 0 and np.linalg.matrix_rank(
                x[:, [k for k in cols if k != c]]) == rank)
            use.remove(drop)
            continue
        if len(keys) < len(cols) + 1:
            return (_median([g for *_, g in samples]),) + (0.0,) * (n_parts - 1)
        coef, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)
        neg = [i for i, v in zip(cols, coef) if v < 0 and i != 0]
        if not neg:
            break
        use = [i for i in use if i not in neg]
    full = [0.0] * n_parts
    for i, v in zip(cols, coef):
        full[i] = max(0.0, float(v))
    return tuple(full)


def _fill_rows(known: dict[float, float], rows: list[float]) -> list[Optional[float]]:
    if not known:
        return [None] * len(rows)
    xs = sorted(known)
    out = []
    for r in rows:
        if r <= xs[0]:
            out.append(known[xs[0]])
        elif r >= xs[-1]:
            out.append(known[xs[-1]])
        else:
            j = next(i for i, x in enumerate(xs) if x >= r)
            lo, hi = xs[j - 1], xs[j]
            out.append(known[lo] + (r - lo) / (hi - lo) * (known[hi] - known[lo]))
    return out


def _fill_table(cells: dict[tuple[float, float], float], tiers: list[float],
                rows: list[float]) -> Optional[list[list[float]]]:
    if not cells:
        return None
    by_tier = [_fill_rows({r: v for (t, r), v in cells.items() if t == tier}, rows)
               for tier in tiers]
    measured = [i for i, row in enumerate(by_tier) if row[0] is not None]
    table = []
    for i, tier in enumerate(tiers):
        if by_tier[i][0] is None:
            nearest = min(measured, key=lambda j: abs(math.log2(tiers[j]) - math.log2(tier)))
            table.append(list(by_tier[nearest]))
        else:
            table.append(by_tier[i])
    return table


def _config_event(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The trace's `config` event (its first), or {} for a trace without one."""
    for e in events:
        if e["ev"] == "config":
            return e
    return {}


def _graph_prefills(cfg: dict[str, Any]) -> bool:
    """Did this engine (its `config` event) replay graphs for its prompt chunks? Only a CUDA
    engine (its trace has no fixed `graph_mib`) with engine.graphs and engine.prefill_graphs
    on; eager chunks cost several times more (a 64-token chunk on the H200: 13.5 ms eager,
    1.2 ms as a graph)."""
    eng, mem = cfg.get("engine") or {}, cfg.get("memory") or {}
    return (bool(cfg) and mem.get("graph_mib", 0) is None and bool(eng.get("graphs"))
            and bool(eng.get("prefill_graphs", True)))


def _prefill_key(e: dict[str, Any], knobs: dict[str, Any]) -> tuple[float, Optional[float]]:
    """(padded tokens, attention tier or None) of a `prefill` event."""
    n = int(e["tokens"])
    buckets = knobs.get("prefill_buckets")
    b = prefill_bucket(n, buckets) if buckets is not None else n
    if "ctx" not in e or "context_tier_min" not in knobs or "max_context" not in knobs:
        return float(b), None
    start = int(e["ctx"]) - n
    return float(b), float(context_tier(start + b, int(knobs["context_tier_min"]),
                                        int(knobs["max_context"])))


def _fill_shapes(cells: dict[str, dict[tuple[float, str], float]], tiers: list[float],
                 shapes: list[str]) -> tuple[dict[str, list[list[float]]], dict[str, str]]:
    grids = {a: _fill_grid(cells[a], tiers, shapes) for a in GRAPH_ACTIONS}
    copied = {}
    for a in GRAPH_ACTIONS:
        if not cells[a]:  # no sample of this action at all: copy a whole table
            donor = next(d for d in FALLBACK_ACTIONS[a] if cells[d])
            copied[a] = donor
    for a in GRAPH_ACTIONS:
        if a in copied:
            continue
        for ci, shape in enumerate(shapes):
            if grids[a][0][ci] is not None:
                continue
            # Never measured for `a`: another action's value scaled by the median a/donor
            # ratio over the (tier, shape) cells measured for both.
            for donor in FALLBACK_ACTIONS[a]:
                if grids[donor][0][ci] is None or donor in copied:
                    continue
                ratios = [cells[a][k] / cells[donor][k] for k in cells[a]
                          if k in cells[donor] and cells[donor][k] > 0]
                r = _median(ratios) if ratios else 1.0
                for ti in range(len(tiers)):
                    grids[a][ti][ci] = grids[donor][ti][ci] * r
                break
    for a, donor in copied.items():
        grids[a] = [list(r) for r in grids[donor]]
    for a in GRAPH_ACTIONS:  # a shape measured only under a copied action: copy its donor
        for ti in range(len(tiers)):
            for ci in range(len(shapes)):
                if grids[a][ti][ci] is None:
                    grids[a][ti][ci] = next(grids[d][ti][ci] for d in FALLBACK_ACTIONS[a]
                                            if grids[d][ti][ci] is not None)
    return grids, copied


def _steady_hits(events: list[dict[str, Any]], field: str) -> dict[tuple[float, str], list[float]]:
    """A trace's graph-replayed windows' `field` by (tier, shape), leaving out the windows
    right after a prompt chunk (slower, see fit_profile)."""
    chunks = {e["step"] for e in events if e["ev"] == "prefill"}
    out: dict[tuple[float, str], list[float]] = defaultdict(list)
    for e in events:
        if (e["ev"] == "window" and e.get("graph") == "hit" and field in e and "ctx" in e
                and e["step"] - 1 not in chunks):
            g, r = window_shape(e)
            out[(float(e["ctx"]), f"{g}x{r}")].append(float(e[field]))
    return out


def _fit_submit(serial: list[list[dict[str, Any]]],
                overlapped: list[list[dict[str, Any]]],
                divisors: Optional[dict[int, float]] = None) -> Optional[dict[str, Any]]:
    """host.submit_s: per (tier, shape) measured both ways, the serial windows' median `dev`
    (each divided by its run's speed factor in `divisors`, slot count's share included, as the
    decode tables are: a queued window then costs its overlapped median whatever the slot
    count) less the overlapped windows' median `dur` (a queued window's device seconds); the median
    of those differences weighted by the overlapped samples, at least 0, overall ("s") and by
    shape ("by_shape", for decode.submit_s: on the H200 the tiny model's plain-batch windows,
    the smaller graphs, waited 6 us, its drafting ones 25). None when no cell has
    SUBMIT_MIN_SAMPLES both ways. (An overlapped window whose host was late waited for its
    submission too, so a host-bound run only lowers the figure.)"""
    ser: dict[tuple[float, str], list[float]] = defaultdict(list)
    ovl: dict[tuple[float, str], list[float]] = defaultdict(list)
    for n, events in enumerate(serial):
        f = (divisors or {}).get(n, 1.0)
        for k, v in _steady_hits(events, "dev").items():
            ser[k].extend(x / f for x in v)
    kept = 0
    for events in overlapped:
        if not _device_bound(events):
            continue
        kept += 1
        for k, v in _steady_hits(events, "dur").items():
            ovl[k].extend(v)
    diffs: dict[str, list[float]] = defaultdict(list)
    cells = {}
    for k in sorted(set(ser) & set(ovl)):
        if len(ser[k]) >= SUBMIT_MIN_SAMPLES and len(ovl[k]) >= SUBMIT_MIN_SAMPLES:
            d = _median(ser[k]) - _median(ovl[k])
            cells[f"{k[1]}@{k[0]:g}"] = round(d, 7)
            diffs[k[1]].extend([d] * len(ovl[k]))
    if not diffs:
        return None
    return {"s": max(0.0, _median([d for v in diffs.values() for d in v])),
            "by_shape": {sh: max(0.0, _median(v)) for sh, v in diffs.items()},
            "cells": cells, "overlapped_traces": len(overlapped), "device_bound_traces": kept}


#: An overlapped run is device-bound (its windows queued behind each other) when the median
#: time between consecutive windows is within this factor of their median device seconds.
DEVICE_BOUND_GAP = 1.02


def _device_bound(events: list[dict[str, Any]]) -> bool:
    """Did this overlapped run's windows come back to back? Only then is a window's `dur` the
    device seconds of a queued window: where the host was late (a traced run of many small
    windows: the tiny model's 8x2 windows came 5% apart), each window's events also span its
    submission."""
    win = [e for e in events if e["ev"] == "window" and "dur" in e]
    gaps = [b["t"] - a["t"] for a, b in zip(win, win[1:]) if b["step"] == a["step"] + 1]
    if len(gaps) < SUBMIT_MIN_SAMPLES:
        return False
    return _median(gaps) <= DEVICE_BOUND_GAP * _median([float(e["dur"]) for e in win])


def _shape_submits(by_shape: dict[str, float], shapes: list[str], overall: float) -> list[float]:
    """decode.submit_s: each shape's own figure, else that of the measured shape that
    decode_time would take for it (the same rows per group, the nearest group count), else
    `overall`."""
    out = []
    for sh in shapes:
        n, _, g = sh.partition("x")
        near = sh if sh in by_shape else same_depth_shape((int(n), int(g)), by_shape)
        out.append(overall if near is None else by_shape[near])
    return out


def fit_profile(traces: Iterable[list[dict[str, Any]]],
                source: Optional[dict[str, Any]] = None,
                walls: Optional[list[Optional[tuple[float, Optional[float]]]]] = None,
                names: Optional[list[str]] = None) -> CostProfile:
    """`walls`: per trace, (traced wall s, untraced wall s or None) of runs timed with an
    untraced twin (None, or an untraced None, for one without); the host parts are then
    scaled by the pooled factor (sim.untraced_twins), so the profile prices an engine as
    served, and `source.untraced_host` says from which runs (`names`: the traces' names)."""
    traces = list(traces)
    if walls is not None and len(walls) != len(traces):
        raise FitError(f"walls: {len(walls)} entries for {len(traces)} traces")
    if names is not None and len(names) != len(traces):
        raise FitError(f"names: {len(names)} entries for {len(traces)} traces")
    # Overlapped traces beside serial ones that carry `dev` price one thing only: what the
    # idle device of a serial window waits for its submission (host.submit_s), by the same
    # shapes' windows queued behind the one before. Every other part comes from the serial
    # traces, whose windows and host gaps are priced one by one. Overlapped traces alone are
    # fitted as before (their windows' `dur` is then the decode tables').
    queued = [i for i, ev in enumerate(traces) if (_config_event(ev).get("engine") or {}).get("overlap")]
    serial_dev = any("dev" in e for i, ev in enumerate(traces) if i not in queued
                     for e in ev if e["ev"] == "window")
    overlapped: list[list[dict[str, Any]]] = []
    if queued and serial_dev:
        keep = [i for i in range(len(traces)) if i not in queued]
        overlapped = [traces[i] for i in queued]
        traces = [traces[i] for i in keep]
        walls = None if walls is None else [walls[i] for i in keep]
        names = None if names is None else [names[i] for i in keep]
    decode: dict[str, dict[tuple[float, float], list[float]]] = {a: defaultdict(list)
                                                                 for a in GRAPH_ACTIONS}
    shaped: dict[str, dict[tuple[float, str], list[float]]] = {a: defaultdict(list)
                                                               for a in GRAPH_ACTIONS}
    # Prompt-chunk samples by how the engine ran them (graphs or eagerly): the profile's table
    # comes from graph chunks when any trace has them, since graphs are what predictions run.
    prefill_by: dict[bool, dict[float, list[float]]] = {True: defaultdict(list),
                                                        False: defaultdict(list)}
    tiered_by: dict[bool, dict[tuple[float, float], list[float]]] = {True: defaultdict(list),
                                                                     False: defaultdict(list)}
    untiered = {True: False, False: False}
    host: list[HostSample] = []
    commits: list[dict[str, Any]] = []
    n_traces = 0
    # Per trace: window samples (action, tier, rows, shape, seconds, right after a prompt
    # chunk), prompt chunks
    # (graph chunks, tokens, tier, seconds) and host gaps, kept apart until each trace's
    # speed is known.
    win_by: dict[int, list[tuple[str, float, float, str, float, bool]]] = {}
    pre_by: dict[int, list[tuple[bool, float, Optional[float], float]]] = {}
    host_by: dict[int, list[HostSample]] = {}
    slots_by: dict[int, Optional[int]] = {}
    # Serial traces whose windows carry `dev` (their device seconds by CUDA events) split each
    # window's `dur`, the host's wall of the whole call: the decode tables take `dev`, and the
    # rest, the window's own host share, is host.launch_s, which engine.overlap hides. Only when
    # every window has it: tables of mixed meanings would price nothing right.
    split = all("dev" in e for events in traces for e in events
                if e["ev"] == "window" and "dur" in e and "ctx" in e)
    launch: list[float] = []
    for n, events in enumerate(traces):
        n_traces += 1
        cfg = _config_event(events)
        slots_by[n] = trace_slots(cfg)
        knobs = cfg.get("engine") or {}
        graph_chunks = _graph_prefills(cfg)
        win_by[n], pre_by[n] = [], []
        chunk_steps = {e["step"] for e in events if e["ev"] == "prefill" and "dur" in e}
        for e in events:
            if e["ev"] == "window" and "dur" in e and "ctx" in e:
                g, r = window_shape(e)
                device = float(e["dev"] if split else e["dur"])
                win_by[n].append((e["graph"], float(e["ctx"]), float(e["rows"]), f"{g}x{r}",
                                  device, e["step"] - 1 in chunk_steps))
                if split and e["graph"] == "hit":
                    launch.append(max(0.0, float(e["dur"]) - device))
            elif e["ev"] == "prefill" and "dur" in e and e.get("segments", 1) == 1:
                # (a chunk of several slots, engine.prefill_slots, is not a chunk of its own
                # tokens: its events carry the whole chunk's time, so they stay out of the fit)
                tokens, tier = _prefill_key(e, knobs)
                pre_by[n].append((graph_chunks, tokens, tier, float(e["dur"])))
            elif e["ev"] == "commit":
                # The Markov chain is per request: keep requests of different traces apart.
                commits.append({**e, "req": (n, e["req"])})
        host_by[n] = _host_samples(events)
    # A window right after a prompt chunk runs 5-15% slower than the same shape otherwise
    # (H200, every shape): those are kept out of the speed judging, where a run whose shared
    # cells are mostly its ramp-up windows would look slow throughout.
    judged: dict[str, set[int]] = {"window": set(), "prefill": set(), "host": set()}
    win_groups: dict[int, int] = {}
    win_speed = _trace_speeds({n: [((a, t, sh), d) for a, t, _, sh, d, after in xs if not after]
                               for n, xs in win_by.items()}, judged["window"], win_groups)
    # A run's window speed includes its engine's slot count's (sim.slot_speeds): each
    # sample is brought to the runs' average speed, the slot count's share kept apart.
    slot_fit = fit_slot_scale(win_speed, win_groups, slots_by)
    pre_speed = _trace_speeds({n: [((gc, tok, t), d) for gc, tok, t, d in xs]
                               for n, xs in pre_by.items()}, judged["prefill"])
    host_speed = _trace_speeds({n: [((c, f, a, p), g) for c, f, a, p, g in xs]
                                for n, xs in host_by.items()}, judged["host"])
    after_chunk: dict[str, dict[tuple[float, Any], list[float]]] = {
        a: defaultdict(list) for a in GRAPH_ACTIONS}  # ... and out of a cell with enough others
    after_rows: dict[str, dict[tuple[float, float], list[float]]] = {
        a: defaultdict(list) for a in GRAPH_ACTIONS}
    for n in win_by:
        for a, tier, r, sh, dur, after in win_by[n]:
            (after_rows if after else decode)[a][(tier, r)].append(dur / slot_fit.divisor[n])
            (after_chunk if after else shaped)[a][(tier, sh)].append(dur / slot_fit.divisor[n])
        for gc, tokens, tier, dur in pre_by[n]:
            prefill_by[gc][tokens].append(dur / pre_speed[n])
            if tier is None:
                untiered[gc] = True
            else:
                tiered_by[gc][(tier, tokens)].append(dur / pre_speed[n])
        host.extend((c, f, a, p, g / host_speed[n]) for c, f, a, p, g in host_by[n])
    for plain, extra in ((decode, after_rows), (shaped, after_chunk)):
        for a in GRAPH_ACTIONS:
            for k, v in extra[a].items():
                if len(plain[a].get(k, ())) < MEDIAN_MIN_SAMPLES:
                    plain[a][k].extend(v)
    if not any(decode.values()):
        raise FitError("no window event with `dur` and `ctx` in the traces: nothing to fit")
    kind = bool(prefill_by[True])  # graph chunks if any trace ran them
    prefill, prefill_tiered = prefill_by[kind], tiered_by[kind]
    all_tiered = not untiered[kind]
    if not prefill:
        raise FitError("no prefill event with `dur` in the traces: nothing to fit")

    tiers = sorted({t for cells in decode.values() for t, _ in cells})
    rows = sorted({r for cells in decode.values() for _, r in cells})
    medians = {a: {k: _cell(v) for k, v in decode[a].items()} for a in GRAPH_ACTIONS}
    tables = {a: _fill_table(medians[a], tiers, rows) for a in GRAPH_ACTIONS}
    filled_from = {}
    for a in GRAPH_ACTIONS:
        if tables[a] is None:
            donor = next(d for d in FALLBACK_ACTIONS[a] if tables[d] is not None)
            tables[a] = [list(r) for r in tables[donor]]
            filled_from[a] = donor
    counts = {a: [[len(decode[a].get((t, r), ())) for r in rows] for t in tiers]
              for a in GRAPH_ACTIONS}

    def shape_order(name: str) -> tuple[int, int]:
        n_, _, g_ = name.partition("x")
        return int(n_) * int(g_), int(n_)

    shapes = sorted({sh for cells in shaped.values() for _, sh in cells}, key=shape_order)
    shape_cells = {a: {k: _cell(v) for k, v in shaped[a].items()} for a in GRAPH_ACTIONS}
    for a in GRAPH_ACTIONS:
        # A shape measured steadily at some tier: its cells of a few samples at other tiers
        # (a run's transitional windows: ramp-up, drain) are filled from the steady tier by
        # the tiers' ratio instead (the issue-21 calibration's 1x4@512, 6 samples from three
        # runs' tails: 584 us, where steady runs measured 502-510).
        steady = {sh for (_, sh), v in shaped[a].items() if len(v) >= SPARSE_CELL_SAMPLES}
        for (t, sh), v in shaped[a].items():
            if len(v) < SPARSE_CELL_SAMPLES and sh in steady:
                del shape_cells[a][(t, sh)]
    shape_s, _ = _fill_shapes(shape_cells, tiers, shapes)
    shape_counts = {a: [[len(shaped[a].get((t, sh), ())) for sh in shapes] for t in tiers]
                    for a in GRAPH_ACTIONS}

    tokens = sorted(prefill)
    pre_tiers = pre_table = None
    if all_tiered and prefill_tiered:
        pre_tiers = sorted({t for t, _ in prefill_tiered})
        pre_cells = {k: _cell(v) for k, v in prefill_tiered.items()}
        pre_table = _fill_grid(pre_cells, pre_tiers, tokens)
    acc = fit_acceptance(commits)
    h_fixed, h_commit, h_admit, h_burst, h_prefill, h_finish = fit_host(host)
    twin = None
    if walls is not None:
        twin = untraced_host_factor(
            [(ev, float(w[0]), None if w[1] is None else float(w[1])) if w is not None
             else (ev, 0.0, None) for ev, w in zip(traces, walls)],
            names if names is not None else [str(i) for i in range(len(traces))])
        if twin["factor"] is not None:
            h_fixed, h_commit, h_admit, h_burst, h_prefill, h_finish = (
                h * twin["factor"] for h in (h_fixed, h_commit, h_admit, h_burst, h_prefill,
                                             h_finish))
    src = {**(source or {}), "kind": "fitted", "traces": n_traces,
           "counts": counts, "shape_counts": shape_counts,
           "prefill_counts": [len(prefill[t]) for t in tokens],
           "prefill_from": "graphs" if kind else "eager",
           "prefill_eager_left_out": sum(len(v) for v in prefill_by[False].values()) if kind else 0,
           "host_overhead_samples": len(host), "actions_copied": filled_from,
           "launch_samples": len(launch),
           # (window speeds with the slot count's share out: sim.slot_speeds)
           "trace_speeds": {"window": [round(slot_fit.residual[n], 4)
                                       for n in sorted(win_speed)],
                            "prefill": [round(pre_speed[n], 4) for n in sorted(pre_speed)],
                            "host": [round(host_speed[n], 4) for n in sorted(host_speed)]},
           # which of those factors were judged (the others are 1 for want of shared cells)
           "trace_speeds_judged": {k: [n in judged[k] for n in sorted(win_speed)]
                                   for k in judged}}
    if slot_fit.scale:
        src["slot_scale"] = {**slot_fit.as_profile_field(),
                             "trace_slots": [slots_by[n] for n in sorted(slots_by)]}
    if twin is not None:
        src["untraced_host"] = {**twin, "factor": None if twin["factor"] is None
                                else round(twin["factor"], 4)}
    if pre_table is not None:
        src["prefill_table_counts"] = [[len(prefill_tiered.get((t, b), ())) for b in tokens]
                                       for t in pre_tiers]
    submit = _fit_submit(traces, overlapped, slot_fit.divisor) if overlapped else None
    shape_submit = None
    if submit is not None:
        src["submit"] = {k: v for k, v in submit.items() if k not in ("s", "by_shape")}
        shape_submit = _shape_submits(submit["by_shape"], shapes, submit["s"])
    return CostProfile(
        host_submit_s=submit["s"] if submit else 0.0, decode_shape_submit_s=shape_submit,
        host_overhead_s=h_fixed, host_per_commit_s=h_commit, host_per_admit_s=h_admit,
        host_per_admit_burst_s=h_burst, host_after_prefill_s=h_prefill,
        host_per_finish_s=h_finish, host_launch_s=_median(launch) if launch else 0.0,
        prefill_tokens=tokens, prefill_s=[_cell(prefill[t]) for t in tokens],
        decode_rows=rows, decode_tiers=tiers, decode_s=tables,
        acceptance=acc.as_dict() if acc.judged else None, source=src,
        prefill_tiers=pre_tiers, prefill_table=pre_table,
        decode_shapes=shapes, decode_shape_s=shape_s,
        decode_slot_scale=slot_fit.as_profile_field())


def fit_profile_files(paths: Iterable[str | Path],
                      source: Optional[dict[str, Any]] = None,
                      walls: Optional[list[Optional[tuple[float, Optional[float]]]]] = None
                      ) -> CostProfile:
    """fit_profile of trace files (each named by its directory in the twins' record)."""
    paths = [Path(p) for p in paths]
    traces = [load_trace(p)[0] for p in paths]
    return fit_profile(traces, {**(source or {}), "files": [str(p) for p in paths]}, walls,
                       [p.parent.name for p in paths])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.profile", description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="engine trace.jsonl files")
    ap.add_argument("--out", required=True, help="cost profile JSON to write")
    args = ap.parse_args(argv)
    try:
        prof = fit_profile_files(args.traces)
    except (TraceError, FitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prof.save(args.out)
    print(f"wrote {args.out}: {len(prof.decode_rows)} row counts x {len(prof.decode_tiers)} "
          f"tiers, {len(prof.prefill_tokens)} prefill sizes, host {prof.host_overhead_s:.6f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
