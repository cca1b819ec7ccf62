"""outputs.jsonl and metrics.json of a simulated run (docs/SCHEDULING.md, last section).

Definitions (DESIGN.md section 7): PP = prompt tokens / that request's prefill device time;
TG = (output tokens - 1) / (last token time - first token time); E2E = output tokens /
(finish time - arrival time); aggregate = all output tokens / time from the first arrival to
the last finish. Percentiles are numpy's default (linear interpolation).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .scheduler import RequestRecord
from .simulation import SimRun
from .spread import range_rows

PERCENTILES = {"p50": 50, "p95": 95}


def _div(num: float, den: Optional[float]) -> Optional[float]:
    return num / den if den else None


def _pcts(values: list[float]) -> dict[str, Optional[float]]:
    if not values:
        return {k: None for k in PERCENTILES}
    return {k: float(np.percentile(values, q)) for k, q in PERCENTILES.items()}


def _span(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else b - a


def request_metrics(rec: RequestRecord) -> dict[str, Any]:
    out = rec.tokens
    return {
        "id": rec.req.id,
        "prompt_tokens": rec.req.prompt_tokens,
        "output_tokens": out,
        "queue_s": _span(rec.arrive_s, rec.admit_s),
        "ttft_s": _span(rec.arrive_s, rec.first_token_s),
        "e2e_s": _span(rec.arrive_s, rec.finish_s),
        "pp_tps": _div(rec.req.prompt_tokens, rec.prefill_device_s)
        if rec.first_token_s is not None else None,
        "tg_tps": _div(out - 1, _span(rec.first_token_s, rec.last_token_s)) if out > 1 else None,
        "e2e_tps": _div(out, _span(rec.arrive_s, rec.finish_s)),
        "finish_reason": rec.reason,
    }


def outputs_lines(run: SimRun) -> list[dict[str, Any]]:
    """One line per request in input order (the simulator has no text or token ids)."""
    recs = sorted(run.records.values(), key=lambda r: r.req.index)
    return [{"id": r.req.id, "text": None, "token_ids": None, "finish_reason": r.reason,
             "prompt_tokens": r.req.prompt_tokens, "output_tokens": r.tokens} for r in recs]


def run_metrics(run: SimRun) -> dict[str, Any]:
    recs = sorted(run.records.values(), key=lambda r: r.req.index)
    per_request = [request_metrics(r) for r in recs]
    output_tokens = sum(r.tokens for r in recs)
    arrivals = [r.arrive_s for r in recs if r.arrive_s is not None]
    finishes = [r.finish_s for r in recs if r.finish_s is not None]
    span = (max(finishes) - min(arrivals)) if arrivals and finishes else None
    drafted = sum(r.drafted for r in recs)
    accepted = sum(r.accepted for r in recs)
    return {
        "wall_s": run.end_s,
        "output_tokens": output_tokens,
        "aggregate_tps": _div(output_tokens, span),
        "acceptance": _div(accepted, drafted),
        "windows": run.stats.windows,
        "prefills": run.stats.prefills,
        "graph": dict(run.stats.graph),
        "ttft_s": _pcts([m["ttft_s"] for m in per_request if m["ttft_s"] is not None]),
        "e2e_s": _pcts([m["e2e_s"] for m in per_request if m["e2e_s"] is not None]),
        "requests": per_request,
        # The simulator's own facts (the engine's metrics.json has no such key).
        "sim": {
            "steps": run.steps,
            "idle_steps": run.stats.idle,
            "distinct_graph_keys": len(run.cache.keys_seen),
            "graphs_held": len(run.cache),
            "graphs_mib": run.cache.held_mib,
            "captures": run.cache.captures,
            "crashed_at_step": run.stats.crashed_at_step,
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
        ("acceptance", _fmt(m["acceptance"])),
        ("TTFT p50 / p95 (s)", f"{_fmt(m['ttft_s']['p50'])} / {_fmt(m['ttft_s']['p95'])}"),
        ("E2E p50 / p95 (s)", f"{_fmt(m['e2e_s']['p50'])} / {_fmt(m['e2e_s']['p95'])}"),
        ("windows / prefills", f"{m['windows']} / {m['prefills']}"),
        ("graphs hit/capture/eager/evict",
         f"{g['hit']} / {g['capture']} / {g['eager']} / {g['evict']}"),
        ("distinct graph keys", str(m["sim"]["distinct_graph_keys"])),
    ]
    if m.get("range"):
        rows[3:3] = range_rows(m["range"])
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
