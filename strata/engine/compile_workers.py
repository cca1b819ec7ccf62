"""engine.compile_workers: processes that fill torch.compile's on-disk caches in parallel, so
that the warm-up finds its graphs compiled.

Compiling costs once per layer kind (docs/ENGINE.md), and most of a cold warm-up is inductor
lowering and compiling each graph dynamo traces, one after another in one process. Each worker
builds the same engine over a copy of the model cut to its shortest prefix that holds every
layer kind (dummy weights: compiling reads shapes, not values), on the same device, and runs
the warm-up's shapes in the warm-up's order, so dynamo traces the same graphs in the same order
in every process. Worker r of W hands inductor the graphs numbered r, r + W, ... (inductor
writes them to the FX graph and AOTAutograd caches) and runs the rest eagerly. The engine's own
warm-up then traces each graph and loads it from those caches instead of compiling it.

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

from strata.config import EngineConfig
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
    engine's warm-up will look up), and runs the rest eagerly."""

    def __init__(self, dynamic: Optional[bool], counter: Iterator[int], rank: int, world: int):
        super().__init__(None, None, dynamic)
        self.counter, self.rank, self.world = counter, rank, world
        self.compiled = 0

    def __call__(self, gm, example_inputs):
        if next(self.counter) % self.world == self.rank:
            self.compiled += 1
            return super().__call__(gm, example_inputs)
        return gm.forward


def sharded_backends(rank: int, world: int) -> tuple[Callable[[Optional[bool]], Any], list]:
    """A backend factory for `compiled_functions` (dynamic -> backend), every backend it makes
    sharing one graph counter, and the list of those backends (their `compiled` counts)."""
    counter = itertools.count()
    made: list[ShardedInductor] = []

    def make(dynamic: Optional[bool]) -> ShardedInductor:
        made.append(ShardedInductor(dynamic, counter, rank, world))
        return made[-1]

    return make, made


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
    if want < 2 and asked is None:  # one worker would compile everything before the warm-up
        return WorkerPlan(0, layers, 0.0, f"auto needs 4 cores a worker and two workers "
                                          f"({cores} cores)")
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] / MIB - float(ecfg.vram_reserve_mib)
        fits = max(0, int(free // mib))
        if fits < want:
            if fits == 0:
                return WorkerPlan(0, layers, mib, f"one needs about {mib:.0f} MiB and "
                                                  f"{max(free, 0):.0f} MiB are free above the reserve")
            want = fits
    return WorkerPlan(want, layers, mib)


def _worker_mib(loaded: Any, layers: int, n_slots: int, lane_rows: int) -> float:
    from strata.model.state import DecodeState

    model = loaded.model
    dropped = {id(p) for layer in model.layers[layers:] for p in layer.parameters()}
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in dropped)
    per = DecodeState.bytes_per_lane(loaded.args, lane_rows, loaded.dtype, loaded.has_mtp)
    # the state keeps the engine's stack sizes (DecodeState `stacks`)
    return (weights + (n_slots + 1) * (per["main"] + per["draft"])) / MIB + WORKER_OVERHEAD_MIB


def run_workers(plan: WorkerPlan, loaded: Any, ecfg: EngineConfig, device: torch.device, backend: str,
                n_slots: int, log: Callable[[str], None]) -> dict:
    """Start the plan's workers and wait for them (stopping any past WORKER_TIMEOUT_S, or all
    of them if this process is interrupted). Returns {"compiled": graphs inductor compiled in
    them, "failed": [why, ...], "seconds": ...}; a failed worker is reported, not raised: the
    warm-up compiles what it left."""
    import dataclasses
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    engine = dataclasses.asdict(ecfg)
    args = loaded.args
    job = {"load_args": {**loaded.load_args, "num_layers": plan.layers, "load_format": "dummy"},
           "stacks": (len(args.full_layers), len(args.linear_layers)),
           "engine": engine, "device": str(device), "backend": backend, "slots": n_slots,
           "has_mtp": loaded.has_mtp, "parent": os.getpid()}
    threads = max(1, (os.cpu_count() or 1) // plan.world)
    procs, conns = [], []
    saved = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    # Each worker's inductor compiles its kernels in a pool of its own: share the cores.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    t0 = time.perf_counter()
    try:
        for rank in range(plan.world):
            here, there = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(job, rank, plan.world, there),
                            name=f"strata-compile-{rank}", daemon=False)
            p.start()
            there.close()
            procs.append(p)
            conns.append(here)
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
        else:
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = saved
    results: list[Optional[dict]] = [None] * plan.world
    last = t0
    try:
        while any(r is None for r in results):
            for rank, (p, conn) in enumerate(zip(procs, conns)):
                if results[rank] is not None:
                    continue
                if conn.poll(0.2):
                    try:
                        results[rank] = conn.recv()
                    except EOFError:
                        results[rank] = {"error": f"worker {rank} exited without a result "
                                                  f"(exit code {p.exitcode})"}
                elif not p.is_alive() and not conn.poll(0):
                    results[rank] = {"error": f"worker {rank} exited without a result "
                                              f"(exit code {p.exitcode})"}
            now = time.perf_counter()
            if now - t0 > WORKER_TIMEOUT_S:
                for rank, r in enumerate(results):
                    if r is None:
                        results[rank] = {"error": f"worker {rank} still running after "
                                                  f"{WORKER_TIMEOUT_S:.0f} s: stopped"}
                break
            if now - last >= PROGRESS_S:
                last = now
                done = sum(r is not None for r in results)
                log(f"INFO compile workers: {done} of {plan.world} done ({now - t0:.0f} s)")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(10)
        for conn in conns:
            conn.close()
    failed = [r["error"] for r in results if r and "error" in r]
    return {"compiled": sum(r.get("compiled", 0) for r in results if r),
            "failed": failed, "seconds": time.perf_counter() - t0}


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
        conn.send(_compile_share(job, rank, world))
    except BaseException as e:  # reported to the engine, which carries on without this share
        tail = traceback.format_exc().strip().splitlines()[-1]
        conn.send({"error": f"worker {rank}: {type(e).__name__}: {e} ({tail})"})
    finally:
        conn.close()
        sys.stdout.flush()


def _compile_share(job: dict, rank: int, world: int) -> dict:
    import dataclasses

    from strata.engine.llm_engine import Engine
    from strata.kernels import ops
    from strata.model.loader import load_checkpoint

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
    make, made = sharded_backends(rank, world)
    eng = Engine(loaded, ecfg, device, log=lambda s: None, compile_backend=make,
                 state_stacks=tuple(job["stacks"]))
    eng.warmup(capture=False)
    return {"compiled": sum(b.compiled for b in made)}
