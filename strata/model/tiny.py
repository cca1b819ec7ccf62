"""Tiny random Qwen3-Next checkpoints with real key names (tests use them; nothing is downloaded)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable, Optional

import torch

from strata.model.config import ModelArgs
from strata.model.loader import save_checkpoint
from strata.model.qwen3_next import Qwen3Next

TINY_DEFAULTS = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
    rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.25,
    max_position_embeddings=4096, torch_dtype="float32",
)


def tiny_args(**overrides) -> ModelArgs:
    kw = dict(TINY_DEFAULTS)
    if "full_attention_interval" in overrides:
        interval = overrides.pop("full_attention_interval")
        n = overrides.get("num_hidden_layers", kw["num_hidden_layers"])
        kw["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention"
                             for i in range(n)]
    kw.update(overrides)
    if len(kw["layer_types"]) != kw["num_hidden_layers"]:
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    return ModelArgs(**kw)


@torch.no_grad()
def init_random(model: Qwen3Next, seed: int = 0, std: float = 0.02, head_std: float = 0.02,
                norm_std: float = 0.0) -> Qwen3Next:
    """Deterministic random weights. norm_std > 0 perturbs norm weights (tests exercise them)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.ones(p.shape) + 0.1 * torch.randn(p.shape, generator=g))
        elif "norm" in name.rsplit(".", 2)[-2] or name.endswith("norm.weight"):
            base = torch.ones(p.shape) if ".linear_attn.norm." in name else torch.zeros(p.shape)
            p.copy_(base + norm_std * torch.randn(p.shape, generator=g))
        elif name == "lm_head.weight":
            p.copy_(head_std * torch.randn(p.shape, generator=g))
        else:
            p.copy_(std * torch.randn(p.shape, generator=g))
    return model


def default_corpus() -> Iterable[str]:
    """Source text of a few standard-library modules: always present, no download."""
    lib = Path(sys.modules["json"].__file__).resolve().parent.parent
    for name in ("json/__init__.py", "json/decoder.py", "json/encoder.py", "textwrap.py",
                 "string.py", "bisect.py", "heapq.py", "fnmatch.py", "glob.py", "colorsys.py"):
        f = lib / name
        if f.is_file():
            yield f.read_text(encoding="utf-8", errors="replace")


def train_bpe(vocab_size: int, texts: Optional[Iterable[str]] = None):
    """A byte-level BPE tokenizer with `<|endoftext|>` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts if texts is not None else default_corpus()), trainer)
    return tok


def make_tiny_random(path: str | Path, seed: int = 0, with_mtp: bool = True,
                     dtype: torch.dtype = torch.float32, head_std: float = 0.5,
                     norm_std: float = 0.1, tokenizer: bool = True, **overrides) -> Path:
    """Write a random checkpoint directory: config.json, model.safetensors, tokenizer.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    eos = [0]
    if tokenizer:
        vocab = overrides.get("vocab_size", TINY_DEFAULTS["vocab_size"])
        tok = train_bpe(vocab)
        overrides["vocab_size"] = max(vocab, tok.get_vocab_size())
        tok.save(str(path / "tokenizer.json"))
    args = tiny_args(eos_token_id=eos, **overrides)
    torch.manual_seed(seed)
    model = init_random(Qwen3Next(args, with_mtp=with_mtp), seed=seed, head_std=head_std,
                        norm_std=norm_std)
    save_checkpoint(model, path, dtype=dtype)
    (path / "generation_config.json").write_text('{"eos_token_id": 0}\n')
    return path
