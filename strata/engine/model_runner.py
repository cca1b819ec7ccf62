"""Runs planned windows on the device: static input buffers, graph cache, eager fallback.

The window's inputs (slot, position and row count per group) go into one static device buffer;
graphs captured for a key read slices of it, so a replay needs only a small host-to-device copy
and returns one small tensor. Padding groups (up to the shape bucket) point at the scratch lane
with one row at position 0: they compute but write nowhere that is read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from strata.config import EngineConfig
from strata.engine.graph_cache import CudaGraphBackend, GraphCache, GraphRun, RecordingBackend
from strata.engine.memory import MemoryBudget
from strata.kinds import GraphAction
from strata.engine.verifier import Verifier
from strata.engine.warmup import WarmupDone, WarmupPlan
from strata.trace import TraceWriter, prefill_bucket, shape_bucket

#: Seconds between the warm-up's progress lines.
PROGRESS_S = 15.0


@dataclass
class PendingWindow:
    """A window launched and not yet read (engine.overlap)."""
    #: Its output rows, in host memory once `end` has passed.
    host: torch.Tensor
    groups: int
    start: Optional[Any]
    end: Optional[Any]
    #: CPU: the seconds the window took to run (it ran inside the launch).
    cpu_s: float


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
        # Two host input buffers: an overlapped window (`launch`) fills one while the copy
        # from the other may still be queued behind the window running on the device.
        self._host_bufs = [torch.zeros(3, max_groups, dtype=torch.long, pin_memory=pin)
                           for _ in range(2)]
        self._host_at = 0
        self._host_nps = [b.numpy() for b in self._host_bufs]  # cheap element writes
        self.host_inputs, self.host_np = self._host_bufs[0], self._host_nps[0]
        # Views of both input buffers by padded group count, made once: a torch slice costs
        # microseconds of host time, and a window took five of them.
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}
        # Overlapped windows' outputs land in pinned host buffers (two per shape, alternating)
        # while the next window runs; CUDA events time them on the device.
        self._out_bufs: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._out_at = 0
        # Prompt chunks: a static token buffer and (lane, start, length, next token) on the device.
        self.buckets = tuple(prefill_buckets)
        self.p_tokens = torch.zeros(max(self.buckets, default=1), dtype=torch.long, device=device)
        self.p_meta = torch.zeros(4, dtype=torch.long, device=device)
        self.p_host = torch.zeros(4, dtype=torch.long, pin_memory=pin)
        self.p_backend = prefill_graphs
        self.budget = budget
        self.p_graphs: dict[tuple, Any] = {}  # ([segments,] bucket, ctx, filtered) -> handle
        # engine.prefill_slots: token, meta and pinned meta buffers by segment count
        self.p_seg_tokens: dict[int, torch.Tensor] = {}
        self.p_seg_meta: dict[int, torch.Tensor] = {}
        self.p_seg_host: dict[int, torch.Tensor] = {}
        self.pin = pin
        self.p_graphs_mib = 0.0
        self._p_failed = False
        #: A layer split (the verifier can launch and land apart): whether the window being
        #: run is launched only (pipelined slot groups); None on one device.
        self._staged: Optional[bool] = False if hasattr(verifier, "launch") else None
        #: engine.expert_cache_mib > 0: the ExpertCache whose counts each window copies out.
        self.expert_cache = getattr(verifier, "expert_cache", None)

    @classmethod
    def for_engine(cls, verifier: Verifier, ecfg: EngineConfig, device: torch.device,
                   budget: MemoryBudget, trace: TraceWriter, log: Callable[[str], None]) -> "ModelRunner":
        """A runner with the graph cache and prompt-chunk graphs `ecfg` asks for."""
        n_slots = budget.slots
        cache = None
        if ecfg.graphs:
            # On a layer split a window holds messages between the stages, so this cache records
            # window plans (for the trace and the LRU) and each stage captures its own compute
            # (stage_graphs.py), charged there: on CUDA the plans hold no memory.
            backend = (CudaGraphBackend(device) if device.type == "cuda" and ecfg.stages == 1
                       else RecordingBackend(ecfg.cpu_graph_mib if device.type == "cpu" else 0.0))
            cache = GraphCache(ecfg.graph_limit, backend, budget, trace, ecfg.graph_mib_estimate,
                               log=log)
        max_groups = shape_bucket(n_slots, list(ecfg.shape_buckets))
        if ecfg.batch_invariant:  # a window of 1-row groups runs window_rows of them
            max_groups = max(max_groups, ecfg.window_rows)
        p_backend = (CudaGraphBackend(device) if device.type == "cuda" and ecfg.graphs
                     and ecfg.prefill_graphs else None)
        return cls(verifier, cache, device, max(max_groups, n_slots), verifier.state.scratch,
                   log=log, prefill_buckets=tuple(ecfg.prefill_buckets), prefill_graphs=p_backend,
                   budget=budget)

    # ---- admission --------------------------------------------------------------------------
    def bind_lanes(self, slots: list) -> None:
        """Fresh state, sampling parameters and the prompt on the device for each admitted
        slot, in one host-to-device copy and four kernels however many there are. Binding is
        host time each request of a burst waits for before its first prompt chunk, and every
        torch call is part of it."""
        n = len(slots)
        params = [s.req.req.params for s in slots]
        # One int64 host buffer: lane ids, (top_k, seed) rows, (temperature, top_p) as float32
        # pairs in n int64 words, then every prompt's ids.
        lens = [len(s.req.req.prompt_ids) for s in slots]
        host = np.empty(4 * n + sum(lens), dtype=np.int64)
        host[:n] = [s.id for s in slots]
        host[n:3 * n] = [v for p in params for v in (int(p.top_k), int(p.seed))]
        host[3 * n:4 * n].view(np.float32)[:] = [v for p in params
                                                 for v in (float(p.temperature), float(p.top_p))]
        off = 4 * n
        for s, k in zip(slots, lens):
            host[off:off + k] = s.req.req.prompt_ids
            off += k
        dev = torch.from_numpy(host).to(self.device)
        lanes = dev[:n]
        self.verifier.state.reset_lanes(lanes)
        self.verifier.bufs.set_params(lanes, dev[3 * n:4 * n].view(torch.float32).view(n, 2),
                                      dev[n:3 * n].view(n, 2))
        off = 4 * n
        for s, k in zip(slots, lens):
            s.req.prompt_tensor = dev[off:off + k]  # a view: the burst's buffer lives on
            off += k                                # until its last request ends

    # ---- prompt chunks ------------------------------------------------------------------------
    @staticmethod
    def _write_meta(host: torch.Tensor, meta: torch.Tensor, rows) -> None:
        """(lane, start, n, next token or None) of each segment into the pinned `host` rows,
        then one copy to the device `meta` (blocking: host is reused at once)."""
        h = host.view(-1, 4)
        for i, (lane, start, n, nxt) in enumerate(rows):
            h[i, 0], h[i, 1], h[i, 2], h[i, 3] = lane, start, n, -1 if nxt is None else nxt
        meta.copy_(host)

    def _set_meta(self, lane: int, start: int, n: int, next_token: Optional[int]) -> None:
        self._write_meta(self.p_host, self.p_meta, [(lane, start, n, next_token)])

    def _segment_buffers(self, segs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens (segs, the last bucket), device meta (segs, 4) and its pinned host copy for
        chunks of `segs` segments, made on first use and kept: captured chunks read them."""
        if segs not in self.p_seg_tokens:
            self.p_seg_tokens[segs] = torch.zeros(segs, max(self.buckets, default=1),
                                                  dtype=torch.long, device=self.device)
            self.p_seg_meta[segs] = torch.zeros(segs, 4, dtype=torch.long, device=self.device)
            self.p_seg_host[segs] = torch.zeros(segs, 4, dtype=torch.long, pin_memory=self.pin)
        return self.p_seg_tokens[segs], self.p_seg_meta[segs], self.p_seg_host[segs]

    def prefill(self, lane: int, prompt: torch.Tensor, start: int, n: int, next_token: Optional[int],
                tier: Callable[[int], int], filtered: bool = True) -> tuple[str, torch.Tensor]:
        """Run prompt[start:start+n] of `lane`; returns (graph action, (1,) device token).
        `filtered` picks the chunk's sampler (Verifier.prefill), so it is part of the graph's key."""
        b = prefill_bucket(n, self.buckets)  # past the last bucket: unpadded
        ctx = tier(start + b)
        set_meta = lambda: self._set_meta(lane, start, n, next_token)  # noqa: E731
        set_meta()
        if b > self.p_tokens.shape[0]:
            # past the last bucket: eagerly, on tokens of its own (captured chunks read
            # p_tokens, so it keeps its storage)
            return GraphAction.EAGER, self.verifier.prefill(
                prompt[start:start + n].to(self.device), self.p_meta, ctx, filtered)
        self.p_tokens[:n].copy_(prompt[start:start + n])
        run = lambda: self.verifier.prefill(self.p_tokens[:b], self.p_meta, ctx, filtered)  # noqa: E731
        return self._run_chunk((b, ctx, filtered), b, run, set_meta,
                               lambda: self._set_meta(self.scratch, 0, 1, None))

    def prefill_segments(self, chunks: list, tier: Callable[[int], int],
                         filtered: bool = True) -> tuple[str, torch.Tensor]:
        """One prompt chunk of several lanes (engine.prefill_slots): `chunks` holds (lane, prompt,
        start, n, next token) for each, every segment padded to the bucket of the longest;
        returns (graph action, (S,) device tokens, one per segment as `prefill` returns).
        Graphs are keyed by the segment count too."""
        segs = len(chunks)
        b = prefill_bucket(max(c[3] for c in chunks), self.buckets)
        ctx = tier(max(c[2] for c in chunks) + b)
        buf, meta, host = self._segment_buffers(segs)
        if b > buf.shape[1]:  # past the last bucket: eagerly, on tokens of its own (as prefill)
            buf = torch.zeros(segs, b, dtype=torch.long, device=self.device)
        for i, (_, prompt, start, n, _) in enumerate(chunks):
            buf[i, :n].copy_(prompt[start:start + n])

        def set_meta(rows) -> None:
            self._write_meta(host, meta, rows)

        real = [(lane, start, n, nxt) for lane, _, start, n, nxt in chunks]
        set_meta(real)
        run = lambda: self.verifier.prefill(buf[:, :b], meta, ctx, filtered)  # noqa: E731
        # (warmed on the scratch lane alone: every segment's writes land there)
        return self._run_chunk((segs, b, ctx, filtered), b, run, lambda: set_meta(real),
                               lambda: set_meta([(self.scratch, 0, 1, None)] * segs))

    def _run_chunk(self, key: tuple, b: int, run: Callable, set_meta: Callable,
                   set_scratch: Callable) -> tuple[str, torch.Tensor]:
        """A prompt chunk whose inputs are in place (`set_meta` puts them back): eagerly, or its
        captured graph (captured first, warmed on the scratch lane by `set_scratch`)."""
        if self.p_backend is None or b not in self.buckets or self._p_failed:
            return GraphAction.EAGER, run()
        handle = self.p_graphs.get(key)
        if handle is not None:
            return GraphAction.HIT, self.p_backend.replay(handle)
        if self.budget is not None and not self.budget.graph_fits(
                self.cache.last_mib if self.cache else 0.0, self.cache.graphs_mib if self.cache else 0.0):
            return GraphAction.EAGER, run()
        try:
            # Warm on the scratch lane first: lazy initialisation must not happen in a capture.
            set_scratch()
            run()
            handle, mib = self.p_backend.capture(run)
        except Exception as e:  # a CUDA error in capture: prompt chunks run eagerly from now on
            self._p_failed = True
            self.log(f"WARNING: prefill graph capture failed for {key} "
                     f"({type(e).__name__}: {e}); prompt chunks run eagerly")
            set_meta()
            return GraphAction.EAGER, run()
        self.p_graphs[key] = handle
        self.p_graphs_mib += mib
        if self.budget is not None:
            self.budget.fixed_graphs_mib += mib
        if len(self.p_graphs) == 1:
            self.log(f"INFO prefill graphs: captured {key} ({mib:.1f} MiB); one per "
                     f"(bucket, context tier) as prompts need them, charged to the memory budget")
        set_meta()
        return GraphAction.CAPTURE, self.p_backend.replay(handle)

    def release_prefill_graphs(self) -> None:
        for handle in self.p_graphs.values():
            self.p_backend.release(handle)
        self.p_graphs.clear()
        if self.budget is not None:
            self.budget.fixed_graphs_mib -= self.p_graphs_mib
        self.p_graphs_mib = 0.0

    def _views_of(self, n: int) -> tuple[torch.Tensor, ...]:
        """(device inputs, host inputs, groups' lanes, positions, rows) for `n` groups."""
        v = self._views.get((self._host_at, n))
        if v is None:
            dev = self.inputs[:, :n]
            v = self._views[self._host_at, n] = (dev, self.host_inputs[:, :n], dev[0], dev[1],
                                                 dev[2])
        return v

    def _flip_host_inputs(self) -> None:
        self._host_at ^= 1
        self.host_inputs, self.host_np = self._host_bufs[self._host_at], self._host_nps[self._host_at]

    def _fill(self, groups: list[tuple[int, int, int]], n: int, pad_all: bool = False) -> None:
        h = self.host_np
        h[0, :n] = self.scratch
        h[1, :n] = 0
        h[2, :n] = 1
        if not pad_all:
            for i, (lane, pos, rows) in enumerate(groups):
                h[0, i], h[1, i], h[2, i] = lane, pos, rows
        dev, host = self._views_of(n)[:2]
        dev.copy_(host, non_blocking=True)

    def _fn(self, n: int, g: int, ctx: int, filtered: bool):
        _, _, gs, gp, rows = self._views_of(n)
        if self._staged is not None:  # a layer split: whole windows, or (pipelined) stage 0's
            # part to land later; chosen per run, since a recorded plan may replay either way
            return lambda: (self.verifier.launch if self._staged else self.verifier.window)(
                gs, gp, rows, g, ctx, filtered)
        return lambda: self.verifier.window(gs, gp, rows, g, ctx, filtered)

    def decode(self, groups: list[tuple[int, int, int]], n_padded: int, g: int, ctx: int,
               filtered: bool, key: Optional[str], timed: bool = False) -> GraphRun:
        """Run a window of (lane, pos, rows) groups; its output is the host rows, one per group.
        `filtered` picks the window's sampler, so it must be part of `key`. `timed` (CUDA): also
        its device seconds by two events (`run.device_s`), the part of the call's wall that
        engine.overlap cannot hide behind the host (a traced run's window `dev`)."""
        start = None
        if timed and self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        run = self._run(groups, n_padded, g, ctx, filtered, key)
        end = None
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        run.output = run.output.tolist()[: len(groups)]  # (a list slice is cheaper than a tensor's)
        if end is not None:  # (the rows' read waited for the window: both events have passed)
            run.device_s = start.elapsed_time(end) / 1e3
        return run

    def launch(self, groups: list[tuple[int, int, int]], n_padded: int, g: int, ctx: int,
               filtered: bool, key: Optional[str], timed: bool = True) -> GraphRun:
        """As `decode`, without waiting for the device (engine.overlap): the output is a
        PendingWindow for `read`, which the engine calls after launching the next window. The
        groups' positions are ignored: the verifier reads them on the device. `timed`: time
        it on the device (two timing events; without, `read` reports 0 seconds)."""
        self._flip_host_inputs()
        cuda = self.device.type == "cuda"
        start = end = None
        t0 = time.perf_counter()
        if cuda and timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        run = self._run(groups, n_padded, g, ctx, filtered, key)
        out = run.output
        if cuda:
            bufs = self._out_bufs.get(tuple(out.shape))
            if bufs is None:
                bufs = self._out_bufs[tuple(out.shape)] = [
                    torch.empty(out.shape, dtype=out.dtype, pin_memory=True) for _ in range(2)]
            self._out_at ^= 1
            host = bufs[self._out_at]
            host.copy_(out, non_blocking=True)  # before the next window overwrites a graph's output
            end = torch.cuda.Event(enable_timing=timed)
            end.record()
        else:  # the CPU ran it already, into a tensor of its own (no static graph output)
            host = out
        run.output = PendingWindow(host, len(groups), start, end, time.perf_counter() - t0)
        return run

    def launch_staged(self, groups: list[tuple[int, int, int]], n_padded: int, g: int, ctx: int,
                      filtered: bool, key: Optional[str]) -> GraphRun:
        """engine.pipeline_groups: as `decode`, but returns once stage 0 has run its layers
        and handed the window on; the output is the stage verifier's StageWindow, which
        `land_staged` reads (windows land in launch order)."""
        return self._run(groups, n_padded, g, ctx, filtered, key, staged=True)

    def land_staged(self, window: Any, groups: int) -> list[list[int]]:
        """A launched window's host rows, one per real group, once the last stage returns them."""
        return self.verifier.land(window).tolist()[:groups]

    @staticmethod
    def read(pending: "PendingWindow") -> tuple[list[list[int]], float]:
        """Wait for a launched window; returns its host rows (one per group) and its device
        seconds (CUDA events; on CPU the time it took to run)."""
        if pending.end is None:
            return pending.host.tolist()[: pending.groups], pending.cpu_s
        pending.end.synchronize()
        dur = 0.0 if pending.start is None else pending.start.elapsed_time(pending.end) / 1e3
        return pending.host.tolist()[: pending.groups], dur

    def _run(self, groups: list[tuple[int, int, int]], n_padded: int, g: int, ctx: int,
             filtered: bool, key: Optional[str], staged: bool = False) -> GraphRun:
        if n_padded > self.inputs.shape[1]:
            raise RuntimeError(f"window of {n_padded} groups exceeds the {self.inputs.shape[1]} "
                               f"input rows sized at start")
        if n_padded < len(groups):
            raise RuntimeError(f"window of {len(groups)} groups planned into {n_padded} padded "
                               f"groups: a group would be dropped")
        self._fill(groups, n_padded)
        if self._staged is not None:
            self._staged = staged
        try:
            run = self._run_filled(groups, n_padded, g, ctx, filtered, key)
        finally:
            if self._staged is not None:
                self._staged = False
        if self.expert_cache is not None:  # in stream order right after the window, before
            run.expert_counts = self.expert_cache.after_launch()  # `launch` records its end
        return run

    def _run_filled(self, groups: list[tuple[int, int, int]], n_padded: int, g: int, ctx: int,
                    filtered: bool, key: Optional[str]) -> GraphRun:
        fn = self._fn(n_padded, g, ctx, filtered)
        if self.cache is None or key is None:
            run = GraphRun(GraphAction.EAGER, fn())
        else:
            def warm() -> None:
                # One eager run on the scratch lane: lazy initialisation (library handles,
                # kernels) must not happen inside a capture, and the real state must not move.
                if self.cache.backend.name != "record":
                    self._fill(groups, n_padded, pad_all=True)
                    fn()
                    if self.device.type == "cuda":  # the padding's copy must be done before
                        torch.cuda.synchronize(self.device)  # its host buffer is refilled
                    self._fill(groups, n_padded)

            run = self.cache.run(key, fn, warm)
        return run

    # ---- warm-up ------------------------------------------------------------------------------
    def warmup(self, plan: WarmupPlan, tier: Callable[[int], int],
               progress: Callable[[str], None] = lambda s: None,
               capture: bool = True,
               before_captures: Optional[Callable[[], None]] = None) -> WarmupDone:
        """Run every window shape and prompt-chunk bucket of `plan` once on the scratch lane
        (eagerly, no graphs), so that torch.compile's work happens now rather than inside the
        first requests; then (after `before_captures`, and unless `capture` is false) capture
        the prompt-chunk graphs and the shape-keyed window graphs requests will use. Real lanes
        are not touched. `progress` hears how far it got, at most every PROGRESS_S seconds (a
        full-depth model compiles for minutes)."""
        done = WarmupDone()
        shapes = [(ng, g) for ng, g in plan.window_shapes if ng <= self.inputs.shape[1]]
        total = len(shapes) * len(plan.window_tiers) * 2
        t0 = last = time.perf_counter()

        def tick(what: str) -> None:
            nonlocal last
            now = time.perf_counter()
            if now - last >= PROGRESS_S:
                last = now
                progress(f"INFO warm-up: {what} ({now - t0:.0f} s)")

        for ng, g in shapes:
            self._fill([], ng, pad_all=True)
            for ctx in plan.window_tiers:
                for filtered in (False, True):
                    self._fn(ng, g, ctx, filtered)()
                    done.windows += 1
                    tick(f"{done.windows} of {total} window shapes run")
        segs = plan.prefill_segments
        for i, b in enumerate(plan.prefill_buckets):
            self.p_tokens[:b].zero_()
            self._set_meta(self.scratch, 0, 1, None)
            for filtered in (False, True):
                self.verifier.prefill(self.p_tokens[:b], self.p_meta, tier(b), filtered)
            if segs > 1:  # several slots' chunks, every segment on the scratch lane
                buf, meta, host = self._segment_buffers(segs)
                buf[:, :b].zero_()
                self._write_meta(host, meta, [(self.scratch, 0, 1, None)] * segs)
                for filtered in (False, True):
                    self.verifier.prefill(buf[:, :b], meta, tier(b), filtered)
            tick(f"{i + 1} of {len(plan.prefill_buckets)} prompt buckets run")
        if before_captures is not None:
            before_captures()
        # Prompt-chunk graphs, one per (bucket, tier) a chunk can read: a capture inside a
        # request would add tens of ms to its time to first token. Those of requests that do
        # not filter, as for windows; a filtering request's are captured on first use. Without
        # `capture` (a compile worker) the same compiled calls run, uncaptured, so that they
        # compile what the captures would.
        if self.p_backend is not None:
            zeros = torch.zeros(plan.max_context, dtype=torch.long, device=self.device)
            for b in plan.prefill_buckets:
                for ctx in plan.every_tier:
                    if ctx < tier(b):  # a chunk at start ctx - b reads exactly `ctx`
                        continue
                    if not capture:
                        self._set_meta(self.scratch, 0, 1, None)
                        self.verifier.prefill(self.p_tokens[:b], self.p_meta, ctx, False)
                        continue
                    action, _ = self.prefill(self.scratch, zeros, ctx - b, b, None, tier,
                                             filtered=False)
                    done.prefill_graphs += action == GraphAction.CAPTURE
                    tick(f"{done.prefill_graphs} prompt-chunk graphs captured")
        # Window graphs (tiers ascending, deepest windows first) up to the graph limit: a
        # capture inside a request costs it 15-35 ms on the H200. Layout keys are too many to
        # enumerate: they are captured on first use.
        for key, (bucket, g, ctx) in plan.window_keys or []:
            if not capture:
                self._fill([], bucket, pad_all=True)
                self._fn(bucket, g, ctx, False)()
                continue
            if not self.cache.has_room():
                break  # the next capture would have to evict: leave the rest to first use
            run = self.decode([], bucket, g, ctx, False, key)
            if run.action != GraphAction.CAPTURE:  # refused by the budget: such windows run eagerly
                break
            done.window_keys.append(key)
            done.window_mib.append(round(run.mib, 3))
            tick(f"{len(done.window_keys)} window graphs captured")
        return done
