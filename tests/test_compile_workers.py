"""engine.compile_workers (strata/engine/compile_workers.py): processes that fill the compile
caches in parallel before the warm-up, each over the model cut to one layer of each kind."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from omegaconf import OmegaConf

from strata.config import ConfigError, EngineConfig, validate_engine
from strata.engine import compile_workers as cw
from strata.engine import compiling
from strata.model.tiny import tiny_args


def test_kinds_prefix_holds_every_layer_kind():
    # the embedded model's pattern: linear, linear, full, repeated
    assert cw.kinds_prefix(tiny_args(num_hidden_layers=6, full_attention_interval=3)) == 3
    # Qwen3-Next-80B-A3B: three linear-attention layers, then full attention, 48 deep
    assert cw.kinds_prefix(tiny_args(num_hidden_layers=48, full_attention_interval=4)) == 4
    # a dense-MLP layer is a kind of its own, wherever it first appears
    args = tiny_args(num_hidden_layers=8, full_attention_interval=4, mlp_only_layers=[5])
    assert cw.kinds_prefix(args) == 6
    assert cw.kinds_prefix(tiny_args(num_hidden_layers=1)) == 1


def _graph(x):
    return x * 2 + 1


def test_sharded_backends_number_graphs_across_functions(monkeypatch):
    """Every backend a worker makes shares one count of the graphs dynamo hands them; worker r
    of W compiles those numbered r mod W (here: recorded instead of compiled) and runs the
    others as traced, with the same results."""
    handed = []

    def fake_inductor(self, gm, example_inputs):
        handed.append(self.rank)
        return gm.forward

    monkeypatch.setattr(torch._TorchCompileInductorWrapper, "__call__", fake_inductor)
    torch._dynamo.reset()
    told = []
    make, tally = cw.sharded_backends(rank=1, world=2, handled=told.append)
    f = torch.compile(lambda x: x.sin() + 1, dynamic=False, backend=make(False, None))
    g = torch.compile(lambda x: x.cos() * 2, dynamic=False,
                      backend=make(None, compiling.PROMPT_REGION_OPTIONS))
    xs = [torch.randn(n) for n in (3, 5, 7)]
    for x in xs:  # graphs in order: f3 g3 f5 g5 f7 g7 (static shapes: one per size)
        assert torch.equal(f(x), x.sin() + 1) and torch.equal(g(x), x.cos() * 2)
    assert tally == [3, 3] and told == [1, 2, 3]  # numbers 1, 3, 5: all g's, each reported
    assert handed == [1, 1, 1]
    torch._dynamo.reset()


def test_prompt_regions_compile_untiled_with_or_without_workers():
    """The prompt-chunk regions (symbolic lengths) get PROMPT_REGION_OPTIONS, every region
    inductor's deterministic mode, from torch.compile's own inductor and from the workers'
    backends alike (the options are in the cache keys: the engine must look up what the
    workers compiled)."""
    from strata.model.qwen3_next import Qwen3Next

    prompt, window = compiling.region_options(True), compiling.region_options(False)
    assert prompt == {"deterministic": True, "triton.max_tiles": 1}
    assert window == {"deterministic": True}
    # valid inductor options: the wrapper rejects an unknown key
    w = torch._TorchCompileInductorWrapper(None, prompt, True)
    assert w.config == prompt
    asked = []

    def backend(dynamic, options):
        asked.append((dynamic, options))
        return "eager"

    model = Qwen3Next(tiny_args(num_hidden_layers=3, full_attention_interval=3), with_mtp=True)
    compiling.compiled_functions(model, backend=backend)
    assert (True, prompt) in asked and (None, window) in asked
    assert all(o in (window, prompt) for _, o in asked)
    assert all(o == window for d, o in asked if d is None)  # windows: no prompt options
    # the workers' backends and the engine's awaiting one build the same wrapper
    make, _ = cw.sharded_backends(rank=0, world=2)
    sharded = make(True, prompt)
    awaiting = cw.PlannedWorkers(cw.WorkerPlan(0, 1, 0.0), start=None).backend(True, prompt)
    assert sharded.config == awaiting.config == w.config
    assert sharded.dynamic == awaiting.dynamic == w.dynamic


class _Loaded:
    def __init__(self, layers: int, load_args: dict):
        self.args = tiny_args(num_hidden_layers=layers, full_attention_interval=3)
        from strata.model.qwen3_next import Qwen3Next
        self.model = Qwen3Next(self.args, with_mtp=True)
        self.dtype, self.has_mtp, self.load_args = torch.float32, True, load_args


def test_plan_workers_auto_starts_none_on_the_cpu_and_counts_what_is_asked():
    loaded, ecfg = _Loaded(6, {"path": "x"}), EngineConfig()
    cpu = torch.device("cpu")
    plan = cw.plan_workers(None, loaded, ecfg, cpu, n_slots=2, max_context=64)
    assert plan.world == 0 and "off CUDA" in plan.reason and plan.layers == 3
    assert cw.plan_workers(0, loaded, ecfg, cpu, 2, 64).world == 0
    plan = cw.plan_workers(2, loaded, ecfg, cpu, 2, 64)
    assert plan.world == 2 and plan.mib > cw.WORKER_OVERHEAD_MIB
    # a model not built by load_checkpoint has nothing to rebuild from
    assert cw.plan_workers(2, _Loaded(6, {}), ecfg, cpu, 2, 64).world == 0
    # a worker's model keeps only the prefix: half the layers, less than the whole model
    whole = sum(p.numel() * 4 for p in loaded.model.parameters()) / 2**20
    assert plan.mib - cw.WORKER_OVERHEAD_MIB < whole


@pytest.mark.parametrize("room, asked, world", [(1.5, None, 0), (1.5, 1, 1), (3.5, None, 3),
                                                (9.0, None, 4), (0.5, 2, 0)])
def test_plan_workers_fit_the_devices_free_memory_and_auto_never_starts_one(
        monkeypatch, room, asked, world):
    """Free memory above the reserve for `room` workers: auto takes what fits up to four (16
    cores), but never a lone worker, which compiles every graph the warm-up then waits for (an
    H100 at 24 FP8 80B layers had room for one, which ran out of memory beside the engine)."""
    loaded, ecfg = _Loaded(6, {"path": "x"}), EngineConfig()
    mib = cw.plan_workers(2, loaded, ecfg, torch.device("cpu"), 2, 64).mib
    free = (ecfg.vram_reserve_mib + room * mib) * 2**20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 8 * free))
    monkeypatch.setattr(cw.os, "cpu_count", lambda: 16)
    plan = cw.plan_workers(asked, loaded, ecfg, torch.device("cuda", 0), 2, 64)
    assert plan.world == world, plan
    if world == 0:
        assert "MiB are free above the reserve" in plan.reason


def test_auto_starts_none_on_fewer_than_eight_cores(monkeypatch):
    loaded, ecfg = _Loaded(6, {"path": "x"}), EngineConfig()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**50, 2**51))
    monkeypatch.setattr(cw.os, "cpu_count", lambda: 7)
    plan = cw.plan_workers(None, loaded, ecfg, torch.device("cuda", 0), 2, 64)
    assert plan.world == 0 and "auto needs two workers (7 cores, 4 a worker)" in plan.reason
    assert cw.plan_workers(2, loaded, ecfg, torch.device("cuda", 0), 2, 64).world == 2


@pytest.mark.parametrize("other", [dict(stages=2), dict(expert_cache_mib=64)])
def test_compile_workers_refused_with_stages_and_the_expert_cache(other):
    e = OmegaConf.structured(EngineConfig)
    for k, v in other.items():
        setattr(e, k, v)
    e.compile_workers = None  # auto: starts none there, no error
    validate_engine(e)
    e.compile_workers = 0
    validate_engine(e)
    e.compile_workers = 2
    with pytest.raises(ConfigError, match=r"^engine.compile_workers: .*compile_workers=0 or null"):
        validate_engine(e)


WORKERS_RUN = """
import dataclasses, json, torch
from strata.config import EMBEDDED_MODEL_DIR, EngineConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.model.loader import load_checkpoint

if __name__ == "__main__":
    loaded = load_checkpoint(EMBEDDED_MODEL_DIR, load_format="dummy", log=lambda s: None)
    ecfg = dataclasses.replace(EngineConfig(), mode="solo", spec=2, compile="on",
                               compile_workers=2, prefill_buckets=[16], max_context=64,
                               context_tier_min=32)
    logs = []
    eng = Engine(loaded, ecfg, torch.device("cpu"), log=logs.append)
    eng.add_request(Request("r", [5, 9, 11, 3, 7], SamplingParams(max_tokens=6, stop_at_eos=False),
                            arrival_step=0, stream_text=False))
    while eng.has_work():
        eng.step()
    print(json.dumps({"logs": logs, "compiled": eng.warmup_done.compiled_graphs,
                      "cached": eng.warmup_done.cached_graphs,
                      "emitted": len(eng.requests["r"].emitted)}))
"""


@pytest.mark.slow
def test_workers_leave_every_warmup_graph_in_the_compile_cache(tmp_path):
    """Two workers over the first 3 of the embedded model's 6 layers compile the warm-up's
    graphs with inductor (on the CPU: C++); the engine's own warm-up, beside them, then loads
    the graphs it traces from the cache, every one, and the engine runs. In a process
    of its own, as an engine starts (this one's torch state is the earlier tests')."""
    import json
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(WORKERS_RUN)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    text = "\n".join(got["logs"])
    assert "compile workers: 2 processes compile the warm-up's graphs beside it, over the first " \
        "3 layers" in text, text
    assert "WARNING" not in text, text
    # every graph: the workers number the graphs as the engine does (a graph AOTAutograd had
    # dynamo trace again with a float specialised, which a worker running it eagerly did not,
    # shifted a worker's numbering by one: compiling.py specialises floats)
    assert got["compiled"] > 0 and got["cached"] == got["compiled"], text
    assert got["emitted"] == 6


def test_a_failed_worker_is_a_warning_and_the_warmup_compiles_alone(monkeypatch):
    """A worker that cannot build its model (here: a checkpoint path that is gone) reports why;
    the engine warns, naming it, and its own warm-up compiles everything (here with dynamo's
    eager backend: tracing without code generation, for speed)."""
    import torch._dynamo

    from strata.config import EMBEDDED_MODEL_DIR
    from strata.engine.llm_engine import Engine
    from strata.model.loader import load_checkpoint

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda f=None, **kw: compile_(f, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    loaded = load_checkpoint(EMBEDDED_MODEL_DIR, load_format="dummy", log=lambda s: None)
    loaded.load_args["path"] = "/nonexistent/strata-checkpoint"
    ecfg = dataclasses.replace(EngineConfig(), mode="solo", spec=2, compile="on",
                               compile_workers=1, prefill_buckets=[16], max_context=64,
                               context_tier_min=32)
    logs: list[str] = []
    eng = Engine(loaded, ecfg, torch.device("cpu"), log=logs.append)
    warnings = [line for line in logs if line.startswith("WARNING")]
    assert len(warnings) == 1, logs
    assert "compile worker failed" in warnings[0] and "/nonexistent/strata-checkpoint" in warnings[0]
    assert eng.warmup_done.compiled_graphs > 0 and eng.warmup_done.cached_graphs == 0
    eng.close()
    torch._dynamo.reset()


def _engine_inputs(workers: int):
    from strata.config import EMBEDDED_MODEL_DIR
    from strata.model.loader import load_checkpoint

    loaded = load_checkpoint(EMBEDDED_MODEL_DIR, load_format="dummy", log=lambda s: None)
    ecfg = dataclasses.replace(EngineConfig(), mode="solo", spec=2, compile="on",
                               compile_workers=workers, prefill_buckets=[16], max_context=64,
                               context_tier_min=32)
    return loaded, ecfg


def test_an_engine_that_fails_to_build_starts_no_workers(monkeypatch):
    """The workers start with the warm-up, not while the engine is built: when a part built
    after the compiled functions raises, no worker process is left running."""
    import multiprocessing

    from strata.engine import llm_engine

    def broken(*a, **kw):
        raise RuntimeError("runner build failed")

    monkeypatch.setattr(llm_engine.ModelRunner, "for_engine", broken)
    loaded, ecfg = _engine_inputs(1)
    with pytest.raises(RuntimeError, match="runner build failed"):
        llm_engine.Engine(loaded, ecfg, torch.device("cpu"), log=lambda s: None)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("strata-compile")]


def test_workers_that_fail_to_start_are_a_warning_and_the_warmup_compiles_alone(monkeypatch):
    """A start that raises (here: the process spawn) is one warning naming why; the warm-up
    compiles every graph itself (dynamo's eager backend here, for speed)."""
    import torch._dynamo

    from strata.engine import compile_workers
    from strata.engine.llm_engine import Engine

    def no_spawn(self, *a, **kw):
        raise OSError("no processes left")

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda f=None, **kw: compile_(f, **{**kw, "backend": "eager"}))
    monkeypatch.setattr(compile_workers.WorkerGroup, "__init__", no_spawn)
    torch._dynamo.reset()
    loaded, ecfg = _engine_inputs(1)
    logs: list[str] = []
    eng = Engine(loaded, ecfg, torch.device("cpu"), log=logs.append)
    warnings = [line for line in logs if line.startswith("WARNING")]
    assert len(warnings) == 1, logs
    assert "failed to start" in warnings[0] and "no processes left" in warnings[0]
    assert eng.warmup_done.compiled_graphs > 0
    eng.close()
    torch._dynamo.reset()


@pytest.mark.parametrize("ng,g", [(1, 1), (3, 2)])
def test_the_attention_regions_pass_the_same_strides_compiled_or_eager(ng, g):
    """What the attention's second region takes from its first (q, and the q/gate projection)
    has the same sizes and strides whether the first ran compiled or eagerly (a compile worker
    runs the graphs it does not own eagerly), so the second traces the same graph, with the
    same cache key, behind either. The output gate, a view with new head dims, did not: at one
    row its size-1 dims took the projection's row stride compiled and its own row size eagerly.
    (v goes to the K/V write, which runs outside the compiled regions.)"""
    from strata.model.qwen3_next import Attention, Qwen3Next
    from strata.model.tiny import init_random

    model = init_random(Qwen3Next(tiny_args(num_hidden_layers=4), with_mtp=True), seed=0).eval()
    model.fuse_for_inference(16)
    layer = next(m for m in model.layers if m.kind == "full_attention")
    assert isinstance(layer.self_attn, Attention) and layer.self_attn.w_qkv is not None
    x = torch.randn(ng, g, model.args.hidden_size)
    cos, sin = model.rope(torch.arange(ng) * 5, g)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = layer.window_attn_pre(x, cos, sin)
        compiled = torch.compile(type(layer).window_attn_pre, backend="inductor",
                                 fullgraph=True)(layer, x, cos, sin)
    torch._dynamo.reset()
    for e, c in ((eager[0], compiled[0]), (eager[3], compiled[3])):  # q, qg
        assert (e.shape, e.stride(), e.storage_offset()) == (c.shape, c.stride(), c.storage_offset())
        assert torch.allclose(e, c, atol=1e-5)


def test_memory_formats_pickle_by_one_name_in_every_process():
    """Inductor's cache keys pickle memory formats; by default pickle names one through the first
    module in sys.modules that holds `torch`, which differs between processes. strata pickles
    them through one function (strata/engine/compiling.py), and they load back as themselves."""
    import pickle

    import strata.engine.compiling  # noqa: F401  (registers the reducer)

    for fmt in (torch.contiguous_format, torch.channels_last, torch.preserve_format):
        data = pickle.dumps(fmt)
        assert b"memory_format_named" in data and b"__main__" not in data
        assert pickle.loads(data) is fmt
