"""Build the expert cache of a prediction from its config (`experts`, `memory`, and strata's
engine.expert_cache_mib / expert_adapt_every / expert_profile)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .config import SimConfigError
from .expert_costs import ExpertCosts, MissCost, bytes_model_from_config
from .experts import ExpertCacheModel, ExpertModelError, RoutingModel
from .streams import RandomStreams

MIB = 1 << 20


def expert_slots(cache_mib: float, experts: int, moe_layers: int, expert_bytes: int) -> int:
    """Device slots per MoE layer that `cache_mib` MiB hold (at most every expert); 0 MiB
    means no cache: every expert resident."""
    if cache_mib <= 0:
        return experts
    return min(experts, int(cache_mib * MIB // (moe_layers * expert_bytes)))


def cache_mib_for_fraction(fraction: float, experts: int, moe_layers: int,
                           expert_bytes: int) -> int:
    """The smallest whole-MiB budget whose slots hold `fraction` of each layer's experts."""
    slots = round(fraction * experts)
    return -(-slots * moe_layers * expert_bytes // MIB)


@dataclass
class ExpertInputs:
    model: ExpertCacheModel
    costs: ExpertCosts
    #: The `config` event's memory fields of the cache (COMMON.md contract); empty when off.
    memory_fields: dict[str, int]


def build_expert_inputs(cfg: Any, streams: RandomStreams,
                        scale: Optional[dict[str, float]] = None) -> Optional[ExpertInputs]:
    """The expert model of a prediction, or None when `experts.experts` is 0. `scale`: the
    profile's speed factors when it is a prediction range's end (its source.scaled)."""
    x, e, m = cfg.experts, cfg.engine, cfg.memory
    if x.experts == 0:
        return None
    try:
        if e.expert_profile:
            routing = RoutingModel.from_profile(e.expert_profile, x.row_overlap)
            if routing.experts != x.experts or routing.layers != x.moe_layers \
                    or routing.top_k != x.top_k:
                raise SimConfigError(
                    f"engine.expert_profile: {e.expert_profile} has {routing.layers} layers x "
                    f"{routing.experts} experts, top_k {routing.top_k}; the experts config says "
                    f"{x.moe_layers} x {x.experts}, top_k {x.top_k}")
        else:
            routing = RoutingModel.zipf(x.moe_layers, x.experts, x.top_k, x.skew, x.row_overlap)
        cache_on = e.expert_cache_mib > 0
        slots = expert_slots(e.expert_cache_mib, x.experts, x.moe_layers, x.expert_bytes)
        if cache_on and slots < 1:
            raise SimConfigError(
                f"engine.expert_cache_mib: {e.expert_cache_mib} MiB holds no expert slot: one "
                f"slot per layer needs {x.moe_layers} x {x.expert_bytes} bytes = "
                f"{x.moe_layers * x.expert_bytes / MIB:.1f} MiB")
        model = ExpertCacheModel(routing, slots, e.expert_adapt_every, x.decay, x.swap_limit,
                                 x.expert_bytes, streams.stream("experts.routing"),
                                 cache_on=cache_on, call_rows=x.call_rows,
                                 prefill_launch_rows=x.prefill_launch_rows)
        bytes_model = bytes_model_from_config(x, m, e.draft_vocab, e.draft_head == "fp8") \
            if x.cost == "bytes" else None
    except ExpertModelError as err:
        raise SimConfigError(str(err)) from None
    hbm = m.hbm_gb_s * 1e9 * x.hbm_efficiency
    bus = m.bus_gb_s * 1e9 if m.bus_gb_s > 0 else float("inf")
    prefill = float((scale or {}).get("prefill", 1.0))
    costs = ExpertCosts(x.cost, MissCost(float(x.expert_bytes), bus, float(x.miss_s)), hbm,
                        bytes_model,
                        window_scale=float((scale or {}).get("window", 1.0)),
                        prefill_scale=prefill * float(x.prefill_scale),
                        prefill_expert_scale=None if x.prefill_expert_scale is None
                        else prefill * float(x.prefill_expert_scale),
                        prefill_row_s=prefill * float(x.prefill_row_s))
    fields = ({"expert_slots": slots, "experts": x.experts, "expert_bytes": int(x.expert_bytes),
               "moe_layers": x.moe_layers} if cache_on else {})
    return ExpertInputs(model, costs, fields)
