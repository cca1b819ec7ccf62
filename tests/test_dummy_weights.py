"""Dummy weights (model.load_format=dummy), num_layers truncation, the presets, and the
default workload of a model without a tokenizer.

- a directory holding only config.json builds a model with seeded random weights: the same
  seed gives bit-identical weights, another seed different ones, and each parameter's values
  depend on its name and the seed only;
- with an FP8 quantization_config the dummy weights are FP8 with block scales (kept FP8);
- activations stay sane through many layers and the router spreads rows over the experts;
- model.num_layers keeps the first N layers (dummy only);
- the errors: dummy without config.json, auto over a config-only directory;
- the presets compose and point at the shipped configs with the real values;
- the default workload without a tokenizer is token-id prompts; a text prompt is an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from strata.kernels import ops
from strata.model.config import CheckpointError, load_model_args
from strata.model.dummy import param_seed
from strata.model.fp8 import FP8_DTYPE
from strata.model.loader import load_checkpoint, resolve_model_path
from strata.model.tiny import tiny_args
from strata.workload import WorkloadError, load_request_file, load_workload

pytestmark = pytest.mark.usefixtures("single_thread")
QUIET = dict(log=lambda _m: None)


def _config_dir(path: Path, quant: dict | None = None, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_args(eos_token_id=[0], **overrides).to_hf_dict()
    if quant:
        cfg["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg))
    return path


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [16, 16], "modules_to_not_convert": ["lm_head", "embed_tokens", "mlp.gate",
                                                                  "mlp.shared_expert_gate"]}


def _sd(lm) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in lm.model.named_parameters()}


def test_dummy_is_deterministic_for_a_seed(tmp_path):
    d = _config_dir(tmp_path / "cfg")
    a = _sd(load_checkpoint(d, load_format="dummy", dummy_seed=7, **QUIET))
    b = _sd(load_checkpoint(d, load_format="dummy", dummy_seed=7, **QUIET))
    c = _sd(load_checkpoint(d, load_format="dummy", dummy_seed=8, **QUIET))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    moving = [k for k in a if a[k].std() > 0]  # norms are constant by design
    assert moving and not any(torch.equal(a[k], c[k]) for k in moving)
    # a parameter's values come from its own name and the seed, whatever the order
    assert param_seed(7, "layers.0.mlp.gate.weight") != param_seed(7, "layers.1.mlp.gate.weight")
    assert param_seed(7, "x") == param_seed(7, "x") != param_seed(8, "x")


def test_dummy_weights_have_the_documented_scales(tmp_path):
    lm = load_checkpoint(_config_dir(tmp_path / "cfg"), load_format="dummy", fuse=False, **QUIET)
    sd = dict(lm.model.named_parameters())
    assert torch.all(sd["layers.0.input_layernorm.weight"] == 0)  # zero-centred: identity
    assert torch.all(sd["layers.0.linear_attn.norm.weight"] == 1)  # plain weight of the gated norm
    assert abs(sd["layers.0.linear_attn.in_proj_qkvz.weight"].std().item() - 0.02) < 0.003
    assert sd["layers.0.mlp.gate.weight"].std() > 2 * 0.02  # a wider router
    a_log = sd["layers.0.linear_attn.A_log"].exp()
    assert torch.all((a_log >= 1) & (a_log <= 16))
    assert lm.has_mtp  # num_nextn_predict_layers 1: the MTP module is built too


@torch.no_grad()
def test_dummy_activations_stay_sane_through_depth_and_route_widely(tmp_path, monkeypatch):
    d = _config_dir(tmp_path / "cfg", num_hidden_layers=16, num_experts=32, num_experts_per_tok=4)
    lm = load_checkpoint(d, load_format="dummy", **QUIET)
    toks = torch.randint(0, lm.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    rms, routed = [], set()
    for layer in lm.model.layers:  # the residual stream after each layer
        layer._ffn = lambda x, f=layer._ffn: rms.append(f(x)) or rms[-1]
        route = layer.mlp._route
        layer.mlp._route = lambda logits, r=route: (lambda w, i: routed.update(i.flatten().tolist()) or (w, i))(*r(logits))
    real_route = ops.moe_route  # the router op (its last column: the shared expert)

    def moe_route(*a, **kw):
        w, i = real_route(*a, **kw)
        routed.update(i[:, :a[3]].flatten().tolist())
        return w, i

    monkeypatch.setattr(ops, "moe_route", moe_route)
    logits = lm.model.logits(lm.model.forward_train(toks))
    assert len(rms) == 16
    for x in rms:
        r = x.pow(2).mean().sqrt().item()
        assert torch.isfinite(x).all() and 1e-3 < r < 50, r
    assert len(routed) >= 24  # 16 layers x 24 rows x top-4 reach most of the 32 experts
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_dummy_fp8_weights_have_block_scales(tmp_path):
    d = _config_dir(tmp_path / "cfg", quant=FP8)
    lm = load_checkpoint(d, load_format="dummy", fp8="keep", dtype="float32", **QUIET)
    assert lm.fp8
    e = lm.model.layers[0].mlp.experts
    assert e.w_gate_up.dtype == FP8_DTYPE and e.gu_scale.shape == (8, 4, 4)  # I=32, H=64, blocks 16
    assert e.down_scale.shape == (8, 4, 2)
    assert lm.model.layers[0].mlp.gate.weight.dtype == torch.float32  # a module not converted
    from strata.kernels.reference import dequant_gate_up
    w = dequant_gate_up(e.w_gate_up, e.gu_scale, (16, 16))
    assert 0.01 < w.std().item() < 0.04
    toks = torch.randint(0, lm.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(lm.model.logits(lm.model.forward_train(toks))).all()
    # on CPU (auto) the same config gives a plain float model
    plain = load_checkpoint(d, load_format="dummy", **QUIET)
    assert not plain.fp8 and all(p.dtype == torch.float32 for p in plain.model.parameters())


def test_num_layers_truncates_and_is_dummy_only(tmp_path, tiny_ckpt):
    d = _config_dir(tmp_path / "cfg", num_hidden_layers=8)
    lm = load_checkpoint(d, load_format="dummy", num_layers=3, **QUIET)
    assert len(lm.model.layers) == 3 and lm.args.num_hidden_layers == 3
    assert lm.args.layer_types == load_model_args(d).layer_types[:3]
    with pytest.raises(CheckpointError, match="model.num_layers"):
        load_checkpoint(d, load_format="dummy", num_layers=9, **QUIET)
    with pytest.raises(CheckpointError, match="model.num_layers.*load_format=dummy"):
        load_checkpoint(tiny_ckpt, num_layers=2, **QUIET)


def test_dummy_without_config_json_and_auto_without_weights(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(empty, load_format="dummy", **QUIET)
    assert str(empty / "config.json") in str(ei.value) and "load_format=dummy" in str(ei.value)
    d = _config_dir(tmp_path / "cfg")
    for fmt in ("auto", "safetensors"):
        with pytest.raises(CheckpointError) as ei:
            load_checkpoint(d, load_format=fmt, **QUIET)
        assert str(d) in str(ei.value) and "model.load_format=dummy" in str(ei.value)
    with pytest.raises(CheckpointError, match="model.load_format"):
        load_checkpoint(d, load_format="random", **QUIET)


# ---- the presets ----------------------------------------------------------------------------
@pytest.mark.parametrize("preset,fp8", [("qwen3_next_80b_a3b", False), ("qwen3_next_80b_a3b_fp8", True)])
def test_presets_point_at_the_real_configs(preset, fp8):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from strata.config import register_configs
    from strata.model.fp8 import load_quant_config

    register_configs()
    GlobalHydra.instance().clear()
    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={preset}", "model.load_format=dummy"])
    GlobalHydra.instance().clear()
    assert cfg.model.load_format == "dummy" and cfg.model.num_layers is None
    path = resolve_model_path(cfg.model.path)
    assert path.is_dir() and not (path / "model.safetensors").exists()
    a = load_model_args(path)
    assert (a.vocab_size, a.hidden_size, a.num_hidden_layers, a.num_experts, a.num_experts_per_tok,
            a.moe_intermediate_size, a.shared_expert_intermediate_size, a.intermediate_size,
            a.head_dim, a.num_key_value_heads, a.linear_num_value_heads) == \
        (151936, 2048, 48, 512, 10, 512, 512, 5120, 256, 2, 32)
    assert len(a.full_layers) == 12 and a.num_nextn_predict_layers == 1
    assert a.torch_dtype == "bfloat16" and 151645 in a.eos_token_id and a.rope_theta == 1e7
    q = load_quant_config(path)
    assert (q is not None) == fp8
    if fp8:
        assert q.block == (128, 128)
        for m in ("model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate", "lm_head",
                  "model.embed_tokens", "model.layers.0.linear_attn.in_proj_ba"):
            assert not q.converts(m), m
        for m in ("model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.shared_expert.gate_proj",
                  "model.layers.3.self_attn.q_proj"):
            assert q.converts(m), m


# ---- workloads without a tokenizer ------------------------------------------------------------
def _workload(**kw):
    from strata.config import WorkloadConfig
    return OmegaConf.structured(WorkloadConfig(**kw))


def test_default_workload_without_tokenizer_is_token_ids():
    said = []
    reqs = load_workload(_workload(requests=3, prompt_tokens=10, seed=4), None, 1000, log=said.append)
    assert len(reqs) == 3 and all(len(r.prompt_ids) == 10 for r in reqs)
    assert all(0 < t < 1000 for r in reqs for t in r.prompt_ids)
    assert len(said) == 1 and "INFO" in said[0] and "tokenizer" in said[0]
    again = load_workload(_workload(requests=3, prompt_tokens=10, seed=4), None, 1000, log=said.append)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in reqs]


def test_text_prompt_without_tokenizer_names_the_request(tmp_path):
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"id": "a", "prompt_ids": [1, 2]}\n{"id": "b", "prompt": "hello"}\n')
    with pytest.raises(WorkloadError) as ei:
        load_request_file(str(f), _workload(kind="file"), None, 1000)
    assert f"{f}:2" in str(ei.value) and "'b'" in str(ei.value) and "prompt_ids" in str(ei.value)
