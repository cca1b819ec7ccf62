"""engine.stages=N on the CPU (gloo): a layer split across processes gives the one-stage tokens.

Each staged engine spawns its stage processes (a few seconds of interpreter and torch start-up
on the CI machine), so the end-to-end tests use the embedded tiny model, few tokens, and the
slow marker where a test starts more than one staged engine.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from conftest import cpu_engine_config
from sim.replay import replay_trace
from strata.config import EMBEDDED_MODEL_DIR, ConfigError
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.engine.stages import balance_layers, plan_stages, stage_devices
from strata.model.loader import load_checkpoint
from strata.model.stage_slice import StageSlice

PROMPTS = [[5, 17, 42], [6, 17, 42, 99], [7, 3, 1, 4, 1, 5], [9, 9]]


def _requests(max_tokens: int = 10) -> list[Request]:
    # greedy and sampled requests (the last stage samples: its seeds must be the driver's)
    return [Request(id=f"r{i}", prompt_ids=p,
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.8 if i % 2 else 0.0,
                                          seed=i, top_k=20 if i == 3 else 0))
            for i, p in enumerate(PROMPTS)]


def _run(**knobs) -> tuple[dict, list[str], Engine]:
    eng = Engine.from_config(cpu_engine_config(EMBEDDED_MODEL_DIR, **knobs), log=lambda m: None)
    try:
        for r in _requests():
            eng.add_request(r)
        while eng.has_work():
            eng.step()
        return ({k: (rs.emitted, str(rs.reason)) for k, rs in eng.requests.items()},
                [e["ev"] for e in eng.trace.events], eng)
    finally:
        eng.close()


MODES = {"solo": dict(mode="solo", spec=3), "batch": dict(mode="batch", batch_mtp=False, slots=3),
         "batch_mtp": dict(mode="batch", batch_mtp=True, slots=3)}


# ---- placement -------------------------------------------------------------------------------
def test_balance_layers_minimises_the_largest_stage():
    assert balance_layers([1] * 8, 0, 0, 2) == [4, 4]
    # the last stage's head weighs 4 layers: it gets fewer layers
    assert balance_layers([1] * 8, 0, 4, 2) == [6, 2]
    counts = balance_layers([5, 1, 1, 1, 1, 5], 1, 1, 3)
    assert sum(counts) == 6 and min(counts) >= 1 and counts == [1, 4, 1]


def test_stage_layers_errors_name_the_key():
    from strata.model.config import load_model_args

    args = load_model_args(EMBEDDED_MODEL_DIR)
    cfg = cpu_engine_config(EMBEDDED_MODEL_DIR, stages=2, stage_layers="3,2")
    with pytest.raises(ConfigError, match=r"engine.stage_layers: '3,2' sums to 5 layers but the model has 6"):
        plan_stages(cfg, args, torch.float32)
    cfg = cpu_engine_config(EMBEDDED_MODEL_DIR, stages=7)
    with pytest.raises(ConfigError, match=r"engine.stages: 7 stages for a model of 6 decoder layers"):
        plan_stages(cfg, args, torch.float32)
    with pytest.raises(ConfigError, match="engine.stage_layers"):  # the count per stage
        Engine.from_config(cpu_engine_config(EMBEDDED_MODEL_DIR, stages=2, stage_layers="6"))
    with pytest.raises(ConfigError, match="engine.stage_layers"):  # a stage without layers
        Engine.from_config(cpu_engine_config(EMBEDDED_MODEL_DIR, stages=2, stage_layers="6,0"))
    with pytest.raises(ConfigError, match="sums to 7"):  # before any process starts
        Engine.from_config(cpu_engine_config(EMBEDDED_MODEL_DIR, stages=2, stage_layers="4,3"))
    cfg = cpu_engine_config(EMBEDDED_MODEL_DIR, stages=2, stage_layers="2,4")
    assert [(s.start, s.stop, s.first, s.last) for s in plan_stages(cfg, args, torch.float32)] == \
        [(0, 2, True, False), (2, 6, False, True)]


def test_more_stages_than_cuda_devices_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"engine.stages=2: needs 2 CUDA devices .* 1 are visible"):
        stage_devices(torch.device("cuda"), 2)
    assert stage_devices(torch.device("cpu"), 5) == [torch.device("cpu")] * 5


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_a_stage_loads_only_its_layers_with_the_whole_models_weights(load_format):
    kw = dict(dtype="float32", log=lambda m: None, load_format=load_format)
    full = dict(load_checkpoint(EMBEDDED_MODEL_DIR, **kw).model.named_parameters())
    for sl in (StageSlice(0, 2, True, False), StageSlice(2, 5, False, False), StageSlice(5, 6, False, True)):
        part = load_checkpoint(EMBEDDED_MODEL_DIR, stage=sl, **kw)
        assert part.args.layer_types == full_types()[sl.start:sl.stop]
        assert part.has_mtp and (part.model.mtp is not None) == sl.last
        held = 0
        for name, p in part.model.named_parameters():
            if p.is_meta:  # not this stage's: no memory
                assert name.split(".")[0] in ("embed_tokens", "norm", "lm_head"), name
                continue
            if name.startswith("layers."):
                i, rest = name.split(".", 2)[1:]
                name = f"layers.{int(i) + sl.start}.{rest}"
            assert torch.equal(p, full[name]), name
            held += 1
        assert held


def full_types() -> list[str]:
    from strata.model.config import load_model_args

    return load_model_args(EMBEDDED_MODEL_DIR).layer_types


# ---- end to end --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [
    "batch_mtp",
    "solo",
    "batch",
])
def test_two_stages_give_the_one_stage_tokens(mode, single_thread):
    # a split runs serially (overlap auto) and one slot a chunk (prefill_slots auto)
    one, ev1, _ = _run(**MODES[mode], overlap=False, prefill_slots=1)
    two, ev2, eng = _run(**MODES[mode], stages=2, graphs=True)
    assert one == two
    assert eng.stages.graph_stats[0]["graph_hits"] > 0  # stage 0 replayed its window graphs
    assert ev1 == ev2  # the same scheduling decisions, event for event
    assert eng.trace.events[0]["engine"]["stages"] == 2
    result = replay_trace(eng.trace.events, name=f"stages=2 {mode}")  # the simulator agrees
    assert result.ok, result.first_divergence


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["5,1", "1,5"])  # a last stage without DeltaNet layers; a one-layer first
def test_uneven_stages_give_the_one_stage_tokens(layers, single_thread):
    one, _, _ = _run(**MODES["batch_mtp"])
    assert _run(**MODES["batch_mtp"], stages=2, stage_layers=layers)[0] == one


@pytest.mark.slow
def test_three_stages_give_the_one_stage_tokens(single_thread):
    one, _, _ = _run(**MODES["solo"])
    assert _run(**MODES["solo"], stages=3)[0] == one


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_stage_killed_mid_run_fails_every_request_with_an_error(pipelined, single_thread):
    eng = Engine.from_config(cpu_engine_config(EMBEDDED_MODEL_DIR, mode="batch", slots=2, stages=2,
                                               pipeline_groups=pipelined), log=lambda m: None)
    try:
        for r in _requests(max_tokens=40):
            eng.add_request(r)
        late = Request(id="late", prompt_ids=[1, 2], params=SamplingParams(max_tokens=4))
        late.arrival_step = 1000
        eng.add_request(late)
        outs = []
        for _ in range(8):
            outs += eng.step()
        assert any(o.new_token_ids for o in outs)
        pid = eng.stages.procs[0].pid
        os.kill(pid, signal.SIGKILL)
        for _ in range(50):
            if not eng.has_work():
                break
            outs += eng.step()
        assert not eng.has_work()
        assert eng.fault is not None and f"pid {pid}" in eng.fault and "died" in eng.fault
        # every request ended, each with an error event naming the dead stage: none lost silently
        finished = {o.id: o for o in outs if o.finished}
        assert set(finished) == {r.id for r in _requests()} | {"late"}
        for rid, o in finished.items():
            assert o.finish_reason == "error" and "died" in o.error, (rid, o.error)
        finishes = [e for e in eng.trace.events if e["ev"] == "finish"]
        assert sorted(e["req"] for e in finishes) == sorted(finished)
        assert all(e["reason"] == "error" for e in finishes)
    finally:
        eng.close()


def test_a_stage_that_cannot_load_is_a_clear_error(ckpt_copy, single_thread):
    from conftest import edit_tensors
    from strata.model.config import CheckpointError, load_model_args

    last = load_model_args(ckpt_copy).num_hidden_layers - 1
    key = f"model.layers.{last}.input_layernorm.weight"
    edit_tensors(ckpt_copy, lambda sd: sd.pop(key))  # only the last stage reads it
    with pytest.raises(CheckpointError, match=rf"stage 1: .*missing tensor '{key}'"):
        Engine.from_config(cpu_engine_config(ckpt_copy, stages=2), log=lambda m: None)
    # the stage processes are gone and a new split starts in this process
    _, _, eng = _run(**MODES["batch"], stages=2)
    assert eng.stages.closed


def test_a_stage_without_room_for_the_slots_is_a_clear_error(monkeypatch, single_thread):
    """Stage 0 plans the slot count; a stage that cannot hold that many is named (the CPU stages
    are forks, so a patch made here reaches them)."""
    from strata.model import state as state_mod

    driver, build = os.getpid(), state_mod.DecodeState.__init__

    def full_device(self, *a, **kw):
        if os.getpid() != driver:
            raise RuntimeError("out of memory (simulated)\nmore")
        build(self, *a, **kw)

    monkeypatch.setattr(state_mod.DecodeState, "__init__", full_device)
    with pytest.raises(ConfigError, match=r"engine.slots: stage 1 cannot hold the state of 3 slots "
                                          r"\(RuntimeError: out of memory \(simulated\)\)"):
        Engine.from_config(cpu_engine_config(EMBEDDED_MODEL_DIR, stages=2, mode="batch", slots=3),
                           log=lambda m: None)
