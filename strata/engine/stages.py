"""engine.stages=N: consecutive layer ranges on N devices, one process per stage.

The engine process is stage 0 and the only driver: scheduler, rotation, trace and graphs of
the plan stay there. It starts one process per further stage itself (multiprocessing spawn),
joins them in a torch.distributed group (gloo on CPU, NCCL on CUDA with stage k on device k)
and sends each of them every device step as a small message (strata/engine/stage_protocol.py).
Each stage holds its own layers' weights, K/V, DeltaNet state and a window's DeltaNet rows
(recurrent update factors, conv snapshots); the last also holds the final norm, LM head, MTP
layer and the slot buffers (pending token, draft, MTP hidden, sampling parameters), so it
samples, verifies and drafts with the unchanged Verifier.

One decode window: stage 0 takes its tokens from its copy of each slot's pending token and draft
(every window's output and prompt chunk's reply bring them back), embeds them and runs its layers;
the hidden states go stage to stage once; the last stage verifies and returns the window's output
([y..., accepted, next draft] per group) to every earlier stage, each of which commits the accepted
prefix to its own DeltaNet layers (replays its factors, copies the conv snapshot). A prompt chunk:
the driver sends the chunk, hidden states go stage to stage, the last stage returns the token and
draft. Messages are point to point (stage_protocol.py), so with engine.pipeline_groups the driver
launches another group's window before the last stage returns the first one's output (pipeline.py).
Verification and commit are the one-stage code, so the tokens are the one-stage tokens.
With engine.graphs each stage replays its own part of a window as a graph of its compute, the
messages outside it (strata/engine/stage_graphs.py); the driver's graph cache records the
window plans.

A stage process that dies is a StageFailure: the engine fails every request it holds with an
error and stops (Engine.fault); the server's engine process then exits, which is its restart
path (503 + Retry-After while it restarts).
"""

from __future__ import annotations

import gc
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from strata.config import ConfigError, stage_graphs_on
from strata.engine import stage_protocol as proto
from strata.engine.stage_graphs import StageGraphs, StaticInputs, scratch_plan
from strata.engine.verifier import SlotBuffers
from strata.kernels import ops
from strata.kinds import FinishReason
from strata.model.config import CheckpointError, ModelArgs, load_model_args
from strata.model.stage_slice import StageSlice

#: Seconds the driver waits for the stage processes to load their layers and join.
JOIN_TIMEOUT_S = 1800.0
#: A stage process that is gone for this long while the driver still waits (a collective that
#: does not notice a dead peer, as NCCL may not) ends the engine process.
DEAD_STAGE_GRACE_S = 30.0


class StageFailure(RuntimeError):
    """A stage process died or its link broke: the pipeline cannot run any more."""


# ---- placement --------------------------------------------------------------------------------
def layer_bytes(args: ModelArgs, dtype: torch.dtype, with_mtp: bool) -> tuple[list[int], int, int]:
    """Parameter bytes of each decoder layer, of the first stage's extras (the embedding) and
    of the last stage's (norm, LM head, MTP layer and its embedding), from a meta model."""
    from strata.model.qwen3_next import Qwen3Next

    with torch.device("meta"):
        model = Qwen3Next(args, with_mtp=with_mtp).to(dtype)
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    per_layer = [nbytes(layer) for layer in model.layers]
    embed = nbytes(model.embed_tokens)
    last = embed + nbytes(model.norm) + nbytes(model.lm_head) + (nbytes(model.mtp) if model.mtp else 0)
    return per_layer, embed, last


def balance_layers(per_layer: list[int], first_extra: int, last_extra: int, n: int) -> list[int]:
    """Layer counts of n consecutive stages (each >= 1) that minimise the largest stage's bytes."""
    total = len(per_layer)
    prefix = [0]
    for b in per_layer:
        prefix.append(prefix[-1] + b)
    inf = float("inf")
    # best[k][i]: the smallest possible maximum over stages 0..k-1 holding layers 0..i-1.
    best = [[inf] * (total + 1) for _ in range(n + 1)]
    cut = [[0] * (total + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, n + 1):
        for i in range(k, total - (n - k) + 1):
            for j in range(k - 1, i):
                cost = prefix[i] - prefix[j] + (first_extra if k == 1 else 0) \
                    + (last_extra if k == n else 0)
                v = max(best[k - 1][j], cost)
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    counts, i = [], total
    for k in range(n, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def plan_stages(cfg: Any, args: ModelArgs, dtype: torch.dtype) -> list[StageSlice]:
    """The stages' layer ranges: engine.stage_layers' counts, or auto (bytes balanced)."""
    n, depth = int(cfg.engine.stages), args.num_hidden_layers
    if n > depth:
        raise ConfigError(f"engine.stages: {n} stages for a model of {depth} decoder layers "
                          f"(each stage needs at least one)")
    if str(cfg.engine.stage_layers) == "auto":
        per_layer, first, last = layer_bytes(args, dtype, args.num_nextn_predict_layers > 0)
        counts = balance_layers(per_layer, first, last, n)
    else:
        counts = [int(c) for c in str(cfg.engine.stage_layers).split(",")]
        if sum(counts) != depth:
            raise ConfigError(f"engine.stage_layers: {cfg.engine.stage_layers!r} sums to "
                              f"{sum(counts)} layers but the model has {depth}")
    out, start = [], 0
    for k, c in enumerate(counts):
        out.append(StageSlice(start, start + c, k == 0, k == n - 1))
        start += c
    return out


def stage_devices(device: torch.device, n: int) -> list[torch.device]:
    """Stage k's device: the CPU for every stage, or CUDA device (first + k)."""
    if device.type != "cuda":
        return [device] * n
    first = device.index or 0
    visible = torch.cuda.device_count()
    if first + n > visible:
        raise ConfigError(f"engine.stages={n}: needs {n} CUDA devices (one per stage) from "
                          f"cuda:{first}, but {visible} are visible (CUDA_VISIBLE_DEVICES)")
    return [torch.device("cuda", first + k) for k in range(n)]


# ---- the process group ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StageGroup:
    """The stage processes and the torch.distributed group the driver (rank 0) shares with them."""

    def __init__(self, cfg_dict: dict, slices: list[StageSlice], devices: list[torch.device],
                 log: Callable[[str], None]):
        import multiprocessing as mp

        import torch.distributed as dist

        from strata.engine.stage_worker import stage_main

        if dist.is_initialized():
            raise ConfigError("engine.stages: this process already has a torch.distributed group "
                              "(one staged engine per process; close the other first)")
        self.slices, self.devices, self.log = slices, devices, log
        self.world = len(slices)
        self.last = self.world - 1
        self.backend = "nccl" if devices[0].type == "cuda" else "gloo"
        self.comm_device = devices[0]
        port = _free_port()
        # CUDA needs fresh processes; on the CPU a fork starts in a fraction of a second where a
        # spawned interpreter takes seconds to import torch again.
        fork = devices[0].type == "cpu" and "fork" in mp.get_all_start_methods()
        ctx = mp.get_context("fork" if fork else "spawn")
        self.procs = []
        if fork:  # a fork's collector must never destroy the parent's objects (C++ ones abort)
            gc.freeze()
        try:
            for k in range(1, self.world):
                sl = slices[k]
                p = ctx.Process(target=stage_main, name=f"strata-stage-{k}", daemon=True,
                                args=(k, self.world, port, cfg_dict,
                                      (sl.start, sl.stop, sl.first, sl.last), str(devices[k]),
                                      os.getpid()))
                p.start()
                self.procs.append(p)
        finally:
            if fork:
                gc.unfreeze()
        # The store after the processes: a fork must not inherit its server (they connect, retrying).
        self.store = dist.TCPStore("127.0.0.1", port, self.world, is_master=True,
                                   timeout=timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False)
        self.closed = False
        self.failure: Optional[str] = None
        #: Stage 0's window graphs (FirstStageVerifier sets it); with `graph_stats`, what
        #: `close` reports.
        self.stage0_graphs: Any = None
        #: Each stage's graph-cache counters (GraphCache.stats) by stage, filled by `close`
        #: (a stage process reports its own when it stops).
        self.graph_stats: dict[int, dict] = {}
        self._in_call_since: Optional[float] = None
        self._watch = threading.Thread(target=self._watchdog, name="strata-stage-watch", daemon=True)

    def join(self) -> None:
        """Wait until every stage has loaded its layers (a load error is raised here with the
        stage's message), then form the process group."""
        import torch.distributed as dist

        deadline = time.monotonic() + JOIN_TIMEOUT_S
        waiting = set(range(1, self.world))
        while waiting:
            for k in sorted(waiting):
                if self.store.check([f"stage{k}.error"]):
                    msg = self.store.get(f"stage{k}.error").decode()
                    self.close()
                    kind, _, text = msg.partition(":")
                    raise (CheckpointError if kind == "CheckpointError" else ConfigError)(text)
                if self.store.check([f"stage{k}.ready"]):
                    waiting.discard(k)
                elif not self.procs[k - 1].is_alive():
                    code = self.procs[k - 1].exitcode
                    self.close()
                    raise StageFailure(f"stage {k} process exited (code {code}) while loading")
            if time.monotonic() > deadline:
                self.close()
                raise StageFailure(f"stages {sorted(waiting)} did not load within {JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        if self.backend == "nccl":
            torch.cuda.set_device(self.comm_device)
        dist.init_process_group(self.backend, store=self.store, rank=0, world_size=self.world,
                                timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        proto.open_channels()
        self._watch.start()
        d = ", ".join(f"{k}: layers {s.start}-{s.stop - 1} on {self.devices[k]}"
                      for k, s in enumerate(self.slices))
        self.log(f"INFO stages={self.world} ({self.backend}): {d}; the last holds the head and MTP")

    # ---- liveness -------------------------------------------------------------------------
    def dead_stage(self) -> Optional[str]:
        for k, p in enumerate(self.procs, 1):
            if not p.is_alive():
                return f"stage {k} process (pid {p.pid}) died (exit code {p.exitcode})"
        return None

    def _watchdog(self) -> None:
        """A collective that never notices its dead peer would hang the engine: end it, so that
        its supervisor (the server) restarts it. Gloo raises on a dead peer; this is for NCCL."""
        while not self.closed:
            time.sleep(1.0)
            since = self._in_call_since
            dead = self.dead_stage()
            if dead and since is not None and time.monotonic() - since > DEAD_STAGE_GRACE_S:
                self.log(f"ERROR: {dead} and stage 0 is still waiting on it; exiting")
                os._exit(3)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run one exchange with the stages; a broken stage becomes StageFailure."""
        if self.failure is not None:
            raise StageFailure(self.failure)
        self._in_call_since = time.monotonic()
        try:
            return fn()
        except StageFailure:
            raise
        except Exception as e:
            time.sleep(0.2)  # let a dying peer's exit code arrive
            self.failure = self.dead_stage() or f"stage link broke: {type(e).__name__}: {e}"
            raise StageFailure(self.failure) from None
        finally:
            self._in_call_since = None

    def close(self) -> None:
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        joined = dist.is_initialized()
        if not joined:  # a failed start: the stages wait for a group that will never form
            for p in self.procs:
                p.kill()
        if joined:
            if self.failure is None and self.dead_stage() is None:
                try:
                    proto.send_header(proto.OP_STOP, device=self.comm_device)
                    proto.flush()
                except Exception:
                    pass
            proto.close_channels()
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        for p in self.procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        if joined:
            self._collect_graph_stats()
        if self.stage0_graphs is not None and self.stage0_graphs.captured:
            self.stage0_graphs.cache.clear()  # (its device memory, before another engine loads)

    def _collect_graph_stats(self) -> None:
        """Each stage's graph counters (a stage reports its own when it stops), logged in one
        line: that the stages replayed their graphs, and how much memory they held."""
        if self.stage0_graphs is None or not self.stage0_graphs.captured:
            return
        self.graph_stats[0] = self.stage0_graphs.stats()
        for k in range(1, self.world):
            try:
                if self.store.check([f"stage{k}.graphs"]):
                    self.graph_stats[k] = json.loads(self.store.get(f"stage{k}.graphs").decode())
            except Exception:  # (a dead stage reported nothing)
                pass
        self.log("INFO stage graphs: " + "; ".join(
            f"stage {k}: {st['graph_captures']} captured, {st['graph_hits']} replayed, "
            f"{st['graph_eager']} eager, {st['graphs_mib']:.1f} MiB held"
            for k, st in sorted(self.graph_stats.items())))


# ---- stage 0 ------------------------------------------------------------------------------------
class DriverSlotBuffers(SlotBuffers):
    """Stage 0's slot buffers: binding lanes also resets them on every stage and gives the last
    stage (which samples) the sampling parameters."""

    group: StageGroup

    @classmethod
    def wrapping(cls, bufs: SlotBuffers, group: StageGroup) -> "DriverSlotBuffers":
        """The engine's buffers (the same tensors) with binding sent to the stages."""
        out = cls.__new__(cls)
        out.__dict__.update(bufs.__dict__)
        out.group = group
        return out

    def set_params(self, lanes: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> None:
        super().set_params(lanes, floats, ints)
        payload = torch.cat([lanes[:, None], ints, floats.contiguous().view(torch.int64)], 1)
        self.group.call(lambda: proto.send_bind(payload, self.group.comm_device))


@dataclass
class StageWindow:
    """A window stage 0 has launched (its layers ran, its hidden states went on) and not yet
    landed (read the last stage's output and committed its own DeltaNet rows)."""
    gs: torch.Tensor
    gp: torch.Tensor
    g: int
    rec: torch.Tensor
    conv: torch.Tensor
    #: The graph whose outputs rec and conv are (held until the window lands), or None.
    graph: Optional[str] = None


class FirstStageVerifier:
    """Stage 0's side of the Verifier's interface (window, prefill): it embeds the tokens, runs
    its layers, hands the hidden states on, and commits its DeltaNet rows of the prefix the
    last stage accepted. The ModelRunner drives it as it drives the Verifier; pipelined
    slot groups (engine.pipeline_groups) call `launch` and `land` apart, with other groups'
    windows launched in between. Its compute (embedding and layers) replays a graph per window
    shape (`graphs`, stage_graphs.py) between the messages.

    A window's tokens are each slot's pending token and draft, which stage 0 keeps in its own
    slot buffers from every window's output and prompt chunk's reply (the drafts travel with
    their group), so it needs nothing from the last stage to start a window; a window of more
    than 2 rows (solo: chained drafts, which need the MTP layer) asks the last stage for them."""

    def __init__(self, engine: Any, group: StageGroup):
        self.group = group
        self.model = engine.model
        self.state = engine.state
        self.split_keys = engine.verifier.split_keys
        self.drafting = engine.drafting
        self.bufs = DriverSlotBuffers.wrapping(engine.bufs, group)
        # Stage 0's window compute (embedding and its layers) as graphs of its own
        # (strata/engine/stage_graphs.py); the driver's graph cache records window plans.
        self.graphs = StageGraphs.for_stage(engine.cfg, engine.device, engine.budget, engine.log)
        self.inputs = StaticInputs(engine.device)
        group.stage0_graphs = self.graphs

    def window(self, gs: torch.Tensor, gp: torch.Tensor, rows: torch.Tensor, g: int, ctx: int,
               filtered: bool) -> torch.Tensor:
        return self.land(self.launch(gs, gp, rows, g, ctx, filtered))

    def launch(self, gs: torch.Tensor, gp: torch.Tensor, rows: torch.Tensor, g: int, ctx: int,
               filtered: bool) -> StageWindow:
        return self.group.call(lambda: self._launch(gs, gp, rows, g, ctx, filtered))

    def land(self, w: StageWindow) -> torch.Tensor:
        """The window's output [y..., accepted, next draft] per group, once the last stage
        returns it (windows land in launch order); stage 0 commits its share."""
        return self.group.call(lambda: self._land(w))

    def _launch(self, gs, gp, rows, g, ctx, filtered) -> StageWindow:
        grp, ng = self.group, gs.shape[0]
        plan = torch.stack([gs, gp, rows])  # a copy: the runner refills its inputs for the next window
        proto.send_header(proto.OP_WINDOW, ng, g, ctx, int(filtered), device=grp.comm_device)
        proto.fan_out(plan)
        tokens = None
        if g > 2:  # chained drafts: only the last stage can make them
            tokens = proto.recv_back(self.inputs.get("tokens", ng, g), grp.last)
        if self.graphs.captured:
            x, rec, conv, graph = self._replay_layers(plan, g, ctx, tokens)
            x = x.clone()  # (sent asynchronously; the next replay rewrites the graph's output)
        else:
            x, rec, conv = self._layers(plan[0], plan[1], g, ctx, tokens)
            graph = None
        proto.send(x, 1)
        return StageWindow(plan[0], plan[1], g, rec, conv, graph)

    def _layers(self, gs, gp, g, ctx, tokens) -> tuple[torch.Tensor, ...]:
        """Stage 0's compute of a window: (hidden states, DeltaNet recurrent factors, conv
        snapshots). `tokens`: the window's tokens, or None for each slot's pending token and
        draft."""
        if tokens is None:
            tokens = torch.stack([self.bufs.pending[gs], self.bufs.draft[gs]][:g], 1)
        return self.model.window_layers(self.model.embed(tokens), gs, gp, ctx, self.state,
                                        self.split_keys)

    def _replay_layers(self, plan, g, ctx, tokens) -> tuple[Any, ...]:
        """`_layers` from the graph of the window's shape: the plan is copied into a static
        buffer (`tokens`, when given, already is one); the outputs are the graph's own."""
        ng = plan.shape[1]
        static = self.inputs.get("plan", 2, ng)
        static.copy_(plan[:2])

        def warm() -> None:  # on the scratch lane: the real state must not move twice
            static.copy_(scratch_plan(static, self.state.scratch))
            self._layers(static[0], static[1], g, ctx, tokens)
            static.copy_(plan[:2])

        out, graph = self.graphs.run((ng, g, ctx), lambda: self._layers(static[0], static[1], g,
                                                                        ctx, tokens),
                                     warm, hold=True)
        return (*out, graph)

    def _land(self, w: StageWindow) -> torch.Tensor:
        ng, g, bufs = w.gs.shape[0], w.g, self.bufs
        out = proto.recv_back(torch.empty(ng, g + 2, dtype=torch.long, device=w.gs.device),
                              self.group.last)
        accept = out[:, g]
        commit_stage(accept, w.gs, w.gp, w.rec, w.conv, self.state, bufs.pos)
        self.graphs.release(w.graph)
        bufs.pending[w.gs] = out[torch.arange(ng, device=out.device), accept]
        bufs.draft[w.gs] = out[:, g + 1]
        return out

    def prefill(self, tokens: torch.Tensor, meta: torch.Tensor, ctx: int,
                filtered: bool = True) -> torch.Tensor:
        """Verifier.prefill across the stages. `filtered` is not sent: the last stage samples
        with the sorting sampler, which gives a request that does not filter the same tokens."""
        return self.group.call(lambda: self._prefill(tokens, meta, ctx))

    def _prefill(self, tokens, meta, ctx) -> torch.Tensor:
        grp, bufs = self.group, self.bufs
        proto.send_header(proto.OP_PREFILL, tokens.shape[0], ctx, device=grp.comm_device)
        proto.fan_out(torch.cat([tokens, meta]))
        x = self.model.prefill_layers(self.model.embed(tokens)[None], meta[0:1], meta[1:2],
                                      self.state, length=meta[2:3], ctx=ctx)
        proto.send(x, 1)
        reply = proto.recv_back(torch.empty(2, dtype=torch.long, device=tokens.device), grp.last)
        lane = meta[0:1]
        bufs.pending.index_copy_(0, lane, reply[0:1])
        bufs.draft.index_copy_(0, lane, reply[1:2])
        return reply[0:1]

    def handoff_seconds(self, groups: int, rows: int, repeats: int = 50) -> float:
        """Mean seconds of one window's exchange between the stages (header, plan, hidden
        states through every stage, output) without its compute: what the split adds to a
        window of this shape. For benchmarks; run it between requests."""
        dev = self.group.comm_device
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        self.exchange(groups, rows)
        sync()
        t0 = time.perf_counter()
        for _ in range(repeats):
            self.exchange(groups, rows)
        sync()
        return (time.perf_counter() - t0) / repeats

    def exchange(self, groups: int, rows: int) -> None:
        """One window's messages without compute (PING): every pair of every channel. The
        first one also sets up NCCL's point-to-point communicators, each of which both ranks
        must join at once (so no later send blocks on a peer that is busy elsewhere)."""
        grp, dev = self.group, self.group.comm_device
        h = self.model.args.hidden_size

        def once() -> None:
            proto.send_header(proto.OP_PING, groups, rows, device=dev)
            proto.fan_out(torch.zeros(3, groups, dtype=torch.long, device=dev))
            proto.send(torch.zeros(groups, rows, h, dtype=self.model.dtype, device=dev), 1)
            proto.recv_back(torch.empty(groups, rows + 2, dtype=torch.long, device=dev), grp.last)

        grp.call(once)


def commit_stage(accept: torch.Tensor, gs: torch.Tensor, gp: torch.Tensor, rec: torch.Tensor,
                 conv: torch.Tensor, state: Any, pos: torch.Tensor) -> None:
    """A stage's share of the commit: its DeltaNet layers replay the accepted prefix's factors
    onto their state and take the conv snapshot after it (the last stage's Verifier decided
    it). The state must be the one the window read: nothing touches the window's slots in
    between (windows land in launch order; pipelined slot groups are disjoint)."""
    if rec.shape[0]:
        ops.commit_accepted(accept, gs, gp, rec, conv, state.rec, state.conv, pos)


# ---- the engine's side ----------------------------------------------------------------------------
def start(engine_cls: type, cfg: Any, device: torch.device, log: Callable[[str], None],
          trace_path: Any) -> Any:
    """Engine.from_config for engine.stages > 1: plan the stages, start their processes, load
    stage 0's layers here, and build the engine around them."""
    from omegaconf import OmegaConf

    from strata.model.loader import load_model, resolve_dtype, resolve_model_path, truncate_layers

    path = resolve_model_path(cfg.model.path)
    args = load_model_args(path)
    if cfg.model.num_layers is not None:
        args = truncate_layers(args, int(cfg.model.num_layers))
    dtype = resolve_dtype(cfg.model.dtype, args, device)
    slices = plan_stages(cfg, args, dtype)
    devices = stage_devices(device, len(slices))
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    # The trace's config line records the counts chosen (the simulator splits a window's time
    # by them), not "auto".
    cfg.engine.stage_layers = ",".join(str(sl.stop - sl.start) for sl in slices)
    # A prompt chunk's graph would hold a stage's messages (each stage's part of it could be
    # captured as a window's is; not done yet): prompt chunks run eagerly.
    cfg.engine.prefill_graphs = False
    if not stage_graphs_on(cfg.engine, devices[0].type):
        if cfg.engine.graphs:
            log("INFO engine.stages > 1: windows run without graphs (engine.stage_graphs=true "
                "captures each stage's compute; on CUDA not yet the default)")
        cfg.engine.graphs = False  # every stage and the driver's plan cache
    else:
        log(f"INFO engine.stages > 1: each stage replays its own window compute as "
            f"{'CUDA graphs' if devices[0].type == 'cuda' else 'recorded plans'} (stage 0: "
            f"embedding and its layers; middle stages: their layers; the last: its layers, "
            f"head, sampling, acceptance, commit and MTP draft), with every message outside "
            f"them; windows of more than 2 rows per group run the last stage eagerly, and "
            f"prompt chunks run eagerly")
    group = StageGroup(OmegaConf.to_container(cfg), slices, devices, log)
    try:
        loaded = load_model(cfg.model, devices[0], log, stage=slices[0])
        group.join()
        engine = engine_cls(loaded, cfg.engine, devices[0], log=log, trace_path=trace_path,
                            stages=group)
    except BaseException:
        group.close()
        raise
    return engine


def attach(engine: Any, group: StageGroup) -> FirstStageVerifier:
    """Called by Engine.__init__ once its state is built: the stages build theirs for the slot
    count stage 0 planned (and whether slots draft); one that cannot (its device is fuller, or
    holds the head and every slot's draft state) is a config error naming it. Returns stage 0's
    verifier."""
    def setup() -> int:
        proto.send_header(proto.OP_SETUP, engine.state.lanes, int(engine.drafting),
                          device=group.comm_device)
        return proto.gather_status(0, group.comm_device)

    if group.call(setup):
        for k in range(1, group.world):
            if group.store.check([f"stage{k}.error"]):
                raise ConfigError(group.store.get(f"stage{k}.error").decode().partition(":")[2])
        raise ConfigError("engine.stages: a stage could not build its slot state")
    verifier = FirstStageVerifier(engine, group)
    verifier.exchange(1, 1)
    return verifier


def fail_everything(engine: Any, message: str, outs: dict) -> None:
    """A dead stage: every request the engine holds (queued, prefilling, decoding, not yet
    arrived) ends with finish reason error and the message; the engine takes no more work."""
    engine.fault = message
    for rs in list(engine.requests.values()):
        if not rs.finished:
            rs.error = message
            engine._finish(rs, FinishReason.ERROR, outs)
    engine.arrivals.drop_finished()
