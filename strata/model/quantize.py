"""Write an FP8 block checkpoint (Hugging Face fine-grained format) from a float one.

Each converted weight (O, I) becomes float8_e4m3fn values plus `weight_scale_inv`
(ceil(O/bo), ceil(I/bi)) float32, the block's amax / 448, so that value x scale restores the
weight to e4m3 precision. Converted: every 2-D `.weight` of a linear layer or an expert whose
module `modules_to_not_convert` does not name. Embeddings are never converted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from strata.model.config import CheckpointError, load_model_args
from strata.model.fp8 import FP8_DTYPE, FP8_MAX, QuantConfig
from strata.model.loader import check_entries, read_entries

#: Kept in high precision by default, as the Qwen3-Next FP8 release does: the head, the
#: embedding, the routers and the DeltaNet's small b/a projection.
DEFAULT_NOT_CONVERT = ("lm_head", "embed_tokens", "mlp.gate", "mlp.shared_expert_gate",
                       "linear_attn.in_proj_ba")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "config.json")


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, I) float -> (O, I) float8_e4m3fn and (ceil(O/bo), ceil(I/bi)) float32 scale_inv."""
    o, i = w.shape
    # a block beyond the weight is one block either way; padding up to it could ask for TBs
    bo, bi = min(block[0], o), min(block[1], i)
    po, pi = -(-o // bo) * bo, -(-i // bi) * bi
    wp = F.pad(w.float(), (0, pi - i, 0, po - o))
    blocks = wp.view(po // bo, bo, pi // bi, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(po, pi)[:o, :i]
    return q.to(FP8_DTYPE).contiguous(), scale.contiguous()


def _convertible(key: str, t: torch.Tensor, quant: QuantConfig) -> bool:
    if not key.endswith(".weight") or t.dim() != 2 or "embed_tokens" in key:
        return False
    return t.is_floating_point() and quant.converts(key[: -len(".weight")])


def quantize_checkpoint(src: str | Path, dst: str | Path, block: Sequence[int] = (128, 128),
                        not_convert: Optional[Sequence[str]] = None, log=print) -> Path:
    """Write DST: the FP8 block checkpoint of SRC (shards kept as they are), config.json with
    quantization_config, and every other file of SRC (tokenizer, generation config) copied."""
    src, dst = Path(src), Path(dst)
    load_model_args(src)  # a clear error for a directory that is no checkpoint
    cfg = json.loads((src / "config.json").read_text())
    if "quantization_config" in cfg:
        raise CheckpointError(f"{src / 'config.json'}: already has a quantization_config")
    if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                  for b in block):
        raise CheckpointError(f"--block: two positive ints, got {list(block)}")
    quant = QuantConfig((int(block[0]), int(block[1])),
                        tuple(DEFAULT_NOT_CONVERT if not_convert is None else not_convert))
    # Before anything is written: DST = SRC would overwrite the source's weights, and a
    # used DST would mix its old shards and index with the new checkpoint.
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: is the source checkpoint; write the FP8 one to a new "
                              f"directory")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst}: exists and is not an empty directory (the FP8 checkpoint "
                              f"goes to a new or empty one)")
    # The loader's checks of the source's files: one clear error for a corrupt shard, a bad
    # index, a non-float tensor or FP8 weights without a quantization_config.
    entries = read_entries(src)
    check_entries(entries, None, src)
    index = src / "model.safetensors.index.json"
    shards = (["model.safetensors"] if (src / "model.safetensors").is_file()
              else sorted({e.file.name for e in entries.values()}))
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    n_fp8 = 0
    for shard in shards:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(src / shard), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                t = sf.get_tensor(key)
                if _convertible(key, t, quant):
                    out[key], out[key + "_scale_inv"] = quantize_block(t, quant.block)
                    n_fp8 += 1
                else:
                    out[key] = t
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in out})
    if shards != ["model.safetensors"]:
        (dst / index.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    cfg["quantization_config"] = quant.to_hf_dict()
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name not in WEIGHT_FILES and f.name not in shards:
            shutil.copy2(f, dst / f.name)
    log(f"wrote {dst}: {n_fp8} FP8 weights, weight_block_size {list(quant.block)}")
    return dst
