"""Named kinds shared by the engine, the simulator and the trace (torch-free).

String-valued (StrEnum), so a member equals, prints and serialises as the plain string the
trace has always held: `PlanKind.PREFILL == "prefill"`, `json.dumps(GraphAction.HIT) == '"hit"'`.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """What a slot is doing."""
    FREE = "free"
    PREFILL = "prefill"
    DECODE = "decode"


class PlanKind(StrEnum):
    """What one engine iteration runs."""
    PREFILL = "prefill"
    DECODE = "decode"
    IDLE = "idle"


class GraphAction(StrEnum):
    """How a window ran: replaying a cached graph, capturing one, or without a graph."""
    HIT = "hit"
    CAPTURE = "capture"
    EAGER = "eager"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCEL = "cancel"
    ERROR = "error"
