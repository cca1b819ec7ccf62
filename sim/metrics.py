"""outputs.jsonl and metrics.json of a simulated run (docs/SCHEDULING.md, last section).

The request metrics (PP, TG, E2E, TTFT, aggregate) are strata.metrics' definitions, the same
the engine, the benchmarks and the server use; this module maps a simulated request's record
onto them and adds the simulator's own facts.
"""

from __future__ import annotations

from typing import Any, Optional

from strata.metrics import RequestTimes, aggregate, ratio, request_metrics

from .scheduler import RequestRecord
from .simulation import SimRun
from .spread import range_rows


def request_times(rec: RequestRecord) -> RequestTimes:
    return RequestTimes(rec.req.id, rec.req.prompt_tokens, rec.tokens, rec.arrive_s,
                        rec.admit_s, rec.first_token_s, rec.last_token_s, rec.finish_s,
                        rec.prefill_device_s, 1, rec.drafted, rec.accepted, rec.reason)


def outputs_lines(run: SimRun) -> list[dict[str, Any]]:
    """One line per request in input order (the simulator has no text or token ids)."""
    recs = sorted(run.records.values(), key=lambda r: r.req.index)
    return [{"id": r.req.id, "text": None, "token_ids": None, "finish_reason": r.reason,
             "prompt_tokens": r.req.prompt_tokens, "output_tokens": r.tokens} for r in recs]


def run_metrics(run: SimRun) -> dict[str, Any]:
    recs = sorted(run.records.values(), key=lambda r: r.req.index)
    times = [request_times(r) for r in recs]
    agg = aggregate(times)
    st = run.stats
    cache_on = run.experts is not None and run.experts.cache_on
    return {
        "wall_s": run.end_s,
        "output_tokens": agg["output_tokens"],
        "aggregate_tps": agg["aggregate_tps"],
        "acceptance": ratio(sum(r.accepted for r in recs), sum(r.drafted for r in recs)),
        "windows": run.stats.windows,
        "prefills": run.stats.prefills,
        "graph": dict(run.stats.graph),
        # hits / (hits + misses) over the decode windows; null when the cache is off.
        "expert_hit_rate": (ratio(st.expert_hits, st.expert_hits + st.expert_misses)
                            if cache_on else None),
        "ttft_s": agg["ttft_s"],
        "e2e_s": agg["e2e_s"],
        "requests": [request_metrics(t) for t in times],
        # The simulator's own facts (the engine's metrics.json has no such key).
        "sim": {
            "steps": run.steps,
            "idle_steps": run.stats.idle,
            "distinct_graph_keys": len(run.cache.keys_seen),
            "graphs_held": len(run.cache),
            "graphs_mib": run.cache.held_mib,
            "captures": run.cache.captures,
            "crashed_at_step": run.stats.crashed_at_step,
            "expert_hits": st.expert_hits,
            "expert_misses": st.expert_misses,
            "expert_swaps": st.expert_swaps,
            # window shapes whose depth the profile never measured (priced by extrapolation)
            "extrapolated_shapes": sorted(run.stats.extrapolated_shapes),
        },
    }


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def metrics_table(m: dict[str, Any]) -> str:
    g = m["graph"]
    rows = [
        ("output tokens", str(m["output_tokens"])),
        ("wall (simulated s)", _fmt(m["wall_s"])),
        ("aggregate tok/s", _fmt(m["aggregate_tps"], ".1f")),
        ("acceptance", _fmt(m["acceptance"])
         + ("" if not m.get("acceptance_range") else
            f" (workload's mean from a few requests: {_fmt(m['acceptance_range'][0])} .. "
            f"{_fmt(m['acceptance_range'][1])})")),
        ("TTFT p50 / p95 (s)", f"{_fmt(m['ttft_s']['p50'])} / {_fmt(m['ttft_s']['p95'])}"),
        ("E2E p50 / p95 (s)", f"{_fmt(m['e2e_s']['p50'])} / {_fmt(m['e2e_s']['p95'])}"),
        ("windows / prefills", f"{m['windows']} / {m['prefills']}"),
        ("graphs hit/capture/eager/evict",
         f"{g['hit']} / {g['capture']} / {g['eager']} / {g['evict']}"),
        ("distinct graph keys", str(m["sim"]["distinct_graph_keys"])),
    ]
    if m.get("expert_hit_rate") is not None:
        rows.append(("expert hit rate", _fmt(m["expert_hit_rate"])))
    if m.get("range"):
        rows[3:3] = range_rows(m["range"])
    if m["sim"].get("extrapolated_shapes"):
        rows.append(("window shapes past the profile's depths",
                     ", ".join(m["sim"]["extrapolated_shapes"])
                     + " (priced along their depth from measured shapes)"))
    if m["sim"]["crashed_at_step"] is not None:
        rows.append(("ENGINE EXIT (upstream OOM) at step", str(m["sim"]["crashed_at_step"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


#: The figures a prediction is judged on (DESIGN.md section 6): (label, path in metrics.json).
COMPARED_FIGURES = (("aggregate tok/s", ("aggregate_tps",)),
                    ("TTFT p50 (s)", ("ttft_s", "p50")), ("TTFT p95 (s)", ("ttft_s", "p95")),
                    ("E2E p50 (s)", ("e2e_s", "p50")), ("E2E p95 (s)", ("e2e_s", "p95")),
                    ("acceptance", ("acceptance",)))


def compare_metrics(engine: dict[str, Any], sim: dict[str, Any]) -> list[tuple[str, Any, Any, Optional[float]]]:
    """(figure, engine value, simulated value, relative error) for each compared figure."""
    rows = []
    for label, path in COMPARED_FIGURES:
        e, s = engine, sim
        for k in path:
            e = e.get(k) if isinstance(e, dict) else None
            s = s.get(k) if isinstance(s, dict) else None
        err = (s - e) / e if isinstance(e, (int, float)) and isinstance(s, (int, float)) and e else None
        rows.append((label, e, s, err))
    return rows


def comparison_table(rows: list[tuple[str, Any, Any, Optional[float]]]) -> str:
    width = max(len(r[0]) for r in rows)
    out = [f"{'figure':<{width}}  {'engine':>10}  {'sim':>10}  {'error':>8}"]
    for label, e, s, err in rows:
        out.append(f"{label:<{width}}  {_fmt(e):>10}  {_fmt(s):>10}  "
                   f"{'-' if err is None else format(err, '+.1%'):>8}")
    return "\n".join(out)
