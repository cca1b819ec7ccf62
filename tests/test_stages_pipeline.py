"""engine.pipeline_groups: pipelined slot groups across stages (gloo on the CPU).

Pipelined windows hold different slots than a one-stage engine's (a window takes at most
ceil(D / S) slots and skips the slots in flight), and the tokens must not change: a slot's next
window starts only after its window's accepted prefix is known, and each request's tokens do
not depend on who shares its windows (tests/test_engine_identity.py). The trace of a pipelined
run replays exactly in the simulator, windows in flight included.
"""

from __future__ import annotations

import pytest

from conftest import cpu_engine_config
from sim.pipeline import StagePipeline
from sim.replay import replay_trace
from strata.config import EMBEDDED_MODEL_DIR, ConfigError, validate_engine
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.engine.scheduler import Scheduler
from strata.engine.slots import DECODE
from strata.trace import TraceWriter
from test_stages import MODES, _requests, _run


def _check_pipelined(mode: str, **knobs) -> Engine:
    one, _, _ = _run(**MODES[mode])
    piped, _, eng = _run(**{**MODES[mode], "stages": 2, "pipeline_groups": True, **knobs})
    assert piped == one
    # stage 0 replayed its window graphs (engine.graphs is on; the last stage's windows of
    # more than 2 rows run eagerly: tests/test_stages_graphs.py)
    assert eng.stages.graph_stats[0]["graph_hits"] > 0
    windows = [e for e in eng.trace.events if e["ev"] == "window"]
    assert windows and all("launched" in e and e["launched"] < e["step"] for e in windows)
    result = replay_trace(eng.trace.events, name=f"pipelined {mode}")
    assert result.ok, result.first_divergence
    return eng


@pytest.mark.parametrize("mode", ["batch_mtp", pytest.param("batch", marks=pytest.mark.slow)])
def test_pipelined_groups_give_the_one_stage_tokens(mode, single_thread):
    # warm-up records window plans run whole; pipelined, their replays launch only
    eng = _check_pipelined(mode, slots=4, warmup="on")
    assert eng.stats()["graph_hits"] > 0
    # two groups were in flight at once: a window launched before the one before it landed
    # (a step launches its window first, then lands the oldest)
    windows = [e for e in eng.trace.events if e["ev"] == "window"]
    assert any(b["launched"] <= a["step"] for a, b in zip(windows, windows[1:]))
    assert eng.trace.events[0]["engine"]["pipeline_groups"] is True


@pytest.mark.slow
def test_pipelined_solo_gives_the_one_stage_tokens(single_thread):
    _check_pipelined("solo")


@pytest.mark.slow
def test_pipelined_padded_windows_of_three_rows_drain_first(single_thread):
    # batch-invariant windows of W=9 pad 2-row groups to 3 rows: the last stage makes such a
    # window's tokens (chained drafts), so it may not start with other windows in flight
    _check_pipelined("batch_mtp", slots=3, batch_invariant=True, window_rows=9)


@pytest.mark.slow
def test_three_pipelined_stages_give_the_one_stage_tokens(single_thread):
    # the middle stage commits a window's DeltaNet rows while the next group's window runs
    _check_pipelined("batch_mtp", stages=3, slots=4)


@pytest.mark.slow
def test_a_request_cancelled_in_flight_leaves_its_slot_clean(single_thread):
    """A cancel frees the slot while its window is in flight; the next request bound to that
    slot must start from fresh state (its window lands first), so every other request keeps
    the one-stage tokens."""
    one, _, _ = _run(**MODES["batch_mtp"])
    eng = Engine.from_config(cpu_engine_config(EMBEDDED_MODEL_DIR, mode="batch", batch_mtp=True,
                                               slots=2, stages=2, pipeline_groups=True),
                             log=lambda m: None)
    try:
        victim = Request(id="victim", prompt_ids=[3, 1, 4],
                         params=SamplingParams(max_tokens=40))
        eng.add_request(victim)
        for r in _requests():
            eng.add_request(r)
        cancelled = False
        while eng.has_work():
            slot = eng.scheduler.slots[0]
            if not cancelled and slot.req is not None and slot.req.id == "victim" and slot.inflight:
                eng.cancel("victim")
                cancelled = True
            eng.step()
        assert cancelled
        got = {k: (rs.emitted, str(rs.reason)) for k, rs in eng.requests.items() if k != "victim"}
        assert got == one
        assert eng.requests["victim"].reason == "cancel"
        result = replay_trace(eng.trace.events, name="pipelined cancel")
        assert result.ok, result.first_divergence
    finally:
        eng.close()


def test_pipeline_groups_needs_stages():
    cfg = cpu_engine_config(EMBEDDED_MODEL_DIR, pipeline_groups=True)
    with pytest.raises(ConfigError, match=r"engine.pipeline_groups: .*needs engine.stages >= 2"):
        validate_engine(cfg.engine)


def test_pipelined_windows_take_a_share_of_the_slots_and_skip_those_in_flight():
    sched = Scheduler(5, mode="batch", batch_mtp=True, drafting=True, spec=3, window_rows=16,
                      decode_share=0.5, prefill_chunk=8, max_context=64,
                      trace=TraceWriter(None), pipeline=2)
    for slot in sched.slots:
        slot.phase, slot.req, slot.pos = DECODE, _Req(), 4
        sched.ring.join(slot.id)
    first = sched.plan()
    assert [s.id for s, _ in first.groups] == [0, 1, 2]  # ceil(5 / 2) slots, though 16 rows fit
    for s, r in first.groups:
        s.inflight = r
    second = sched.plan()
    assert [s.id for s, _ in second.groups] == [3, 4]  # the slots in flight are passed over
    for s, r in second.groups:
        s.inflight = r
    assert sched.plan().kind == "idle"  # every slot waits for a window in flight
    for s, _ in first.groups:
        s.inflight = 0
    assert [s.id for s, _ in sched.plan().groups] == [0, 1, 2]


class _Req:
    left = 100


def test_the_two_stage_pipeline_model():
    """Stage times split by layers; with two windows in flight the second enters stage 0 while
    the first runs on stage 1, so two windows take 1.5 window times plus the hand-off, not 2."""
    p = StagePipeline([0.5, 0.5], handoff_s=0.1)
    assert p.serial_time(1.0) == pytest.approx(1.1)
    assert p.launch(0.0, 1.0) == pytest.approx(1.1)   # 0.5 + 0.1 + 0.5
    assert p.launch(0.0, 1.0) == pytest.approx(1.6)   # stage 0 free at 0.5; stage 1 at 1.1
    uneven = StagePipeline.from_knobs(_Knobs(stages=2, stage_layers="3,1"))
    assert uneven.fractions == [0.75, 0.25] and uneven.handoff_s == 0.0
    assert uneven.launch(0.0, 1.0) == 1.0 and uneven.launch(0.0, 1.0) == 1.75
    assert StagePipeline.from_knobs(_Knobs(stages=1, stage_layers="auto")) is None


class _Knobs:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_the_simulator_predicts_the_pipelines_gain():
    """A device-bound preset on two stages: pipelined groups finish the same cohort sooner than
    a single group (each stage works on one group's window while the other has the next), and
    by less than the stages' count (host time, prompt chunks drain the pipeline). 64 output
    tokens a request: at real scale a 64-token prompt chunk costs about seven 8 x 1 windows."""
    from hydra import compose, initialize_config_dir

    from sim.config import SIM_CONF_DIR, register_configs
    from sim.predict import run_predict

    register_configs()

    def tps(pipelined: bool) -> float:
        with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                "hardware=h200_80b_a3b_fp8", "workload=cohort", "workload.requests=8",
                "workload.prompt_tokens=64", "workload.max_tokens=64", "engine.slots=8",
                "spread.enabled=false",
                "engine.stages=2", f"engine.pipeline_groups={str(pipelined).lower()}"])
        res = run_predict(cfg)
        windows = [e for e in res.run.events if e["ev"] == "window"]
        assert all(("launched" in e) == pipelined for e in windows)
        return res.metrics["aggregate_tps"]

    single, piped = tps(False), tps(True)
    assert 1.2 * single < piped < 2.0 * single
