"""The expert cache (engine.expert_cache_mib > 0): routed experts in host memory, a per-layer
set of device slots holding the cached ones.

Placement. Dense weights, shared experts, routers, the LM head, the MTP layer (its experts
too), KV, DeltaNet state and graphs are planned first (strata/engine/memory.py); then every
decoder MoE layer gets the same number of device slots, as many as engine.expert_cache_mib
holds (at most the layer's experts). The full routed stacks of every layer move to host memory
(pinned on CUDA: the host store; the FP8 scales of every expert stay on the device), and a
device table slot_of (layers, E) int32 says which slot holds each expert (-1: not resident).
A folded shared expert sits in a slot of its own after the routed ones, always resident.

Misses. ops.moe_experts reads a resident expert from its slot and a missing one from the host
store (on a GPU through its device-visible address, over the bus, inside the kernel), so the
captured window graphs stay valid whichever experts miss and the tokens are those of an engine
with every expert resident.

Counting (capturable, inside the MoE kernel). Inside a decode window each cached layer hands
ops.moe_experts the cache's `routed` (layers, E) (cumulative routed selections), its
`window_state` (the window's hits and misses, then a seen flag per (layer, expert)) and its own
layer index (a device tensor, so one compiled region serves every layer of a kind); the gate/up
kernel adds each distinct expert's rows to `routed` and counts it once per window (each distinct
(layer, expert) pair: a hit when the expert was resident at the window's start). A window so
adds one zeroing op (window_state), and after it (outside any graph: ExpertCache.after_launch)
one copy of (hits, misses) into pinned host memory, read after the window's own sync: nothing
per layer beyond the MoE kernels. Prompt chunks are not counted (they run outside begin_window /
end_window).

Fill and adapt. The first fill is each layer's most-routed experts of a routing profile
(engine.expert_profile, scripts/profile_routing.py's JSON), or the lowest expert ids. Every
engine.expert_adapt_every windows, per layer, the most-routed missing expert replaces the
least-routed resident one when its decayed count is higher (counts decay by DECAY per
adaptation). The copy runs on a side stream and the next window waits on its event, so no
window ever reads a torn expert.

engine.overlap. Window t+1 is launched before window t is read, so each launched window's
counts go to a pinned buffer of its own (two, alternating: at most one window is in flight
while another is read), copied in stream order right after it; the routed counts of an
adaptation are those of the windows launched up to the one that ends its period (copied out and
zeroed after it, in stream order), so overlap on or off the same windows decide a swap. The
swap decided when window t is read is ordered on the streams after every window launched so
far: window t+1, in flight, reads the slots as they were (and counts its hits against them), and
window t+2 onwards reads the new ones. On the CPU window t+1 has already run by then.

Reset. ExpertCache.reset() returns a cache to its first fill with its adaptation state
cleared, between windows (it refuses inside one, or while a launched window is unread), so a
benchmark can time every cell from the same state (scripts/bench_expert_cache.py); the moved
slots are copied back like a swap's, in place.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from strata.config import ConfigError
from strata.model.qwen3_next import decoder_moe_layers as moe_layers

MIB = 2**20
#: Decayed routing counts: each adaptation multiplies the old counts by this before adding the
#: windows' since the last one, so popularity a few adaptations old fades.
DECAY = 0.75


def expert_bytes(experts: nn.Module) -> int:
    """Bytes of one routed expert: gate/up and down weights, and their FP8 scales."""
    parts = [experts.w_gate_up, experts.w_down]
    if experts.gu_scale is not None:
        parts += [experts.gu_scale, experts.down_scale]
    return int(sum(p[0].numel() * p.element_size() for p in parts))


def scale_bytes(experts: nn.Module) -> int:
    """Bytes of one routed expert's FP8 block scales (0 for float experts). Every expert's
    scales stay on the device (about 0.03% of an FP8 expert), so a miss reads only its
    weights over the bus, in large requests."""
    if experts.gu_scale is None:
        return 0
    return int(sum(p[0].numel() * p.element_size() for p in (experts.gu_scale, experts.down_scale)))


@dataclass
class ExpertCachePlan:
    """How many device slots each MoE layer gets, and the sizes the trace reports."""
    slots: int
    experts: int
    expert_bytes: int
    layers: list[int]
    cache_mib: float
    #: Bytes of one expert's FP8 scales (part of expert_bytes), resident for every expert.
    scale_bytes: int = 0

    @property
    def moe_layers(self) -> int:
        return len(self.layers)

    def routed_mib(self) -> float:
        """Every routed expert of the decoder's MoE layers (what moves to the host store)."""
        return self.moe_layers * self.experts * self.expert_bytes / MIB

    def resident_mib(self) -> float:
        """The device slots, and every expert's scales."""
        weights = self.expert_bytes - self.scale_bytes
        return self.moe_layers * (self.slots * weights + self.experts * self.scale_bytes) / MIB

    def memory_fields(self) -> dict:
        """The `config` trace event's memory fields of the cache (COMMON contract)."""
        return {"expert_slots": self.slots, "experts": self.experts,
                "expert_bytes": self.expert_bytes, "moe_layers": self.moe_layers}

    def describe(self, profile: Optional[str]) -> str:
        """The engine's log line for the cache; `profile`: engine.expert_profile."""
        return (f"expert cache: {self.slots} of {self.experts} routed experts resident in each "
                f"of {self.moe_layers} MoE layers ({self.resident_mib():.1f} MiB of slots, the "
                f"rest {self.routed_mib() - self.resident_mib():.1f} MiB in host memory); "
                f"first fill {'from ' + profile if profile else 'lowest ids'}")


def plan_expert_cache(model, cache_mib: float) -> ExpertCachePlan:
    """Slots per MoE layer that engine.expert_cache_mib holds; a budget or a model the cache
    cannot serve is a ConfigError naming the numbers."""
    layers = moe_layers(model)
    if not layers:
        raise ConfigError("engine.expert_cache_mib: this model has no MoE layers to cache")
    for i, moe in layers:
        if moe.w_in is not None:
            raise ConfigError(
                f"engine.expert_cache_mib: MoE layer {i} runs dense (its {moe.experts.w_gate_up.shape[0]} "
                f"experts <= model.moe_dense_experts={moe.dense_experts}), reading every expert; "
                f"set model.moe_dense_experts=0 to cache its experts")
    moe0 = layers[0][1]
    n_exp = int(moe0.experts.w_gate_up.shape[0])
    eb, sb = expert_bytes(moe0.experts), scale_bytes(moe0.experts)
    per_slot = len(layers) * (eb - sb)
    scales = len(layers) * n_exp * sb
    slots = min(n_exp, math.floor((cache_mib * MIB - scales) / per_slot))
    if slots < 1:
        raise ConfigError(
            f"engine.expert_cache_mib={cache_mib}: holds no routed expert per MoE layer: one "
            f"slot in each of the {len(layers)} MoE layers takes {per_slot / MIB:.3f} MiB "
            f"({eb - sb} bytes per expert)"
            + (f", beside every expert's scales ({scales / MIB:.3f} MiB)" if sb else ""))
    return ExpertCachePlan(slots, n_exp, eb, [i for i, _ in layers], float(cache_mib), sb)


def read_profile(path: str, plan: ExpertCachePlan) -> np.ndarray:
    """Per-layer routed counts (moe_layers, E) of a routing profile, for this model's MoE layers."""
    p = Path(path)
    try:
        prof = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"engine.expert_profile: cannot read {p}: {e}") from None
    for key in ("layers", "experts", "counts"):
        if key not in prof:
            raise ConfigError(f"engine.expert_profile: {p} has no {key!r} (not a routing profile "
                              f"of scripts/profile_routing.py)")
    if int(prof["experts"]) != plan.experts:
        raise ConfigError(f"engine.expert_profile: {p} profiles {prof['experts']} experts per "
                          f"layer, this model has {plan.experts}")
    rows = {int(li): c for li, c in zip(prof["layers"], prof["counts"])}
    missing = [li for li in plan.layers if li not in rows]
    if missing:
        raise ConfigError(f"engine.expert_profile: {p} has no counts for MoE layers {missing}")
    counts = np.array([rows[li] for li in plan.layers], dtype=np.float64)
    if counts.shape != (plan.moe_layers, plan.experts):
        raise ConfigError(f"engine.expert_profile: {p}: counts must be {plan.experts} numbers per "
                          f"layer, got shape {counts.shape}")
    return counts


def top_experts(counts: np.ndarray, slots: int) -> np.ndarray:
    """(layers, slots) expert ids: each layer's most-counted, ties to the lower id."""
    return np.stack([np.sort(np.argsort(-row, kind="stable")[:slots]) for row in counts])


@dataclass
class WindowCounts:
    """One launched window's counts on their way to host memory (ExpertCache.after_launch),
    readable once the window has synced."""
    #: (2,) int32, pinned on CUDA: the window's hits and misses.
    stats: torch.Tensor
    #: (layers, E) float32, pinned on CUDA: the routed counts of the adapt period this window
    #: ends (an adaptation is due when it is read), else None.
    routed: Optional[torch.Tensor] = None


class LayerCache:
    """One MoE layer's view of the cache: what its Experts module hands ops.moe_experts."""

    def __init__(self, slot_of: torch.Tensor, routed: torch.Tensor, window_state: torch.Tensor,
                 layer: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 gu_scale: Optional[torch.Tensor], down_scale: Optional[torch.Tensor],
                 host: tuple):
        self.slot_of = slot_of          # (E [+1 shared],) int32, device
        self.routed = routed            # (layers, E) float32, device: the cache's, every layer
        self.window_state = window_state  # (2 + layers * E,) int32, device: the cache's
        self.layer = layer              # (1,) int32, device: this layer's row in both
        self.gate_up, self.down = gate_up, down          # device slots (S [+1], ...)
        self.gu_scale, self.down_scale = gu_scale, down_scale
        self.host_gate_up, self.host_down, self.host_gu_scale, self.host_down_scale = host
        #: True inside a decode window (ExpertCache.begin_window .. end_window): the kernel counts.
        self.counting = False

    def counting_args(self) -> dict:
        """ops.moe_experts' counting arguments inside a decode window, else none."""
        if not self.counting:
            return {}
        return {"routed_counts": self.routed, "window_state": self.window_state,
                "count_layer": self.layer}


class ExpertCache:
    def __init__(self, model, plan: ExpertCachePlan, device: torch.device,
                 profile: Optional[str] = None, adapt_every: int = 0):
        """`profile`: a routing profile choosing the first fill (None: the lowest ids);
        `adapt_every`: windows between adaptations (0: never)."""
        self.plan, self.device, self.adapt_every = plan, device, int(adapt_every)
        if device.type == "cuda":
            from strata.kernels import ops

            if ops.implementations()["moe_experts"] == "torch":
                raise ConfigError("engine.expert_cache_mib: on a GPU the cache needs the cyext "
                                  "MoE kernel (backend=auto, cuda or hip, with strata_cuda built): "
                                  "the torch reference cannot read host memory inside a graph")
        L, E, S = plan.moe_layers, plan.experts, plan.slots
        pin = device.type == "cuda"
        if profile is not None:
            first = top_experts(read_profile(profile, plan), S)
        else:
            first = np.arange(S)[None].repeat(L, 0)
        #: (L, S) the expert each slot held at the start: what reset() returns to.
        self.first_fill = first.astype(np.int64)
        # Host-side truth: which expert each slot holds, and the slot of each expert.
        self.slot_expert = self.first_fill.copy()                      # (L, S)
        self.host_slot_of = np.full((L, E + 1), -1, dtype=np.int32)    # column E: a folded shared
        self._table_from_slots()
        self.slot_of = torch.from_numpy(self.host_slot_of.copy()).to(device)
        self._slot_of_staging = torch.empty(self.host_slot_of.shape, dtype=torch.int32,
                                            pin_memory=pin)
        self.routed = torch.zeros(L, E, dtype=torch.float32, device=device)
        # One buffer, zeroed once per window: the window's (hits, misses), then the seen flags
        # of every (layer, expert).
        self.window_state = torch.zeros(2 + L * E, dtype=torch.int32, device=device)
        # Host copies of a launched window's counts, two of each, alternating (after_launch):
        # under engine.overlap the next window's copy is queued before this one is read.
        self._stats_host = [torch.zeros(2, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._routed_host = [torch.zeros(L, E, dtype=torch.float32, pin_memory=pin)
                             for _ in range(2)]
        self._host_at = 0
        #: Windows launched since the start (or the warm-up): what decides an adaptation is due.
        self.launched = 0
        #: Windows launched (after_launch) and not yet read (after_window): under
        #: engine.overlap one may be in flight, and reset() must wait for it.
        self.unread = 0
        #: The last swap's slot-table copy (CUDA), which must finish before its pinned staging
        #: buffer is written again.
        self._table_copied: Optional[torch.cuda.Event] = None
        self.decayed = np.zeros((L, E), dtype=np.float64)
        self.layers: list[LayerCache] = []
        self.host: list[tuple] = []
        for li, (_, moe) in enumerate(moe_layers(model)):
            self.layers.append(self._install(li, moe.experts, pin))
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.hits = self.misses = self.swaps = self.swap_bytes = 0
        self.windows = 0

    # ---- placement ----------------------------------------------------------------------------
    def _install(self, li: int, experts: nn.Module, pin: bool) -> LayerCache:
        """Move layer li's routed experts to the host store and its residents to device slots;
        a folded shared expert takes one more slot after them (slot_of[E] = S). A layer that an
        earlier cache holds already (another engine on the same loaded model) is re-planned
        from that cache's host store."""
        E, S = self.plan.experts, self.plan.slots
        fp8 = experts.gu_scale is not None
        folded = experts.shared_id is not None
        prev = experts.cache
        if prev is not None:
            routed = [prev.host_gate_up, prev.host_down, prev.host_gu_scale, prev.host_down_scale]
            shared = [prev.gate_up, prev.down, prev.gu_scale, prev.down_scale]
        elif folded:
            routed = list(experts.stacks)
            shared = list(experts.stacks)
        else:
            routed = [experts.w_gate_up, experts.w_down, experts.gu_scale, experts.down_scale]
            shared = [None] * 4
        n = 4 if fp8 else 2
        host, slots = [], []
        chosen = torch.from_numpy(self.slot_expert[li])
        for j in range(n):
            src = routed[j].detach()
            if j >= 2:  # FP8 scales: every expert's stay on the device (scale_bytes)
                h = src if prev is not None else src[:E].clone()
            elif prev is not None and src.device.type == "cpu" and (src.is_pinned() or not pin):
                h = src  # the earlier cache's host store, as it is
            else:
                h = torch.empty((E, *src.shape[1:]), dtype=src.dtype, pin_memory=pin)
                h.copy_(src[:E])
            d = torch.empty((S + folded, *src.shape[1:]), dtype=src.dtype, device=self.device)
            d[:S].copy_(h[chosen])
            if folded:
                d[S].copy_(shared[j][-1])
            host.append(h)
            slots.append(d)
        names = ("w_gate_up", "w_down", "gu_scale", "down_scale")
        for name, h in zip(names, host):  # the module keeps the host store (shape (E, ...))
            setattr(experts, name, nn.Parameter(h, requires_grad=False))
        experts.stacks = ()
        while len(host) < 4:
            host.append(None)
            slots.append(None)
        if folded:
            _repoint_shared(experts, [t for t in slots if t is not None])
            self.host_slot_of[li, E] = S
            self.slot_of[li, E] = S
        self.host.append(tuple(host))
        layer = torch.full((1,), li, dtype=torch.int32, device=self.device)
        cache = LayerCache(self.slot_of[li], self.routed, self.window_state, layer, slots[0],
                           slots[1], slots[2], slots[3], tuple(host))
        experts.cache = cache
        return cache

    def _table_from_slots(self) -> None:
        """host_slot_of's routed columns from slot_expert (a folded shared expert's column
        E stays)."""
        E, S = self.plan.experts, self.plan.slots
        self.host_slot_of[:, :E] = -1
        for li, experts in enumerate(self.slot_expert):
            self.host_slot_of[li, experts] = np.arange(S, dtype=np.int32)

    def resident(self) -> np.ndarray:
        """(layers, E) bool: the resident set now."""
        return self.host_slot_of[:, :self.plan.experts] >= 0

    # ---- inside a window (device, capturable) ---------------------------------------------------
    def begin_window(self) -> None:
        """Zero the window's seen flags and (hits, misses); the MoE kernels count from here."""
        self.window_state.zero_()
        for lc in self.layers:
            lc.counting = True

    def end_window(self) -> None:
        """The MoE kernels stop counting (the window's counts go to the host in after_launch)."""
        for lc in self.layers:
            lc.counting = False

    # ---- between windows (host) ---------------------------------------------------------------
    def after_launch(self) -> WindowCounts:
        """Right after a decode window is queued (outside its graph, before anything that marks
        its end): copy its hits and misses to a host buffer of its own and, when it ends an
        adapt period, the period's routed counts too (then zero them), all in stream order, so
        that a window launched before this one is read counts apart."""
        self.launched += 1
        self.unread += 1
        self._host_at ^= 1
        stats = self._stats_host[self._host_at]
        stats.copy_(self.window_state[:2], non_blocking=True)
        routed = None
        if self.adapt_every and self.launched % self.adapt_every == 0:
            routed = self._routed_host[self._host_at]
            routed.copy_(self.routed, non_blocking=True)
            self.routed.zero_()
        return WindowCounts(stats, routed)

    def after_window(self, counts: WindowCounts) -> tuple[int, int, Optional[tuple[int, int]]]:
        """Read a window's counts (after_launch's; the window has synced) and adapt when it
        ended an adapt period; returns hits, misses and (experts, bytes) of a swap or None."""
        hits, misses = (int(v) for v in counts.stats.tolist())
        self.unread -= 1
        self.hits += hits
        self.misses += misses
        self.windows += 1
        swap = None
        if counts.routed is not None:
            swap = self.adapt(counts.routed.numpy().astype(np.float64))
        return hits, misses, swap

    def plan_swaps(self, counts: np.ndarray) -> list[tuple[int, int, int]]:
        """Decay, add `counts` (layers, E), and pick per layer (layer, evicted, admitted): the
        most-routed missing expert for the least-routed resident, when it is routed more."""
        self.decayed = self.decayed * DECAY + counts
        res = self.resident()
        out = []
        for li in range(self.plan.moe_layers):
            if res[li].all():
                continue
            d = self.decayed[li]
            missing = np.flatnonzero(~res[li])
            resident = np.flatnonzero(res[li])
            m = int(missing[np.argmax(d[missing])])
            v = int(resident[np.argmin(d[resident])])
            if d[m] > d[v]:
                out.append((li, v, m))
        return out

    def adapt(self, counts: Optional[np.ndarray] = None) -> Optional[tuple[int, int]]:
        """One adaptation from `counts` (layers, E), the period's routed counts (None: read and
        zero the device's now, which waits for every window launched): swap per plan_swaps,
        copying on a side stream that the next window launched waits on. Returns (experts
        copied, bytes) or None when nothing moved."""
        if counts is None:
            counts = self.routed.cpu().numpy().astype(np.float64)
            self.routed.zero_()
        swaps = self.plan_swaps(counts)
        if not swaps:
            return None
        moves = []
        for li, v, m in swaps:
            slot = int(self.host_slot_of[li, v])
            self.host_slot_of[li, v] = -1
            self.host_slot_of[li, m] = slot
            self.slot_expert[li, slot] = m
            moves.append((li, slot, m))
        self._copy(moves)
        n, b = len(swaps), len(swaps) * self.plan.expert_bytes
        self.swaps += n
        self.swap_bytes += b
        return n, b

    def _copy(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy each (layer, slot, expert) of `moves` from the host store into its slot, then
        host_slot_of into the device slot table, in place (captured graphs keep their
        addresses)."""
        def run() -> None:
            for li, slot, m in moves:
                c = self.layers[li]
                for dev, host in zip((c.gate_up, c.down, c.gu_scale, c.down_scale), self.host[li]):
                    if dev is not None:
                        dev[slot].copy_(host[m], non_blocking=True)
            if self._table_copied is not None:  # the last swap's copy still reads the staging
                self._table_copied.synchronize()
            self._slot_of_staging.copy_(torch.from_numpy(self.host_slot_of))
            self.slot_of.copy_(self._slot_of_staging, non_blocking=True)

        if self.side is None:
            run()
            return
        main = torch.cuda.current_stream(self.device)
        # After every window queued so far: under engine.overlap one is still in flight, and
        # it reads the evicted slots and the old slot table.
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            run()
            done = torch.cuda.Event()
            done.record(self.side)
        self._table_copied = done
        main.wait_event(done)  # the next window launched reads whole experts only

    def reset_counts(self) -> None:
        """Forget routing seen so far (the warm-up's scratch-lane windows, launched and never
        read): adapt periods count windows from here."""
        self.routed.zero_()
        self.launched = self.unread = 0

    def reset(self) -> int:
        """Back to the first fill, as a freshly built cache: each slot holds the expert it
        held at the start (the routing profile's or the lowest ids; the slots that moved are
        copied back from the host store as a swap's are, on the side stream, in place, so
        captured window graphs stay valid) and the adaptation state starts over (routed and
        decayed counts, the window state, the adapt period's window count). The run's totals
        (hits, misses, swaps, windows) keep counting: they are the engine's reports. Between
        windows only: inside a decode window, or with a launched window not yet read
        (engine.overlap), it raises RuntimeError, since that window's counts and the swap they
        decide belong to the state being dropped. Returns the experts copied back."""
        if any(lc.counting for lc in self.layers):
            raise RuntimeError("ExpertCache.reset inside a decode window (begin_window .. "
                               "end_window)")
        if self.unread:
            raise RuntimeError(f"ExpertCache.reset with {self.unread} launched window(s) not "
                               f"read yet (after_window): finish the engine's work first")
        moves = [(int(li), int(slot), int(self.first_fill[li, slot]))
                 for li, slot in np.argwhere(self.slot_expert != self.first_fill)]
        self.slot_expert[:] = self.first_fill
        self._table_from_slots()
        if moves:
            self._copy(moves)
        self.reset_counts()
        self.window_state.zero_()
        self.decayed[:] = 0.0
        self._host_at = 0
        return len(moves)

    # ---- reporting ----------------------------------------------------------------------------
    def hit_rate(self) -> Optional[float]:
        total = self.hits + self.misses
        return self.hits / total if total else None

    def stats_fields(self) -> dict:
        return {"expert_hits": self.hits, "expert_misses": self.misses,
                "expert_swaps": self.swaps, "expert_swap_bytes": self.swap_bytes}


def _repoint_shared(experts: nn.Module, slots: list[torch.Tensor]) -> None:
    """A folded shared expert's parameters become views of its slot (the last), so the old
    (E+1) stacks are freed."""
    shared = experts.shared_modules
    fp8 = len(slots) > 2
    attr = "weight"
    pairs = [(slots[0], shared[:2], attr), (slots[1], shared[2:], attr)]
    if fp8:
        pairs += [(slots[2], shared[:2], "weight_scale_inv"), (slots[3], shared[2:], "weight_scale_inv")]
    for stack, mods, a in pairs:
        row = 0
        for m in mods:
            rows = getattr(m, a).shape[0]
            setattr(m, a, nn.Parameter(stack[-1, row:row + rows], requires_grad=False))
            row += rows
