"""Request metrics, defined once (DESIGN.md section 7), for the engine, the simulator, the
benchmarks and the server; and the printed table.

PP = prompt tokens / that request's prefill device time (once its first token came);
TG = (output tokens - tokens seen at the first token) / (last token time - first token time);
E2E = output tokens / (finish time - arrival time); TTFT = first token time - arrival time;
aggregate = all output tokens / time from the first arrival to the last finish.
Percentiles are numpy's default (linear interpolation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

PERCENTILES = {"p50": 50, "p95": 95}


@dataclass
class RequestTimes:
    """One request's facts, on one clock (seconds), as an engine, a simulator or a client saw
    them. None: the moment did not come (a request cancelled before its first token)."""
    id: str
    prompt_tokens: int
    output_tokens: int
    arrive: Optional[float]
    admit: Optional[float] = None
    first: Optional[float] = None
    last: Optional[float] = None
    finish: Optional[float] = None
    #: Device time of its prefill (0: not measured).
    prefill_s: float = 0.0
    #: Tokens already out at `first` (a client reading a stream may see several at once).
    first_tokens: int = 1
    drafted: int = 0
    accepted: int = 0
    reason: Optional[str] = None


def span(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else b - a


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def percentiles(values: Iterable[Optional[float]]) -> dict[str, Optional[float]]:
    values = [v for v in values if v is not None]
    if not values:
        return {k: None for k in PERCENTILES}
    return {k: float(np.percentile(values, q)) for k, q in PERCENTILES.items()}


def request_metrics(t: RequestTimes) -> dict[str, Any]:
    out = t.output_tokens
    tg_span = span(t.first, t.last)
    return {
        "id": t.id, "prompt_tokens": t.prompt_tokens, "output_tokens": out,
        "queue_s": span(t.arrive, t.admit), "ttft_s": span(t.arrive, t.first),
        "e2e_s": span(t.arrive, t.finish),
        "pp_tps": ratio(t.prompt_tokens, t.prefill_s) if t.first is not None else None,
        "tg_tps": ratio(out - t.first_tokens, tg_span)
        if out > t.first_tokens and tg_span and tg_span > 0 else None,
        "e2e_tps": ratio(out, span(t.arrive, t.finish)),
        "drafted": t.drafted, "accepted": t.accepted, "finish_reason": t.reason,
    }


def request_timings(t: RequestTimes) -> dict[str, Any]:
    """The timings a final output carries (and the server reports)."""
    return {"arrive": t.arrive, "queue_s": span(t.arrive, t.admit), "prefill_s": t.prefill_s,
            "ttft_s": span(t.arrive, t.first), "decode_s": span(t.first, t.last),
            "e2e_s": span(t.arrive, t.finish), "drafted": t.drafted, "accepted": t.accepted}


def aggregate(times: list[RequestTimes]) -> dict[str, Any]:
    """Output tokens, their aggregate rate over first arrival to last finish, and the TTFT
    and E2E percentiles of `times`."""
    arrivals = [t.arrive for t in times if t.arrive is not None]
    finishes = [t.finish for t in times if t.finish is not None]
    wall = (max(finishes) - min(arrivals)) if arrivals and finishes else None
    total = sum(t.output_tokens for t in times)
    return {"output_tokens": total, "span_s": wall, "aggregate_tps": ratio(total, wall),
            "ttft_s": percentiles(span(t.arrive, t.first) for t in times),
            "e2e_s": percentiles(span(t.arrive, t.finish) for t in times)}


def engine_request_times(rs) -> RequestTimes:
    """The facts of an engine RequestState."""
    return RequestTimes(rs.id, rs.prompt_len, len(rs.emitted), rs.t_arrive, rs.t_admit,
                        rs.t_first, rs.t_last, rs.t_finish, rs.prefill_s, 1, rs.drafted,
                        rs.accepted, rs.reason)


def run_metrics(states: Iterable, stats: dict[str, Any]) -> dict[str, Any]:
    times = [engine_request_times(rs) for rs in states]
    agg = aggregate(times)
    return {
        "wall_s": agg["span_s"] or 0.0, "output_tokens": agg["output_tokens"],
        "aggregate_tps": agg["aggregate_tps"],
        "acceptance": ratio(stats["accepted"], stats["drafted"]),
        "windows": stats["windows"], "prefills": stats["prefills"],
        "graph": {"hit": stats["graph_hits"], "capture": stats["graph_captures"],
                  "eager": stats["graph_eager"], "evict": stats["graph_evictions"]},
        "ttft_s": agg["ttft_s"], "e2e_s": agg["e2e_s"],
        "expert_hit_rate": expert_hit_rate(stats),
        "requests": [request_metrics(t) for t in times],
    }


def expert_hit_rate(stats: dict[str, Any]) -> Optional[float]:
    """Hits / (hits + misses) of the expert cache's (layer, expert) reads; None when the cache
    is off or no window ran."""
    if not stats.get("expert_cache"):
        return None
    return ratio(stats["expert_hits"], stats["expert_hits"] + stats["expert_misses"])


def _f(v: Optional[float], nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def format_table(m: dict[str, Any]) -> str:
    head = f"{'request':<12} {'prompt':>6} {'out':>5} {'PP t/s':>9} {'TG t/s':>9} {'E2E t/s':>9} {'TTFT s':>8} {'accept':>7}  finish"
    lines = [head, "-" * len(head)]
    for r in m["requests"]:
        acc = ratio(r["accepted"], r["drafted"])
        lines.append(f"{r['id'][:12]:<12} {r['prompt_tokens']:>6} {r['output_tokens']:>5} "
                     f"{_f(r['pp_tps']):>9} {_f(r['tg_tps']):>9} {_f(r['e2e_tps']):>9} "
                     f"{_f(r['ttft_s'], 3):>8} {_f(acc, 2):>7}  {r['finish_reason']}")
    g = m["graph"]
    lines.append("-" * len(head))
    lines.append(f"aggregate {_f(m['aggregate_tps'])} tokens/s over {m['wall_s']:.3f} s, "
                 f"{m['output_tokens']} tokens; acceptance {_f(m['acceptance'], 3)}; "
                 f"windows {m['windows']} (graph hit {g['hit']}, capture {g['capture']}, "
                 f"eager {g['eager']}, evict {g['evict']}); prefills {m['prefills']}"
                 + (f"; expert hit rate {m['expert_hit_rate']:.3f}"
                    if m.get("expert_hit_rate") is not None else ""))
    return "\n".join(lines)
