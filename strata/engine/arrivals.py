"""Requests added but not yet due: one heap per clock (engine step, or seconds since start)."""

from __future__ import annotations

import heapq
from typing import Optional

from strata.engine.slots import RequestState


class Arrivals:
    def __init__(self) -> None:
        # (arrival_step | arrival_s, input order, state)
        self._steps: list[tuple[float, int, RequestState]] = []
        self._secs: list[tuple[float, int, RequestState]] = []

    def __bool__(self) -> bool:
        return bool(self._steps) or bool(self._secs)

    def add(self, rs: RequestState, current_step: int) -> None:
        req = rs.req
        if req.arrival_s is not None:
            heapq.heappush(self._secs, (float(req.arrival_s), rs.order, rs))
        else:
            step = req.arrival_step if req.arrival_step is not None else current_step
            heapq.heappush(self._steps, (float(step), rs.order, rs))

    def pop_due(self, step: int, now: float) -> list[RequestState]:
        """Requests due at `step` or by `now`, FIFO by input order whichever clock brought
        them; those finished (cancelled) before arriving are dropped."""
        due = []
        while self._steps and self._steps[0][0] <= step:
            due.append(heapq.heappop(self._steps))
        while self._secs and self._secs[0][0] <= now:
            due.append(heapq.heappop(self._secs))
        return [rs for _, _, rs in sorted(due, key=lambda d: d[1]) if not rs.finished]

    def drop_finished(self) -> None:
        """Forget requests cancelled before they arrived."""
        self._steps = [d for d in self._steps if not d[2].finished]
        self._secs = [d for d in self._secs if not d[2].finished]
        heapq.heapify(self._steps)
        heapq.heapify(self._secs)

    def next_wall_clock(self, now: float, only_secs: bool) -> Optional[float]:
        """Seconds until the next wall-clock arrival, when only such arrivals wait."""
        if self._steps or not self._secs or not only_secs:
            return None
        return max(0.0, self._secs[0][0] - now)
