"""Acceptance fitted from an engine trace of the user's own workload (`acceptance.from_trace`).

How often drafts are accepted depends on the text: on code prompts the H200 engine accepted
0.89 of its drafts where the profile's synthetic prompts gave 0.75. A profile's fit prices
its own prompts; a trace of a few of the user's requests (a short engine run, or any trace of
that workload) prices theirs. The fit is sim.acceptance.fit_acceptance over the trace's
commit events, optionally of its first `requests` requests only (in admission order), which
is how the transfer from a few requests to the rest is checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .acceptance import fit_acceptance
from .config import SimConfigError
from .replay import TraceError, load_trace

#: The chain model's per-request spread (how much requests differ in difficulty) is fitted
#: only from this many requests or more: from 8 it swung the predicted acceptance by up to
#: 0.18 on the H200's held-out runs, where without it the error was that of the 8 requests'
#: own rate against the rest's (scripts/sim_transfer_check.py --acceptance-eval).
CHAIN_SPREAD_MIN_REQUESTS = 16


def admitted_requests(events: list[dict[str, Any]]) -> list[Any]:
    """Request ids in the order the engine admitted them (first admission of each)."""
    seen: dict[Any, None] = {}
    for e in events:
        if e.get("ev") == "admit" and e.get("req") not in seen:
            seen[e["req"]] = None
    return list(seen)


def fit_from_trace(path: str | Path, requests: int = 0) -> dict[str, Any]:
    """The acceptance section (AcceptanceFit.as_dict()) fitted from the trace at `path`,
    from its first `requests` admitted requests (0 = all)."""
    try:
        events, _ = load_trace(path)
    except TraceError as e:
        raise SimConfigError(f"acceptance.from_trace: {e}") from None
    order = admitted_requests(events)
    if requests:
        if requests > len(order):
            raise SimConfigError(
                f"acceptance.from_trace_requests: {requests} requests asked, the trace {path} "
                f"admitted {len(order)}")
        keep = set(order[:requests])
    else:
        keep = set(order)
    commits = [e for e in events if e.get("ev") == "commit" and e.get("req") in keep]
    fit = fit_acceptance(commits)
    if not fit.judged:
        raise SimConfigError(f"acceptance.from_trace: {path}: no draft was judged in the "
                             f"{len(keep)} requests used (a trace of a run with drafting?)")
    out = fit.as_dict()
    chain = out.get("chain")
    if chain and len(keep) < CHAIN_SPREAD_MIN_REQUESTS:
        out["chain"] = {**chain, "spread": 0.0, "offset": 0.0,
                        "spread_left_out": f"fitted from {len(keep)} requests "
                                           f"(< {CHAIN_SPREAD_MIN_REQUESTS})"}
    return out
