"""The verifier's window glue (window_inputs, window_pick, window_store) compiled: the tokens
of the eager functions in every mode, serial and overlapped. aot_eager traces and
functionalizes them as inductor would (their writes to the slot buffers included) without
generating code, so the test takes seconds; the GPU runs them through inductor."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch._dynamo
from conftest import cpu_engine_config
from torch._dynamo.utils import counters

from strata.engine import verifier
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams

GLUE = verifier.GLUE_FUNCTIONS


def run(model_dir, mode, batch_mtp, overlap, temperature):
    cfg = cpu_engine_config(model_dir, mode=mode, batch_mtp=batch_mtp, slots=3, overlap=overlap)
    eng = Engine.from_config(cfg, log=lambda s: None)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        ids = torch.randint(1, 500, (5 + 4 * i,), generator=g).tolist()
        eng.add_request(Request(f"r{i}", ids, SamplingParams(
            max_tokens=9 + 4 * i, temperature=temperature, seed=i, stop_at_eos=False),
            arrival_step=i, stream_text=False))
    while eng.has_work():
        eng.step()
    out = {k: v.emitted for k, v in eng.requests.items()}
    eng.close()
    return out


@pytest.mark.slow
@torch._dynamo.config.patch(suppress_errors=False)  # a compile failure must fail the test
def test_compiled_window_glue_keeps_every_token(tiny_ckpt, monkeypatch):
    # greedy serial, seeded sampling overlapped (device positions)
    cases = [(mode, bm, ov, t) for (mode, bm), (ov, t) in itertools.product(
        (("solo", False), ("batch", False), ("batch", True)), ((False, 0.0), (True, 0.9)))]
    ref = {c: run(tiny_ckpt, *c) for c in cases}
    torch._dynamo.reset()
    for name in GLUE:
        monkeypatch.setitem(verifier.PURE_FUNCTIONS, name,
                            torch.compile(verifier.PURE_FUNCTIONS[name], backend="aot_eager",
                                          dynamic=True))  # as compiling.compiled_functions does
    counters.clear()
    for c in cases:
        assert run(tiny_ckpt, *c) == ref[c], c
    assert counters["stats"]["unique_graphs"] >= len(GLUE)  # the compiled functions ran
    torch._dynamo.reset()
