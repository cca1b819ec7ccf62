"""The model's hyper-parameters, read from a Hugging Face `config.json` (model_type qwen3_next)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

SUPPORTED_MODEL_TYPES = ("qwen3_next",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the key."""


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    torch_dtype: str = "float32"
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    #: MTP layers the config announces (0: none; the checkpoint decides if they are present).
    num_nextn_predict_layers: int = 1

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    def to_hf_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model_type"] = "qwen3_next"
        d["architectures"] = ["Qwen3NextForCausalLM"]
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor}
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        d["dtype"] = self.torch_dtype
        return d


def _rope(cfg: dict[str, Any]) -> tuple[float, float]:
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        raise CheckpointError(f"config.json: {key} must be an object, got {rp!r}")
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype not in ("default", None):
        raise CheckpointError(f"config.json: rope type {rtype!r} is not supported (default only)")
    for key, v in (("rope_theta", theta), ("partial_rotary_factor", factor)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CheckpointError(f"config.json: {key} must be a number, got {v!r}")
    return float(theta), float(factor)


#: ModelArgs' integer fields and the least value each may take.
_INT_MINIMUMS = {"vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1,
                 "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 1,
                 "intermediate_size": 1, "linear_num_key_heads": 1, "linear_num_value_heads": 1,
                 "linear_key_head_dim": 1, "linear_value_head_dim": 1, "linear_conv_kernel_dim": 1,
                 "num_experts": 0, "num_experts_per_tok": 1, "moe_intermediate_size": 0,
                 "shared_expert_intermediate_size": 0, "decoder_sparse_step": 1,
                 "max_position_embeddings": 1, "num_nextn_predict_layers": 0}


def _check_int(cfg_path: Path, key: str, value: Any, least: int) -> None:
    # (bool is an int to Python, never to a config)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise CheckpointError(f"{cfg_path}: {key} must be an integer >= {least}, got {value!r}")


def _check_values(cfg_path: Path, args: ModelArgs) -> None:
    """Every value of a parsed config.json in its range, so that a malformed one is an error
    naming the key instead of a failure deep inside the model's construction."""
    for key, least in _INT_MINIMUMS.items():
        _check_int(cfg_path, key, getattr(args, key), least)
    for key in ("norm_topk_prob", "tie_word_embeddings"):
        if not isinstance(getattr(args, key), bool):
            raise CheckpointError(f"{cfg_path}: {key} must be true or false, "
                                  f"got {getattr(args, key)!r}")
    for key in ("rms_norm_eps", "rope_theta"):
        v = getattr(args, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise CheckpointError(f"{cfg_path}: {key} must be a finite number > 0, got {v!r}")
    if not 0 < args.partial_rotary_factor <= 1 or args.rotary_dim < 2 or args.rotary_dim % 2:
        raise CheckpointError(
            f"{cfg_path}: partial_rotary_factor {args.partial_rotary_factor!r} of head_dim "
            f"{args.head_dim} must give an even rotary dimension of at least 2, within head_dim")
    if args.num_experts:
        if args.num_experts_per_tok > args.num_experts:
            raise CheckpointError(f"{cfg_path}: num_experts_per_tok ({args.num_experts_per_tok}) "
                                  f"must be at most num_experts ({args.num_experts})")
        if args.moe_intermediate_size < 1:
            raise CheckpointError(f"{cfg_path}: moe_intermediate_size must be >= 1 with "
                                  f"num_experts > 0, got {args.moe_intermediate_size!r}")
    bad = [i for i in args.mlp_only_layers if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i < args.num_hidden_layers]
    if bad:
        raise CheckpointError(f"{cfg_path}: mlp_only_layers must list layer indices in "
                              f"[0, {args.num_hidden_layers}), got {bad}")
    check_eos_ids(args.eos_token_id, args.vocab_size, cfg_path)


def check_eos_ids(ids: list, vocab_size: int, where: Any) -> None:
    """End-of-text ids must be token ids of the vocabulary: the engine stops on them, so a
    string or an id past the vocabulary would silently never end a completion."""
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise CheckpointError(f"{where}: eos_token_id must be token ids in [0, {vocab_size}), "
                              f"got {bad}")


def load_model_args(path: str | Path) -> ModelArgs:
    """Parse `config.json` in a checkpoint directory into ModelArgs, with clear errors."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: missing (a checkpoint directory needs config.json)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{cfg_path}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path}: must hold a JSON object, got {type(cfg).__name__}")
    if "text_config" in cfg and cfg.get("model_type") != "qwen3_next":
        if not isinstance(cfg["text_config"], dict):
            raise CheckpointError(f"{cfg_path}: text_config must be an object, "
                                  f"got {cfg['text_config']!r}")
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type")}
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{cfg_path}: model_type {mtype!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "linear_num_key_heads",
                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"]
    missing = [k for k in required if k not in cfg]
    if missing:
        raise CheckpointError(f"{cfg_path}: missing keys {missing}")
    n = cfg["num_hidden_layers"]
    _check_int(cfg_path, "num_hidden_layers", n, 1)
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = cfg.get("full_attention_interval", 4)
        _check_int(cfg_path, "full_attention_interval", interval, 1)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if len(layer_types) != n or any(t not in ("linear_attention", "full_attention") for t in layer_types):
        raise CheckpointError(f"{cfg_path}: layer_types must list {n} of linear_attention/full_attention")
    theta, factor = _rope(cfg)
    eos = cfg.get("eos_token_id")
    eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    args = ModelArgs(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_hidden_layers=n,
        layer_types=list(layer_types), num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"],
        linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"],
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
        num_experts=cfg.get("num_experts", 0), num_experts_per_tok=cfg.get("num_experts_per_tok", 1),
        moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
        norm_topk_prob=cfg.get("norm_topk_prob", True),
        decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
        mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, partial_rotary_factor=factor,
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        hidden_act=cfg.get("hidden_act", "silu"), torch_dtype=str(dtype).replace("torch.", ""),
        eos_token_id=eos_list, bos_token_id=cfg.get("bos_token_id"),
        num_nextn_predict_layers=cfg.get("num_nextn_predict_layers", 1),
    )
    _check_values(cfg_path, args)
    if args.hidden_act != "silu":
        raise CheckpointError(f"{cfg_path}: hidden_act {args.hidden_act!r} is not supported (silu)")
    if args.num_attention_heads % args.num_key_value_heads:
        raise CheckpointError(f"{cfg_path}: num_attention_heads must be a multiple of num_key_value_heads")
    if args.linear_num_value_heads % args.linear_num_key_heads:
        raise CheckpointError(f"{cfg_path}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    return args
