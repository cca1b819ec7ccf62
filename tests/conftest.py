"""Shared fixtures: tiny random qwen3_next checkpoints, written once per session into tmp dirs.

CONFIGS differ in attention heads, full_attention_interval, experts and top-k, DeltaNet
value/key head ratio, norm_topk_prob, tied embeddings and dense (mlp_only) layers, so that the
parity tests see every branch of the model. Helpers used by several test files live here too
(`from conftest import rel_err`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from strata.model.tiny import make_tiny_random

CONFIGS: dict[str, dict] = {
    # 3 DeltaNet + 1 attention, 4 q / 2 kv heads, 8 experts top-2 renormalised,
    # 4 DeltaNet value heads over 2 key heads.
    "base": dict(),
    # Interval 2 (l, f, l, f), 2 q / 1 kv heads of 32, half rotary, 4 experts top-1 without
    # renormalisation, equal DeltaNet key/value heads, tied embeddings.
    "tied": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 partial_rotary_factor=0.5, full_attention_interval=2, num_experts=4,
                 num_experts_per_tok=1, norm_topk_prob=False, linear_num_key_heads=2,
                 linear_num_value_heads=2, tie_word_embeddings=True, seed=1),
    # Interval 3 over 3 layers, 6 q / 3 kv heads of 8, 16 experts top-4 without
    # renormalisation, a dense MLP layer, DeltaNet 3 value heads over 1 key head, Dv != Dk.
    "wide": dict(num_hidden_layers=3, full_attention_interval=3, num_attention_heads=6,
                 num_key_value_heads=3, head_dim=8, num_experts=16, num_experts_per_tok=4,
                 norm_topk_prob=False, mlp_only_layers=[1], linear_num_key_heads=1,
                 linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=12,
                 moe_intermediate_size=16, seed=2),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict[str, Path]:
    """name -> checkpoint directory (float32, with mtp.* and tokenizer.json), for CONFIGS."""
    out = {}
    for name, overrides in CONFIGS.items():
        kw = dict(overrides)
        seed = kw.pop("seed", 0)
        out[name] = make_tiny_random(tmp_path_factory.mktemp(f"ckpt-{name}"), seed=seed, **kw)
    return out


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_ckpts) -> Path:
    """The base configuration's checkpoint (read-only: copy it before changing anything)."""
    return tiny_ckpts["base"]


@pytest.fixture(scope="session")
def tiny_ckpt_no_mtp(tmp_path_factory) -> Path:
    """A checkpoint without mtp.* tensors."""
    return make_tiny_random(tmp_path_factory.mktemp("ckpt-nomtp"), seed=3, with_mtp=False)


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    """A fresh writable copy of the base checkpoint, for tests that damage it."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for the module: these tiny models gain nothing from more, and on a
    busy 2-core machine OpenMP spin-waiting makes 2 threads several times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gpu_kernel_test(fn):
    """Marks a test of the cyext GPU kernels: marker `gpu`, skipped without a CUDA/HIP device
    or without the strata_cuda extension."""
    from strata.kernels import cyext_ops

    marks = [pytest.mark.gpu,
             pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device"),
             pytest.mark.skipif(cyext_ops.gpu_platform() is None,
                                reason="strata_cuda extension not built")]
    for mark in reversed(marks):
        fn = mark(fn)
    return fn


def cpu_engine_config(model_dir, max_context: int = 256, **engine_knobs):
    """A StrataConfig for an engine on the CPU over `model_dir`, with engine knobs set."""
    from omegaconf import OmegaConf

    from strata.config import StrataConfig

    cfg = OmegaConf.structured(StrataConfig)
    cfg.device = "cpu"
    cfg.model.path = str(model_dir)
    cfg.engine.max_context = max_context
    for k, v in engine_knobs.items():
        setattr(cfg.engine, k, v)
    return cfg


def run_cohort(eng, requests, max_steps: int) -> None:
    """Add the requests to the engine and step it until it has no work (at most max_steps
    steps); fail if it has not finished them."""
    for r in requests:
        eng.add_request(r)
    for _ in range(max_steps):
        if not eng.has_work():
            break
        eng.step()
    assert not eng.has_work(), "engine did not finish the cohort"


def checkpoint_error(path, *needles, **load_kw) -> str:
    """Load `path`, expect one clear CheckpointError (no chained traceback) whose message holds
    every needle; returns the message."""
    from strata.model.config import CheckpointError
    from strata.model.loader import load_checkpoint

    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(path, log=lambda _m: None, **load_kw)
    msg = str(ei.value)
    for n in needles:
        assert str(n) in msg, (n, msg)
    e = ei.value
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)
    return msg


def edit_tensors(path: Path, fn) -> None:
    """Apply fn to the state dict of path/model.safetensors and write it back."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


#: The fast subset (`pytest -m "not slow"`, under 3 minutes on 2 cores) runs the first few
#: variants of these parametrized tests; the others are marked slow and run in the full suite
#: (CI). Each entry: the test's node id without its parameters -> the variants kept, in
#: collection order. Chosen by `pytest -m "not slow" --durations=0`: the heaviest parametrized
#: tests, each keeping the variants that cover its distinct paths.
FAST_VARIANTS: dict[str, int] = {
    "tests/test_expert_cache.py::test_tokens_identical_at_every_budget": 3,
    "tests/test_expert_cache.py::test_moe_counting_under_torch_compile": 1,
    "tests/test_sim_acceptance_transfer.py::test_acceptance_from_8_requests_holds_on_the_rest": 1,
    "tests/test_sim_hardware.py::test_every_shipped_preset_composes_and_predicts": 2,
    "tests/test_stages.py::test_two_stages_give_the_one_stage_tokens": 1,
    "tests/test_overlap.py::test_overlap_keeps_the_text_in_every_mode": 3,
    "tests/test_overlap.py::test_overlapped_traces_replay_exactly": 2,
    "tests/test_synthetic_acceptance.py::test_decisions_are_keyed_by_seed_and_position": 2,
    "tests/test_engine_warnings.py::test_stop_inside_an_accepted_group": 2,
    "tests/test_engine_warnings.py::test_eos_cuts_output": 1,
    "tests/test_engine_warnings.py::test_multi_token_stop_string_never_streams_its_text": 1,
    "tests/test_engine_warnings.py::test_single_token_stop_string_cuts_output": 1,
    "tests/test_engine_identity.py::test_solo_identity_with_graphs": 1,
    "tests/test_warmup_graphs.py::test_warmup_captures_then_requests_hit_and_the_sim_replays_it": 1,
    "tests/test_many_experts_identity.py::test_greedy_tokens_identical_in_every_mode": 1,
    "tests/test_engine_properties.py::test_committed_state_matches_recompute": 2,
}


def pytest_configure(config):
    """Under pytest-xdist (the README's `-n 2`), each worker takes its share of the cores, and
    so do the engines and scripts its tests start: torch's default of a thread per core in
    every worker oversubscribes them, and OpenMP's spin-waits then cost several times over."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ.setdefault("OMP_NUM_THREADS", threads)
        os.environ.setdefault("MKL_NUM_THREADS", threads)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    seen: dict[str, int] = {}
    for item in items:
        base = item.nodeid.split("[", 1)[0]
        keep = FAST_VARIANTS.get(base)
        if keep is None or "[" not in item.nodeid or item.get_closest_marker("slow"):
            continue
        seen[base] = seen.get(base, 0) + 1
        if seen[base] > keep:
            item.add_marker(pytest.mark.slow)
