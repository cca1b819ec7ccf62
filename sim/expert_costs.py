"""Device time of a forward when routed experts may miss the device (issue 17).

Two ways to price a window, `experts.cost` choosing:

- `profile`: the cost profile's window (measured with every expert resident) plus, per read
  of a missed expert, its bytes over the bus plus `miss_s`, less the missed experts' bytes
  over effective HBM bandwidth (a miss is read from host memory instead of the device).
- `bytes` (real scale, and cards with no profile): a window of `groups` groups of `depth`
  rows at full depth costs
      layers x per_layer_s
      + (other bytes + hits x expert_bytes) / (hbm_gb_s x hbm_efficiency)
      + reads x (expert_bytes / bus + miss_s)
      + layers x per_layer_launch_s x (ceil(rows / launch_rows) - 1)
  where other bytes = the dense weights, head, MTP, KV and state the window reads:
  base + per_group x groups + per_draft x max(0, depth - 2) (a lone slot's deeper window runs
  more MTP draft steps); with engine.draft_vocab=K each draft pass (one a drafting window, and
  its chain steps) reads (head_rows - K) x head_row_bytes fewer, and with engine.draft_head=fp8
  its rows in FP8 (half their bytes). per_layer_s, hbm_efficiency
  and the byte terms are fitted (`fit_window_bytes`) to the engine's full-depth FP8 windows on
  the H200 (docs/bench/s7/fp8_full.json and fp8_n8.json); a card keeps the per-layer cost and the
  efficiency and brings its own bandwidths. Windows of more than `launch_rows` rows (strata:
  16) run the FP8 linear and the router once per 16 rows and the gate/up kernel with x read
  from L2, which the bytes do not show: `per_layer_launch_s` prices each extra 16 rows per
  layer, fitted to such windows (`fit_launch_excess`). A capture or an eager window adds the
  profile's excess over a graph hit. A prompt chunk of T tokens costs what a 1-group window of
  T rows costs (a memory-bound estimate: fair for the short chunks of the studies, low for long
  ones).

A missed expert is read over the bus once per MoE kernel call that routes to it (`reads`: the
kernel takes at most `experts.call_rows` rows a call, strata's 32, so a 64-token prompt chunk
can read a missed expert twice; a decode window of up to 32 rows reads it once).

A swap's copy runs on a side stream after the window it follows; the next forward waits for
it, so what the host time before that forward does not hide is added to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from .experts import ExpertModelError, WindowExperts
from .files import read_json


@dataclass
class WindowBytesModel:
    """A full-depth window's device time from the bytes it reads (see the module doc)."""
    layers: int
    per_layer_s: float
    hbm_bytes_per_s: float
    other_base_bytes: float
    other_per_group_bytes: float
    other_per_draft_bytes: float
    expert_bytes: float
    #: engine.draft_vocab: the LM-head bytes each draft pass does not read (0: off)
    draft_head_saved_bytes: float = 0.0
    #: rows a launch of the row-count-bound kernels takes, and what each launch past a window's
    #: first adds per layer (0: no such term)
    launch_rows: int = 0
    per_layer_launch_s: float = 0.0

    def extra_launches(self, rows: int) -> int:
        """Launches past the first that a window of `rows` rows runs per layer."""
        return max(0, -(-rows // self.launch_rows) - 1) if self.launch_rows > 0 else 0

    def other_bytes(self, groups: int, depth: int) -> float:
        passes = 1 + max(0, depth - 2) if depth >= 2 else 0  # a window of 1-row groups drafts none
        return (self.other_base_bytes + self.other_per_group_bytes * groups
                + self.other_per_draft_bytes * max(0, depth - 2)
                - self.draft_head_saved_bytes * passes)

    def resident_s(self, groups: int, depth: int, resident_experts: int) -> float:
        """Seconds of the window's device-resident work: the fixed part and the HBM bytes."""
        return (self.layers * (self.per_layer_s
                               + self.per_layer_launch_s * self.extra_launches(groups * depth))
                + (self.other_bytes(groups, depth) + resident_experts * self.expert_bytes)
                / self.hbm_bytes_per_s)


@dataclass
class MissCost:
    """Seconds one missed expert adds: its bytes over the bus and a fixed cost."""
    expert_bytes: float
    bus_bytes_per_s: float
    miss_s: float

    def seconds(self, misses: int) -> float:
        return misses * (self.expert_bytes / self.bus_bytes_per_s + self.miss_s)


class ExpertCosts:
    """Prices forwards for the scheduler, given the expert draw of each."""

    def __init__(self, mode: str, miss: MissCost, hbm_bytes_per_s: float,
                 bytes_model: Optional[WindowBytesModel] = None, window_scale: float = 1.0,
                 prefill_scale: float = 1.0, prefill_expert_scale: Optional[float] = None,
                 prefill_row_s: float = 0.0):
        if mode not in ("profile", "bytes"):
            raise ExpertModelError(f"experts.cost: must be profile or bytes, got {mode!r}")
        if mode == "bytes" and bytes_model is None:
            raise ExpertModelError("experts.cost=bytes needs the window bytes model")
        self.mode = mode
        self.miss = miss
        self.hbm_bytes_per_s = hbm_bytes_per_s
        self.bytes_model = bytes_model
        #: bytes model: the speed factors of a prediction range's end (sim/spread.py scales
        #: the profile's windows and prompt chunks; the bytes model's device time follows).
        self.window_scale = window_scale
        self.prefill_scale = prefill_scale
        self.prefill_expert_scale = prefill_scale if prefill_expert_scale is None \
            else prefill_expert_scale
        self.prefill_row_s = prefill_row_s
        #: Seconds of swap copy still running when the last forward ended.
        self.pending_copy_s = 0.0

    def window_s(self, x: WindowExperts, groups: int, depth: int, profile_s: float,
                 profile_hit_s: float) -> float:
        """A window's device seconds; profile_s / profile_hit_s: the cost profile's time of
        this window with its graph action / as a graph hit (every expert resident)."""
        if self.mode == "bytes":
            base = (self.bytes_model.resident_s(groups, depth, x.hits) * self.window_scale
                    + max(0.0, profile_s - profile_hit_s))
        else:
            base = profile_s - x.misses * self.miss.expert_bytes / self.hbm_bytes_per_s
        return max(0.0, base) + self.miss.seconds(x.reads)

    def prefill_s(self, x: WindowExperts, rows: int, profile_s: float) -> float:
        """A prompt chunk's device seconds; rows: the rows it computes (its slots' chunks, each
        padded to the chunk's bucket)."""
        if self.mode == "bytes":
            experts_s = x.hits * self.bytes_model.expert_bytes / self.bytes_model.hbm_bytes_per_s
            return (self.bytes_model.resident_s(1, 1, 0) * self.prefill_scale
                    + experts_s * self.prefill_expert_scale + rows * self.prefill_row_s
                    + self.miss.seconds(x.reads))
        return max(0.0, profile_s - x.misses * self.miss.expert_bytes / self.hbm_bytes_per_s) \
            + self.miss.seconds(x.reads)

    def swap_started(self, swap_bytes: int) -> None:
        self.pending_copy_s += swap_bytes / self.miss.bus_bytes_per_s

    def wait_for_copy(self, host_s: float, overlapped: bool = False) -> float:
        """Seconds the next forward waits for the swap copy beyond `host_s` of host time; in an
        overlapped loop the copy is queued behind the window in flight (strata ExpertCache._copy)
        and the next forward waits for all of it."""
        wait = self.pending_copy_s if overlapped else max(0.0, self.pending_copy_s - host_s)
        self.pending_copy_s = 0.0
        return wait


# --- fitting the bytes model -----------------------------------------------------------------

def bench_windows(paths: Sequence[str | Path], skip: Sequence[str] = ("w16",)) -> list[dict]:
    """The window rows of scripts/bench_engine.py JSON files (summary -> config@N -> windows:
    groups, rows, windows, mean_ms, bytes), leaving out configurations whose name holds a
    `skip` substring."""
    out = []
    for path in paths:
        p = Path(path)
        d = read_json(p, "bench JSON", ExpertModelError)
        for name, cell in (d.get("summary") or {}).items():
            if any(s in name for s in skip):
                continue
            for w in cell.get("windows", []):
                try:
                    out.append({"config": name, "groups": int(w["groups"]), "depth": int(w["rows"]),
                                "count": int(w["windows"]), "s": float(w["mean_ms"]) / 1e3,
                                "expert_bytes_read": float(w["bytes"]["experts"]),
                                "distinct": float(w["bytes"]["distinct_experts"]),
                                "other_bytes": float(w["bytes"]["total"]) - float(w["bytes"]["experts"])})
                except (KeyError, TypeError, ValueError) as e:
                    raise ExpertModelError(f"{p}: {name}: malformed window row ({e})") from None
    if not out:
        raise ExpertModelError(f"no window rows in {[str(p) for p in paths]}")
    return out


def fit_window_bytes(rows: list[dict], layers: int, moe_layers: int, expert_bytes: float,
                     hbm_gb_s: float, weight_cap: int = 10) -> tuple[WindowBytesModel, dict]:
    """Least squares of t = fixed + (other + experts) bytes / bandwidth over the measured
    windows (each weighted by its window count, capped at `weight_cap`: a shape seen in one
    or two windows is noisier); then the other bytes as base + per_group x groups + per_draft
    x max(0, depth - 2). Returns the model and a report (efficiency against `hbm_gb_s`, each
    row's fitted time and error)."""
    t = np.array([r["s"] for r in rows])
    total = np.array([r["other_bytes"] + r["expert_bytes_read"] for r in rows])
    w = np.sqrt(np.minimum([r["count"] for r in rows], weight_cap).astype(float))
    a = np.stack([np.ones_like(total), total], axis=1)
    (fixed, inv_bw), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    if inv_bw <= 0 or fixed < 0:
        raise ExpertModelError(f"window bytes fit is not physical: fixed {fixed} s, "
                               f"1/bandwidth {inv_bw} s/B")
    b = np.array([[1.0, r["groups"], max(0, r["depth"] - 2)] for r in rows])
    other = np.array([r["other_bytes"] for r in rows])
    (base, per_group, per_draft), *_ = np.linalg.lstsq(b, other, rcond=None)
    model = WindowBytesModel(layers=layers, per_layer_s=float(fixed) / layers,
                             hbm_bytes_per_s=1.0 / float(inv_bw),
                             other_base_bytes=float(base), other_per_group_bytes=float(per_group),
                             other_per_draft_bytes=float(per_draft), expert_bytes=expert_bytes)
    fitted = []
    for r in rows:
        # the model as the simulator runs it: distinct experts per layer x MoE layers
        s = model.resident_s(r["groups"], r["depth"], round(r["distinct"] * moe_layers))
        fitted.append({**{k: r[k] for k in ("config", "groups", "depth", "count")},
                       "measured_ms": r["s"] * 1e3, "model_ms": s * 1e3,
                       "error": s / r["s"] - 1.0})
    report = {"per_layer_s": model.per_layer_s, "hbm_gb_s_effective": model.hbm_bytes_per_s / 1e9,
              "hbm_efficiency": model.hbm_bytes_per_s / (hbm_gb_s * 1e9),
              "other_base_bytes": base, "other_per_group_bytes": per_group,
              "other_per_draft_bytes": per_draft, "rows": fitted}
    return model, report


def bytes_model_from_config(x: Any, memory: Any, draft_vocab: int = 0,
                            draft_fp8: bool = False) -> WindowBytesModel:
    """The bytes model of an `experts` config on the `memory` group's card; `draft_vocab`:
    engine.draft_vocab (0: drafts read the whole LM head); `draft_fp8`: engine.draft_head=fp8,
    the drafts' rows read in FP8 (a byte a weight of experts.head_row_bytes' bf16 row, and a
    float32 scale per 128 x 128 block, each byte at experts.fp8_head_byte_cost bf16 bytes'
    time)."""
    saved = 0.0
    if draft_vocab > 0 or draft_fp8:
        knob = "engine.draft_vocab" if draft_vocab > 0 else "engine.draft_head"
        if x.head_rows < 1 or x.head_row_bytes <= 0:
            raise ExpertModelError(f"{knob}: the bytes model prices it from the LM "
                                   "head's rows and their bytes: set experts.head_rows and "
                                   "experts.head_row_bytes")
        if draft_vocab > x.head_rows:
            raise ExpertModelError(f"engine.draft_vocab: {draft_vocab} exceeds the LM head's "
                                   f"rows (experts.head_rows={x.head_rows})")
        rows = draft_vocab or x.head_rows
        row_bytes = float(x.head_row_bytes) / 2 * (1 + 4 / 128**2) * float(
            x.fp8_head_byte_cost) if draft_fp8 else float(x.head_row_bytes)
        saved = x.head_rows * float(x.head_row_bytes) - rows * row_bytes
    return WindowBytesModel(layers=int(x.layers), per_layer_s=float(x.per_layer_s),
                            hbm_bytes_per_s=float(memory.hbm_gb_s) * 1e9 * float(x.hbm_efficiency),
                            other_base_bytes=float(x.other_base_bytes),
                            other_per_group_bytes=float(x.other_per_group_bytes),
                            other_per_draft_bytes=float(x.other_per_draft_bytes),
                            expert_bytes=float(x.expert_bytes), draft_head_saved_bytes=saved,
                            launch_rows=int(x.launch_rows),
                            per_layer_launch_s=float(x.per_layer_launch_s))


def fit_launch_excess(rows: list[dict], layers: int, moe_layers: int, expert_bytes: float,
                      hbm_gb_s: float, launch_rows: int = 16, weight_cap: int = 10
                      ) -> tuple[WindowBytesModel, dict]:
    """The bytes model fitted to the windows of at most `launch_rows` rows (fit_window_bytes),
    then per_layer_launch_s: the wider windows' time beyond that model per layer and per extra
    launch, their mean weighted as fit_window_bytes weights (window count capped). Returns the
    model with the term and a report (each wide row's excess)."""
    narrow = [r for r in rows if r["groups"] * r["depth"] <= launch_rows]
    wide = [r for r in rows if r["groups"] * r["depth"] > launch_rows]
    if not narrow or not wide:
        raise ExpertModelError(f"the launch fit needs windows of at most {launch_rows} rows and "
                               f"wider ones: got {len(narrow)} and {len(wide)}")
    model, report = fit_window_bytes(narrow, layers, moe_layers, expert_bytes, hbm_gb_s,
                                     weight_cap)
    model.launch_rows = launch_rows
    per, weights, out = [], [], []
    for r in wide:
        base = model.resident_s(r["groups"], r["depth"], round(r["distinct"] * moe_layers))
        extra = model.extra_launches(r["groups"] * r["depth"])
        per.append((r["s"] - base) / (layers * extra))
        weights.append(min(r["count"], weight_cap))
        out.append({**{k: r[k] for k in ("config", "groups", "depth", "count")},
                    "measured_ms": r["s"] * 1e3, "narrow_model_ms": base * 1e3,
                    "per_layer_launch_us": per[-1] * 1e6})
    model.per_layer_launch_s = max(0.0, float(np.average(per, weights=weights)))
    report = {**report, "per_layer_launch_s": model.per_layer_launch_s, "wide_rows": out}
    return model, report

