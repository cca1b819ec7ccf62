"""The device-memory budget: weights, slot state, draft state and graphs above a reserve.

budget = device total - reserve - weights - slots x (KV + states + draft state) - graphs held.
On CUDA the budget is also capped by what the device reports free minus the reserve, so memory
taken outside strata's accounting (the allocator's cache, other processes) is respected too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

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

    def planned_mib(self) -> float:
        return self.weights_mib + self.slots * self.slot_mib + self.fixed_graphs_mib

    def graph_budget_mib(self, graphs_mib: float) -> float:
        """MiB a new graph may still take."""
        budget = self.total_mib - self.reserve_mib - self.planned_mib() - graphs_mib
        if self.device_free_mib is not None:
            budget = min(budget, self.device_free_mib() - self.reserve_mib)
        return budget

    def free_mib(self, graphs_mib: float) -> float:
        return self.total_mib - self.planned_mib() - graphs_mib

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
