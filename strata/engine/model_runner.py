"""Runs planned windows on the device: static input buffers, graph cache, eager fallback.

The window's inputs (slot, position and row count per group) go into one static device buffer;
graphs captured for a key read slices of it, so a replay needs only a small host-to-device copy
and returns one small tensor. Padding groups (up to the shape bucket) point at the scratch lane
with one row at position 0: they compute but write nowhere that is read.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from strata.engine.graph_cache import GraphCache
from strata.engine.memory import MemoryBudget
from strata.engine.verifier import Verifier
from strata.trace import prefill_bucket


class ModelRunner:
    def __init__(self, verifier: Verifier, cache: Optional[GraphCache], device: torch.device,
                 max_groups: int, scratch_lane: int, log: Callable[[str], None] = print,
                 prefill_buckets: tuple[int, ...] = (), prefill_graphs: Optional[Any] = None,
                 budget: Optional[MemoryBudget] = None):
        """`prefill_buckets`: lengths prompt chunks are padded to; `prefill_graphs`: a capture
        backend for them (None: prompt chunks run eagerly), charged to `budget`."""
        self.verifier = verifier
        self.cache = cache
        self.device = device
        self.scratch = scratch_lane
        self.log = log
        pin = device.type == "cuda"
        self.inputs = torch.zeros(3, max_groups, dtype=torch.long, device=device)
        self.host_inputs = torch.zeros(3, max_groups, dtype=torch.long, pin_memory=pin)
        self.host_np = self.host_inputs.numpy()  # cheap element writes on the hot path
        # Prompt chunks: a static token buffer and (lane, start, length, next token) on the device.
        self.buckets = tuple(prefill_buckets)
        self.p_tokens = torch.zeros(max(self.buckets, default=1), dtype=torch.long, device=device)
        self.p_meta = torch.zeros(4, dtype=torch.long, device=device)
        self.p_host = torch.zeros(4, dtype=torch.long, pin_memory=pin)
        self.p_backend = prefill_graphs
        self.budget = budget
        self.p_graphs: dict[tuple[int, int], Any] = {}  # (bucket, ctx) -> captured handle
        self.p_graphs_mib = 0.0
        self._p_failed = False

    # ---- prompt chunks ------------------------------------------------------------------------
    def _set_meta(self, lane: int, start: int, n: int, next_token: Optional[int]) -> None:
        h = self.p_host
        h[0], h[1], h[2], h[3] = lane, start, n, -1 if next_token is None else next_token
        self.p_meta.copy_(h)  # blocking: h is reused at once

    def prefill(self, lane: int, prompt: torch.Tensor, start: int, n: int, next_token: Optional[int],
                tier: Callable[[int], int]) -> tuple[str, torch.Tensor]:
        """Run prompt[start:start+n] of `lane`; returns (graph action, (1,) device token)."""
        b = prefill_bucket(n, self.buckets)  # past the last bucket: unpadded
        ctx = tier(start + b)
        if b > self.p_tokens.shape[0]:
            self.p_tokens = torch.zeros(b, dtype=torch.long, device=self.device)
        self.p_tokens[:n].copy_(prompt[start:start + n])
        self._set_meta(lane, start, n, next_token)
        run = lambda: self.verifier.prefill(self.p_tokens[:b], self.p_meta, ctx)  # noqa: E731
        key = (b, ctx)
        if self.p_backend is None or b not in self.buckets or self._p_failed:
            return "eager", run()
        handle = self.p_graphs.get(key)
        if handle is not None:
            return "hit", self.p_backend.replay(handle)
        if self.budget is not None and self.budget.graph_budget_mib(
                (self.cache.graphs_mib if self.cache else 0.0)) < (self.cache.last_mib if self.cache else 0.0):
            return "eager", run()
        try:
            # Warm on the scratch lane first: lazy initialisation must not happen in a capture.
            self._set_meta(self.scratch, 0, 1, None)
            run()
            handle, mib = self.p_backend.capture(run)
        except Exception as e:  # a CUDA error in capture: prompt chunks run eagerly from now on
            self._p_failed = True
            self.log(f"WARNING: prefill graph capture failed for bucket {b} ctx {ctx} "
                     f"({type(e).__name__}: {e}); prompt chunks run eagerly")
            self._set_meta(lane, start, n, next_token)
            return "eager", run()
        self.p_graphs[key] = handle
        self.p_graphs_mib += mib
        if self.budget is not None:
            self.budget.fixed_graphs_mib += mib
        if len(self.p_graphs) == 1:
            self.log(f"INFO prefill graphs: captured bucket {b} ctx {ctx} ({mib:.1f} MiB); one per "
                     f"(bucket, context tier) as prompts need them, charged to the memory budget")
        self._set_meta(lane, start, n, next_token)
        return "capture", self.p_backend.replay(handle)

    def release_prefill_graphs(self) -> None:
        for handle in self.p_graphs.values():
            self.p_backend.release(handle)
        self.p_graphs.clear()
        if self.budget is not None:
            self.budget.fixed_graphs_mib -= self.p_graphs_mib
        self.p_graphs_mib = 0.0

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
        if n_padded < len(groups):
            raise RuntimeError(f"window of {len(groups)} groups planned into {n_padded} padded "
                               f"groups: a group would be dropped")
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
