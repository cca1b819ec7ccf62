"""The rotation ring and its pointer (docs/SCHEDULING.md, "Rotation").

Decoding slots sit in a ring ordered by slot id; the pointer names the slot that starts the
next window, or is empty (then the smallest id starts). A window takes slots from the pointer
onward, wrapping, while the next group fits in the window's rows and not every slot is taken;
the pointer then moves to the ring successor of the last slot taken. Joining never moves the
pointer; leaving moves it only if it named the leaving slot, to the next larger id (wrapping).
"""

from __future__ import annotations

import bisect
from typing import Callable, Optional

from strata.trace import invariant_group_rows


class RotationRing:
    def __init__(self) -> None:
        self._members: list[int] = []  # sorted slot ids
        self.pointer: Optional[int] = None

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, slot: int) -> bool:
        i = bisect.bisect_left(self._members, slot)
        return i < len(self._members) and self._members[i] == slot

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(self._members)

    def join(self, slot: int) -> None:
        if slot in self:
            raise ValueError(f"slot {slot} is already in the ring")
        bisect.insort(self._members, slot)

    def leave(self, slot: int) -> None:
        if slot not in self:
            raise ValueError(f"slot {slot} is not in the ring")
        self._members.remove(slot)
        if self.pointer == slot:
            self.pointer = self._successor_id(slot)

    def _successor_id(self, slot: int) -> Optional[int]:
        """The smallest member id greater than `slot`, wrapping; None if the ring is empty."""
        if not self._members:
            return None
        i = bisect.bisect_right(self._members, slot)
        return self._members[i % len(self._members)]

    def build_window(self, rows_of: Callable[[int], int], window_rows: int,
                     batch_invariant: bool = False, max_groups: Optional[int] = None) -> list[int]:
        """Take slots for one window; returns them in window order and moves the pointer.

        `rows_of(slot)` is the slot's group size. A group that does not fit ends the window
        (slots are never skipped), so the first group always fits when rows_of <= window_rows.
        A slot of 0 rows is passed over (engine.overlap: the window in flight may take it to
        the end of its context; pipelined slot groups: its window is in flight); if every slot is, the window is empty and the pointer stays.
        Batch-invariant windows pad every group to the row count `invariant_group_rows` gives
        for the deepest one: the groups fit while that count times their number is at most
        window_rows. `max_groups` (pipelined slot groups): at most this many slots are taken.
        """
        if not self._members:
            return []
        start = self.pointer if self.pointer is not None else self._members[0]
        i0 = self._members.index(start)
        n = len(self._members)
        taken: list[int] = []
        rows = 0
        group_rows: list[int] = []
        for j in range(n):
            if max_groups is not None and len(taken) == max_groups:
                break
            slot = self._members[(i0 + j) % n]
            r = rows_of(slot)
            if r == 0:
                continue
            if batch_invariant:
                padded = invariant_group_rows(max(group_rows + [r]), window_rows)
                if padded * (len(group_rows) + 1) > window_rows:
                    break
            elif rows + r > window_rows:
                break
            taken.append(slot)
            rows += r
            group_rows.append(r)
        if not taken and all(rows_of(s) == 0 for s in self._members):
            return taken
        if not taken:
            raise ValueError(f"slot {start}'s group of {rows_of(start)} rows exceeds "
                             f"window_rows={window_rows}")
        self.pointer = self._successor_id(taken[-1])
        return taken
