"""The skinny linear in decode windows (moe_launch_options(skinny_bf16=), ops.linear_skinny):
which weights it takes, and that the model routes a window's float linears through it and a
prompt chunk's not. The kernel's own parity and bits are GPU tests (tests/test_moe_kernels.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import cyext_ops as C
from strata.kernels import ops
from strata.model.loader import load_checkpoint, save_checkpoint
from strata.model.qwen3_next import Qwen3Next
from strata.model.state import DecodeState
from strata.model.tiny import init_random, tiny_args

pytestmark = pytest.mark.usefixtures("single_thread")


def bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("x,w,want", [
    (bf16(4, 256), bf16(1296, 256), True),           # the embedded model's fused MoE input
    (bf16(2, 8, 256), bf16(4096, 256), True),        # the LM head, leading dims
    (bf16(4, 1024), bf16(4096, 1024), True),         # the largest taken
    (bf16(4, 2048), bf16(2048, 2048), False),        # the 80B's hidden: cuBLAS
    (bf16(4, 256), bf16((1 << 22) // 256 + 8, 256), False),  # too many elements
    (bf16(4, 24), bf16(64, 24), False),              # in_features not a multiple of 32
    (bf16(4, 48), bf16(64, 48), False),              # a multiple of 16 (CUDA cores) only
    (torch.zeros(4, 256), torch.zeros(512, 256), False),  # float32
    (bf16(4, 256), bf16(512, 128), False),           # shapes that do not match
])
def test_skinny_bf16_takes(monkeypatch, x, w, want):
    monkeypatch.setattr(C, "_skinny_bf16", True)
    assert C.skinny_bf16_takes(x, w) is want
    monkeypatch.setattr(C, "_skinny_bf16", False)
    assert C.skinny_bf16_takes(x, w) is False


class _FlagsOnlyExtension:
    """Stands in for the GPU extension: its launch switches and dependents' row limit, and the
    rows of each skinny launch."""

    def __init__(self, flags, pdl_rows=4):
        self.flags, self.pdl_rows, self.seen = flags, pdl_rows, []

    def moe_set_options(self, flags):
        if flags >= 0:
            self.flags = flags
        return self.flags

    def linear_pdl_rows(self, rows):
        old = self.pdl_rows
        if rows >= 0:
            self.pdl_rows = rows
        return old

    def linear_skinny(self, x, weight, scale, bo, bi, y, stream):
        self.seen.append(x.shape[0])


def test_skinny_bf16_launches_every_row_count_without_touching_the_switches(monkeypatch):
    """The model's skinny linears reach the kernel at every row count up to
    SKINNY_BF16_MAX_ROWS with the launch switches untouched: the extension itself decides,
    by its row limit, which launch is a programmatic dependent."""
    ext = _FlagsOnlyExtension(0xFFFF)
    monkeypatch.setattr(C, "_gpu", ext)
    monkeypatch.setattr(C, "_stream", lambda t: 0)
    monkeypatch.setattr(C, "_cuda_sm90", lambda device: True)
    w = bf16(64, 32)
    rows = (1, C.SKINNY_BF16_PDL_MAX_ROWS, C.SKINNY_BF16_PDL_MAX_ROWS + 1, C.SKINNY_BF16_MAX_ROWS)
    for m in rows:
        C.gpu_linear_skinny(bf16(m, 32), w)
        assert (ext.flags, ext.pdl_rows) == (0xFFFF, 4)
    assert ext.seen == list(rows)
    assert C._skinny_bf16 is True  # the default: on


def test_skinny_pdl_rows_switch(monkeypatch):
    """moe_launch_options(skinny_pdl_rows=) sets the extension's row limit (0: none, 16: every
    window) and refuses what is not a row count in 0..SKINNY_BF16_MAX_ROWS."""
    ext = _FlagsOnlyExtension(0xFFFF)
    monkeypatch.setattr(C, "_gpu", ext)
    assert C.moe_launch_options()["skinny_pdl_rows"] == C.SKINNY_BF16_PDL_MAX_ROWS == 4
    for limit in (C.SKINNY_BF16_MAX_ROWS, 0, 4):
        assert C.moe_launch_options(skinny_pdl_rows=limit)["skinny_pdl_rows"] == limit
        assert ext.pdl_rows == limit and C.moe_launch_options()["skinny_pdl_rows"] == limit
    for bad in (-1, C.SKINNY_BF16_MAX_ROWS + 1, True, 2.0):
        with pytest.raises(ValueError, match="skinny_pdl_rows"):
            C.moe_launch_options(skinny_pdl_rows=bad)
    assert ext.pdl_rows == 4


@pytest.mark.skipif(C._gpu is None, reason="the GPU extension is not built")
def test_extension_row_limit_is_the_documented_default():
    """The built extension's dependents' row limit starts at SKINNY_BF16_PDL_MAX_ROWS and
    moe_launch_options(skinny_pdl_rows=) moves it there (a host setting: no GPU needed)."""
    old = C._gpu.linear_pdl_rows(-1)
    try:
        assert C._gpu.linear_pdl_rows(-1) == C.SKINNY_BF16_PDL_MAX_ROWS
        assert C.moe_launch_options(skinny_pdl_rows=9)["skinny_pdl_rows"] == 9
        assert C._gpu.linear_pdl_rows(-1) == 9
    finally:
        C._gpu.linear_pdl_rows(old)


def test_skinny_linear_is_f_linear_off_an_sm90_gpu(monkeypatch):
    """gpu_linear_skinny never launches the kernel where its tensor-core form cannot run."""
    ext = _FlagsOnlyExtension(0xFFFF)
    monkeypatch.setattr(C, "_gpu", ext)
    x, w = torch.randn(4, 32).bfloat16(), torch.randn(64, 32).bfloat16()
    assert torch.equal(C.gpu_linear_skinny(x, w), F.linear(x, w))
    assert ext.seen == []


def test_skinny_off_the_gpu_is_f_linear():
    """On the CPU and torch backends linear_skinny is the reference (F.linear), and the model
    never asks for it (ops.skinny_takes is false without the GPU kernel)."""
    x, w = torch.randn(3, 32), torch.randn(48, 32)
    assert torch.equal(ops.linear_skinny(x, w), F.linear(x, w))
    assert not ops.native("linear_skinny")
    assert ops.skinny_takes(x.bfloat16(), w.bfloat16()) is False


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("skinny-tiny")
    model = init_random(Qwen3Next(tiny_args(), with_mtp=True), seed=5, std=0.1, head_std=0.5)
    save_checkpoint(model, path)
    return path


def run_prompt_then_window(model):
    """A 5-token prompt chunk, then a 1 x 3 verify window: (prompt hidden, window logits)."""
    state = DecodeState(model.args, 2, 32, model.dtype, "cpu", with_mtp=True)
    h = model.prefill(torch.tensor([5, 9, 2, 7, 1]), 0, 0, state)
    out = model.verify_window(torch.tensor([[3, 4, 6]]), torch.tensor([0]), torch.tensor([5]), 8,
                              state)
    return h, out[1]


def test_windows_route_float_linears_through_linear_skinny(tiny_dir, monkeypatch):
    """With ops.skinny_takes true, a decode window runs every float linear (attention's and
    DeltaNet's fused input projections, their output projections, the fused MoE matmuls, the LM
    head) as ops.linear_skinny, a prompt chunk none; with the reference op both give what
    F.linear gives."""
    model = load_checkpoint(tiny_dir, dtype="float32", log=lambda _m: None).model
    h_ref, logits_ref = run_prompt_then_window(model)
    calls = []

    def recording(x, weight):
        calls.append((phase, tuple(x.shape[:-1]), tuple(weight.shape)))
        return F.linear(x, weight)

    monkeypatch.setattr(ops, "skinny_takes", lambda x, w: True)
    monkeypatch.setattr(ops, "linear_skinny", recording)
    phase = "prompt"
    state = DecodeState(model.args, 2, 32, model.dtype, "cpu", with_mtp=True)
    h = model.prefill(torch.tensor([5, 9, 2, 7, 1]), 0, 0, state)
    assert calls == []
    phase = "window"
    logits = model.verify_window(torch.tensor([[3, 4, 6]]), torch.tensor([0]), torch.tensor([5]),
                                 8, state)[1]
    assert torch.equal(h, h_ref) and torch.equal(logits, logits_ref)
    shapes = {w for _, _, w in calls}
    a = model.args
    assert (a.vocab_size, a.hidden_size) in shapes  # the LM head
    # per layer: its mixer's input and output projections and the MoE block's two matmuls
    assert len(calls) >= 4 * a.num_hidden_layers + 1
    assert all(rows in ((3,), (1, 3)) for _, rows, _ in calls)
