"""Requests, their arrivals, and the exogenous events of a run (cancels, faults, stops).

`SimRequest` is what the simulated engine serves. A workload makes them from the config
(`build_workload`), each random input from its own stream; a replay makes them from an engine
trace. `ArrivalSource` is the SimPy component that releases them over time, and `ExternalEvents`
holds the inputs that come from outside the scheduler in a replay: cancels and faults at given
steps, and the token count at which a request meets a stop condition.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import simpy

from .config import validate_workload
from .streams import RandomStreams


@dataclass
class SimRequest:
    id: Any
    #: Position in the workload's input order (ties in arrival are broken by it).
    index: int
    prompt_tokens: int
    max_tokens: int
    #: Exactly one of these is set: the engine iteration, or the simulated second, of arrival.
    arrival_step: Optional[int] = None
    arrival_s: Optional[float] = None
    #: The request meets a stop condition (EOS, stop string) when this many tokens were emitted
    #: and the next one is sampled; None = it runs to max_tokens or the context end.
    stop_after_tokens: Optional[int] = None
    #: The very first token (sampled at prefill end) meets a stop condition; the request then
    #: finishes with `stop_after_tokens` tokens.
    stop_at_prefill: bool = False
    #: The request samples with top-k / top-p: its windows use the filtering sampler, whose
    #: graphs are keyed apart (`+f`).
    filtered: bool = False
    #: Instead of an arrival step or second: a closed loop's request, which arrives in the
    #: iteration after an earlier request finishes (ArrivalSource.request_finished).
    after_finish: bool = False
    #: The request's sampling seed (the engine's default, 0, unless a request names one): with
    #: engine.synthetic_acceptance it keys the accept decisions, as in the engine.
    seed: int = 0

    def __post_init__(self):
        if (self.arrival_step is not None) + (self.arrival_s is not None) + self.after_finish != 1:
            raise ValueError(f"request {self.id!r}: set exactly one of arrival_step, arrival_s, "
                             f"after_finish")
        if self.prompt_tokens < 1:
            raise ValueError(f"request {self.id!r}: prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.id!r}: max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class ExternalEvents:
    """Inputs from outside the scheduler, keyed by the engine iteration they take effect in.

    cancels: step -> request ids whose client went away, in the order they did; they finish at
    the start of that iteration (docs/SCHEDULING.md, "Iterations", item 1).
    faults: steps whose planned prefill or window fails on the device (an engine fault): the
    iteration is planned as usual (the decode_share counters and the rotation pointer move),
    then every request it touched finishes with `error` instead of running.
    """
    cancels: dict[int, list[Any]] = field(default_factory=dict)
    faults: set[int] = field(default_factory=set)

    def add_cancel(self, step: int, req_id: Any) -> None:
        self.cancels.setdefault(step, []).append(req_id)

    def cancels_at(self, step: int) -> list[Any]:
        return list(self.cancels.get(step, ()))

    def faulted(self, step: int) -> bool:
        return step in self.faults


class ArrivalSource:
    """Releases requests into the engine: by step (the engine asks each iteration) or by time.

    Time arrivals are released by this component's SimPy process, which also wakes an engine
    waiting idle for work. The engine collects what is due at the start of each iteration;
    `collect` also takes any time arrival whose instant is exactly now, so the outcome never
    depends on which of two processes SimPy resumes first at one instant.
    """

    def __init__(self, env: simpy.Environment, requests: list[SimRequest]):
        self.env = env
        self._by_step = sorted((r for r in requests if r.arrival_step is not None),
                               key=lambda r: (r.arrival_step, r.index))
        self._by_time = sorted((r for r in requests if r.arrival_s is not None),
                               key=lambda r: (r.arrival_s, r.index))
        #: A closed loop's requests, in input order, each waiting for an earlier one to finish.
        self._after_finish = deque(sorted((r for r in requests if r.after_finish),
                                          key=lambda r: r.index))
        self._landed: list[SimRequest] = []
        self._wakeup = env.event()
        env.process(self._release())

    def _release(self):
        for req in list(self._by_time):
            if req.arrival_s > self.env.now:
                yield self.env.timeout(req.arrival_s - self.env.now)
            if req in self._by_time:  # not yet taken by an exact-instant collect()
                self._by_time.remove(req)
                self._landed.append(req)
            if not self._wakeup.triggered:
                self._wakeup.succeed()

    def collect(self, step: int) -> list[SimRequest]:
        """Requests that join the queue in iteration `step`, in (arrival, input order)."""
        due = [r for r in self._by_step if r.arrival_step <= step]
        self._by_step = self._by_step[len(due):]
        now = [r for r in self._by_time if r.arrival_s <= self.env.now]
        for r in now:
            self._by_time.remove(r)
        landed, self._landed = self._landed + now, []
        landed.sort(key=lambda r: (r.arrival_s, r.index))
        return due + landed

    def request_finished(self, step: int) -> None:
        """A request finished in iteration `step`: a closed loop's next request arrives in the
        next iteration (as the engine's runner adds it after the step that finished one)."""
        if self._after_finish:
            req = self._after_finish.popleft()
            req.arrival_step = step + 1
            req.after_finish = False
            self._by_step.append(req)
            self._by_step.sort(key=lambda r: (r.arrival_step, r.index))

    def withdraw(self, req_id: Any) -> bool:
        """Drop a request that has not arrived yet (cancelled before its arrival)."""
        for pool in (self._by_step, self._by_time, self._landed, self._after_finish):
            for r in pool:
                if r.id == req_id:
                    pool.remove(r)
                    return True
        return False

    @property
    def pending(self) -> bool:
        """Requests due at a known step or second. A closed loop's waiting requests do not
        count: one is released by a finish, so it is due by the time the finishing iteration
        ends."""
        return bool(self._by_step or self._by_time or self._landed)

    @property
    def waits_on_time(self) -> bool:
        """Only time arrivals are left, so an idle engine should sleep until one lands."""
        return not self._by_step and not self._landed and bool(self._by_time)

    def wakeup(self) -> simpy.Event:
        """An event that fires at the next time arrival."""
        if self._wakeup.triggered:
            self._wakeup = self.env.event()
        return self._wakeup


def _draw_sizes(gen, lo: int, hi: Optional[int], n: int) -> list[int]:
    if hi is None or hi == lo:
        return [lo] * n
    return [int(x) for x in gen.integers(lo, hi + 1, size=n)]


def build_workload(w: Any, streams: RandomStreams) -> list[SimRequest]:
    """The requests of workload config `w`; each random input uses its own named stream."""
    validate_workload(w)
    n = w.requests
    prompts = _draw_sizes(streams.stream("workload.prompt_tokens"), w.prompt_tokens,
                          w.prompt_tokens_max, n)
    outputs = _draw_sizes(streams.stream("workload.max_tokens"), w.max_tokens,
                          w.max_tokens_max, n)
    filtered = [bool(x) for x in streams.stream("workload.filtered").random(n) < w.filtered_share]
    steps: list[Optional[int]] = [None] * n
    times: list[Optional[float]] = [None] * n
    if w.kind == "stagger":
        steps = [i * w.stagger_steps for i in range(n)]
    elif w.kind == "cohort":
        times = [0.0] * n
    elif w.kind == "poisson":
        gaps = streams.stream("workload.arrivals").exponential(1.0 / w.rate_per_s, size=n)
        gaps[0] = 0.0  # the first request opens the run
        times = [float(t) for t in gaps.cumsum()]
    elif w.kind == "burst":
        sizes_gen = streams.stream("workload.burst_sizes")
        spread_gen = streams.stream("workload.burst_spread")
        times, wave = [], 0
        while len(times) < n:
            size = _draw_sizes(sizes_gen, w.burst_size, w.burst_size_max, 1)[0]
            start = wave * w.burst_gap_s
            offsets = sorted(spread_gen.uniform(0.0, w.burst_spread_s, size=size)) \
                if w.burst_spread_s > 0 else [0.0] * size
            times.extend(start + float(o) for o in offsets)
            wave += 1
        times = times[:n]
    closed = [w.concurrency > 0 and i >= w.concurrency for i in range(n)]
    return [SimRequest(id=f"r{i}", index=i, prompt_tokens=prompts[i], max_tokens=outputs[i],
                       arrival_step=None if closed[i] else steps[i],
                       arrival_s=None if closed[i] else times[i], filtered=filtered[i],
                       after_finish=closed[i],
                       seed=0 if w.request_seeds is None else w.request_seeds + i)
            for i in range(n)]
