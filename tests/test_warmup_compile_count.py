"""A prompt chunk's samples compile no graphs of their own.

A prompt chunk passes its lanes to the samplers as a column of its meta rows (stride 4), a
window as a contiguous row, and dynamo guards on strides, so each sampler traced a graph per
segment count for prompt chunks (one slot a chunk, and several with engine.prefill_slots > 1)
beside the windows' graphs of the same shapes. strata/engine/compiling.py's contiguous_lanes
gives the compiled samplers contiguous lanes (a copy only where they are not), so the chunks'
samples run the windows' graphs: four graphs fewer (two samplers x two segment counts).

Counted with dynamo's own counters (backend "eager": tracing and guards, not code generation),
against the same engine without it; the tokens must be the same.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from strata.config import StrataConfig
from strata.engine import compiling
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.kernels import ops
from strata.model.tiny import make_tiny_random

torch.set_num_threads(1)


@pytest.fixture
def eager_compile(monkeypatch):
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda f=None, **kw: compile_(f, **{**kw, "backend": "eager"}))
    yield
    ops.set_backend("auto", "cpu")


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@torch._dynamo.config.patch(suppress_errors=False)
def test_a_strided_lanes_column_samples_with_the_contiguous_graph(eager_compile):
    from strata.engine.sampling import sample_plain_lanes

    torch._dynamo.reset()
    counters.clear()
    sampler = compiling.contiguous_lanes(torch.compile(sample_plain_lanes, dynamic=None))
    raw = torch.compile(sample_plain_lanes, dynamic=None)
    temperature, seed = torch.tensor([0.0, 0.7, 1.0]), torch.tensor([1, 2, 3])
    logits = torch.randn(2, 40)
    meta = torch.tensor([[1, 7, 3, -1], [2, 4, 5, -1]])  # (lane, start, length, next) rows
    with torch.no_grad():
        # one segment (a stride-4 column that is_contiguous() all the same), then two
        for segs in (1, 2):
            lanes, pos0 = meta[:segs, 0], meta[:segs, 1].clone()
            row = lanes.clone(memory_format=torch.contiguous_format)
            want = sampler(logits[:segs], row, pos0, 1, 0, temperature, seed)
            before = graphs()
            got = sampler(logits[:segs], lanes, pos0, 1, 0, temperature, seed)
            assert graphs() == before, f"{segs} segments' lanes column traced a graph of its own"
            assert torch.equal(got, want)
            raw(logits[:segs], row, pos0, 1, 0, temperature, seed)
            before = graphs()
            raw(logits[:segs], lanes, pos0, 1, 0, temperature, seed)
            assert graphs() > before  # what the wrapper saves: dynamo guards on the stride


def engine_run(model_path: str) -> tuple[int, int, dict]:
    """A compiled, warmed batch_mtp engine with two slots, two-slot prompt chunks and two
    buckets: the graphs traced by the end of its warm-up and of four requests (greedy,
    sampled, top-k filtered, in a burst so that their chunks share), and their tokens."""
    torch._dynamo.reset()
    counters.clear()
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device, cfg.model.path = "cpu", model_path
    e = cfg.engine
    e.mode, e.batch_mtp, e.max_context, e.slots = "batch", True, 256, 2
    e.compile, e.prefill_buckets, e.prefill_slots = "on", [16, 32], 2
    logs: list[str] = []
    eng = Engine.from_config(cfg, log=logs.append)
    warm = graphs()
    # the warm-up's line says how many graphs it compiled (all of them: a fresh dynamo)
    assert any(f"{warm} graphs compiled" in line for line in logs), [
        line for line in logs if "warm-up:" in line]
    params = [dict(temperature=0.0), dict(temperature=0.8, seed=1),
              dict(temperature=0.9, top_k=5, seed=2), dict(temperature=0.0)]
    for i, p in enumerate(params):
        eng.add_request(Request(f"r{i}", [5 + i, 9, 11 + i, 3, 7] * (1 + 3 * i), SamplingParams(
            max_tokens=12, stop_at_eos=False, **p), arrival_step=0, stream_text=False))
    while eng.has_work():
        eng.step()
    tokens = {k: v.emitted for k, v in eng.requests.items()}
    eng.close()
    return warm, graphs(), tokens


@pytest.mark.slow
def test_warmup_traces_fewer_graphs_for_the_same_tokens(monkeypatch, tmp_path, eager_compile):
    make_tiny_random(tmp_path, seed=0, num_experts=64, num_experts_per_tok=4)
    new = engine_run(str(tmp_path))
    torch._dynamo.reset()
    with monkeypatch.context() as m:  # as before: the samplers take the chunk's lanes column
        m.setattr(compiling, "contiguous_lanes", lambda f: f)
        old = engine_run(str(tmp_path))
    (warm_new, end_new, tok_new), (warm_old, end_old, tok_old) = new, old
    # two samplers x two segment counts (one slot a chunk, two)
    assert warm_new == warm_old - 4, (warm_new, warm_old)
    assert (end_new, end_old) == (warm_new, warm_old), "requests compiled what the warm-up did not"
    assert tok_new == tok_old
    assert all(len(t) == 12 for t in tok_new.values())
