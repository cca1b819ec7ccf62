"""The expert cache with prompt chunks of several slots (engine.prefill_slots set above 1; its
auto is 1 with the cache, strata.config.prefill_slots_of).

The trace contract allows one expert_swap a step (sim/replay.py refuses two). Both
implementations adapt only at the read of a decode window that ends an adapt period
(strata/engine/postprocess.commit_window; sim/scheduler._read_window), and a step reads at most
one window with the cache (serial or engine.overlap; the cache refuses engine.stages > 1, so
no pipelined step lands several): a prompt chunk, of one slot or of eight, reads none and so
never swaps. These tests pin that for the simulator's predictions and for the CPU engine's
traces: every swap follows a window read of its own step, at most one a step, and each trace
replays exactly, swaps included.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from sim.predict import run_predict
from sim.replay import replay_trace
from tests.test_sim_expert_cache import SMALL_EXPERTS, cfg_of


def check_swaps(events: list[dict]) -> list[tuple[int, int]]:
    """At most one expert_swap a step, each after a window event of its own step (its read)
    with no prompt chunk between; the multi-slot prompt chunks are there. Returns the
    (step, experts)."""
    per_step = Counter(e["step"] for e in events if e["ev"] == "expert_swap")
    assert per_step and max(per_step.values()) == 1, per_step
    for i, e in enumerate(events):
        if e["ev"] != "expert_swap":
            continue
        before = next(p for p in reversed(events[:i]) if p["ev"] in ("window", "prefill"))
        assert before["ev"] == "window" and before["step"] == e["step"], (before, e)
    assert any(e["ev"] == "prefill" and e.get("segments", 1) > 1 for e in events)
    return [(e["step"], e["experts"]) for e in events if e["ev"] == "expert_swap"]


def assert_replays_with_its_swaps(events: list[dict]) -> None:
    swaps = check_swaps(events)
    result = replay_trace(events)
    assert result.ok, result.first_divergence
    assert [(e["step"], e["experts"]) for e in result.sim_events
            if e["ev"] == "expert_swap"] == swaps


@pytest.mark.parametrize("overlap", ["false", "true"])
@pytest.mark.parametrize("workload", ["cohort", "stagger"])
def test_predicted_trace_with_multi_slot_prompt_chunks_swaps_once_a_step_and_replays(
        overlap, workload):
    """engine.prefill_slots=8 with a swapping cache (adapt every window, so that any read a
    step that swapped twice would show): prompt chunks of up to 8 slots, no step with two
    swaps, and the predicted trace replays exactly."""
    cfg = cfg_of(*SMALL_EXPERTS, "engine.expert_cache_mib=16", "engine.expert_adapt_every=1",
                 "experts.skew=1.0", f"workload={workload}", "workload.requests=8",
                 "workload.prompt_tokens=40", "workload.max_tokens=12", "engine.slots=8",
                 "engine.prefill_chunk=16", "engine.prefill_slots=8", f"engine.overlap={overlap}",
                 "spread.enabled=false")
    events = run_predict(cfg).run.events
    assert events[0]["engine"]["prefill_slots"] == 8
    assert_replays_with_its_swaps(events)


@pytest.fixture(scope="module")
def cached_model(tmp_path_factory):
    from strata.model.tiny import make_tiny_random

    # tests/test_expert_cache.py's model: 64 experts top 4, 1 MiB holds 7 of each layer's.
    return make_tiny_random(tmp_path_factory.mktemp("prefill-slots-cache"), seed=7,
                            tokenizer=False, num_experts=64, num_experts_per_tok=4,
                            moe_intermediate_size=48, shared_expert_intermediate_size=48)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_engine_trace_with_multi_slot_prompt_chunks_swaps_once_a_step_and_replays(
        cached_model, overlap):
    """The CPU engine, engine.prefill_slots=8 and a cache that misses and swaps every window:
    prompt chunks of several slots, at most one swap a step, each at a window's read, and the
    simulator replays the trace exactly, swaps included."""
    import torch
    from conftest import cpu_engine_config, run_cohort

    from strata.engine.llm_engine import Engine
    from strata.engine.request import Request, SamplingParams

    torch.set_num_threads(1)
    cfg = cpu_engine_config(cached_model, 128, mode="batch", batch_mtp=True, slots=3,
                            window_rows=6, spec=3, prefill_chunk=4, expert_cache_mib=1,
                            expert_adapt_every=1, prefill_slots=8, overlap=overlap)
    cfg.model.moe_dense_experts = 0
    eng = Engine.from_config(cfg, log=lambda s: None)
    rng = random.Random(3)
    run_cohort(eng, [Request(f"r{i}", [rng.randrange(1, 512) for _ in range(3 + 4 * i)],
                             SamplingParams(max_tokens=6 + 2 * i, stop_at_eos=False),
                             arrival_step=0) for i in range(5)], 2000)
    events = list(eng.trace.events)
    assert events[0]["engine"]["prefill_slots"] == 8
    assert_replays_with_its_swaps(events)
