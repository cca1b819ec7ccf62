"""engine.pipeline_groups: pipelined slot groups across the stages of engine.stages=S.

A decode window is launched (stage 0 runs its layers and hands it on) and landed (the last
stage's output read, committed) apart, with up to S windows of different slots in flight: while
the last stage verifies one group's window, stage 0 runs the next group's. The scheduler makes
the groups (scheduler.py: a slot in flight gets 0 rows, a window takes at most ceil(D / S) of
the D decoding slots, round-robin through the ring), so a slot's window t + 1 always starts
after its window t's accepted prefix is known, and the tokens are those of one stage.

One step (docs/ENGINE.md, "Pipelined slot groups"):
  - a decode plan launches its window; then, with S windows in flight, the oldest lands;
    a window of more than 2 rows per group (a lone slot's chained drafts, which stage 0 must
    ask the last stage for) first lands every window in flight;
  - a prompt chunk first lands every window in flight, then runs as in the serial step;
  - an idle plan (every decoding slot in flight) lands the oldest;
  - admission lands, before binding a slot, every window up to the last that holds it (a
    request cancelled in flight leaves its window behind).
Windows land in launch order; a window event is written when it lands, with `launched`, the
step that launched it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.engine.faults import fail_touched
from strata.engine.overlap import Launched
from strata.engine.postprocess import commit_window
from strata.engine.scheduler import Plan
from strata.engine.window import WindowShape, window_shape
from strata.kinds import PlanKind

if TYPE_CHECKING:
    from strata.engine.llm_engine import Engine

_DECODE, _PREFILL = PlanKind.DECODE, PlanKind.PREFILL


@dataclass
class StagedWindow:
    """A window launched into the stages and not yet landed."""
    launched: Launched
    #: The step that launched it, and when (perf_counter): its window event's `dur` is launch
    #: to land.
    step: int
    t0: float


class PipelinedWindows:
    """The engine's step for a planned iteration when engine.pipeline_groups is on."""

    def __init__(self, engine: "Engine", depth: int):
        self.engine = engine
        self.depth = depth
        self.inflight: deque[StagedWindow] = deque()

    def before_bind(self, slots: list, outs: dict) -> None:
        """Land every window up to the last one holding one of `slots` (about to be bound: a
        request cancelled in flight left its window behind, and the lane's commit must come
        before its reset)."""
        ids = {s.id for s in slots}
        upto = max((i + 1 for i, w in enumerate(self.inflight)
                    if any(s.id in ids for s, _, _ in w.launched.groups)), default=0)
        for _ in range(upto):
            self._land(self.inflight.popleft(), outs)

    def close(self) -> None:
        """Land the windows in flight (unless a stage died): the stages' outputs must be read
        before they stop, or their sends never complete."""
        if self.engine.stages.failure is None:
            self.land_all({})

    def land_all(self, outs: dict) -> None:
        while self.inflight:
            self._land(self.inflight.popleft(), outs)

    def step(self, plan: Plan, outs: dict) -> None:
        eng = self.engine
        if plan.kind == _DECODE:
            w = window_shape(plan.groups, plan.layout, eng.cfg, eng._tier, eng.cache is not None)
            if w.rows > 2:  # its tokens come back behind the outputs in flight
                self.land_all(outs)
            try:
                staged = self._launch(plan, w)
            except Exception as e:  # its requests fail (a dead stage: every request)
                staged = None
                fail_touched(eng, plan.kind, e, [(s, s.req) for s, _ in plan.groups], outs)
            if staged is not None:
                for slot, r, rs in staged.launched.groups:
                    slot.inflight = r
                self.inflight.append(staged)
            if len(self.inflight) >= self.depth:
                self._land(self.inflight.popleft(), outs)
            return
        if not self.inflight:
            eng._run(plan, outs)
        elif plan.kind == _PREFILL:
            self.land_all(outs)
            eng._run(plan, outs)
        else:  # every decoding slot waits for a window in flight
            self._land(self.inflight.popleft(), outs)

    def _launch(self, plan: Plan, w: WindowShape) -> StagedWindow:
        eng = self.engine
        t0 = time.perf_counter()
        run = eng.runner.launch_staged([(s.id, s.pos, r) for s, r in plan.groups], w.groups,
                                       w.rows, w.tier, w.filtered, w.key)
        return StagedWindow(Launched([(s, r, s.req) for s, r in plan.groups], plan.layout, w, run),
                            eng.steps, t0)

    def _land(self, staged: StagedWindow, outs: dict) -> None:
        eng, launched = self.engine, staged.launched
        for slot, _, rs in launched.groups:
            if slot.req is rs:
                slot.inflight = 0
        try:
            rows = eng.runner.land_staged(launched.run.output, len(launched.groups))
            # The commit too, as the serial step's (_run): a fault in it escaped step() here.
            commit_window(eng, launched.groups, launched.layout, launched.shape, launched.run,
                          rows, time.perf_counter() - staged.t0, outs, launched=staged.step)
        except Exception as e:
            fail_touched(eng, _DECODE, e, [(s, rs) for s, _, rs in launched.groups], outs)
