"""Greedy tokens are identical in every mode on a many-expert model.

64 experts, top-4: more experts than model.moe_dense_experts (16), and every window's rows x 4
stay below 64, so the MoE blocks take the routed-experts path (the gathered experts today, the
grouped-by-expert kernel where it lands), not the dense one. Solo, plain batch and batch_mtp,
graphs off and on, must emit the same tokens for the same requests.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import cpu_engine_config, run_cohort

from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.model.fp8 import dense_fp8_layers
from strata.model.qwen3_next import GatedDeltaNet
from strata.model.tiny import make_tiny_random

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("many-experts"), seed=5, tokenizer=False,
                            num_experts=64, num_experts_per_tok=4, moe_intermediate_size=16)


def cohort() -> list[Request]:
    rng = random.Random(11)
    return [Request(f"r{i}", [rng.randrange(1, 512) for _ in range(2 + 5 * i)],
                    SamplingParams(max_tokens=10 + 2 * i, stop_at_eos=False), arrival_step=i)
            for i in range(3)]


def run(path, mode: str, graphs: bool, device: str = "cpu", dtype: str | None = None,
        fp8_dense: str = "windows", requests=cohort, expect_prompt_dequant: bool = False,
        **knobs) -> dict:
    knobs.setdefault("prefill_chunk", 4)
    cfg = cpu_engine_config(path, 128, mode="solo" if mode == "solo" else "batch",
                            batch_mtp=mode == "batch_mtp", slots=3, window_rows=6, spec=3,
                            graphs=graphs, **knobs)
    cfg.device = device
    cfg.model.fp8_dense = fp8_dense
    if dtype:
        cfg.model.dtype = dtype
    eng = Engine.from_config(cfg, log=lambda s: None)
    try:
        from strata.kernels.cyext_ops import linear_fp8_streams
        fp8_qkvz = fp8_dense == "fp8" or (fp8_dense == "windows" and linear_fp8_streams(device))
        if fp8_qkvz and device == "cuda":  # FP8 qkvz: windows project b/a in the conv
            assert all(m.ba_in_conv(eng.model.dtype) for m in eng.model.modules()
                       if isinstance(m, GatedDeltaNet))
        if expect_prompt_dequant:  # every dense FP8 layer left is marked
            marked = [m.prompt_dequant for _, m in dense_fp8_layers(eng.model)]
            assert marked and all(marked)
        run_cohort(eng, requests(), 1000)
        rows = [len(ev["layout"]) for ev in eng.trace.events if ev["ev"] == "window"]
        assert max(rows) * 4 < 64  # the routed-experts path
        return {rid: list(rs.emitted) for rid, rs in eng.requests.items()}
    finally:
        eng.close()


def test_greedy_tokens_identical_in_every_mode(many_experts):
    ref = run(many_experts, "solo", False)
    for mode in ("solo", "batch", "batch_mtp"):
        for graphs in (False, True):
            if (mode, graphs) == ("solo", False):
                continue
            assert run(many_experts, mode, graphs) == ref, (mode, graphs)


_GPU = [pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("device,fp8_dense", [("cpu", "auto"), ("cpu", "auto-streams"),
                                              ("cpu", "windows-streams"),
                                              pytest.param("cuda", "auto", marks=_GPU),
                                              pytest.param("cuda", "windows", marks=_GPU),
                                              pytest.param("cuda", "fp8", marks=_GPU)])
def test_greedy_tokens_identical_in_every_mode_fp8_bf16(tmp_path, device, fp8_dense, monkeypatch):
    """The same with FP8 block-128 weights in bfloat16 (hidden 256, 64 experts of 128 features,
    top-4), solo, plain batch and batch_mtp, graphs off and on; on the GPU through the GPU
    extension's grouped kernels (on sm_90+ the streamed ones, their gate/up on tensor cores).
    fp8_dense=fp8 keeps every dense projection FP8: the DeltaNet windows then take b/a from
    causal_conv_window_qkvz_ba (in_proj_ba stays bfloat16), as windows (the default) does in
    windows. auto-streams, windows-streams: auto and windows as they are where the streamed FP8
    linear runs (the contracting projections, or every dense one, FP8 in windows and
    dequantised in prompt chunks), on the CPU. Regions run uncompiled, so this takes seconds."""
    from strata.kernels import cyext_ops, ops
    from strata.model.quantize import quantize_checkpoint

    if device == "cuda" and cyext_ops.gpu_platform() is None:
        pytest.skip("needs the cyext GPU extension")
    streams = fp8_dense.endswith("-streams")
    if streams:  # FP8 kept as on a GPU with the streamed FP8 linear
        from strata.model import loader
        monkeypatch.setattr(loader, "fp8_supported", lambda device: True)
        monkeypatch.setattr(cyext_ops, "linear_fp8_streams", lambda device: True)
        fp8_dense = fp8_dense.removesuffix("-streams")
    src = make_tiny_random(tmp_path / "bf16", seed=6, tokenizer=False, hidden_size=256,
                           num_experts=64, num_experts_per_tok=4, moe_intermediate_size=128)
    path = quantize_checkpoint(src, tmp_path / "fp8", (128, 128), log=lambda _m: None)

    def run_on(mode: str, graphs: bool) -> dict:
        return run(path, mode, graphs, device=device, dtype="bfloat16", fp8_dense=fp8_dense,
                   compile="off", expect_prompt_dequant=streams)

    try:
        ref = run_on("solo", False)
        for mode in ("solo", "batch", "batch_mtp"):
            for graphs in (False, True):
                if (mode, graphs) != ("solo", False):
                    assert run_on(mode, graphs) == ref, (mode, graphs)
        if device == "cuda":
            return  # (other row counts: cuBLAS may round the dense projections otherwise)
        # prompt chunks of several slots (prefill_slots 3, 16-token chunks): launches of up to
        # 48 rows against solo's 16
        def shared_chunks(mode: str, slots: int, graphs: bool = False) -> dict:
            return run(path, mode, graphs, device=device, dtype="bfloat16", fp8_dense=fp8_dense,
                       compile="off", requests=long_prompts, prefill_chunk=16,
                       prefill_slots=slots)
        want = shared_chunks("solo", 1)
        for mode, graphs in (("batch", False), ("batch_mtp", False), ("batch_mtp", True)):
            assert shared_chunks(mode, 3, graphs) == want, (mode, graphs)
    finally:
        ops.set_backend("torch", "cpu")


def long_prompts() -> list[Request]:
    """Three prompts of 21-40 tokens arriving together: with prefill_chunk 16 and
    prefill_slots 3 their chunks share prompt launches of up to 48 rows, where solo's are 16."""
    rng = random.Random(12)
    return [Request(f"p{i}", [rng.randrange(1, 512) for _ in range(21 + 9 * i + i % 2)],
                    SamplingParams(max_tokens=8, stop_at_eos=False)) for i in range(3)]


def test_moe_calls_say_whether_their_rows_are_a_prompt_chunk(many_experts, monkeypatch):
    """ops.moe_experts hears prompt=True for every call of a prompt chunk (the main model's and
    the MTP layer's, several slots' chunks at once) and False for every decode window's: the
    GPU kernels give the two kinds different bits, each independent of the launch's rows."""
    from strata.kernels import ops
    from strata.model.qwen3_next import Qwen3Next

    where = {"prompt": 0}
    calls = []

    def marked(fn, is_prompt):
        def wrapper(self, *a, **kw):
            inside = is_prompt(a, kw)
            where["prompt"] += inside
            try:
                return fn(self, *a, **kw)
            finally:
                where["prompt"] -= inside
        return wrapper

    monkeypatch.setattr(Qwen3Next, "prefill", marked(Qwen3Next.prefill, lambda a, kw: True))
    monkeypatch.setattr(Qwen3Next, "mtp_window", marked(
        Qwen3Next.mtp_window, lambda a, kw: kw.get("variant", "window") == "prefill"))
    cfg = cpu_engine_config(many_experts, 128, mode="batch", batch_mtp=True, slots=3,
                            window_rows=6, spec=3, prefill_chunk=16, prefill_slots=3)
    eng = Engine.from_config(cfg, log=lambda s: None)
    inner = ops.moe_experts

    def spy(*a, prompt=False, **kw):
        calls.append((where["prompt"] > 0, prompt, a[0].shape[0]))
        return inner(*a, prompt=prompt, **kw)

    monkeypatch.setattr(ops, "moe_experts", spy)
    try:
        run_cohort(eng, long_prompts(), 1000)
    finally:
        eng.close()
    assert all(inside == prompt for inside, prompt, _ in calls), calls
    assert any(p and rows > 16 for _, p, rows in calls)  # a chunk of several slots
    assert any(not p for _, p, _ in calls)


def test_padding_rows_of_a_prompt_chunk_read_no_more_experts(many_experts, monkeypatch):
    """A padded prompt chunk's padding rows are parked on one expert its real rows read anyway
    (weight 0): its MoE calls route the padding rows nowhere else, and the real rows' outputs
    are the same bits as without the mask."""
    from strata.kernels import ops
    from strata.model.loader import load_model
    from strata.model.qwen3_next import SparseMoe
    from omegaconf import OmegaConf
    from strata.config import ModelConfig

    mcfg = OmegaConf.structured(ModelConfig)
    mcfg.path = str(many_experts)
    moe = next(m for m in load_model(mcfg, "cpu", log=lambda s: None).model.modules()
               if isinstance(m, SparseMoe))
    x = torch.randn(2, 8, moe.experts.w_gate_up.shape[2], generator=torch.Generator().manual_seed(1))
    valid = torch.arange(8)[None] < torch.tensor([[5], [3]])  # two segments of 5 and 3 tokens
    seen = []
    inner = ops.moe_experts

    def spy(x_, wgu, wd, weights, index, *a, **kw):
        seen.append((weights.clone(), index.clone()))
        return inner(x_, wgu, wd, weights, index, *a, **kw)

    monkeypatch.setattr(ops, "moe_experts", spy)
    plain = moe(x, prompt=True)
    parked = moe(x, prompt=True, valid=valid)
    rows = valid.reshape(-1)
    assert torch.equal(parked.reshape(16, -1)[rows], plain.reshape(16, -1)[rows])
    (_, idx0), (w1, idx1) = seen[0], seen[-1]
    assert torch.equal(idx1[rows], idx0[rows])
    real = set(idx1[rows].flatten().tolist())
    assert set(idx1[~rows].flatten().tolist()) <= real  # no expert beyond the real rows'
    assert len(set(idx1[~rows].flatten().tolist())) == 1 and not w1[~rows].any()
    assert set(idx0[~rows].flatten().tolist()) - real  # (unparked, they did add experts)


def test_padding_groups_of_a_window_route_alike(many_experts, monkeypatch):
    """A decode window padded up to its shape bucket runs its padding groups on the scratch lane
    at position 0, all alike: their rows pick the same experts, so together they read one
    group's experts, which is how the simulator prices a padded window
    (sim.scheduler.routed_groups)."""
    from strata.kernels import ops
    from strata.model.qwen3_next import Qwen3Next

    cfg = cpu_engine_config(many_experts, 128, mode="batch", batch_mtp=True, slots=5,
                            window_rows=10, spec=3)
    eng = Engine.from_config(cfg, log=lambda s: None)
    scratch = eng.runner.scratch
    window = {}
    checked = []
    inner_moe, inner_verify = ops.moe_experts, Qwen3Next.verify_window

    def verify(self, tokens, group_slot, *a, **kw):
        window["pad"] = (group_slot == scratch).tolist()
        window["g"] = tokens.shape[1]
        try:
            return inner_verify(self, tokens, group_slot, *a, **kw)
        finally:
            window.clear()

    def spy(x, wgu, wd, weights, index, *a, **kw):
        if window and sum(window["pad"]) > 1:
            g = window["g"]
            rows = index.reshape(len(window["pad"]), g, -1)
            pads = [rows[i] for i, p in enumerate(window["pad"]) if p]
            assert all(torch.equal(p, pads[0]) for p in pads), "padding groups routed apart"
            checked.append(len(pads))
        return inner_moe(x, wgu, wd, weights, index, *a, **kw)

    monkeypatch.setattr(Qwen3Next, "verify_window", verify)
    monkeypatch.setattr(ops, "moe_experts", spy)
    rng = random.Random(13)
    try:
        run_cohort(eng, [Request(f"q{i}", [rng.randrange(1, 512) for _ in range(6)],
                                 SamplingParams(max_tokens=12, stop_at_eos=False))
                         for i in range(5)], 1000)
    finally:
        eng.close()
    assert checked and max(checked) == 3  # five groups in a window of eight
