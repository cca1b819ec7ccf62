"""Checkpoint loading and saving: round trips, shards, dtype, and one clear error per bad case."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import checkpoint_error, edit_tensors, rel_err
from strata.model.loader import load_checkpoint, save_checkpoint
from strata.model.state import DecodeState

QUIET = dict(log=lambda _m: None)
pytestmark = pytest.mark.usefixtures("single_thread")


def _tokens(vocab: int, n: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(lm, toks):
    h = lm.model.forward_train(toks)
    out = lm.model.logits(h)
    if lm.has_mtp:
        out = torch.cat([out, lm.model.logits(lm.model.mtp_train(h, toks))], 1)
    return out


def _state_dict(lm) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in lm.model.state_dict().items()}


# ---- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["base", "tied"])
def test_save_load_round_trip_is_bit_identical(which, tiny_ckpts, tmp_path):
    a = load_checkpoint(tiny_ckpts[which], dtype="float32", **QUIET)
    save_checkpoint(a.model, tmp_path / "rt", dtype=torch.float32)
    b = load_checkpoint(tmp_path / "rt", dtype="float32", **QUIET)
    sa, sb = _state_dict(a), _state_dict(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # The tensors on disk are the same too (same keys, same bits).
    fa = load_file(str(tiny_ckpts[which] / "model.safetensors"))
    fb = load_file(str(tmp_path / "rt" / "model.safetensors"))
    assert fa.keys() == fb.keys()
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    assert ("lm_head.weight" in fa) == (not a.args.tie_word_embeddings)
    toks = _tokens(a.args.vocab_size)
    assert torch.equal(_logits(a, toks), _logits(b, toks))
    assert json.loads((tmp_path / "rt" / "config.json").read_text())["model_type"] == "qwen3_next"


def test_sharded_index_loads_identically(tiny_ckpt, tmp_path):
    ref = load_checkpoint(tiny_ckpt, dtype="float32", **QUIET)
    dst = tmp_path / "sharded"
    shutil.copytree(tiny_ckpt, dst)
    (dst / "model.safetensors").unlink()
    sd = load_file(str(tiny_ckpt / "model.safetensors"))
    keys = sorted(sd)
    shards = [keys[i::3] for i in range(3)]  # interleaved: a parameter's experts span shards
    weight_map = {}
    for i, ks in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: sd[k] for k in ks}, str(dst / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in ks})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    got = load_checkpoint(dst, dtype="float32", **QUIET)
    sa, sb = _state_dict(ref), _state_dict(got)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    toks = _tokens(ref.args.vocab_size)
    assert torch.equal(_logits(ref, toks), _logits(got, toks))


def test_bfloat16_override(tiny_ckpt):
    f32 = load_checkpoint(tiny_ckpt, dtype="float32", **QUIET)
    bf = load_checkpoint(tiny_ckpt, dtype="bfloat16", **QUIET)
    assert bf.dtype == torch.bfloat16 and f32.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in bf.model.parameters())
    toks = _tokens(f32.args.vocab_size)
    assert rel_err(_logits(bf, toks).float(), _logits(f32, toks)) <= 3e-2
    # auto is float32 on CPU, whatever the checkpoint stores.
    assert load_checkpoint(tiny_ckpt, **QUIET).dtype == torch.float32


def test_bfloat16_checkpoint_round_trip(tiny_ckpt, tmp_path):
    a = load_checkpoint(tiny_ckpt, dtype="float32", **QUIET)
    save_checkpoint(a.model, tmp_path / "bf", dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "bf" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "bf" / "model.safetensors")).values())
    b = load_checkpoint(tmp_path / "bf", dtype="bfloat16", **QUIET)
    sa, sb = _state_dict(a), _state_dict(b)
    assert all(torch.equal(sa[k].to(torch.bfloat16), sb[k]) for k in sa)


def test_load_on_meta_free_device_and_rotary_buffer(tiny_ckpt):
    lm = load_checkpoint(tiny_ckpt, dtype="float32", **QUIET)
    assert not any(p.is_meta for p in lm.model.parameters())
    assert not any(b.is_meta for b in lm.model.buffers())
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert not lm.model.training


# ---- bad checkpoints: one CheckpointError naming the file and the key ---------------------------


def test_not_a_directory(tmp_path):
    checkpoint_error(tmp_path / "nope", "nope", "not a directory")


def test_missing_config(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    checkpoint_error(ckpt_copy, ckpt_copy / "config.json", "missing")


def test_malformed_config_json(ckpt_copy):
    (ckpt_copy / "config.json").write_text('{"model_type": "qwen3_next", ')
    checkpoint_error(ckpt_copy, ckpt_copy / "config.json", "JSON")


def test_unsupported_model_type(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    checkpoint_error(ckpt_copy, ckpt_copy / "config.json", "model_type", "'llama'")


@pytest.mark.parametrize("key,value,needle", [
    ("hidden_size", -4, "hidden_size must be an integer >= 1, got -4"),
    ("vocab_size", "big", "vocab_size must be an integer >= 1, got 'big'"),
    ("num_hidden_layers", 2.5, "num_hidden_layers must be an integer >= 1, got 2.5"),
    ("num_attention_heads", 0, "num_attention_heads must be an integer >= 1, got 0"),
    ("num_experts_per_tok", True, "num_experts_per_tok must be an integer >= 1, got True"),
    ("num_experts_per_tok", 99, "num_experts_per_tok (99) must be at most num_experts"),
    ("max_position_embeddings", 0, "max_position_embeddings must be an integer >= 1"),
    ("rms_norm_eps", -1, "rms_norm_eps must be a finite number > 0, got -1"),
    ("norm_topk_prob", "yes", "norm_topk_prob must be true or false, got 'yes'"),
    ("mlp_only_layers", [0, 7], "mlp_only_layers must list layer indices in [0, 4), got [7]"),
    ("eos_token_id", -1, "eos_token_id must be token ids in [0, "),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "x"}, "rope_theta must be a number"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 2.0},
     "partial_rotary_factor 2.0"),
])
def test_config_value_out_of_range(ckpt_copy, key, value, needle):
    """A malformed config.json value is one CheckpointError naming the key and the value, not a
    failure deep inside the model's construction."""
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4
    cfg[key] = value
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    checkpoint_error(ckpt_copy, needle)


def test_config_without_layer_types_needs_a_positive_interval(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 0
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    checkpoint_error(ckpt_copy, "full_attention_interval must be an integer >= 1, got 0")


def test_config_missing_required_key(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    del cfg["linear_num_value_heads"]
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    checkpoint_error(ckpt_copy, ckpt_copy / "config.json", "linear_num_value_heads")


@pytest.mark.parametrize("key", ["model.layers.0.linear_attn.A_log",
                                 "model.layers.1.mlp.experts.3.up_proj.weight",
                                 "model.layers.3.self_attn.k_norm.weight",
                                 "mtp.norm.weight", "lm_head.weight"])
def test_missing_tensor(ckpt_copy, key):
    edit_tensors(ckpt_copy, lambda sd: sd.pop(key))
    checkpoint_error(ckpt_copy, ckpt_copy, "model.safetensors", repr(key), "missing")


@pytest.mark.parametrize("key", ["model.layers.0.linear_attn.extra.weight",
                                 "model.layers.1.mlp.experts.8.gate_proj.weight",
                                 "transformer.h.0.attn.weight"])
def test_unexpected_tensor(ckpt_copy, key):
    edit_tensors(ckpt_copy, lambda sd: sd.__setitem__(key, torch.zeros(4, 4)))
    checkpoint_error(ckpt_copy, ckpt_copy / "model.safetensors", repr(key))


@pytest.mark.parametrize("key", ["model.embed_tokens.weight",
                                 "model.layers.2.mlp.experts.5.down_proj.weight",
                                 "mtp.fc.weight"])
def test_misshapen_tensor(ckpt_copy, key):
    def edit(sd):
        t = sd[key]
        sd[key] = torch.zeros(t.shape[0] + 1, *t.shape[1:])
    edit_tensors(ckpt_copy, edit)
    checkpoint_error(ckpt_copy, ckpt_copy / "model.safetensors", repr(key), "shape")


def _shard(path: Path) -> Path:
    sd = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    keys = sorted(sd)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    for name, ks in zip(names, halves):
        save_file({k: sd[k] for k in ks}, str(path / name))
    wm = {k: n for n, ks in zip(names, halves) for k in ks}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return path / names[1]


def test_missing_shard(ckpt_copy):
    second = _shard(ckpt_copy)
    load_checkpoint(ckpt_copy, **QUIET)  # complete: loads
    second.unlink()
    checkpoint_error(ckpt_copy, second, "model.safetensors.index.json", "missing shard")


def test_malformed_shard_index(ckpt_copy):
    _shard(ckpt_copy)
    (ckpt_copy / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    checkpoint_error(ckpt_copy, ckpt_copy / "model.safetensors.index.json", "malformed")
    (ckpt_copy / "model.safetensors.index.json").write_text("{}")
    checkpoint_error(ckpt_copy, ckpt_copy / "model.safetensors.index.json", "weight_map")


def test_no_safetensors_at_all(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    checkpoint_error(ckpt_copy, ckpt_copy, "model.safetensors", "model.safetensors.index.json")


def test_corrupt_safetensors(ckpt_copy):
    f = ckpt_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    checkpoint_error(ckpt_copy, f, "safetensors")


def test_corrupt_tokenizer_and_generation_config(ckpt_copy):
    (ckpt_copy / "generation_config.json").write_text("{eos")
    checkpoint_error(ckpt_copy, ckpt_copy / "generation_config.json", "eos_token_id")
    (ckpt_copy / "generation_config.json").unlink()
    (ckpt_copy / "tokenizer.json").write_text("not json")
    checkpoint_error(ckpt_copy, ckpt_copy / "tokenizer.json", "tokenizer")


def test_missing_tokenizer_is_not_an_error(ckpt_copy):
    (ckpt_copy / "tokenizer.json").unlink()
    lm = load_checkpoint(ckpt_copy, **QUIET)
    assert lm.tokenizer is None
    assert lm.args.eos_token_id == [0]  # from config.json
    toks = _tokens(lm.args.vocab_size)
    assert torch.isfinite(_logits(lm, toks)).all()


def test_tokenizer_loaded_with_eos(tiny_ckpt):
    lm = load_checkpoint(tiny_ckpt, **QUIET)
    assert lm.tokenizer is not None and lm.tokenizer.eos_ids == [0]
    ids = lm.tokenizer.encode("def f(x):\n    return x\n")
    assert lm.tokenizer.decode(ids) == "def f(x):\n    return x\n"


# ---- a checkpoint without MTP ------------------------------------------------------------------
def test_checkpoint_without_mtp_loads_runs_and_says_so_once(tiny_ckpt_no_mtp, capsys):
    assert not any(k.startswith("mtp.") for k in load_file(str(tiny_ckpt_no_mtp / "model.safetensors")))
    lm = load_checkpoint(tiny_ckpt_no_mtp, dtype="float32")  # default log: print
    out = capsys.readouterr().out
    info = [ln for ln in out.splitlines() if ln.startswith("INFO") and "mtp" in ln]
    assert len(info) == 1, out
    assert not lm.has_mtp and lm.model.mtp is None
    toks = _tokens(lm.args.vocab_size, 20)
    with torch.no_grad():
        full = lm.model.logits(lm.model.forward_train(toks))
        state = DecodeState(lm.args, 1, 24, lm.dtype, "cpu", with_mtp=False)
        h = lm.model.prefill(toks[0, :19], 0, 0, state)
        _, lg, _, _ = lm.model.verify_window(toks[:1, 19:20], torch.tensor([0]), torch.tensor([19]),
                                             20, state)
    assert rel_err(torch.cat([lm.model.logits(h), lg[0]]), full[0]) <= 1e-4


def test_checkpoint_with_mtp_prints_no_info(tiny_ckpt, capsys):
    lm = load_checkpoint(tiny_ckpt, dtype="float32")
    assert lm.has_mtp
    assert "INFO" not in capsys.readouterr().out
