"""Error bars of a prediction: the workload simulated again at the profile's fast and slow speeds.

A profile prices every cell at its runs' average speed (sim/profile.py divides each trace's
samples by the trace's speed factor and records the factors in `source.trace_speeds`: one per
trace for windows, prompt chunks and host gaps). Runs of one engine on one machine went at
speeds up to 30% apart in windows and 2x in host time, and another machine of the same kind
can run at yet another speed. So a prediction also reports a range:

- fast end: every window, prompt chunk and host gap at the low quantile of the profile's
  factors of its kind (spread.quantiles[0]), divided by 1 + spread.machine;
- slow end: at the high quantile, times 1 + spread.machine;
- with spread.profiles (more profiles of the same hardware: other machines or calls), the
  envelope over every profile's point and ends.

Each end is one more simulation of the same workload, with the same seed (same acceptance
draws), so a figure's range is where it lands when the machine runs that much faster or slower
throughout. A profile without `trace_speeds` (one run, or hand-written) has factor 1 at both
quantiles: its range is spread.machine alone. Where the profile says which runs the fit could
judge (`trace_speeds_judged`), only theirs count.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import numpy as np

from .costs import GRAPH_ACTIONS, CostProfile

#: The cost kinds a speed factor applies to (the keys of source.trace_speeds).
KINDS = ("window", "prefill", "host")
#: Figures of metrics.json that get a range: (name in `range`, path in metrics.json).
RANGED = (("aggregate_tps", ("aggregate_tps",)), ("wall_s", ("wall_s",)),
          ("ttft_s.p50", ("ttft_s", "p50")), ("ttft_s.p95", ("ttft_s", "p95")),
          ("e2e_s.p50", ("e2e_s", "p50")), ("e2e_s.p95", ("e2e_s", "p95")))


def speed_quantiles(profile: CostProfile, quantiles: list[float]) -> dict[str, tuple[float, float]]:
    """Per kind, the (low, high) quantiles of the profile's per-run speed factors (1, 1 when
    the profile records none)."""
    speeds = (profile.source or {}).get("trace_speeds") or {}
    judged = (profile.source or {}).get("trace_speeds_judged") or {}
    out = {}
    for kind in KINDS:
        xs = [float(x) for x in speeds.get(kind) or [] if float(x) > 0]
        flags = judged.get(kind)
        if flags is not None and len(flags) == len(xs):
            # Only judged runs say how fast a run may go: an unjudged one's factor is 1 for
            # want of shared cells, and a profile of mostly unjudged runs would report a
            # range as narrow as its few judged ones make it.
            xs = [x for x, j in zip(xs, flags) if j]
        if len(xs) < 2:
            out[kind] = (1.0, 1.0)
        else:
            lo, hi = np.quantile(xs, [quantiles[0], quantiles[1]])
            out[kind] = (float(lo), float(hi))
    return out


def scaled(profile: CostProfile, window: float, prefill: float, host: float) -> CostProfile:
    """A copy of `profile` whose windows, prompt chunks and host parts take that many times
    as long."""
    p = copy.deepcopy(profile)
    p.decode_s = {a: [[x * window for x in row] for row in p.decode_s[a]] for a in GRAPH_ACTIONS}
    if p.decode_shape_s is not None:
        p.decode_shape_s = {a: [[x * window for x in row] for row in p.decode_shape_s[a]]
                            for a in GRAPH_ACTIONS}
    p.prefill_s = [x * prefill for x in p.prefill_s]
    if p.prefill_table is not None:
        p.prefill_table = [[x * prefill for x in row] for row in p.prefill_table]
    for name in ("host_overhead_s", "host_per_commit_s", "host_per_admit_s",
                 "host_per_admit_burst_s", "host_after_prefill_s", "host_per_finish_s",
                 "host_launch_s", "host_submit_s"):
        setattr(p, name, getattr(p, name) * host)
    if p.decode_shape_submit_s is not None:
        p.decode_shape_submit_s = [x * host for x in p.decode_shape_submit_s]
    p.source = {**p.source, "scaled": {"window": window, "prefill": prefill, "host": host}}
    return p


def end_factors(profile: CostProfile, quantiles: list[float],
                machine: float) -> dict[str, dict[str, float]]:
    """{"fast": {kind: factor}, "slow": {kind: factor}} for `profile`."""
    q = speed_quantiles(profile, quantiles)
    return {"fast": {k: q[k][0] / (1.0 + machine) for k in KINDS},
            "slow": {k: q[k][1] * (1.0 + machine) for k in KINDS}}


def _get(m: dict[str, Any], path: tuple[str, ...]) -> Optional[float]:
    for k in path:
        m = m.get(k) if isinstance(m, dict) else None
    return m if isinstance(m, (int, float)) else None


def prediction_range(spread: Any, profiles: list[tuple[str, CostProfile]],
                     point: dict[str, Any],
                     simulate_with: Callable[[CostProfile], dict[str, Any]]) -> dict[str, Any]:
    """The `range` section of metrics.json: for every RANGED figure [low, high] over the
    point prediction and each profile's fast and slow end (`simulate_with(profile)` returns
    the metrics of the workload simulated with that profile), plus how each end was priced."""
    runs = []
    for i, (name, prof) in enumerate(profiles):
        ends = end_factors(prof, list(spread.quantiles), float(spread.machine))
        if i > 0:  # another profile: its own point too
            ends = {"point": {k: 1.0 for k in KINDS}, **ends}
        for end, f in ends.items():
            if i == 0 and all(v == 1.0 for v in f.values()):
                m = point  # the point itself: no spread to price
            else:
                m = simulate_with(scaled(prof, f["window"], f["prefill"], f["host"]))
            runs.append({"profile": name, "end": end, "factors": {k: round(v, 4) for k, v in f.items()},
                         **{fig: _get(m, path) for fig, path in RANGED}})
    out: dict[str, Any] = {"quantiles": list(spread.quantiles), "machine": float(spread.machine)}
    for fig, path in RANGED:
        vals = [v for v in [_get(point, path)] + [r[fig] for r in runs] if v is not None]
        out[fig] = [min(vals), max(vals)] if vals else None
    out["runs"] = runs
    return out


def range_rows(rng: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows for the printed metrics table."""
    def fmt(fig: str, spec: str) -> str:
        v = rng.get(fig)
        return "-" if v is None else f"{format(v[0], spec)} .. {format(v[1], spec)}"

    q = rng["quantiles"]
    label = f"p{q[0] * 100:g}-p{q[1] * 100:g} of runs" + (
        f", machines +-{rng['machine']:.0%}" if rng["machine"] else "")
    return [(f"aggregate tok/s range ({label})", fmt("aggregate_tps", ".1f")),
            ("TTFT p50 range (s)", fmt("ttft_s.p50", ".3f")),
            ("E2E p50 range (s)", fmt("e2e_s.p50", ".3f"))]
