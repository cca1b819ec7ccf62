"""Runs planned windows on the device: static input buffers, graph cache, eager fallback.

The window's inputs (slot, position and row count per group) go into one static device buffer;
graphs captured for a key read slices of it, so a replay needs only a small host-to-device copy
and returns one small tensor. Padding groups (up to the shape bucket) point at the scratch lane
with one row at position 0: they compute but write nowhere that is read.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from strata.engine.graph_cache import GraphCache
from strata.engine.verifier import Verifier


class ModelRunner:
    def __init__(self, verifier: Verifier, cache: Optional[GraphCache], device: torch.device,
                 max_groups: int, scratch_lane: int, log: Callable[[str], None] = print):
        self.verifier = verifier
        self.cache = cache
        self.device = device
        self.scratch = scratch_lane
        self.log = log
        pin = device.type == "cuda"
        self.inputs = torch.zeros(3, max_groups, dtype=torch.long, device=device)
        self.host_inputs = torch.zeros(3, max_groups, dtype=torch.long, pin_memory=pin)
        self.host_np = self.host_inputs.numpy()  # cheap element writes on the hot path

    def _fill(self, groups: list[tuple[int, int, int]], n: int, pad_all: bool = False) -> None:
        h = self.host_np
        h[0, :n] = self.scratch
        h[1, :n] = 0
        h[2, :n] = 1
        if not pad_all:
            for i, (lane, pos, rows) in enumerate(groups):
                h[0, i], h[1, i], h[2, i] = lane, pos, rows
        self.inputs[:, :n].copy_(self.host_inputs[:, :n], non_blocking=True)

    def _fn(self, n: int, g: int, ctx: int, filtered: bool):
        gs, gp, rows = self.inputs[0, :n], self.inputs[1, :n], self.inputs[2, :n]
        return lambda: self.verifier.window(gs, gp, rows, g, ctx, filtered)

    def decode(self, groups: list[tuple[int, int, int]], n_padded: int, g: int, ctx: int,
               filtered: bool, key: Optional[str], pinned: set[str]) -> tuple[str, list[list[int]]]:
        """Run a window of (lane, pos, rows) groups; returns (graph action, host rows).
        `filtered` picks the window's sampler, so it must be part of `key`."""
        if n_padded > self.inputs.shape[1]:
            raise RuntimeError(f"window of {n_padded} groups exceeds the {self.inputs.shape[1]} "
                               f"input rows sized at start")
        self._fill(groups, n_padded)
        if self.cache is None or key is None:
            action, run = "eager", self._fn(n_padded, g, ctx, filtered)
        else:
            def warm() -> None:
                # One eager run on the scratch lane: lazy initialisation (library handles,
                # kernels) must not happen inside a capture, and the real state must not move.
                if self.cache.backend.name != "record":
                    self._fill(groups, n_padded, pad_all=True)
                    self._fn(n_padded, g, ctx, filtered)()
                    self._fill(groups, n_padded)

            action, run = self.cache.lookup(key, pinned, lambda: self._fn(n_padded, g, ctx, filtered),
                                            warm)
        try:
            out = run()
        except Exception:
            # A failed replay may have moved part of the state: drop the graph, and let the
            # engine fail the window's requests cleanly rather than guess.
            if action != "eager" and self.cache is not None:
                self.cache.drop(key, "error")
            raise
        return action, out[: len(groups)].tolist()
