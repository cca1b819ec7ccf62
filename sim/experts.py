"""The expert cache, as the simulator models it (issue 17; docs/SIMULATOR.md, "Expert cache").

An engine with `engine.expert_cache_mib > 0` keeps `slots` routed experts per MoE layer on the
device and reads the others from host memory inside the window. Per window, what matters is
the distinct (layer, expert) pairs its rows route to, and which of them were resident at the
window's start (a hit) or not (a miss).

- `RoutingModel`: per-layer expert popularity, fitted from a routing profile JSON
  (scripts/profile_routing.py; COMMON.md's contract) or a Zipf law of exponent `skew` (the
  engine's `model.dummy_routing_skew`: expert e's popularity falls off like (e+1)^-s, expert 0
  the most popular). A window of R rows draws, per layer and row, top_k distinct experts with
  probability proportional to popularity (Gumbel top-k), independently across rows and windows:
  the profile gives marginal counts only. The one dependence modelled is within a group (one
  request's consecutive positions): each of a row's top_k picks repeats the previous row's
  pick in that place with probability `row_overlap` (trained routers route neighbouring
  tokens alike; random dummy routers do not, 0). A prompt chunk is one group of its tokens.
- `ExpertCacheModel`: the resident set and its adaptive swap, modelled as the engine runs it
  (strata/engine/expert_cache.py): the first fill is the `slots` most popular experts of each
  layer (the profile's counts, ties to the lower id; the lowest ids without a profile); the
  decode windows' routed picks accumulate, and every `adapt_every` decode windows the decayed
  counts become counts x decay + the picks since the last adaptation, and each layer swaps its
  least-counted resident for its most-counted missing expert while the missing one counts more
  (at most `swap_limit` per layer, the engine's 1; 0 = no limit). Prompt chunks pay their
  misses but, as in the engine, do not count. A forward of more rows than `call_rows` (strata's
  MoE kernel takes 32 a call) reads a missed expert over the bus once per call that routes to
  it: `reads`, what sim/expert_costs.py prices (a miss is still counted once).
- `RecordedExperts`: replay. Hits, misses and bus bytes come from the trace's window events,
  in order, the way replay takes acceptance from commits; a swap is replayed at the step the
  trace has it, and the simulator emits it only at the read of a window that ends an adapt
  period, so a swap anywhere else is a divergence.
- engine.overlap: a window is launched before the one before it is read. An adaptation is
  decided at the read of the window that ends its period, from the picks of the windows up to
  that one; the window already in flight ran on the slots as they were, the next one launched
  runs on the new ones, and its device work waits for the whole swap copy (queued after the
  window in flight), where a serial loop's copy overlaps the host's planning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np

from .files import read_json

#: Added to every profiled count before it becomes a popularity: an expert the profile never
#: saw routed keeps a small chance (a finite profile misses rare experts).
PROFILE_PSEUDOCOUNT = 0.5


class ExpertModelError(ValueError):
    """A routing profile or expert setting that cannot be used (names the file or key)."""


@dataclass
class WindowExperts:
    """One forward's experts: distinct (layer, expert) pairs resident at its start (hits)
    and not (misses), summed over the MoE layers; `reads`: the missed experts' reads over
    the bus, one per MoE kernel call that routes to them (the kernel takes at most
    `call_rows` rows a call, so a longer forward can read a missed expert more than once;
    None = misses)."""
    hits: int
    misses: int
    reads: Optional[int] = None

    def __post_init__(self) -> None:
        if self.reads is None:
            self.reads = self.misses

    @property
    def distinct(self) -> int:
        return self.hits + self.misses


@dataclass
class ExpertSwap:
    """An adaptive swap: experts copied host -> device across all layers, and their bytes."""
    experts: int
    bytes: int


class ExpertSource(Protocol):
    """What the scheduler asks of the expert cache (the model in predict, the trace in
    replay)."""
    #: The engine runs an expert cache (engine.expert_cache_mib > 0): windows carry hits,
    #: misses and bus_bytes. Off: the model only prices the experts' bytes, all resident.
    cache_on: bool
    slots: int
    experts: int
    moe_layers: int
    expert_bytes: int

    def window(self, step: int, groups: list[int]) -> WindowExperts: ...

    def prefill(self, step: int, tokens: int) -> WindowExperts: ...

    def after_window(self, step: int) -> Optional[ExpertSwap]:
        """Called once per window read, in launch order (under engine.overlap the next window
        has been launched by then): the swap when this window ends an adapt period."""
        ...


# --- routing ---------------------------------------------------------------------------------

class RoutingModel:
    """Per-layer expert popularity (`popularity[layer]` sums to 1) and top_k."""

    def __init__(self, popularity: np.ndarray, top_k: int, counts: Optional[np.ndarray] = None,
                 row_overlap: float = 0.0):
        p = np.asarray(popularity, dtype=np.float64)
        if p.ndim != 2 or p.shape[0] < 1 or p.shape[1] < 1:
            raise ExpertModelError(f"popularity must be [layers][experts], got shape {p.shape}")
        if not 1 <= top_k <= p.shape[1]:
            raise ExpertModelError(f"top_k must be in [1, {p.shape[1]}], got {top_k}")
        if (p < 0).any() or (p.sum(axis=1) <= 0).any():
            raise ExpertModelError("popularity must be >= 0 with a positive sum per layer")
        self.popularity = p / p.sum(axis=1, keepdims=True)
        self.top_k = int(top_k)
        if not 0.0 <= row_overlap <= 1.0:
            raise ExpertModelError(f"experts.row_overlap: must be in [0, 1], got {row_overlap}")
        self.row_overlap = float(row_overlap)
        #: What orders the first fill (the profile's counts; the popularity otherwise).
        self.fill_order_counts = self.popularity if counts is None else np.asarray(counts, float)
        with np.errstate(divide="ignore"):
            self._log_p = np.log(self.popularity)

    @property
    def layers(self) -> int:
        return self.popularity.shape[0]

    @property
    def experts(self) -> int:
        return self.popularity.shape[1]

    @classmethod
    def zipf(cls, layers: int, experts: int, top_k: int, skew: float,
             row_overlap: float = 0.0) -> "RoutingModel":
        """Expert e of every layer routed with popularity proportional to (e+1)^-skew (0 =
        uniform): the synthetic skew of the engine's dummy routers."""
        if skew < 0:
            raise ExpertModelError(f"experts.skew: must be >= 0, got {skew}")
        p = (np.arange(1, experts + 1, dtype=np.float64) ** -float(skew))[None, :]
        return cls(np.repeat(p, layers, axis=0), top_k, row_overlap=row_overlap)

    @classmethod
    def from_profile(cls, path: str | Path, row_overlap: float = 0.0) -> "RoutingModel":
        """Fit from a routing profile JSON: popularity = (counts + PROFILE_PSEUDOCOUNT)
        normalised per layer."""
        d = load_routing_profile(path)
        counts = np.asarray(d["counts"], dtype=np.float64)
        return cls(counts + PROFILE_PSEUDOCOUNT, int(d["top_k"]), counts=counts,
                   row_overlap=row_overlap)

    def draw(self, groups: list[int], rng: np.random.Generator) -> np.ndarray:
        """Selections of a forward whose groups have these row counts, per layer: an int
        array [layers][experts] counting the row picks of each expert (a row picks top_k
        experts, distinct unless row_overlap repeats a pick)."""
        return self.draw_calls(groups, rng, 0).sum(axis=0)

    def draw_calls(self, groups: list[int], rng: np.random.Generator,
                   call_rows: int) -> np.ndarray:
        """`draw`, split by MoE kernel call: [calls][layers][experts] picks, the forward's
        rows in order, `call_rows` rows a call (0 = one call). The draw itself does not
        depend on the split."""
        L, E, k = self.layers, self.experts, self.top_k
        rows = int(sum(groups))
        if rows <= 0:
            return np.zeros((1, L, E), dtype=np.int64)
        # Gumbel top-k: the k largest log p + Gumbel noise are a draw of k distinct experts
        # without replacement, with probability proportional to p.
        keys = self._log_p[:, None, :] + rng.gumbel(size=(L, rows, E))
        chosen = np.argpartition(-keys, k - 1, axis=2)[:, :, :k] if k < E else \
            np.broadcast_to(np.arange(E), (L, rows, E)).copy()
        if self.row_overlap > 0:
            start = 0
            for g in groups:
                for r in range(start + 1, start + g):
                    keep = rng.random((L, k)) < self.row_overlap
                    chosen[:, r, :] = np.where(keep, chosen[:, r - 1, :], chosen[:, r, :])
                start += g
        step = call_rows if 0 < call_rows < rows else rows
        calls = []
        for r0 in range(0, rows, step):
            flat = (np.arange(L)[:, None, None] * E + chosen[:, r0:r0 + step, :]).ravel()
            calls.append(np.bincount(flat, minlength=L * E).reshape(L, E))
        return np.stack(calls)


def expected_distinct_uniform(experts: int, top_k: int, rows: int) -> float:
    """Distinct experts per layer that `rows` rows of uniform routing touch on average:
    E * (1 - (1 - k/E)^R) (REAL_SCALE_NOTES.md)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def load_routing_profile(path: str | Path) -> dict[str, Any]:
    """A routing profile JSON (COMMON.md): {"model", "layers", "experts", "top_k", "tokens",
    "counts": [[E ints] per MoE layer], "windows", "distinct_per_window"}; checked."""
    p = Path(path)
    d = read_json(p, "routing profile", ExpertModelError)
    if not isinstance(d, dict):
        raise ExpertModelError(f"{p}: routing profile must be a JSON object")
    missing = [k for k in ("layers", "experts", "top_k", "counts") if k not in d]
    if missing:
        raise ExpertModelError(f"{p}: routing profile lacks {missing}")
    counts, E = d["counts"], d["experts"]
    # (a JSON true is an int to Python; a NaN or infinite count would make the popularity NaN)
    if isinstance(E, bool) or not isinstance(E, int) or E < 1:
        raise ExpertModelError(f"{p}: experts must be a positive int, got {E!r}")
    if isinstance(d["top_k"], bool) or not isinstance(d["top_k"], int) or not 1 <= d["top_k"] <= E:
        raise ExpertModelError(f"{p}: top_k must be an int in [1, experts={E}], got {d['top_k']!r}")
    if not isinstance(d["layers"], list):
        raise ExpertModelError(f"{p}: layers must be a list (the MoE layers' ids), got "
                               f"{d['layers']!r}")
    if not isinstance(counts, list) or not counts or len(counts) != len(d["layers"]):
        got = len(counts) if isinstance(counts, list) else repr(counts)
        raise ExpertModelError(f"{p}: counts must hold one list per entry of layers "
                               f"({len(d['layers'])}), got {got}")
    for i, row in enumerate(counts):
        if not isinstance(row, list) or len(row) != E or any(
                isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < math.inf
                for c in row):
            raise ExpertModelError(f"{p}: counts[{i}] must be {E} finite non-negative numbers")
    return d


# --- the resident set ------------------------------------------------------------------------

class ExpertCacheModel:
    """Resident sets of `slots` experts per layer, their decayed counts and the adaptive swap;
    one `rng` stream draws every forward's routing."""

    def __init__(self, routing: RoutingModel, slots: int, adapt_every: int, decay: float,
                 swap_limit: int, expert_bytes: int, rng: np.random.Generator,
                 cache_on: bool = True, call_rows: int = 0, prefill_launch_rows: int = 0):
        if slots < 0:
            raise ExpertModelError(f"expert slots must be >= 0, got {slots}")
        if call_rows < 0:
            raise ExpertModelError(f"experts.call_rows: must be >= 0, got {call_rows}")
        #: Rows of one MoE kernel call (strata's MOE_MAX_ROWS; 0 = a forward is one call).
        self.call_rows = int(call_rows)
        if prefill_launch_rows < 0:
            raise ExpertModelError(f"experts.prefill_launch_rows: must be >= 0, got "
                                   f"{prefill_launch_rows}")
        #: Without the cache: rows of one routed-expert launch in a prompt chunk (0: one).
        self.prefill_launch_rows = int(prefill_launch_rows)
        if not 0.0 < decay <= 1.0:
            raise ExpertModelError(f"experts.decay: must be in (0, 1], got {decay}")
        self.routing = routing
        self.experts = routing.experts
        self.moe_layers = routing.layers
        self.slots = min(int(slots), self.experts)
        self.adapt_every = int(adapt_every)
        self.decay = float(decay)
        self.swap_limit = int(swap_limit)
        self.expert_bytes = int(expert_bytes)
        self.rng = rng
        self.cache_on = bool(cache_on)
        order = np.argsort(-routing.fill_order_counts, axis=1, kind="stable")
        self.resident = np.zeros((self.moe_layers, self.experts), dtype=bool)
        np.put_along_axis(self.resident, order[:, :self.slots], True, axis=1)
        #: Decayed counts as of the last adaptation, and the picks routed since.
        self.counts = np.zeros((self.moe_layers, self.experts), dtype=np.float64)
        self.routed = np.zeros((self.moe_layers, self.experts), dtype=np.float64)
        #: The picks of windows launched and not yet read (under engine.overlap one window runs
        #: ahead of the read that may adapt: its picks belong to the next period).
        self._unread: list[np.ndarray] = []
        self.read = 0
        self.swapped = 0

    def _forward(self, groups: list[int]) -> tuple[WindowExperts, np.ndarray]:
        calls = self.routing.draw_calls(groups, self.rng, self.call_rows)
        sel = calls.sum(axis=0)
        #: The last forward's selections [layer][expert] (for checks and tests).
        self.last_selection = sel
        touched = sel > 0
        hits = int(np.count_nonzero(touched & self.resident))
        misses = int(np.count_nonzero(touched)) - hits
        reads = int(np.count_nonzero((calls > 0) & ~self.resident[None])) \
            if len(calls) > 1 else misses
        return WindowExperts(hits, misses, reads), sel

    def window(self, step: int, groups: list[int]) -> WindowExperts:
        """A decode window's hits and misses against the resident set as it is at its launch
        (under engine.overlap a swap decided at the previous window's read reaches only the
        windows launched after that read, as in the engine)."""
        x, sel = self._forward(groups)
        self._unread.append(sel)
        return x

    def prefill(self, step: int, tokens: int) -> WindowExperts:
        """A prompt chunk routes its tokens through the same cache (its misses cost bus
        time too); the engine counts only decode windows, so it adds no counts. Without the
        cache a chunk of more than `prefill_launch_rows` rows runs several launches, each
        reading the distinct experts of its own rows: their hits add up."""
        rows = self.prefill_launch_rows
        if self.cache_on or not rows or tokens <= rows:
            return self._forward([tokens])[0]
        parts = [self._forward([min(rows, tokens - s)])[0] for s in range(0, tokens, rows)]
        return WindowExperts(sum(x.hits for x in parts), sum(x.misses for x in parts),
                             sum(x.reads for x in parts))

    def after_window(self, step: int) -> Optional[ExpertSwap]:
        """The read of the oldest unread window: its picks count, and when it ends an adapt
        period (every adapt_every-th window launched), the adaptation runs on the picks of the
        windows up to it, as the engine's (strata/engine/expert_cache.py after_launch)."""
        self.read += 1
        if self._unread:
            self.routed += self._unread.pop(0)
        if not self.adapt_every or self.read % self.adapt_every or self.slots >= self.experts:
            return None
        n = self.adapt()
        return ExpertSwap(n, n * self.expert_bytes) if n else None

    def adapt(self) -> int:
        """Swap, per layer, the least-counted residents for the most-counted missing experts
        while the missing one counts more; returns the experts copied."""
        self.counts = self.counts * self.decay + self.routed
        self.routed[:] = 0.0
        if self.slots == 0:
            return 0
        total = 0
        for layer in range(self.moe_layers):
            c, res = self.counts[layer], self.resident[layer]
            ins = np.flatnonzero(~res)
            outs = np.flatnonzero(res)
            ins = ins[np.argsort(-c[ins], kind="stable")]
            outs = outs[np.argsort(c[outs], kind="stable")]
            n = min(len(ins), len(outs))
            if self.swap_limit:
                n = min(n, self.swap_limit)
            k = int(np.count_nonzero(c[ins[:n]] > c[outs[:n]]))
            if k:
                res[ins[:k]] = True
                res[outs[:k]] = False
                total += k
        self.swapped += total
        return total


class RecordedExperts:
    """Replay: each window's hits and misses and each swap as the engine's trace has them."""

    def __init__(self, windows: list[tuple[int, int]], swaps: dict[int, ExpertSwap],
                 slots: int, experts: int, moe_layers: int, expert_bytes: int,
                 adapt_every: int):
        self._windows = list(windows)
        self._swaps = dict(swaps)
        self.slots, self.experts = int(slots), int(experts)
        self.moe_layers, self.expert_bytes = int(moe_layers), int(expert_bytes)
        self.adapt_every = int(adapt_every)
        self.cache_on = True
        self.windows = 0
        self.read = 0

    def window(self, step: int, groups: list[int]) -> WindowExperts:
        i = self.windows
        self.windows += 1
        if i < len(self._windows):
            return WindowExperts(*self._windows[i])
        # The replay ran a window the trace lacks: the event comparison reports it.
        return WindowExperts(0, 0)

    def prefill(self, step: int, tokens: int) -> WindowExperts:
        return WindowExperts(0, 0)

    def after_window(self, step: int) -> Optional[ExpertSwap]:
        self.read += 1
        if not self.adapt_every or self.read % self.adapt_every:
            return None
        return self._swaps.get(step)


def window_fields(x: WindowExperts, expert_bytes: int) -> dict[str, int]:
    """The window event's expert fields (COMMON.md contract)."""
    return {"hits": x.hits, "misses": x.misses, "bus_bytes": x.misses * int(expert_bytes)}
