"""The shape and graph key of a planned decode window (docs/SCHEDULING.md: graph keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from strata.config import EngineConfig
from strata.trace import invariant_window_shape, layout_key, shape_bucket, shape_key


@dataclass
class WindowShape:
    #: Groups the window runs, padding included.
    groups: int
    #: Rows of every group.
    rows: int
    #: Context tier its attention reads.
    tier: int
    #: Its sampler filters (top-k / top-p): part of the graph.
    filtered: bool
    #: Graph-cache key (None: no graph cache).
    key: Optional[str]


def window_shape(groups: list, layout: tuple, ecfg: EngineConfig, tier: Callable[[int], int],
                 cached: bool) -> WindowShape:
    """`groups`: (slot, rows) pairs; `cached`: windows go through a graph cache."""
    g = max(r for _, r in groups)
    # (engine.overlap: the window in flight may first move a slot `inflight` positions on)
    ctx = tier(max(s.pos + s.inflight + r for s, r in groups))
    n_padded = len(groups)
    if ecfg.batch_invariant:  # window_rows rows exactly, whatever the layout
        n_padded, g = invariant_window_shape(g, ecfg.window_rows)
    # The sampler is part of the graph: sort-free unless a request of the window filters.
    filtered = any(s.req.filtered for s, _ in groups)
    key = None
    if cached and ecfg.graph_key == "layout":
        key = layout_key(layout, ctx, filtered)
    elif cached:
        if not ecfg.batch_invariant:
            n_padded = shape_bucket(len(groups), list(ecfg.shape_buckets))
        key = shape_key(n_padded, g, ctx, filtered)
    return WindowShape(n_padded, g, ctx, filtered, key)
