"""The engine: requests in, one iteration per `step()`, streaming outputs and a trace out.

Each step schedules (cancels, arrivals, admission, the iteration's plan), runs the plan on the
device (a prompt chunk or a decode window, through the ModelRunner), and commits what came
back (postprocess.py: tokens emitted, stop conditions, finished requests). Memory planning,
warm-up, graph caching, text streams, faults, reporting and metrics live in their own
modules. The engine never imports the faces (strata.serve, strata.__main__).
Single-threaded: drive it from one thread.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from strata.config import (ConfigError, batch_mtp_from_env, check_known_keys, overlap_on,
                           plain_engine_config, prefill_slots_of, validate_engine, validate_model)
from strata.engine.arrivals import Arrivals
from strata.engine.compiling import compiled_functions
from strata.engine.device import resolve_device
from strata.engine.draft_vocab import draft_head, head_mib
from strata.engine.expert_cache import ExpertCache, plan_expert_cache
from strata.engine.memory import plan_engine_memory
from strata.engine.model_runner import ModelRunner
from strata.engine.overlap import OverlappedWindows
from strata.engine.faults import fail_touched
from strata.engine.pipeline import PipelinedWindows
from strata.engine.postprocess import commit_prompt, commit_window, output_of, record_finish
from strata.engine.reporting import config_fields, engine_stats, final_text
from strata.engine.request import Request, RequestError, RequestOutput
from strata.engine.scheduler import Plan, Scheduler
from strata.engine.slots import RequestState
from strata.engine.verifier import SlotBuffers, Verifier
from strata.engine.warmup import plan_warmup
from strata.engine.window import window_shape
from strata.kernels import ops
from strata.kinds import FinishReason, PlanKind
from strata.model.loader import LoadedModel, load_model
from strata.model.state import DecodeState
from strata.trace import TraceWriter, context_tier

#: Plan kinds the step compares every iteration (read through the enum's class, a member costs
#: a metaclass attribute hook).
_PREFILL, _DECODE = PlanKind.PREFILL, PlanKind.DECODE


def _check_id(req_id) -> None:
    """A request id given to cancel or release (the request table would raise TypeError:
    unhashable type)."""
    if not isinstance(req_id, str):
        raise RequestError("id", f"must be a request id (str), got {type(req_id).__name__}")


class Engine:
    @classmethod
    def from_config(cls, cfg: Any, log: Callable[[str], None] = print,
                    trace_path: Optional[str | Path] = None) -> "Engine":
        check_known_keys(cfg)
        device = resolve_device(cfg.device)
        validate_engine(cfg.engine)  # fail before the checkpoint is read
        validate_model(cfg.model)
        try:
            chosen = ops.set_backend(cfg.backend.name, device.type)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        log(f"INFO kernels: backend={chosen} ({cfg.backend.name} asked)")
        if cfg.engine.stages > 1:  # a layer split: stage processes (strata/engine/stages.py)
            from strata.engine import stages
            return stages.start(cls, cfg, device, log, trace_path)
        # with the expert cache the routed experts load into host memory, where it keeps them
        t0 = time.perf_counter()
        loaded = load_model(cfg.model, device, log, routed_on_host=cfg.engine.expert_cache_mib > 0)
        log(f"INFO model {loaded.path.name} loaded in {time.perf_counter() - t0:.1f} s")
        return cls(loaded, cfg.engine, device, log=log, trace_path=trace_path)

    def __init__(self, loaded: LoadedModel, ecfg: Any, device: torch.device,
                 log: Callable[[str], None] = print, trace_path: Optional[str | Path] = None,
                 stages: Optional[Any] = None, compile_backend: Optional[Callable] = None,
                 state_stacks: Optional[tuple[int, int]] = None):
        """`stages`: the stage processes of engine.stages > 1 (stages.StageGroup); `loaded`
        is then stage 0's part of the model. `compile_backend` and `state_stacks`: a compile
        worker's sharded inductor (dynamic -> backend; else torch's own) and the engine's state
        stack sizes (DecodeState; strata/engine/compile_workers.py)."""
        ecfg = self.cfg = plain_engine_config(ecfg)  # attribute reads on the hot path must be cheap
        validate_engine(ecfg)
        self.log, self.device, self.loaded = log, device, loaded
        self.model, self.args, self.tokenizer = loaded.model, loaded.args, loaded.tokenizer
        self.model_name = loaded.path.name
        dense_prefill = any(getattr(m, "dense_prefill", False) for m in self.model.modules())
        self.prefill_slots = prefill_slots_of(ecfg, dense_prefill)
        if ecfg.prefill_slots is not None and ecfg.prefill_slots > 1 and dense_prefill:
            # the dense path is chosen by the chunk's rows, which other slots' chunks change
            raise ConfigError(f"model.moe_dense_prefill=true runs a prompt chunk's experts dense "
                              f"by its row count, which engine.prefill_slots="
                              f"{ecfg.prefill_slots} changes (other bits than one slot a "
                              f"chunk): use engine.prefill_slots=1 with it")
        self.max_context = min(int(ecfg.max_context), self.args.max_position_embeddings)
        if self.max_context < ecfg.max_context:
            log(f"INFO engine.max_context={ecfg.max_context} exceeds the model's "
                f"max_position_embeddings; using {self.max_context}")
        self.eos = set(self.args.eos_token_id)
        # the draft head before the memory plan, which counts it with the weights
        draft_ids, head = draft_head(self.model, ecfg, self.args.eos_token_id)
        draft_head_mib = head_mib(head)
        fp8_note = " in FP8 (engine.draft_head=fp8)" if ecfg.draft_head == "fp8" else ""
        if draft_ids is not None:
            log(f"INFO engine.draft_vocab={ecfg.draft_vocab}: drafts choose among "
                f"{draft_ids.numel()} of {self.args.vocab_size} tokens "
                f"({ecfg.draft_vocab_file or 'the lowest ids'}, with the end-of-text ids); "
                f"their head holds {draft_head_mib:.0f} MiB{fp8_note}")
        elif head is not None:
            log(f"INFO engine.draft_head=fp8: drafts read an FP8 copy of the LM head "
                f"({draft_head_mib:.0f} MiB); the targets read the model's own")
        elif ecfg.draft_head == "fp8":
            log("INFO engine.draft_head=fp8: the LM head is FP8 already; drafts read it")
        self.trace = TraceWriter(trace_path)
        self._clock0 = time.perf_counter()
        self._warnings: list[str] = []

        # ---- what fits: slots, and whether they draft (DESIGN.md section 3) -------------------
        batch_mtp = batch_mtp_from_env(ecfg.batch_mtp)
        off_reason = ("the checkpoint has no mtp.* weights" if not loaded.has_mtp else
                      f"engine.spec={ecfg.spec} < 2 leaves no draft row" if ecfg.spec < 2 else None)
        cache_plan = (plan_expert_cache(self.model, ecfg.expert_cache_mib)
                      if ecfg.expert_cache_mib > 0 else None)
        mem = plan_engine_memory(loaded, ecfg, device, self.max_context, off_reason, cache_plan,
                                 draft_head_mib)
        self.budget, self.drafting, n_slots = mem.budget, mem.drafting, mem.budget.slots
        self.batch_mtp = bool(batch_mtp and self.drafting)
        log(f"INFO {mem.describe()}")
        self.expert_cache: Optional[ExpertCache] = None
        #: engine.overlap as resolved (auto: on with one stage, with or without the expert cache)
        self.overlapped = overlap_on(ecfg)
        if cache_plan is not None:
            t0 = time.perf_counter()
            self.expert_cache = ExpertCache(self.model, cache_plan, device, ecfg.expert_profile,
                                            ecfg.expert_adapt_every)
            log(f"INFO {cache_plan.describe(ecfg.expert_profile)}; placed in "
                f"{time.perf_counter() - t0:.1f} s")

        # ---- state, verifier, scheduler, graph cache, runner ------------------------------------
        self.compiling = ecfg.compile == "on" or (ecfg.compile == "auto" and device.type == "cuda")
        self.state = DecodeState(self.args, n_slots, self.max_context, loaded.dtype, device,
                                 self.drafting, spare_rows=ecfg.window_rows + 1,
                                 stacks=state_stacks)
        self.bufs = SlotBuffers(n_slots, self.args.hidden_size, loaded.dtype, device)
        split_keys = ecfg.invariant_split_keys if ecfg.batch_invariant else 0
        warming = ecfg.warmup == "on" or (ecfg.warmup == "auto" and self.compiling)
        # compile workers, where this process compiles the model's regions now (an earlier
        # engine may have) and the warm-up will run through them; they start with the warm-up
        workers = None
        if (warming and self.compiling and getattr(self.model, "_strata_compiled", None) is None
                and compile_backend is None and stages is None and cache_plan is None):
            workers = self._plan_compile_workers(n_slots)
            if workers is not None:
                compile_backend = workers.backend
        functions = (compiled_functions(self.model, device, ecfg.graphs,
                                        ecfg.compile_specialize_one, backend=compile_backend)
                     if self.compiling else None)
        self.verifier = Verifier(self.model, self.state, self.bufs, self.drafting,
                                 split_keys=split_keys, functions=functions,
                                 synthetic_acceptance=ecfg.synthetic_acceptance,
                                 expert_cache=self.expert_cache,
                                 device_positions=self.overlapped,
                                 draft_ids=draft_ids, draft_head=head)
        self.stages, self.fault = stages, None  # fault: why the engine stopped (a dead stage)
        if ecfg.stages > 1 and stages is None:
            raise ConfigError(f"engine.stages={ecfg.stages}: build the engine with "
                              f"Engine.from_config, which starts the stage processes")
        if stages is not None:
            from strata.engine.stages import attach
            self.verifier = attach(self, stages)
        self.scheduler = Scheduler(n_slots, mode=ecfg.mode, batch_mtp=self.batch_mtp,
                                   drafting=self.drafting, spec=ecfg.spec,
                                   window_rows=ecfg.window_rows, decode_share=ecfg.decode_share,
                                   prefill_chunk=ecfg.prefill_chunk, max_context=self.max_context,
                                   trace=self.trace, batch_invariant=ecfg.batch_invariant,
                                   pipeline=ecfg.stages if ecfg.pipeline_groups else 0,
                                   prefill_slots=self.prefill_slots,
                                   batch_mtp_drafts=ecfg.batch_mtp_drafts)
        self.runner = ModelRunner.for_engine(self.verifier, ecfg, device, self.budget,
                                             self.trace, log)
        self.cache = self.runner.cache
        self.trace.emit("config", **config_fields(self, cache_plan))
        if batch_mtp and ecfg.mode == "batch" and mem.off_reason is not None:
            self.warn(f"batch_mtp is off: {mem.off_reason}")
        if ecfg.synthetic_acceptance is not None:
            self.warn(f"engine.synthetic_acceptance={ecfg.synthetic_acceptance}: drafts are "
                      f"accepted at random (synthetic acceptance, for benchmarks), so the text "
                      f"is not the model's")
        #: What the warm-up did (warmup.WarmupDone), once it ran.
        self.warmup_done = None
        self._heap_frozen = False  # engine.gc_freeze did freeze it (close() thaws it)
        if warming:
            self.warmup(workers=workers)
            self._clock0 = time.perf_counter()  # request times count from here
            self.trace.restart_clock()

        self.requests: dict[str, RequestState] = {}
        self.arrivals = Arrivals()
        self._order = 0
        self.steps = self.windows = self.prefills = 0
        self.output_tokens = self.drafted = self.accepted = 0
        self._cancels: list[RequestState] = []
        #: engine.overlap: the decode windows launched ahead of their reads.
        self.overlap = OverlappedWindows(self) if self.overlapped else None
        self.pipeline = PipelinedWindows(self, ecfg.stages) if ecfg.pipeline_groups else None

    def _plan_compile_workers(self, n_slots: int):
        """engine.compile_workers: how many start with the warm-up (compile_workers.
        PlannedWorkers), or None."""
        from strata.engine.compile_workers import PlannedWorkers, WorkerGroup, plan_workers

        plan = plan_workers(self.cfg.compile_workers, self.loaded, self.cfg, self.device,
                            n_slots, self.max_context)
        if plan.world == 0:
            if self.cfg.compile_workers:  # asked for, and none fit
                self.warn(f"engine.compile_workers={self.cfg.compile_workers}: none started "
                          f"({plan.reason}); the warm-up compiles alone")
            return None
        return PlannedWorkers(plan, lambda p: WorkerGroup(p, self.loaded, self.cfg, self.device,
                                                          ops.backend(), n_slots, self.log))

    def _start_compile_workers(self, workers):
        """Start the planned workers (their WorkerGroup), or warn and return None: the warm-up
        then compiles alone."""
        plan = workers.plan
        try:
            group = workers.start()
        except Exception as e:  # (the start's own cleanup stopped any it had started)
            self.warn(f"compile workers failed to start, the warm-up compiles alone: "
                      f"{type(e).__name__}: {e}")
            return None
        self.log(f"INFO compile workers: {plan.world} processes compile the warm-up's graphs "
                 f"beside it, over the first {plan.layers} layers (dummy weights, about "
                 f"{plan.mib:.0f} MiB each)")
        return group

    def _finish_compile_workers(self, workers) -> None:
        out = workers.finish()
        for why in out["failed"]:
            self.warn(f"compile worker failed, the warm-up compiles its share itself: {why}")
        self.log(f"INFO compile workers: {out['compiled']} graphs compiled in "
                 f"{out['seconds']:.1f} s")

    def warmup(self, capture: bool = True, workers=None) -> None:
        """Run every shape this engine can plan once on the scratch lane and capture the graphs
        requests will use (ModelRunner.warmup), so that compiling and capturing happen now
        rather than inside the first requests. `capture=False` (a compile worker): only run
        the shapes. `workers` (compile_workers.PlannedWorkers): compile workers, started here
        to run beside it and waited for before the captures (which take the device memory they
        hold)."""
        from torch._dynamo.utils import counters

        t0 = time.perf_counter()
        traced = counters["stats"]["unique_graphs"]
        loaded = counters["inductor"]["fxgraph_cache_hit"]
        most_rows = max(self.cfg.spec if self.drafting else 1, 2 if self.batch_mtp else 1)
        plan = plan_warmup(self.cfg, len(self.scheduler.slots), most_rows, self.max_context,
                           self.cache is not None, self.prefill_slots)
        group = self._start_compile_workers(workers) if workers is not None else None
        try:
            done = self.runner.warmup(
                plan, self._tier, self.log, capture=capture,
                before_captures=(lambda: self._finish_compile_workers(group)) if group else None)
        finally:
            if group is not None:
                group.finish()  # (again: returns at once) stopped even if the warm-up failed
        # how many graphs the warm-up compiled: what its time mostly is on a cold cache
        done.compiled_graphs = counters["stats"]["unique_graphs"] - traced
        done.cached_graphs = counters["inductor"]["fxgraph_cache_hit"] - loaded
        self.warmup_done = done
        if self.expert_cache is not None:  # scratch-lane routing is not the workload's
            self.expert_cache.reset_counts()
        if plan.window_keys is not None:  # a replay starts from these graphs
            self.trace.emit("warmup", keys=done.window_keys, mib=done.window_mib)
        self._sync()
        done.seconds = time.perf_counter() - t0
        self.log(f"INFO {done.describe(plan)}")
        if capture and self.cfg.gc_freeze:
            self._freeze_heap()

    def _freeze_heap(self) -> None:
        """engine.gc_freeze: collect once (so no garbage is frozen), then freeze what is left."""
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        self._heap_frozen = True
        self.log(f"INFO gc: {gc.get_freeze_count()} objects frozen after the warm-up (one full "
                 f"pass before it took {(time.perf_counter() - t0) * 1e3:.0f} ms); the "
                 f"collector's passes skip them until the engine closes")

    # ---- small helpers ---------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._clock0

    def warn(self, text: str) -> None:
        self._warnings.append(text)
        self.log(f"WARNING: {text}")
        self.trace.emit("warning", text=text)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _tier(self, need: int) -> int:
        return context_tier(need, self.cfg.context_tier_min, self.max_context)

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Validate and queue a request (it arrives at its arrival_step / arrival_s, or now)."""
        self.validate_request(req)
        # the engine's own copy of what it validated: a caller changing its prompt or stop list
        # afterwards would otherwise reach the device unchecked
        req = dataclasses.replace(req, prompt_ids=list(req.prompt_ids),
                                  params=dataclasses.replace(req.params, stop=list(req.params.stop)))
        rs = self.requests[req.id] = RequestState(req, self._order)
        self._order += 1
        self.arrivals.add(rs, self.steps)

    def validate_request(self, req: Request) -> None:
        """Raise RequestError naming the problem if `req` cannot be added now."""
        if isinstance(req.id, str) and req.id in self.requests:
            raise RequestError("id", f"duplicate request id {req.id!r}")
        req.validate(self.args.vocab_size, self.max_context)
        if req.params.stop and self.tokenizer is None:  # (they were silently never matched)
            raise RequestError("stop", "stop strings match the output's text, and this "
                                       "checkpoint has no tokenizer.json to decode it")

    def cancel(self, req_id: str) -> None:
        """Stop a request at the next step (an unknown or finished id: nothing to do)."""
        _check_id(req_id)
        rs = self.requests.get(req_id)
        if rs is not None and not rs.finished and not rs.cancel_requested:
            rs.cancel_requested = True
            self._cancels.append(rs)

    def release(self, req_id: str) -> None:
        """Forget a finished request (a long-running server calls this after its final output)."""
        _check_id(req_id)
        rs = self.requests.get(req_id)
        if rs is None:
            return
        if not rs.finished:
            raise RequestError("id", f"request {req_id!r} has not finished; cancel it first")
        del self.requests[req_id]

    def has_work(self) -> bool:
        return (bool(self.arrivals) or self.scheduler.busy() or bool(self._cancels)
                or (self.overlap is not None and self.overlap.inflight is not None)
                or (self.pipeline is not None and bool(self.pipeline.inflight)))

    def next_arrival_in(self) -> Optional[float]:
        """Seconds until the next wall-clock arrival, when nothing else is waiting."""
        return self.arrivals.next_wall_clock(self.now(), only_secs=not self.scheduler.busy())

    # ---- one iteration: schedule, run, postprocess -----------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.trace.step = self.steps
        outs: dict[str, RequestOutput] = {}
        plan = self._schedule(outs)
        if self.overlap is not None:
            self.overlap.step(plan, outs)
        elif self.pipeline is not None:
            self.pipeline.step(plan, outs)
        else:
            self._run(plan, outs)
        if self.cache is not None and self.cfg.vram_every and self.steps % self.cfg.vram_every == 0:
            self.trace.emit("vram", **self.budget.vram_event(self.cache.graphs_mib))
        self.steps += 1
        return list(outs.values())

    def _run(self, plan: Plan, outs: dict) -> None:
        """Run one planned iteration to the end (the serial step)."""
        try:
            if plan.kind == _PREFILL:
                self._run_prefill(plan, outs)
            elif plan.kind == _DECODE:
                self._run_decode(plan, outs)
            elif wait := self.next_arrival_in():
                time.sleep(min(wait, 0.05))
        except Exception as e:  # an engine fault fails the requests it touched, never hangs
            touched = [s for s, _ in (plan.prefill_segments if plan.kind == PlanKind.PREFILL
                                      else plan.groups)]
            fail_touched(self, plan.kind, e, [(s, s.req) for s in touched], outs)

    def _schedule(self, outs: dict) -> Plan:
        """Cancels, then arrivals, then admission (lanes bound), then the iteration's plan."""
        now = self.now()
        cancelled_early = False
        for rs in self._cancels:
            if not rs.finished:
                cancelled_early |= rs.t_arrive is None
                self._finish(rs, FinishReason.CANCEL, outs)
        self._cancels.clear()
        if cancelled_early:
            self.arrivals.drop_finished()
        for rs in self.arrivals.pop_due(self.steps, now):
            rs.t_arrive = now
            self.scheduler.enqueue(rs)
        admitted = self.scheduler.admit()
        if admitted:
            if self.pipeline is not None:
                self.pipeline.before_bind(admitted, outs)
            now = self.now()
            try:
                self.runner.bind_lanes(admitted)
            except Exception as e:  # (validated requests: a device fault, say out of memory)
                # It fails the requests it admitted and frees their slots; the engine goes on.
                fail_touched(self, "admission", e, [(s, s.req) for s in admitted], outs)
                admitted = []
            for s in admitted:
                s.req.t_admit = now
        return self.scheduler.plan()

    def _run_prefill(self, plan: Plan, outs: dict) -> None:
        """One prompt chunk: the next chunk of one slot, or of several (engine.prefill_slots,
        one launch for all); then each slot's prompt commit in order, as if each had run alone."""
        segments = plan.prefill_segments
        chunks, finals = [], []
        for slot, n in segments:
            rs = slot.req
            start = slot.prefilled
            finals.append(start + n == rs.prompt_len)
            chunks.append((slot.id, rs.prompt_tensor, start, n,
                           None if finals[-1] else rs.req.prompt_ids[start + n]))
        filtered = any(s.req.req.params.filtered for s, _ in segments)
        t0 = time.perf_counter()
        if len(chunks) == 1:
            _, tokens = self.runner.prefill(*chunks[0], self._tier, filtered)
        else:
            _, tokens = self.runner.prefill_segments(chunks, self._tier, filtered)
        firsts = tokens.tolist() if any(finals) else None  # one sync per chunk ending a prompt
        self._sync()
        dur = time.perf_counter() - t0
        for i, (slot, n) in enumerate(segments):
            commit_prompt(self, slot, n, firsts[i] if finals[i] else None, dur, outs,
                          segments=len(segments))

    def _run_decode(self, plan: Plan, outs: dict) -> None:
        w = window_shape(plan.groups, plan.layout, self.cfg, self._tier, self.cache is not None)
        t0 = time.perf_counter()
        run = self.runner.decode([(s.id, s.pos, r) for s, r in plan.groups], w.groups, w.rows,
                                 w.tier, w.filtered, w.key, timed=self.trace.active)
        dur = time.perf_counter() - t0
        commit_window(self, [(s, r, s.req) for s, r in plan.groups], plan.layout, w, run,
                      run.output, dur, outs)

    # ---- ending a request (the commits end theirs: postprocess.py) ----------------------------
    def _finish(self, rs: RequestState, reason: str, outs: dict) -> None:
        """End a request from outside the decode path (cancel, error: faults.py, stages.py)."""
        rs.finished, rs.reason = True, reason
        out = output_of(rs, outs)
        out.finished, out.finish_reason, out.error = True, reason, rs.error
        out.output_tokens = len(rs.emitted)
        record_finish(self, rs, out)
        if rs.slot is not None:
            self.scheduler.release(self.scheduler.slots[rs.slot])
        elif rs in self.scheduler.queue:
            self.scheduler.queue.remove(rs)

    # ---- reporting (strata/engine/reporting.py) --------------------------------------------------
    def final_text(self, rs: RequestState) -> str:
        return final_text(rs, self.tokenizer)

    def stats(self) -> dict:
        return engine_stats(self)

    def close(self) -> None:
        if self.overlap is not None and self.overlap.inflight is not None:
            self.overlap.inflight = None  # unread: its graph must not go while it runs
            self._sync()
        if self.pipeline is not None:
            self.pipeline.close()
        if self.cache is not None:
            self.cache.clear()
        self.runner.release_prefill_graphs()
        if self.stages is not None:
            self.stages.close()
        self.trace.close()
        if self._heap_frozen:  # (process-wide: another engine's frozen objects thaw too)
            gc.unfreeze()
            self._heap_frozen = False
