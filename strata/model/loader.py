"""Load and save Hugging Face format checkpoints (config.json, safetensors, tokenizer.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from strata.model.config import CheckpointError, ModelArgs, load_model_args
from strata.model.qwen3_next import Qwen3Next, Rotary
from strata.model.tokenizer import Tokenizer
from strata.model.weight_map import QWEN3_NEXT, KeyMap

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Qwen3Next
    args: ModelArgs
    tokenizer: Optional[Tokenizer]
    path: Path
    has_mtp: bool
    dtype: torch.dtype


def resolve_dtype(name: str, args: ModelArgs, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype on GPU, float32 on CPU (CPU half-precision matmul is slow)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(args.torch_dtype, torch.bfloat16)
    if name not in DTYPES:
        raise CheckpointError(f"model.dtype: {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _shard_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: malformed shard index ({type(e).__name__}: {e})") from None
        for f in files:
            if not (path / f).is_file():
                raise CheckpointError(f"{path / f}: missing shard named in {index.name}")
        return [path / f for f in files]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def load_checkpoint(path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu",
                    keymap: KeyMap = QWEN3_NEXT, log=print, fuse: bool = True,
                    moe_dense_experts: int = 16) -> LoadedModel:
    """Build the model from a checkpoint directory; every problem names the file and the key."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model.path: {path} is not a directory")
    device = torch.device(device)
    args = load_model_args(path)
    tdtype = resolve_dtype(dtype, args, device)
    files = _shard_files(path)
    with_mtp = False
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                if any(k.startswith("mtp.") for k in sf.keys()):
                    with_mtp = True
        except Exception as e:  # safetensors raises its own SafetensorError (or OSError)
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
    with torch.device("meta"):
        model = Qwen3Next(args, with_mtp=with_mtp)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {"lm_head.weight"} if args.tie_word_embeddings else set()
    values: dict[str, torch.Tensor] = {name: torch.empty(p.shape, dtype=tdtype, device=device)
                                       for name, p in params.items() if name not in tied}
    covered: set[tuple] = set()  # (param, expert, part) of every tensor read
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                target = keymap.to_target(key)
                if target is None or target.param not in values:
                    if key == "lm_head.weight" and tied:
                        continue
                    raise CheckpointError(f"{f}: unexpected tensor {key!r} (no such parameter)")
                t = sf.get_tensor(key)
                dest = values[target.param]
                if target.expert is None:
                    want = tuple(dest.shape)
                    view = dest
                else:
                    inter = dest.shape[1] // 2 if target.part != "down" else None
                    if target.expert >= dest.shape[0]:
                        raise CheckpointError(f"{f}: tensor {key!r}: expert {target.expert} out of "
                                              f"range (num_experts={dest.shape[0]})")
                    if target.part == "gate":
                        view = dest[target.expert, :inter]
                    elif target.part == "up":
                        view = dest[target.expert, inter:]
                    else:
                        view = dest[target.expert]
                    want = tuple(view.shape)
                if tuple(t.shape) != want:
                    raise CheckpointError(f"{f}: tensor {key!r} has shape {tuple(t.shape)}, "
                                          f"expected {want}")
                view.copy_(t.to(tdtype))
                covered.add((target.param, target.expert, target.part))
    missing = [key for name in values
               for key, tg in keymap.checkpoint_keys(name, tuple(values[name].shape))
               if (tg.param, tg.expert, tg.part) not in covered]
    if missing:
        names = ", ".join(f.name for f in files)
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r} (not in {names}; "
                              f"{len(missing)} missing in all)")
    model.to_empty(device=device).to(tdtype)
    model.to(dtype=tdtype)  # the parameters themselves take the load dtype (not only the values)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in values:
                p.copy_(values[name])
        if args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        # Buffers are not in the checkpoint: rebuild the rotary table on the device.
        model.rotary = Rotary(args).to(device)
    model.eval().requires_grad_(False)
    if fuse:
        model.fuse_for_inference(moe_dense_experts)
    if not with_mtp:
        log("INFO: checkpoint has no mtp.* weights: running without speculation")
    tok = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    if tok is not None and not args.eos_token_id:
        args.eos_token_id = tok.eos_ids
    return LoadedModel(model, args, tok, path, with_mtp, tdtype)


def save_checkpoint(model: Qwen3Next, path: str | Path, dtype: torch.dtype = torch.float32,
                    keymap: KeyMap = QWEN3_NEXT, extra_config: Optional[dict] = None) -> None:
    """Write config.json and model.safetensors with real checkpoint key names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    args = model.args
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if args.tie_word_embeddings and name == "lm_head.weight":
            continue
        data = p.detach().to("cpu", dtype)
        for key, target in keymap.checkpoint_keys(name, tuple(p.shape)):
            if target.expert is None:
                t = data
            elif target.part == "gate":
                t = data[target.expert, : data.shape[1] // 2]
            elif target.part == "up":
                t = data[target.expert, data.shape[1] // 2:]
            else:
                t = data[target.expert]
            tensors[key] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = args.to_hf_dict()
    cfg["dtype"] = str(dtype).replace("torch.", "")
    cfg["num_nextn_predict_layers"] = 1 if model.mtp is not None else 0
    if extra_config:
        cfg.update(extra_config)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

