"""Greedy and sampled output is the same on every kernel backend built here (torch, cpu)."""

import itertools

import pytest
import torch
from omegaconf import OmegaConf

from strata.config import StrataConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.kernels import cyext_ops, ops
from strata.model.tiny import make_tiny_random

torch.set_num_threads(1)

BACKENDS = ["torch"] + (["cpu"] if cyext_ops.cpu_available() else [])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("backends"), seed=3, tokenizer=False,
                            max_position_embeddings=512)


def run(model_dir, backend, mode, batch_mtp, temperature):
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device, cfg.model.path, cfg.backend.name = "cpu", str(model_dir), backend
    cfg.engine.mode, cfg.engine.batch_mtp, cfg.engine.max_context = mode, batch_mtp, 256
    cfg.engine.slots = 4
    eng = Engine.from_config(cfg, log=lambda s: None)
    assert ops.backend() == backend
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        ids = torch.randint(1, 500, (6 + 5 * i,), generator=g).tolist()
        eng.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=10 + 3 * i, temperature=temperature,
                                                             seed=i, stop_at_eos=False),
                                arrival_step=2 * i, stream_text=False))
    while eng.has_work():
        eng.step()
    out = {k: v.emitted for k, v in eng.requests.items()}
    eng.close()
    ops.set_backend("torch", "cpu")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_backend_and_mode_gives_the_same_text(model_dir, temperature):
    ref = run(model_dir, "torch", "solo", False, temperature)
    for backend in BACKENDS:
        for mode, batch_mtp in (("solo", False), ("batch", False), ("batch", True)):
            assert run(model_dir, backend, mode, batch_mtp, temperature) == ref, (backend, mode, batch_mtp)


def test_auto_picks_the_built_cpu_kernels():
    name = ops.set_backend("auto", "cpu")
    try:
        assert name == ("cpu" if cyext_ops.cpu_available() else "torch")
    finally:
        ops.set_backend("torch", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or cyext_ops.gpu_platform() is None,
                    reason="needs a GPU and the cyext GPU extension")
def test_gpu_backends_and_modes_give_the_same_text(model_dir):
    """On the GPU (float32): the cyext kernels and the torch reference, in every mode, greedy
    and sampled, with CUDA graphs, serial and overlapped (engine.overlap: positions read on the
    device, outputs read one window late). Regions run uncompiled here, so the test takes
    seconds, not minutes of compiling (scripts/bench_engine.py checks greedy identity with them
    compiled)."""
    from strata.model.loader import load_checkpoint

    dev = torch.device("cuda")
    outs = {}
    for backend in ("torch", cyext_ops.gpu_platform()):
        ops.set_backend(backend, "cuda")
        loaded = load_checkpoint(str(model_dir), "float32", dev, log=lambda s: None)
        try:
            for temperature, mode, batch_mtp, overlap in itertools.product(
                    (0.0, 0.8), ("solo", "batch"), (False, True), (False, True)):
                if mode == "solo" and batch_mtp:
                    continue
                ecfg = OmegaConf.structured(StrataConfig).engine
                ecfg.mode, ecfg.batch_mtp, ecfg.max_context, ecfg.slots = mode, batch_mtp, 256, 4
                ecfg.compile, ecfg.overlap = "off", overlap
                eng = Engine(loaded, ecfg, dev, log=lambda s: None)
                g = torch.Generator().manual_seed(0)
                for i in range(4):
                    ids = torch.randint(1, 500, (6 + 5 * i,), generator=g).tolist()
                    eng.add_request(Request(f"r{i}", ids, SamplingParams(
                        max_tokens=10 + 3 * i, temperature=temperature, seed=i, stop_at_eos=False),
                        arrival_step=2 * i, stream_text=False))
                while eng.has_work():
                    eng.step()
                outs[(backend, temperature, mode, batch_mtp, overlap)] = {
                    k: v.emitted for k, v in eng.requests.items()}
                eng.close()
        finally:
            ops.set_backend("torch", "cpu")
    for key, got in outs.items():
        backend, temperature = key[:2]
        assert got == outs[("torch", temperature, "solo", False, False)], key


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or cyext_ops.gpu_platform() is None
                    or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper-class GPU and the cyext GPU extension")
def test_programmatic_launches_of_compiled_regions_change_no_token(model_dir, monkeypatch):
    """Compiled regions with inductor's triton.enable_pdl (the default on sm_90+ with graphs)
    and without it: the same greedy and sampled tokens in batch_mtp with graphs (bf16: the
    kernels are the same, only their launches overlap)."""
    import torch._dynamo

    from strata.engine import compiling

    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv(compiling.PDL_ENV, pdl)
        torch._dynamo.reset()
        cfg = OmegaConf.structured(StrataConfig)
        cfg.device, cfg.model.path, cfg.model.dtype = "cuda", str(model_dir), "bfloat16"
        cfg.engine.mode, cfg.engine.batch_mtp, cfg.engine.max_context = "batch", True, 256
        cfg.engine.slots, cfg.engine.compile, cfg.engine.prefill_buckets = 2, "on", [16, 32]
        eng = Engine.from_config(cfg, log=lambda s: None)
        assert compiling.inductor_pdl() == (pdl == "1")
        for i in range(3):
            eng.add_request(Request(f"r{i}", [5 + i, 9, 11 + i, 3, 7], SamplingParams(
                max_tokens=16, temperature=0.8 if i else 0.0, seed=i, stop_at_eos=False),
                arrival_step=i, stream_text=False))
        while eng.has_work():
            eng.step()
        outs[pdl] = {k: v.emitted for k, v in eng.requests.items()}
        eng.close()
    ops.set_backend("torch", "cpu")
    assert outs["1"] == outs["0"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_traced_serial_windows_carry_their_device_seconds(model_dir, tmp_path):
    """A serial engine's traced windows carry `dev` (CUDA events) within their `dur` (the
    host's wall of the call): the cost profile prices windows on `dev` and the rest as the
    window's host share, which engine.overlap hides. Overlapped windows' `dur` is already
    device time, and they carry no `dev`."""
    import json

    from strata.model.loader import load_checkpoint

    dev = torch.device("cuda")
    loaded = load_checkpoint(str(model_dir), "float32", dev, log=lambda s: None)
    for overlap in (False, True):
        ecfg = OmegaConf.structured(StrataConfig).engine
        ecfg.mode, ecfg.batch_mtp, ecfg.max_context, ecfg.slots = "batch", True, 256, 2
        ecfg.compile, ecfg.overlap = "off", overlap
        path = tmp_path / f"trace_{overlap}.jsonl"
        eng = Engine(loaded, ecfg, dev, log=lambda s: None, trace_path=path)
        for i in range(2):
            eng.add_request(Request(f"r{i}", [5 + i, 7, 9], SamplingParams(
                max_tokens=12, stop_at_eos=False), stream_text=False))
        while eng.has_work():
            eng.step()
        eng.close()
        wins = [e for e in map(json.loads, path.read_text().splitlines()) if e["ev"] == "window"]
        assert wins
        if overlap:
            assert all("dev" not in e for e in wins)
        else:
            assert all(0 < e["dev"] <= e["dur"] for e in wins)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or cyext_ops.gpu_platform() is None,
                    reason="needs CUDA and the cyext GPU extension")
@pytest.mark.parametrize("prefill_slots", [1, 3])
def test_gpu_prompt_chunks_past_the_last_bucket_leave_the_captured_chunks_their_buffer(
        model_dir, prefill_slots):
    """A chunk longer than the last prefill bucket runs eagerly on tokens of its own: the
    bucketed chunks captured before it (warm-up) still read the buffer the runner writes, so
    prompts after it get the tokens they get with graphs off (one and several slots a chunk)."""
    outs = {}
    for graphs in (False, True):
        cfg = OmegaConf.structured(StrataConfig)
        cfg.device, cfg.model.path, cfg.model.dtype = "cuda", str(model_dir), "float32"
        e = cfg.engine
        e.mode, e.batch_mtp, e.max_context, e.slots, e.compile = "batch", True, 256, 3, "off"
        e.graphs, e.warmup = graphs, "on"
        e.prefill_buckets, e.prefill_chunk, e.prefill_slots = [8, 16], 40, prefill_slots
        eng = Engine.from_config(cfg, log=lambda s: None)
        g = torch.Generator().manual_seed(1)
        for i, (plen, arrival) in enumerate(((40, 0), (35, 0), (7, 6), (12, 6), (5, 6))):
            ids = torch.randint(1, 500, (plen,), generator=g).tolist()
            eng.add_request(Request(f"r{i}", ids, SamplingParams(max_tokens=6, stop_at_eos=False),
                                    arrival_step=arrival, stream_text=False))
        while eng.has_work():
            eng.step()
        outs[graphs] = {k: v.emitted for k, v in eng.requests.items()}
        eng.close()
    assert outs[True] == outs[False]
