"""Slots (decoding lanes bound to one request each) and the per-request bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from strata.engine.request import Request

from strata.kinds import Phase

FREE, PREFILL, DECODE = Phase.FREE, Phase.PREFILL, Phase.DECODE


@dataclass
class RequestState:
    req: Request
    order: int  # input order: FIFO ties and output order
    emitted: list[int] = field(default_factory=list)
    slot: Optional[int] = None
    finished: bool = False
    reason: Optional[str] = None
    error: Optional[str] = None
    cancel_requested: bool = False
    #: Its TextStream (when it streams text or watches stop strings), made at the first token.
    text_stream: Optional[object] = None
    # Timing (seconds since engine start) for PP / TG / E2E.
    t_arrive: Optional[float] = None
    t_admit: Optional[float] = None
    t_first: Optional[float] = None
    t_last: Optional[float] = None
    t_finish: Optional[float] = None
    prefill_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    prompt_tensor: Optional[object] = None  # the prompt ids on the device, set at admission
    #: The request's sampling filters (top-k / top-p): read per window, so computed once here.
    filtered: bool = field(init=False)

    def __post_init__(self):
        self.filtered = self.req.params.filtered

    @property
    def id(self) -> str:
        return self.req.id

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def left(self) -> int:
        return self.req.params.max_tokens - len(self.emitted)


@dataclass
class Slot:
    id: int
    phase: Phase = FREE
    req: Optional[RequestState] = None
    prefilled: int = 0  # prompt tokens already run
    pos: int = 0  # committed positions (the pending token sits at pos)
    admit_seq: int = 0  # admission order, for "prefilling slot admitted earliest"
    #: engine.overlap, engine.pipeline_groups: rows of this slot's group in the window launched
    #: and not yet read (it may commit that many positions and emit that many tokens the host
    #: does not know of; pipelined, the slot waits for it).
    inflight: int = 0

    def bind(self, rs: RequestState, seq: int) -> None:
        self.phase, self.req, self.prefilled, self.pos, self.admit_seq = PREFILL, rs, 0, 0, seq
        self.inflight = 0
        rs.slot = self.id

    def release(self) -> None:
        if self.req is not None:
            self.req.slot = None
        self.phase, self.req, self.prefilled, self.pos, self.inflight = FREE, None, 0, 0, 0
