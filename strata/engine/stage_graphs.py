"""Graphs on a layer split (engine.stages > 1): each stage captures its own window compute.

On a split a window is, on each stage, compute between messages (stage_protocol.py): stage 0
embeds the tokens and runs its layers, then sends the hidden states; a middle stage receives
them, runs its layers and sends; the last stage receives them and verifies (its layers, head,
sampling, acceptance, commit, MTP draft), then returns the output. A graph cannot hold a message
(the other process's half of the exchange is not in it), so each stage copies a window's
inputs into static buffers (`StaticInputs`), receives into them, replays the graph of its
compute (`StageGraphs`, a GraphCache of the stage's own, charged to its own device's budget)
and sends what the graph wrote. While a stage captures or replays, stage_protocol refuses every
message (`MessageFreeBackend`), so a message put inside a captured region raises, on the CPU in
CI as on CUDA.

Output buffers. A graph writes the same output buffers on every replay. Stage 0 and the middle
stages read a window's DeltaNet rows (rec factors, conv snapshots) when the window lands, and
with pipelined slot groups up to `depth` = engine.stages windows are in flight, of which several
may have the same shape. So each shape has `depth` graphs there (one on the last stage, which
reads its output right after the replay), used in turn: a copy's previous window is `depth`
windows of that shape back, and since stage 0 has at most `depth` windows in flight it has
landed. A middle stage commits a window only when a later message touches its slots
(PendingCommits), so it may hold more: before it replays a copy still held, it lands the window
holding it (the last stage sent that output long ago).
(Copying them out of one graph per shape instead would add a copy of every DeltaNet layer's
rows to every window; extra graphs cost memory once, and only when pipelining.) The
graphs of windows in flight are pinned: never evicted before they land. The hidden states and
the last stage's output are sent from a copy, because a send is asynchronous (NCCL runs it on
its own stream) and the next replay must not overwrite the buffer under it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from strata.engine import stage_protocol as proto
from strata.engine.graph_cache import CudaGraphBackend, GraphCache, StaticRecordingBackend
from strata.engine.memory import MemoryBudget
from strata.trace import TraceWriter


class MessageFreeBackend:
    """A capture backend during whose captures and replays every stage message raises."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name = inner.name

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        with proto.no_messages("a graph capture"):
            return self.inner.capture(fn)

    def replay(self, handle: Any) -> Any:
        with proto.no_messages("a graph replay"):
            return self.inner.replay(handle)

    def release(self, handle: Any) -> None:
        self.inner.release(handle)


def pipeline_depth(ecfg: Any) -> int:
    """Windows stage 0 may have in flight: engine.stages with pipelined slot groups, else 1."""
    return int(ecfg.stages) if ecfg.pipeline_groups else 1


class StageGraphs:
    """One stage's window graphs: a GraphCache keyed by the window's shape and its turn among
    the shape's `depth` copies, or None (engine.graphs=false: every window runs eagerly)."""

    def __init__(self, cache: Optional[GraphCache], depth: int):
        self.cache = cache
        self.depth = depth
        #: The copy each shape's next window uses.
        self._turns: dict[tuple, int] = {}
        #: Keys of the graphs whose windows are in flight (their outputs not yet read), oldest
        #: first: pinned in the cache.
        self.held: list[str] = []

    @classmethod
    def for_stage(cls, ecfg: Any, device: torch.device, budget: MemoryBudget,
                  log: Callable[[str], None], holds_outputs: bool = True) -> "StageGraphs":
        """`holds_outputs`: windows' outputs are read when they land (stage 0, a middle
        stage), so each shape has a graph per window in flight; the last stage reads its
        output right after the replay, so one per shape."""
        depth = pipeline_depth(ecfg) if holds_outputs else 1
        if not ecfg.graphs:
            return cls(None, depth)
        inner = (CudaGraphBackend(device, capture_error_mode="thread_local") if device.type == "cuda"
                 else StaticRecordingBackend(ecfg.cpu_graph_mib))
        trace = TraceWriter(None)  # the driver's trace records windows, not a stage's graphs
        trace.keep = False
        limit = int(ecfg.graph_limit) * depth  # (0: unbounded)
        cache = GraphCache(limit, MessageFreeBackend(inner), budget, trace,
                           ecfg.graph_mib_estimate, log=log)
        return cls(cache, depth)

    @property
    def captured(self) -> bool:
        """Whether windows replay graphs (else they run eagerly)."""
        return self.cache is not None

    def run(self, shape: tuple, fn: Callable[[], Any], warm: Callable[[], None],
            hold: bool = False, land: Optional[Callable[[str], None]] = None
            ) -> tuple[Any, Optional[str]]:
        """`fn`'s output (it reads only static inputs), replayed from the graph of `shape`'s
        next copy (captured first, after `warm()`), and the graph's key. `hold`: its outputs
        are read when the window lands, so the graph stays pinned until `release(key)`.
        `land(key)`: lands the window still holding that copy, if one does (a middle stage
        commits lazily, so its windows in flight are not bounded by `depth`); without it, a
        copy still held is a bug."""
        turn = self._turns.get(shape, 0)
        key = "x".join(str(v) for v in shape) + f"#{turn}"
        if key in self.held:
            if land is None:
                raise RuntimeError(f"stage graph {key}: replayed while the window that last "
                                   f"replayed it is in flight (its outputs not yet read)")
            land(key)
        self._turns[shape] = (turn + 1) % self.depth
        if self.cache.backend.name == "record":  # nothing lazy to initialise outside a recording
            warm = _nothing
        out = self.cache.run(key, fn, warm, pinned=self.held).output
        if hold:
            self.held.append(key)
        return out, key

    def release(self, key: Optional[str]) -> None:
        """A held window landed: its graph may be replayed for a later window or evicted."""
        if key is not None:
            self.held.remove(key)

    def stats(self) -> dict:
        return GraphCache.stats(self.cache)


def _nothing() -> None:
    pass


class StaticInputs:
    """The input buffers a stage's graphs read, one per name and shape (a graph reads the same
    addresses on every replay): a window's inputs are copied or received into them."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, *shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        buf = self._bufs.get((name, shape, dtype))
        if buf is None:
            buf = self._bufs[name, shape, dtype] = torch.zeros(*shape, dtype=dtype,
                                                               device=self.device)
        return buf


def scratch_plan(like: torch.Tensor, scratch: int) -> torch.Tensor:
    """A plan (lane, position, rows per group; `like`'s leading rows of it) that points every
    group at the scratch lane with one row at position 0: what a capture's warm-up runs, so
    that no real state moves twice."""
    plan = torch.zeros_like(like)
    plan[0] = scratch
    if plan.shape[0] > 2:
        plan[2] = 1
    return plan
