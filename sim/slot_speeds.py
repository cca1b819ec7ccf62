"""How a window's device time depends on the engine's slot count, from the profile fit's per-run
speed factors.

On the H200 the tiny model's windows of one shape took 4-6% longer in an 8-slot engine than
in a 1- or 4-slot one (4x1 at tier 256: 335 us with 4 slots, 350-363 us with 8; 4x2: 365
against 380-384; 1x4: 455 with one slot, 473 with 8), steadily, run after run, while the
cells an 8-slot engine served (8x1, 8x2) matched to 1%. A cost keyed by window shape alone
priced the served 4-slot cells 5-6% dear (issue 21). The fit's speed polish (sim.profile
._trace_speeds) already splits each run's log seconds into a cell effect and a run effect
over the cells runs share; a run's effect is its speed, slot count included. So:

- in the group of linked runs that spans the most slot counts (the main group), the scale of
  slot count s is the geometric mean of the speed factors of its runs at s: the runs' own
  speeds average out, the slot count's stays;
- every window sample is divided by its run's factor as before (main group), or, for a run
  outside the main group (its shapes shared with no run of another slot count, e.g. plain
  batch at 4 slots, whose 4x1 windows no other run has steadily), by its factor times its
  group's slot scale: its cells are then at the main group's speed too;
- a prediction with n slots multiplies window times by the scale at n (CostProfile
  .for_slots), linear in log2(slots) between the slot counts measured, clamped outside.

A run's speed with its slot count's share taken out (`residual`) is what the prediction
range's spread reads: the slot count is no run-to-run noise.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class SlotFit:
    """`scale`: slot count -> window-time factor (empty: no slot scale, one slot count or
    none linked); `divisor`: per trace, what its window samples are divided by; `residual`:
    per trace, its speed with the slot count's share taken out."""
    scale: dict[int, float] = field(default_factory=dict)
    divisor: dict[int, float] = field(default_factory=dict)
    residual: dict[int, float] = field(default_factory=dict)

    def at(self, slots: int) -> float:
        """The scale at `slots` (linear in log2 between the measured counts, clamped)."""
        if not self.scale:
            return 1.0
        xs = sorted(self.scale)
        x = math.log2(max(1, slots))
        if x <= math.log2(xs[0]):
            return self.scale[xs[0]]
        if x >= math.log2(xs[-1]):
            return self.scale[xs[-1]]
        hi = next(i for i, n in enumerate(xs) if math.log2(n) >= x)
        lo, up = xs[hi - 1], xs[hi]
        w = (x - math.log2(lo)) / (math.log2(up) - math.log2(lo))
        return self.scale[lo] + w * (self.scale[up] - self.scale[lo])

    def as_profile_field(self) -> Optional[dict[str, list]]:
        """decode.slot_scale of a cost profile (None without a scale)."""
        if not self.scale:
            return None
        xs = sorted(self.scale)
        return {"slots": xs, "scale": [round(self.scale[n], 4) for n in xs]}


def trace_slots(cfg: dict[str, Any]) -> Optional[int]:
    """The slot count an engine ran, from its trace's `config` event: the memory budget's
    `slots` (what fit), else the asked `engine.slots` (1 in solo mode); None if unstated."""
    mem, eng = cfg.get("memory") or {}, cfg.get("engine") or {}
    if mem.get("slots") is not None:
        return int(mem["slots"])
    if eng.get("mode") == "solo":
        return 1
    return int(eng["slots"]) if eng.get("slots") is not None else None


def fit_slot_scale(speeds: dict[int, float], groups: dict[int, int],
                   slots: dict[int, Optional[int]]) -> SlotFit:
    """The slot scale from the window polish's per-trace `speeds`, the judged traces' linked
    `groups` (trace -> group name) and each trace's slot count (None: unknown, left as is)."""
    members: dict[int, list[int]] = defaultdict(list)
    for n, g in groups.items():
        members[g].append(n)

    def counts(g: int) -> set[int]:
        return {slots[n] for n in members[g] if slots.get(n) is not None}

    plain = SlotFit(divisor=dict(speeds), residual=dict(speeds))
    if not members:
        return plain
    main = max(sorted(members), key=lambda g: (len(counts(g)), len(members[g])))
    if len(counts(main)) < 2:
        return plain
    logs: dict[int, list[float]] = defaultdict(list)
    for n in members[main]:
        if slots.get(n) is not None:
            logs[slots[n]].append(math.log(speeds[n]))
    fit = SlotFit(scale={s: math.exp(sum(v) / len(v)) for s, v in logs.items()})
    for n, speed in speeds.items():
        s = slots.get(n)
        if s is None:
            fit.divisor[n] = fit.residual[n] = speed
        elif groups.get(n) == main:
            fit.divisor[n], fit.residual[n] = speed, speed / fit.scale[s]
        else:  # its group's cells are at that group's slot counts' speed
            known = [m for m in (members[groups[n]] if n in groups else [n])
                     if slots.get(m) is not None]
            centre = math.exp(sum(math.log(fit.at(slots[m])) for m in known) / len(known))
            fit.divisor[n] = speed * centre
            fit.residual[n] = speed * centre / fit.at(s)
    return fit
