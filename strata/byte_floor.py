"""The byte floor of a verify window: the bytes it must read, and the time reading them takes.

A decode window of a large MoE model is bound by memory traffic, so its floor is

    floor_s = bytes read / bandwidth

where every byte the window must read is counted once, and nothing it writes is counted. The
default bandwidth, H200_COPY_BYTES_PER_S = 4.3e12 B/s, is the H200's measured device-to-device
copy rate counted as read + write bytes (docs/BENCHMARKS.md): no kernel streams its reads faster
than a copy moves bytes, so it is the realistic ceiling for the reads alone.

What a window of `groups` x `rows` rows (R = groups x rows) reading `ctx` keys must read:
  - dense weights, once each: every layer's projections, routers, shared experts and norms, the
    embedding rows of its R tokens, the final norm and the LM head (one logits matmul for all
    rows);
  - routed experts: the distinct experts the R rows route to, per MoE layer: a measured count
    when given, else the expectation under uniform routing, E * (1 - (1 - k/E)^R);
  - per group: the K/V of `ctx` positions in every full-attention layer, and the recurrent
    (float32) and conv state of every linear-attention layer;
  - drafting (MTP on): each MTP pass reads the MTP layer (fc, norms, one full-attention MoE
    decoder layer, its distinct experts for the pass's rows, its K/V) and the LM head again. A
    window runs rows - 2 chain passes of `groups` rows (solo windows extend the draft chain) and
    one pass over all R committed rows. With a draft vocabulary of K tokens
    (engine.draft_vocab) a pass reads K rows of the LM head instead of all of them.
Weights are stored as `WeightFormat` says: float (2 bytes for bf16) or HF fine-grained FP8 (one
byte per weight plus a float32 scale per block), with `not_converted` name patterns kept float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from strata.model.config import ModelArgs

#: Measured H200 device-to-device copy rate, read + write bytes per second.
H200_COPY_BYTES_PER_S = 4.3e12


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint stores its weights.

    float_bytes: bytes per element of everything not FP8 (norms, embeddings, conv, state-free
    vectors, unconverted projections), and of the K/V cache. fp8_block: (bo, bi) for HF
    fine-grained FP8 projections (1 byte per weight + 4 bytes per bo x bi block), None for float.
    not_converted: `modules_to_not_convert` patterns; a projection the pattern names (as in the
    HF checkpoint: model.layers.3.mlp.gate, or any layer's mlp.gate) stays float."""

    float_bytes: int = 2
    fp8_block: Optional[tuple[int, int]] = None
    not_converted: tuple[str, ...] = ()

    def __post_init__(self):
        if self.float_bytes not in (1, 2, 4):
            raise ValueError(f"WeightFormat.float_bytes: must be 1, 2 or 4, got {self.float_bytes}")
        if self.fp8_block is not None and (len(self.fp8_block) != 2 or min(self.fp8_block) < 1):
            raise ValueError(f"WeightFormat.fp8_block: must be (bo, bi) >= 1, got {self.fp8_block}")

    def linear(self, name: str, out: int, inp: int) -> int:
        """Bytes of a projection weight (out, inp) named `name`, with its scales."""
        if self.fp8_block is None or any(_names(p, name) for p in self.not_converted):
            return out * inp * self.float_bytes
        bo, bi = self.fp8_block
        return out * inp + math.ceil(out / bo) * math.ceil(inp / bi) * 4


def _names(pattern: str, name: str) -> bool:
    """A modules_to_not_convert pattern names a module: the module itself, a module it ends in,
    or a module that contains it (so `mlp.gate` names the router, not `mlp.gate_proj`)."""
    return (name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")
            or f".{pattern}." in name)


def expected_distinct_experts(experts: int, top_k: int, rows: int) -> float:
    """Distinct experts R rows touch when each picks top_k of `experts` uniformly."""
    if experts <= 0 or rows <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def _attention_layer(args: ModelArgs, fmt: WeightFormat, prefix: str) -> int:
    hq, hkv, d, h = args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.hidden_size
    return (fmt.linear(f"{prefix}.self_attn.q_proj", 2 * hq * d, h)
            + fmt.linear(f"{prefix}.self_attn.k_proj", hkv * d, h)
            + fmt.linear(f"{prefix}.self_attn.v_proj", hkv * d, h)
            + fmt.linear(f"{prefix}.self_attn.o_proj", h, hq * d)
            + 2 * d * fmt.float_bytes)  # q_norm, k_norm


def _linear_attention_layer(args: ModelArgs, fmt: WeightFormat, prefix: str) -> int:
    h, nv = args.hidden_size, args.linear_num_value_heads
    key_dim = args.linear_num_key_heads * args.linear_key_head_dim
    value_dim = nv * args.linear_value_head_dim
    return (fmt.linear(f"{prefix}.linear_attn.in_proj_qkvz", 2 * key_dim + 2 * value_dim, h)
            + fmt.linear(f"{prefix}.linear_attn.in_proj_ba", 2 * nv, h)
            + fmt.linear(f"{prefix}.linear_attn.out_proj", h, value_dim)
            + (args.conv_dim * args.linear_conv_kernel_dim  # conv1d
               + 2 * nv + args.linear_value_head_dim) * fmt.float_bytes)  # dt_bias, A_log, norm


def _ffn_dense(args: ModelArgs, fmt: WeightFormat, prefix: str, moe: bool) -> int:
    """The FFN's always-read weights: router, shared expert and its gate; or the dense MLP."""
    h = args.hidden_size
    if not moe:
        i = args.intermediate_size
        return (fmt.linear(f"{prefix}.mlp.gate_proj", i, h) + fmt.linear(f"{prefix}.mlp.up_proj", i, h)
                + fmt.linear(f"{prefix}.mlp.down_proj", h, i))
    s = args.shared_expert_intermediate_size
    return (fmt.linear(f"{prefix}.mlp.gate", args.num_experts, h)
            + fmt.linear(f"{prefix}.mlp.shared_expert_gate", 1, h)
            + fmt.linear(f"{prefix}.mlp.shared_expert.gate_proj", s, h)
            + fmt.linear(f"{prefix}.mlp.shared_expert.up_proj", s, h)
            + fmt.linear(f"{prefix}.mlp.shared_expert.down_proj", h, s))


def expert_bytes(args: ModelArgs, fmt: WeightFormat, prefix: str = "model.layers.0") -> int:
    """One routed expert's gate, up and down projections."""
    h, i = args.hidden_size, args.moe_intermediate_size
    e = f"{prefix}.mlp.experts.0"
    return (fmt.linear(f"{e}.gate_proj", i, h) + fmt.linear(f"{e}.up_proj", i, h)
            + fmt.linear(f"{e}.down_proj", h, i))


def window_bytes(args: ModelArgs, groups: int, rows: int, ctx: int, fmt: WeightFormat = WeightFormat(),
                 drafting: bool = False,
                 distinct_experts: Optional[float | Sequence[float]] = None,
                 draft_vocab: int = 0, draft_fp8: bool = False) -> dict[str, float]:
    """Bytes a verify window of `groups` x `rows` rows must read (module docstring), by part:
    dense, experts, head, kv, state, mtp, and total. `distinct_experts`: measured distinct
    routed experts per MoE layer of the main model (one number for every layer, or one per MoE
    layer in order); None assumes uniform routing. `ctx`: keys each group's attention reads.
    `draft_vocab`: the drafts' tokens (engine.draft_vocab; 0 = the whole vocabulary);
    `draft_fp8`: drafts read an FP8 copy of those head rows (engine.draft_head=fp8: a byte a
    weight and a float32 scale per 128 x 128 block)."""
    if groups < 1 or rows < 1 or ctx < 0:
        raise ValueError(f"window_bytes: groups and rows must be >= 1 and ctx >= 0, got "
                         f"groups={groups} rows={rows} ctx={ctx}")
    if not 0 <= draft_vocab <= args.vocab_size:
        raise ValueError(f"window_bytes: draft_vocab must be in [0, {args.vocab_size}], got "
                         f"{draft_vocab}")
    h, el = args.hidden_size, fmt.float_bytes
    r = groups * rows
    moe_layers = [i for i in range(args.num_hidden_layers) if args.is_moe_layer(i)]
    if distinct_experts is None:
        per_layer = [expected_distinct_experts(args.num_experts, args.num_experts_per_tok, r)] * len(moe_layers)
    elif isinstance(distinct_experts, (int, float)):
        per_layer = [float(distinct_experts)] * len(moe_layers)
    else:
        per_layer = [float(x) for x in distinct_experts]
        if len(per_layer) != len(moe_layers):
            raise ValueError(f"window_bytes: distinct_experts has {len(per_layer)} entries for "
                             f"{len(moe_layers)} MoE layers")
    dense = r * h * el + h * el  # embedding rows, final norm
    for i, kind in enumerate(args.layer_types):
        p = f"model.layers.{i}"
        dense += 2 * h * el  # input and post-attention norms
        dense += (_linear_attention_layer(args, fmt, p) if kind == "linear_attention"
                  else _attention_layer(args, fmt, p))
        dense += _ffn_dense(args, fmt, p, args.is_moe_layer(i))
    experts = sum(n * expert_bytes(args, fmt, f"model.layers.{i}") for i, n in zip(moe_layers, per_layer))
    head = fmt.linear("lm_head", args.vocab_size, h)
    kv_row = 2 * args.num_key_value_heads * args.head_dim * el
    kv = groups * ctx * len(args.full_layers) * kv_row
    state = groups * len(args.linear_layers) * (
        args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
        + args.conv_dim * (args.linear_conv_kernel_dim - 1) * el)
    mtp = 0.0
    if drafting:
        moe = args.num_experts > 0
        layer = (_attention_layer(args, fmt, "mtp.layers.0") + _ffn_dense(args, fmt, "mtp.layers.0", moe)
                 + fmt.linear("mtp.fc", h, 2 * h) + 5 * h * el)  # 2 pre-fc, 2 layer, final norms
        one_expert = expert_bytes(args, fmt, "mtp.layers.0") if moe else 0
        # the draft head: the LM head, or a copy of its rows for the draft vocabulary, in the
        # model's float format or in FP8 (engine.draft_head=fp8)
        head_rows = draft_vocab or args.vocab_size
        if draft_fp8:
            from strata.engine.draft_vocab import FP8_HEAD_BLOCK
            draft_head = WeightFormat(fp8_block=FP8_HEAD_BLOCK).linear("draft_head", head_rows, h)
        else:
            draft_head = head if not draft_vocab else draft_vocab * h * el
        passes = [groups] * max(rows - 2, 0) + [r]
        for n in passes:
            used = expected_distinct_experts(args.num_experts, args.num_experts_per_tok, n) if moe else 0.0
            mtp += layer + used * one_expert + draft_head + n * h * el + groups * ctx * kv_row
    parts = {"dense": float(dense), "experts": float(experts), "head": float(head), "kv": float(kv),
             "state": float(state), "mtp": float(mtp)}
    parts["total"] = sum(parts.values())
    parts["distinct_experts"] = float(sum(per_layer) / len(per_layer)) if per_layer else 0.0
    return parts


def floor_seconds(total_bytes: float, bandwidth: float = H200_COPY_BYTES_PER_S) -> float:
    """Seconds to read `total_bytes` once at `bandwidth` bytes per second."""
    if bandwidth <= 0:
        raise ValueError(f"floor_seconds: bandwidth must be > 0, got {bandwidth}")
    return total_bytes / bandwidth


def weight_format_from_config(config: dict, dtype_bytes: int) -> WeightFormat:
    """The WeightFormat of an HF config.json dict: FP8 blocks from its quantization_config
    (quant_method fp8), else float weights of `dtype_bytes` bytes."""
    q = config.get("quantization_config") or {}
    if not q:
        return WeightFormat(float_bytes=dtype_bytes)
    if q.get("quant_method") != "fp8":
        raise ValueError(f"config.json quantization_config.quant_method: only fp8 is modelled, "
                         f"got {q.get('quant_method')!r}")
    block = q.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise ValueError(f"config.json quantization_config.weight_block_size: must be [bo, bi], "
                         f"got {block!r}")
    return WeightFormat(float_bytes=dtype_bytes, fp8_block=(int(block[0]), int(block[1])),
                        not_converted=tuple(q.get("modules_to_not_convert") or ()))
