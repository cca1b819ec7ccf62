"""The layer split's time model (engine.stages, engine.pipeline_groups; docs/SIMULATOR.md,
"Stages and pipelined slot groups").

A window's device time `dur` (the cost profile's, for the whole model on one device) splits
over the S stages in proportion to their decoder layers: t_k = dur * layers_k / depth. Between
two stages the hidden states take `handoff_s`. Each stage runs one window part at a time, in
launch order: a window's part on stage k starts when its part on stage k - 1 has ended and
been handed over, and stage k has finished the part before it. Unpipelined, a window is alone
on the stages: it takes dur + (S - 1) * handoff_s. Pipelined, a window of another group enters
stage 0 as soon as stage 0 is free, so with S groups in flight one window ends every
max_k t_k (plus the hand-off when it is the larger), not every dur.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class StagePipeline:
    #: Each stage's share of a window's device time (sums to 1).
    fractions: list[float]
    #: Seconds to hand the hidden states from one stage to the next.
    handoff_s: float = 0.0
    #: When each stage is next free (simulated seconds).
    free: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.free:
            self.free = [0.0] * len(self.fractions)

    @classmethod
    def from_knobs(cls, knobs: Any, handoff_s: float = 0.0) -> Optional["StagePipeline"]:
        """The split of engine.stages / engine.stage_layers (None for one stage). Under
        stage_layers=auto the engine records the counts it chose in its trace; a prediction
        from auto assumes equal counts."""
        n = int(getattr(knobs, "stages", 1))
        if n < 2:
            return None
        layers = str(getattr(knobs, "stage_layers", "auto"))
        counts = [1] * n if layers == "auto" else [int(c) for c in layers.split(",")]
        total = sum(counts)
        return cls([c / total for c in counts], float(handoff_s))

    def serial_time(self, dur: float) -> float:
        """An unpipelined window: every stage in turn, with the hand-offs between them."""
        return dur + (len(self.fractions) - 1) * self.handoff_s

    def launch(self, start: float, dur: float) -> float:
        """A pipelined window launched at `start`; returns when its last stage ends."""
        t = start
        for k, f in enumerate(self.fractions):
            if k:
                t += self.handoff_s
            t = max(t, self.free[k]) + dur * f
            self.free[k] = t
        return t
