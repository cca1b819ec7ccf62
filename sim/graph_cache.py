"""The graph cache: LRU with a count limit and a memory budget (docs/SCHEDULING.md, "Graph cache").

Two memory policies:
- `counted` (strata): graph memory is part of the plan. The graph budget is
  `total - reserve - weights - slots x slot state - graphs held`; before a capture the cache
  evicts LRU entries until the planned size (the last measured capture, `graph_mib_estimate`
  before any) fits, and runs the window eagerly if it still does not.
- `upstream` (the upstream engine, for studies): graph memory is not counted. The engine has
  filled the card down to its reserve; captures allocate from what is left of it after other
  runtime allocations, and a capture that does not fit fails (the upstream engine then exits).
  Evictions (by count limit) do free memory, so usage levels off at the limit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional


@dataclass
class MemoryFacts:
    """What the memory budget is computed from (the trace's `memory` record)."""
    total_mib: float
    weights_mib: float
    slot_mib: float
    #: Slots whose state is allocated.
    slots: int
    reserve_mib: float
    #: Planned size of a graph before any capture was measured.
    graph_mib_estimate: float
    #: upstream policy: memory taken out of the reserve by non-graph runtime allocations.
    runtime_overhead_mib: float = 0.0


@dataclass
class GraphDecision:
    """What the cache decided for one window."""
    action: str  # hit | capture | eager
    #: (key, reason) in eviction order.
    evictions: list[tuple[str, str]] = field(default_factory=list)
    #: The measured size charged for a capture (MiB).
    captured_mib: float = 0.0
    #: Why the window ran eagerly, when it did.
    eager_reason: Optional[str] = None
    #: upstream policy: the capture found no free memory (the upstream engine exits here).
    capture_failed: bool = False


class GraphCache:
    def __init__(self, limit: int, policy: str, memory: MemoryFacts,
                 measure_capture: Callable[[], float]):
        """`measure_capture()` returns the device memory the next capture takes (MiB)."""
        if limit < 0:
            raise ValueError(f"graph_limit must be >= 0, got {limit}")
        if policy not in ("counted", "upstream"):
            raise ValueError(f"graph policy must be counted or upstream, got {policy!r}")
        self.limit = limit
        self.policy = policy
        self.memory = memory
        self._measure_capture = measure_capture
        self._entries: "OrderedDict[str, float]" = OrderedDict()  # key -> MiB, LRU first
        self._last_measured_mib: Optional[float] = None
        self.captures = 0
        self.keys_seen: set[str] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def keys_lru_first(self) -> list[str]:
        return list(self._entries)

    @property
    def held_mib(self) -> float:
        return sum(self._entries.values())

    @property
    def planned_mib(self) -> float:
        if self._last_measured_mib is None:
            return self.memory.graph_mib_estimate
        return self._last_measured_mib

    def budget_mib(self) -> float:
        """Memory left for graphs (counted: the plan's budget; upstream: what is really free)."""
        m = self.memory
        if self.policy == "upstream":
            return m.reserve_mib - m.runtime_overhead_mib - self.held_mib
        return m.total_mib - m.reserve_mib - m.weights_mib - m.slots * m.slot_mib - self.held_mib

    def _evict_lru(self, protected: Iterable[str], reason: str,
                   out: list[tuple[str, str]]) -> bool:
        keep = set(protected)
        for key in self._entries:
            if key not in keep:
                del self._entries[key]
                out.append((key, reason))
                return True
        return False

    def window(self, key: str, protected: Iterable[str] = ()) -> GraphDecision:
        """Decide how the window keyed `key` runs; `protected` keys are never evicted."""
        self.keys_seen.add(key)
        if key in self._entries:
            self._entries.move_to_end(key)
            return GraphDecision("hit")
        protected = set(protected) | {key}
        evictions: list[tuple[str, str]] = []
        if self.limit > 0 and len(self._entries) >= self.limit:
            self._evict_lru(protected, "limit", evictions)
        if self.policy == "upstream":
            size = self._measure_capture()
            if size > self.budget_mib():
                return GraphDecision("eager", evictions, capture_failed=True,
                                     eager_reason=f"capture of {size:.1f} MiB failed: "
                                     f"{self.budget_mib():.1f} MiB free")
            return self._capture(key, size, evictions)
        while self.planned_mib > self.budget_mib():
            if not self._evict_lru(protected, "memory", evictions):
                break
        if self.planned_mib > self.budget_mib():
            return GraphDecision("eager", evictions, eager_reason=(
                f"graph budget {self.budget_mib():.1f} MiB cannot hold a "
                f"{self.planned_mib:.1f} MiB graph"))
        return self._capture(key, self._measure_capture(), evictions)

    def prewarm(self, keys: Iterable[str]) -> tuple[list[str], list[float]]:
        """Capture `keys` in order before any request, as the engine's warm-up does: it stops
        at the graph limit, or before a capture that would need an eviction to fit. Returns
        the keys captured and their sizes."""
        done: list[str] = []
        sizes: list[float] = []
        for key in keys:
            if self.limit > 0 and len(self._entries) >= self.limit:
                break
            if self.planned_mib > self.budget_mib():
                break
            self.keys_seen.add(key)
            d = self._capture(key, self._measure_capture(), [])
            done.append(key)
            sizes.append(d.captured_mib)
        return done, sizes

    def _capture(self, key: str, size: float, evictions: list[tuple[str, str]]) -> GraphDecision:
        self._entries[key] = size
        if size > 0:  # a capture that measured nothing does not lower the planned size
            self._last_measured_mib = size
        self.captures += 1
        return GraphDecision("capture", evictions, captured_mib=size)
