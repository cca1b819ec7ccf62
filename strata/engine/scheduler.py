"""Iteration policy: admission, prefill/decode choice, group sizing (docs/SCHEDULING.md).

Pure bookkeeping, no tensors: the engine asks for a plan, runs it on the device, and reports
back what was committed. The simulator in sim/ implements the same rules independently.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from strata.engine.rotation import RotationRing
from strata.engine.slots import DECODE, FREE, PREFILL, RequestState, Slot
from strata.kinds import PlanKind
from strata.trace import TraceWriter

_DECODE_PLAN = PlanKind.DECODE  # (an enum member read through its class costs a hook per window)

@dataclass
class Plan:
    kind: PlanKind
    slot: Optional[Slot] = None  # prefill: the (first) slot
    tokens: int = 0  # prefill: its prompt tokens this chunk
    groups: list[tuple[Slot, int]] = field(default_factory=list)  # decode: (slot, rows)
    #: prefill with engine.prefill_slots > 1: (slot, tokens) of each lane the chunk holds, in
    #: admission order (the first is `slot`, `tokens`); empty: that one slot alone.
    segments: list[tuple[Slot, int]] = field(default_factory=list)

    @property
    def prefill_segments(self) -> list[tuple[Slot, int]]:
        return self.segments or [(self.slot, self.tokens)]

    @property
    def layout(self) -> tuple[int, ...]:
        return tuple(s.id for s, r in self.groups for _ in range(r))


class Scheduler:
    def __init__(self, n_slots: int, *, mode: str, batch_mtp: bool, drafting: bool, spec: int,
                 window_rows: int, decode_share: float, prefill_chunk: int, max_context: int,
                 trace: TraceWriter, batch_invariant: bool = False, pipeline: int = 0,
                 prefill_slots: int = 1, batch_mtp_drafts: Optional[int] = 1):
        """`pipeline` (engine.pipeline_groups): the stages, whose windows of different slots
        are in flight at once (0: off); `prefill_slots` (engine.prefill_slots): the prefilling
        slots one prompt chunk may hold; `batch_mtp_drafts` (engine.batch_mtp_drafts, null:
        spec - 1): the most drafts a batch_mtp group verifies."""
        self.slots = [Slot(i) for i in range(n_slots)]
        self.queue: deque[RequestState] = deque()
        self.ring = RotationRing()
        self.mode, self.batch_mtp, self.drafting = mode, batch_mtp, drafting
        self.spec, self.window_rows = spec, window_rows
        self.batch_mtp_drafts = spec - 1 if batch_mtp_drafts is None else batch_mtp_drafts
        self.batch_invariant = batch_invariant
        self.pipeline = pipeline
        self.decode_share, self.prefill_chunk = decode_share, prefill_chunk
        self.prefill_slots = prefill_slots
        self.max_context = max_context
        self.trace = trace
        self.mixed_iters = 0
        self.mixed_decodes = 0
        self._admit_seq = 0

    # ---- queue and admission -------------------------------------------------------------
    def enqueue(self, rs: RequestState) -> None:
        self.queue.append(rs)
        self.trace.emit("arrive", req=rs.id, prompt_tokens=rs.prompt_len,
                        max_tokens=rs.req.params.max_tokens, filtered=rs.filtered)

    def admit(self) -> list[Slot]:
        admitted = []
        while self.queue:
            free = [s for s in self.slots if s.phase == FREE]
            if not free:
                break
            slot = free[0]
            rs = self.queue.popleft()
            self._admit_seq += 1
            slot.bind(rs, self._admit_seq)
            self.trace.emit("admit", req=rs.id, slot=slot.id)
            admitted.append(slot)
        return admitted

    def release(self, slot: Slot) -> None:
        """A slot whose request ended leaves the ring (if decoding) and becomes free."""
        if slot.phase == DECODE:
            self.ring.leave(slot.id)
        slot.release()

    def start_decoding(self, slot: Slot) -> None:
        slot.phase = DECODE
        self.ring.join(slot.id)

    # ---- planning ----------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.queue) or any(s.phase != FREE for s in self.slots)

    def rows_for(self, slot: Slot, lone: bool, decoding: int = 1) -> int:
        """Rows of the slot's group in the next window; 0: it cannot run in it. `decoding`:
        the slots the window may hold. A window in flight (engine.overlap) may still commit
        `slot.inflight` positions and emit as many tokens: the bounds assume it does, so no row
        ever writes past the context."""
        if self.pipeline and slot.inflight:
            return 0  # its window t + 1 waits for window t's accepted prefix
        spec = self.spec if self.drafting else 1
        if self.mode == "solo" or lone:
            base = spec
        elif self.batch_mtp and self.drafting:
            # one draft, or as many as the window has room for (engine.batch_mtp_drafts)
            base = max(2, min(1 + self.batch_mtp_drafts, self.window_rows // max(1, decoding)))
        else:
            base = 1
        room = self.max_context - slot.pos - slot.inflight
        if room < 1:
            return 0  # it may have reached the end of the context: wait for the window's read
        return max(1, min(base, slot.req.left - slot.inflight, room))

    def plan(self) -> Plan:
        prefilling = [s for s in self.slots if s.phase == PREFILL]
        decoding = self.ring.members
        if prefilling and decoding:
            n = self.mixed_iters + 1
            decode = self.mixed_decodes < self.decode_share * n
            self.mixed_iters = n
            self.mixed_decodes += int(decode)
        elif decoding:
            decode = True
        elif prefilling:
            decode = False
        else:
            return Plan(PlanKind.IDLE)
        if not decode:  # the earliest admitted prefilling slots (prefill_slots), a chunk each
            segs = [(s, min(self.prefill_chunk, s.req.prompt_len - s.prefilled))
                    for s in sorted(prefilling, key=lambda s: s.admit_seq)[:self.prefill_slots]]
            return Plan(PlanKind.PREFILL, slot=segs[0][0], tokens=segs[0][1],
                        segments=segs if len(segs) > 1 else [])
        lone = len(decoding) == 1 and not prefilling
        cap = -(-len(decoding) // self.pipeline) if self.pipeline else None
        n = len(decoding) if cap is None else cap  # the slots the window may hold
        rows = {sid: self.rows_for(self.slots[sid], lone, n) for sid in decoding}
        taken = self.ring.build(lambda sid: rows[sid], self.window_rows, self.batch_invariant, cap)
        if not taken:  # (overlap, pipelining) every decoding slot waits for a window in flight
            return Plan(PlanKind.IDLE)
        return Plan(_DECODE_PLAN, groups=[(self.slots[sid], rows[sid]) for sid in taken])
