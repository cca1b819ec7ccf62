"""Wiring: a `Scenario` (everything one run needs) and `simulate`, which runs it in SimPy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TextIO

import simpy

from strata.trace import TraceWriter

from .acceptance import AcceptanceModel
from .costs import CostProfile
from .graph_cache import GraphCache, MemoryFacts
from .scheduler import RequestRecord, RunStats, SimEngine
from .workload import ArrivalSource, ExternalEvents, SimRequest


@dataclass
class Scenario:
    #: Engine knobs (a SimEngineConfig or any object with its fields).
    knobs: Any
    memory: MemoryFacts
    #: Slots the engine runs (after the memory check; 1 in solo mode).
    slots: int
    requests: list[SimRequest]
    acceptance: AcceptanceModel
    costs: CostProfile
    #: Device memory one capture takes (MiB); called once per capture.
    measure_capture: Callable[[], float]
    #: The `config` trace line: engine knobs and memory facts as the engine records them.
    config_engine: dict[str, Any]
    config_memory: dict[str, Any]
    max_steps: int
    external: ExternalEvents = field(default_factory=ExternalEvents)
    #: Window graphs the engine's warm-up captured before any request, in capture order.
    warm_keys: list[str] = field(default_factory=list)
    #: The expert cache (sim/experts.py: the model in predict, the trace in replay) and what
    #: prices its misses (sim/expert_costs.py; None in replay); None = no expert model.
    experts: Any = None
    expert_costs: Any = None
    #: engine.stages > 1: seconds to hand a window's hidden states from one stage to the next
    #: (sim/pipeline.py).
    stage_handoff_s: float = 0.0


@dataclass
class SimRun:
    events: list[dict[str, Any]]
    records: dict[Any, RequestRecord]
    stats: RunStats
    cache: GraphCache
    steps: int
    end_s: float
    #: The expert cache the run used (None: no expert model).
    experts: Any = None


def simulate(scenario: Scenario, trace_stream: Optional[TextIO] = None) -> SimRun:
    """Run the scenario to the end; events are kept and, if given, written to `trace_stream`."""
    env = simpy.Environment()
    trace = TraceWriter(stream=trace_stream, clock=lambda: env.now)
    trace.emit("config", engine=scenario.config_engine, memory=scenario.config_memory)
    arrivals = ArrivalSource(env, scenario.requests)
    engine = SimEngine(env, scenario.knobs, scenario.memory, scenario.slots, arrivals,
                       scenario.external, scenario.acceptance, scenario.costs, trace,
                       scenario.measure_capture, scenario.max_steps, scenario.requests,
                       experts=scenario.experts, expert_costs=scenario.expert_costs,
                       stage_handoff_s=scenario.stage_handoff_s)
    if scenario.warm_keys:
        keys, sizes = engine.cache.prewarm(scenario.warm_keys)
        trace.emit("warmup", keys=keys, mib=sizes)
    env.run(until=engine.process)
    trace.flush()
    return SimRun(events=trace.events, records=engine.records, stats=engine.stats,
                  cache=engine.cache, steps=engine.step, end_s=env.now,
                  experts=scenario.experts)
