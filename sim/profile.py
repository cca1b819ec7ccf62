"""Fit a cost profile from engine traces.

From each trace: `window` events give (rows, `ctx` tier, graph action, `dur` seconds);
`prefill` events give (tokens, `dur`); consecutive iterations that both ran device work give
the host overhead (the time between their events minus the later one's `dur`); `commit` events
give the acceptance models (sim.acceptance.fit_acceptance).

Each measured cell is the median of its samples. Gaps in the grid are filled so every query
has an answer: within a tier, unmeasured row counts interpolate linearly between measured ones
(constant past the ends); a tier with no sample copies the nearest measured tier (in log2);
an action with no sample at all copies another action's table (FALLBACK_ACTIONS). The profile's
`source.counts` records the samples behind every cell, so filled cells can be told apart.

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

from .acceptance import fit_acceptance
from .costs import GRAPH_ACTIONS, CostProfile
from .replay import TraceError, load_trace

#: Where an action with no samples takes its table from, in order of preference.
FALLBACK_ACTIONS = {"hit": ("eager", "capture"), "eager": ("hit", "capture"),
                    "capture": ("eager", "hit")}


class FitError(ValueError):
    pass


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _host_overhead_samples(events: list[dict[str, Any]]) -> list[float]:
    device: dict[int, tuple[float, float]] = {}  # step -> (t, dur) of its device event
    for e in events:
        if e["ev"] in ("window", "prefill") and "dur" in e and e["step"] not in device:
            device[e["step"]] = (float(e["t"]), float(e["dur"]))
    out = []
    for step, (t, _) in device.items():
        nxt = device.get(step + 1)
        if nxt is not None:
            out.append(max(0.0, nxt[0] - t - nxt[1]))
    return out


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


def fit_profile(traces: Iterable[list[dict[str, Any]]],
                source: Optional[dict[str, Any]] = None) -> CostProfile:
    decode: dict[str, dict[tuple[float, float], list[float]]] = {a: defaultdict(list)
                                                                 for a in GRAPH_ACTIONS}
    prefill: dict[float, list[float]] = defaultdict(list)
    host: list[float] = []
    commits: list[dict[str, Any]] = []
    n_traces = 0
    for n, events in enumerate(traces):
        n_traces += 1
        for e in events:
            if e["ev"] == "window" and "dur" in e and "ctx" in e:
                decode[e["graph"]][(float(e["ctx"]), float(e["rows"]))].append(float(e["dur"]))
            elif e["ev"] == "prefill" and "dur" in e:
                prefill[float(e["tokens"])].append(float(e["dur"]))
            elif e["ev"] == "commit":
                # The Markov chain is per request: keep requests of different traces apart.
                commits.append({**e, "req": (n, e["req"])})
        host.extend(_host_overhead_samples(events))
    if not any(decode.values()):
        raise FitError("no window event with `dur` and `ctx` in the traces: nothing to fit")
    if not prefill:
        raise FitError("no prefill event with `dur` in the traces: nothing to fit")

    tiers = sorted({t for cells in decode.values() for t, _ in cells})
    rows = sorted({r for cells in decode.values() for _, r in cells})
    medians = {a: {k: _median(v) for k, v in decode[a].items()} for a in GRAPH_ACTIONS}
    tables = {a: _fill_table(medians[a], tiers, rows) for a in GRAPH_ACTIONS}
    filled_from = {}
    for a in GRAPH_ACTIONS:
        if tables[a] is None:
            donor = next(d for d in FALLBACK_ACTIONS[a] if tables[d] is not None)
            tables[a] = [list(r) for r in tables[donor]]
            filled_from[a] = donor
    counts = {a: [[len(decode[a].get((t, r), ())) for r in rows] for t in tiers]
              for a in GRAPH_ACTIONS}
    tokens = sorted(prefill)
    acc = fit_acceptance(commits)
    return CostProfile(
        host_overhead_s=_median(host) if host else 0.0,
        prefill_tokens=tokens, prefill_s=[_median(prefill[t]) for t in tokens],
        decode_rows=rows, decode_tiers=tiers, decode_s=tables,
        acceptance=acc.as_dict() if acc.judged else None,
        source={**(source or {}), "kind": "fitted", "traces": n_traces,
                "counts": counts, "prefill_counts": [len(prefill[t]) for t in tokens],
                "host_overhead_samples": len(host), "actions_copied": filled_from})


def fit_profile_files(paths: Iterable[str | Path],
                      source: Optional[dict[str, Any]] = None) -> CostProfile:
    paths = [Path(p) for p in paths]
    traces = [load_trace(p)[0] for p in paths]
    return fit_profile(traces, {**(source or {}), "files": [str(p) for p in paths]})


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
