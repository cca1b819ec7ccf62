"""What an engine reports about itself: the `config` trace event it starts with, its stats
(Engine.stats: metrics.json, the server's /metrics, benchmarks) and a request's final text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from strata.config import engine_knobs
from strata.engine.device import device_free_used_mib
from strata.engine.expert_cache import ExpertCachePlan
from strata.engine.graph_cache import GraphCache
from strata.engine.slots import RequestState

if TYPE_CHECKING:
    from strata.engine.llm_engine import Engine


def config_fields(eng: "Engine", cache_plan: Optional[ExpertCachePlan]) -> dict:
    """The `config` event's fields: the engine's knobs as resolved (batch_mtp after the
    environment and what fits, slots, the context the model allows, overlap after auto) and
    its memory plan."""
    ecfg = eng.cfg
    knobs = {**engine_knobs(ecfg), "batch_mtp": eng.batch_mtp, "slots": eng.budget.slots,
             "max_context": eng.max_context, "drafting": eng.drafting,
             "overlap": eng.overlapped, "prefill_slots": eng.prefill_slots}
    memory = {**eng.budget.as_dict(),
              "graph_mib": float(ecfg.cpu_graph_mib) if eng.device.type == "cpu" else None}
    if cache_plan is not None:
        memory.update(cache_plan.memory_fields())
    return {"engine": knobs, "memory": memory}


def engine_stats(eng: "Engine") -> dict:
    """Counters, slot use, graph caches, device memory and the expert cache's hits."""
    dev_free, dev_used = device_free_used_mib(eng.device)
    expert_cache, runner = eng.expert_cache, eng.runner
    return {
        "output_tokens": eng.output_tokens, "drafted": eng.drafted, "accepted": eng.accepted,
        "busy_slots": sum(1 for s in eng.scheduler.slots if s.phase != "free"),
        "slots": len(eng.scheduler.slots), "windows": eng.windows, "prefills": eng.prefills,
        **GraphCache.stats(eng.cache),
        "device_free_mib": dev_free, "device_used_mib": dev_used,
        "prefill_graphs": len(runner.p_graphs), "prefill_graphs_mib": runner.p_graphs_mib,
        "expert_cache": expert_cache is not None,
        "expert_hits": expert_cache.hits if expert_cache else 0,
        "expert_misses": expert_cache.misses if expert_cache else 0,
    }


def final_text(rs: RequestState, tokenizer: Optional[Any]) -> str:
    """The request's whole text: the text stream's when a stop string ended it (the stream
    cut the text at the stop string), else its emitted tokens decoded ("" without a tokenizer)."""
    if rs.reason == "stop" and rs.req.params.stop and rs.text_stream is not None:
        return rs.text_stream.text
    return tokenizer.decode(rs.emitted) if tokenizer is not None else ""
