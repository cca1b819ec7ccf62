"""FP8 block checkpoints (Hugging Face fine-grained format) and the model on the grouped MoE op.

- scripts/quantize_fp8.py's quantiser writes FP8 weights with amax/448 block scales, keeps
  the modules it is told to keep, and copies the tokenizer;
- an FP8 checkpoint with blocks smaller than the tensors (and dims that are not multiples of
  them) loads on CPU dequantised exactly, and matches transformers run on the dequantised float
  copy; kept in FP8 (the GPU path: Fp8Linear, FP8 stacked experts through ops.linear_fp8 and
  ops.moe_experts, here on their torch references) it matches too;
- FP8 projections fuse only where every part's rows are a multiple of the block rows;
- each malformed checkpoint is one clear error naming the file and the tensor or key;
- routed experts go through ops.moe_experts and agree with the dense path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import checkpoint_error, edit_tensors, rel_err
from strata.kernels import ops
from strata.kernels.reference import dequant_fp8_block
from strata.model.config import CheckpointError
from strata.model.fp8 import FP8_DTYPE, Fp8Linear, fuse_projections
from strata.model.loader import load_checkpoint
from strata.model.quantize import quantize_block, quantize_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")
QUIET = dict(log=lambda _m: None)
#: Block sizes per tiny config: (16, 12) keeps rows multiples of the block (fused FP8
#: projections) with columns that are not; (24, 8) leaves rows ragged (expert gate/up of 32 rows,
#: attention of 32 and 128 rows), so projections stay unfused and gate/up scales straddle.
BLOCKS = {"base": (16, 12), "wide": (24, 8)}


def _tokens(vocab: int, shape, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def fp8_ckpts(tiny_ckpts, tmp_path_factory) -> dict[str, Path]:
    return {n: quantize_checkpoint(tiny_ckpts[n], tmp_path_factory.mktemp(f"fp8-{n}"), b, log=lambda _m: None)
            for n, b in BLOCKS.items()}


def _dequantised_copy(src: Path, dst: Path) -> Path:
    """The float checkpoint an FP8 one stands for: every FP8 weight times its block scales."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    block = cfg.pop("quantization_config")["weight_block_size"]
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(dst / "model.safetensors"))
    out = {}
    for k, t in sd.items():
        if k.endswith("_scale_inv"):
            continue
        out[k] = dequant_fp8_block(t, sd[k + "_scale_inv"], block) if t.dtype == FP8_DTYPE else t.float()
    save_file(out, str(dst / "model.safetensors"))
    return dst


# ---- the quantiser ---------------------------------------------------------------------------
def test_quantize_block_scales_are_block_amax_over_448():
    w = torch.randn(40, 20, generator=torch.Generator().manual_seed(0))
    q, s = quantize_block(w, (16, 8))
    assert q.dtype == FP8_DTYPE and s.shape == (3, 3) and s.dtype == torch.float32
    assert torch.allclose(s[0, 0], w[:16, :8].abs().max() / 448)
    assert torch.allclose(s[2, 2], w[32:, 16:].abs().max() / 448)  # a ragged corner block
    back = dequant_fp8_block(q, s, (16, 8))
    assert rel_err(back, w) < 0.05  # e4m3 keeps 3 mantissa bits
    assert q.float().abs().amax() == 448  # each block's amax lands on the top of the range
    # quantising the dequantised weight again gives it back
    q2, s2 = quantize_block(back, (16, 8))
    assert rel_err(dequant_fp8_block(q2, s2, (16, 8)), back) < 1e-6


def test_quantized_checkpoint_layout(fp8_ckpts, tiny_ckpts):
    src, dst = tiny_ckpts["base"], fp8_ckpts["base"]
    cfg = json.loads((dst / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "fp8" and q["fmt"] == "e4m3" and q["weight_block_size"] == [16, 12]
    assert "mlp.gate" in q["modules_to_not_convert"]
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert (dst / "generation_config.json").is_file()
    with safe_open(str(dst / "model.safetensors"), "pt") as sf:
        keys = set(sf.keys())
        w = sf.get_tensor("model.layers.0.mlp.experts.3.up_proj.weight")
        s = sf.get_tensor("model.layers.0.mlp.experts.3.up_proj.weight_scale_inv")
        assert w.dtype == FP8_DTYPE and s.shape == (2, 6)  # (32, 64) in blocks of (16, 12)
        for kept in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                     "model.layers.0.mlp.shared_expert_gate.weight",
                     "model.layers.0.linear_attn.in_proj_ba.weight",
                     "model.layers.0.input_layernorm.weight"):
            assert sf.get_tensor(kept).dtype == torch.float32, kept
            assert kept + "_scale_inv" not in keys
        assert sf.get_tensor("model.layers.3.self_attn.q_proj.weight").dtype == FP8_DTYPE
        assert sf.get_tensor("mtp.fc.weight").dtype == FP8_DTYPE


def test_quantize_refuses_a_quantized_source(fp8_ckpts, tmp_path):
    with pytest.raises(CheckpointError, match="quantization_config"):
        quantize_checkpoint(fp8_ckpts["base"], tmp_path / "again", (16, 12), log=lambda _m: None)


# ---- loading against transformers ------------------------------------------------------------
@pytest.mark.parametrize("name", list(BLOCKS))
@torch.no_grad()
def test_fp8_checkpoint_matches_transformers_on_the_dequantised_copy(name, fp8_ckpts, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    ref_dir = _dequantised_copy(fp8_ckpts[name], tmp_path / "float")
    ref = transformers.Qwen3NextForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
    toks = _tokens(ref.config.vocab_size, (2, 70), seed=3)
    want = ref(input_ids=toks, use_cache=False).logits

    plain = load_checkpoint(fp8_ckpts[name], dtype="float32", **QUIET)  # CPU: dequantised
    assert not plain.fp8 and plain.quant.block == BLOCKS[name]
    assert all(p.dtype == torch.float32 for p in plain.model.parameters())
    assert rel_err(plain.model.logits(plain.model.forward_train(toks)), want) <= 1e-4

    kept = load_checkpoint(fp8_ckpts[name], dtype="float32", fp8="keep", fp8_dense="fp8",
                           **QUIET)  # the GPU path with model.fp8_dense=fp8
    assert kept.fp8
    experts = kept.model.layers[0].mlp.experts
    assert experts.w_gate_up.dtype == FP8_DTYPE and experts.gu_scale is not None
    assert isinstance(kept.model.layers[0].mlp.shared_expert.up_proj, Fp8Linear)
    assert rel_err(kept.model.logits(kept.model.forward_train(toks)), want) <= 1e-4
    # model.fp8_dense=auto (the default) is dequant on CPU: dense layers get the exact float
    # copy, experts FP8
    mixed = load_checkpoint(fp8_ckpts[name], dtype="float32", fp8="keep", **QUIET)
    assert not any(isinstance(m, Fp8Linear) for m in mixed.model.layers[0].linear_attn.modules())
    assert mixed.model.layers[0].mlp.experts.w_gate_up.dtype == FP8_DTYPE
    assert isinstance(mixed.model.layers[0].mlp.shared_expert.up_proj, Fp8Linear)
    assert rel_err(mixed.model.logits(mixed.model.forward_train(toks)), want) <= 1e-4


def test_fp8_dense_must_be_known(fp8_ckpts):
    with pytest.raises(CheckpointError, match="model.fp8_dense"):
        load_checkpoint(fp8_ckpts["base"], fp8="keep", fp8_dense="int4", **QUIET)


def test_fp8_dense_auto_keeps_the_contracting_projections(fp8_ckpts, monkeypatch):
    """model.fp8_dense=auto where the streamed FP8 kernel runs: the contracting projections
    (o_proj, out_proj) stay FP8, the wide input projections get their float copy (and fuse as
    float), and the logits are the dequantised model's."""
    import strata.kernels.cyext_ops as cyext_ops
    monkeypatch.setattr(cyext_ops, "linear_fp8_streams", lambda device: True)
    lm = load_checkpoint(fp8_ckpts["base"], dtype="float32", fp8="keep", fp8_dense="auto", **QUIET)
    attn, lin = lm.model.layers[3].self_attn, lm.model.layers[0].linear_attn
    assert isinstance(attn.o_proj, Fp8Linear) and isinstance(lin.out_proj, Fp8Linear)
    assert not isinstance(attn.q_proj, Fp8Linear) and not isinstance(lin.in_proj_qkvz, Fp8Linear)
    assert attn.w_qkv is not None and attn.w_qkv.dtype == torch.float32 and attn.s_qkv is None
    assert attn.o_proj.prompt_dequant and lin.out_proj.prompt_dequant and lm.model.mtp.fc.prompt_dequant
    plain = load_checkpoint(fp8_ckpts["base"], dtype="float32", **QUIET)
    toks = _tokens(lm.args.vocab_size, (2, 9), seed=4)
    with torch.no_grad():
        got = lm.model.logits(lm.model.forward_train(toks))
        want = plain.model.logits(plain.model.forward_train(toks))
    assert rel_err(got, want) <= 1e-4


@torch.no_grad()
def test_fp8_dense_auto_prompt_chunks_run_the_contracting_projections_dequantised(fp8_ckpts,
                                                                                 monkeypatch):
    """Under model.fp8_dense=auto (where the streamed FP8 kernel runs) a prompt chunk runs the
    FP8 contracting projections on their weights dequantised in the chunk: no ops.linear_fp8
    call on a dense layer's weight, and the chunk's logits are bit for bit those of the model
    dequantised at load (fp8_dense=dequant; the experts are FP8 in both). Windows still run
    them on ops.linear_fp8; fp8_dense=fp8 keeps FP8 in prompt chunks too."""
    import strata.kernels.cyext_ops as cyext_ops
    from strata.model import fp8 as fp8_mod
    from strata.model.state import DecodeState
    monkeypatch.setattr(cyext_ops, "linear_fp8_streams", lambda device: True)
    weights = []  # the weight of every ops.linear_fp8 call
    real = ops.linear_fp8
    monkeypatch.setattr(fp8_mod.ops, "linear_fp8", lambda *a: weights.append(a[1].data_ptr()) or real(*a))

    def dense_calls(lm) -> int:
        dense = {m.weight.data_ptr() for _, m in fp8_mod.dense_fp8_layers(lm.model)}
        n = sum(w in dense for w in weights)
        weights.clear()
        return n

    def prompt_logits(lm):
        st = DecodeState(lm.args, 1, 32, lm.dtype, "cpu", with_mtp=True)
        hidden = lm.model.prefill(_tokens(lm.args.vocab_size, (20,), seed=5), 0, 0, st)
        return lm.model.logits(hidden), st

    auto = load_checkpoint(fp8_ckpts["base"], dtype="float32", fp8="keep", fp8_dense="auto", **QUIET)
    deq = load_checkpoint(fp8_ckpts["base"], dtype="float32", fp8="keep", fp8_dense="dequant", **QUIET)
    got, st = prompt_logits(auto)
    assert dense_calls(auto) == 0
    want, _ = prompt_logits(deq)
    assert torch.equal(got, want)
    # a window's rows take the FP8 kernel
    group_slot, group_pos = torch.zeros(1, dtype=torch.long), torch.full((1,), 20, dtype=torch.long)
    auto.model.verify_window(_tokens(auto.args.vocab_size, (1, 2), seed=6), group_slot, group_pos,
                             32, st)
    assert dense_calls(auto) > 0
    fp8_all = load_checkpoint(fp8_ckpts["base"], dtype="float32", fp8="keep", fp8_dense="fp8", **QUIET)
    assert not any(m.prompt_dequant for _, m in fp8_mod.dense_fp8_layers(fp8_all.model))
    prompt_logits(fp8_all)
    assert dense_calls(fp8_all) > 0


@torch.no_grad()
def test_fp8_dense_windows_keeps_every_dense_layer_fp8_for_windows_only(fp8_ckpts, monkeypatch):
    """model.fp8_dense=windows (where the streamed FP8 kernel runs): every dense FP8 layer stays
    FP8, the wide input projections too (attention's q/k/v fused as FP8; DeltaNet's qkvz apart
    from its float b/a, as the checkpoints keep it), and each is marked for prompt chunks to run
    dequantised: a chunk calls ops.linear_fp8 on no dense weight and gives the logits of the
    model dequantised at load (to float32 rounding: that model fuses DeltaNet's qkvz with its
    float b/a, so the projection's values are the same but the ops after it read rows that
    start at other alignments, which a CPU's vectorised reductions may sum in another order:
    seen with AVX-512), while a window runs the input projections on the
    FP8 kernel. Elsewhere it dequantises, as auto does."""
    import strata.kernels.cyext_ops as cyext_ops
    from strata.model import fp8 as fp8_mod
    from strata.model.state import DecodeState
    deq = load_checkpoint(fp8_ckpts["base"], dtype="float32", fp8="keep", fp8_dense="dequant", **QUIET)
    off = load_checkpoint(fp8_ckpts["base"], dtype="float32", fp8="keep", fp8_dense="windows", **QUIET)
    assert not fp8_mod.dense_fp8_layers(off.model)  # no streamed kernel here: dequantised
    monkeypatch.setattr(cyext_ops, "linear_fp8_streams", lambda device: True)
    lm = load_checkpoint(fp8_ckpts["base"], dtype="float32", fp8="keep", fp8_dense="windows", **QUIET)
    attn, lin = lm.model.layers[3].self_attn, lm.model.layers[0].linear_attn
    assert isinstance(attn.q_proj, Fp8Linear) and isinstance(lin.in_proj_qkvz, Fp8Linear)
    assert attn.s_qkv is not None and lin.w_in is None and not isinstance(lin.in_proj_ba, Fp8Linear)
    dense = fp8_mod.dense_fp8_layers(lm.model)
    assert dense and all(m.prompt_dequant for _, m in dense)
    calls = []
    real = ops.linear_fp8
    monkeypatch.setattr(fp8_mod.ops, "linear_fp8", lambda *a: calls.append(a[1].data_ptr()) or real(*a))
    wide = {attn.w_qkv.data_ptr(), lin.in_proj_qkvz.weight.data_ptr()}
    dense_ptrs = {m.weight.data_ptr() for _, m in dense} | wide

    def prompt_logits(m):
        st = DecodeState(m.args, 1, 32, m.dtype, "cpu", with_mtp=True)
        return m.model.logits(m.model.prefill(_tokens(m.args.vocab_size, (20,), seed=5), 0, 0, st)), st

    got, st = prompt_logits(lm)
    assert not any(p in dense_ptrs for p in calls)
    torch.testing.assert_close(got, prompt_logits(deq)[0], rtol=0, atol=1e-5)
    calls.clear()
    lm.model.verify_window(_tokens(lm.args.vocab_size, (1, 2), seed=6), torch.zeros(1, dtype=torch.long),
                           torch.full((1,), 20, dtype=torch.long), 32, st)
    assert wide <= set(calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,block", [((48, 36), (16, 12)), ((40, 30), (24, 8)),
                                         ((3, 48, 36), (16, 12))])
def test_dequant_fp8_block_is_each_weight_times_its_block_scale(shape, block, dtype):
    """dequant_fp8_block (a prompt chunk's dequantised projections among its users) gives every
    element its block's scale times the FP8 value, rounded once to `dtype`, for blocks that tile
    the weight (its broadcast product, leading dims too) and for ragged ones."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=g) * 3
    q, s = zip(*(quantize_block(m, block) for m in w.reshape(-1, *shape[-2:])))
    q, s = torch.stack(q).view(shape), torch.stack(s).view(*shape[:-2], *s[0].shape)
    rows = torch.arange(shape[-2]) // block[0]
    cols = torch.arange(shape[-1]) // block[1]
    want = (q.float() * s[..., rows[:, None], cols[None, :]]).to(dtype)
    assert torch.equal(dequant_fp8_block(q, s, block, dtype), want)


def test_fp8_fusion_only_where_rows_are_block_multiples(fp8_ckpts):
    base = load_checkpoint(fp8_ckpts["base"], dtype="float32", fp8="keep", fp8_dense="fp8",
                           **QUIET).model
    attn = base.layers[3].self_attn  # rows 128, 32, 32 in blocks of 16: fused, scales too
    assert attn.s_qkv is not None and attn.w_qkv.dtype == FP8_DTYPE
    assert attn.q_proj.weight.data_ptr() == attn.w_qkv.data_ptr()
    assert attn.k_proj.weight_scale_inv.data_ptr() == attn.s_qkv[attn.q_proj.weight_scale_inv.shape[0]:].data_ptr()
    assert base.layers[0].linear_attn.w_in is None  # in_proj_ba stays float: not fused with FP8
    wide = load_checkpoint(fp8_ckpts["wide"], dtype="float32", fp8="keep", fp8_dense="fp8",
                           **QUIET).model
    assert wide.layers[2].self_attn.w_qkv is not None  # 96, 24, 24 rows in blocks of 24
    ragged = [Fp8Linear(64, 48, (24, 8)), Fp8Linear(64, 32, (24, 8))]  # 32 rows: 1.33 blocks
    assert fuse_projections(ragged) is None
    assert fuse_projections([Fp8Linear(64, 48, (24, 8)), torch.nn.Linear(64, 24, bias=False)]) is None
    # FP8 scales are parameters, so the engine's weights_mib (a sum over parameters) counts them
    names = {n for n, _ in wide.named_parameters()}
    assert "layers.0.mlp.experts.gu_scale" in names
    assert "layers.2.self_attn.q_proj.weight_scale_inv" in names


@torch.no_grad()
def test_fp8_window_paths_match_the_dequantised_model(fp8_ckpts):
    """The cached prefill path of the FP8-kept model against the dequantised one."""
    from strata.model.state import DecodeState
    a = load_checkpoint(fp8_ckpts["base"], dtype="float32", **QUIET)
    b = load_checkpoint(fp8_ckpts["base"], dtype="float32", fp8="keep", fp8_dense="fp8", **QUIET)
    toks = _tokens(a.args.vocab_size, (20,), seed=5)
    outs = []
    for lm in (a, b):
        st = DecodeState(lm.args, 1, 32, lm.dtype, "cpu", with_mtp=True)
        outs.append(lm.model.logits(lm.model.prefill(toks, 0, 0, st)))
    assert rel_err(outs[1], outs[0]) <= 1e-4


# ---- bad FP8 checkpoints ---------------------------------------------------------------------
@pytest.fixture
def fp8_copy(fp8_ckpts, tmp_path) -> Path:
    return Path(shutil.copytree(fp8_ckpts["base"], tmp_path / "ckpt"))




def _edit_quant(path: Path, **kv) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(kv)
    (path / "config.json").write_text(json.dumps(cfg))


KEY = "model.layers.1.mlp.experts.2.down_proj.weight"


def test_missing_scale(fp8_copy):
    edit_tensors(fp8_copy, lambda sd: sd.pop(KEY + "_scale_inv"))
    checkpoint_error(fp8_copy, fp8_copy / "model.safetensors", KEY, "weight_scale_inv")


def test_scale_of_the_wrong_shape(fp8_copy):
    edit_tensors(fp8_copy, lambda sd: sd.update({KEY + "_scale_inv": torch.ones(4, 4)}))
    checkpoint_error(fp8_copy, fp8_copy / "model.safetensors", KEY + "_scale_inv", "(4, 4)", "(4, 3)")


def test_scale_without_an_fp8_weight(fp8_copy):
    k = "model.layers.0.mlp.gate.weight_scale_inv"
    edit_tensors(fp8_copy, lambda sd: sd.update({k: torch.ones(1, 6)}))
    checkpoint_error(fp8_copy, fp8_copy / "model.safetensors", k)


def test_fp8_weight_in_a_module_not_to_convert(fp8_copy):
    k = "model.layers.0.mlp.gate.weight"
    def edit(sd):
        sd[k + "_scale_inv"] = torch.ones(1, 6)
        sd[k] = sd[k].to(FP8_DTYPE)
    edit_tensors(fp8_copy, edit)
    checkpoint_error(fp8_copy, fp8_copy / "model.safetensors", k, "modules_to_not_convert")


def test_fp8_weight_without_quantization_config(fp8_copy):
    cfg = json.loads((fp8_copy / "config.json").read_text())
    del cfg["quantization_config"]
    (fp8_copy / "config.json").write_text(json.dumps(cfg))
    checkpoint_error(fp8_copy, fp8_copy / "config.json", "quantization_config", "float8_e4m3fn")


@pytest.mark.parametrize("key,value,needle", [
    ("quant_method", "gptq", "quant_method"),
    ("fmt", "e5m2", "fmt"),
    ("weight_block_size", [128], "weight_block_size"),
    ("modules_to_not_convert", "lm_head", "modules_to_not_convert"),
])
def test_unsupported_quantization_config(fp8_copy, key, value, needle):
    _edit_quant(fp8_copy, **{key: value})
    checkpoint_error(fp8_copy, fp8_copy / "config.json", needle, repr(value) if key in ("quant_method", "fmt") else needle)


# ---- the routed experts on ops.moe_experts ---------------------------------------------------
@torch.no_grad()
def test_routed_experts_use_the_grouped_op_and_agree_with_dense(tiny_ckpts, monkeypatch):
    lm = load_checkpoint(tiny_ckpts["wide"], dtype="float32", moe_dense_experts=0, **QUIET)
    moe = lm.model.layers[0].mlp  # 16 experts top-4: 3 rows x 4 < 16 take the grouped op
    x = torch.randn(3, lm.args.hidden_size, generator=torch.Generator().manual_seed(0))
    calls = []
    real = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    got = moe(x)
    assert calls == [(3, lm.args.hidden_size)]
    moe.dense_experts = 16  # every row count on the fused dense path
    want = moe(x)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("fp8", [False, True])
@torch.no_grad()
def test_shared_expert_folds_into_the_grouped_call(fp8, tmp_path, monkeypatch):
    """Where the shared expert has the routed experts' shape it runs as expert E of the same
    ops.moe_experts call, weighted by sigmoid(shared gate) on every row; router and shared gate
    are one matmul. Same logits as the unfused model."""
    from strata.model.tiny import make_tiny_random
    src = make_tiny_random(tmp_path / "f", seed=3, tokenizer=False, shared_expert_intermediate_size=32)
    path = quantize_checkpoint(src, tmp_path / "q", (16, 16), log=lambda _m: None) if fp8 else src
    mode = dict(fp8="keep") if fp8 else {}
    folded = load_checkpoint(path, dtype="float32", moe_dense_experts=0, **mode, **QUIET)
    plain = load_checkpoint(path, dtype="float32", fuse=False, **mode, **QUIET)
    moe = folded.model.layers[0].mlp
    assert moe.experts.shared_id == 8 and moe.w_router is not None
    assert moe.shared_expert.up_proj.weight.data_ptr() == moe.experts.stacks[0][8, 32:].data_ptr()
    ids = []
    real = ops.moe_experts
    monkeypatch.setattr(ops, "moe_experts", lambda *a, **k: ids.append(a[4]) or real(*a, **k))
    toks = _tokens(folded.args.vocab_size, (1, 3), seed=1)  # 3 rows x top-2 < 8 experts: grouped
    got = folded.model.logits(folded.model.forward_train(toks))
    assert ids and all(i.shape[1] == 3 and torch.all(i[:, -1] == 8) for i in ids)
    want = plain.model.logits(plain.model.forward_train(toks))
    assert rel_err(got, want) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(BLOCKS))
@torch.no_grad()
def test_fp8_on_cuda_keeps_fp8_and_matches_the_dequantised_model(name, fp8_ckpts):
    """On a GPU with FP8 the weights stay FP8 (the kernels dequantise); logits agree with the
    exactly dequantised model on the same device. Run with each kernel backend."""
    from strata.model.fp8 import fp8_supported
    dev = torch.device("cuda")
    for backend in ("torch", "auto"):
        ops.set_backend(backend, dev)
        try:
            kept = load_checkpoint(fp8_ckpts[name], dtype="float32", device=dev, **QUIET)
            plain = load_checkpoint(fp8_ckpts[name], dtype="float32", device=dev, fp8="dequant", **QUIET)
            assert kept.fp8 == fp8_supported(dev)
            toks = _tokens(kept.args.vocab_size, (2, 40), seed=7).to(dev)
            got = kept.model.logits(kept.model.forward_train(toks))
            want = plain.model.logits(plain.model.forward_train(toks))
            assert rel_err(got, want) <= 1e-3, backend
        finally:
            ops.set_backend("torch", "cpu")
