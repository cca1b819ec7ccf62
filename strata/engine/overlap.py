"""engine.overlap: plan and launch window t+1 before reading window t (docs/ENGINE.md,
"Overlapped host scheduling").

A decode plan is launched before the window in flight is read, so the host's planning of it
overlaps the device's run of the previous one; any other plan waits for that read first and
then runs as in the serial step. The read finishes requests one window late: their groups in
the window launched meanwhile are discarded when it is read (tokens past a finish are never
emitted; the rows wrote only the request's own lane, which a new request's binding resets
after them in stream order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from strata.engine.faults import fail_touched
from strata.engine.graph_cache import GraphRun
from strata.engine.postprocess import commit_window
from strata.engine.scheduler import Plan
from strata.engine.slots import RequestState, Slot
from strata.engine.window import WindowShape, window_shape
from strata.kinds import PlanKind

if TYPE_CHECKING:
    from strata.engine.llm_engine import Engine

_DECODE = PlanKind.DECODE  # (an enum member read through its class costs a hook per window)


@dataclass
class Launched:
    """A decode window launched and not yet read."""
    #: (slot, rows, the request the slot held at launch), in window order.
    groups: list[tuple[Slot, int, RequestState]]
    layout: tuple[int, ...]
    shape: WindowShape
    #: Its graph action and size; `output` is the runner's PendingWindow.
    run: GraphRun


class OverlappedWindows:
    """The engine's step for a planned iteration when engine.overlap is on."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        #: The window launched and not yet read.
        self.inflight: Optional[Launched] = None

    def step(self, plan: Plan, outs: dict) -> None:
        eng = self.engine
        prev, self.inflight = self.inflight, None
        if plan.kind != _DECODE:
            if prev is not None:
                self._land(prev, outs)
            eng._run(plan, outs)
            return
        try:
            launched = self._launch(plan)
        except Exception as e:  # the launched window's requests fail; the one in flight lands
            launched = None
            fail_touched(eng, plan.kind, e, [(s, s.req) for s, _ in plan.groups], outs)
        if prev is not None:
            self._land(prev, outs)
        if launched is not None:
            for slot, r, rs in launched.groups:
                if slot.req is rs:
                    slot.inflight = r
            self.inflight = launched

    def _launch(self, plan: Plan) -> Launched:
        eng = self.engine
        w = window_shape(plan.groups, plan.layout, eng.cfg, eng._tier, eng.cache is not None)
        run = eng.runner.launch([(s.id, s.pos, r) for s, r in plan.groups], w.groups, w.rows,
                                w.tier, w.filtered, w.key, timed=eng.trace.active)
        return Launched([(s, r, s.req) for s, r in plan.groups], plan.layout, w, run)

    def _land(self, launched: Launched, outs: dict) -> None:
        """Wait for a launched window, then commit it (postprocess.commit_window)."""
        eng = self.engine
        for slot, _, rs in launched.groups:
            if slot.req is rs:
                slot.inflight = 0
        try:
            rows, dur = eng.runner.read(launched.run.output)
            # The commit too, as the serial step's (_run): a fault in it (the expert cache's
            # swap, detokenizing) escaped step() here, losing the outputs of the step.
            commit_window(eng, launched.groups, launched.layout, launched.shape, launched.run,
                          rows, dur, outs)
        except Exception as e:
            fail_touched(eng, _DECODE, e, [(s, rs) for s, _, rs in launched.groups], outs)
