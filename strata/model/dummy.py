"""Seeded random weights for `model.load_format=dummy` (benchmarks without a checkpoint).

Every parameter is drawn on the model's device (on the GPU for a GPU model: an 80B model is
never built on the host, though its routed experts may be held there for the expert cache) from
its own generator, seeded from `seed` and the parameter's name, so the
weights do not depend on the order parameters are visited in. Scales keep activations sane
through any depth: the zero-centred RMSNorm weights are 0 (Qwen3-Next's identity, x_hat * (1 + w)),
the DeltaNet gated norm's are 1, projections are N(0, 0.02), the router is wider so that rows
route to distinct experts, and the DeltaNet decay parameters follow the tiny test models.
FP8 weights get random e4m3 values spread over most of the format's range and per-block scales
near std * 4 / 448, so that the dequantised weights have about the same spread.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from strata.model.fp8 import FP8_DTYPE, FP8_MAX

WEIGHT_STD = 0.02
ROUTER_STD = 0.05  # router logits of std ~2 on normalised inputs: distinct top-k per row
CONV_STD = 0.3  # the depthwise conv mixes only K taps
#: Elements drawn at once when filling an FP8 weight (bounds the float32 scratch tensor).
FP8_CHUNK = 1 << 26


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run's seed and the parameter name (stable across runs and hosts)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def scale_name(weight_name: str) -> str:
    """Name of the block-scale parameter of an FP8 weight parameter."""
    if weight_name.endswith(".w_gate_up"):
        return weight_name[: -len("w_gate_up")] + "gu_scale"
    if weight_name.endswith(".w_down"):
        return weight_name[: -len("w_down")] + "down_scale"
    return weight_name + "_scale_inv"


def _std(name: str) -> float:
    if name.endswith(".mlp.gate.weight"):
        return ROUTER_STD
    if name.endswith("conv1d.weight"):
        return CONV_STD
    return WEIGHT_STD


@torch.no_grad()
def _fill_float(name: str, p: torch.Tensor, g: torch.Generator) -> None:
    leaf_module = name.rsplit(".", 2)[-2] if name.count(".") else ""
    if name.endswith("A_log"):
        p.copy_(torch.empty(p.shape, device=p.device).uniform_(1.0, 16.0, generator=g).log_())
    elif name.endswith("dt_bias"):
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, device=p.device, generator=g))
    elif "norm" in leaf_module:
        p.fill_(1.0 if ".linear_attn.norm." in name else 0.0)
    else:
        p.normal_(0.0, _std(name), generator=g)


@torch.no_grad()
def _fill_fp8(name: str, w: torch.Tensor, scale: torch.Tensor, g: torch.Generator) -> None:
    rows = w.view(-1, w.shape[-1])
    step = max(1, FP8_CHUNK // rows.shape[1])
    for s in range(0, rows.shape[0], step):
        part = rows[s:s + step]
        vals = torch.empty(part.shape, device=w.device).normal_(0.0, FP8_MAX / 4, generator=g)
        part.copy_(vals.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
    scale.uniform_(0.75, 1.25, generator=g).mul_(_std(name) * 4 / FP8_MAX)


def _on(p: torch.Tensor, device: torch.device) -> bool:
    """Whether p is on `device` ("cuda" meaning the current CUDA device, as cuda:0 may be)."""
    return p.device.type == device.type and device.index in (None, p.device.index)


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int, device: torch.device | None = None,
               progress=None) -> nn.Module:
    """Fill every parameter of `model` (already on its device) with seeded random values.
    `device`: the model's device, where every value is drawn; a parameter held elsewhere (routed
    experts the loader left in host memory for the expert cache) is drawn there in a scratch
    copy and copied over, so that its values do not depend on where it is held. `progress`: a
    placement.LoadProgress told each parameter's bytes."""
    params = dict(model.named_parameters())  # tied parameters once
    scales = {scale_name(n) for n, p in params.items() if p.dtype == FP8_DTYPE}
    for name, p in params.items():
        if name in scales:
            continue  # filled with its weight
        at = p.device if device is None or _on(p, torch.device(device)) else torch.device(device)
        g = torch.Generator(device=at).manual_seed(param_seed(seed, name))
        w = p if at == p.device else torch.empty_like(p, device=at)
        if p.dtype == FP8_DTYPE:
            _fill_fp8(name, w, params[scale_name(name)], g)
        else:
            _fill_float(name, w, g)
        if w is not p:
            p.copy_(w)
        if progress is not None:
            progress.add(p.numel() * p.element_size())
    return model


@torch.no_grad()
def apply_routing_skew(model: nn.Module, skew: float, seed: int) -> int:
    """model.dummy_routing_skew (SYNTHETIC): give every MoE router a skewed expert popularity.
    Each layer ranks its experts by a seeded permutation and adds -skew * ln(1 + rank) to the
    router logit of the expert of that rank, so each expert's softmax weight is scaled by
    (1 + rank)^-skew: a Zipf-like fall-off of exponent `skew` (trained routers are skewed;
    docs/EXPERT_CACHE.md). Which experts are popular differs per layer. Returns the layers
    changed."""
    from strata.model.qwen3_next import SparseMoe

    n = 0
    for name, m in model.named_modules():
        if not isinstance(m, SparseMoe):
            continue
        n_exp = m.gate.weight.shape[0]
        g = torch.Generator().manual_seed(param_seed(seed, f"{name}.routing_skew"))
        rank = torch.empty(n_exp, dtype=torch.long)
        rank[torch.randperm(n_exp, generator=g)] = torch.arange(n_exp)
        bias = -float(skew) * torch.log1p(rank.double())
        m.routing_bias = bias.float().to(m.gate.weight.device)
        n += 1
    return n
