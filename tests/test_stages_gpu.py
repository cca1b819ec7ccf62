"""engine.stages=2 on two CUDA devices (NCCL): the one-stage tokens in every mode, and the
hand-off measurement runs. The lead runs it on the two-GPU machine:
`PYTHONPATH=$PWD python3 -m pytest -q tests/test_stages_gpu.py` (with pipelined slot groups:
`-k pipelined`; each stage's CUDA graphs: `-k graphs`)."""

from __future__ import annotations

import pytest
import torch

from conftest import cpu_engine_config
from strata.config import EMBEDDED_MODEL_DIR
from strata.engine.llm_engine import Engine
from test_stages import MODES, _requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices"),
]


def _run(**knobs):
    cfg = cpu_engine_config(EMBEDDED_MODEL_DIR, **knobs)
    cfg.device = "cuda"
    cfg.model.dtype = "float32"  # as conf/model/tiny.yaml
    eng = Engine.from_config(cfg, log=lambda m: None)
    try:
        for r in _requests(max_tokens=24):
            eng.add_request(r)
        while eng.has_work():
            eng.step()
        hand = eng.verifier.handoff_seconds(2, 2, 20) if eng.stages is not None else None
        return {k: (rs.emitted, str(rs.reason)) for k, rs in eng.requests.items()}, hand
    finally:
        eng.close()  # (a split's stages report their graph counters here)
        graph_stats.clear()
        graph_stats.update(eng.stages.graph_stats if eng.stages is not None else {})


#: The graph counters of each stage of the split `_run` ran last (StageGroup.graph_stats).
graph_stats: dict[int, dict] = {}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("compile_", ["off", "auto"])
def test_two_gpu_stages_give_the_one_gpu_tokens(mode, compile_):
    knobs = dict(MODES[mode], compile=compile_, graphs=False)
    one, _ = _run(**knobs)
    two, hand = _run(**knobs, stages=2)
    assert one == two
    assert 0 < hand < 0.05  # one 2x2 window's messages over NCCL: well under 50 ms


@pytest.mark.parametrize("mode", list(MODES))
def test_two_gpu_pipelined_groups_give_the_one_gpu_tokens(mode):
    """engine.pipeline_groups over NCCL: windows of two slot groups in flight at once, the
    point-to-point channels in both directions, and still the one-GPU tokens."""
    knobs = dict(MODES[mode], compile="off", graphs=False)
    one, _ = _run(**knobs)
    piped, hand = _run(**knobs, stages=2, pipeline_groups=True)
    assert one == piped
    assert 0 < hand < 0.05


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("pipelined", [False, True])
def test_two_gpu_stage_graphs_give_the_one_gpu_tokens(mode, pipelined):
    """engine.graphs on a split: each stage replays CUDA graphs of its own compute (stage 0
    its embedding and layers, the last its layers, head, sampling, acceptance, commit and
    draft) with the NCCL messages outside them, and the tokens are the one GPU's (graphs on
    too); pipelined, two graphs per shape keep the windows in flight apart."""
    knobs = dict(MODES[mode], compile="off", graphs=True)
    one, _ = _run(**knobs)
    two, hand = _run(**knobs, stages=2, pipeline_groups=pipelined, stage_graphs=True)
    stats = dict(graph_stats)
    assert one == two
    assert 0 < hand < 0.05
    assert stats[0]["graph_hits"] > 0 and stats[0]["graph_eager"] == 0
    if mode != "solo":  # (solo's windows of 3 rows run the last stage eagerly)
        assert stats[1]["graph_hits"] > 0 and stats[1]["graph_eager"] == 0
