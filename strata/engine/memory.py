"""The device-memory budget: weights, slot state, draft state and graphs above a reserve.

budget = device total - reserve - weights - slots x (KV + states + draft state) - graphs held.
On CUDA the budget is also capped by what the device reports free minus the reserve, so memory
taken outside strata's accounting (other processes) is respected too; when only that cap
refuses a graph, the caching allocator's unused blocks go back to the device first (`reclaim`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from strata.config import ConfigError

MIB = 2**20


@dataclass
class MemoryBudget:
    total_mib: float
    reserve_mib: float
    weights_mib: float
    slot_mib: float  # per slot, draft state included when drafting is on
    slots: int
    #: Device free MiB right now (CUDA), or None (CPU: arithmetic only).
    device_free_mib: Optional[Callable[[], float]] = None
    #: Graphs held outside the LRU cache (prompt-chunk graphs, one per bucket and tier).
    fixed_graphs_mib: float = 0.0
    #: Returns the caching allocator's unused blocks to the device (CUDA), or None. Captures
    #: leave them cached, where the device's free figure does not count them.
    reclaim: Optional[Callable[[], None]] = None
    #: The graphs held when a reclaim last left a graph short: not tried again (a sync and
    #: an emptied cache per eager window) until the graphs held change.
    _futile_at: Optional[float] = field(default=None, repr=False)

    def planned_mib(self) -> float:
        return self.weights_mib + self.slots * self.slot_mib + self.fixed_graphs_mib

    def _planned_room_mib(self, graphs_mib: float) -> float:
        """MiB a new graph may take by the plan's arithmetic alone."""
        return self.total_mib - self.reserve_mib - self.planned_mib() - graphs_mib

    def graph_budget_mib(self, graphs_mib: float) -> float:
        """MiB a new graph may still take."""
        budget = self._planned_room_mib(graphs_mib)
        if self.device_free_mib is not None:
            budget = min(budget, self.device_free_mib() - self.reserve_mib)
        return budget

    def graph_fits(self, mib: float, graphs_mib: float) -> bool:
        """A new graph of `mib` fits beside `graphs_mib` of graphs. When only the device's free
        figure stands in the way, the allocator's cache is emptied and it is read again."""
        if mib <= self.graph_budget_mib(graphs_mib):
            return True
        if (self.reclaim is None or mib > self._planned_room_mib(graphs_mib)
                or self._futile_at == graphs_mib):
            return False
        self.reclaim()
        fits = mib <= self.graph_budget_mib(graphs_mib)
        self._futile_at = None if fits else graphs_mib
        return fits

    def free_mib(self, graphs_mib: float) -> float:
        return self.total_mib - self.planned_mib() - graphs_mib

    def vram_event(self, graphs_mib: float) -> dict:
        """The `vram` trace event: free MiB (what CUDA reports; on the CPU the plan's
        arithmetic), the graphs held and the reserve."""
        free = self.device_free_mib() if self.device_free_mib is not None else self.free_mib(graphs_mib)
        return {"free_mib": round(free, 3), "graphs_mib": round(graphs_mib, 3),
                "reserve_mib": self.reserve_mib}

    def as_dict(self) -> dict:
        return {"total_mib": round(self.total_mib, 3), "weights_mib": round(self.weights_mib, 3),
                "slot_mib": round(self.slot_mib, 6), "slots": self.slots,
                "reserve_mib": self.reserve_mib}


def fit_slots(asked: int, total_mib: float, reserve_mib: float, weights_mib: float,
              slot_mib: float, graph_mib: float) -> int:
    """Slots that fit: floor((total - reserve - weights - one graph) / per-slot), capped at asked."""
    room = total_mib - reserve_mib - weights_mib - graph_mib
    if slot_mib <= 0:
        return asked
    return max(0, min(asked, math.floor(room / slot_mib)))


@dataclass
class MemoryPlan:
    """How many slots run and whether they draft, from the device size and the model."""
    budget: MemoryBudget
    drafting: bool
    #: Why drafting (so batch_mtp) is off, or None.
    off_reason: Optional[str]
    draft_mib: float
    #: Slots asked for.
    asked: int

    def describe(self) -> str:
        b = self.budget
        return (f"slots={b.slots} (asked {self.asked}): weights {b.weights_mib:.1f} MiB, "
                f"{b.slot_mib:.2f} MiB per slot (draft state {self.draft_mib:.2f}), reserve "
                f"{b.reserve_mib:.0f} MiB of {b.total_mib:.0f} MiB")


def plan_memory(*, asked: int, drafting: bool, off_reason: Optional[str], total_mib: float,
                reserve_mib: float, weights_mib: float, main_mib: float, draft_mib: float,
                graph_estimate_mib: float,
                device_free_mib: Optional[Callable[[], float]] = None,
                reclaim: Optional[Callable[[], None]] = None) -> MemoryPlan:
    """Fit `asked` slots of `main_mib` (+ `draft_mib` when drafting) above the reserve and the
    weights, with room for one graph. Drafting is dropped when its state costs slots; not even
    one slot fitting is a ConfigError naming the knobs that help."""
    n_with = fit_slots(asked, total_mib, reserve_mib, weights_mib, main_mib + draft_mib,
                       graph_estimate_mib)
    n_without = fit_slots(asked, total_mib, reserve_mib, weights_mib, main_mib, graph_estimate_mib)
    if drafting and n_with < min(asked, n_without):
        drafting = False
        off_reason = off_reason or (f"the per-slot draft state ({draft_mib:.1f} MiB) does not "
                                    f"fit beside {asked} slots")
    n_slots = n_with if drafting else n_without
    if n_slots < 1:
        raise ConfigError(
            f"engine.slots: not even one slot fits: device {total_mib:.0f} MiB - reserve "
            f"{reserve_mib:.0f} - weights {weights_mib:.1f} leaves too little for a slot of "
            f"{main_mib + draft_mib:.1f} MiB (lower engine.max_context or engine.vram_reserve_mib)")
    slot_mib = main_mib + (draft_mib if drafting else 0.0)
    budget = MemoryBudget(total_mib, reserve_mib, weights_mib, slot_mib, n_slots, device_free_mib,
                          reclaim=reclaim)
    return MemoryPlan(budget, drafting, off_reason, draft_mib, asked)


def plan_engine_memory(loaded, ecfg, device, max_context: int,
                       off_reason: Optional[str], expert_cache=None,
                       extra_weights_mib: float = 0.0) -> MemoryPlan:
    """plan_memory for a loaded model: its weights, and the per-lane state (KV, DeltaNet
    states, draft state) of `max_context` positions plus the window's spare rows.
    `extra_weights_mib`: device tensors the engine holds beside the model's parameters (the
    draft head of engine.draft_vocab), counted as weights.

    `expert_cache` (an ExpertCachePlan, engine.expert_cache_mib > 0): the routed experts leave
    the weights; everything else is planned first, and the cache's device slots must fit in
    what is left (else a ConfigError naming the numbers); they then count as weights."""
    import torch

    from strata.engine.device import allocator_reclaim, device_memory  # (they import MIB from here)
    from strata.model.state import DecodeState

    per = DecodeState.bytes_per_lane(loaded.args, max_context + ecfg.window_rows + 1,
                                     loaded.dtype, loaded.has_mtp)
    elem = torch.empty((), dtype=loaded.dtype).element_size()
    total_mib, free_fn = device_memory(device, ecfg.cpu_device_mib)
    weights_mib = (sum(p.numel() * p.element_size() for p in loaded.model.parameters()) / MIB
                   + extra_weights_mib)
    if expert_cache is not None:
        weights_mib -= expert_cache.routed_mib()
    plan = plan_memory(
        asked=ecfg.slots if ecfg.mode == "batch" else 1, drafting=off_reason is None,
        off_reason=off_reason, total_mib=total_mib, reserve_mib=float(ecfg.vram_reserve_mib),
        weights_mib=weights_mib,
        main_mib=per["main"] / MIB + (loaded.args.hidden_size * elem + 64) / MIB,
        draft_mib=per["draft"] / MIB, graph_estimate_mib=ecfg.graph_mib_estimate,
        device_free_mib=free_fn, reclaim=allocator_reclaim(device))
    if expert_cache is not None:
        b = plan.budget
        room = b.total_mib - b.reserve_mib - b.planned_mib() - ecfg.graph_mib_estimate
        need = expert_cache.resident_mib()
        if need > room:
            raise ConfigError(
                f"engine.expert_cache_mib={ecfg.expert_cache_mib}: the device cannot hold the "
                f"expert cache: {need:.1f} MiB of slots ({expert_cache.slots} per MoE layer x "
                f"{expert_cache.moe_layers} layers x {expert_cache.expert_bytes} bytes) beside "
                f"device {b.total_mib:.0f} MiB - reserve {b.reserve_mib:.0f} - weights without "
                f"routed experts {b.weights_mib:.1f} - {b.slots} slots x {b.slot_mib:.2f} - one "
                f"graph {ecfg.graph_mib_estimate:.0f} = {room:.1f} MiB (lower "
                f"engine.expert_cache_mib, engine.slots or engine.max_context)")
        b.weights_mib += need
    return plan
