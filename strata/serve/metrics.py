"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Written by hand so the server needs no `prometheus_client`. Engine counters (output tokens,
drafts, graph captures ...) restart from zero in every new engine process; the server adds the
last value seen from each dead process to a base, so the exported counters never go backwards.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Iterable, Optional

#: Engine stats keys that are monotonic counters inside one engine process.
ENGINE_COUNTERS = ("output_tokens", "drafted", "accepted", "graph_captures", "graph_evictions",
                   "graph_hits", "graph_eager", "windows", "prefills", "expert_hits",
                   "expert_misses")
#: Window over which strata_output_tokens_per_second is measured.
RATE_WINDOW_S = 10.0
MIB = 1 << 20


def parse_metrics(text: str) -> dict[str, float]:
    """A /metrics page's samples by name and labels (`name{label="v"}`): what render() writes,
    read back (benchmarks, the soak, the tests)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


class Histogram:
    def __init__(self, buckets: Iterable[float]):
        self.bounds = sorted(buckets)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{_fmt(b)}"}} {c}' for b, c in zip(self.bounds, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_fmt(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


def _fmt(v: float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _num(v) -> Optional[float]:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


class ServerMetrics:
    def __init__(self) -> None:
        self.started = time.time()
        self.requests: dict[str, int] = {}        # finished requests by outcome
        self.rejected: dict[str, int] = {}        # refused before running, by reason
        self.prompt_tokens = 0
        self.restarts = 0
        self.engine_now: dict = {}
        self.engine_base: dict[str, float] = {k: 0.0 for k in ENGINE_COUNTERS}
        self._rate: deque = deque()               # (monotonic t, output tokens total)
        self.ttft = Histogram([0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120])
        self.duration = Histogram([0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600])

    # -- updates (event-loop thread only)
    def finished(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def on_stats(self, st: dict) -> None:
        self.engine_now = st
        now = time.monotonic()
        self._rate.append((now, self.counter("output_tokens")))
        while len(self._rate) > 2 and self._rate[1][0] < now - RATE_WINDOW_S:
            self._rate.popleft()

    def on_engine_exit(self) -> None:
        for k in ENGINE_COUNTERS:
            v = _num(self.engine_now.get(k))
            if v is not None:
                self.engine_base[k] += v
        self.engine_now = {}

    # -- reads
    def counter(self, key: str) -> float:
        v = _num(self.engine_now.get(key))
        return self.engine_base.get(key, 0.0) + (v or 0.0)

    def tokens_per_second(self) -> float:
        if len(self._rate) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self._rate[0], self._rate[-1]
        now = time.monotonic()
        # Stats stop arriving while the engine is down: count the silence as idle time.
        span = max(t1, now) - t0
        return (v1 - v0) / span if span > 0.2 else 0.0

    def render(self, *, up: bool, state: str, in_flight: int, max_pending: int,
               model: Optional[str]) -> str:
        L: list[str] = []

        def metric(name: str, kind: str, help_: str, samples) -> None:
            L.append(f"# HELP {name} {help_}")
            L.append(f"# TYPE {name} {kind}")
            if isinstance(samples, (int, float)):
                L.append(f"{name} {_fmt(samples)}")
            else:
                for labels, v in samples:
                    lab = ",".join(f'{k}="{_esc(str(x))}"' for k, x in labels.items())
                    L.append(f"{name}{{{lab}}} {_fmt(v)}" if lab else f"{name} {_fmt(v)}")

        st = self.engine_now
        metric("strata_up", "gauge", "1 while the engine process is loaded and serving.", int(up))
        metric("strata_engine_state", "gauge", "Engine process state (1 for the current state).",
               [({"state": s}, int(s == state)) for s in
                ("loading", "ready", "restarting", "failed", "stopped")])
        metric("strata_info", "gauge", "Served model.", [({"model": model or ""}, 1)])
        metric("strata_engine_restarts_total", "counter", "Engine processes restarted after dying.",
               self.restarts)
        metric("strata_requests_in_flight", "gauge", "Requests accepted and not yet finished.",
               in_flight)
        metric("strata_requests_max_pending", "gauge", "server.max_pending (more get 429).",
               max_pending)
        metric("strata_requests_total", "counter",
               "Finished requests by outcome (stop, length, cancel, error, timeout).",
               [({"outcome": k}, v) for k, v in sorted(self.requests.items())] or 0)
        metric("strata_requests_rejected_total", "counter",
               "Requests refused before running, by reason.",
               [({"reason": k}, v) for k, v in sorted(self.rejected.items())] or 0)
        metric("strata_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
               self.prompt_tokens)
        metric("strata_output_tokens_total", "counter", "Output tokens emitted by the engine.",
               self.counter("output_tokens"))
        metric("strata_output_tokens_per_second", "gauge",
               f"Output tokens per second over the last {RATE_WINDOW_S:g} s.",
               self.tokens_per_second())
        drafted, accepted = self.counter("drafted"), self.counter("accepted")
        metric("strata_draft_tokens_total", "counter", "MTP draft tokens verified.", drafted)
        metric("strata_draft_accepted_tokens_total", "counter", "MTP draft tokens accepted.",
               accepted)
        metric("strata_draft_acceptance_rate", "gauge",
               "Accepted / drafted MTP tokens since the server started (0 before any draft).",
               accepted / drafted if drafted > 0 else 0.0)
        metric("strata_windows_total", "counter", "Verifier windows run.", self.counter("windows"))
        for key, name, help_ in (("busy_slots", "strata_busy_slots", "Slots bound to a request."),
                                 ("slots", "strata_slots", "Slots the engine runs."),
                                 ("graph_entries", "strata_graph_cache_entries",
                                  "Graphs held in the graph cache.")):
            v = _num(st.get(key))
            metric(name, "gauge", help_, v if v is not None else 0)
        metric("strata_graph_captures_total", "counter", "Graph captures.",
               self.counter("graph_captures"))
        metric("strata_graph_evictions_total", "counter", "Graph cache evictions.",
               self.counter("graph_evictions"))
        metric("strata_graph_hits_total", "counter", "Windows replayed from a cached graph.",
               self.counter("graph_hits"))
        metric("strata_graph_eager_total", "counter", "Windows run eagerly (no graph).",
               self.counter("graph_eager"))
        metric("strata_expert_hits_total", "counter",
               "Expert cache: distinct (layer, routed expert) reads of decode windows that found "
               "the expert resident on the device.", self.counter("expert_hits"))
        metric("strata_expert_misses_total", "counter",
               "Expert cache: distinct (layer, routed expert) reads of decode windows from host "
               "memory.", self.counter("expert_misses"))
        metric("strata_prefills_total", "counter", "Prefill iterations run.",
               self.counter("prefills"))
        v = _num(st.get("graphs_mib"))
        if v is not None:
            metric("strata_graph_cache_bytes", "gauge", "Device memory held by cached graphs.",
                   v * MIB)
        for key, name, help_ in (("device_free_mib", "strata_device_memory_free_bytes",
                                  "Device memory free, as the engine last measured it."),
                                 ("device_used_mib", "strata_device_memory_used_bytes",
                                  "Device memory used by the engine.")):
            v = _num(st.get(key))
            if v is not None:
                metric(name, "gauge", help_, v * MIB)
        L.append("# HELP strata_time_to_first_token_seconds Submit to first streamed token.")
        L.append("# TYPE strata_time_to_first_token_seconds histogram")
        L.extend(self.ttft.lines("strata_time_to_first_token_seconds"))
        L.append("# HELP strata_request_duration_seconds Submit to last token of completed requests.")
        L.append("# TYPE strata_request_duration_seconds histogram")
        L.extend(self.duration.lines("strata_request_duration_seconds"))
        metric("strata_server_start_time_seconds", "gauge", "Unix time the server started.",
               self.started)
        return "\n".join(L) + "\n"


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
