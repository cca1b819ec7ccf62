"""engine.compile_workers: processes that compile the warm-up's graphs in parallel, leaving them
in torch.compile's on-disk caches for the warm-up to load.

Compiling costs once per layer kind (docs/ENGINE.md), and most of a cold warm-up is inductor
lowering and compiling each graph dynamo traces, one after another in one process. Each worker
builds the same engine over a copy of the model cut to its shortest prefix that holds every
layer kind (dummy weights: compiling reads shapes, not values), on the same device, and runs
the warm-up's shapes in the warm-up's order, so dynamo traces the same graphs in the same order
in every process. Worker r of W hands inductor the graphs numbered r, r + W, ... (inductor
writes them to the FX graph and AOTAutograd caches), runs the rest eagerly, and tells the
engine after each. The engine's warm-up runs beside them: it traces each graph, waits until the
worker that owns it has compiled it, and loads it from the caches instead of compiling it.

Nothing the engine computes depends on the workers: a graph they did not leave in the caches
(a worker that failed, a key that differs) is compiled by the warm-up as before.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from strata.config import EngineConfig, environ_set
from strata.engine.memory import MIB

#: Device memory a worker needs beyond its model and slot state: its CUDA context, the
#: allocator's slack, inductor's autotuning buffers.
WORKER_OVERHEAD_MIB = 1536.0
#: Most workers `auto` starts.
AUTO_MAX = 4
#: A worker still running after this long is stopped; the warm-up compiles what it left.
WORKER_TIMEOUT_S = 900.0
#: Seconds between the progress lines of the wait for the workers.
PROGRESS_S = 15.0


def kinds_prefix(args: Any) -> int:
    """The fewest leading decoder layers that hold every layer kind the model has (attention
    type, and MoE or dense MLP), in the order the full model first meets them."""
    seen: dict[tuple[str, bool], int] = {}
    for i, kind in enumerate(args.layer_types[: args.num_hidden_layers]):
        seen.setdefault((kind, args.is_moe_layer(i)), i)
    return max(seen.values()) + 1


class ShardedInductor(torch._TorchCompileInductorWrapper):
    """torch.compile's inductor backend for worker `rank` of `world`: the graphs dynamo hands
    any backend sharing `counter` are numbered in order; this one compiles those numbered rank
    mod world, exactly as torch.compile(backend="inductor") does (so the caches hold what the
    engine's warm-up will look up), calls `handled(k)` after its k-th (compiled or failed), and
    runs the rest eagerly."""

    def __init__(self, dynamic: Optional[bool], options: Optional[dict], counter: Iterator[int],
                 rank: int, world: int, handled: Callable[[int], None], tally: list):
        super().__init__(None, options, dynamic)
        self.counter, self.rank, self.world = counter, rank, world
        self.handled, self.tally = handled, tally

    def __call__(self, gm, example_inputs):
        if next(self.counter) % self.world != self.rank:
            return gm.forward
        try:
            out = super().__call__(gm, example_inputs)
            self.tally[1] += 1
            return out
        finally:
            self.tally[0] += 1
            self.handled(self.tally[0])


def sharded_backends(rank: int, world: int, handled: Callable[[int], None] = lambda k: None):
    """A backend factory for `compiled_functions` ((dynamic, options) -> backend), every backend
    it makes sharing one graph counter, and the tally [graphs handled, graphs compiled] they
    share."""
    counter, tally = itertools.count(), [0, 0]

    def make(dynamic: Optional[bool], options: Optional[dict]) -> ShardedInductor:
        return ShardedInductor(dynamic, options, counter, rank, world, handled, tally)

    return make, tally


class AwaitingInductor(torch._TorchCompileInductorWrapper):
    """The engine's inductor backend while its compile workers run: graph n (numbered as the
    workers number theirs) waits until worker n mod W has handled it, then compiles as
    torch.compile(backend="inductor") does, which finds it in the caches. Past the workers
    (later shapes, or every graph once they are done) it compiles at once."""

    def __init__(self, dynamic: Optional[bool], options: Optional[dict],
                 workers: "PlannedWorkers"):
        super().__init__(None, options, dynamic)
        self.workers = workers

    def __call__(self, gm, example_inputs):
        group = self.workers.group
        if group is not None:  # (None: not started, or their start failed)
            group.wait_graph(next(group.counter))
        return super().__call__(gm, example_inputs)


@dataclass
class WorkerPlan:
    """What the engine asks of its compile workers."""
    world: int
    #: Decoder layers each worker's model keeps (kinds_prefix).
    layers: int
    #: Estimated device MiB per worker.
    mib: float
    #: Why none start (None when world > 0).
    reason: Optional[str] = None


def plan_workers(asked: Optional[int], loaded: Any, ecfg: Any, device: torch.device,
                 n_slots: int, max_context: int) -> WorkerPlan:
    """How many workers start: engine.compile_workers (null: auto, on CUDA one per 4 cores up to
    AUTO_MAX and at least two, none on the CPU), fewer where the device's free memory cannot
    hold them beside the engine."""
    args = loaded.args
    layers = kinds_prefix(args)
    if asked == 0:
        return WorkerPlan(0, layers, 0.0, "engine.compile_workers=0")
    if asked is None and device.type != "cuda":
        return WorkerPlan(0, layers, 0.0, "auto starts none off CUDA")
    if not loaded.load_args:
        return WorkerPlan(0, layers, 0.0, "the model was not built by load_checkpoint")
    if layers >= args.num_hidden_layers and asked is None:
        return WorkerPlan(0, layers, 0.0, "the model is no deeper than its layer kinds")
    mib = _worker_mib(loaded, layers, n_slots, max_context + ecfg.window_rows + 1)
    cores = os.cpu_count() or 1
    want = asked if asked is not None else min(AUTO_MAX, cores // 4)
    limit = f"{cores} cores, 4 a worker"
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] / MIB - float(ecfg.vram_reserve_mib)
        fits = max(0, int(free // mib))
        if fits < want:
            limit = (f"one needs about {mib:.0f} MiB and {max(free, 0):.0f} MiB are free above "
                     f"the reserve")
            if fits == 0:
                return WorkerPlan(0, layers, mib, limit)
            want = fits
    if want < 2 and asked is None:  # a lone worker compiles every graph the warm-up waits for
        return WorkerPlan(0, layers, mib, f"auto needs two workers ({limit})")
    return WorkerPlan(want, layers, mib)


def _worker_mib(loaded: Any, layers: int, n_slots: int, lane_rows: int) -> float:
    from strata.model.state import DecodeState

    model = loaded.model
    dropped = {id(p) for layer in model.layers[layers:] for p in layer.parameters()}
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in dropped)
    per = DecodeState.bytes_per_lane(loaded.args, lane_rows, loaded.dtype, loaded.has_mtp)
    # the state keeps the engine's stack sizes (DecodeState `stacks`)
    return (weights + (n_slots + 1) * (per["main"] + per["draft"])) / MIB + WORKER_OVERHEAD_MIB


class PlannedWorkers:
    """The engine's compile workers between its build and its warm-up: `backend` goes to
    compiled_functions while the engine is built, and the processes start only when the warm-up
    does (`start`), so that an engine whose build fails leaves none running."""

    def __init__(self, plan: WorkerPlan, start: Callable[[WorkerPlan], "WorkerGroup"]):
        self.plan, self._start = plan, start
        #: The started group (None before `start`, or when it failed).
        self.group: Optional[WorkerGroup] = None

    def backend(self, dynamic: Optional[bool], options: Optional[dict]) -> AwaitingInductor:
        return AwaitingInductor(dynamic, options, self)

    def start(self) -> "WorkerGroup":
        self.group = self._start(self.plan)
        return self.group


class WorkerGroup:
    """The plan's workers, started; the engine's warm-up waits on them graph by graph
    (`backend`, AwaitingInductor), then `finish` collects what they did."""

    def __init__(self, plan: WorkerPlan, loaded: Any, ecfg: EngineConfig, device: torch.device,
                 kernels: str, n_slots: int, log: Callable[[str], None]):
        import dataclasses
        import multiprocessing as mp

        self.plan, self.log = plan, log
        self.counter = itertools.count()
        args = loaded.args
        if device.type == "cuda" and device.index is None:  # the workers' device is this one
            device = torch.device("cuda", torch.cuda.current_device())
        job = {"load_args": {**loaded.load_args, "num_layers": plan.layers, "load_format": "dummy"},
               "stacks": (len(args.full_layers), len(args.linear_layers)),
               "engine": dataclasses.asdict(ecfg), "device": str(device), "backend": kernels,
               "slots": n_slots, "has_mtp": loaded.has_mtp, "parent": os.getpid(),
               # inductor's CPU kernels are generated for the process's thread count, which
               # is in their cache keys: the workers' must be the engine's
               "threads": torch.get_num_threads()}
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        #: Per worker: graphs it has handled; its final report once it sent one (or died).
        self.handled = [0] * plan.world
        self.results: list[Optional[dict]] = [None] * plan.world
        self.summary: Optional[dict] = None
        self.t0 = self._last = time.perf_counter()
        # Each worker's inductor compiles its kernels in a pool of its own: share the cores.
        threads = str(max(1, (os.cpu_count() or 1) // plan.world))
        try:
            with environ_set("TORCHINDUCTOR_COMPILE_THREADS", threads):
                for rank in range(plan.world):
                    here, there = ctx.Pipe(duplex=False)
                    p = ctx.Process(target=worker_main, args=(job, rank, plan.world, there),
                                    name=f"strata-compile-{rank}", daemon=False)
                    p.start()
                    there.close()
                    self.procs.append(p)
                    self.conns.append(here)
        except BaseException:
            self.finish()
            raise

    def _poll(self, wait_s: float) -> None:
        """Read what the workers sent; a worker gone without its report is failed."""
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns)):
            while self.results[rank] is None and conn.poll(wait_s):
                wait_s = 0.0
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = {"error": f"worker {rank} exited without a result (exit code "
                                    f"{p.exitcode})"}
                if isinstance(msg, int):
                    self.handled[rank] = msg
                else:
                    self.results[rank] = msg
            if self.results[rank] is None and not p.is_alive() and not conn.poll(0):
                self.results[rank] = {"error": f"worker {rank} exited without a result (exit "
                                               f"code {p.exitcode})"}
        now = time.perf_counter()
        if now - self.t0 > WORKER_TIMEOUT_S:
            for rank, r in enumerate(self.results):
                if r is None:
                    self.results[rank] = {"error": f"worker {rank} still running after "
                                                   f"{WORKER_TIMEOUT_S:.0f} s: stopped"}
        if now - self._last >= PROGRESS_S:
            self._last = now
            done = sum(r is not None for r in self.results)
            self.log(f"INFO compile workers: {sum(self.handled)} graphs compiled, {done} of "
                     f"{self.plan.world} workers done ({now - self.t0:.0f} s)")

    def wait_graph(self, n: int) -> None:
        """Until the worker that owns graph n has handled it (or is done)."""
        rank, k = n % self.plan.world, n // self.plan.world + 1
        while self.results[rank] is None and self.handled[rank] < k:
            self._poll(0.05)

    def finish(self) -> dict:
        """Wait for every worker's report (stopping any past WORKER_TIMEOUT_S, or all of them if
        this process is interrupted). Returns {"compiled": graphs inductor compiled in them,
        "failed": [why, ...], "seconds": ...}: a failed worker is reported, not raised. Once
        done, it returns the same at once."""
        if self.summary is not None:
            return self.summary
        try:
            while any(r is None for r in self.results[:len(self.procs)]):
                self._poll(0.2)
        finally:
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
                p.join(10)
            for conn in self.conns:
                conn.close()
        for rank, r in enumerate(self.results):  # interrupted: every wait must end
            if r is None:
                self.results[rank] = {"error": f"worker {rank} stopped unfinished"}
        done = [r for r in self.results if r]
        self.summary = {"compiled": sum(r.get("compiled", 0) for r in done),
                        "failed": [r["error"] for r in done if "error" in r],
                        "seconds": time.perf_counter() - self.t0}
        return self.summary


def _watch_parent(parent: int) -> None:
    """The engine gone (even by SIGKILL): nothing is left to compile for."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def worker_main(job: dict, rank: int, world: int, conn) -> None:
    """A compile worker (spawn target): build the engine at the prefix depth without its
    warm-up, then run the warm-up's shapes with every world-th graph compiled by inductor."""
    threading.Thread(target=_watch_parent, args=(job["parent"],), daemon=True).start()
    try:
        conn.send(_compile_share(job, rank, world, conn))
    except BaseException as e:  # reported to the engine, which carries on without this share
        tail = traceback.format_exc().strip().splitlines()[-1]
        conn.send({"error": f"worker {rank}: {type(e).__name__}: {e} ({tail})"})
    finally:
        conn.close()
        sys.stdout.flush()


def _compile_share(job: dict, rank: int, world: int, conn) -> dict:
    import dataclasses

    from strata.engine.llm_engine import Engine
    from strata.kernels import ops
    from strata.model.loader import load_checkpoint

    torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ops.set_backend(job["backend"], device.type)
    loaded = load_checkpoint(device=device, log=lambda s: None, **job["load_args"])
    if loaded.has_mtp != job["has_mtp"]:
        return {"error": f"worker {rank}: the dummy model's MTP ({loaded.has_mtp}) is not the "
                         f"checkpoint's ({job['has_mtp']}): its graphs would not be the engine's"}
    ecfg = dataclasses.replace(EngineConfig(**job["engine"]), slots=job["slots"], warmup="off",
                               compile="on", compile_workers=0)
    make, tally = sharded_backends(rank, world, handled=conn.send)
    eng = Engine(loaded, ecfg, device, log=lambda s: None, compile_backend=make,
                 state_stacks=tuple(job["stacks"]))
    eng.warmup(capture=False)
    return {"compiled": tally[1]}
