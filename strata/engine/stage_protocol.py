"""The messages between stage 0 (the driver) and the other stages: a fixed-size header that
rank 0 broadcasts (the op and a few integers), then the op's tensors. Every rank takes part in
the same collectives in the same order, so a message needs no tags or acknowledgements.

  SETUP   [slots, drafting]               once, after the driver planned memory; then every
                                          rank's status (0: its slot state is built), max-reduced
  BIND    [n] + (n, 4) int64              lanes, (top_k, seed), (temperature, top_p) as float32 pairs
  WINDOW  [groups, rows, ctx, filtered]   + (3, groups) lane, position, rows per group
  PREFILL [bucket, ctx]                   + (bucket + 4): the chunk, then lane, start, length, next
  PING    [groups, rows]                  a window's messages without its compute (benchmarks)
  STOP    []
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OP_SETUP, OP_BIND, OP_WINDOW, OP_PREFILL, OP_STOP, OP_PING = 1, 2, 3, 4, 5, 6
HEADER = 6


def send_header(op: int, *values: int, device: torch.device) -> None:
    dist.broadcast(torch.tensor([op, *values] + [0] * (HEADER - 1 - len(values)), dtype=torch.long,
                                device=device), 0)


def recv_header(device: torch.device) -> list[int]:
    t = torch.empty(HEADER, dtype=torch.long, device=device)
    dist.broadcast(t, 0)
    return t.tolist()


def broadcast(t: torch.Tensor, src: int) -> torch.Tensor:
    t = t.contiguous()
    dist.broadcast(t, src)
    return t


def send(t: torch.Tensor, dst: int) -> None:
    dist.send(t.contiguous(), dst)


def recv(t: torch.Tensor, src: int) -> torch.Tensor:
    dist.recv(t, src)
    return t


def send_bind(payload: torch.Tensor, device: torch.device) -> None:
    send_header(OP_BIND, payload.shape[0], device=device)
    broadcast(payload, 0)


def gather_status(status: int, device: torch.device) -> int:
    """The largest status over all ranks (each rank passes its own)."""
    t = torch.tensor([status], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
