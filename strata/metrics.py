"""Run metrics the way upstream users measure (DESIGN.md section 7) and the printed table."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np


def _pct(values: list[float]) -> dict[str, Optional[float]]:
    if not values:
        return {"p50": None, "p95": None}
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))}


def _ratio(a: float, b: Optional[float]) -> Optional[float]:
    return a / b if b else None


def request_metrics(rs) -> dict[str, Any]:
    out = len(rs.emitted)
    e2e = (rs.t_finish - rs.t_arrive) if rs.t_finish is not None and rs.t_arrive is not None else None
    ttft = (rs.t_first - rs.t_arrive) if rs.t_first is not None and rs.t_arrive is not None else None
    tg_span = (rs.t_last - rs.t_first) if rs.t_last is not None and rs.t_first is not None else None
    return {
        "id": rs.id, "prompt_tokens": rs.prompt_len, "output_tokens": out,
        "queue_s": (rs.t_admit - rs.t_arrive) if rs.t_admit is not None and rs.t_arrive is not None else None,
        "ttft_s": ttft, "e2e_s": e2e,
        "pp_tps": _ratio(rs.prompt_len, rs.prefill_s),
        "tg_tps": _ratio(out - 1, tg_span) if out > 1 else None,
        "e2e_tps": _ratio(out, e2e),
        "drafted": rs.drafted, "accepted": rs.accepted,
        "finish_reason": rs.reason,
    }


def run_metrics(states: Iterable, stats: dict[str, Any]) -> dict[str, Any]:
    states = list(states)
    reqs = [request_metrics(rs) for rs in states]
    arrivals = [rs.t_arrive for rs in states if rs.t_arrive is not None]
    finishes = [rs.t_finish for rs in states if rs.t_finish is not None]
    wall = (max(finishes) - min(arrivals)) if arrivals and finishes else 0.0
    total = sum(r["output_tokens"] for r in reqs)
    return {
        "wall_s": wall, "output_tokens": total, "aggregate_tps": _ratio(total, wall),
        "acceptance": _ratio(stats["accepted"], stats["drafted"]),
        "windows": stats["windows"], "prefills": stats["prefills"],
        "graph": {"hit": stats["graph_hits"], "capture": stats["graph_captures"],
                  "eager": stats["graph_eager"], "evict": stats["graph_evictions"]},
        "ttft_s": _pct([r["ttft_s"] for r in reqs if r["ttft_s"] is not None]),
        "e2e_s": _pct([r["e2e_s"] for r in reqs if r["e2e_s"] is not None]),
        "requests": reqs,
    }


def _f(v: Optional[float], nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def format_table(m: dict[str, Any]) -> str:
    head = f"{'request':<12} {'prompt':>6} {'out':>5} {'PP t/s':>9} {'TG t/s':>9} {'E2E t/s':>9} {'TTFT s':>8} {'accept':>7}  finish"
    lines = [head, "-" * len(head)]
    for r in m["requests"]:
        acc = _ratio(r["accepted"], r["drafted"])
        lines.append(f"{r['id'][:12]:<12} {r['prompt_tokens']:>6} {r['output_tokens']:>5} "
                     f"{_f(r['pp_tps']):>9} {_f(r['tg_tps']):>9} {_f(r['e2e_tps']):>9} "
                     f"{_f(r['ttft_s'], 3):>8} {_f(acc, 2):>7}  {r['finish_reason']}")
    g = m["graph"]
    lines.append("-" * len(head))
    lines.append(f"aggregate {_f(m['aggregate_tps'])} tokens/s over {m['wall_s']:.3f} s, "
                 f"{m['output_tokens']} tokens; acceptance {_f(m['acceptance'], 3)}; "
                 f"windows {m['windows']} (graph hit {g['hit']}, capture {g['capture']}, "
                 f"eager {g['eager']}, evict {g['evict']}); prefills {m['prefills']}")
    return "\n".join(lines)
