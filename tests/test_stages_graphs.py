"""Graphs on a layer split (strata/engine/stage_graphs.py), on the CPU: each stage replays its
own window compute from recorded plans whose outputs are static (StaticRecordingBackend, as a
CUDA graph's are), with every message outside; no message may happen inside a capture or replay.
The end-to-end token checks with graphs on are tests/test_stages.py's and
tests/test_stages_pipeline.py's (engine.stage_graphs, auto, is on for CPU stages); these check
the parts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import cpu_engine_config
from strata.config import EMBEDDED_MODEL_DIR
from strata.engine import stage_protocol as proto
from strata.engine.graph_cache import GraphCache, RecordingBackend, StaticRecordingBackend
from strata.engine.llm_engine import Engine
from strata.engine.memory import MemoryBudget
from strata.engine.stage_graphs import MessageFreeBackend, StageGraphs
from strata.trace import TraceWriter
from test_stages import MODES, _requests, _run


def _ecfg(**kw) -> SimpleNamespace:
    base = dict(graphs=True, stages=2, pipeline_groups=False, graph_limit=32, cpu_graph_mib=1.0,
                graph_mib_estimate=1.0)
    return SimpleNamespace(**{**base, **kw})


def _budget() -> MemoryBudget:
    return MemoryBudget(total_mib=1024, reserve_mib=0, weights_mib=0, slot_mib=0, slots=1)


def _graphs(**kw) -> StageGraphs:
    return StageGraphs.for_stage(_ecfg(**kw), torch.device("cpu"), _budget(), log=lambda m: None)


# ---- the guard ------------------------------------------------------------------------------------
def test_a_message_inside_no_messages_raises_before_it_is_sent():
    t = torch.zeros(2, dtype=torch.long)
    with proto.no_messages("a graph replay"):
        for send in (lambda: proto.send(t, 1), lambda: proto.recv(t, 0),
                     lambda: proto.send_back(t, 0), lambda: proto.recv_back(t, 1),
                     lambda: proto.fan_out(t), proto.flush):
            with pytest.raises(proto.MessageInGraph, match="inside a graph replay"):
                send()
    assert proto._refusing is None  # (and outside it messages go through again)


def test_a_message_put_inside_a_stage_graph_raises(monkeypatch):
    """A stage's graph cache refuses messages while it replays (recorded plans run at replay)
    and while it captures (CUDA graphs run the function at capture: here a backend that does)."""
    sent = []
    monkeypatch.setattr(proto.dist, "isend", lambda t, dst, group=None: sent.append(dst))
    monkeypatch.setattr(proto.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(proto, "_outbox", [])
    graphs = _graphs()
    plan = torch.zeros(4)

    def window_with_a_message():
        proto.send(plan, 1)  # a window's hand-off put inside its captured compute
        return plan * 2

    with pytest.raises(proto.MessageInGraph, match="graph replay"):
        graphs.run((1, 2, 64), window_with_a_message, warm=lambda: None)

    class RunsAtCapture(RecordingBackend):
        def capture(self, fn):
            fn()
            return fn, 1.0

    assert sent == []
    log = []
    cache = GraphCache(4, MessageFreeBackend(RunsAtCapture(1.0)), _budget(), TraceWriter(None),
                       1.0, log=log.append)
    run = cache.run("k", window_with_a_message, lambda: None)
    # refused at capture, with a warning naming it; the window then runs eagerly (its send real)
    assert run.action == "eager" and sent == [1]
    assert any("MessageInGraph" in line and "graph capture" in line for line in log)
    ok = cache.run("k2", lambda: plan + 1, lambda: None)  # compute alone captures
    assert ok.action == "capture" and torch.equal(ok.output, plan + 1)


# ---- static outputs and their copies ---------------------------------------------------------------
def test_static_recording_replays_return_the_same_tensors():
    b = StaticRecordingBackend(1.0)
    src = [torch.tensor([1.0])]
    handle, _ = b.capture(lambda: (src[0] * 2, [src[0] + 1]))
    first = b.replay(handle)
    src[0] = torch.tensor([5.0])
    second = b.replay(handle)
    assert second[0] is first[0] and second[1][0] is first[1][0]
    assert first[0].item() == 10.0 and first[1][0].item() == 6.0  # overwritten, as on CUDA


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_each_shape_has_one_graph_per_window_in_flight(depth):
    """Windows of one shape in flight keep their own outputs until they land: a shape has
    `depth` graphs, used in turn, each pinned while its window is in flight."""
    graphs = _graphs(stages=depth, pipeline_groups=depth > 1)
    value = [0.0]
    run = lambda: torch.tensor([value[0]])  # noqa: E731
    held = []
    for i in range(depth):
        value[0] = float(i)
        held.append(graphs.run((2, 2, 64), run, lambda: None, hold=True))
    assert [out.item() for out, _ in held] == list(range(depth))  # none overwritten
    assert len({key for _, key in held}) == depth
    with pytest.raises(RuntimeError, match="in flight"):  # the oldest has not landed
        graphs.run((2, 2, 64), run, lambda: None, hold=True)
    graphs.release(held[0][1])
    value[0] = 9.0
    out, key = graphs.run((2, 2, 64), run, lambda: None, hold=True)
    assert key == held[0][1] and out is held[0][0] and out.item() == 9.0  # its copy, reused
    landed = []

    def land(k: str) -> None:  # (a middle stage lands the window that holds it)
        landed.append(k)
        graphs.release(k)

    graphs.run((2, 2, 64), run, lambda: None, land=land)
    assert landed == [held[1 % depth][1]]
    assert graphs.cache.stats()["graph_hits"] == 2


def test_graphs_off_give_no_stage_cache():
    assert not _graphs(graphs=False).captured


# ---- end to end ------------------------------------------------------------------------------------
def _replays(eng: Engine) -> dict[int, int]:
    return {k: st["graph_hits"] for k, st in eng.stages.graph_stats.items()}


@pytest.mark.parametrize("pipelined", [False, True])
def test_every_stage_replays_its_graphs_and_keeps_the_one_stage_tokens(pipelined, single_thread):
    """batch_mtp with graphs on: the one-stage tokens, and stage 0's replays grow over the run
    while the last stage's (reported when it stops) happened too."""
    one, _, _ = _run(**MODES["batch_mtp"], overlap=False)
    eng = Engine.from_config(cpu_engine_config(EMBEDDED_MODEL_DIR, **MODES["batch_mtp"], stages=2,
                                               pipeline_groups=pipelined), log=lambda m: None)
    try:
        for r in _requests():
            eng.add_request(r)
        seen = []
        while eng.has_work():
            eng.step()
            seen.append(eng.verifier.graphs.cache.hits)
        two = {k: (rs.emitted, str(rs.reason)) for k, rs in eng.requests.items()}
    finally:
        eng.close()
    assert two == one
    assert seen[-1] > seen[len(seen) // 2] > 0
    replays = _replays(eng)
    assert set(replays) == {0, 1} and min(replays.values()) > 0
    if pipelined:  # two windows of one shape in flight: two graphs of it on stage 0
        assert eng.stages.graph_stats[0]["graph_captures"] > len({k.split("#")[0] for k in
                                                                  eng.verifier.graphs.cache.entries})


def test_graphs_off_keep_the_eager_split(single_thread):
    one, _, _ = _run(**MODES["batch"], overlap=False)
    two, _, eng = _run(**MODES["batch"], stages=2, graphs=False)
    assert two == one
    assert eng.stages.graph_stats == {} and eng.cache is None


def test_stage_graphs_auto_is_on_for_cpu_stages_only():
    """engine.stage_graphs null: CPU stages replay recorded plans, CUDA stages run eagerly until
    the two-GPU tests have run the captures; true and false force it; graphs=false wins."""
    from strata.config import stage_graphs_on

    auto = SimpleNamespace(graphs=True, stage_graphs=None)
    assert stage_graphs_on(auto, "cpu") and not stage_graphs_on(auto, "cuda")
    assert stage_graphs_on(SimpleNamespace(graphs=True, stage_graphs=True), "cuda")
    assert not stage_graphs_on(SimpleNamespace(graphs=True, stage_graphs=False), "cpu")
    assert not stage_graphs_on(SimpleNamespace(graphs=False, stage_graphs=None), "cpu")


@pytest.mark.parametrize("knobs, named", [(dict(stages=1, stage_graphs=True), "engine.stage_graphs"),
                                          (dict(stages=2, graphs=False, stage_graphs=True),
                                           "engine.graphs=false")])
def test_stage_graphs_without_a_split_or_graphs_is_a_config_error(knobs, named):
    from strata.config import ConfigError

    cfg = cpu_engine_config(EMBEDDED_MODEL_DIR, **knobs)
    with pytest.raises(ConfigError, match=named):
        Engine.from_config(cfg, log=lambda m: None)
