"""Fewer graphs in the warm-up: what strata/engine/compiling.py does to that end.

A prompt chunk passes its lanes to the samplers as a column of its meta rows (stride 4), a
window as a contiguous row, and dynamo guards on strides, so each sampler traced a graph per
segment count for prompt chunks (one slot a chunk, and several with engine.prefill_slots > 1)
beside the windows' graphs of the same shapes. contiguous_lanes gives the compiled samplers
contiguous lanes (a copy only where they are not), so the chunks' samples run the windows'
graphs: four graphs fewer (two samplers x two segment counts). It also passes a view's logits
(a window's targets) detached: dynamo guards on a view's base, so the drafts' logits (no view)
traced graphs of their own, two fewer (one per sampler). And every sampler call passes the
offset the targets take (1), the drafts and a chunk's first token the position before theirs:
the samplers specialise on the int, two graphs fewer.

duck_shape(False): a prompt bucket of 16 rows was tied to a size of 16 (the tiny model's head
dimension) and the bucket of 32 recompiled the prompt regions, four graphs fewer (the DeltaNet
and attention prompt regions x two segment counts).

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
from strata.model.qwen3_next import Qwen3Next
from strata.model.state import DecodeState
from strata.model.tiny import init_random, make_tiny_random, tiny_args

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


@torch._dynamo.config.patch(suppress_errors=False)
def test_view_logits_sample_with_the_graph_of_their_shape(eager_compile):
    """A window's targets reach the sampler as a view (its logits reshaped), its drafts as
    logits of their own: the same shapes, one graph each."""
    from strata.engine.sampling import sample_plain_lanes

    temperature, seed = torch.tensor([0.0, 0.7, 1.0]), torch.tensor([1, 2, 3])
    traced = {}
    for name, wrap in (("raw", lambda f: f), ("wrapped", compiling.contiguous_lanes)):
        torch._dynamo.reset()
        counters.clear()
        sampler = wrap(torch.compile(sample_plain_lanes, dynamic=None))
        with torch.no_grad():
            for ng, rows in ((1, 1), (1, 2), (2, 2)):  # the row count dynamic from the second
                lanes, pos0 = torch.arange(ng), torch.tensor([7, 9][:ng])
                y = torch.randn(ng, rows, 40)
                want = sampler(y.reshape(ng * rows, -1), lanes, pos0, rows, 1, temperature, seed)
                got = sampler(y.reshape(ng * rows, -1).clone(), lanes, pos0, rows, 1,
                              temperature, seed)
                assert torch.equal(got, want)
        traced[name] = graphs()
    assert traced["wrapped"] == 3, traced
    assert traced["raw"] > traced["wrapped"], traced  # what the wrapper saves


@torch._dynamo.config.patch(suppress_errors=False)
def test_a_bucket_equal_to_a_head_size_recompiles_no_prompt_region(monkeypatch, eager_compile):
    """Prompt chunks of 16, 32 and 64 rows (16: the tiny model's head dimension) through the
    regions compiled_functions compiles: the first bucket traces every prompt graph, the others
    none. With torch's duck shaping the 16-row bucket shared the head dimension's symbol, the
    regions fixed it at 16, and the 32-row bucket recompiled the DeltaNet region and both
    attention ones."""
    import torch.fx.experimental._config as fx_config

    monkeypatch.setattr(fx_config, "use_duck_shape", True)  # torch's default, restored after
    ops.set_backend("auto", "cpu")
    args = tiny_args(num_hidden_layers=4, num_experts=64, num_experts_per_tok=4, eos_token_id=[0])
    assert args.head_dim == 16
    model = init_random(Qwen3Next(args, with_mtp=True), seed=0).eval()
    model.fuse_for_inference(16)
    state = DecodeState(args, 2, 128, torch.float32, torch.device("cpu"), True)
    torch._dynamo.reset()
    counters.clear()
    compiling.compiled_functions(model, torch.device("cpu"))
    seen = []
    lane, start = torch.tensor([0]), torch.tensor([0])
    with torch.no_grad():
        for n in (16, 32, 64):  # padded chunks, as the engine runs them
            tokens, length = torch.arange(n) + 1, torch.tensor([n - 3])
            hidden = model.prefill(tokens, lane, start, state, length=length, ctx=n)
            valid = torch.arange(n)[None] < length[:, None]
            model.mtp_window(hidden[None], tokens[None], lane, start, n, state, with_logits=False,
                             variant="prefill", valid=valid)
            seen.append(graphs())
    model.compile_regions(None, None)
    assert seen[0] > 0
    assert seen[1:] == seen[:1] * 2, f"graphs after each bucket: {seen}"


def test_every_sampler_call_samples_at_offset_one(monkeypatch, tmp_path):
    """The samplers specialise on their int offset, so the targets (offset 1: y_j at p + j + 1),
    the drafts and a chunk's first token all pass offset 1 (the position before theirs) and
    share the targets' graphs: two graphs fewer than drafts at offset 0. Solo spec 3 drafts a
    chain (a draft sampled inside the window) as well as after the window and after a chunk."""
    from strata.engine.verifier import Verifier

    offsets = []
    sample = Verifier._sample

    def spy(self, logits, lanes, pos0, rows_per, offset, filtered, token=None):
        offsets.append(offset)
        return sample(self, logits, lanes, pos0, rows_per, offset, filtered, token)

    monkeypatch.setattr(Verifier, "_sample", spy)
    make_tiny_random(tmp_path, seed=0, num_experts=8, num_experts_per_tok=2)
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device, cfg.model.path = "cpu", str(tmp_path)
    cfg.engine.mode, cfg.engine.spec, cfg.engine.max_context = "solo", 3, 128
    eng = Engine.from_config(cfg, log=lambda line: None)
    eng.add_request(Request("r", [5, 9, 11, 3, 7], SamplingParams(
        max_tokens=6, temperature=0.8, seed=1, stop_at_eos=False), arrival_step=0,
        stream_text=False))
    while eng.has_work():
        eng.step()
    assert len(eng.requests["r"].emitted) == 6
    eng.close()
    assert len(offsets) > 4 and set(offsets) == {1}, offsets


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
    import torch.fx.experimental._config as fx_config

    make_tiny_random(tmp_path, seed=0, num_experts=64, num_experts_per_tok=4)
    new = engine_run(str(tmp_path))
    torch._dynamo.reset()
    with monkeypatch.context() as m:  # as before: the samplers take the chunk's lanes column
        m.setattr(compiling, "contiguous_lanes", lambda f: f)
        old = engine_run(str(tmp_path))
    torch._dynamo.reset()
    with monkeypatch.context() as m:  # torch's duck shaping
        m.setattr(compiling, "duck_shape", lambda on: None)
        m.setattr(fx_config, "use_duck_shape", True)
        duck = engine_run(str(tmp_path))
    (warm_new, end_new, tok_new), (warm_old, end_old, tok_old) = new, old
    # two samplers x two segment counts (one slot a chunk, two), and their drafts' graphs
    assert warm_new == warm_old - 6, (warm_new, warm_old)
    # the DeltaNet and attention prompt regions x two segment counts
    assert warm_new == duck[0] - 4, (warm_new, duck[0])
    assert (end_new, end_old, duck[1]) == (warm_new, warm_old, duck[0]), \
        "requests compiled what the warm-up did not"
    assert tok_new == tok_old == duck[2]
    assert all(len(t) == 12 for t in tok_new.values())
