"""The graph cache: captured decode windows kept in a bounded LRU, charged to the memory budget.

A window runs by replaying a captured graph (CUDA graph on GPU; on CPU a recorded plan, so the
same cache logic runs in CI) or eagerly. Rules (docs/SCHEDULING.md): a hit refreshes the entry;
a miss on a full cache evicts the least recently used entry that the current window does not
need; before a capture, LRU entries are evicted until the planned graph size fits the budget;
if it still does not fit, the window runs eagerly and the engine says why. Every failure of
capture or replay becomes an eviction or an eager run with a log line, never a silent exit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Protocol

from strata.engine.memory import MemoryBudget
from strata.kinds import GraphAction
from strata.trace import TraceWriter


#: (An enum member read through its class costs a metaclass attribute hook per window.)
_HIT = GraphAction.HIT


class CaptureBackend(Protocol):
    name: str

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """Record `fn` (no side effects happen); returns (handle, measured MiB)."""

    def replay(self, handle: Any) -> Any:
        """Run a captured handle; returns its output."""

    def release(self, handle: Any) -> None:
        """Free a handle's memory."""


class RecordingBackend:
    """CPU stand-in for CUDA graphs: a 'capture' records the plan (the callable), a replay runs
    it. Each capture is charged a fixed size so the memory arithmetic is exercised on CPU."""

    name = "record"

    def __init__(self, graph_mib: float):
        self.graph_mib = graph_mib

    def capture(self, fn):
        return fn, self.graph_mib

    def replay(self, handle):
        return handle()

    def release(self, handle) -> None:
        pass


class StaticRecordingBackend(RecordingBackend):
    """RecordingBackend whose replays return the same output tensors every time, as a CUDA
    graph's replays do (each replay's results are copied into the first one's), so that code
    reading a graph's output after a later replay of it fails on the CPU too."""

    def capture(self, fn):
        return [fn, None], self.graph_mib

    def replay(self, handle):
        out = handle[0]()
        if handle[1] is None:
            handle[1] = out
            return out
        return _copy_into(handle[1], out)


def _copy_into(dst: Any, src: Any) -> Any:
    """`src`'s tensors copied into `dst`'s (the same nesting of tuples and lists); returns dst."""
    if isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)
    else:
        dst.copy_(src)
    return dst


class CudaGraphBackend:
    """Real CUDA graphs, each with a private memory pool so that evicting one frees its memory.

    A capture's size is what it takes from the device: the larger of the drop in the driver's
    free memory (instantiation, new segments) and the growth of the caching allocator's reserved
    memory (the graph's private pool), across capture and instantiation. A handle is a list
    [graph, output] so that release() can drop the only references to both before it returns
    the pool's memory to the device (a reference held elsewhere would keep the pool alive)."""

    name = "cuda"

    def __init__(self, device, capture_error_mode: str = "global"):
        """`capture_error_mode` (torch.cuda.graph's): "thread_local" where other threads of
        the process use CUDA during a capture (a stage's NCCL watchdog queries its events)."""
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.capture_error_mode = capture_error_mode

    def capture(self, fn):
        torch = self.torch
        torch.cuda.synchronize(self.device)
        free0, _ = torch.cuda.mem_get_info(self.device)
        reserved0 = torch.cuda.memory_reserved(self.device)
        try:
            graph, out = self._capture(fn)
        except torch.cuda.OutOfMemoryError:
            from strata.engine.device import empty_allocator_caches

            # cached blocks of the main pool may hold what the graph's pool needs
            empty_allocator_caches(self.device)
            graph, out = self._capture(fn)
        torch.cuda.synchronize(self.device)
        free1, _ = torch.cuda.mem_get_info(self.device)
        reserved1 = torch.cuda.memory_reserved(self.device)
        taken = max(free0 - free1, reserved1 - reserved0, 0)
        return [graph, out], taken / 2**20

    def _capture(self, fn):
        """torch.cuda.graph's capture (a private pool, on this backend's stream) without its
        emptying of the allocator's caches (device and pinned host) first: the graph's pool
        needs nothing from the main pool's cache, and after every capture of a warm-up the
        emptied blocks would go back to cudaMalloc. MemoryBudget.graph_fits empties them when
        the device's free figure alone refuses a graph."""
        graph = self.torch.cuda.CUDAGraph()
        with self.torch.cuda.stream(self.stream):
            graph.capture_begin(capture_error_mode=self.capture_error_mode)
            try:
                out = fn()
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # the capture's own error is the one to report
                    pass
                raise
            graph.capture_end()
        return graph, out

    def replay(self, handle):
        handle[0].replay()
        return handle[1]

    def release(self, handle) -> None:
        handle.clear()  # the graph and its output go; then their pool can be freed
        self.torch.cuda.empty_cache()


@dataclass
class Entry:
    handle: Any
    mib: float


@dataclass
class GraphRun:
    """What running one window through the cache did."""
    #: hit (replayed), capture (captured, then replayed) or eager (ran without a graph).
    action: GraphAction
    output: Any
    #: The measured size of the graph captured (capture only).
    mib: Optional[float] = None
    #: Keys evicted to make room, in order.
    evicted: list[str] = field(default_factory=list)
    #: A decode window's expert-cache counts on their way to the host
    #: (expert_cache.WindowCounts; None without the cache).
    expert_counts: Any = None
    #: A serial window's device seconds by CUDA events (ModelRunner.decode(timed=True)), or
    #: None: its trace event's `dev`, beside `dur`, the host's wall of the whole call.
    device_s: Optional[float] = None


class GraphCache:
    def __init__(self, limit: int, backend: CaptureBackend, budget: MemoryBudget, trace: TraceWriter,
                 estimate_mib: float, log: Callable[[str], None] = print):
        self.limit = limit
        self.backend = backend
        self.budget = budget
        self.trace = trace
        self.log = log
        self.entries: "OrderedDict[str, Entry]" = OrderedDict()
        self.last_mib = estimate_mib
        self.hits = self.captures = self.eager = self.evictions = 0
        self._warned: set[str] = set()

    @property
    def graphs_mib(self) -> float:
        return sum(e.mib for e in self.entries.values())

    def _evict(self, key: str, reason: str) -> None:
        entry = self.entries.pop(key)
        try:
            self.backend.release(entry.handle)
        finally:
            self.evictions += 1
            self.trace.emit("evict", key=key, reason=reason)

    def _lru_victim(self, pinned: set[str]) -> Optional[str]:
        for key in self.entries:  # OrderedDict iterates least recently used first
            if key not in pinned:
                return key
        return None

    def _warn_once(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            self.log(f"WARNING: {text}")
            self.trace.emit("warning", text=text)

    def has_room(self) -> bool:
        """A capture now would need no eviction: below the limit, and the planned size fits."""
        return ((self.limit <= 0 or len(self.entries) < self.limit)
                and self.budget.graph_fits(self.last_mib, self.graphs_mib))

    def _make_room(self, key: str, pinned: Iterable[str]) -> list[str]:
        """Evict for the limit, then for memory, never `key` or `pinned`; returns the keys."""
        keep = set(pinned) | {key}
        evicted = []
        if self.limit > 0 and len(self.entries) >= self.limit:
            victim = self._lru_victim(keep)
            if victim is not None:
                self._evict(victim, "limit")
                evicted.append(victim)
        while not self.budget.graph_fits(self.last_mib, self.graphs_mib):
            victim = self._lru_victim(keep)
            if victim is None:
                break
            self._evict(victim, "memory")
            evicted.append(victim)
        return evicted

    def _choose(self, key: str, fn: Callable[[], Any], warm: Callable[[], None],
                pinned: Iterable[str]) -> tuple[str, Callable[[], Any], Optional[float], list[str]]:
        """How a window whose key has no entry runs: captured, or eagerly."""
        evicted = self._make_room(key, pinned)
        if not self.budget.graph_fits(self.last_mib, self.graphs_mib):
            self._warn_once("memory", f"graph memory exhausted (planned {self.last_mib:.1f} MiB, "
                                      f"budget {self.budget.graph_budget_mib(self.graphs_mib):.1f} MiB "
                                      f"above reserve {self.budget.reserve_mib} MiB): windows "
                                      f"without a cached graph run eagerly")
            self.eager += 1
            return GraphAction.EAGER, fn, None, evicted
        try:
            warm()
            handle, mib = self.backend.capture(fn)
        except Exception as e:  # a CUDA error during capture: run eagerly, never exit
            self._warn_once("capture:" + type(e).__name__,
                            f"graph capture failed for {key} ({type(e).__name__}: {e}); running eagerly")
            self.eager += 1
            return GraphAction.EAGER, fn, None, evicted
        self.entries[key] = Entry(handle, mib)
        self.last_mib = mib if mib > 0 else self.last_mib
        self.captures += 1
        return GraphAction.CAPTURE, lambda: self.backend.replay(handle), mib, evicted

    def run(self, key: str, fn: Callable[[], Any], warm: Callable[[], None],
            pinned: Iterable[str] = ()) -> GraphRun:
        """Run the window with `key`: replay its graph, capture one, or run `fn` eagerly.

        `fn` is the window's function (reading static inputs); `warm()` runs it once on
        scratch state before a capture, so that lazy initialisation happens outside it.
        `pinned` keys are never evicted for this window. A failed replay drops the graph (it
        may have moved part of the state) and raises, so the caller fails the window cleanly.
        """
        entry = self.entries.get(key)
        if entry is not None:  # the steady state: no closures, no room to make
            self.entries.move_to_end(key)
            self.hits += 1
            try:
                return GraphRun(_HIT, self.backend.replay(entry.handle))
            except Exception:
                self.drop(key, "error")
                raise
        action, call, mib, evicted = self._choose(key, fn, warm, pinned)
        try:
            output = call()
        except Exception:
            if action != GraphAction.EAGER:
                self.drop(key, "error")
            raise
        return GraphRun(action, output, mib, evicted)

    def stats(self: Optional["GraphCache"]) -> dict:
        """Counters for Engine.stats (all zero without a cache: call as GraphCache.stats(c))."""
        c = self
        return {"graph_entries": len(c.entries) if c else 0, "graph_captures": c.captures if c else 0,
                "graph_evictions": c.evictions if c else 0, "graph_hits": c.hits if c else 0,
                "graph_eager": c.eager if c else 0, "graphs_mib": c.graphs_mib if c else 0.0}

    def drop(self, key: str, reason: str = "error") -> None:
        """Evict an entry whose replay failed."""
        if key in self.entries:
            self._evict(key, reason)

    def clear(self) -> None:
        for key in list(self.entries):
            self.backend.release(self.entries.pop(key).handle)
