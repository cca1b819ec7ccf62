"""The rotation policy: which decoding slots fill the next window (docs/SCHEDULING.md).

Active slots form a ring ordered by slot id; a pointer names the slot that starts the next
window. A window takes slots from the pointer onward, wrapping, until the next group would not
fit in W rows or every slot is in; the pointer then moves past the last slot taken. A batch-
invariant window (`engine.batch_invariant`) runs its groups padded to one row count, a divisor
of W (strata.trace.invariant_group_rows): a group fits when all the groups taken, padded so,
still come to at most W rows. A slot of 0 rows (engine.overlap: the window in flight may take
it to the end of its context; pipelined slot groups: its group's window is in flight) is
passed over. With pipelined slot groups (engine.pipeline_groups) a window takes at most
ceil(D / S) slots, D decoding slots over S stages, so that S windows of different slots can be
in flight at once.
"""

from __future__ import annotations

from typing import Callable, Optional

from strata.trace import invariant_group_rows


class RotationRing:
    def __init__(self) -> None:
        self.members: list[int] = []  # decoding slot ids, ascending
        self.pointer: Optional[int] = None

    def join(self, slot: int) -> None:
        """A slot that finished prefill joins; the pointer does not move."""
        if slot in self.members:
            raise ValueError(f"slot {slot} is already in the ring")
        self.members.append(slot)
        self.members.sort()

    def leave(self, slot: int) -> None:
        """A slot leaves; if the pointer named it, the pointer moves to its ring successor."""
        self.members.remove(slot)
        if self.pointer == slot:
            later = [s for s in self.members if s > slot]
            self.pointer = later[0] if later else (self.members[0] if self.members else None)

    def build(self, rows_of: Callable[[int], int], window_rows: int,
              batch_invariant: bool = False, max_groups: Optional[int] = None) -> list[int]:
        """Slots of the next window, in window order; advances the pointer. `max_groups`
        (pipelined slot groups): take at most this many slots."""
        if not self.members:
            return []
        start = self.pointer if self.pointer in self.members else self.members[0]
        i0 = self.members.index(start)
        n = len(self.members)
        taken: list[int] = []
        used = deepest = 0
        for step in range(n):
            if max_groups is not None and len(taken) == max_groups:
                break
            slot = self.members[(i0 + step) % n]
            r = rows_of(slot)
            if r == 0:
                continue
            if batch_invariant:
                g = invariant_group_rows(max(deepest, r), window_rows)
                if (len(taken) + 1) * g > window_rows:
                    break
                deepest = max(deepest, r)
            elif used + r > window_rows:
                break
            taken.append(slot)
            used += r
        if not taken and rows_of(start) > 0:  # one group always fits: spec <= W is a config invariant
            raise RuntimeError(f"slot {start} needs {rows_of(start)} rows > window_rows={window_rows}")
        if not taken:
            return taken
        last = self.members.index(taken[-1])
        self.pointer = self.members[(last + 1) % n]
        return taken
