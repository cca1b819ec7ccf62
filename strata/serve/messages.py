"""The messages between the server and its engine process (torch-free: both import it).

Plain dataclasses of builtins, pickled over multiprocessing pipes; the server never needs torch
or numpy to unpickle them.

  server -> engine (commands): Submit, Cancel, Stop
  engine -> server (events):   Ready, Accepted, Rejected, Outputs (one engine step's rows),
                               Stats, Fatal (sent just before a non-zero exit)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


# ---- server -> engine ---------------------------------------------------------------------------
@dataclass
class Submit:
    req_id: str
    #: protocol.GenRequest.engine_spec()
    spec: dict[str, Any]


@dataclass
class Cancel:
    req_id: str


@dataclass
class Stop:
    """Close the engine and exit 0."""


# ---- engine -> server ---------------------------------------------------------------------------
@dataclass
class Ready:
    #: model_name, max_context, pid, generation, slots, vocab_size, eos_ids
    info: dict[str, Any]


@dataclass
class Accepted:
    req_id: str
    prompt_tokens: int


@dataclass
class Rejected:
    req_id: str
    #: The request field at fault (None: not classified).
    field: Optional[str]
    message: str


@dataclass
class OutputRow:
    """One request's output of one engine step (a streaming delta)."""
    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    #: Only on the finishing row: queue_s, prefill_s, first_token_s, decode_s, drafted, accepted.
    timings: Optional[dict[str, Any]] = None

    def joined(self, later: "OutputRow") -> "OutputRow":
        """This row followed by `later` as one: token ids and text concatenated, the rest
        from `later`."""
        return OutputRow(later.req_id, self.new_token_ids + later.new_token_ids,
                         self.new_text + later.new_text, later.finished, later.finish_reason,
                         later.error, later.prompt_tokens, later.output_tokens, later.timings)


@dataclass
class Outputs:
    rows: list[OutputRow] = field(default_factory=list)


@dataclass
class Stats:
    #: Engine.stats(), at most every STATS_EVERY_S and when work runs out.
    stats: dict[str, Any]


@dataclass
class Fatal:
    message: str
    traceback: Optional[str] = None
