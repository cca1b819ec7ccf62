"""What the warm-up runs: every window shape and prompt-chunk bucket an engine can plan, and
the shape-keyed window graphs its requests will use (ModelRunner.warmup runs the plan)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from strata.config import EngineConfig
from strata.trace import (context_tiers, invariant_shapes, shape_bucket, shape_key,
                          warm_window_keys)


@dataclass
class WarmupPlan:
    #: (groups, rows per group) of every window to run once.
    window_shapes: list[tuple[int, int]]
    #: Context tiers each window shape runs at.
    window_tiers: list[int]
    #: Prompt-chunk lengths to run once (and to capture, at every tier they can read).
    prefill_buckets: list[int]
    every_tier: list[int]
    max_context: int
    #: (key, (groups bucket, rows, tier)) of the window graphs to capture, in order; None when
    #: windows are not captured ahead (no graph cache, or layout keys: too many to enumerate).
    window_keys: Optional[list[tuple[str, tuple[int, int, int]]]]
    #: The most slots' chunks one prompt chunk holds (engine.prefill_slots, at most the slots).
    #: Above 1, every bucket also runs once as a chunk of this many segments: a segment count
    #: past 1 is a dimension torch.compile treats as dynamic, compiled then for every count.
    prefill_segments: int = 1


@dataclass
class WarmupDone:
    windows: int = 0
    prefill_graphs: int = 0
    #: The window graphs captured, in order, and their measured MiB (a replay starts from them).
    window_keys: list[str] = field(default_factory=list)
    window_mib: list[float] = field(default_factory=list)
    #: Graphs torch.compile traced during the warm-up (dynamo's counter; 0: nothing compiled,
    #: or the model's regions were compiled by an earlier engine).
    compiled_graphs: int = 0
    #: Of those, the graphs inductor loaded from its on-disk cache (compile workers, or an
    #: earlier process) instead of compiling them.
    cached_graphs: int = 0
    #: Wall time of the warm-up, compile workers included.
    seconds: float = 0.0

    def facts(self) -> dict:
        """What a benchmark records of it."""
        return {"seconds": round(self.seconds, 1), "compiled_graphs": self.compiled_graphs,
                "cached_graphs": self.cached_graphs, "window_graphs": len(self.window_keys),
                "prefill_graphs": self.prefill_graphs}

    def describe(self, plan: WarmupPlan) -> str:
        slots = (f" (also as chunks of {plan.prefill_segments} slots)"
                 if plan.prefill_segments > 1 else "")
        cached = f" ({self.cached_graphs} from the compile cache)" if self.cached_graphs else ""
        traced = (f"{self.compiled_graphs} graphs compiled{cached}, "
                  if self.compiled_graphs else "")
        return (f"warm-up: {self.windows} window shapes and {len(plan.prefill_buckets)} prompt "
                f"buckets{slots} run once, {traced}{self.prefill_graphs} prompt-chunk graphs and "
                f"{len(self.window_keys)} window graphs captured, in {self.seconds:.1f} s (compiling "
                f"and capturing happen here, not in requests)")


def plan_warmup(ecfg: EngineConfig, n_slots: int, most_rows: int, max_context: int,
                graph_cache: bool, prefill_slots: int) -> WarmupPlan:
    """`most_rows`: the deepest group a window can hold; `graph_cache`: windows replay graphs;
    `prefill_slots`: engine.prefill_slots as the engine resolved it (config.prefill_slots_of)."""
    every_tier = context_tiers(ecfg.context_tier_min, max_context)
    if ecfg.batch_invariant:
        shapes = set(invariant_shapes(most_rows, ecfg.window_rows))
    else:
        shapes = set()
        for g in range(1, most_rows + 1):
            groups = max(1, min(n_slots, ecfg.window_rows // g))
            if ecfg.graph_key == "shape":
                top = shape_bucket(groups, list(ecfg.shape_buckets))
                shapes.update((b, g) for b in ecfg.shape_buckets if b <= top)
            else:
                shapes.update((n, g) for n in range(1, groups + 1))
    keys = None
    if graph_cache and ecfg.graph_key == "shape":
        keys = [(shape_key(b, g, t, False), (b, g, t))
                for b, g, t in warm_window_keys(n_slots, most_rows, ecfg.window_rows,
                                                list(ecfg.shape_buckets), ecfg.context_tier_min,
                                                max_context, ecfg.batch_invariant)]
    return WarmupPlan(
        window_shapes=sorted(shapes),
        # a second context length makes torch.compile treat it as dynamic
        window_tiers=every_tier[:2],
        prefill_buckets=[b for b in ecfg.prefill_buckets if b <= max_context],
        every_tier=every_tier, max_context=max_context, window_keys=keys,
        prefill_segments=max(1, min(prefill_slots, n_slots)))
