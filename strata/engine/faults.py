"""An engine fault (an exception while running or reading an iteration) fails the requests
that iteration touched, never hangs them; a dead pipeline stage fails every request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata.engine.postprocess import record_finish
from strata.kinds import FinishReason

if TYPE_CHECKING:
    from strata.engine.llm_engine import Engine


def fail_touched(eng: "Engine", kind: str, e: Exception, touched: list, outs: dict) -> None:
    """Fail the requests of the (slot, request) pairs the faulted work touched that still hold
    their slot, with a message naming the iteration and the exception."""
    msg = f"engine fault in {kind} iteration {eng.steps}: {type(e).__name__}: {e}"
    eng.log(f"ERROR: {msg}")
    for slot, rs in touched:
        if rs is None or slot.req is not rs:
            continue
        if not rs.finished:
            rs.error = msg
            eng._finish(rs, FinishReason.ERROR, outs)
        else:
            # It finished in the faulted commit before the commit recorded its finish and freed
            # its slot (commit_window does both after every group's emission): do both here,
            # or the slot stays bound to a finished request and the engine never idles.
            if rs.t_finish is None:
                record_finish(eng, rs, outs.get(rs.id))
            eng.scheduler.release(slot)
    if eng.stages is not None and eng.stages.failure is not None:
        from strata.engine.stages import fail_everything
        fail_everything(eng, msg, outs)
