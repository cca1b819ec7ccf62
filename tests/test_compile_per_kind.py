"""Compiling the window regions costs once per layer kind, not once per layer.

Qwen3Next.compile_regions compiles each region once per layer kind, as a function taking the
layer first, and every layer of the kind (the MTP layer too, for full attention) runs that one
function; dynamo inlines the module (its parameters are graph inputs, its guards check types
and shapes, not the instance), so the linear-attention layers share one compiled graph per
window shape and the full-attention layers another. A model of 8 layers must compile exactly
as many graphs, with no more recompiles, as one of 4 (dynamo's own counters, backend "eager":
tracing and guards are what is checked, not code generation).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from strata.kernels import ops
from strata.model.qwen3_next import Qwen3Next
from strata.model.state import DecodeState
from strata.model.tiny import init_random, tiny_args

torch.set_num_threads(1)


@torch._dynamo.config.patch(suppress_errors=False)  # an engine in this process may have set it
def compiled_graphs(layers: int) -> dict:
    # Bind the kernels afresh: a Python wrapper left in `ops` by another test (a spy closing
    # over a growing list) would add guards of its own.
    ops.set_backend("auto", "cpu")
    args = tiny_args(num_hidden_layers=layers, num_experts=64, num_experts_per_tok=4,
                     eos_token_id=[0])
    model = init_random(Qwen3Next(args, with_mtp=True), seed=0).eval()
    model.fuse_for_inference(16)
    state = DecodeState(args, 3, 64, torch.float32, torch.device("cpu"), True, spare_rows=5)
    torch._dynamo.reset()
    counters.clear()
    model.compile_regions(lambda f: torch.compile(f, backend="eager", dynamic=None),
                          lambda f: torch.compile(f, backend="eager", dynamic=True))
    for kind, attrs in (("linear_attention", ("c_linear", "p_linear")),
                        ("full_attention", ("c_attn_pre", "c_attn_post", "p_attn_pre", "p_attn_post"))):
        layers = [m for m in model.layers if m.kind == kind]
        if kind == "full_attention":
            layers.append(model.mtp.layers[0])
        for attr in attrs:
            assert len({getattr(m, attr).__func__ for m in layers}) == 1, (kind, attr)
    with torch.no_grad():
        for ng, g in ((2, 1), (1, 4)):  # rows x top-4 < 64 experts: the routed path
            tokens = torch.arange(ng * g).view(ng, g) + 1
            gs, gp = torch.arange(ng), torch.full((ng,), 5)
            hidden, _, _, _ = model.verify_window(tokens, gs, gp, 64, state)
            model.mtp_window(hidden, tokens, gs, gp, 64, state, with_logits=False)
        for n in (8,):
            model.prefill(torch.arange(n) + 1, 0, 0, state, length=torch.tensor([n - 1]), ctx=32)
    model.compile_regions(None, None)
    return {"graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values())}


@pytest.mark.slow
def test_compiled_graphs_do_not_grow_with_depth():
    four = compiled_graphs(4)
    eight = compiled_graphs(8)
    assert four["graphs"] > 0
    assert eight == four, f"8 layers compiled {eight}, 4 layers {four}"


@torch._dynamo.config.patch(suppress_errors=False)
def test_prompt_chunks_of_any_length_compile_once():
    """The prompt-chunk regions compile with symbolic lengths: a chunk of another bucket (other
    chunk counts and padding in the chunked delta rule, which runs outside the compiled
    region) traces no new graph and recompiles nothing. When the rule's chunk loop was traced,
    every bucket recompiled the linear-attention region, MoE included (tens of seconds each at
    full depth)."""
    ops.set_backend("auto", "cpu")
    args = tiny_args(num_hidden_layers=2, eos_token_id=[0])
    model = init_random(Qwen3Next(args, with_mtp=False), seed=0).eval()
    state = DecodeState(args, 2, 512, torch.float32, torch.device("cpu"), False)
    torch._dynamo.reset()
    counters.clear()
    model.compile_regions(None, lambda f: torch.compile(f, backend="eager", dynamic=True))
    seen = []
    with torch.no_grad():
        for n in (16, 32, 64, 128, 256, 200):
            model.prefill(torch.arange(n) + 1, 0, 0, state, length=torch.tensor([n - 3]), ctx=n)
            seen.append((counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())))
    model.compile_regions(None, None)
    assert seen[0][0] > 0
    assert seen[-1] == seen[1], f"graphs and recompiles after each length: {seen}"


def test_programmatic_launches_only_where_graphs_replay_on_hopper(monkeypatch):
    """Compiled regions launch their kernels programmatically (inductor's triton.enable_pdl)
    only on CUDA sm_90+ with graphs; TORCHINDUCTOR_ENABLE_PDL wins either way, and
    compiled_functions sets the process-wide switch it reports."""
    import torch._inductor.config as inductor_config

    from strata.engine import compiling

    if not hasattr(inductor_config.triton, "enable_pdl"):
        pytest.skip("this torch's inductor has no triton.enable_pdl")
    monkeypatch.delenv(compiling.PDL_ENV, raising=False)
    assert not compiling.pdl_default(torch.device("cpu"))
    if not torch.cuda.is_available():
        assert not compiling.pdl_default(torch.device("cuda"))
    else:
        hopper = torch.cuda.get_device_capability()[0] >= 9 and not torch.version.hip
        assert compiling.pdl_default(torch.device("cuda")) == hopper
        assert not compiling.pdl_default(torch.device("cuda"), graphs=False)
    for env, want in (("1", True), ("0", False)):
        monkeypatch.setenv(compiling.PDL_ENV, env)
        assert compiling.pdl_default(torch.device("cpu"), graphs=False) == want
    monkeypatch.setattr(inductor_config.triton, "enable_pdl", False)
    model = init_random(Qwen3Next(tiny_args(num_hidden_layers=2), with_mtp=False), seed=0).eval()
    monkeypatch.setenv(compiling.PDL_ENV, "1")
    compiling.compiled_functions(model, torch.device("cpu"))
    assert compiling.inductor_pdl()
    model.compile_regions(None, None)
