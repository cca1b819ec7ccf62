"""Rotation ring and pointer rules (docs/SCHEDULING.md, "Rotation"), on hand-worked examples."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.rotation import RotationRing


def ring_of(*slots):
    r = RotationRing()
    for s in slots:
        r.join(s)
    return r


def two_rows(_slot):
    return 2


def test_empty_pointer_starts_at_smallest_and_wraps():
    # Four 2-row groups fill W=8; with 6 slots the windows rotate 0-3, 4,5,0,1, 2-5, ...
    r = ring_of(5, 0, 3, 1, 4, 2)
    assert r.pointer is None
    assert r.build_window(two_rows, 8) == [0, 1, 2, 3]
    assert r.pointer == 4
    assert r.build_window(two_rows, 8) == [4, 5, 0, 1]
    assert r.pointer == 2
    assert r.build_window(two_rows, 8) == [2, 3, 4, 5]
    assert r.pointer == 0


def test_all_taken_pointer_stays_on_first_taken():
    r = ring_of(1, 3, 6)
    r.pointer = 3
    assert r.build_window(two_rows, 8) == [3, 6, 1]
    assert r.pointer == 3  # the successor of the last taken (1) is the first taken


def test_group_that_does_not_fit_ends_the_window_without_skipping():
    rows = {0: 2, 1: 4, 2: 1, 3: 2}
    r = ring_of(0, 1, 2, 3)
    r.pointer = 1
    # 1 (4 rows), 2 (5), 3 (7), 0 would make 9 > 8: stop; 0 is not skipped over for nothing.
    assert r.build_window(rows.get, 8) == [1, 2, 3]
    assert r.pointer == 0
    rows[0] = 6
    # From 0: 6 rows, then 1 (4 rows) would make 10: stop at one group though 2 (1 row) fits.
    assert r.build_window(rows.get, 8) == [0]
    assert r.pointer == 1


def test_join_never_moves_pointer():
    r = ring_of(2, 5)
    r.pointer = 5
    r.join(3)
    r.join(7)
    assert r.pointer == 5
    assert r.build_window(two_rows, 8) == [5, 7, 2, 3]


def test_join_with_empty_pointer_keeps_it_empty():
    r = ring_of(4)
    r.leave(4)
    assert r.pointer is None
    r.join(6)
    r.join(2)
    assert r.pointer is None
    assert r.build_window(two_rows, 4) == [2, 6]


def test_leave_moves_pointer_only_if_it_named_the_slot():
    r = ring_of(0, 2, 4, 6)
    r.pointer = 4
    r.leave(2)
    assert r.pointer == 4
    r.leave(4)
    assert r.pointer == 6  # next larger id
    r.leave(6)
    assert r.pointer == 0  # wraps to the smallest
    r.leave(0)
    assert r.pointer is None  # ring empty


def test_leaving_in_window_order_chains_pointer_moves():
    # Window (3,3,5,5,0,0) took everyone; pointer back on 3. Slots 3 and 5 finish: they leave
    # in window order, so the pointer goes 3 -> 5 (then the smallest id above 3) -> 0.
    r = ring_of(0, 3, 5)
    r.pointer = 3
    assert r.build_window(two_rows, 8) == [3, 5, 0]
    assert r.pointer == 3
    r.leave(3)
    assert r.pointer == 5
    r.leave(5)
    assert r.pointer == 0


def test_upstream_layout_example():
    # The layout from the upstream crash log: slots 2,2,3,3,0,0,1,1 is the window that starts
    # at pointer 2 over a ring of four 2-row slots.
    r = ring_of(0, 1, 2, 3)
    r.pointer = 2
    taken = r.build_window(two_rows, 8)
    assert [s for s in taken for _ in range(2)] == [2, 2, 3, 3, 0, 0, 1, 1]


def test_group_larger_than_window_is_an_error():
    r = ring_of(0)
    with pytest.raises(ValueError, match="exceeds window_rows"):
        r.build_window(lambda s: 5, 4)


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 15), min_size=1, max_size=16), st.integers(1, 8),
       st.integers(0, 40))
def test_every_slot_gets_a_turn(slots, group_rows, start):
    """With equal groups, consecutive windows visit every slot before any slot twice."""
    window = 8
    group_rows = min(group_rows, window)
    r = ring_of(*slots)
    order = sorted(slots)
    r.pointer = order[start % len(order)]
    seen = []
    while len(seen) < len(slots):
        seen.extend(r.build_window(lambda s: group_rows, window))
    assert sorted(seen[:len(slots)]) == order
    assert r.pointer in slots
