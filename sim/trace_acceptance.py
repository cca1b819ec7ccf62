"""Acceptance fitted from an engine trace of the user's own workload (`acceptance.from_trace`).

How often drafts are accepted depends on the text: on code prompts the H200 engine accepted
0.89 of its drafts where the profile's synthetic prompts gave 0.75. A profile's fit prices
its own prompts; a trace of a few of the user's requests (a short engine run, or any trace of
that workload) prices theirs. The fit is sim.acceptance.fit_acceptance over the trace's
commit events, optionally of its first `requests` requests only (in admission order), which
is how the transfer from a few requests to the rest is checked.

Two things a few requests cannot say well, and what stands in for them:

- **Depth factors** (how much worse a draft chained on a draft is guessed): a short run with
  several requests in flight runs 2-row groups, which judge no deeper drafts, and its lone
  windows at the end judge a handful (5 in 8 requests of 256 tokens at 4 in flight). A factor
  fitted from 5 drafts swung a solo prediction by 0.1; without any, the factor is 1 and solo
  came out 0.08 high. The depth factor is the drafter's, more than the text's, so each one is
  pooled with the cost profile's (`prior`: the same model measured on that machine, lone
  windows included) as DEPTH_PRIOR_JUDGED judged drafts' worth of evidence.
- **The workload's mean**: requests differ far more than drafts do (per request 0.5 to 1.0 on
  code prompts), so k requests' mean is off the rest's by about sd / sqrt(k) whatever the
  model (0.05 for 8 requests of the CPU runs). The fit records the requests' spread
  (`requests`, `request_sd`: per-request accepted / drafted, requests with at least
  SPREAD_MIN_DRAFTED drafts), and a prediction reports the range that uncertainty spans
  (`acceptance_range` in metrics.json: the workload simulated again with every rate moved by
  that many standard errors in logit space, so solo's deeper windows get a wider range).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Optional

from .acceptance import SPREAD_MIN_DRAFTED, fit_acceptance, logit_shift, pin_difficulties
from .config import SimConfigError
from .replay import TraceError, load_trace

#: The chain model's per-request spread (how much requests differ in difficulty) is fitted
#: only from this many requests or more: from 8 it swung the predicted acceptance by up to
#: 0.18 on the H200's held-out runs, where without it the error was that of the 8 requests'
#: own rate against the rest's (scripts/sim_transfer_check.py --acceptance-eval).
CHAIN_SPREAD_MIN_REQUESTS = 16
#: Weight of the profile's depth factor, in judged deeper drafts: a depth the trace judged
#: this often weighs as much as the profile's factor.
DEPTH_PRIOR_JUDGED = 40
#: The normal quantile of acceptance_range's ends (p10 and p90, as spread.quantiles).
RANGE_Z = 1.2816


def admitted_requests(events: list[dict[str, Any]]) -> list[Any]:
    """Request ids in the order the engine admitted them (first admission of each)."""
    seen: dict[Any, None] = {}
    for e in events:
        if e.get("ev") == "admit" and e.get("req") not in seen:
            seen[e["req"]] = None
    return list(seen)


def pooled_depth(factors: list[float], judged: list[int],
                 prior: Optional[list[float]]) -> list[float]:
    """Depth factors (index 0 = first draft = 1) pooled with the prior's: depth j's factor is
    (judged_j * factor_j + DEPTH_PRIOR_JUDGED * prior_j) / (judged_j + DEPTH_PRIOR_JUDGED),
    `judged` counting the deeper drafts behind each factor from depth 1 on. Depths only one
    side has take that side's factor (the last factor holds deeper)."""
    if not prior or len(prior) < 2:
        return list(factors)
    out = [1.0]
    for j in range(1, max(len(factors), len(prior))):
        p = prior[min(j, len(prior) - 1)]
        if j >= len(factors):
            out.append(p)
            continue
        n = judged[j - 1] if j - 1 < len(judged) else 0
        out.append((n * factors[j] + DEPTH_PRIOR_JUDGED * p) / (n + DEPTH_PRIOR_JUDGED))
    return out


def request_spread(commits: list[dict[str, Any]]) -> tuple[int, Optional[float]]:
    """(requests with drafts, sd of their accepted / drafted) over requests with at least
    SPREAD_MIN_DRAFTED drafts (None below two such requests)."""
    acc: dict[Any, list[int]] = {}
    for c in commits:
        a = acc.setdefault(c["req"], [0, 0])
        a[0] += int(c["accepted"])
        a[1] += int(c["drafted"])
    rates = [a / d for a, d in acc.values() if d >= SPREAD_MIN_DRAFTED]
    n = sum(1 for _, d in acc.values() if d)
    return n, (statistics.pstdev(rates) if len(rates) >= 2 else None)


def commit_walks(commits: list[dict[str, Any]], order: list[Any]
                 ) -> list[list[tuple[int, int, int]]]:
    """Per request of `order`, its (output position, drafted, accepted) commits in trace order
    (positions counted as fit_acceptance counts them: the prefill's token is 1; none: [])."""
    emitted: dict[Any, int] = {}
    walks: dict[Any, list[tuple[int, int, int]]] = {}
    for c in commits:
        before = emitted.get(c["req"], 1)
        emitted[c["req"]] = before + int(c.get("emitted", int(c["accepted"]) + 1))
        walks.setdefault(c["req"], []).append((before, int(c["drafted"]), int(c["accepted"])))
    return [walks.get(r, []) for r in order]


#: fit_from_trace's results by (file, its size and mtime, requests, prior): the chain's spread
#: fit simulates the traced requests over a hundred times (seconds), and a check that predicts
#: a workload under many seeds fits the same trace each time.
_FIT_CACHE: dict[tuple, dict[str, Any]] = {}
_FIT_CACHE_SIZE = 16


def fit_from_trace(path: str | Path, requests: int = 0,
                   prior: Optional[dict[str, Any]] = None, pin: bool = False) -> dict[str, Any]:
    """The acceptance section (AcceptanceFit.as_dict()) fitted from the trace at `path`,
    from its first `requests` admitted requests (0 = all), its depth factors pooled with
    `prior`'s (a profile's acceptance section, or None), plus `requests` and `request_sd`;
    with `pin`, the chain section's `pinned`: each of those requests' own logit shift, in
    admission order (acceptance.pin_requests). (Cached while the file is unchanged; each call
    gets its own copy.)"""
    try:
        st = Path(path).stat()
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, int(requests),
               json.dumps(prior, sort_keys=True, default=str), bool(pin))
    except OSError:
        key = None  # (load_trace says what is wrong with it)
    if key is not None and key in _FIT_CACHE:
        return copy.deepcopy(_FIT_CACHE[key])
    out = _fit_from_trace(path, requests, prior, pin)
    if key is not None:
        if len(_FIT_CACHE) >= _FIT_CACHE_SIZE:
            _FIT_CACHE.pop(next(iter(_FIT_CACHE)))
        _FIT_CACHE[key] = copy.deepcopy(out)
    return out


def _fit_from_trace(path: str | Path, requests: int,
                    prior: Optional[dict[str, Any]], pin: bool = False) -> dict[str, Any]:
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
    prior = prior or {}
    pos = out.get("position")
    if pos:
        pos["depth_factor"] = pooled_depth(pos["depth_factor"], pos["depth_judged"][1:],
                                           (prior.get("position") or {}).get("depth_factor"))
    chain = out.get("chain")
    if chain:
        chain["depth_factor"] = pooled_depth(chain["depth_factor"], chain["judged"]["deeper"],
                                             (prior.get("chain") or {}).get("depth_factor"))
        if len(keep) < CHAIN_SPREAD_MIN_REQUESTS:
            out["chain"] = {**chain, "spread": 0.0, "offset": 0.0,
                            "spread_left_out": f"fitted from {len(keep)} requests "
                                               f"(< {CHAIN_SPREAD_MIN_REQUESTS})"}
        if pin:
            used = [r for r in order if r in keep]
            out["chain"]["pinned"] = pin_difficulties(out["chain"], commit_walks(commits, used))
    out["requests"], out["request_sd"] = request_spread(commits)
    return out


def range_shift(fit: Optional[dict[str, Any]]) -> Optional[float]:
    """The logit shift of acceptance_range's ends: RANGE_Z standard errors of the requests'
    mean acceptance (sd / sqrt(requests)), in logit units at the fit's own acceptance. None
    when the fit records no spread (a profile's fit, or fewer than two requests)."""
    if not fit or not fit.get("request_sd") or not fit.get("requests"):
        return None
    m = float(fit.get("acceptance_metric") or 0.0)
    if not 0.0 < m < 1.0:
        return None
    return RANGE_Z * float(fit["request_sd"]) / math.sqrt(int(fit["requests"])) / (m * (1 - m))


def shifted_fit(fit: dict[str, Any], shift: float) -> dict[str, Any]:
    """A copy of an acceptance section with every rate of every model moved by `shift` in
    logit space (depth factors and the chain's spread as they are): the same text, that much
    easier or harder for the drafter."""
    out = copy.deepcopy(fit)
    out["rate"] = logit_shift(out["rate"], shift)
    out["markov"] = {k: logit_shift(v, shift) for k, v in out["markov"].items()}
    if "position" in out:
        out["position"]["rate"] = [logit_shift(x, shift) for x in out["position"]["rate"]]
    if "chain" in out:
        c = out["chain"]
        c["first"] = logit_shift(c["first"], shift)
        c["after_miss"] = [logit_shift(x, shift) for x in c["after_miss"]]
        c["after_hit"] = [logit_shift(x, shift) for x in c["after_hit"]]
    return out


def acceptance_range(simulate: Callable[[dict[str, Any]], Optional[float]],
                     fit: Optional[dict[str, Any]]) -> Optional[list[float]]:
    """[low, high] of the workload's acceptance given that the fit saw a few requests: the
    workload simulated again with the fit's rates moved down and up by range_shift
    (`simulate(fit)` returns the simulated acceptance), so a mode with deeper windows, whose
    acceptance moves more with the text, gets a wider range. None without a spread."""
    shift = range_shift(fit)
    if shift is None:
        return None
    ends = [simulate(shifted_fit(fit, -shift)), simulate(shifted_fit(fit, shift))]
    if any(e is None for e in ends):
        return None
    return [min(ends), max(ends)]
