"""The simulated engine: one SimPy process that runs strata's iteration loop.

Each iteration follows docs/SCHEDULING.md: cancels and faults, arrivals, admission, then one of
a prefill chunk, a decode window, or an idle wait. The engine logs every domain event to the
trace through `strata.trace.TraceWriter`, whose clock is the simulated time, so a replay can be
compared with `strata.trace.replay_view` and a prediction is deterministic.

The components it drives (each its own class): `ArrivalSource` (arrivals, with its own
process), `RotationRing` (window composition), `GraphCache` (graph keys, LRU, memory budget),
an `AcceptanceModel` (how many drafts each group accepts) and a `CostProfile` (how long work
takes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import simpy

from strata.config import overlap_on, prefill_slots_of
from strata.trace import (TraceWriter, context_tier, invariant_window_shape, layout_key,
                          prefill_bucket, shape_bucket, shape_key)

from .acceptance import AcceptanceModel
from .costs import CostProfile
from .expert_costs import ExpertCosts
from .experts import ExpertSource, window_fields
from .graph_cache import GraphCache, GraphDecision, MemoryFacts
from .pipeline import StagePipeline
from .rotation import RotationRing
from .workload import ArrivalSource, ExternalEvents, SimRequest


class SimulationError(RuntimeError):
    pass


def routed_groups(real: int, run_groups: int, run_rows: int) -> list[int]:
    """Rows per group whose routed experts a window of `real` groups reads when the engine
    runs it as `run_groups` groups of `run_rows` rows: every row it runs routes, a real group's
    rows past its own too (a stored draft, a chained one), and the padding groups, which all run
    the same rows of the scratch lane, route as one more group."""
    return [run_rows] * real + ([run_rows] if run_groups > real else [])


#: The `key` a window reports when graphs are off (no cache, so no key is computed).
NO_GRAPH_KEY = "eager"
#: Decimal places of `dur` in the trace (microseconds, as the engine writes it).
TRACE_DUR_DIGITS = 6


@dataclass
class SlotState:
    slot: int
    req: SimRequest
    #: Admission order (the earliest admitted prefilling slot prefills first).
    admitted_seq: int
    prompt_done: int = 0
    #: Committed positions (prompt + accepted tokens); the pending token sits at pos.
    pos: int = 0
    emitted: int = 0
    decoding: bool = False
    #: engine.overlap, engine.pipeline_groups: rows of its group in the window launched and
    #: not yet read.
    inflight: int = 0

    @property
    def left(self) -> int:
        return self.req.max_tokens - self.emitted


@dataclass
class RequestRecord:
    """Timeline of one request, for outputs.jsonl and metrics.json."""
    req: SimRequest
    arrive_s: Optional[float] = None
    admit_s: Optional[float] = None
    prefill_device_s: float = 0.0
    first_token_s: Optional[float] = None
    last_token_s: Optional[float] = None
    finish_s: Optional[float] = None
    tokens: int = 0
    reason: Optional[str] = None
    drafted: int = 0
    accepted: int = 0


@dataclass
class InFlight:
    """engine.overlap, engine.pipeline_groups: a window launched and not yet read."""
    groups: list[tuple[SlotState, int]]
    layout: list[int]
    key: str
    decision: GraphDecision
    dur: float
    tier: int
    #: Simulated time its device work ends.
    end: float
    #: Pipelined slot groups: the step that launched it (its window event records it).
    launched: Optional[int] = None
    #: The expert cache's fields of its window event (hits, misses, bytes), if any.
    expert_fields: Optional[dict[str, int]] = None


@dataclass
class RunStats:
    windows: int = 0
    prefills: int = 0
    idle: int = 0
    graph: dict[str, int] = field(default_factory=lambda: {"hit": 0, "capture": 0, "eager": 0,
                                                           "evict": 0})
    #: upstream policy: the step at which a capture failed and the engine exited.
    crashed_at_step: Optional[int] = None
    #: Expert cache: distinct (layer, expert) pairs of the decode windows that were resident
    #: (hits) or not (misses), and adaptive swaps.
    expert_hits: int = 0
    expert_misses: int = 0
    expert_swaps: int = 0
    #: Window shapes ("NxG") the profile has no shape of their depth for, priced by carrying
    #: its times along the depth (CostProfile.unmeasured_depth).
    extrapolated_shapes: set[str] = field(default_factory=set)


class SimEngine:
    """strata's scheduler, re-implemented from DESIGN.md and docs/SCHEDULING.md."""

    def __init__(self, env: simpy.Environment, knobs: Any, memory: MemoryFacts, slots: int,
                 arrivals: ArrivalSource, external: ExternalEvents,
                 acceptance: AcceptanceModel, costs: CostProfile, trace: TraceWriter,
                 measure_capture: Callable[[], float], max_steps: int,
                 requests: list[SimRequest], experts: Optional[ExpertSource] = None,
                 expert_costs: Optional[ExpertCosts] = None, stage_handoff_s: float = 0.0):
        self.env = env
        self.knobs = knobs
        self.n_slots = slots
        self.arrivals = arrivals
        self.external = external
        self.acceptance = acceptance
        self.costs = costs
        self.trace = trace
        self.max_steps = max_steps
        self.cache = GraphCache(knobs.graph_limit, knobs.graph_policy, memory, measure_capture)
        self.ring = RotationRing()
        self.queue: deque[SimRequest] = deque()
        self.slots: dict[int, SlotState] = {}
        self.free: set[int] = set(range(slots))
        self.records = {r.id: RequestRecord(r) for r in requests}
        self.stats = RunStats()
        self.step = 0
        self._admissions = 0
        #: decode_share counters: iterations in which both kinds existed, and decodes among them.
        self._mixed_iterations = 0
        self._mixed_decodes = 0
        self._warned_eager = False
        #: What this iteration's host time at its start depends on (CostProfile.
        #: host_head_time): its admissions. The host time after its device work (commits,
        #: finishes, a prompt chunk's bookkeeping: host_tail_time) is charged before the next
        #: iteration starts, so the next arrivals come after it, as in the engine.
        self._admitted = 0
        self.drafting = bool(knobs.drafting) and knobs.spec >= 2
        #: The expert cache (sim/experts.py): each forward's hits and misses, and the swaps;
        #: `expert_costs` prices them (None in replay, where time is not compared).
        self.experts = experts
        self.expert_costs = expert_costs
        #: engine.overlap: the window in flight, and when the device is free of it.
        self.overlap = overlap_on(knobs)  # as the engine resolves it
        self._inflight: Optional[InFlight] = None
        self._device_free = 0.0
        #: engine.stages > 1: the stages' time model; engine.pipeline_groups: the depth (the
        #: stages) and the windows in flight, oldest first.
        self.stages = StagePipeline.from_knobs(knobs, stage_handoff_s)
        self.pipeline = (int(knobs.stages) if self.stages is not None
                         and getattr(knobs, "pipeline_groups", False) else 0)
        self._pipe: deque[InFlight] = deque()
        self._just_admitted: list[int] = []
        self.process = env.process(self.run())

    # --- the loop --------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self.slots or self.queue or self.arrivals.pending or self._inflight
                    or self._pipe)

    def run(self):
        while self._has_work() and self.stats.crashed_at_step is None:
            if self.step >= self.max_steps:
                raise SimulationError(f"no end after max_steps={self.max_steps} iterations "
                                      f"({len(self.slots)} slots busy, {len(self.queue)} queued)")
            self.trace.step = self.step
            yield from self._iteration()
            self.step += 1

    def _iteration(self):
        for req_id in self.external.cancels_at(self.step):
            self._cancel(req_id)
        for req in self.arrivals.collect(self.step):
            self.queue.append(req)
            self.records[req.id].arrive_s = self.env.now
            self.trace.emit("arrive", req=req.id, prompt_tokens=req.prompt_tokens,
                            max_tokens=req.max_tokens, filtered=req.filtered)
        self._admitted = self._admit()
        if self.pipeline:  # a slot's window in flight lands before the slot is bound again
            yield from self._land_holding(self._just_admitted)
        prefilling = [s for s in self.slots.values() if not s.decoding]
        kind = self._iteration_kind(bool(prefilling), len(self.ring) > 0)
        if self.overlap:
            yield from self._overlapped(kind, prefilling)
        elif self.pipeline:
            yield from self._pipelined(kind, prefilling)
        elif kind == "decode":
            yield from self._decode(prefilling_exists=bool(prefilling))
        elif kind == "prefill":
            yield from self._prefill(self._prefill_pick(prefilling))
        else:
            yield from self._idle()

    def _overlapped(self, kind: str, prefilling: list[SlotState]):
        """engine.overlap: a decode window is planned and launched before the window in flight
        is read; anything else reads that window first, then runs as in the serial loop."""
        prev, self._inflight = self._inflight, None
        if kind == "decode":
            groups = self._plan_groups(bool(prefilling))
            if groups:
                launched = yield from self._launch(groups)
                if prev is not None:
                    yield from self._land(prev)
                if launched is not None:
                    for st, r in launched.groups:
                        if self.slots.get(st.slot) is st:
                            st.inflight = r
                    self._inflight = launched
                return
            kind = "idle"  # every decoding slot waits for the window in flight
        if prev is not None:
            yield from self._land(prev)
        if kind == "prefill":
            yield from self._prefill(self._prefill_pick(prefilling))
        elif prev is None:
            yield from self._idle()

    def _pipelined(self, kind: str, prefilling: list[SlotState]):
        """engine.pipeline_groups (strata/engine/pipeline.py): a decode window is launched, and
        with `stages` windows in flight the oldest lands; a window of more than 2 rows per
        group first lands every window in flight; a prompt chunk lands every window in flight,
        then runs; an idle iteration with windows in flight lands the oldest."""
        if kind == "decode":
            groups = self._plan_groups(bool(prefilling))
            if groups:
                if self._window_shape(groups)[1] > 2:  # rows per group, padding included
                    yield from self._land_all()
                launched = yield from self._launch(groups)
                if launched is not None:
                    launched.launched = self.step
                    for st, r in launched.groups:
                        st.inflight = r
                    self._pipe.append(launched)
                if len(self._pipe) >= self.pipeline:
                    yield from self._land(self._pipe.popleft())
                return
            kind = "idle"  # every decoding slot waits for a window in flight
        if not self._pipe:
            if kind == "prefill":
                yield from self._prefill(self._prefill_pick(prefilling))
            else:
                yield from self._idle()
        elif kind == "prefill":
            yield from self._land_all()
            yield from self._prefill(self._prefill_pick(prefilling))
        else:
            yield from self._land(self._pipe.popleft())

    def _land_all(self):
        while self._pipe:
            yield from self._land(self._pipe.popleft())

    def _land_holding(self, slots: list[int]):
        """Land every window in flight up to the last one holding one of `slots`."""
        upto = max((i + 1 for i, w in enumerate(self._pipe)
                    if any(st.slot in slots for st, _ in w.groups)), default=0)
        for _ in range(upto):
            yield from self._land(self._pipe.popleft())

    def _launch(self, groups: list[tuple[SlotState, int]]):
        """Plan and launch one window: host time, then the device runs it once it is free."""
        if self.external.faulted(self.step):
            for st, _ in groups:
                self._finish(st, "error")
                self._release(st)
            return None
        layout, key, tier, decision, dur = self._window_decision(groups)
        if decision.capture_failed:
            self._crash(decision)
            return None
        # The window's own host share (filling, launching) runs here, while the window before
        # it may still be on the device.
        host = self._host() + self.costs.host_launch_s
        table_dur = dur
        # The experts' reads price the window as in the serial loop (the bytes model at real
        # scale, misses with the cache); with pipelined groups they are part of every stage's
        # share.
        dur, expert_fields = self._expert_priced(groups, layout, tier, dur, host)
        yield self.env.timeout(host)
        for ev_key, reason in decision.evictions:
            self.stats.graph["evict"] += 1
            self.trace.emit("evict", key=ev_key, reason=reason)
        if self.pipeline:
            end = self.stages.launch(self.env.now, dur)
            return InFlight(groups, layout, key, decision, end - self.env.now, tier, end,
                            expert_fields=expert_fields)
        # An idle device waits for the window's submission (part of the profile's serial
        # device seconds, host.submit_s); one still busy with the window before has it queued
        # by the time it is free, and runs without the slot count's share of the tables, which
        # is in the serial submission too (CostProfile.window_slot_factor). `dur` as the
        # engine's events would span it: from the device reaching the window to its end.
        start = max(self.env.now, self._device_free)
        if self.env.now < self._device_free:
            submit = self.costs.submit_time(self._window_shape(groups))
            if submit > 0:
                queued = (dur - table_dur * (1.0 - 1.0 / self.costs.window_slot_factor)
                          - submit)
                end = max(self.env.now + dur, self._device_free + max(0.0, queued))
                dur = end - start
        self._device_free = start + dur
        return InFlight(groups, layout, key, decision, dur, tier, self._device_free,
                        expert_fields=expert_fields)

    def _land(self, w: InFlight):
        """Wait for a launched window's device work and read it: its window event, then the
        commits of the groups whose requests still hold their slots."""
        for st, _ in w.groups:
            st.inflight = 0
        wait = max(0.0, w.end - self.env.now) + self.costs.host_sync_s
        if wait > 0:
            yield self.env.timeout(wait)
        groups = [(st, r) for st, r in w.groups if self.slots.get(st.slot) is st]
        yield from self._read_window(w.layout, w.key, w.decision, w.dur, w.tier, groups,
                                     w.expert_fields, launched=w.launched)

    def _iteration_kind(self, prefilling: bool, decoding: bool) -> str:
        if prefilling and decoding:
            # decode_share: decode while the decodes so far are fewer than the share of the
            # mixed iterations including this one. Written as the float comparison the rule
            # states, so that both implementations round the same way.
            self._mixed_iterations += 1
            if self._mixed_decodes < self.knobs.decode_share * self._mixed_iterations:
                self._mixed_decodes += 1
                return "decode"
            return "prefill"
        if decoding:
            return "decode"
        if prefilling:
            return "prefill"
        return "idle"

    def _host(self) -> float:
        """This iteration's host seconds before its device work; resets its admissions."""
        t = self.costs.host_head_time(self._admitted)
        self._admitted = 0
        return t

    def _tail(self, commits: int = 0, finishes: int = 0, after_prefill: bool = False):
        """The host seconds after this iteration's device work (CostProfile.host_tail_time)."""
        t = self.costs.host_tail_time(commits, finishes, after_prefill)
        if t > 0:
            yield self.env.timeout(t)

    def _admit(self) -> int:
        n = 0
        self._just_admitted = []
        while self.queue and self.free:
            n += 1
            req = self.queue.popleft()
            slot = min(self.free)
            self.free.remove(slot)
            self.slots[slot] = SlotState(slot, req, admitted_seq=self._admissions)
            self._just_admitted.append(slot)
            self._admissions += 1
            self.records[req.id].admit_s = self.env.now
            self.trace.emit("admit", req=req.id, slot=slot)
        return n

    def _idle(self):
        self.stats.idle += 1
        if self.arrivals.waits_on_time:
            yield self.arrivals.wakeup()
        else:
            yield self.env.timeout(self._host())

    # --- prefill ---------------------------------------------------------------------------

    def _prefill_pick(self, prefilling: list[SlotState]) -> list[SlotState]:
        """The slots the next prompt chunk holds: the earliest admitted, up to
        engine.prefill_slots of them."""
        return sorted(prefilling, key=lambda s: s.admitted_seq)[:prefill_slots_of(self.knobs)]

    def _prefill(self, sts: list[SlotState]):
        """One prompt chunk: each slot's next chunk, padded to the bucket of the longest and
        priced as one chunk of all their rows; then each slot's commit in order."""
        k = self.knobs
        chunks = [min(k.prefill_chunk, st.req.prompt_tokens - st.prompt_done) for st in sts]
        if self.external.faulted(self.step):
            yield from self._fault(list(sts))
            return
        padded = prefill_bucket(max(chunks), k.prefill_buckets)
        # The engine pads the chunk to its bucket, and its attention reads the tier holding
        # the padded chunk.
        tier = context_tier(max(st.prompt_done for st in sts) + padded, k.context_tier_min,
                            k.max_context)
        dur = self.costs.prefill_time(padded * len(sts), tier)
        host = self._host()
        if self.experts is not None:
            x = self.experts.prefill(self.step, sum(chunks))
            if self.expert_costs is not None:
                dur = (self.expert_costs.prefill_s(x, padded * len(sts), dur)
                       + self.expert_costs.wait_for_copy(host, self.overlap))
        yield self.env.timeout(host + dur)
        extra = {"segments": len(sts)} if len(sts) > 1 else {}
        finishes = 0
        for st, tokens in zip(sts, chunks):
            st.prompt_done += tokens
            rec = self.records[st.req.id]
            rec.prefill_device_s += dur
            self.stats.prefills += 1
            # `ctx` as the engine writes it: the positions the chunk covers (start + tokens).
            self.trace.emit("prefill", req=st.req.id, slot=st.slot, tokens=tokens,
                            dur=round(dur, TRACE_DUR_DIGITS), ctx=st.prompt_done, **extra)
            if st.prompt_done < st.req.prompt_tokens:
                continue
            # Prompt done: the slot samples and emits its first token.
            st.pos = st.req.prompt_tokens
            st.emitted = 1
            rec.first_token_s = rec.last_token_s = self.env.now
            reason = None
            if st.req.stop_at_prefill:
                reason = "stop"
                st.emitted = st.req.stop_after_tokens or 0
            elif st.left <= 0 or st.pos >= k.max_context:
                reason = "length"
            if reason is None:
                st.decoding = True
                self.ring.join(st.slot)
            else:
                self._finish(st, reason)
                self._release(st)
                finishes += 1
        yield from self._tail(finishes=finishes, after_prefill=True)

    # --- decode ----------------------------------------------------------------------------

    def _base_rows(self, lone: bool, decoding: int = 1) -> int:
        """A group's rows before its request's bounds; `decoding`: the slots the window may
        hold (a batch_mtp group takes up to window_rows // decoding, engine.batch_mtp_drafts)."""
        k = self.knobs
        if k.mode == "solo" or lone:
            return k.spec if self.drafting else 1
        if not (k.batch_mtp and self.drafting):
            return 1
        drafts = k.spec - 1 if k.batch_mtp_drafts is None else k.batch_mtp_drafts
        return max(2, min(1 + drafts, k.window_rows // max(1, decoding)))

    def _window_shape(self, groups: list[tuple[SlotState, int]]) -> tuple[int, int]:
        """(groups the engine runs, rows per group it runs): batch-invariant windows run
        window_rows rows in groups of a divisor of it; otherwise the engine pads the groups to
        the shape bucket only under shape keys with graphs on."""
        k = self.knobs
        g = max(r for _, r in groups)
        if k.batch_invariant:
            return invariant_window_shape(g, k.window_rows)
        n = len(groups)
        if k.graphs and k.graph_key == "shape":
            n = shape_bucket(n, k.shape_buckets)
        return n, g

    def _window_key(self, groups: list[tuple[SlotState, int]], layout: list[int],
                    shape: tuple[int, int]) -> tuple[str, int]:
        """(graph key, context tier) of a window; `shape` is its `_window_shape`."""
        k = self.knobs
        tier = context_tier(max(st.pos + st.inflight + r for st, r in groups), k.context_tier_min,
                            k.max_context)
        # One filtering request makes the whole window use the sorting sampler: another graph.
        filtered = any(st.req.filtered for st, _ in groups)
        if k.graph_key == "layout":
            return layout_key(layout, tier, filtered), tier
        if k.batch_invariant:
            return shape_key(*shape, tier, filtered), tier
        bucket = shape_bucket(len(groups), k.shape_buckets)
        return shape_key(bucket, max(r for _, r in groups), tier, filtered), tier

    def _plan_groups(self, prefilling_exists: bool) -> list[tuple[SlotState, int]]:
        """The next window's (slot, rows) groups. Under engine.overlap the window in flight
        may still commit `inflight` positions and emit as many tokens: the rows assume it does,
        and a slot it may take to the end of the context waits (0 rows)."""
        k = self.knobs
        # Pipelined: at most ceil(D / S) slots, so that S windows of different slots fly.
        cap = -(-len(self.ring) // self.pipeline) if self.pipeline else None
        base = self._base_rows(len(self.ring) == 1 and not prefilling_exists,
                               len(self.ring) if cap is None else cap)

        def rows_of(slot: int) -> int:
            st = self.slots[slot]
            if self.pipeline and st.inflight:
                return 0  # pipelined: its next window waits for this one's accepted prefix
            room = k.max_context - st.pos - st.inflight
            return 0 if room < 1 else max(1, min(base, st.left - st.inflight, room))

        taken = self.ring.build_window(rows_of, k.window_rows, k.batch_invariant, cap)
        return [(self.slots[s], rows_of(s)) for s in taken]

    def _window_decision(self, groups: list[tuple[SlotState, int]]):
        """(layout, key, tier, graph decision, device seconds) of a window of `groups`."""
        k = self.knobs
        layout = [st.slot for st, r in groups for _ in range(r)]
        shape = self._window_shape(groups)
        key, tier = self._window_key(groups, layout, shape)
        if k.graphs:
            decision = self.cache.window(key)
        else:
            decision, key = GraphDecision("eager"), NO_GRAPH_KEY
        # Batch-invariant windows compute all window_rows rows, padding included.
        rows = shape[0] * shape[1] if k.batch_invariant else len(layout)
        dur = 0.0 if decision.capture_failed else self.costs.decode_time(rows, tier,
                                                                          decision.action, shape)
        if self.costs.unmeasured_depth(shape):
            self.stats.extrapolated_shapes.add(f"{shape[0]}x{shape[1]}")
        return layout, key, tier, decision, dur

    def _decode(self, prefilling_exists: bool):
        groups = self._plan_groups(prefilling_exists)
        if self.external.faulted(self.step):
            yield from self._fault([st for st, _ in groups])
            return
        layout, key, tier, decision, dur = self._window_decision(groups)
        if decision.capture_failed:
            self._crash(decision)
            return
        launch = self.costs.host_launch_s  # the window's own host share, before its device work
        host = self._host()
        dur, expert_fields = self._expert_priced(groups, layout, tier, dur, host + launch)
        if self.stages is not None:  # an unpipelined split: every stage in turn
            dur = self.stages.serial_time(dur)
        yield self.env.timeout(host + launch + dur)

        for ev_key, reason in decision.evictions:
            self.stats.graph["evict"] += 1
            self.trace.emit("evict", key=ev_key, reason=reason)
        # As the engine traces a serial window: `dur` the wall of the whole call, `dev` its
        # device share (when the profile tells them apart).
        yield from self._read_window(layout, key, decision, launch + dur, tier, groups,
                                     expert_fields, dev=dur if launch else None)

    def _expert_priced(self, groups: list[tuple[SlotState, int]], layout: list[int], tier: int,
                       dur: float, host: float) -> tuple[float, dict[str, int]]:
        """A window's device seconds with its experts' reads priced, and the expert cache's
        fields of its event (none when there is no expert model)."""
        expert_fields: dict[str, int] = {}
        if self.experts is not None:
            shape = self._window_shape(groups)
            rows = shape[0] * shape[1] if self.knobs.batch_invariant else len(layout)
            x = self.experts.window(self.step, routed_groups(len(groups), *shape))
            if self.experts.cache_on:
                expert_fields = window_fields(x, self.experts.expert_bytes)
                self.stats.expert_hits += x.hits
                self.stats.expert_misses += x.misses
            if self.expert_costs is not None:
                hit_s = self.costs.decode_time(rows, tier, "hit", shape)
                dur = (self.expert_costs.window_s(x, shape[0], shape[1], dur, hit_s)
                       + self.expert_costs.wait_for_copy(host, self.overlap))
        return dur, expert_fields

    def _read_window(self, layout: list[int], key: str, decision: GraphDecision, dur: float,
                     tier: int, groups: list[tuple[SlotState, int]],
                     expert_fields: Optional[dict[str, int]] = None,
                     launched: Optional[int] = None, dev: Optional[float] = None):
        """A window's results: its event, each group's commit, the finishes, the host tail."""
        self.stats.windows += 1
        self.stats.graph[decision.action] += 1
        self.trace.emit("window", layout=layout, key=key, graph=decision.action,
                        rows=len(layout), dur=round(dur, TRACE_DUR_DIGITS), ctx=tier,
                        **(expert_fields or {}),
                        **({} if launched is None else {"launched": launched}),
                        **({} if dev is None else {"dev": round(dev, TRACE_DUR_DIGITS)}))
        if decision.action == "capture":
            self._emit_vram()
        if decision.eager_reason and not self._warned_eager:
            self._warned_eager = True
            self.trace.emit("warning", text=f"window runs eagerly: {decision.eager_reason}")

        finished: list[tuple[SlotState, str]] = []
        for st, r in groups:
            drafted = r - 1
            accepted = self.acceptance.accepted(st.req, drafted, st.emitted)
            rec = self.records[st.req.id]
            rec.drafted += drafted
            rec.accepted += accepted
            emitted, reason = self._commit(st, accepted)
            self.trace.emit("commit", req=st.req.id, slot=st.slot, drafted=drafted,
                            accepted=accepted, emitted=emitted)
            if reason is not None:
                finished.append((st, reason))
        for st, reason in finished:
            self._finish(st, reason)
        for st, _ in finished:  # slots leave in window order, after all commits
            self._release(st)
        self._expert_swap()
        yield from self._tail(commits=len(groups), finishes=len(finished))

    def _expert_swap(self) -> None:
        """The expert cache's adaptive swap after a window that ends an adapt period; its
        copy delays the next forward (ExpertCosts.wait_for_copy)."""
        if self.experts is None:
            return
        swap = self.experts.after_window(self.step)
        if swap is None:
            return
        self.stats.expert_swaps += 1
        self.trace.emit("expert_swap", experts=swap.experts, bytes=swap.bytes)
        if self.expert_costs is not None:
            self.expert_costs.swap_started(swap.bytes)

    def _commit(self, st: SlotState, accepted: int) -> tuple[int, Optional[str]]:
        """Commit rows 0..accepted; returns (tokens emitted, finish reason or None)."""
        rec = self.records[st.req.id]
        candidates = accepted + 1
        st.pos += candidates
        stop_at = st.req.stop_after_tokens
        if stop_at is not None and st.emitted + candidates > stop_at:
            emitted = max(0, stop_at - st.emitted)
            reason: Optional[str] = "stop"
        else:
            emitted = candidates
            reason = None
        st.emitted += emitted
        if emitted:
            rec.last_token_s = self.env.now
        if reason is None and (st.left <= 0 or st.pos >= self.knobs.max_context):
            reason = "length"
        return emitted, reason

    # --- finishing -------------------------------------------------------------------------

    def _finish(self, st_or_req: Any, reason: str) -> None:
        st = st_or_req if isinstance(st_or_req, SlotState) else None
        req = st.req if st else st_or_req
        rec = self.records[req.id]
        rec.tokens = st.emitted if st else 0
        rec.reason = reason
        rec.finish_s = self.env.now
        self.trace.emit("finish", req=req.id, reason=reason, tokens=rec.tokens)
        self.arrivals.request_finished(self.step)

    def _release(self, st: SlotState) -> None:
        if st.decoding:
            self.ring.leave(st.slot)
        del self.slots[st.slot]
        self.free.add(st.slot)

    def _cancel(self, req_id: Any) -> None:
        """A cancel: the request finishes now; its slot is free for this iteration's admission."""
        for st in self.slots.values():
            if st.req.id == req_id:
                self._finish(st, "cancel")
                self._release(st)
                return
        for req in self.queue:
            if req.id == req_id:
                self.queue.remove(req)
                self._finish(req, "cancel")
                return
        if self.arrivals.withdraw(req_id):
            self._finish(self.records[req_id].req, "cancel")
        # Otherwise it has finished already: nothing to cancel.

    def _fault(self, touched: list[SlotState]):
        """An engine fault in this iteration's device work fails the requests it touched."""
        yield self.env.timeout(self._host())
        for st in touched:
            self._finish(st, "error")
            self._release(st)

    def _crash(self, decision: GraphDecision) -> None:
        """upstream policy: a capture failed for want of memory and the engine exits."""
        self.stats.crashed_at_step = self.step
        for ev_key, reason in decision.evictions:
            self.stats.graph["evict"] += 1
            self.trace.emit("evict", key=ev_key, reason=reason)
        self.trace.emit("warning", text=f"engine exits: {decision.eager_reason} after "
                                        f"{self.cache.captures} captures")
        self._emit_vram()
        for slot in sorted(self.slots):
            self._finish(self.slots[slot], "error")
        for req in list(self.queue):
            self._finish(req, "error")
        self.queue.clear()
        self.slots.clear()
        self.ring = RotationRing()

    def _emit_vram(self) -> None:
        self.trace.emit("vram", free_mib=round(self.cache.budget_mib(), 3),
                        graphs_mib=round(self.cache.held_mib, 3),
                        reserve_mib=self.cache.memory.reserve_mib)
