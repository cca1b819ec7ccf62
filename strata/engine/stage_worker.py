"""A stage process of engine.stages > 1 (strata/engine/stages.py starts it; spawn target).

It loads only its layer range, joins the group, then serves the driver's messages
(strata/engine/stage_protocol.py) until STOP or until the driver goes away: its own K/V, DeltaNet
state and a window's DeltaNet rows for its layers; on the last stage also the slot buffers and the
unchanged Verifier, whose model is `LastStageModel` (its verify forward and prompt chunk start from
the hidden states handed over by the stage before). With engine.graphs a window's compute replays a
graph of this stage's own (`StageWindows`, strata/engine/stage_graphs.py), the messages outside it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch

from strata.engine import stage_protocol as proto
from strata.engine.memory import MIB, MemoryBudget
from strata.engine.stage_graphs import StageGraphs, StaticInputs, scratch_plan
from strata.model.stage_slice import StageSlice


def _log(rank: int, msg: str) -> None:
    print(f"[stage {rank} {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _watch_parent(parent: int) -> None:
    """The driver gone (even by SIGKILL): nothing is left to serve."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


class LastStageModel:
    """The last stage's model as the Verifier sees it: the window's tokens (made here, from the
    pending token and drafts) go to stage 0, and the verify forward and prompt chunk continue
    from the hidden states the stage before hands over. Everything else is the stage model's."""

    def __init__(self, model: Any, rank: int):
        self._model = model
        self._rank = rank
        #: A window's hidden states already received (into a graph's static buffer), or None:
        #: the verify forward receives them itself.
        self._handed: Optional[torch.Tensor] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    @contextmanager
    def handed_over(self, x: torch.Tensor) -> Iterator[None]:
        """Verify windows inside start from `x` (received before: a graph holds no message)."""
        self._handed = x
        try:
            yield
        finally:
            self._handed = None

    def _hidden(self, *lead: int, like: torch.Tensor) -> torch.Tensor:
        if self._handed is not None:
            return self._handed
        m = self._model
        x = torch.empty(*lead, m.args.hidden_size, dtype=m.dtype, device=like.device)
        return proto.recv(x, self._rank - 1)

    def verify_window(self, tokens, group_slot, group_pos, ctx, state, split_keys=0):
        if tokens.shape[1] > 2:  # chained drafts: only this stage can make them (see OP_WINDOW)
            proto.send_back(tokens, 0)
        x = self._hidden(*tokens.shape, like=tokens)
        x, rec, conv = self._model.window_layers(x, group_slot, group_pos, ctx, state, split_keys)
        hidden, logits = self._model.c_head(x)
        return hidden, logits, rec, conv

    def prefill(self, tokens, lane, start, state, length=None, ctx=None):
        grid = tokens.dim() == 2  # (1, L) from Verifier.prefill (one slot a chunk on a split)
        x = self._hidden(tokens.shape[0] if grid else 1, tokens.shape[-1], like=tokens)
        out = self._model.p_norm(self._model.prefill_layers(x, lane, start, state, length, ctx))
        return out if grid else out[0]


class PendingCommits:
    """A middle stage's windows whose output (the accepted prefix) the last stage has not yet
    returned to it: with pipelined slot groups it runs the next group's window meanwhile, and
    commits a window's DeltaNet rows before a later message touches its slots (the commit
    replays the rows' factors onto the state the window read, so that state must not move)."""

    def __init__(self, state: Any, pos: torch.Tensor, last: int, device: torch.device,
                 graphs: StageGraphs):
        self.state, self.pos, self.last, self.device = state, pos, last, device
        self.graphs = graphs
        self.scratch = {state.scratch}  # every padded window writes it: no order to keep there
        #: (lanes as a set, gs, gp, rows per group, rec, conv, the graph that wrote rec and
        #: conv or None), oldest first.
        self.items: list[tuple] = []

    def add(self, gs, gp, g, rec, conv, graph: Optional[str]) -> None:
        self.items.append((set(gs.tolist()) - self.scratch, gs, gp, g, rec, conv, graph))

    def settle(self, lanes: Optional[set] = None) -> None:
        """Commit the pending windows up to the last one sharing a lane with `lanes` (None:
        all of them). Outputs arrive oldest first, so the earlier ones are read on the way."""
        upto = len(self.items) if lanes is None else max(
            (i + 1 for i, it in enumerate(self.items) if it[0] & lanes), default=0)
        self._settle(upto)

    def settle_graph(self, graph: str) -> None:
        """Commit the pending windows up to the one whose DeltaNet rows `graph` wrote: its
        next replay will overwrite them."""
        self._settle(next(i + 1 for i, it in enumerate(self.items) if it[6] == graph))

    def _settle(self, upto: int) -> None:
        from strata.engine.stages import commit_stage

        for _, gs, gp, g, rec, conv, graph in self.items[:upto]:
            out = proto.recv_back(torch.empty(gs.shape[0], g + 2, dtype=torch.long,
                                              device=self.device), self.last)
            commit_stage(out[:, g], gs, gp, rec, conv, self.state, self.pos)
            self.graphs.release(graph)
        del self.items[:upto]


class StageWindows:
    """A stage's side of a window (not stage 0's): the hidden states received from the stage
    before, then its compute, replayed from a graph when windows are captured (the messages
    stay outside it: stage_graphs.py) or eager."""

    def __init__(self, model: Any, verifier: Any, state: Any, graphs: StageGraphs,
                 split_keys: int, rank: int, device: torch.device, dtype: torch.dtype):
        """`model`: the stage's model (the last stage's LastStageModel); `verifier`: the last
        stage's Verifier over it, else None."""
        self.model, self.verifier, self.state, self.graphs = model, verifier, state, graphs
        self.split_keys, self.rank, self.dtype = split_keys, rank, dtype
        self.inputs = StaticInputs(device)

    def _receive(self, ng: int, g: int) -> torch.Tensor:
        """The hidden states from the stage before: into the graph's static buffer."""
        h = self.model.args.hidden_size
        buf = (self.inputs.get("x", ng, g, h, dtype=self.dtype) if self.graphs.captured
               else torch.empty(ng, g, h, dtype=self.dtype, device=self.inputs.device))
        return proto.recv(buf, self.rank - 1)

    def _static_plan(self, plan: torch.Tensor, rows: int) -> tuple[torch.Tensor, Callable]:
        """The first `rows` rows of the plan in a static buffer, and a function that runs a
        callable on the scratch lane's plan there, then restores it (a capture's warm-up)."""
        static = self.inputs.get("plan", rows, plan.shape[1])
        static.copy_(plan[:rows])

        def on_scratch(fn: Callable[[], Any]) -> None:
            static.copy_(scratch_plan(static, self.state.scratch))
            fn()
            static.copy_(plan[:rows])

        return static, on_scratch

    def layers(self, plan: torch.Tensor, g: int, ctx: int, pending: PendingCommits) -> tuple[Any, ...]:
        """A middle stage: (hidden states to send on, DeltaNet recurrent factors and conv
        snapshots, graph key or None). They are read when the window lands (`pending`): its
        graph is held until then."""
        x_in = self._receive(plan.shape[1], g)
        if not self.graphs.captured:
            return (*self.model.window_layers(x_in, plan[0], plan[1], ctx, self.state,
                                              self.split_keys), None)
        static, on_scratch = self._static_plan(plan, 2)
        run = lambda: self.model.window_layers(x_in, static[0], static[1], ctx, self.state,  # noqa: E731
                                               self.split_keys)
        (x, rec, conv), graph = self.graphs.run((plan.shape[1], g, ctx), run,
                                                lambda: on_scratch(run), hold=True,
                                                land=pending.settle_graph)
        return x.clone(), rec, conv, graph  # (sent asynchronously: the next replay rewrites x)

    def verify(self, plan: torch.Tensor, g: int, ctx: int, filtered: bool) -> torch.Tensor:
        """The last stage: the window's output (verify, accept, commit, draft). A window of
        more than 2 rows per group runs eagerly: its verify forward sends the chained drafts
        to stage 0 before it can receive the hidden states."""
        if g > 2 or not self.graphs.captured:
            return self.verifier.window(plan[0], plan[1], plan[2], g, ctx, filtered)
        x = self._receive(plan.shape[1], g)
        static, on_scratch = self._static_plan(plan, 3)

        def run() -> torch.Tensor:
            with self.model.handed_over(x):
                return self.verifier.window(static[0], static[1], static[2], g, ctx, filtered)

        out, _ = self.graphs.run((plan.shape[1], g, ctx, int(filtered)), run,
                                 lambda: on_scratch(run))
        return out.clone()  # (sent asynchronously: the next replay rewrites it)


def _stage_budget(loaded: Any, ecfg: Any, device: torch.device, n_slots: int, max_context: int,
                  drafting: bool) -> MemoryBudget:
    """This stage's device budget for its graphs: its weights and slot state above the reserve
    (and, on CUDA, what the device reports free)."""
    from strata.engine.device import allocator_reclaim, device_memory
    from strata.model.state import DecodeState

    total_mib, free_fn = device_memory(device, ecfg.cpu_device_mib)
    weights_mib = sum(p.numel() * p.element_size() for p in loaded.model.parameters()
                      if not p.is_meta) / MIB
    per = DecodeState.bytes_per_lane(loaded.args, max_context + ecfg.window_rows + 1, loaded.dtype,
                                     drafting)
    return MemoryBudget(total_mib, float(ecfg.vram_reserve_mib), weights_mib,
                        (per["main"] + per["draft"]) / MIB, n_slots, free_fn,
                        reclaim=allocator_reclaim(device))


def stage_main(rank: int, world: int, port: int, cfg_dict: dict, sl: tuple, device_name: str,
               parent: int) -> None:
    """Process entry point: load, report ready (or the load error) through the store, serve."""
    import torch.distributed as dist

    from strata.engine.stages import JOIN_TIMEOUT_S

    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    stage = StageSlice(*sl)
    device = torch.device(device_name)
    try:
        from omegaconf import OmegaConf

        from strata.config import StrataConfig
        from strata.kernels import ops
        from strata.model.loader import load_model

        cfg = OmegaConf.merge(OmegaConf.structured(StrataConfig), cfg_dict)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # a forked child: OpenMP hangs in it with more than one thread (CPU stages are
            torch.set_num_threads(1)  # for tests and checks, not speed)
        ops.set_backend(cfg.backend.name, device.type)
        loaded = load_model(cfg.model, device, lambda m: None, stage=stage)
    except Exception as e:
        store.set(f"stage{rank}.error", f"{type(e).__name__}:stage {rank}: {e}")
        os._exit(2)
    store.set(f"stage{rank}.ready", "1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    proto.open_channels()
    try:
        serve(rank, world, stage, cfg, loaded, device, store)
    except Exception as e:  # the driver went away mid-message, or a real error: say which
        _log(rank, f"stopped: {type(e).__name__}: {e}")
        if not isinstance(e, RuntimeError) or "Connection closed" not in str(e):
            traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()
    os._exit(0)


def serve(rank: int, world: int, stage: StageSlice, cfg: Any, loaded: Any, device: torch.device,
          store: Any) -> None:
    from strata.config import plain_engine_config
    from strata.engine.compiling import compiled_functions
    from strata.engine.verifier import SlotBuffers, Verifier
    from strata.model.state import DecodeState

    ecfg = plain_engine_config(cfg.engine)
    model, args, last = loaded.model, loaded.args, world - 1
    op, n_slots, drafting, *_ = proto.recv_header(device)
    if op != proto.OP_SETUP:
        raise RuntimeError(f"stage {rank}: expected the setup message, got op {op}")
    drafting = bool(drafting)
    max_context = min(int(ecfg.max_context), args.max_position_embeddings)
    try:
        state = DecodeState(args, n_slots, max_context, loaded.dtype, device, drafting and stage.last,
                            spare_rows=ecfg.window_rows + 1)
        bufs = SlotBuffers(n_slots, args.hidden_size, loaded.dtype, device)
        status = 0
    except Exception as e:  # (out of memory) the driver reports it by stage
        store.set(f"stage{rank}.error", f"ConfigError:engine.slots: stage {rank} cannot hold the "
                  f"state of {n_slots} slots ({type(e).__name__}: {str(e).splitlines()[0]}); lower "
                  f"engine.slots or engine.max_context, or move layers off it (engine.stage_layers)")
        status = 1
    if proto.gather_status(status, device):
        return
    compiling = ecfg.compile == "on" or (ecfg.compile == "auto" and device.type == "cuda")
    # CUDA stages replay graphs only with engine.stage_graphs=true (null is off there)
    functions = (compiled_functions(model, device, bool(ecfg.graphs and ecfg.stage_graphs),
                                    ecfg.compile_specialize_one)
                 if compiling else None)
    split_keys = ecfg.invariant_split_keys if ecfg.batch_invariant else 0
    graphs = StageGraphs.for_stage(ecfg, device, _stage_budget(loaded, ecfg, device, n_slots,
                                                               max_context, drafting and stage.last),
                                   lambda m: _log(rank, m), holds_outputs=not stage.last)
    stage_model = LastStageModel(model, rank) if stage.last else model
    verifier = None
    if stage.last:
        verifier = Verifier(stage_model, state, bufs, drafting, split_keys=split_keys,
                            functions=functions, synthetic_acceptance=ecfg.synthetic_acceptance)
    windows = StageWindows(stage_model, verifier, state, graphs, split_keys, rank, device,
                           loaded.dtype)
    empty = lambda *shape, dtype=torch.long: torch.empty(*shape, dtype=dtype, device=device)  # noqa: E731
    pending = PendingCommits(state, bufs.pos, last, device, graphs)
    with torch.inference_mode():
        while True:
            op, a, b, c, d, _ = proto.recv_header(device)
            if op == proto.OP_STOP:  # take what is still owed to it, so every send completes
                pending.settle()
                proto.flush()
                if graphs.captured:  # for the driver's report (StageGroup.close)
                    store.set(f"stage{rank}.graphs", json.dumps(graphs.stats()))
                return
            if op == proto.OP_BIND:
                payload = proto.recv(empty(a, 4), 0)
                lanes = payload[:, 0].contiguous()
                pending.settle(set(lanes.tolist()))  # a lane's old window commits before its reset
                state.reset_lanes(lanes)
                bufs.set_params(lanes, payload[:, 3:4].contiguous().view(torch.float32),
                                payload[:, 1:3].contiguous())
            elif op == proto.OP_WINDOW:
                ng, g, ctx, filtered = a, b, c, bool(d)
                plan = proto.recv(empty(3, ng), 0)
                if stage.last:
                    proto.back_to_all(windows.verify(plan, g, ctx, filtered))
                    continue
                pending.settle(set(plan[0].tolist()))
                x, rec, conv, graph = windows.layers(plan, g, ctx, pending)
                proto.send(x, rank + 1)
                pending.add(plan[0], plan[1], g, rec, conv, graph)
            elif op == proto.OP_PREFILL:
                n, ctx = a, b
                buf = proto.recv(empty(n + 4), 0)
                tokens, meta = buf[:n], buf[n:]
                if stage.last:
                    token = verifier.prefill(tokens, meta, ctx)
                    proto.send_back(torch.cat([token, bufs.draft[meta[0:1]]]), 0)
                    continue
                pending.settle()
                x = proto.recv(empty(1, n, args.hidden_size, dtype=loaded.dtype), rank - 1)
                x = model.prefill_layers(x, meta[0:1], meta[1:2], state, length=meta[2:3], ctx=ctx)
                proto.send(x, rank + 1)
            elif op == proto.OP_PING:
                ng, g = a, b
                proto.recv(empty(3, ng), 0)
                hidden = proto.recv(empty(ng, g, args.hidden_size, dtype=loaded.dtype), rank - 1)
                if stage.last:
                    proto.back_to_all(empty(ng, g + 2).zero_())
                else:
                    proto.send(hidden, rank + 1)
                    proto.recv_back(empty(ng, g + 2), last)
            else:
                raise RuntimeError(f"stage {rank}: unknown op {op}")
