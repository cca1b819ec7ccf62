"""FP8 block-scaled weights (Hugging Face fine-grained format) in the model.

A checkpoint's `quantization_config` (config.json) says the format; each FP8 `...weight` has a
`...weight_scale_inv` (ceil(O/bo), ceil(I/bi)) beside it. On a GPU with FP8 support the model
keeps such weights in FP8: a linear layer becomes an `Fp8Linear` (its forward is
`ops.linear_fp8`) and the stacked experts keep FP8 `w_gate_up` / `w_down` with `gu_scale` /
`down_scale` (layouts in strata/kernels/reference.py). Elsewhere the loader dequantises exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from strata.kernels import ops
from strata.kernels.reference import dequant_fp8_block
from strata.model.config import CheckpointError

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite float8_e4m3fn value (a block's amax maps to it when quantising).
FP8_MAX = 448.0


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` of an FP8 block checkpoint."""
    block: tuple[int, int]
    not_convert: tuple[str, ...] = field(default_factory=tuple)

    def converts(self, module: str) -> bool:
        """Whether the module (checkpoint name, e.g. `model.layers.0.mlp.gate`) is FP8.
        An entry matches whole dotted components, so `mlp.gate` names the router but not
        `mlp.gate_proj`."""
        dotted = f".{module}."
        return not any(f".{m.strip('.')}." in dotted for m in self.not_convert)

    def to_hf_dict(self) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block), "modules_to_not_convert": list(self.not_convert)}


def parse_quant_config(cfg: dict, where: str | Path) -> Optional[QuantConfig]:
    """The QuantConfig of a parsed config.json (None when it has no quantization_config);
    anything strata cannot run is a CheckpointError naming `where` and the key."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: quantization_config must be an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{where}: quantization_config.quant_method {method!r} is not "
                              f"supported (fp8 only)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}: quantization_config.fmt {fmt!r} is not supported (e4m3 only)")
    # static: per-layer activation scales (input_scale tensors) that strata would not apply
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CheckpointError(f"{where}: quantization_config.activation_scheme {scheme!r} is not "
                              f"supported (dynamic only)")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size must be two "
                              f"positive ints [bo, bi], got {block!r}")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise CheckpointError(f"{where}: quantization_config.modules_to_not_convert must be a "
                              f"list of module names")
    return QuantConfig((int(block[0]), int(block[1])), tuple(skip))


def load_quant_config(path: str | Path) -> Optional[QuantConfig]:
    """The QuantConfig of the checkpoint directory's config.json (None: not quantised)."""
    cfg_path = Path(path) / "config.json"
    return parse_quant_config(json.loads(cfg_path.read_text()), cfg_path)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the block scales of a (..., O, I) weight."""
    *lead, o, i = shape
    return (*lead, -(-o // block[0]), -(-i // block[1]))


def fp8_supported(device: torch.device) -> bool:
    """FP8 weights stay FP8 on a GPU of compute capability 8.9 or newer (Ada, Hopper)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if getattr(torch.version, "hip", None):  # MI300 and newer: e4m3fnuz, not e4m3fn
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    """A bias-free linear layer with an FP8 weight (O, I) and float32 block scales."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int]):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = (int(block[0]), int(block[1]))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_shape((out_features, in_features), block), dtype=torch.float32),
            requires_grad=False)

    #: Whether prompt chunks (project(..., prompt=True)) run this layer on its weight
    #: dequantised in the chunk instead of the FP8 kernel; the loader sets it (model.fp8_dense).
    prompt_dequant: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear_fp8(x, self.weight, self.weight_scale_inv, self.block)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


def project(mod: nn.Module, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
    """mod(x); for a prompt chunk's rows (prompt) through an Fp8Linear marked prompt_dequant,
    one matmul on its weight dequantised to x's dtype in the chunk. The streamed FP8 kernel
    reads the whole weight once per 16 rows (its bits must not depend on a launch's rows), so
    eight slots' 64-token chunks, 512 rows, read a contracting projection 32 times; the
    dequantised copy costs one pass that writes twice the FP8 bytes, and cuBLAS then reads
    it once. Windows keep the FP8 kernel."""
    if dequant_in_prompt(mod, prompt):
        return linear(x, mod.weight, mod.weight_scale_inv, mod.block, dequant=True)
    if type(mod) is nn.Linear and mod.bias is None:
        return dense(x, mod.weight, prompt)
    return mod(x)


def dequant_in_prompt(mod: nn.Module, prompt: bool) -> bool:
    """Whether a prompt chunk's rows (prompt) run `mod`, or the fused projection it is a view
    of, on its weight dequantised in the chunk: an Fp8Linear the loader marked prompt_dequant."""
    return prompt and isinstance(mod, Fp8Linear) and mod.prompt_dequant


#: Projections fused into one matmul with their siblings at load (attention's q/k/v,
#: DeltaNet's qkvz with ba): they must share one format, so they follow the widest of them.
FUSED_INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "in_proj_qkvz", "in_proj_ba")


def contracting(name: str, mod: nn.Module) -> bool:
    """Whether a projection (module `name`) has no more outputs than inputs and is not one of
    the fused input projections: attention's o_proj, DeltaNet's out_proj, the MTP fc. There the
    streamed FP8 kernel measured faster than cuBLAS on the bf16 copy at every decode row count
    on an H200, while the wide input projections (12288 or 9216 outputs) ran faster on cuBLAS
    from four rows up (docs/KERNELS.md)."""
    return (mod.out_features <= mod.in_features
            and name.rsplit(".", 1)[-1] not in FUSED_INPUT_PROJECTIONS)


def dense_fp8_layers(model: nn.Module) -> list[tuple[str, "Fp8Linear"]]:
    """(name, module) of every Fp8Linear outside the MoE blocks (the dense linear layers)."""
    from strata.model.qwen3_next import SparseMoe

    in_moe = {id(m) for blk in model.modules() if isinstance(blk, SparseMoe) for m in blk.modules()}
    return [(name, mod) for name, mod in model.named_modules()
            if isinstance(mod, Fp8Linear) and id(mod) not in in_moe]


def dense_to_dequantize(model: nn.Module, keep=None) -> list[tuple[str, "Fp8Linear"]]:
    """(name, module) of every Fp8Linear that dequantize_dense(model, dtype, keep) replaces."""
    return [(name, mod) for name, mod in dense_fp8_layers(model)
            if not (keep is not None and keep(name, mod))]


def dequantize_in_prompts(model: nn.Module) -> int:
    """Mark every dense Fp8Linear prompt_dequant (project()); returns how many."""
    layers = dense_fp8_layers(model)
    for _, mod in layers:
        mod.prompt_dequant = True
    return len(layers)


def dequantize_dense(model: nn.Module, dtype: torch.dtype, keep=None) -> int:
    """Replace every Fp8Linear outside the MoE blocks (attention, DeltaNet and MTP projections,
    dense MLPs) by an nn.Linear holding its exactly dequantised weight in `dtype`, except those
    for which keep(name, module) is true; the routed and shared experts stay FP8 for the grouped
    kernel. cuBLAS on the bf16 copy reads twice the bytes but beat the FP8 kernels on the wide
    projections (docs/KERNELS.md), so those trade memory for speed. Returns how many layers
    changed."""
    todo = dense_to_dequantize(model, keep)
    for name, mod in todo:
        owner_name, attr = name.rsplit(".", 1) if "." in name else ("", name)
        owner = model.get_submodule(owner_name) if owner_name else model
        dense = nn.Linear(mod.in_features, mod.out_features, bias=False, device="meta")
        dense.weight = nn.Parameter(dequant_fp8_block(mod.weight, mod.weight_scale_inv, mod.block,
                                                      dtype), requires_grad=False)
        setattr(owner, attr, dense)
    return len(todo)


def to_fp8_linear(parent: nn.Module, attr: str, block: tuple[int, int]) -> Fp8Linear:
    """Replace `parent.attr` (an nn.Linear without bias) by an Fp8Linear of the same shape
    (on the device of the old weight, meta while the loader builds)."""
    old = getattr(parent, attr)
    if not isinstance(old, nn.Linear) or old.bias is not None:
        raise CheckpointError(f"{attr}: only bias-free linear layers can hold FP8 weights")
    with torch.device(old.weight.device):
        new = Fp8Linear(old.in_features, old.out_features, block)
    setattr(parent, attr, new)
    return new


def dense(x: torch.Tensor, weight: torch.Tensor, prompt: bool = False) -> torch.Tensor:
    """x @ weight^T for a float weight: in a decode window (not prompt) a small bf16 weight on
    the GPU's skinny kernel where it is switched on (ops.skinny_takes), else F.linear."""
    if not prompt and ops.skinny_takes(x, weight):
        return ops.linear_skinny(x, weight)
    return torch.nn.functional.linear(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor],
           block: Optional[tuple[int, int]], dequant: bool = False,
           prompt: bool = False) -> torch.Tensor:
    """x @ weight^T for a float weight (scale None: dense()) or an FP8 block-scaled one;
    `dequant`: the FP8 weight dequantised to x's dtype first (a prompt chunk's rows, as
    project()); `prompt`: a prompt chunk's rows (dense())."""
    if scale is None:
        return dense(x, weight, prompt)
    if dequant:
        return torch.nn.functional.linear(x, dequant_fp8_block(weight, scale, block, x.dtype))
    return ops.linear_fp8(x, weight, scale, block)


def fuse_projections(mods: list[nn.Module], row_multiple: int = 1):
    """One weight (and for FP8 one scale tensor) for several projections of the same input, or
    None when they cannot be fused: a mix of float and FP8, or FP8 parts whose row counts are
    not multiples of the block rows (their scale rows would straddle two parts). Each module's
    parameters become views into the fused tensors, so no memory is duplicated.
    row_multiple (float weights only): zero rows are appended up to a multiple of it, so that
    the product's rows stay 16-byte aligned (cuBLAS falls back to slow unaligned kernels for an
    output of 513 columns, the router plus the shared-expert gate); callers slice them off.
    Returns (weight, scale or None, block or None)."""
    fp8 = [isinstance(m, Fp8Linear) for m in mods]
    if any(fp8) and not all(fp8):
        return None
    if all(fp8):
        block = mods[0].block
        if any(m.block != block or m.out_features % block[0] for m in mods):
            return None
        return _cat_views(mods, "weight"), _cat_views(mods, "weight_scale_inv"), block
    return _cat_views(mods, "weight", row_multiple), None, None


def _cat_views(mods: list[nn.Module], name: str, row_multiple: int = 1) -> torch.Tensor:
    parts = [getattr(m, name).detach() for m in mods]
    if parts[0].dtype == FP8_DTYPE:  # concatenated as bytes: not every torch build cats float8
        fused = torch.cat([p.view(torch.uint8) for p in parts], dim=0).view(FP8_DTYPE)
    else:
        pad = -sum(p.shape[0] for p in parts) % row_multiple
        if pad:
            parts.append(parts[0].new_zeros(pad, *parts[0].shape[1:]))
        fused = torch.cat(parts, dim=0).contiguous()
    start = 0
    for m in mods:
        n = getattr(m, name).shape[0]
        setattr(m, name, nn.Parameter(fused[start:start + n], requires_grad=False))
        start += n
    return fused
