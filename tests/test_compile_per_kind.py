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
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from strata.config import StrataConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.kernels import ops
from strata.model.qwen3_next import Qwen3Next
from strata.model.state import DecodeState
from strata.model.tiny import init_random, make_tiny_random, tiny_args

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


def _prompt_chunk_graphs(mtp_valid: bool) -> tuple[int, int]:
    """A 4-layer model's prompt chunk (a padded one: length < its bucket) and the MTP layer
    over it, the prompt regions compiled: (graphs traced, graph breaks)."""
    ops.set_backend("auto", "cpu")
    args = tiny_args(num_hidden_layers=4, num_experts=64, num_experts_per_tok=4, eos_token_id=[0])
    model = init_random(Qwen3Next(args, with_mtp=True), seed=0).eval()
    model.fuse_for_inference(16)
    state = DecodeState(args, 2, 128, torch.float32, torch.device("cpu"), True)
    torch._dynamo.reset()
    counters.clear()
    model.compile_regions(None, lambda f: torch.compile(f, backend="eager", dynamic=True))
    n, length = 8, torch.tensor([6])  # 8 rows x top-4 < 64 experts: the grouped path
    tokens, lane, start = torch.arange(n) + 1, torch.tensor([0]), torch.tensor([0])
    with torch.no_grad():
        hidden = model.prefill(tokens, lane, start, state, length=length, ctx=n)
        valid = torch.arange(n)[None] < length[:, None]
        model.mtp_window(hidden[None], tokens[None], lane, start, n, state, with_logits=False,
                         variant="prefill", valid=valid if mtp_valid else None)
    model.compile_regions(None, None)
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_prompt_regions_trace_whole_and_the_mtp_layer_shares_the_decoders_graphs():
    """The chunked gated delta rule is one opaque op in the linear layers' prompt region
    (ops.chunk_rule; a graph break around it split the region into four graphs), and the MTP
    layer gets the chunk's real rows as the decoder layers do, so its attention region runs
    their graph (without them it traced one of its own)."""
    graphs, breaks = _prompt_chunk_graphs(mtp_valid=True)
    assert breaks == 0, f"{breaks} graph breaks in the prompt regions"
    apart, _ = _prompt_chunk_graphs(mtp_valid=False)
    assert graphs == apart - 1, (graphs, apart)


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


def test_compiled_regions_use_inductors_deterministic_mode(monkeypatch):
    """Reductions get one configuration, not the fastest timed on a cold cache (so bf16 text
    cannot follow a timing): on unless TORCHINDUCTOR_DETERMINISTIC says otherwise, and in every
    region's inductor options, since dynamo resets inductor's process-wide flag after each
    frame it converts (shown here: a compile after the flag was set leaves it off)."""
    import torch._inductor.config as inductor_config

    from strata.engine import compiling

    monkeypatch.delenv(compiling.DETERMINISTIC_ENV, raising=False)
    assert compiling.deterministic_default()
    for env, want in (("1", True), ("0", False)):
        monkeypatch.setenv(compiling.DETERMINISTIC_ENV, env)
        assert compiling.deterministic_default() == want
        assert compiling.region_options(False)["deterministic"] is want
    monkeypatch.delenv(compiling.DETERMINISTIC_ENV, raising=False)
    monkeypatch.setattr(inductor_config, "deterministic", True)
    torch._dynamo.reset()
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    assert not inductor_config.deterministic  # why the flag cannot carry it
    torch._dynamo.reset()
    # what inductor sees while it compiles: each region's options, on every frame
    import torch._inductor.compile_fx as cfx
    seen, inner = [], cfx._InProcessFxCompile.codegen_and_compile

    def spy(*a, **kw):
        seen.append(inductor_config.deterministic)
        return inner(*a, **kw)

    monkeypatch.setattr(cfx._InProcessFxCompile, "codegen_and_compile", spy)
    monkeypatch.setattr(inductor_config, "force_disable_caches", True)  # codegen, not a cache hit
    f = torch.compile(lambda x: (x * x).sum(-1), options=compiling.region_options(False))
    g = torch.compile(lambda x: x.cumsum(0), options=compiling.region_options(True))
    f(torch.randn(3, 4)), g(torch.randn(5)), f(torch.randn(2, 4, 4))
    assert len(seen) >= 3 and all(seen)
    torch._dynamo.reset()


def specialize_one_run(model_path: str, one_apart: bool, device: str) -> tuple[int, int, dict]:
    """An engine (batch_mtp, two slots, compiled, warmed up) with engine.compile_specialize_one
    set: the graphs dynamo traced by the end of its warm-up and of three requests, and their
    tokens (one greedy, two sampled)."""
    torch._dynamo.reset()
    counters.clear()
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device, cfg.model.path = device, model_path
    cfg.engine.mode, cfg.engine.batch_mtp, cfg.engine.max_context = "batch", True, 256
    cfg.engine.slots, cfg.engine.compile, cfg.engine.prefill_buckets = 2, "on", [16, 32]
    cfg.engine.compile_specialize_one = one_apart
    eng = Engine.from_config(cfg, log=lambda s: None)
    warm = counters["stats"]["unique_graphs"]
    for i in range(3):
        eng.add_request(Request(f"r{i}", [5 + i, 9, 11 + i, 3, 7], SamplingParams(
            max_tokens=16, temperature=0.8 if i else 0.0, seed=i, stop_at_eos=False),
            arrival_step=i, stream_text=False))
    while eng.has_work():
        eng.step()
    tokens = {k: v.emitted for k, v in eng.requests.items()}
    eng.close()
    return warm, counters["stats"]["unique_graphs"], tokens


@pytest.mark.slow
def test_compile_specialize_one_off_compiles_fewer_graphs_for_the_same_tokens(monkeypatch,
                                                                                tmp_path):
    """engine.compile_specialize_one=false: a group or row count of 1 compiles no graphs of its
    own, so the warm-up traces fewer graphs (backend "eager": tracing, not code generation);
    the requests then trace none the warm-up did not, and emit the same tokens."""
    from strata.engine.compiling import specialize_one

    make_tiny_random(tmp_path, seed=0)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda f=None, **kw: compile_(f, **{**kw, "backend": "eager"}))
    try:
        runs = {one: specialize_one_run(str(tmp_path), one, "cpu") for one in (True, False)}
    finally:
        specialize_one(True)  # process-wide: leave torch's default for the other tests
        ops.set_backend("auto", "cpu")
    (warm_on, end_on, tok_on), (warm_off, end_off, tok_off) = runs[True], runs[False]
    assert warm_off < warm_on, runs
    assert (end_on, end_off) == (warm_on, warm_off), "requests compiled what the warm-up did not"
    assert tok_off == tok_on


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compile_specialize_one_off_changes_no_token_on_the_gpu(tmp_path):
    """The same with inductor's kernels and graphs on the GPU: generic 1-row kernels give the
    tokens the specialised ones give, and fewer graphs are compiled."""
    from strata.engine.compiling import specialize_one

    make_tiny_random(tmp_path, seed=0)
    try:
        runs = {one: specialize_one_run(str(tmp_path), one, "cuda") for one in (True, False)}
    finally:
        specialize_one(True)
        ops.set_backend("auto", "cpu")
    assert runs[False][0] < runs[True][0], runs
    assert runs[False][2] == runs[True][2]
