"""Acceptance models: how many of a group's drafts the verifier accepts.

A group of r rows carries r-1 drafts; the slot accepts the longest prefix of drafts that equal
the target tokens (DESIGN.md section 4), so `accepted` is the number of leading successes.
A draft after the first rejected one is never judged: the models draw nothing for it.

- `FixedRateAcceptance`: each judged draft is accepted with probability `rate`.
- `MarkovAcceptance`: two states, the outcome of the request's previous judged draft
  (accepted / rejected); P(accept) depends on the state, and on `p_first` for a request's first
  draft. The chain runs across the request's commits, which captures runs of easy and hard text.
- `PositionAcceptance`: each judged draft is accepted with a probability that depends on its
  output position (tokens the request emitted before the commit, plus the draft's index in the
  group), in buckets of `tokens` positions (past the last bucket the last rate holds), times a
  factor for its depth in the group (1 for the first draft; deeper drafts, which a lone slot's
  4-row windows carry, are drafted from drafts and accepted less often). Output position
  matters: acceptance drifts as a generation goes on (a small model falls into repetition its
  drafter predicts well, so its acceptance climbs with the output length).
- `ChainAcceptance`: the text itself as a chain over output positions: position p is
  "draftable" (the drafter's one-step guess for it is right) with a probability that depends
  on whether position p-1 was, and on p's bucket. Windows judge a draft at some positions and
  skip others (a 2-row group that accepts jumps two positions; a lone 4-row window judges up to
  three in a row), so which positions get judged depends on the window shape; a model over
  judged drafts alone (position, markov) cannot tell a lone window's first drafts, which mostly
  follow a miss, from a grouped window's. Deeper drafts need their position draftable and pass
  a depth factor (a draft chained on a draft is guessed less well). Requests differ: some
  prompts lead to text the drafter guesses far better than others (per-request acceptance
  0.25-0.87 in one H200 cell), so each request draws a difficulty that shifts its rates in
  logit space (`spread`, the shift's standard deviation, and `offset`, which keeps the mean
  where the traces put it). Without it every request would see the same rates, and the spread
  of requests' lengths in windows, hence the E2E tail, would come out too narrow.
- `RecordedAcceptance`: the engine's own per-commit `accepted`, for replay.
- `SyntheticAcceptance`: engine.synthetic_acceptance itself: the engine's decisions, a hash of
  the request's seed and the draft's position (strata.engine.sampling.synthetic_prefix), so a
  prediction of a synthetic benchmark takes the windows the engine takes (requests of one seed
  and prompt length accept alike and finish together), where `fixed` would draw them apart.

Random models draw from one stream per request (same seed, same request: same outcomes, however
the scheduler interleaves requests).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import numpy as np

from .streams import RandomStreams


class AcceptanceModel:
    def accepted(self, req: Any, drafted: int, position: int = 0) -> int:
        """Drafts accepted of `drafted`; `position` = tokens the request emitted so far."""
        raise NotImplementedError


class _Uniforms:
    """A stream's uniform draws in order, `random()` at a time, drawn from the Generator in
    blocks: the same numbers as a `Generator.random()` call each, at a small part of a numpy
    call's cost (the acceptance models draw millions in a calibration's refit)."""

    __slots__ = ("_gen", "_block", "_next")
    BLOCK = 64

    def __init__(self, gen: np.random.Generator):
        self._gen, self._block, self._next = gen, [], 0

    def random(self) -> float:
        i = self._next
        if i == len(self._block):
            self._block, i = self._gen.random(self.BLOCK).tolist(), 0
        self._next = i + 1
        return self._block[i]


class _PerRequestStreams:
    """One uniform stream per request index (stream `name`, the index its key)."""

    def __init__(self, streams: RandomStreams, name: str):
        self._streams = streams
        self._name = name
        self._gens: dict[Any, _Uniforms] = {}

    def gen(self, req_index: int) -> _Uniforms:
        g = self._gens.get(req_index)
        if g is None:
            g = self._gens[req_index] = _Uniforms(self._streams.stream(self._name, req_index))
        return g


class FixedRateAcceptance(AcceptanceModel):
    def __init__(self, rate: float, streams: RandomStreams):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance rate must be in [0, 1], got {rate}")
        self.rate = rate
        self._gens = _PerRequestStreams(streams, "acceptance")

    def accepted(self, req: Any, drafted: int, position: int = 0) -> int:
        gen = self._gens.gen(req.index)
        a = 0
        while a < drafted and gen.random() < self.rate:
            a += 1
        return a


class SyntheticAcceptance(AcceptanceModel):
    """engine.synthetic_acceptance=rate: a group's drafts at positions pos0 + 1 .. pos0 +
    drafted are accepted while the engine's hash of (request seed, position) stays under `rate`.
    pos0, the group's first row, is the request's last emitted token: prompt + emitted - 1."""

    def __init__(self, rate: float):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"engine.synthetic_acceptance must be in [0, 1], got {rate}")
        import torch  # (only this model needs it: the engine's own decision function)

        from strata.engine.sampling import synthetic_prefix
        self.rate = rate
        self._torch, self._prefix = torch, synthetic_prefix

    def accepted(self, req: Any, drafted: int, position: int = 0) -> int:
        if drafted <= 0:
            return 0
        t = self._torch
        pos0 = req.prompt_tokens + position - 1
        return int(self._prefix(t.tensor([drafted + 1]), t.tensor([req.seed]), t.tensor([pos0]),
                                drafted + 1, self.rate)[0])


def _rates(what: str, rates: list[float]) -> list[float]:
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"{what} must be a non-empty list in [0, 1], got {rates}")
    return [float(r) for r in rates]


def _bucket(model: str, tokens: int) -> int:
    if tokens < 1:
        raise ValueError(f"{model} bucket must be >= 1 tokens, got {tokens}")
    return int(tokens)


def _depth_factors(model: str, depth_factors: Optional[list[float]]) -> list[float]:
    factors = [float(f) for f in (depth_factors or [1.0])]
    if any(f < 0 for f in factors):
        raise ValueError(f"{model} depth factors must be >= 0, got {factors}")
    return factors


class PositionAcceptance(AcceptanceModel):
    """Each judged draft at output position p is accepted with probability
    rates[min(p // tokens, len(rates) - 1)], independently."""

    def __init__(self, rates: list[float], tokens: int, streams: RandomStreams,
                 depth_factors: Optional[list[float]] = None):
        self.rates = _rates("position acceptance rates", rates)
        self.tokens = _bucket("position acceptance", tokens)
        self.depth_factors = _depth_factors("position acceptance", depth_factors)
        self._gens = _PerRequestStreams(streams, "acceptance")

    def rate_at(self, position: int, depth: int = 0) -> float:
        """P(accept) of a draft at output `position`, `depth` drafts into its group (0-based)."""
        r = self.rates[min(max(position, 0) // self.tokens, len(self.rates) - 1)]
        return min(1.0, r * self.depth_factors[min(depth, len(self.depth_factors) - 1)])

    def accepted(self, req: Any, drafted: int, position: int = 0) -> int:
        gen = self._gens.gen(req.index)
        a = 0
        while a < drafted and gen.random() < self.rate_at(position + a, a):
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

    def accepted(self, req: Any, drafted: int, position: int = 0) -> int:
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


class ChainAcceptance(AcceptanceModel):
    """Per request a chain of draftable bits over output positions, drawn lazily in order
    (positions a window skips are drawn too, so the chain does not depend on the windows).
    P(draftable at p) = after_hit[b] if p-1 was draftable else after_miss[b], b = p's bucket of
    `tokens` positions (the last rate holds past the end); `first` for a request's first
    position. Draft j of a group at position p + j is accepted iff p + j is draftable and, for
    j >= 1, a draw passes depth_factors[j] (the last factor holds deeper).

    Per request, the rates first, after_miss and after_hit move in logit space by
    offset + spread * z, z a standard normal drawn once per request from its own stream
    (`acceptance_spread`); spread = offset = 0 leaves them as given. `pinned`: the shifts of
    requests 0 .. len(pinned) - 1 themselves (pin_difficulties: a traced workload's own
    requests), the others drawn as above."""

    def __init__(self, after_miss: list[float], after_hit: list[float], first: float, tokens: int,
                 streams: RandomStreams, depth_factors: Optional[list[float]] = None,
                 spread: float = 0.0, offset: float = 0.0,
                 request_z: Optional[list[float]] = None,
                 pinned: Optional[list[float]] = None):
        self.after_miss = _rates("chain acceptance after_miss rates", after_miss)
        self.after_hit = _rates("chain acceptance after_hit rates", after_hit)
        if len(after_miss) != len(after_hit):
            raise ValueError("chain acceptance after_miss and after_hit need one rate per bucket each")
        if not 0.0 <= first <= 1.0:
            raise ValueError(f"chain acceptance first must be in [0, 1], got {first}")
        self.first = float(first)
        self.tokens = _bucket("chain acceptance", tokens)
        self.depth_factors = _depth_factors("chain acceptance", depth_factors)
        if not (spread >= 0.0 and math.isfinite(spread)) or not math.isfinite(offset):
            raise ValueError(f"chain acceptance spread must be finite and >= 0 and offset "
                             f"finite, got spread={spread}, offset={offset}")
        self.spread, self.offset = float(spread), float(offset)
        self._gens = _PerRequestStreams(streams, "acceptance")
        self._streams = streams  # (its "acceptance_spread" stream: one normal a request)
        #: The spread fit's fixed difficulties by request index (None: drawn per request).
        self._request_z = request_z
        #: Logit shifts of the first requests, as given (None: none pinned).
        self._pinned = [float(x) for x in pinned] if pinned is not None else None
        if self._pinned is not None and not all(math.isfinite(x) for x in self._pinned):
            raise ValueError(f"chain acceptance pinned shifts must be finite, got {pinned}")
        #: request index -> (last position drawn, its bit)
        self._chain: dict[int, tuple[int, bool]] = {}
        #: request index -> (first, after_miss, after_hit) after its shift
        self._rates: dict[int, tuple[float, list[float], list[float]]] = {}

    def _request_rates(self, idx: int) -> tuple[float, list[float], list[float]]:
        r = self._rates.get(idx)
        if r is None and self._pinned is not None and idx < len(self._pinned):
            shift = self._pinned[idx]
            r = (logit_shift(self.first, shift), [logit_shift(x, shift) for x in self.after_miss],
                 [logit_shift(x, shift) for x in self.after_hit])
            self._rates[idx] = r
        if r is None:
            if self.spread == 0.0 and self.offset == 0.0:
                r = (self.first, self.after_miss, self.after_hit)
            else:
                z = (self._request_z[idx] if self._request_z is not None
                     else float(self._streams.stream("acceptance_spread", idx)
                                 .standard_normal()))
                shift = self.offset + self.spread * z
                r = (logit_shift(self.first, shift),
                     [logit_shift(x, shift) for x in self.after_miss],
                     [logit_shift(x, shift) for x in self.after_hit])
            self._rates[idx] = r
        return r

    def _draftable(self, idx: int, gen, position: int) -> bool:
        last = self._chain.get(idx)
        if last is not None and position <= last[0]:
            raise ValueError(f"chain acceptance: position {position} of request {idx} asked after "
                             f"{last[0]} (positions only move forward)")
        first, after_miss, after_hit = self._request_rates(idx)
        if last is None:
            bit = gen.random() < first
        else:
            p, bit = last
            tokens, top = self.tokens, len(after_hit) - 1
            while p < position:
                p += 1
                b = min(max(p, 0) // tokens, top)
                bit = gen.random() < (after_hit[b] if bit else after_miss[b])
        self._chain[idx] = (position, bit)
        return bit

    def accepted(self, req: Any, drafted: int, position: int = 0) -> int:
        gen = self._gens.gen(req.index)
        a = 0
        while a < drafted:
            ok = self._draftable(req.index, gen, position + a)
            if ok and a > 0:
                ok = bool(gen.random() < self.depth_factors[min(a, len(self.depth_factors) - 1)])
            if not ok:
                # The draft was wrong, but the position holds the verified token: the chain
                # goes on from it as drawn.
                break
            a += 1
        return a


def logit_shift(rate: float, shift: float) -> float:
    """`rate` moved by `shift` in logit space; 0 and 1 stay where they are."""
    if rate <= 0.0 or rate >= 1.0 or shift == 0.0:
        return rate
    z = math.log(rate / (1.0 - rate)) + shift
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


class RecordedAcceptance(AcceptanceModel):
    """Replays recorded `accepted` values, in order, per request id.

    A commit the engine never made (the simulator diverged) gets 0; the replay comparison
    reports the divergence, so the value only has to keep the simulation well-formed.
    """

    def __init__(self, per_request: dict[Any, Iterable[int]]):
        self._queues = {req: deque(vals) for req, vals in per_request.items()}

    def accepted(self, req: Any, drafted: int, position: int = 0) -> int:
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
    #: Position model: bucket width (output tokens), rate and judged drafts per bucket.
    position_tokens: int = 0
    position_rates: tuple[float, ...] = ()
    position_judged: tuple[int, ...] = ()
    #: Factor of each draft depth in a group (first draft: 1), and judged drafts per depth.
    depth_factors: tuple[float, ...] = ()
    depth_judged: tuple[int, ...] = ()
    #: Chain model (ChainAcceptance): per bucket, P(draftable) after a miss and after a hit,
    #: the depth factors against after_hit, and the judged drafts behind each.
    chain_after_miss: tuple[float, ...] = ()
    chain_after_hit: tuple[float, ...] = ()
    chain_depth_factors: tuple[float, ...] = ()
    chain_judged: dict[str, list[int]] = field(default_factory=dict)
    #: Chain model: the per-request logit shift's standard deviation and centre
    #: (`_fit_chain_spread`), and the per-request acceptance spread it was matched to.
    chain_spread: float = 0.0
    chain_offset: float = 0.0
    chain_request_sd: Optional[float] = None

    def as_dict(self) -> dict[str, Any]:
        d = {"rate": self.rate,
             "markov": {"p_accept_after_accept": self.p_accept_after_accept,
                        "p_accept_after_reject": self.p_accept_after_reject,
                        "p_accept_first": self.p_accept_first},
             "judged_drafts": self.judged, "commits": self.commits,
             "acceptance_metric": self.acceptance_metric}
        if self.position_rates:
            d["position"] = {"tokens": self.position_tokens, "rate": list(self.position_rates),
                             "judged": list(self.position_judged),
                             "depth_factor": list(self.depth_factors),
                             "depth_judged": list(self.depth_judged)}
        if self.chain_after_miss:
            d["chain"] = {"tokens": self.position_tokens, "after_miss": list(self.chain_after_miss),
                          "after_hit": list(self.chain_after_hit), "first": self.p_accept_first,
                          "depth_factor": list(self.chain_depth_factors),
                          "judged": self.chain_judged,
                          "spread": self.chain_spread, "offset": self.chain_offset,
                          "request_sd": self.chain_request_sd}
        return d


def _ratio(num: int, den: int, default: float) -> float:
    return num / den if den else default


#: Output positions per bucket of the fitted position model.
POSITION_TOKENS = 16
#: Fewest judged drafts behind one fitted position rate: sparser buckets pool with the next
#: ones (a sparse tail pools with the bucket before it).
POSITION_MIN_JUDGED = 40


def _pooled(judged: list[int], hits: list[float], expected: list[float],
            default: float) -> list[float]:
    """hits / expected per index, consecutive indices pooled until each pool holds at least
    POSITION_MIN_JUDGED judged drafts (a sparse tail joins the pool before it)."""
    runs: list[list[int]] = []
    cur: list[int] = []
    for b in range(len(judged)):
        cur.append(b)
        if sum(judged[i] for i in cur) >= POSITION_MIN_JUDGED:
            runs.append(cur)
            cur = []
    if cur:
        if runs:
            runs[-1].extend(cur)
        else:
            runs.append(cur)
    out = [default] * len(judged)
    for run in runs:
        den = sum(expected[i] for i in run)
        r = sum(hits[i] for i in run) / den if den else default
        for i in run:
            out[i] = r
    return out


def fit_acceptance(commits: Iterable[dict[str, Any]], default_rate: float = 0.0) -> AcceptanceFit:
    """Maximum-likelihood fit of both models from commit events (in trace order).

    Each commit with `drafted` = k and `accepted` = a judged min(a + 1, k) drafts: a accepted
    and, when a < k, one rejected. Fixed rate: accepted / judged (the geometric MLE). Markov:
    transition frequencies along each request's sequence of judged outcomes. Commits of
    different traces must use distinct request ids (prefix them), since the chain is per request.
    `default_rate` stands in where no draft was judged.
    """
    outcomes: dict[Any, list[bool]] = defaultdict(list)
    emitted: dict[Any, int] = defaultdict(lambda: 1)  # the first token comes from the prefill
    pos_judged: list[int] = []
    pos_accepted: list[int] = []
    deep: list[tuple[int, int, bool]] = []  # (depth >= 1, position, accepted) of deeper drafts
    walks: dict[Any, list[tuple[int, int, bool]]] = defaultdict(list)  # (position, depth, ok)
    per_request: dict[Any, list[tuple[int, int, int]]] = defaultdict(list)  # (pos, drafted, acc)
    n_commits = drafted_total = accepted_total = 0
    for c in commits:
        k, a = int(c["drafted"]), int(c["accepted"])
        n_commits += 1
        drafted_total += k
        accepted_total += a
        before = emitted[c["req"]]
        emitted[c["req"]] = before + int(c.get("emitted", a + 1))
        per_request[c["req"]].append((before, k, a))
        if k == 0:
            continue
        seq = outcomes[c["req"]]
        seq.extend([True] * a)
        if a < k:
            seq.append(False)
        walks[c["req"]].extend((before + j, j, j < a) for j in range(min(a + 1, k)))
        # The first draft of each group gives the position rates; deeper judged drafts (at
        # positions before + j) give the depth factors against those rates.
        b = before // POSITION_TOKENS
        while len(pos_judged) <= b:
            pos_judged.append(0)
            pos_accepted.append(0)
        pos_judged[b] += 1
        pos_accepted[b] += a > 0
        for j in range(1, min(a + 1, k)):
            deep.append((j, before + j, j < a))
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
    pos_rates = _pooled(pos_judged, pos_accepted, pos_judged, rate)
    depths = max((j for j, _, _ in deep), default=0)
    d_judged, d_hits, d_expected = [0] * depths, [0.0] * depths, [0.0] * depths
    for j, p, ok in deep:
        d_judged[j - 1] += 1
        d_hits[j - 1] += ok
        d_expected[j - 1] += pos_rates[min(p // POSITION_TOKENS, len(pos_rates) - 1)]
    chain = _fit_chain(walks, rate, pos_rates)
    if chain:
        # Requests of one trace ran one workload; across traces window shapes and prompt sizes
        # differ, and so does the mean acceptance: the spread is matched within traces.
        groups = [k[0] if isinstance(k, tuple) else 0 for k in per_request]
        chain.update(_fit_chain_spread(chain, _ratio(first_ok, n_first, rate),
                                       list(per_request.values()), groups))
    return AcceptanceFit(rate=rate,
                         p_accept_after_accept=_ratio(aa, aa + ar, rate),
                         p_accept_after_reject=_ratio(ra, ra + rr, rate),
                         p_accept_first=_ratio(first_ok, n_first, rate),
                         judged=judged, commits=n_commits,
                         acceptance_metric=_ratio(accepted_total, drafted_total, 0.0),
                         position_tokens=POSITION_TOKENS,
                         position_rates=tuple(pos_rates),
                         position_judged=tuple(pos_judged),
                         depth_factors=tuple([1.0] + _pooled(d_judged, d_hits, d_expected, 1.0)),
                         depth_judged=tuple([sum(pos_judged)] + d_judged),
                         **chain)


def _fit_chain(walks: dict[Any, list[tuple[int, int, bool]]], rate: float,
               pos_rates: list[float]) -> dict[str, Any]:
    """ChainAcceptance's parameters from each request's judged drafts in order.

    after_miss: a first draft judged right after a first draft that missed (the previous
    position is known undraftable). after_hit cannot be seen directly (a group that accepts
    skips a position), but a first draft judged two positions after an accepted one is:
    q = h^2 + (1 - h) m, solved for h. Depth factors: deeper drafts against h, since their
    previous position was accepted. Buckets pool as the position model's do."""
    nb = len(pos_rates)
    miss_n, miss_hit = [0] * nb, [0] * nb
    lag_n, lag_hit = [0] * nb, [0] * nb
    deeper: list[tuple[int, int, bool]] = []
    for seq in walks.values():
        for (p0, j0, ok0), (p, j, ok) in zip(seq, seq[1:]):
            b = min(p // POSITION_TOKENS, nb - 1)
            if j > 0:
                deeper.append((j, b, ok))
            elif j0 == 0 and not ok0 and p == p0 + 1:
                miss_n[b] += 1
                miss_hit[b] += ok
            elif j0 == 0 and ok0 and p == p0 + 2:
                lag_n[b] += 1
                lag_hit[b] += ok
    if not sum(miss_n) or not sum(lag_n):
        return {}  # windows of one shape only: nothing tells the two states apart
    miss = _pooled(miss_n, miss_hit, miss_n, rate)
    lag = _pooled(lag_n, lag_hit, lag_n, rate)
    hit = []
    for m, q in zip(miss, lag):
        disc = m * m - 4.0 * (m - q)
        hit.append(min(1.0, max(0.0, (m + math.sqrt(max(0.0, disc))) / 2.0)))
    depths = max((j for j, _, _ in deeper), default=0)
    d_n, d_hits, d_exp = [0] * depths, [0.0] * depths, [0.0] * depths
    for j, b, ok in deeper:
        d_n[j - 1] += 1
        d_hits[j - 1] += ok
        d_exp[j - 1] += hit[b]
    return {"chain_after_miss": tuple(miss), "chain_after_hit": tuple(hit),
            "chain_depth_factors": tuple([1.0] + _pooled(d_n, d_hits, d_exp, 1.0)),
            "chain_judged": {"after_miss": miss_n, "two_after_hit": lag_n, "deeper": d_n}}


#: Requests with fewer drafts than this say little about their own rate: left out of the
#: spread fit (their ratio is mostly binomial noise).
SPREAD_MIN_DRAFTED = 8
#: At most this many requests (evenly picked) are simulated per step of the spread fit.
SPREAD_MAX_REQUESTS = 256
#: The spread fit's search: logit sd in [0, SPREAD_MAX], bisection steps on the sd, bisection
#: steps on the offset that keeps the chain's mean acceptance.
SPREAD_MAX = 4.0
SPREAD_BISECT_STEPS = 12
SPREAD_OFFSET_STEPS = 8
#: The offset's search starts from [-BRACKET, BRACKET] and widens it (doubling) at most
#: WIDEN times on each side.
SPREAD_OFFSET_BRACKET = 0.5
SPREAD_OFFSET_WIDEN = 4
#: Seed of the fit's simulated requests (common random numbers across its steps).
SPREAD_FIT_SEED = 12345


def _bisect(f: Callable[[float], float], lo: float, hi: float, target: float,
            steps: int) -> tuple[float, float]:
    """`steps` halvings of [lo, hi] towards where the rising f crosses `target` (f below it
    moves lo up, else hi down); returns the last bracket."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return lo, hi


def _within_sd(values: list[float], groups: list[Any]) -> float:
    """Pooled within-group standard deviation (each group about its own mean)."""
    by: dict[Any, list[float]] = defaultdict(list)
    for v, g in zip(values, groups):
        by[g].append(v)
    ss = sum(sum((v - sum(vs) / len(vs)) ** 2 for v in vs) for vs in by.values())
    return math.sqrt(ss / len(values))


def _fit_chain_spread(chain: dict[str, Any], first: float,
                      requests: list[list[tuple[int, int, int]]],
                      groups: Optional[list[Any]] = None) -> dict[str, Any]:
    """The chain model's per-request spread, by simulation: each traced request is re-drawn
    under the chain with a per-request logit shift (its traced output length, its windows
    drafting as its traced ones did), and the shift's sd (`chain_spread`) is set so that the
    sd of requests' accepted / drafted within their group (trace) matches the traces', with
    the centre (`chain_offset`) keeping the pooled acceptance (accepted over drafted, all
    requests) where the chain alone puts it, so the spread widens the requests and leaves the
    workload's acceptance as fitted. (Keeping the mean of the requests' ratios instead, over
    their traced commits, put the simulated acceptance 0.03-0.05 above the engine's on the
    CPU runs of docs/SIMULATOR.md's acceptance table: easy requests draft fewer times.) The
    chain alone already spreads requests by chance; where that covers the traces' spread,
    the fit is 0."""
    import statistics

    groups = list(groups) if groups is not None else [0] * len(requests)
    kept = [(r, g) for r, g in zip(requests, groups)
            if sum(k for _, k, _ in r) >= SPREAD_MIN_DRAFTED]
    if len(kept) < 3:
        return {}
    if len(kept) > SPREAD_MAX_REQUESTS:
        step = len(kept) / SPREAD_MAX_REQUESTS
        kept = [kept[int(i * step)] for i in range(SPREAD_MAX_REQUESTS)]
    reqs, groups = [r for r, _ in kept], [g for _, g in kept]
    observed = [sum(a for *_, a in r) / sum(k for _, k, _ in r) for r in reqs]
    target_sd = _within_sd(observed, groups)

    # The requests' difficulties are the normal's quantiles, in a fixed shuffled order: drawn
    # at random, their sample mean (0.13 sd for 56 requests) went into the offset, which
    # then moved every simulation's acceptance by up to 0.04.
    n = len(reqs)
    order = np.random.default_rng(SPREAD_FIT_SEED).permutation(n)
    zs = [statistics.NormalDist().inv_cdf((int(order[i]) + 0.5) / n) for i in range(n)]

    def simulate(spread: float, offset: float) -> tuple[float, float]:
        model = ChainAcceptance(list(chain["chain_after_miss"]), list(chain["chain_after_hit"]),
                                first, POSITION_TOKENS,
                                RandomStreams(SPREAD_FIT_SEED),
                                list(chain["chain_depth_factors"]), spread, offset, zs)
        ratios, acc_all, dr_all = [], 0, 0
        for i, r in enumerate(reqs):
            acc, dr = redraw_request(model, i, r)
            ratios.append(acc / dr if dr else 0.0)
            acc_all, dr_all = acc_all + acc, dr_all + dr
        return acc_all / max(dr_all, 1), _within_sd(ratios, groups)

    base_mean, base_sd = simulate(0.0, 0.0)
    out = {"chain_request_sd": target_sd}
    if base_sd >= target_sd:
        return out

    def centred(spread: float) -> tuple[float, float]:
        """(offset, sd) at `spread`: the offset whose mean ratio is nearest the chain's own,
        by bracketing and bisection (the mean rises with the offset; where it is flat, as
        with rates of exactly 0 or 1, the nearest one tried)."""
        tried: list[tuple[float, float, float]] = []  # (|mean - base|, offset, sd)

        def at(offset: float) -> float:
            m, sd = simulate(spread, offset)
            tried.append((abs(m - base_mean), offset, sd))
            return m

        lo, hi = -SPREAD_OFFSET_BRACKET, SPREAD_OFFSET_BRACKET
        for _ in range(SPREAD_OFFSET_WIDEN):
            if at(lo) <= base_mean:
                break
            lo *= 2
        for _ in range(SPREAD_OFFSET_WIDEN):
            if at(hi) >= base_mean:
                break
            hi *= 2
        _bisect(at, lo, hi, base_mean, SPREAD_OFFSET_STEPS)
        _, offset, sd = min(tried)
        return offset, sd

    lo, hi = 0.0, SPREAD_MAX
    best = (0.0, 0.0)
    for _ in range(SPREAD_BISECT_STEPS):
        mid = (lo + hi) / 2
        off, sd = centred(mid)
        if sd < target_sd:
            lo = mid
        else:
            hi = mid
        best = (mid, off)
    return {**out, "chain_spread": best[0], "chain_offset": best[1]}


#: pin_difficulties' search: each request's logit shift within [-PIN_MAX, PIN_MAX], by this
#: many bisection steps, its expected acceptance taken over PIN_DRAWS seeds.
PIN_MAX = 8.0
PIN_BISECT_STEPS = 16
PIN_DRAWS = 16


def pin_difficulties(chain: dict[str, Any], requests: list[list[tuple[int, int, int]]]
                     ) -> list[float]:
    """Each traced request's own logit shift under the chain fit (`chain`: an acceptance
    section's `chain`): the shift at which the request, redrawn as the spread fit redraws it
    (its traced output length, its windows drafting as its traced ones did), accepts on
    average (PIN_DRAWS seeds, common to every step) the share of its drafts it accepted in the
    trace. `requests`: per request, its (position, drafted, accepted) commits in order. A
    request that drafted nothing, or accepted all or none, takes 0 or the bound."""
    out = []
    for r in requests:
        drafted = sum(k for _, k, _ in r)
        if not drafted:
            out.append(0.0)
            continue
        target = sum(a for *_, a in r) / drafted

        def mean_acceptance(shift: float) -> float:
            acc = dr = 0
            for seed in range(PIN_DRAWS):
                model = ChainAcceptance(list(chain["after_miss"]), list(chain["after_hit"]),
                                        float(chain["first"]), int(chain["tokens"]),
                                        RandomStreams(SPREAD_FIT_SEED + seed),
                                        list(chain.get("depth_factor") or [1.0]),
                                        pinned=[shift])
                a, d = redraw_request(model, 0, r)
                acc, dr = acc + a, dr + d
            return acc / max(dr, 1)

        lo, hi = _bisect(mean_acceptance, -PIN_MAX, PIN_MAX, target, PIN_BISECT_STEPS)
        out.append((lo + hi) / 2)
    return out


class _Indexed:
    """A stand-in request: what the acceptance models read of one (its index)."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def redraw_request(model: AcceptanceModel, index: int,
                   commits: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(accepted, drafted) of a traced request redrawn under `model` as request `index`: it
    writes as many tokens as it did in the trace (`commits`: its (position, drafted, accepted)
    in order), its windows drafting as its traced ones did in turn, so an easy request takes
    fewer windows, as in a simulation, and pooled acceptance weighs requests as the engine's
    metric does."""
    req, pos, c, acc, dr = _Indexed(index), commits[0][0], 0, 0, 0
    end = commits[0][0] + sum(a + 1 for *_, a in commits)
    while pos < end:
        k = commits[c % len(commits)][1]
        a = model.accepted(req, k, pos) if k else 0
        acc, dr, pos, c = acc + a, dr + k, pos + a + 1, c + 1
    return acc, dr


def build_acceptance(cfg: Any, streams: RandomStreams,
                     profile_fit: Optional[dict[str, Any]] = None) -> AcceptanceModel:
    """The acceptance model of config `cfg` (`acceptance` group), optionally from a profile."""
    rate = cfg.rate
    p_aa, p_ar, p_first = cfg.p_accept_after_accept, cfg.p_accept_after_reject, cfg.p_accept_first
    pos_rates, pos_tokens = list(cfg.position_rates), cfg.position_tokens
    depth_factors = list(cfg.position_depth_factors) or [1.0]
    if cfg.from_profile:
        if not profile_fit:
            raise ValueError("acceptance.from_profile=true but the cost profile has no "
                             "`acceptance` section (fit one with sim/profile.py)")
        rate = profile_fit["rate"]
        m = profile_fit["markov"]
        p_aa, p_ar, p_first = m["p_accept_after_accept"], m["p_accept_after_reject"], m["p_accept_first"]
        if cfg.model == "position":
            if "position" not in profile_fit:
                raise ValueError("acceptance.model=position with from_profile=true, but the "
                                 "profile's `acceptance` has no `position` section (refit it)")
            pos_rates = list(profile_fit["position"]["rate"])
            pos_tokens = int(profile_fit["position"]["tokens"])
            depth_factors = list(profile_fit["position"].get("depth_factor") or [1.0])
    if cfg.model == "chain":
        chain = (profile_fit or {}).get("chain") if cfg.from_profile else None
        if chain is None:
            raise ValueError("acceptance.model=chain needs acceptance.from_profile=true and a "
                             "profile whose `acceptance` has a `chain` section (fitted from "
                             "traces with grouped windows; refit with sim/profile.py)")
        spread = float(chain.get("spread") or 0.0) if cfg.request_spread else 0.0
        offset = float(chain.get("offset") or 0.0) if cfg.request_spread else 0.0
        # (validate_acceptance: pin_requests comes with from_trace, whose fit has `pinned`)
        pinned = chain.get("pinned") if cfg.pin_requests else None
        return ChainAcceptance(list(chain["after_miss"]), list(chain["after_hit"]),
                               float(chain["first"]), int(chain["tokens"]), streams,
                               list(chain.get("depth_factor") or [1.0]), spread, offset,
                               pinned=pinned)
    if cfg.model == "fixed":
        return FixedRateAcceptance(rate, streams)
    if cfg.model == "position":
        return PositionAcceptance(pos_rates or [rate], pos_tokens, streams, depth_factors)
    if cfg.model == "markov":
        return MarkovAcceptance(p_aa, p_ar, p_first, streams)
    raise ValueError(f"acceptance.model must be fixed, markov, position or chain, got {cfg.model!r}")
