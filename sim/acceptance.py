"""Acceptance models: how many of a group's drafts the verifier accepts.

A group of r rows carries r-1 drafts; the slot accepts the longest prefix of drafts that equal
the target tokens (DESIGN.md section 4), so `accepted` is the number of leading successes.
A draft after the first rejected one is never judged: the models draw nothing for it.

- `FixedRateAcceptance`: each judged draft is accepted with probability `rate`.
- `MarkovAcceptance`: two states, the outcome of the request's previous judged draft
  (accepted / rejected); P(accept) depends on the state, and on `p_first` for a request's first
  draft. The chain runs across the request's commits, which captures runs of easy and hard text.
- `RecordedAcceptance`: the engine's own per-commit `accepted`, for replay.

Random models draw from one stream per request (same seed, same request: same outcomes, however
the scheduler interleaves requests).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from .streams import RandomStreams


class AcceptanceModel:
    def accepted(self, req: Any, drafted: int) -> int:
        raise NotImplementedError


class _PerRequestStreams:
    def __init__(self, streams: RandomStreams, name: str):
        self._streams = streams
        self._name = name
        self._gens: dict[Any, Any] = {}

    def gen(self, req_index: int):
        g = self._gens.get(req_index)
        if g is None:
            g = self._gens[req_index] = self._streams.stream(self._name, req_index)
        return g


class FixedRateAcceptance(AcceptanceModel):
    def __init__(self, rate: float, streams: RandomStreams):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance rate must be in [0, 1], got {rate}")
        self.rate = rate
        self._gens = _PerRequestStreams(streams, "acceptance")

    def accepted(self, req: Any, drafted: int) -> int:
        gen = self._gens.gen(req.index)
        a = 0
        while a < drafted and gen.random() < self.rate:
            a += 1
        return a


class MarkovAcceptance(AcceptanceModel):
    def __init__(self, p_after_accept: float, p_after_reject: float, p_first: float,
                 streams: RandomStreams):
        for name, p in (("p_after_accept", p_after_accept), ("p_after_reject", p_after_reject),
                        ("p_first", p_first)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"markov acceptance {name} must be in [0, 1], got {p}")
        self.p_after_accept = p_after_accept
        self.p_after_reject = p_after_reject
        self.p_first = p_first
        self._gens = _PerRequestStreams(streams, "acceptance")
        self._last: dict[int, Optional[bool]] = {}

    def accepted(self, req: Any, drafted: int) -> int:
        gen = self._gens.gen(req.index)
        a = 0
        while a < drafted:
            last = self._last.get(req.index)
            p = self.p_first if last is None else (
                self.p_after_accept if last else self.p_after_reject)
            ok = bool(gen.random() < p)
            self._last[req.index] = ok
            if not ok:
                break
            a += 1
        return a


class RecordedAcceptance(AcceptanceModel):
    """Replays recorded `accepted` values, in order, per request id.

    A commit the engine never made (the simulator diverged) gets 0; the replay comparison
    reports the divergence, so the value only has to keep the simulation well-formed.
    """

    def __init__(self, per_request: dict[Any, Iterable[int]]):
        self._queues = {req: deque(vals) for req, vals in per_request.items()}

    def accepted(self, req: Any, drafted: int) -> int:
        q = self._queues.get(req.id)
        a = q.popleft() if q else 0
        return max(0, min(int(a), drafted))


# --- fitting from commit events --------------------------------------------------------------

@dataclass
class AcceptanceFit:
    """Both models fitted from commit events, plus what they were fitted from."""
    rate: float
    p_accept_after_accept: float
    p_accept_after_reject: float
    p_accept_first: float
    #: Drafts judged (accepted or the first rejected of a group) and commits used.
    judged: int
    commits: int
    #: Accepted drafts / drafted, the engine's `acceptance` metric.
    acceptance_metric: float

    def as_dict(self) -> dict[str, Any]:
        return {"rate": self.rate,
                "markov": {"p_accept_after_accept": self.p_accept_after_accept,
                           "p_accept_after_reject": self.p_accept_after_reject,
                           "p_accept_first": self.p_accept_first},
                "judged_drafts": self.judged, "commits": self.commits,
                "acceptance_metric": self.acceptance_metric}


def _ratio(num: int, den: int, default: float) -> float:
    return num / den if den else default


def fit_acceptance(commits: Iterable[dict[str, Any]], default_rate: float = 0.0) -> AcceptanceFit:
    """Maximum-likelihood fit of both models from commit events (in trace order).

    Each commit with `drafted` = k and `accepted` = a judged min(a + 1, k) drafts: a accepted
    and, when a < k, one rejected. Fixed rate: accepted / judged (the geometric MLE). Markov:
    transition frequencies along each request's sequence of judged outcomes. Commits of
    different traces must use distinct request ids (prefix them), since the chain is per request.
    `default_rate` stands in where no draft was judged.
    """
    outcomes: dict[Any, list[bool]] = defaultdict(list)
    n_commits = drafted_total = accepted_total = 0
    for c in commits:
        k, a = int(c["drafted"]), int(c["accepted"])
        n_commits += 1
        drafted_total += k
        accepted_total += a
        if k == 0:
            continue
        seq = outcomes[c["req"]]
        seq.extend([True] * a)
        if a < k:
            seq.append(False)
    judged = sum(len(s) for s in outcomes.values())
    accepted = sum(sum(s) for s in outcomes.values())
    rate = _ratio(accepted, judged, default_rate)
    first_ok = sum(1 for s in outcomes.values() if s and s[0])
    n_first = sum(1 for s in outcomes.values() if s)
    aa = ar = ra = rr = 0
    for s in outcomes.values():
        for prev, nxt in zip(s, s[1:]):
            if prev:
                aa += nxt
                ar += not nxt
            else:
                ra += nxt
                rr += not nxt
    return AcceptanceFit(rate=rate,
                         p_accept_after_accept=_ratio(aa, aa + ar, rate),
                         p_accept_after_reject=_ratio(ra, ra + rr, rate),
                         p_accept_first=_ratio(first_ok, n_first, rate),
                         judged=judged, commits=n_commits,
                         acceptance_metric=_ratio(accepted_total, drafted_total, 0.0))


def build_acceptance(cfg: Any, streams: RandomStreams,
                     profile_fit: Optional[dict[str, Any]] = None) -> AcceptanceModel:
    """The acceptance model of config `cfg` (`acceptance` group), optionally from a profile."""
    rate = cfg.rate
    p_aa, p_ar, p_first = cfg.p_accept_after_accept, cfg.p_accept_after_reject, cfg.p_accept_first
    if cfg.from_profile:
        if not profile_fit:
            raise ValueError("acceptance.from_profile=true but the cost profile has no "
                             "`acceptance` section (fit one with sim/profile.py)")
        rate = profile_fit["rate"]
        m = profile_fit["markov"]
        p_aa, p_ar, p_first = m["p_accept_after_accept"], m["p_accept_after_reject"], m["p_accept_first"]
    if cfg.model == "fixed":
        return FixedRateAcceptance(rate, streams)
    if cfg.model == "markov":
        return MarkovAcceptance(p_aa, p_ar, p_first, streams)
    raise ValueError(f"acceptance.model must be fixed or markov, got {cfg.model!r}")
