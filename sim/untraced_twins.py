"""Untraced twins: how much of a traced run's host time an engine as served spends.

`python -m sim calibrate` (twins=1, the default on CUDA) runs each grid cell's prompts a second
time on the same engine with its trace stopped. A traced run's wall is its device time D (the
`dur` of its windows and prompt chunks), the trace's own recorded time T (its last `trace_s`)
and the host gaps the fit prices, wall - D - T; as served, the same host work takes untraced
wall - D. The factor is the pooled ratio sum(untraced - D) / sum(traced - D - T) over the runs
(each weighted by its host time): one factor for all, because the fit's speed polish centres
per-run host speeds on their mean anyway, and on the H200 one pooled factor predicted held-out
cells' walls within ~1% (docs/SIMULATOR.md).

A run is left out of the pool, with its reason recorded, when it tells nothing sound about its
host: it has no twin (twins=0, or the runner returned none); its twin took longer than the
traced run itself (a trace only adds work, so the twin was disturbed: a collection, the
machine's slow stretch); or its walls are not above its device time. With no run left the
factor is None and the host parts stay as traced. A pooled factor above 1 (twins slower than
the traced runs less their writer's time) is capped at 1: serving never adds host work.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

#: Why a run is left out of the pool (`left_out` values).
NO_TWIN = "no untraced twin"
SLOWER_TWIN = "its untraced twin took longer than its traced run (disturbed)"
NO_HOST = "its traced wall is not above its device and trace time"
NO_SERVED_HOST = "its untraced wall is not above its device time"


def run_parts(events: list[dict[str, Any]]) -> tuple[float, float]:
    """(device seconds, the trace writer's own seconds) of one traced run's events."""
    device = sum(float(e["dur"]) for e in events
                 if e.get("ev") in ("window", "prefill") and "dur" in e)
    spent = max((float(e.get("trace_s") or 0.0) for e in events), default=0.0)
    return device, spent


def untraced_host_factor(runs: Sequence[tuple[list[dict[str, Any]], float, Optional[float]]],
                         names: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """From (trace events, traced wall s, untraced wall s or None) per run: {"factor" (None
    when no run is usable), "runs" (how many were pooled), "per_run" (each run's own ratio,
    None if left out), "left_out" ({run name: reason}), "note" (what was capped, or "")}.
    `names` name the runs in `left_out` (default: their index)."""
    names = list(names) if names is not None else [str(i) for i in range(len(runs))]
    if len(names) != len(runs):
        raise ValueError(f"untraced twins: {len(names)} names for {len(runs)} runs")
    per_run: list[Optional[float]] = []
    left_out: dict[str, str] = {}
    num = den = 0.0
    for name, (events, traced, untraced) in zip(names, runs):
        device, spent = run_parts(events)
        host = traced - device - spent
        reason = (NO_TWIN if untraced is None else SLOWER_TWIN if untraced > traced
                  else NO_HOST if host <= 0 else NO_SERVED_HOST if untraced - device <= 0
                  else None)
        if reason is not None:
            per_run.append(None)
            left_out[name] = reason
            continue
        served = untraced - device
        per_run.append(round(served / host, 4))
        num, den = num + served, den + host
    factor, note = (num / den if den > 0 else None), ""
    if factor is not None and factor > 1:
        note = f"pooled factor {factor:.3f} above 1 capped at 1"
        factor = 1.0
    return {"factor": factor, "runs": sum(f is not None for f in per_run), "per_run": per_run,
            "left_out": left_out, "note": note}


def summary(result: dict[str, Any]) -> str:
    """One line for a log: the factor and what was left out."""
    total = len(result["per_run"])
    if result["factor"] is None:
        head = f"no usable untraced twin in {total} runs: host parts priced as traced"
    else:
        head = (f"host parts x {result['factor']:.3f}, pooled from {result['runs']} of {total} "
                "runs' untraced twins")
    notes = [f"{name}: {why}" for name, why in result["left_out"].items()]
    if result["note"]:
        notes.append(result["note"])
    return head + (f" ({'; '.join(notes)})" if notes else "")
