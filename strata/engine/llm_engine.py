"""The engine: requests in, one iteration per `step()`, streaming outputs and a trace out.

It owns the model, the per-slot state, the scheduler, the verifier and the graph cache, and it
never imports the faces (strata.serve, strata.__main__). Single-threaded: drive it from one
thread.
"""

from __future__ import annotations

import heapq
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from strata.config import (ConfigError, EngineConfig, batch_mtp_from_env, check_known_keys,
                           validate_engine)
from strata.engine.detokenizer import IncrementalDetokenizer
from strata.engine.graph_cache import CudaGraphBackend, GraphCache, RecordingBackend
from strata.engine.memory import MIB, MemoryBudget, fit_slots
from strata.engine.model_runner import ModelRunner
from strata.engine.request import Request, RequestError, RequestOutput
from strata.engine.scheduler import Plan, Scheduler
from strata.engine.slots import RequestState, Slot
from strata.engine.verifier import SlotBuffers, Verifier
from strata.kernels import ops
from strata.model.loader import LoadedModel, load_checkpoint
from strata.model.state import DecodeState
from strata.trace import (TraceWriter, context_tier, context_tiers, invariant_shapes,
                          invariant_window_shape, layout_key, shape_bucket, shape_key,
                          warm_window_keys)

ENGINE_KNOBS = ("mode", "batch_mtp", "slots", "spec", "window_rows", "decode_share", "prefill_chunk",
                "prefill_buckets", "prefill_graphs", "max_context", "context_tier_min",
                "shape_buckets", "graphs", "graph_key", "batch_invariant", "graph_limit",
                "vram_reserve_mib", "graph_mib_estimate", "cpu_graph_mib", "cpu_device_mib",
                "synthetic_acceptance")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: no CUDA device is available (use device=cpu or auto)")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device: must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def plain_engine_config(ecfg: Any) -> EngineConfig:
    """An EngineConfig dataclass from an OmegaConf node (or a dataclass), validated by type."""
    if isinstance(ecfg, EngineConfig):
        return ecfg
    if isinstance(ecfg, DictConfig):
        try:
            node = OmegaConf.merge(OmegaConf.structured(EngineConfig), ecfg)
        except OmegaConfBaseException as e:
            raise ConfigError(f"engine config: {e}".splitlines()[0]) from None
        return OmegaConf.to_object(node)
    raise TypeError(f"engine config must be an EngineConfig or a DictConfig, got {type(ecfg).__name__}")


def timings(rs: RequestState) -> dict:
    """Per-request timings (seconds since engine start, and durations) for a final output."""
    def span(a, b):
        return None if a is None or b is None else b - a
    return {"arrive": rs.t_arrive, "queue_s": span(rs.t_arrive, rs.t_admit),
            "prefill_s": rs.prefill_s, "ttft_s": span(rs.t_arrive, rs.t_first),
            "decode_s": span(rs.t_first, rs.t_last), "e2e_s": span(rs.t_arrive, rs.t_finish),
            "drafted": rs.drafted, "accepted": rs.accepted}


class Engine:
    @classmethod
    def from_config(cls, cfg: Any, log: Callable[[str], None] = print,
                    trace_path: Optional[str | Path] = None) -> "Engine":
        check_known_keys(cfg)
        device = resolve_device(cfg.device)
        validate_engine(cfg.engine)  # fail before the checkpoint is read
        try:
            chosen = ops.set_backend(cfg.backend.name, device.type)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        log(f"INFO kernels: backend={chosen} ({cfg.backend.name} asked)")
        if cfg.model.moe_dense_experts < 0:
            raise ConfigError(f"model.moe_dense_experts: must be >= 0, got {cfg.model.moe_dense_experts}")
        loaded = load_checkpoint(cfg.model.path, cfg.model.dtype, device, log=log,
                                 moe_dense_experts=int(cfg.model.moe_dense_experts),
                                 load_format=cfg.model.load_format,
                                 dummy_seed=int(cfg.model.dummy_seed),
                                 num_layers=cfg.model.num_layers,
                                 fp8_dense=cfg.model.fp8_dense)
        return cls(loaded, cfg.engine, device, log=log, trace_path=trace_path)

    def __init__(self, loaded: LoadedModel, ecfg: Any, device: torch.device,
                 log: Callable[[str], None] = print, trace_path: Optional[str | Path] = None):
        ecfg = plain_engine_config(ecfg)  # attribute reads on the hot path must be cheap
        validate_engine(ecfg)
        self.log = log
        self.device = device
        self.loaded = loaded
        self.model = loaded.model
        self.args = loaded.args
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.path.name
        self.cfg = ecfg
        self.max_context = min(int(ecfg.max_context), self.args.max_position_embeddings)
        if self.max_context < ecfg.max_context:
            log(f"INFO engine.max_context={ecfg.max_context} exceeds the model's "
                f"max_position_embeddings; using {self.max_context}")
        self.eos = set(self.args.eos_token_id)
        self.trace = TraceWriter(trace_path)
        self._clock0 = time.perf_counter()

        # ---- what can run: batch_mtp conditions (DESIGN.md section 3) --------------------
        batch_mtp = batch_mtp_from_env(ecfg.batch_mtp)
        drafting = loaded.has_mtp and ecfg.spec >= 2
        off_reason = None
        if not loaded.has_mtp:
            off_reason = "the checkpoint has no mtp.* weights"
        elif ecfg.spec < 2:
            off_reason = f"engine.spec={ecfg.spec} < 2 leaves no draft row"
        # "More than one device" cannot arise: an engine runs on one device (docs/ENGINE.md).

        # ---- memory: weights, slot state, draft state, graphs above the reserve ---------------
        dtype = loaded.dtype
        spare = int(ecfg.window_rows) + 1
        if device.type == "cuda":
            _, total = torch.cuda.mem_get_info(device)
            total_mib = total / MIB
            free_fn = lambda: torch.cuda.mem_get_info(device)[0] / MIB  # noqa: E731
        else:
            total_mib = float(ecfg.cpu_device_mib)
            free_fn = None
        weights_mib = sum(p.numel() * p.element_size() for p in self.model.parameters()) / MIB
        per = DecodeState.bytes_per_lane(self.args, self.max_context + spare, dtype, loaded.has_mtp)
        bufs_mib = (self.args.hidden_size * torch.empty((), dtype=dtype).element_size() + 64) / MIB
        main_mib = per["main"] / MIB + bufs_mib
        draft_mib = per["draft"] / MIB
        estimate = float(ecfg.graph_mib_estimate)
        reserve = float(ecfg.vram_reserve_mib)
        asked = int(ecfg.slots) if ecfg.mode == "batch" else 1
        n_with = fit_slots(asked, total_mib, reserve, weights_mib, main_mib + draft_mib, estimate)
        n_without = fit_slots(asked, total_mib, reserve, weights_mib, main_mib, estimate)
        if drafting and n_with < min(asked, n_without):
            drafting = False
            off_reason = off_reason or (f"the per-slot draft state ({draft_mib:.1f} MiB) does not "
                                        f"fit beside {asked} slots")
        n_slots = n_with if drafting else n_without
        if n_slots < 1:
            raise ConfigError(
                f"engine.slots: not even one slot fits: device {total_mib:.0f} MiB - reserve "
                f"{reserve:.0f} - weights {weights_mib:.1f} leaves too little for a slot of "
                f"{main_mib + draft_mib:.1f} MiB (lower engine.max_context or engine.vram_reserve_mib)")
        slot_mib = main_mib + (draft_mib if drafting else 0.0)
        self.log(f"INFO slots={n_slots} (asked {asked}): weights {weights_mib:.1f} MiB, "
                 f"{slot_mib:.2f} MiB per slot (draft state {draft_mib:.2f}), reserve {reserve:.0f} MiB "
                 f"of {total_mib:.0f} MiB")
        self.drafting = drafting
        self.batch_mtp = bool(batch_mtp and drafting)
        self._warnings: list[str] = []

        # ---- state, verifier, scheduler, graph cache ---------------------------------------------
        self.state = DecodeState(self.args, n_slots, self.max_context, dtype, device,
                                 drafting, spare_rows=spare)
        self.bufs = SlotBuffers(n_slots, self.args.hidden_size, dtype, device)
        self.verifier = Verifier(self.model, self.state, self.bufs, drafting)
        if ecfg.batch_invariant:
            self.verifier.split_keys = int(ecfg.invariant_split_keys)
        if ecfg.synthetic_acceptance is not None:
            self.verifier.synthetic_acceptance = float(ecfg.synthetic_acceptance)
        compiling = ecfg.compile == "on" or (ecfg.compile == "auto" and device.type == "cuda")
        if compiling:
            self._compile()
        self.budget = MemoryBudget(total_mib, reserve, weights_mib, slot_mib, n_slots, free_fn)
        self.scheduler = Scheduler(n_slots, mode=ecfg.mode, batch_mtp=self.batch_mtp,
                                   drafting=drafting, spec=int(ecfg.spec),
                                   window_rows=int(ecfg.window_rows),
                                   decode_share=float(ecfg.decode_share),
                                   prefill_chunk=int(ecfg.prefill_chunk),
                                   max_context=self.max_context, trace=self.trace,
                                   batch_invariant=bool(ecfg.batch_invariant))
        self.cache: Optional[GraphCache] = None
        if ecfg.graphs:
            backend = (CudaGraphBackend(device) if device.type == "cuda"
                       else RecordingBackend(float(ecfg.cpu_graph_mib)))
            self.cache = GraphCache(int(ecfg.graph_limit), backend, self.budget, self.trace,
                                    estimate, log=self.log)
        max_groups = shape_bucket(n_slots, list(ecfg.shape_buckets))
        if ecfg.batch_invariant:  # a window of 1-row groups runs window_rows of them
            max_groups = max(max_groups, int(ecfg.window_rows))
        p_backend = (CudaGraphBackend(device) if device.type == "cuda" and ecfg.graphs
                     and ecfg.prefill_graphs else None)
        self.runner = ModelRunner(self.verifier, self.cache, device, max(max_groups, n_slots),
                                  self.state.scratch, log=self.log,
                                  prefill_buckets=tuple(ecfg.prefill_buckets),
                                  prefill_graphs=p_backend, budget=self.budget)
        knobs = {k: (list(getattr(ecfg, k)) if k in ("shape_buckets", "prefill_buckets") else getattr(ecfg, k))
                 for k in ENGINE_KNOBS}
        knobs.update(batch_mtp=self.batch_mtp, slots=n_slots, max_context=self.max_context,
                     drafting=drafting)
        memory = self.budget.as_dict()
        memory["graph_mib"] = float(ecfg.cpu_graph_mib) if device.type == "cpu" else None
        self.trace.emit("config", engine=knobs, memory=memory)
        if batch_mtp and ecfg.mode == "batch" and off_reason is not None:
            self.warn(f"batch_mtp is off: {off_reason}")
        if ecfg.synthetic_acceptance is not None:
            self.warn(f"engine.synthetic_acceptance={ecfg.synthetic_acceptance}: drafts are accepted "
                      f"at random (synthetic acceptance, for benchmarks), so the text is not the model's")

        if ecfg.warmup == "on" or (ecfg.warmup == "auto" and compiling):
            self.warmup()
            self._clock0 = time.perf_counter()  # request times count from here
            self.trace.restart_clock()

        self.requests: dict[str, RequestState] = {}
        # Arrivals not yet due, one heap per clock: (arrival_step | arrival_s, order, state).
        self._due_steps: list[tuple[float, int, RequestState]] = []
        self._due_secs: list[tuple[float, int, RequestState]] = []
        self._order = 0
        self.steps = 0
        self.windows = self.prefills = 0
        self.output_tokens = self.drafted = self.accepted = 0
        self._cancels: list[RequestState] = []

    def _compile(self) -> None:
        """Compile the window step's pure regions once per model (engines may share a model)."""
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        # A region that fails to compile runs eagerly (logged by torch) instead of failing requests.
        torch._dynamo.config.suppress_errors = True
        compiled = getattr(self.model, "_strata_compiled", None)
        if compiled is None:
            fn = lambda f: torch.compile(f, dynamic=None)  # noqa: E731
            # Prompt chunks come in many lengths: compile them with symbolic lengths.
            pfn = lambda f: torch.compile(f, dynamic=True)  # noqa: E731
            self.model.compile_regions(fn, pfn)
            compiled = {name: torch.compile(getattr(self.verifier, name), dynamic=None)
                        for name in ("sample", "sample_plain", "accepted_prefix", "synthetic_window")}
            self.model._strata_compiled = compiled
        for name, fn in compiled.items():
            setattr(self.verifier, name, fn)

    def warmup(self) -> None:
        """Run every window shape this engine can plan, and every prompt-chunk bucket, once on
        the scratch lane (eagerly, no graphs, no trace events), so that torch.compile's work
        happens now rather than inside the first requests. Real lanes are not touched."""
        ecfg, runner, ver = self.cfg, self.runner, self.verifier
        t0 = time.perf_counter()
        n_slots = len(self.scheduler.slots)
        spec = int(ecfg.spec) if self.drafting else 1
        most_rows = max(spec, 2 if self.batch_mtp else 1)
        every_tier = context_tiers(int(ecfg.context_tier_min), self.max_context)
        tiers = every_tier[:2]  # a second context length makes torch.compile treat it as dynamic
        if ecfg.batch_invariant:
            shapes = set(invariant_shapes(most_rows, int(ecfg.window_rows)))
        else:
            shapes = set()
            for g in range(1, most_rows + 1):
                groups = max(1, min(n_slots, int(ecfg.window_rows) // g))
                if ecfg.graph_key == "shape":
                    top = shape_bucket(groups, list(ecfg.shape_buckets))
                    shapes.update((b, g) for b in ecfg.shape_buckets if b <= top)
                else:
                    shapes.update((n, g) for n in range(1, groups + 1))
        windows = 0
        for ng, g in sorted(shapes):
            if ng > runner.inputs.shape[1]:
                continue
            runner._fill([], ng, pad_all=True)
            for ctx in tiers:
                for filtered in (False, True):
                    runner._fn(ng, g, ctx, filtered)()
                    windows += 1
        scratch = self.state.scratch
        buckets = [b for b in ecfg.prefill_buckets if b <= self.max_context]
        for b in buckets:
            runner.p_tokens[:b].zero_()
            runner._set_meta(scratch, 0, 1, None)
            ver.prefill(runner.p_tokens[:b], runner.p_meta, self._tier(b))
        # Prompt-chunk graphs too, one per (bucket, tier) a chunk can read: a capture inside a
        # request would add tens of ms to its time to first token.
        captured = 0
        if runner.p_backend is not None:
            zeros = torch.zeros(self.max_context, dtype=torch.long, device=self.device)
            for b in buckets:
                for tier in every_tier:
                    if tier >= self._tier(b):  # a chunk at start tier - b reads exactly `tier`
                        action, _ = runner.prefill(scratch, zeros, tier - b, b, None, self._tier)
                        captured += action == "capture"
        warm_keys = self._capture_window_graphs(most_rows, n_slots)
        self._sync()
        self.log(f"INFO warm-up: {windows} window shapes and {len(buckets)} prompt buckets run once, "
                 f"{captured} prompt-chunk graphs and {len(warm_keys)} window graphs captured, in "
                 f"{time.perf_counter() - t0:.1f} s (compiling and capturing happen here, not in "
                 f"requests)")

    def _capture_window_graphs(self, most_rows: int, n_slots: int) -> list[str]:
        """With shape keys, capture the window graphs requests will use (strata.trace.
        warm_window_keys: tiers ascending, deepest windows first) up to the graph limit: a
        capture inside a request costs it 15-35 ms on the H200. The keys, in capture order,
        and their measured MiB go into the trace's `warmup` event, which a replay starts from.
        Layout keys are too many to enumerate: they are captured on first use."""
        ecfg = self.cfg
        if self.cache is None or ecfg.graph_key != "shape":
            return []
        keys, mibs = [], []
        for bucket, g, tier in warm_window_keys(n_slots, most_rows, int(ecfg.window_rows),
                                                list(ecfg.shape_buckets), int(ecfg.context_tier_min),
                                                self.max_context, bool(ecfg.batch_invariant)):
            if not self.cache.has_room():
                break  # the next capture would have to evict: leave the rest to first use
            key = shape_key(bucket, g, tier, False)
            action, _ = self.runner.decode([], bucket, g, tier, False, key, set())
            if action != "capture":  # the budget refused it: later requests run such windows eagerly
                break
            keys.append(key)
            mibs.append(round(self.cache.entries[key].mib, 3))
        self.trace.emit("warmup", keys=keys, mib=mibs)
        return keys

    # ---- small helpers ----------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._clock0

    def warn(self, text: str) -> None:
        self._warnings.append(text)
        self.log(f"WARNING: {text}")
        self.trace.emit("warning", text=text)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Validate and queue a request (it arrives at its arrival_step / arrival_s, or now)."""
        self.validate_request(req)
        rs = RequestState(req, self._order)
        self._order += 1
        self.requests[req.id] = rs
        if req.arrival_s is not None:
            heapq.heappush(self._due_secs, (float(req.arrival_s), rs.order, rs))
        else:
            step = req.arrival_step if req.arrival_step is not None else self.steps
            heapq.heappush(self._due_steps, (float(step), rs.order, rs))

    def validate_request(self, req: Request) -> None:
        """Raise RequestError naming the problem if `req` cannot be added now."""
        if not isinstance(req.id, str) or not req.id:
            raise RequestError("id", "must be a non-empty string")
        if req.id in self.requests:
            raise RequestError("id", f"duplicate request id {req.id!r}")
        ids = req.prompt_ids
        if not isinstance(ids, list) or not ids:
            raise RequestError("prompt", "is empty")
        vocab = self.args.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RequestError("prompt", f"token id at index {i} ({t!r}) is not in [0, {vocab})")
        if len(ids) >= self.max_context:
            raise RequestError("prompt", f"{len(ids)} tokens leave no room in the context of "
                                         f"{self.max_context} positions (at most {self.max_context - 1})")
        req.params.validate()
        if req.arrival_step is not None and (not isinstance(req.arrival_step, int) or req.arrival_step < 0):
            raise RequestError("arrival_step", f"must be an integer >= 0, got {req.arrival_step!r}")
        if req.arrival_s is not None and not req.arrival_s >= 0:
            raise RequestError("arrival_s", f"must be a number >= 0, got {req.arrival_s!r}")

    def cancel(self, req_id: str) -> None:
        rs = self.requests.get(req_id)
        if rs is not None and not rs.finished and not rs.cancel_requested:
            rs.cancel_requested = True
            self._cancels.append(rs)

    def release(self, req_id: str) -> None:
        """Forget a finished request (a long-running server calls this after its final output)."""
        rs = self.requests.get(req_id)
        if rs is None:
            return
        if not rs.finished:
            raise RequestError("id", f"request {req_id!r} has not finished; cancel it first")
        del self.requests[req_id]

    def has_work(self) -> bool:
        return (bool(self._due_steps) or bool(self._due_secs) or self.scheduler.busy()
                or bool(self._cancels))

    def next_arrival_in(self) -> Optional[float]:
        """Seconds until the next wall-clock arrival, when nothing else is waiting."""
        if self.scheduler.busy() or self._due_steps or not self._due_secs:
            return None
        return max(0.0, self._due_secs[0][0] - self.now())

    def _pop_arrivals(self, now: float) -> list[RequestState]:
        due = []
        while self._due_steps and self._due_steps[0][0] <= self.steps:
            due.append(heapq.heappop(self._due_steps))
        while self._due_secs and self._due_secs[0][0] <= now:
            due.append(heapq.heappop(self._due_secs))
        # Same iteration: FIFO by input order, whichever clock brought them.
        return [rs for _, _, rs in sorted(due, key=lambda d: d[1]) if not rs.finished]

    # ---- one iteration --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.trace.step = self.steps
        outs: dict[str, RequestOutput] = {}
        now = self.now()
        cancelled_early = False
        for rs in self._cancels:
            if not rs.finished:
                cancelled_early |= rs.t_arrive is None
                self._finish(rs, "cancel", outs)
        self._cancels.clear()
        if cancelled_early:  # requests cancelled before they arrived leave the arrival heaps
            self._due_steps = [d for d in self._due_steps if not d[2].finished]
            self._due_secs = [d for d in self._due_secs if not d[2].finished]
            heapq.heapify(self._due_steps)
            heapq.heapify(self._due_secs)
        for rs in self._pop_arrivals(now):
            rs.t_arrive = now
            self.scheduler.enqueue(rs)
        self._bind_lanes(self.scheduler.admit())
        plan = self.scheduler.plan()
        try:
            if plan.kind == "prefill":
                self._run_prefill(plan, outs)
            elif plan.kind == "decode":
                self._run_decode(plan, outs)
            else:
                wait = self.next_arrival_in()
                if wait:
                    time.sleep(min(wait, 0.05))
        except Exception as e:  # an engine fault fails the requests it touched, never hangs
            touched = [plan.slot] if plan.kind == "prefill" else [s for s, _ in plan.groups]
            msg = f"engine fault in {plan.kind} iteration {self.steps}: {type(e).__name__}: {e}"
            self.log(f"ERROR: {msg}")
            for slot in touched:
                if slot.req is not None and not slot.req.finished:
                    slot.req.error = msg
                    self._finish(slot.req, "error", outs)
        if self.cache is not None and self.cfg.vram_every and self.steps % self.cfg.vram_every == 0:
            self._vram()
        self.steps += 1
        return list(outs.values())

    def _bind_lanes(self, slots: list[Slot]) -> None:
        """Fresh state, sampling parameters and the prompt on the device for each admitted
        slot, in one host-to-device copy and four kernels however many there are. Binding is
        host time each request of a burst waits for before its first prompt chunk (0.3 ms a
        burst on the H200, sixth session's traces), and every torch call is part of it."""
        if not slots:
            return
        now = self.now()
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
        self.state.reset_lanes(lanes)
        self.bufs.set_params(lanes, dev[3 * n:4 * n].view(torch.float32).view(n, 2),
                             dev[n:3 * n].view(n, 2))
        off = 4 * n
        for s, k in zip(slots, lens):
            s.req.prompt_tensor = dev[off:off + k]  # a view: the burst's buffer lives on
            s.req.t_admit = now                     # until its last request ends
            off += k

    def _vram(self) -> None:
        graphs = self.cache.graphs_mib if self.cache else 0.0
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0] / MIB
        else:
            free = self.budget.free_mib(graphs)
        self.trace.emit("vram", free_mib=round(free, 3), graphs_mib=round(graphs, 3),
                        reserve_mib=self.budget.reserve_mib)

    def _run_prefill(self, plan: Plan, outs: dict) -> None:
        slot, rs = plan.slot, plan.slot.req
        start, n = slot.prefilled, plan.tokens
        final = start + n == rs.prompt_len
        next_token = None if final else rs.req.prompt_ids[start + n]
        t0 = time.perf_counter()
        _, token = self.runner.prefill(slot.id, rs.prompt_tensor, start, n, next_token, self._tier)
        first = int(token[0]) if final else None  # one sync per finished prompt
        self._sync()
        dur = time.perf_counter() - t0
        slot.prefilled += n
        rs.prefill_s += dur
        self.prefills += 1
        self.trace.emit("prefill", req=rs.id, slot=slot.id, tokens=n, dur=round(dur, 6),
                        ctx=start + n)
        if not final:
            return
        slot.pos = rs.prompt_len
        rs.t_first = self.now()
        self._emit(rs, slot, [first], outs)
        if rs.finished:
            self._finish_event(rs, outs.get(rs.id))
            self.scheduler.release(slot)
        else:
            self.scheduler.start_decoding(slot)

    def _tier(self, need: int) -> int:
        return context_tier(need, self.cfg.context_tier_min, self.max_context)

    def _run_decode(self, plan: Plan, outs: dict) -> None:
        groups = plan.groups
        ecfg = self.cfg
        g = max(r for _, r in groups)
        tier = context_tier(max(s.pos + r for s, r in groups), ecfg.context_tier_min, self.max_context)
        key = None
        n_padded = len(groups)
        if ecfg.batch_invariant:  # window_rows rows exactly, whatever the layout
            n_padded, g = invariant_window_shape(g, int(ecfg.window_rows))
        layout = plan.layout
        # The sampler is part of the graph: sort-free unless a request of the window filters.
        filtered = any(s.req.filtered for s, _ in groups)
        if self.cache is not None:
            if ecfg.graph_key == "layout":
                key = layout_key(layout, tier, filtered)
            else:
                if not ecfg.batch_invariant:
                    n_padded = shape_bucket(len(groups), list(ecfg.shape_buckets))
                key = shape_key(n_padded, g, tier, filtered)
        t0 = time.perf_counter()
        action, rows = self.runner.decode([(s.id, s.pos, r) for s, r in groups], n_padded, g, tier,
                                          filtered, key, {key} if key else set())
        dur = time.perf_counter() - t0
        self.windows += 1
        tracing = self.trace.active  # a server or benchmark builds none of these events
        if tracing:
            extra = {}
            if action == "capture" and key in self.cache.entries:
                # The measured size: replaying a GPU trace needs it to decide what fits.
                extra["mib"] = round(self.cache.entries[key].mib, 3)
            self.trace.emit("window", layout=list(layout), key=key or "eager", graph=action,
                            rows=len(layout), dur=round(dur, 6), ctx=tier, **extra)
        ended = []
        for (slot, r), row in zip(groups, rows):
            rs = slot.req
            a = row[g]
            slot.pos += a + 1
            n = self._emit(rs, slot, row[: a + 1], outs)
            rs.drafted += r - 1
            rs.accepted += a
            self.drafted += r - 1
            self.accepted += a
            if tracing:
                self.trace.emit("commit", req=rs.id, slot=slot.id, drafted=r - 1, accepted=a,
                                emitted=n)
            if rs.finished:
                ended.append(slot)
        for slot in ended:
            self._finish_event(slot.req, outs.get(slot.req.id))
            self.scheduler.release(slot)

    # ---- emission and finishing -------------------------------------------------------------------
    def _emit(self, rs: RequestState, slot: Slot, tokens: list[int], outs: dict) -> int:
        """Emit tokens in order until a stop condition; returns how many were emitted."""
        p = rs.req.params
        out = outs.get(rs.id)
        if out is None:  # (setdefault would build an output per call: this runs per commit)
            out = outs[rs.id] = RequestOutput(rs.id, [], "", prompt_tokens=rs.prompt_len)
        n = 0
        now = self.now()
        watch_stop = bool(p.stop) and self.tokenizer is not None
        longest_stop = max(len(x) for x in p.stop) if p.stop else 0
        stop_hit = False
        for tok in tokens:
            if rs.left <= 0:
                break
            if p.stop_at_eos and tok in self.eos:
                rs.finished, rs.reason = True, "stop"
                break
            rs.emitted.append(tok)
            n += 1
            out.new_token_ids.append(tok)
            if watch_stop:
                before = len(rs.text)
                text = rs.text = self._detok(rs).update(rs.emitted)
                # A stop string not found before ends in the new text: search from one stop
                # length before it.
                lo = max(0, before - (longest_stop - 1))
                hit = min((i for x in p.stop if (i := text.find(x, lo)) >= 0), default=-1)
                if hit >= 0:
                    rs.emitted.pop()  # the token that completed a stop string is not emitted
                    out.new_token_ids.pop()
                    n -= 1
                    rs.text = text[:hit]
                    rs.finished, rs.reason = True, "stop"
                    stop_hit = True
                    break
            if rs.left <= 0:
                rs.finished, rs.reason = True, "length"
                break
        if not rs.finished and slot.pos >= self.max_context:
            rs.finished, rs.reason = True, "length"
        if n:
            rs.t_last = now
            self.output_tokens += n
        if (rs.req.stream_text or watch_stop) and self.tokenizer is not None and not stop_hit:
            det = self._detok(rs)
            rs.text = det.finish(rs.emitted) if rs.finished else det.update(rs.emitted)
        if rs.req.stream_text and self.tokenizer is not None:
            text = rs.text
            end = len(text)
            if not rs.finished:
                while end > rs.streamed_chars and text[end - 1] == "\ufffd":
                    end -= 1  # hold back an incomplete UTF-8 sequence
                if p.stop:  # and what could still become the start of a stop string
                    end = max(rs.streamed_chars, end - (longest_stop - 1))
            out.new_text += text[rs.streamed_chars:end]
            rs.streamed_chars = end
        out.output_tokens = len(rs.emitted)
        if rs.finished:
            out.finished, out.finish_reason = True, rs.reason
        return n

    def _detok(self, rs: RequestState) -> IncrementalDetokenizer:
        if rs.detok is None:
            rs.detok = IncrementalDetokenizer(self.tokenizer)
        return rs.detok

    def _finish_event(self, rs: RequestState, out: Optional[RequestOutput] = None) -> None:
        rs.t_finish = self.now()
        rs.prompt_tensor = None  # device memory goes back at once
        self.trace.emit("finish", req=rs.id, reason=rs.reason, tokens=len(rs.emitted))
        if out is not None:
            out.timings = timings(rs)

    def _finish(self, rs: RequestState, reason: str, outs: dict) -> None:
        """End a request from outside the decode path (cancel, error)."""
        rs.finished, rs.reason = True, reason
        out = outs.setdefault(rs.id, RequestOutput(rs.id, [], "", prompt_tokens=rs.prompt_len))
        out.finished, out.finish_reason, out.error = True, reason, rs.error
        out.output_tokens = len(rs.emitted)
        self._finish_event(rs, out)
        if rs.slot is not None:
            self.scheduler.release(self.scheduler.slots[rs.slot])
        elif rs in self.scheduler.queue:
            self.scheduler.queue.remove(rs)

    # ---- reporting ----------------------------------------------------------------------------------
    def final_text(self, rs: RequestState) -> str:
        if rs.reason == "stop" and rs.req.params.stop:
            return rs.text
        return self.tokenizer.decode(rs.emitted) if self.tokenizer is not None else ""

    def stats(self) -> dict:
        dev_free = dev_used = None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            dev_free, dev_used = free / MIB, (total - free) / MIB
        c = self.cache
        return {
            "output_tokens": self.output_tokens, "drafted": self.drafted, "accepted": self.accepted,
            "busy_slots": sum(1 for s in self.scheduler.slots if s.phase != "free"),
            "slots": len(self.scheduler.slots), "windows": self.windows, "prefills": self.prefills,
            "graph_entries": len(c.entries) if c else 0, "graph_captures": c.captures if c else 0,
            "graph_evictions": c.evictions if c else 0, "graph_hits": c.hits if c else 0,
            "graph_eager": c.eager if c else 0, "graphs_mib": c.graphs_mib if c else 0.0,
            "device_free_mib": dev_free, "device_used_mib": dev_used,
            "prefill_graphs": len(self.runner.p_graphs), "prefill_graphs_mib": self.runner.p_graphs_mib,
        }

    def close(self) -> None:
        if self.cache is not None:
            self.cache.clear()
        self.runner.release_prefill_graphs()
        self.trace.close()
