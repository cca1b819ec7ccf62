"""The trace: the event schema shared by the engine and the simulator (DESIGN.md section 6).

This is the only strata module that sim/ may import. Every event is one JSON object on one
line with `ev` (its kind), `step` (engine iteration index) and `t` (seconds since start).

Events and their fields:
  config   {engine, memory}          first line: the knobs and memory facts a replay needs
  arrive   {req, prompt_tokens, max_tokens, filtered}
  admit    {req, slot}
  prefill  {req, slot, tokens}
  window   {layout, key, graph, rows} graph is hit | capture | eager
  evict    {key, reason}             reason is limit | memory | error
  commit   {req, slot, drafted, accepted, emitted}
  finish   {req, reason, tokens}     reason is stop | length | cancel | error
  warning  {text}
  vram     {free_mib, graphs_mib, reserve_mib}
  warmup   {keys, mib}               window graphs captured before any request, in capture
                                     order (LRU first), and the MiB each measured
  expert_swap {experts, bytes}       the expert cache's adaptive swap after the window before
                                     it: experts copied host -> device (all layers), bytes

`arrive.filtered`: the request samples with top-k / top-p (temperature > 0 and top_k > 0 or
top_p < 1), so every window holding it uses the sorting sampler and its graph key ends in `+f`.
Traces written before it existed lack it; readers take a missing field from FIELD_DEFAULTS.

Events may carry extra fields: `window` and `prefill` carry `dur` (seconds of device work of
that iteration) and `ctx` (for a window its context tier, for a prefill chunk the positions it
covers) so that a cost profile can be fitted from traces. A prompt chunk that held several
slots' chunks (engine.prefill_slots) writes one `prefill` per slot, in admission order, each
with `segments` (their count) and the whole chunk's `dur`.
A capture's `window` event carries `mib` (the device memory it measured): a replay needs it
when the engine measures captures (CUDA) rather than charging a fixed size (`graph_mib`).
With the expert cache (engine.expert_cache_mib > 0) a `window` carries `hits`, `misses` (each
distinct (layer, routed expert) pair its rows route to, once: a hit when resident at the
window's start) and `bus_bytes` (misses x bytes of one routed expert), and the `config`
event's `memory` carries `expert_slots`, `experts`, `expert_bytes` and `moe_layers`.
With pipelined slot groups (engine.pipeline_groups) a `window` is written when it lands (its
output read) and carries `launched`, the step that launched it; its `dur` is launch to land.
Replay compares the sequence of REPLAY_EVENTS on REPLAY_FIELDS (and REPLAY_OPTIONAL_FIELDS
where the engine's event has them); timestamps are never compared.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TextIO
from strata.kinds import GraphAction

EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "config": ("engine", "memory"),
    "arrive": ("req", "prompt_tokens", "max_tokens", "filtered"),
    "admit": ("req", "slot"),
    "prefill": ("req", "slot", "tokens"),
    "window": ("layout", "key", "graph", "rows"),
    "evict": ("key", "reason"),
    "commit": ("req", "slot", "drafted", "accepted", "emitted"),
    "finish": ("req", "reason", "tokens"),
    "warning": ("text",),
    "vram": ("free_mib", "graphs_mib", "reserve_mib"),
    "warmup": ("keys", "mib"),
    "expert_swap": ("experts", "bytes"),
}

#: Events of device work: a trace that writes or keeps them stamps each with `trace_s`, the
#: seconds the writer itself has spent so far (encoding and writing events), so that a cost
#: profile fitted from the trace can take the trace's own host time out of the host gaps it
#: measures: an engine as served (a server, a benchmark) builds no events.
DEVICE_EVENTS = ("prefill", "window")

#: Fields added to the schema later, with the value a reader takes when an older trace lacks one.
FIELD_DEFAULTS: dict[str, dict[str, Any]] = {"arrive": {"filtered": False}}

#: Graph-key suffix of a window that uses the filtering (top-k / top-p) sampler.
FILTERED_SUFFIX = "+f"

GRAPH_ACTIONS = tuple(a.value for a in GraphAction)
EVICT_REASONS = ("limit", "memory", "error")
FINISH_REASONS = ("stop", "length", "cancel", "error")

#: The events a replay must reproduce, and the fields compared for each.
REPLAY_EVENTS = ("admit", "window", "evict", "commit", "finish")
REPLAY_FIELDS: dict[str, tuple[str, ...]] = {
    "admit": ("step", "req", "slot"),
    "window": ("step", "layout", "key", "graph", "rows"),
    "evict": ("step", "key", "reason"),
    "commit": ("step", "req", "slot", "drafted", "accepted", "emitted"),
    "finish": ("step", "req", "reason", "tokens"),
}
#: Fields a replay compares when the engine's event has them: a pipelined window's launch step
#: (engine.pipeline_groups), so that a replay holds the same windows in flight.
REPLAY_OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {"window": ("launched",)}


def layout_key(layout: Iterable[int], tier: int, filtered: bool = False) -> str:
    """Graph key of the `layout` policy: the exact layout plus the context tier, and `+f` when
    the window uses the filtering sampler (a different graph)."""
    return "layout:" + ",".join(str(s) for s in layout) + f"@{tier}" + (FILTERED_SUFFIX if filtered else "")


def shape_key(bucket: int, group_rows: int, tier: int, filtered: bool = False) -> str:
    """Graph key of the `shape` policy: groups bucket x rows per group, plus the context tier,
    and `+f` when the window uses the filtering sampler."""
    return f"shape:{bucket}x{group_rows}@{tier}" + (FILTERED_SUFFIX if filtered else "")


def context_tier(need: int, tier_min: int, max_context: int) -> int:
    """Smallest tier (tier_min doubled k times, capped at max_context) holding `need` positions."""
    tier = tier_min
    while tier < need and tier < max_context:
        tier *= 2
    return min(tier, max_context) if need <= max_context else max_context


def prefill_bucket(tokens: int, buckets: Iterable[int]) -> int:
    """The length a prompt chunk of `tokens` runs at: the smallest bucket holding it, or `tokens`
    itself past the last bucket (such a chunk runs unpadded)."""
    for b in buckets:
        if b >= tokens:
            return int(b)
    return tokens


def context_tiers(tier_min: int, max_context: int) -> list[int]:
    """Every context tier, ascending: tier_min doubled until it reaches max_context."""
    tiers = [context_tier(1, tier_min, max_context)]
    while tiers[-1] < max_context:
        tiers.append(context_tier(tiers[-1] + 1, tier_min, max_context))
    return tiers


def invariant_group_rows(rows: int, window_rows: int) -> int:
    """Rows per group of a batch-invariant window (`engine.batch_invariant`) whose deepest
    group has `rows` rows: the smallest divisor of window_rows that holds them, so the window's
    groups x rows is exactly window_rows whatever its layout."""
    for d in range(max(1, rows), window_rows + 1):
        if window_rows % d == 0:
            return d
    return rows  # rows > window_rows: a config error (spec <= window_rows) caught elsewhere


def invariant_window_shape(rows: int, window_rows: int) -> tuple[int, int]:
    """(groups, rows per group) a batch-invariant window whose deepest group has `rows` rows
    runs: groups x rows per group is exactly window_rows."""
    g = invariant_group_rows(rows, window_rows)
    return window_rows // g, g


def invariant_shapes(most_rows: int, window_rows: int) -> list[tuple[int, int]]:
    """The (groups, rows per group) shapes batch-invariant windows run, deepest first."""
    out: list[tuple[int, int]] = []
    for g in range(most_rows, 0, -1):
        shape = invariant_window_shape(g, window_rows)
        if shape not in out:
            out.append(shape)
    return out


def warm_window_keys(slots: int, most_rows: int, window_rows: int, shape_buckets: Iterable[int],
                     tier_min: int, max_context: int,
                     batch_invariant: bool = False) -> list[tuple[int, int, int]]:
    """The shape-keyed window graphs a warm-up captures, as (bucket, group rows, tier), in
    capture order: context tiers ascending; within a tier, group rows from `most_rows` (the
    deepest window: spec rows, or 2 for batch_mtp) down to 1; within those, every bucket up to
    the one holding the most groups that fit (`window_rows // rows`, at most `slots`). Batch-
    invariant windows run one shape per group depth (`invariant_shapes`). Only the sort-free
    sampler's keys (no `+f`). The capture stops at the graph limit, or at the first capture
    the memory budget refuses."""
    buckets = list(shape_buckets)
    out = []
    for tier in context_tiers(tier_min, max_context):
        if batch_invariant:
            out.extend((n, g, tier) for n, g in invariant_shapes(most_rows, window_rows))
            continue
        for g in range(most_rows, 0, -1):
            top = shape_bucket(max(1, min(slots, window_rows // g)), buckets)
            out.extend((b, g, tier) for b in buckets if b <= top)
    return out


def shape_bucket(groups: int, buckets: Iterable[int]) -> int:
    """The smallest bucket holding `groups` groups (the largest bucket's multiple past the end)."""
    buckets = list(buckets)
    for b in buckets:
        if b >= groups:
            return b
    top = buckets[-1]
    return ((groups + top - 1) // top) * top


#: One compact encoder for every event (json.dumps with separators builds a new one per call).
_encode = json.JSONEncoder(separators=(",", ":")).encode


class TraceWriter:
    """Writes events as JSON Lines; `step` is set by the owner as iterations advance."""

    def __init__(self, path: Optional[str | Path] = None, stream: Optional[TextIO] = None,
                 clock=time.perf_counter):
        self._own = None
        if path is not None:
            self._own = open(path, "w", encoding="utf-8")
        self._out = self._own or stream
        self._clock = clock
        self._t0 = clock()
        self.step = 0
        self.events: list[dict[str, Any]] = []
        self.keep = True
        #: Called with (event name, fields) for every event, kept or not (a soak's counters).
        self.listener: Optional[Callable[[str, dict[str, Any]], None]] = None
        #: Seconds spent recording events (building, keeping, encoding, writing them).
        self.spent_s = 0.0

    @property
    def active(self) -> bool:
        """Whether an event would go anywhere: the engine skips building the events of its
        hot path (a window, its commits) when not, as in a server or a benchmark."""
        return self.keep or self._out is not None or self.listener is not None

    def emit(self, ev: str, **fields: Any) -> Optional[dict[str, Any]]:
        """Check and record one event; returns it, or None when nothing keeps or writes it."""
        if not self.active:
            return None
        expected = EVENT_FIELDS.get(ev)
        if expected is None:
            raise ValueError(f"unknown trace event {ev!r}")
        for f in expected:
            if f not in fields:
                raise ValueError(f"trace event {ev!r} lacks {[f for f in expected if f not in fields]}")
        if self.listener is not None:
            self.listener(ev, fields)
        if not self.keep and self._out is None:
            return None  # a listener only
        now = self._clock()
        rec = {"ev": ev, "step": self.step, "t": round(now - self._t0, 6), **fields}
        if ev in DEVICE_EVENTS:
            rec["trace_s"] = round(self.spent_s, 6)
        if self.keep:
            self.events.append(rec)
        if self._out is not None:
            self._out.write(_encode(rec) + "\n")
        self.spent_s += self._clock() - now
        return rec

    def restart_clock(self) -> None:
        """Event times count from now (after an engine's start-up work)."""
        self._t0 = self._clock()

    def flush(self) -> None:
        if self._out is not None:
            self._out.flush()

    def stop(self) -> None:
        """Write nothing more: the engine then runs as served (sim.engine_runs times an
        untraced twin of a traced run on the same engine)."""
        self.close()
        self._out = None
        self.keep = False

    def close(self) -> None:
        if self._own is not None:
            self._own.close()
            self._own = None


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Read a trace file; a malformed line is an error naming the file and line number."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            if rec.get("ev") not in EVENT_FIELDS:
                raise ValueError(f"{path}:{n}: unknown event {rec.get('ev')!r}")
            out.append(rec)
    return out


def replay_view(events: Iterable[dict[str, Any]]) -> Iterator[tuple]:
    """The comparable projection of a trace: (ev, field values...) for each replayed event."""
    for rec in events:
        ev = rec["ev"]
        if ev in REPLAY_FIELDS:
            extra = tuple((f, rec[f]) for f in REPLAY_OPTIONAL_FIELDS.get(ev, ()) if f in rec)
            yield (ev,) + tuple(_freeze(rec[f]) for f in REPLAY_FIELDS[ev]) + extra


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v
