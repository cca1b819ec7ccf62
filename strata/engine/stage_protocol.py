"""The messages between stage 0 (the driver) and the other stages, all point to point.

Two channels, each a process group of every rank: the forward channel carries what flows with
a window (stage 0's header and the op's inputs to every stage, hidden states from stage k to
k + 1), the backward channel what the last stage returns (a window's output to every earlier
stage, a prompt chunk's token and draft to stage 0, a solo window's tokens to stage 0).
Messages between one pair of ranks on one channel arrive in the order they were sent, so a
message needs no tags, and the two directions never wait for each other: with pipelined slot
groups stage 0 sends a second window's header before the last stage returns the first one's
output (a collective would then be entered in different orders by different ranks). Sends
are asynchronous (the outbox keeps each tensor until its send completes): a sender never
waits for its receiver to get to the message.

  SETUP   [slots, drafting]                 once; then every rank's status (0: its slot state
                                            is built), max-reduced (the one collective)
  BIND    [n] + (n, 4) int64                lanes, (top_k, seed), (temperature, top_p) as
                                            float32 pairs
  WINDOW  [groups, rows, ctx, filtered]    + (3, groups) lane, position, rows per group; a
                                            window of more than 2 rows per group gets its tokens from the
                                            last stage (only it can chain the drafts); output
                                            (groups, rows + 2) from the last stage to every
                                            earlier stage
  PREFILL [bucket, ctx]                     + (bucket + 4): the chunk, then lane, start,
                                            length, next; reply (2,) token and draft to stage 0
  PING    [groups, rows]                    a window's messages without its compute
  STOP    []

No message may be part of a captured graph (another process's half of the exchange cannot be
in it): while a stage captures or replays one (`no_messages`, set by stage_graphs.py), every
send and receive here raises MessageInGraph.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

OP_SETUP, OP_BIND, OP_WINDOW, OP_PREFILL, OP_STOP, OP_PING = 1, 2, 3, 4, 5, 6
HEADER = 6

#: The backward channel's process group (made by `open_channels`; the forward one is WORLD).
_back: Optional[Any] = None
#: Sends not yet known to be complete, with the tensors they read.
_outbox: list[tuple[Any, torch.Tensor]] = []
#: What this stage is doing that no message may be part of (a graph capture or replay), or None.
_refusing: Optional[str] = None


class MessageInGraph(RuntimeError):
    """A send or receive while the stage captures or replays a graph: a bug in the caller."""


@contextmanager
def no_messages(what: str) -> Iterator[None]:
    """Every message inside raises MessageInGraph naming `what` (a graph capture or replay)."""
    global _refusing
    outer, _refusing = _refusing, what
    try:
        yield
    finally:
        _refusing = outer


def _allowed() -> None:
    if _refusing is not None:
        raise MessageInGraph(f"stage_protocol: a message inside {_refusing}; a captured graph "
                             f"must hold only this stage's compute, with its messages outside")


def open_channels() -> None:
    """Every rank calls this once, right after joining the group, in the same order."""
    global _back
    _back = dist.new_group(list(range(dist.get_world_size())))


def close_channels() -> None:
    global _back
    _back = None
    _outbox.clear()


#: Sends the outbox holds per rank of the group before it waits for the oldest. A receiver is
#: at most about `stages` windows (a few messages per stage each) behind its sender, so the
#: oldest of this many has long arrived and waiting for it returns at once (gloo marks a send
#: complete only when waited for).
OUTBOX_PER_RANK = 64


def _post(t: torch.Tensor, dst: int, group: Optional[Any]) -> None:
    _allowed()
    t = t.contiguous()
    work = dist.isend(t, dst, group=group)
    _outbox.append((work, t))
    limit = OUTBOX_PER_RANK * dist.get_world_size()
    if len(_outbox) > limit:
        _outbox[:] = [(w, x) for w, x in _outbox if not w.is_completed()]  # (NCCL knows)
        old = len(_outbox) - limit // 2
        if old > 0:
            for w, _ in _outbox[:old]:
                w.wait()
            del _outbox[:old]


def flush() -> None:
    """Wait until every send of this rank is complete."""
    _allowed()
    for work, _ in _outbox:
        work.wait()
    _outbox.clear()


# ---- forward: stage 0 to every stage, stage k to k + 1 ------------------------------------------
def send_header(op: int, *values: int, device: torch.device) -> None:
    h = torch.tensor([op, *values] + [0] * (HEADER - 1 - len(values)), dtype=torch.long,
                     device=device)
    fan_out(h)


def recv_header(device: torch.device) -> list[int]:
    return recv(torch.empty(HEADER, dtype=torch.long, device=device), 0).tolist()


def fan_out(t: torch.Tensor) -> torch.Tensor:
    """Stage 0: `t` to every other stage."""
    _allowed()
    for k in range(1, dist.get_world_size()):
        _post(t, k, None)
    return t


def send(t: torch.Tensor, dst: int) -> None:
    _post(t, dst, None)


def recv(t: torch.Tensor, src: int) -> torch.Tensor:
    _allowed()
    dist.recv(t, src)
    return t


# ---- backward: the last stage to earlier stages ---------------------------------------------------
def send_back(t: torch.Tensor, dst: int) -> None:
    _post(t, dst, _back)


def back_to_all(t: torch.Tensor) -> None:
    """The last stage: `t` to every earlier stage."""
    _allowed()
    for k in range(dist.get_world_size() - 1):
        _post(t, k, _back)


def recv_back(t: torch.Tensor, src: int) -> torch.Tensor:
    _allowed()
    dist.recv(t, src, group=_back)
    return t


def send_bind(payload: torch.Tensor, device: torch.device) -> None:
    send_header(OP_BIND, payload.shape[0], device=device)
    fan_out(payload)


def gather_status(status: int, device: torch.device) -> int:
    """The largest status over all ranks (each rank passes its own)."""
    _allowed()
    t = torch.tensor([status], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
