"""Replay: re-run an engine trace in the simulator and compare the two event sequences.

Inputs taken from the trace (DESIGN.md section 6): the `config` line (engine knobs, memory
facts), arrivals by step with prompt and max tokens and whether the request filters its
sampling (`arrive`; a trace without `filtered` means none does), each request's per-commit
`accepted` in order (`commit`), and, for requests that finished with stop / cancel / error,
the `finish` token count (and, for cancel and error, the step). An expert-cache trace
(`config.memory.expert_slots`) also gives each window's hits and misses and each swap's size
(sim.experts.RecordedExperts); the simulator decides where swaps fall (after every
engine.expert_adapt_every decode windows), and `expert_view` compares them. Everything else (which slot,
which window, which graph, when a request finishes by length) the simulator decides itself,
and `strata.trace.replay_view` projections of both traces must be identical.

Inferences: a `stop` finish with no commit events stopped at prefill end (its first token met
the stop); otherwise it stops at the commit whose tokens would take it past `tokens` (the stop
token itself is not emitted). An `error` finish at step k means iteration k's device work
faulted: the iteration is planned as usual and every request it touched fails. A `cancel` of
a request that never arrived cancels it before its arrival.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Any, Iterable, Iterator, Optional, get_args, get_type_hints

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from strata.config import TRACED_ENGINE_KNOBS
from strata.trace import (EVENT_FIELDS, FIELD_DEFAULTS, FINISH_REASONS, REPLAY_EVENTS,
                          REPLAY_FIELDS, replay_view)

from .acceptance import RecordedAcceptance
from .config import SimEngineConfig, validate_engine
from .costs import CostProfile
from .experts import ExpertSwap, RecordedExperts
from .graph_cache import MemoryFacts
from .simulation import Scenario, simulate
from .workload import ExternalEvents, SimRequest

#: Events of context shown on each side of a divergence.
CONTEXT_EVENTS = 4
#: Engine-side knobs the simulator needs from the `config` line.
#: (Knobs added to the trace later take the schema's default when a trace lacks them.)
REQUIRED_ENGINE_KNOBS = TRACED_ENGINE_KNOBS + ("drafting",)
REQUIRED_MEMORY_FACTS = ("total_mib", "weights_mib", "slot_mib", "slots", "graph_mib")
#: Counts a replay or an acceptance fit reads from the trace: each must be an int >= 0.
COUNT_FIELDS = {"arrive": ("prompt_tokens", "max_tokens"),
                "commit": ("drafted", "accepted", "emitted"), "finish": ("tokens",)}
#: Bound on simulated iterations per replay: a few per engine event is ample.
STEPS_PER_EVENT_BOUND = 4
STEPS_BOUND_FLOOR = 10_000


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file (or event) and line."""


@dataclass
class Divergence:
    """The first replayed event where engine and simulator differ."""
    index: int
    engine: Optional[tuple]
    sim: Optional[tuple]
    engine_context: list[tuple[int, tuple]] = field(default_factory=list)
    sim_context: list[tuple[int, tuple]] = field(default_factory=list)
    #: Where the engine's event sits in its trace (line number in a file, else event index).
    engine_line: Optional[int] = None

    def __str__(self) -> str:
        where = f" (trace line {self.engine_line})" if self.engine_line else ""
        out = [f"replay diverged at replayed event #{self.index}{where}:",
               f"  engine: {_fmt_view(self.engine)}",
               f"  sim:    {_fmt_view(self.sim)}"]
        for name, ctx in (("engine", self.engine_context), ("sim", self.sim_context)):
            out.append(f"{name} events around it:")
            for i, view in ctx:
                mark = ">" if i == self.index else " "
                out.append(f" {mark} #{i:<5} {_fmt_view(view)}")
        return "\n".join(out)


#: The expert cache's part of a replay (compared after the events of REPLAY_FIELDS): each
#: window's hits, misses and bus bytes, and each adaptive swap.
EXPERT_FIELDS: dict[str, tuple[str, ...]] = {
    "window": ("step", "hits", "misses", "bus_bytes"),
    "expert_swap": ("step", "experts", "bytes"),
}


def expert_view(events: Iterable[dict[str, Any]]) -> Iterator[tuple]:
    """The expert cache's comparable projection: ("window+experts", step, hits, misses,
    bus_bytes) for each window that carries them and ("expert_swap", step, experts, bytes)."""
    for rec in events:
        if rec["ev"] == "window" and "hits" in rec:
            yield ("window+experts",) + tuple(rec[f] for f in EXPERT_FIELDS["window"])
        elif rec["ev"] == "expert_swap":
            yield ("expert_swap",) + tuple(rec[f] for f in EXPERT_FIELDS["expert_swap"])


def _fmt_view(view: Optional[tuple]) -> str:
    if view is None:
        return "(no event: the trace ends here)"
    ev, step, *rest = view
    fields_of = EXPERT_FIELDS["window"] if ev == "window+experts" else (
        EXPERT_FIELDS.get(ev) if ev not in REPLAY_FIELDS else REPLAY_FIELDS[ev])
    names = [f for f in fields_of if f != "step"]
    return f"step {step:<5} {ev:<7} " + " ".join(f"{n}={v!r}" for n, v in zip(names, rest))


@dataclass
class ReplayResult:
    ok: bool
    first_divergence: Optional[Divergence]
    sim_events: list[dict[str, Any]]
    #: Replayed (compared) events per side.
    compared: int = 0
    steps: int = 0
    requests: int = 0


# --- reading ---------------------------------------------------------------------------------

def load_trace(path: str | Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Events of a trace file and the line number of each; errors name the file and line."""
    p = Path(path)
    events, lines = [], []
    try:
        f = open(p, "rb")  # (decoded line by line, so that bad bytes are named by their line)
    except FileNotFoundError:
        raise TraceError(f"{p}: trace file not found") from None
    except OSError as e:
        raise TraceError(f"{p}: cannot read trace: {e.strerror}") from None
    with f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceError(f"{p}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                 f"{e.start + 1})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{p}:{n}: not JSON: {e.msg}") from None
            problem = _event_problem(rec)
            if problem:
                raise TraceError(f"{p}:{n}: {problem}")
            events.append(rec)
            lines.append(n)
    if not events:
        raise TraceError(f"{p}: empty trace (the first line must be a config event)")
    return events, lines


def _count(v: Any) -> bool:
    """A JSON integer >= 0 (not a bool, a float or a string)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _event_problem(rec: Any) -> Optional[str]:
    if not isinstance(rec, dict):
        return "an event must be a JSON object"
    ev = rec.get("ev")
    if not isinstance(ev, str) or ev not in EVENT_FIELDS:
        return f"unknown event {ev!r}"
    optional = FIELD_DEFAULTS.get(ev, {})
    missing = [f for f in ("step",) + EVENT_FIELDS[ev] if f not in rec and f not in optional]
    if missing:
        return f"{ev} event lacks {missing}"
    if not _count(rec["step"]):
        return f"step must be a non-negative integer, got {rec['step']!r}"
    # The fields a replay or a fit takes as inputs (the others are only compared): a wrong
    # type would crash it, or replay something the engine never ran.
    if "req" in rec and (isinstance(rec["req"], bool) or not isinstance(rec["req"], (str, int))):
        return f"{ev} req must be a string, got {rec['req']!r}"
    for f in COUNT_FIELDS.get(ev, ()):
        if f in rec and not _count(rec[f]):
            return f"{ev} {f} must be a non-negative integer, got {rec[f]!r}"
    if ev == "commit" and rec["accepted"] > rec["drafted"]:
        return f"commit accepted={rec['accepted']} exceeds drafted={rec['drafted']}"
    if ev == "arrive" and not isinstance(rec.get("filtered", False), bool):
        return f"arrive filtered must be true or false, got {rec['filtered']!r}"
    if ev == "finish" and rec["reason"] not in FINISH_REASONS:
        return f"finish reason must be one of {FINISH_REASONS}, got {rec['reason']!r}"
    if ev == "warmup" and not (isinstance(rec["keys"], list) and isinstance(rec["mib"], list)
                               and all(isinstance(k, str) for k in rec["keys"])
                               and all(_number(m) for m in rec["mib"])):
        return (f"warmup keys must be a list of graph keys and mib a list of numbers, got "
                f"keys={rec['keys']!r}, mib={rec['mib']!r}")
    if ev == "window" and "mib" in rec and not _number(rec["mib"]):
        return f"window mib must be a number, got {rec['mib']!r}"
    return None


# --- from trace to scenario ------------------------------------------------------------------

def _type_name(t: Any) -> str:
    """'int', 'list[int]', 'bool or null': a schema type as a message names it."""
    args = get_args(t)
    if type(None) in args:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    return t.__name__ if isinstance(t, type) else str(t)


def _knobs(engine: dict[str, Any], where: str) -> SimEngineConfig:
    missing = [k for k in REQUIRED_ENGINE_KNOBS if k not in engine]
    if missing:
        raise TraceError(f"{where}: config.engine lacks {missing}")
    hints = get_type_hints(SimEngineConfig)
    known = {k: v for k, v in engine.items() if k in hints}
    for k, v in known.items():
        # (OmegaConf would read "no" as false and "4" as 4: an engine writes JSON's own types)
        if isinstance(v, str) and hints[k] not in (str, Optional[str]):
            raise TraceError(f"{where}: config.engine.{k}: must be {_type_name(hints[k])}, "
                             f"got {v!r}")
    try:  # typed by the schema, so that a mistyped knob is named, not a crash in the validator
        node = OmegaConf.merge(OmegaConf.structured(SimEngineConfig), known)
    except OmegaConfBaseException as e:
        raise TraceError(f"{where}: config.engine.{e.full_key}: "
                         f"{str(e).splitlines()[0]}") from None
    knobs = OmegaConf.to_object(node)
    knobs.graph_policy = "counted"  # engine traces come from strata's own policy
    if engine.get("overlap") is None:
        knobs.overlap = False  # a trace from before engine.overlap (or its auto) ran serially
    if engine.get("prefill_slots") is None:
        knobs.prefill_slots = 1  # a trace from before its auto ran one slot a chunk
    try:
        validate_engine(knobs)
    except ValueError as e:
        raise TraceError(f"{where}: config.{e}") from None
    return knobs


def _capture_sizes(events: list[dict[str, Any]], graph_mib: Any,
                   estimate_mib: float) -> Callable[[], float]:
    """What each capture of the replay measures. A CPU engine's recording backend charges one
    fixed size (`config.memory.graph_mib`); a CUDA engine measures every capture and writes it
    on the capture's window event (`mib`), which the replay hands out in order. A trace from
    before `mib` was recorded falls back to the engine's estimate: exact while graph memory is
    not what decides (a divergence shows it when it is)."""
    if graph_mib is not None:
        fixed = float(graph_mib)
        return lambda: fixed
    sizes = iter(measured_capture_mib(events))
    return lambda: next(sizes, estimate_mib)


def measured_capture_mib(events: list[dict[str, Any]]) -> list[float]:
    """The graph sizes a CUDA engine measured, in capture order: its warm-up's captures first,
    then each capture's window event (`mib`; traces from before it was recorded have none)."""
    measured = [float(m) for rec in events if rec["ev"] == "warmup" for m in rec["mib"]]
    measured += [float(rec["mib"]) for rec in events
                 if rec["ev"] == "window" and rec.get("graph") == "capture" and "mib" in rec]
    return measured


def memory_overrides(events: list[dict]) -> list[str]:
    """The simulator's memory facts from the engine's trace (sim.calibrate.memory_facts: the
    device, weights and slot sizes the engine recorded, and the graph size it measured).
    Without them the simulator would plan graphs into the default 24 GB card's budget and
    evict where the engine never did."""
    from .calibrate import memory_facts

    facts = memory_facts(events)
    eng = events[0]["engine"]
    return [f"memory.{k}={float(v)}" for k, v in facts.items()] + [
        "memory.graph_mib_jitter=0", f"engine.vram_reserve_mib={int(eng['vram_reserve_mib'])}"]


def scenario_from_trace(events: list[dict[str, Any]], lines: Optional[list[int]] = None,
                        name: str = "trace") -> Scenario:
    def where(i: int) -> str:
        return f"{name}:{lines[i] if lines else i + 1}"

    for i, rec in enumerate(events):
        problem = _event_problem(rec)
        if problem:
            raise TraceError(f"{where(i)}: {problem}")
    if not events or events[0]["ev"] != "config":
        raise TraceError(f"{where(0)}: the first event must be `config` "
                         f"(got {events[0]['ev'] if events else 'nothing'!r})")
    cfg = events[0]
    if not isinstance(cfg["engine"], dict) or not isinstance(cfg["memory"], dict):
        raise TraceError(f"{where(0)}: config.engine and config.memory must be objects")
    knobs = _knobs(cfg["engine"], where(0))
    mem = cfg["memory"]
    missing = [k for k in REQUIRED_MEMORY_FACTS if k not in mem]
    if missing:
        raise TraceError(f"{where(0)}: config.memory lacks {missing}")
    for k in REQUIRED_MEMORY_FACTS:
        v = mem[k]
        if k == "slots" and not (_count(v) and v >= 1):
            raise TraceError(f"{where(0)}: config.memory.slots must be an integer >= 1, got {v!r}")
        if not (_number(v) and v >= 0) and not (k == "graph_mib" and v is None):
            raise TraceError(f"{where(0)}: config.memory.{k} must be a number >= 0, got {v!r}")
    for i, rec in enumerate(events[1:], 1):
        if rec["ev"] == "config":  # (two runs' traces joined: which config would apply?)
            raise TraceError(f"{where(i)}: a second config event (a trace holds one engine "
                             f"run; its config is on {where(0)})")

    requests: list[SimRequest] = []
    seen: set = set()
    accepted: dict[Any, list[int]] = defaultdict(list)
    finishes: dict[Any, tuple[int, dict]] = {}
    first_commit: dict[Any, int] = {}
    for i, rec in enumerate(events):
        ev = rec["ev"]
        if ev == "arrive":
            if rec["req"] in seen:
                raise TraceError(f"{where(i)}: request {rec['req']!r} arrives twice")
            if rec["prompt_tokens"] >= knobs.max_context:  # (the engine refuses it at submit)
                raise TraceError(f"{where(i)}: request {rec['req']!r}: prompt_tokens "
                                 f"{rec['prompt_tokens']} leaves no room in config.engine."
                                 f"max_context={knobs.max_context} (at most "
                                 f"{knobs.max_context - 1})")
            seen.add(rec["req"])
            try:
                requests.append(SimRequest(id=rec["req"], index=len(requests),
                                           prompt_tokens=int(rec["prompt_tokens"]),
                                           max_tokens=int(rec["max_tokens"]),
                                           arrival_step=rec["step"],
                                           filtered=bool(rec.get("filtered", False))))
            except (TypeError, ValueError) as e:
                raise TraceError(f"{where(i)}: {e}") from None
        elif ev == "commit":
            if not accepted.get(rec["req"]):
                first_commit[rec["req"]] = i
            accepted[rec["req"]].append(rec["accepted"])
        elif ev == "finish":
            if rec["req"] in finishes:
                raise TraceError(f"{where(i)}: request {rec['req']!r} finishes twice")
            finishes[rec["req"]] = (i, rec)
    for req_id, i in first_commit.items():
        if req_id not in seen:
            raise TraceError(f"{where(i)}: commit of request {req_id!r}, which never arrived")

    external = ExternalEvents()
    by_id = {r.id: r for r in requests}
    for req_id, (i, rec) in sorted(finishes.items(), key=lambda kv: kv[1][0]):
        reason = rec["reason"]
        if reason == "cancel":
            external.add_cancel(rec["step"], req_id)
            if req_id not in by_id:
                # Cancelled before it arrived: it has no arrive event, only this finish.
                req = SimRequest(id=req_id, index=len(requests), prompt_tokens=1, max_tokens=1,
                                 arrival_step=rec["step"] + 1)
                requests.append(req)
                by_id[req_id] = req
        elif req_id not in by_id:
            raise TraceError(f"{where(i)}: request {req_id!r} finishes but never arrived")
        elif reason == "stop":
            by_id[req_id].stop_after_tokens = int(rec["tokens"])
            # No commit: no window ran for it, so the first token met the stop.
            by_id[req_id].stop_at_prefill = not accepted.get(req_id)
        elif reason == "error":
            external.faults.add(rec["step"])

    experts = recorded_experts(events, knobs, where) if "expert_slots" in mem else None
    slots = 1 if knobs.mode == "solo" else int(mem["slots"])
    measure_capture = _capture_sizes(events, mem["graph_mib"], float(knobs.graph_mib_estimate))
    memory = MemoryFacts(total_mib=float(mem["total_mib"]), weights_mib=float(mem["weights_mib"]),
                         slot_mib=float(mem["slot_mib"]), slots=int(mem["slots"]),
                         reserve_mib=float(knobs.vram_reserve_mib),
                         graph_mib_estimate=float(knobs.graph_mib_estimate))
    return Scenario(knobs=knobs, memory=memory, slots=slots, requests=requests,
                    acceptance=RecordedAcceptance(accepted), costs=CostProfile.zero(),
                    measure_capture=measure_capture,
                    config_engine=cfg["engine"], config_memory=mem,
                    max_steps=max(STEPS_BOUND_FLOOR, STEPS_PER_EVENT_BOUND * len(events)
                                  + max((e["step"] for e in events), default=0)),
                    external=external,
                    warm_keys=[k for rec in events if rec["ev"] == "warmup" for k in rec["keys"]],
                    experts=experts)


def recorded_experts(events: list[dict[str, Any]], knobs: Any,
                     where: Callable[[int], str]) -> RecordedExperts:
    """The expert cache of a trace whose `config.memory` has `expert_slots`: every window's
    hits and misses and every swap, checked (bus_bytes = misses x expert_bytes, a swap's bytes
    = experts x expert_bytes)."""
    mem = events[0]["memory"]
    missing = [k for k in ("expert_slots", "experts", "expert_bytes", "moe_layers") if k not in mem]
    if missing:
        raise TraceError(f"{where(0)}: config.memory has expert_slots but lacks {missing}")
    try:
        slots, experts = int(mem["expert_slots"]), int(mem["experts"])
        expert_bytes, moe_layers = int(mem["expert_bytes"]), int(mem["moe_layers"])
    except (TypeError, ValueError) as e:
        raise TraceError(f"{where(0)}: config.memory expert fields: {e}") from None
    windows: list[tuple[int, int]] = []
    swaps: dict[int, ExpertSwap] = {}
    for i, rec in enumerate(events):
        if rec["ev"] == "window":
            lacking = [k for k in ("hits", "misses", "bus_bytes") if k not in rec]
            if lacking:
                raise TraceError(f"{where(i)}: window of an expert-cache trace lacks {lacking}")
            hits, misses, bus = rec["hits"], rec["misses"], rec["bus_bytes"]
            if not all(isinstance(v, int) and v >= 0 for v in (hits, misses, bus)):
                raise TraceError(f"{where(i)}: window hits, misses and bus_bytes must be "
                                 f"non-negative ints, got {hits!r}, {misses!r}, {bus!r}")
            if bus != misses * expert_bytes:
                raise TraceError(f"{where(i)}: window bus_bytes {bus} != misses {misses} x "
                                 f"expert_bytes {expert_bytes} = {misses * expert_bytes}")
            if hits + misses > moe_layers * experts:
                raise TraceError(f"{where(i)}: window hits + misses = {hits + misses} exceeds "
                                 f"moe_layers {moe_layers} x experts {experts}")
            windows.append((hits, misses))
        elif rec["ev"] == "expert_swap":
            n, b = rec["experts"], rec["bytes"]
            if not (isinstance(n, int) and n >= 0 and b == n * expert_bytes):
                raise TraceError(f"{where(i)}: expert_swap bytes {b!r} != experts {n!r} x "
                                 f"expert_bytes {expert_bytes}")
            if rec["step"] in swaps:
                raise TraceError(f"{where(i)}: two expert_swap events at step {rec['step']}")
            swaps[rec["step"]] = ExpertSwap(n, b)
    return RecordedExperts(windows, swaps, slots, experts, moe_layers, expert_bytes,
                           int(getattr(knobs, "expert_adapt_every", 0)))


# --- comparing -------------------------------------------------------------------------------

def compare(engine_events: Iterable[dict[str, Any]], sim_events: Iterable[dict[str, Any]],
            engine_lines: Optional[list[int]] = None) -> tuple[Optional[Divergence], int]:
    """First divergence of the replay views (None if identical), and events compared."""
    engine_list = list(engine_events)
    # Line of each replayed engine event, to point at the file.
    replayed_lines = [(engine_lines[i] if engine_lines else None)
                      for i, rec in enumerate(engine_list) if rec["ev"] in REPLAY_EVENTS]
    replayed_lines += [(engine_lines[i] if engine_lines else None)
                       for i, rec in enumerate(engine_list)
                       if (rec["ev"] == "window" and "hits" in rec) or rec["ev"] == "expert_swap"]
    sim_list = list(sim_events)
    a = list(replay_view(engine_list)) + list(expert_view(engine_list))
    b = list(replay_view(sim_list)) + list(expert_view(sim_list))
    for i in range(max(len(a), len(b))):
        ea = a[i] if i < len(a) else None
        eb = b[i] if i < len(b) else None
        if ea != eb:
            lo, hi = max(0, i - CONTEXT_EVENTS), i + CONTEXT_EVENTS + 1
            return Divergence(index=i, engine=ea, sim=eb,
                              engine_context=list(enumerate(a))[lo:hi],
                              sim_context=list(enumerate(b))[lo:hi],
                              engine_line=replayed_lines[i] if i < len(a) else None), i
    return None, len(a)


def replay_trace(events: list[dict[str, Any]], lines: Optional[list[int]] = None,
                 name: str = "trace") -> ReplayResult:
    """Replay engine `events` (a parsed trace) and compare; see the module docstring."""
    scenario = scenario_from_trace(events, lines, name)
    run = simulate(scenario)
    divergence, compared = compare(events, run.events, lines)
    return ReplayResult(ok=divergence is None, first_divergence=divergence,
                        sim_events=run.events, compared=compared, steps=run.steps,
                        requests=len(scenario.requests))


def replay_file(path: str | Path) -> ReplayResult:
    events, lines = load_trace(path)
    return replay_trace(events, lines, name=str(path))


def summary_line(result: ReplayResult, path: str) -> str:
    counts: dict[str, int] = defaultdict(int)
    for view in replay_view(result.sim_events):
        counts[view[0]] += 1
    detail = ", ".join(f"{counts[ev]} {ev}" for ev in REPLAY_EVENTS)
    return (f"replay ok: {result.compared} events identical ({detail}) over {result.steps} "
            f"steps, {result.requests} requests: {path}")


def main_replay(trace_path: str, print_outputs: bool = True) -> int:
    """CLI body: 0 when the replay is identical, 1 on a divergence, 2 on a bad trace."""
    try:
        result = replay_file(trace_path)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result.ok:
        if print_outputs:
            print(summary_line(result, trace_path))
        return 0
    print(result.first_divergence)
    return 1
