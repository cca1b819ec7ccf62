"""Cost profile: how long the engine's device work and host work take.

Schema (JSON; docs/SIMULATOR.md has the full description):

    {
      "schema": "strata-sim-cost-profile/1",
      "source": {...},                         free-form: device, commit, traces fitted
      "host_overhead_s": 0.0003,               host time of every iteration (idle ones too)
      "host": {"per_commit_s": 2.9e-05,        optional: host time that grows with the work:
               "per_admit_s": 6e-05,             each commit of the previous iteration (emit,
               "per_admit_burst_s": 0.00037,     stop checks), each request bound to a slot in
               "after_prefill_s": 6e-05,         this one plus once per iteration that binds
               "per_finish_s": 8e-05,            any (one batched binding), after a prompt-chunk
               "sync_s": 1e-05,                  (engine.overlap: reading a window's output
                                                 after its device work, once per window)
               "launch_s": 4e-05,                (a decode window's own host share: filling its
                                                 inputs, launching it, reading its rows; a
                                                 serial window waits for it, engine.overlap
                                                 runs it while the window before is on the
                                                 device)
               "submit_s": 2.5e-05},             (the part of a serial window's device seconds
                                                 the idle device waits for the window to be
                                                 submitted: an overlapped window queued behind
                                                 the one before does not)
                                               iteration, each request finished in the previous
                                               one; host_overhead_s is the fixed part. Commits,
                                               finishes and after-prefill are the earlier
                                               iteration's tail (before the next arrivals), the
                                               rest the later one's head
      "prefill": {"tokens": [t0, t1, ...],     ascending chunk sizes (padded to the engine's
                                               prefill_buckets when the traces listed them)
                  "s":      [s0, s1, ...],     seconds of one prefill chunk of that size
                  "tiers":  [c0, c1, ...],     optional: ascending attention context tiers
                  "table":  [[s per size] per tier]},  optional: by (tier, size)
      "decode": {"rows":  [r0, r1, ...],       ascending window row counts
                 "tiers": [c0, c1, ...],       ascending context tiers
                 "hit":     [[s per row count] per tier],   replaying a captured graph
                 "capture": [[...]],                        capturing (and running) one
                 "eager":   [[...]],                        running without a graph
                 "shapes":  ["NxG", ...],       optional: window shapes (padded groups x rows
                                                per group), each measured in some trace
                 "shape_s": {"hit": [[s per shape] per tier], "capture": ..., "eager": ...},
                 "submit_s": [s per shape],     optional: host.submit_s by shape
                 "slot_scale": {"slots": [n0, ...],   optional: window time x scale by the
                                "scale": [f0, ...]}},  engine's slot count (log2 interpolation)
      "acceptance": {...}                      optional: AcceptanceFit.as_dict()
    }

Interpolation: decode time is linear in rows and in log2(tier) between grid points (bilinear);
prefill time is linear in tokens. Past the last grid point rows and tokens extrapolate along
the last segment's slope (device time keeps growing with work), tiers clamp to the nearest
measured tier. Below the first point rows and tokens scale proportionally toward zero work.
A window whose shape (groups as run, rows per group) is in `decode.shapes` takes that shape's
column instead of the rows table: a 1x4 window (one 4-row group) and a 2x2 one have the same
rows but not the same cost. A shape the profile never measured takes the measured shape with
the same rows per group and the nearest group count (in log2; the larger on a tie): on the
H200, windows of one group depth cost nearly the same at any group count (2-row groups:
444-471 us from 1x2 to 8x2), while the rows table mixes depths (its 4-row cell is mostly 1x4
windows, 25% dearer than 2x2; plain batch's 4x1 windows, never profiled, were priced there).
With no measured shape of that depth it falls back to the rows table. With `prefill.table`, prefill time is also linear in log2(tier).
A window's device time also depends on the engine's slot count, not only on the rows it runs:
on the H200 the tiny model's 4x1 and 4x2 windows took 5-6% longer in an 8-slot engine than in
a 4-slot one, 1x4 windows 4% longer than with one slot (docs/SIMULATOR.md). `decode.slot_scale`
multiplies every window's time by the scale of the engine's slot count (linear in log2(slots)
between the measured ones, clamped outside); `for_slots(n)` gives the profile a prediction
with n slots uses.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from strata.trace import GRAPH_ACTIONS  # the trace schema is the one strata module sim/ uses

from .files import read_json

SCHEMA = "strata-sim-cost-profile/1"


class ProfileError(ValueError):
    pass


def _short(v: Any, width: int = 80) -> str:
    """repr(v), cut to `width` characters (a message quotes a bad value, not a whole table)."""
    r = repr(v)
    return r if len(r) <= width else r[:width - 3] + "..."


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear y(x): proportional below xs[0], last-segment slope past xs[-1]."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    if x <= xs[0]:
        return ys[0] * x / xs[0] if xs[0] > 0 else ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + f * (ys[i] - ys[i - 1])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return max(0.0, ys[-1] + slope * (x - xs[-1]))


def _bracket(x: float, xs: Sequence[float]) -> tuple[int, int, float]:
    """Indices (i, j) around x and the weight of j; clamped at both ends."""
    if x <= xs[0]:
        return 0, 0, 0.0
    if x >= xs[-1]:
        return len(xs) - 1, len(xs) - 1, 0.0
    for j in range(1, len(xs)):
        if x <= xs[j]:
            return j - 1, j, (x - xs[j - 1]) / (xs[j] - xs[j - 1])
    raise AssertionError("unreachable")


def same_depth_shape(shape: tuple[int, int], names: Iterable[str]) -> Optional[str]:
    """Of the shapes `names` ("NxG"), the one with `shape`'s rows per group and the nearest
    group count (log2 distance, the larger on a tie), or None."""
    groups, depth = shape
    same = [(int(n), name) for name in names for n, _, g in [name.partition("x")]
            if int(g) == depth]
    if not same or groups < 1:
        return None
    return min(same, key=lambda c: (abs(math.log2(c[0]) - math.log2(groups)), -c[0]))[1]


def depth_extrapolated_shape(shape: tuple[int, int], names: Sequence[str]):
    """For a shape none of whose depth is measured: the two measured shapes of the family
    (group count, the nearest to `shape`'s by log2 distance, the larger on a tie) that has
    two depths or more whose window times are carried along the depth to it, as ((index,
    depth), (index, depth)) bracketing it, or the family's two deepest; and the index of the
    family's deepest shape when `shape` is deeper than all (None else). None when no family
    has two depths, or `shape` is shallower than its family (the rows table prices those).
    Why: a window's depth is its rows per group, which in solo and batch_mtp windows is the
    drafts it verifies, and each draft past the first is a step of the MTP head in the window;
    so a window one draft deeper than the profile measured costs about one step more, where
    the rows table (filled by the shapes measured at every row count, most of them shallower)
    prices it as a shallow window of that many rows."""
    groups, depth = shape
    fams: dict[int, dict[int, int]] = {}
    for k, name in enumerate(names):
        n, _, g = name.partition("x")
        fams.setdefault(int(n), {})[int(g)] = k
    fams = {n: ds for n, ds in fams.items() if len(ds) >= 2}
    if not fams or groups < 1 or depth < 1:
        return None
    n = min(fams, key=lambda c: (abs(math.log2(c) - math.log2(groups)), -c))
    ds = sorted(fams[n])
    below, above = [d for d in ds if d < depth], [d for d in ds if d > depth]
    if not below:  # shallower than the family: the rows table, as before
        return None
    d1, d2 = (below[-1], above[0]) if above else (ds[-2], ds[-1])
    deepest = fams[n][ds[-1]] if depth > ds[-1] else None
    return (fams[n][d1], d1), (fams[n][d2], d2), deepest


@dataclass
class CostProfile:
    host_overhead_s: float
    prefill_tokens: list[float]
    prefill_s: list[float]
    decode_rows: list[float]
    decode_tiers: list[float]
    #: action -> [tier index][row index] seconds.
    decode_s: dict[str, list[list[float]]]
    acceptance: Optional[dict[str, Any]] = None
    source: dict[str, Any] = field(default_factory=dict)
    #: Optional prefill by attention tier: [tier index][prefill_tokens index] seconds.
    prefill_tiers: Optional[list[float]] = None
    prefill_table: Optional[list[list[float]]] = None
    #: Optional decode by window shape "NxG": action -> [tier index][shape index] seconds.
    decode_shapes: Optional[list[str]] = None
    decode_shape_s: Optional[dict[str, list[list[float]]]] = None
    #: Optional host.submit_s by window shape (one entry per decode_shapes entry): a bigger
    #: graph takes the host longer to submit.
    decode_shape_submit_s: Optional[list[float]] = None
    #: Optional window-time scale by the engine's slot count: {"slots": [...], "scale": [...]}
    #: (ascending slot counts; 1 where the fitted runs' average speed was).
    decode_slot_scale: Optional[dict[str, list[float]]] = None
    #: Optional host time that grows with the work (seconds): per commit of the previous
    #: iteration, per request admitted in this one, once per iteration that admits any (the
    #: engine binds a burst of admissions in one batched step, whose cost is mostly fixed),
    #: and after an iteration that ran a prompt chunk. Absent (all 0): every iteration's
    #: host time is host_overhead_s.
    host_per_commit_s: float = 0.0
    host_per_admit_s: float = 0.0
    host_per_admit_burst_s: float = 0.0
    host_after_prefill_s: float = 0.0
    #: Per request that finished in the previous iteration (its finish event, the slot's
    #: release; in a closed loop, handing the next request to the engine).
    host_per_finish_s: float = 0.0
    #: engine.overlap: the host's wait for a window's output rows after its device work ends
    #: (the event's wake-up and the copy's read), once per window read.
    host_sync_s: float = 0.0
    #: A decode window's own host share, outside its device seconds (the decode tables): filling
    #: its inputs, launching its graph, reading its rows back. Fitted from serial traces whose
    #: windows carry `dev` (their `dur` less it); a serial window waits for it before its
    #: device work, engine.overlap runs it while the window before is still on the device.
    #: 0 for profiles fitted from `dur` alone, whose decode tables hold it.
    host_launch_s: float = 0.0
    #: The part of a serial window's device seconds (the decode tables) in which the idle
    #: device waits for the host to submit the window's copies and graph: a window launched
    #: while the one before is still on the device is queued by then and does not pay it.
    #: Fitted from overlapped traces beside serial ones (sim.profile); 0 without them.
    host_submit_s: float = 0.0
    #: The slot factor for_slots scaled the window tables by (1 when unscaled; not saved). A
    #: serial window's slot-count share is in its submission: overlapped windows queued behind
    #: each other ran within 1% across slot counts where serial ones differed by 8% (H200,
    #: 4x2 at 4 and 8 slots), so a queued window takes the tables without it (sim.scheduler).
    window_slot_factor: float = 1.0

    # --- queries -------------------------------------------------------------------------

    def host_time(self, prev_commits: int = 0, admitted: int = 0, after_prefill: bool = False,
                  prev_finishes: int = 0) -> float:
        """Host seconds between two iterations' device work: the tail of the earlier one
        (`host_tail_time`) and the head of the later one (`host_head_time`)."""
        return (self.host_tail_time(prev_commits, prev_finishes, after_prefill)
                + self.host_head_time(admitted))

    def host_tail_time(self, commits: int = 0, finishes: int = 0,
                       after_prefill: bool = False) -> float:
        """Host seconds after an iteration's device work, before the next iteration starts
        (and takes its arrivals): emitting the commits' tokens, finishing requests, and after
        a prompt chunk its first-token bookkeeping."""
        return (self.host_per_commit_s * commits + self.host_per_finish_s * finishes
                + (self.host_after_prefill_s if after_prefill else 0.0))

    def host_head_time(self, admitted: int = 0) -> float:
        """Host seconds at an iteration's start, after its arrivals and before its device
        work: the fixed part and binding the admissions (a part per request and a part per
        burst)."""
        return (self.host_overhead_s + self.host_per_admit_s * admitted
                + (self.host_per_admit_burst_s if admitted else 0.0))

    def prefill_time(self, tokens: int, tier: Optional[int] = None) -> float:
        """Seconds of a prompt chunk of `tokens` (already padded to its bucket) whose attention
        reads `tier` positions; without a tier table (or a tier) the tier is ignored."""
        if self.prefill_table is None or tier is None:
            return _interp(tokens, self.prefill_tokens, self.prefill_s)
        i, j, w = _bracket(math.log2(tier), [math.log2(t) for t in self.prefill_tiers])
        lo = _interp(tokens, self.prefill_tokens, self.prefill_table[i])
        hi = _interp(tokens, self.prefill_tokens, self.prefill_table[j])
        return lo + w * (hi - lo)

    def decode_time(self, rows: int, tier: int, action: str,
                    shape: Optional[tuple[int, int]] = None) -> float:
        """Seconds of a window of `rows` rows at context `tier`; `shape` = (groups as run,
        i.e. padded to the shape bucket, most rows of a group) picks the shape's measured
        column when the profile has one (see _priced_as)."""
        log_tiers = [math.log2(t) for t in self.decode_tiers]
        i, j, w = _bracket(math.log2(tier), log_tiers)
        plan = self._priced_as(shape)
        if plan is not None and plan[0] == "column":
            return self._shape_time(plan[1], action, i, j, w)
        if plan is not None:
            return self._depth_time(shape, plan[1], action, i, j, w)
        table = self.decode_s[action]
        lo = _interp(rows, self.decode_rows, table[i])
        hi = _interp(rows, self.decode_rows, table[j])
        return lo + w * (hi - lo)

    def submit_time(self, shape: Optional[tuple[int, int]] = None) -> float:
        """host.submit_s for a window of `shape` (its shape's own figure when the profile has
        one, found as decode_time finds the shape's column)."""
        plan = self._priced_as(shape)
        if self.decode_shape_submit_s is not None and plan is not None and plan[0] == "column":
            return self.decode_shape_submit_s[plan[1]]
        return self.host_submit_s

    def _priced_as(self, shape: Optional[tuple[int, int]]):
        """How a window of `shape` is priced: ("column", k), the profile's shape k (its own, or
        the same-depth shape of the nearest group count); ("depth", found), carried along the
        depth (depth_extrapolated_shape's `found`); None, the rows table."""
        if shape is None or self.decode_shapes is None:
            return None
        name = f"{shape[0]}x{shape[1]}"
        if name not in self.decode_shapes:
            name = same_depth_shape(shape, self.decode_shapes)
        if name is not None:
            return "column", self.decode_shapes.index(name)
        found = depth_extrapolated_shape(shape, self.decode_shapes)
        return None if found is None else ("depth", found)

    def _shape_time(self, k: int, action: str, i: int, j: int, w: float) -> float:
        table = self.decode_shape_s[action]
        return table[i][k] + w * (table[j][k] - table[i][k])

    def unmeasured_depth(self, shape: Optional[tuple[int, int]]) -> bool:
        """Whether decode_time prices `shape` along its depth (the profile has shapes, none of
        this depth, and a family of two depths or more to extend)."""
        plan = self._priced_as(shape)
        return plan is not None and plan[0] == "depth"

    def _depth_time(self, shape: tuple[int, int], found, action: str, i: int, j: int,
                    w: float) -> float:
        (k1, d1), (k2, d2), deepest = found
        t1, t2 = self._shape_time(k1, action, i, j, w), self._shape_time(k2, action, i, j, w)
        t = t1 + (shape[1] - d1) * (t2 - t1) / (d2 - d1)
        if deepest is not None:  # past the measured depths: never below the deepest's time
            t = max(t, self._shape_time(deepest, action, i, j, w))
        return max(t, 0.0)

    def slot_factor(self, slots: int) -> float:
        """The window-time scale of an engine of `slots` slots (1 without a slot scale)."""
        if not self.decode_slot_scale:
            return 1.0
        xs = [math.log2(n) for n in self.decode_slot_scale["slots"]]
        ys = self.decode_slot_scale["scale"]
        i, j, w = _bracket(math.log2(max(1, slots)), xs)
        return ys[i] + w * (ys[j] - ys[i])

    def for_slots(self, slots: int) -> "CostProfile":
        """This profile as an engine of `slots` slots runs it: its window tables times
        slot_factor(slots), and no slot scale left (itself when it has none)."""
        if not self.decode_slot_scale:
            return self
        f = self.slot_factor(slots)
        p = copy.deepcopy(self)
        p.decode_s = {a: [[x * f for x in row] for row in t] for a, t in p.decode_s.items()}
        if p.decode_shape_s is not None:
            p.decode_shape_s = {a: [[x * f for x in row] for row in t]
                                for a, t in p.decode_shape_s.items()}
        p.decode_slot_scale = None
        p.window_slot_factor = f
        p.source = {**p.source, "for_slots": {"slots": slots, "scale": f}}
        return p

    # --- construction --------------------------------------------------------------------

    @classmethod
    def zero(cls) -> "CostProfile":
        """Everything takes no time (replay: only the order of events matters)."""
        zeros = [[0.0]]
        return cls(host_overhead_s=0.0, prefill_tokens=[1.0], prefill_s=[0.0],
                   decode_rows=[1.0], decode_tiers=[1.0],
                   decode_s={a: zeros for a in GRAPH_ACTIONS}, source={"kind": "zero"})

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA,
            "source": self.source,
            "host_overhead_s": self.host_overhead_s,
            "prefill": {"tokens": self.prefill_tokens, "s": self.prefill_s},
            "decode": {"rows": self.decode_rows, "tiers": self.decode_tiers,
                       **{a: self.decode_s[a] for a in GRAPH_ACTIONS}},
        }
        if self.prefill_table is not None:
            d["prefill"].update(tiers=self.prefill_tiers, table=self.prefill_table)
        if self.decode_shapes is not None:
            d["decode"].update(shapes=self.decode_shapes, shape_s=self.decode_shape_s)
            if self.decode_shape_submit_s is not None:
                d["decode"]["submit_s"] = self.decode_shape_submit_s
        if self.decode_slot_scale:
            d["decode"]["slot_scale"] = self.decode_slot_scale
        if (self.host_per_commit_s or self.host_per_admit_s or self.host_per_admit_burst_s
                or self.host_after_prefill_s or self.host_per_finish_s or self.host_sync_s
                or self.host_launch_s or self.host_submit_s):
            d["host"] = {"per_commit_s": self.host_per_commit_s,
                         "per_admit_s": self.host_per_admit_s,
                         "per_admit_burst_s": self.host_per_admit_burst_s,
                         "after_prefill_s": self.host_after_prefill_s,
                         "per_finish_s": self.host_per_finish_s, "sync_s": self.host_sync_s,
                         "launch_s": self.host_launch_s, "submit_s": self.host_submit_s}
        if self.acceptance is not None:
            d["acceptance"] = self.acceptance
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, d: Any, where: str = "cost profile") -> "CostProfile":
        def bad(msg: str) -> ProfileError:
            return ProfileError(f"{where}: {msg}")

        # Each value read by its key, so that a wrong shape or type names the field and the value.
        def need(obj: dict, key: str, name: str) -> Any:
            if key not in obj:
                raise bad(f"missing field {name!r}")
            return obj[key]

        def section(v: Any, name: str) -> dict:
            if not isinstance(v, dict):
                raise bad(f"{name} must be an object, got {_short(v)}")
            return v

        def num(v: Any, name: str) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(f"{name} must be a finite number, got {_short(v)}")
            return float(v)

        def nums(v: Any, name: str) -> list[float]:
            if not isinstance(v, list):
                raise bad(f"{name} must be a list of numbers, got {_short(v)}")
            return [num(x, name) for x in v]

        def table(v: Any, name: str) -> list[list[float]]:
            if not isinstance(v, list) or not all(isinstance(r, list) for r in v):
                raise bad(f"{name} must be a list of lists of numbers, got {_short(v)}")
            return [nums(r, name) for r in v]

        if not isinstance(d, dict):
            raise bad("must be a JSON object")
        if d.get("schema") != SCHEMA:
            raise bad(f"schema must be {SCHEMA!r}, got {d.get('schema')!r}")
        pre = section(need(d, "prefill", "prefill"), "prefill")
        dec = section(need(d, "decode", "decode"), "decode")
        acceptance = d.get("acceptance")
        if acceptance is not None:
            section(acceptance, "acceptance")
        source = section(d.get("source") or {}, "source")
        for key in ("trace_speeds", "trace_speeds_judged", "scaled"):  # (sim/spread.py reads them)
            if source.get(key) is not None:
                for kind, v in section(source[key], f"source.{key}").items():
                    if key == "scaled":
                        num(v, f"source.scaled.{kind}")
                    elif v is not None and not isinstance(v, list):
                        raise bad(f"source.{key}.{kind} must be a list, got {_short(v)}")
                    elif key == "trace_speeds" and v is not None:
                        nums(v, f"source.trace_speeds.{kind}")
        prof = cls(host_overhead_s=num(need(d, "host_overhead_s", "host_overhead_s"),
                                       "host_overhead_s"),
                   prefill_tokens=nums(need(pre, "tokens", "prefill.tokens"), "prefill.tokens"),
                   prefill_s=nums(need(pre, "s", "prefill.s"), "prefill.s"),
                   decode_rows=nums(need(dec, "rows", "decode.rows"), "decode.rows"),
                   decode_tiers=nums(need(dec, "tiers", "decode.tiers"), "decode.tiers"),
                   decode_s={a: table(need(dec, a, f"decode.{a}"), f"decode.{a}")
                             for a in GRAPH_ACTIONS},
                   acceptance=acceptance, source=source)
        if "table" in pre:
            prof.prefill_tiers = nums(need(pre, "tiers", "prefill.tiers"), "prefill.tiers")
            prof.prefill_table = table(pre["table"], "prefill.table")
        host_parts = section(d.get("host") or {}, "host")
        prof.host_per_commit_s = num(host_parts.get("per_commit_s", 0.0), "host.per_commit_s")
        prof.host_per_admit_s = num(host_parts.get("per_admit_s", 0.0), "host.per_admit_s")
        prof.host_per_admit_burst_s = num(host_parts.get("per_admit_burst_s", 0.0),
                                          "host.per_admit_burst_s")
        prof.host_after_prefill_s = num(host_parts.get("after_prefill_s", 0.0),
                                        "host.after_prefill_s")
        prof.host_per_finish_s = num(host_parts.get("per_finish_s", 0.0), "host.per_finish_s")
        prof.host_sync_s = num(host_parts.get("sync_s", 0.0), "host.sync_s")
        prof.host_launch_s = num(host_parts.get("launch_s", 0.0), "host.launch_s")
        prof.host_submit_s = num(host_parts.get("submit_s", 0.0), "host.submit_s")
        if "shapes" in dec:
            shapes = need(dec, "shapes", "decode.shapes")
            if not isinstance(shapes, list):
                raise bad(f"decode.shapes must be a list of 'NxG' shapes, got {_short(shapes)}")
            prof.decode_shapes = [str(x) for x in shapes]
            shape_s = section(need(dec, "shape_s", "decode.shape_s"), "decode.shape_s")
            prof.decode_shape_s = {a: table(need(shape_s, a, f"decode.shape_s.{a}"),
                                            f"decode.shape_s.{a}") for a in GRAPH_ACTIONS}
            if dec.get("submit_s") is not None:
                prof.decode_shape_submit_s = nums(dec["submit_s"], "decode.submit_s")
        if dec.get("slot_scale") is not None:
            sc = section(dec["slot_scale"], "decode.slot_scale")
            slots = nums(need(sc, "slots", "decode.slot_scale.slots"), "decode.slot_scale.slots")
            if not all(x.is_integer() for x in slots):
                raise bad(f"decode.slot_scale.slots must be whole slot counts, got {slots}")
            prof.decode_slot_scale = {"slots": [int(x) for x in slots],
                                      "scale": nums(need(sc, "scale", "decode.slot_scale.scale"),
                                                    "decode.slot_scale.scale")}
        prof._check(bad)
        return prof

    def _check(self, bad) -> None:
        def ascending_positive(name: str, xs: list[float]) -> None:
            if not xs or any(x <= 0 for x in xs) or any(b <= a for a, b in zip(xs, xs[1:])):
                raise bad(f"{name} must be ascending positive numbers, got {xs}")

        for name, v in (("host_overhead_s", self.host_overhead_s),
                        ("host.per_commit_s", self.host_per_commit_s),
                        ("host.per_admit_s", self.host_per_admit_s),
                        ("host.per_admit_burst_s", self.host_per_admit_burst_s),
                        ("host.after_prefill_s", self.host_after_prefill_s),
                        ("host.per_finish_s", self.host_per_finish_s),
                        ("host.sync_s", self.host_sync_s),
                        ("host.launch_s", self.host_launch_s),
                        ("host.submit_s", self.host_submit_s)):
            if v < 0:
                raise bad(f"{name} must be >= 0, got {v}")
        ascending_positive("prefill.tokens", self.prefill_tokens)
        ascending_positive("decode.rows", self.decode_rows)
        ascending_positive("decode.tiers", self.decode_tiers)
        if len(self.prefill_s) != len(self.prefill_tokens):
            raise bad("prefill.s must have one entry per prefill.tokens entry")
        for a in GRAPH_ACTIONS:
            t = self.decode_s[a]
            if len(t) != len(self.decode_tiers) or any(len(r) != len(self.decode_rows) for r in t):
                raise bad(f"decode.{a} must be [tiers][rows] = "
                          f"{len(self.decode_tiers)} x {len(self.decode_rows)}")
        if self.prefill_table is not None:
            ascending_positive("prefill.tiers", self.prefill_tiers)
            if len(self.prefill_table) != len(self.prefill_tiers) or any(
                    len(r) != len(self.prefill_tokens) for r in self.prefill_table):
                raise bad(f"prefill.table must be [tiers][tokens] = "
                          f"{len(self.prefill_tiers)} x {len(self.prefill_tokens)}")
            if any(x < 0 for r in self.prefill_table for x in r):
                raise bad("prefill.table has a negative time")
        if self.decode_shapes is not None:
            for name in self.decode_shapes:
                n, _, g = name.partition("x")
                if not (n.isdigit() and g.isdigit() and int(n) > 0 and int(g) > 0):
                    raise bad(f"decode.shapes entries must be 'NxG' (positive ints), got {name!r}")
            if len(set(self.decode_shapes)) != len(self.decode_shapes):
                raise bad("decode.shapes has a repeated shape")
            for a in GRAPH_ACTIONS:
                t = self.decode_shape_s[a]
                if len(t) != len(self.decode_tiers) or any(len(r) != len(self.decode_shapes)
                                                           for r in t):
                    raise bad(f"decode.shape_s.{a} must be [tiers][shapes] = "
                              f"{len(self.decode_tiers)} x {len(self.decode_shapes)}")
                if any(x < 0 for r in t for x in r):
                    raise bad(f"decode.shape_s.{a} has a negative time")
            sub = self.decode_shape_submit_s
            if sub is not None and (len(sub) != len(self.decode_shapes) or any(x < 0 for x in sub)):
                raise bad(f"decode.submit_s must be one time >= 0 per decode.shapes entry "
                          f"({len(self.decode_shapes)}), got {sub}")
        if self.decode_slot_scale is not None:
            sc = self.decode_slot_scale
            ascending_positive("decode.slot_scale.slots", sc["slots"])
            if len(sc["scale"]) != len(sc["slots"]) or any(x <= 0 for x in sc["scale"]):
                raise bad("decode.slot_scale.scale must be one positive number per "
                          f"decode.slot_scale.slots entry, got {sc['scale']}")
        for name, xs in [("prefill.s", self.prefill_s)] + [
                (f"decode.{a}", [x for r in self.decode_s[a] for x in r]) for a in GRAPH_ACTIONS]:
            if any(x < 0 for x in xs):
                raise bad(f"{name} has a negative time")

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        d = read_json(path, "cost profile", ProfileError)
        return cls.from_dict(d, where=str(Path(path)))
