"""strata.byte_floor against hand-computed small cases."""

from __future__ import annotations

import pytest

from strata.byte_floor import (H200_COPY_BYTES_PER_S, WeightFormat, expected_distinct_experts,
                               floor_seconds, weight_format_from_config, window_bytes)
from strata.model.config import ModelArgs


def small_args(**kw) -> ModelArgs:
    """Layer 0: linear attention + MoE (4 experts, top-2); layer 1: full attention + dense MLP."""
    base = dict(vocab_size=10, hidden_size=4, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                num_key_value_heads=1, head_dim=2, intermediate_size=6, linear_num_key_heads=1,
                linear_num_value_heads=2, linear_key_head_dim=2, linear_value_head_dim=2,
                linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=3, shared_expert_intermediate_size=5, mlp_only_layers=[1])
    base.update(kw)
    return ModelArgs(**base)


def test_bf16_window_by_hand():
    b = window_bytes(small_args(), groups=2, rows=1, ctx=5)
    # embedding rows 2x4 + final norm 4; layer 0: norms 8, qkvz 12x4, ba 4x4, out 4x4, conv 8x3,
    # dt_bias + A_log 4, gated norm 2, router 4x4, shared gate 1x4, shared 3 x 5x4; layer 1:
    # norms 8, q 8x4, k 2x4, v 2x4, o 4x4, q/k norms 4, MLP 3 x 6x4: 358 elements of 2 bytes.
    assert b["dense"] == 2 * (12 + 8 + 48 + 16 + 16 + 24 + 4 + 2 + 16 + 4 + 60 + 8 + 32 + 8 + 8 + 16 + 4 + 72)
    assert b["distinct_experts"] == 3.0  # 4 * (1 - (1 - 2/4)^2)
    assert b["experts"] == 3 * (3 * 3 * 4 * 2)
    assert b["head"] == 10 * 4 * 2
    assert b["kv"] == 2 * 5 * 1 * (2 * 1 * 2 * 2)  # groups x ctx x full layers x (K, V) x Hkv x D x 2 B
    assert b["state"] == 2 * 1 * (2 * 2 * 2 * 4 + 8 * 2 * 2)  # rec float32 + conv (K - 1 columns)
    assert b["mtp"] == 0.0
    assert b["total"] == 716 + 216 + 80 + 80 + 128


def test_drafting_adds_the_mtp_passes():
    b = window_bytes(small_args(), groups=1, rows=3, ctx=5, drafting=True)
    layer = 136 + 160 + 64 + 40  # attention, router + shared expert, fc 4x8, five norms
    chain = layer + 2.0 * 72 + 80 + 1 * 8 + 5 * 8   # one row: 2 distinct experts
    final = layer + 3.5 * 72 + 80 + 3 * 8 + 5 * 8   # three rows: 3.5
    assert b["mtp"] == chain + final


def test_measured_experts_and_fp8():
    assert window_bytes(small_args(), 1, 4, 0, distinct_experts=1)["experts"] == 72
    with pytest.raises(ValueError, match="distinct_experts"):
        window_bytes(small_args(), 1, 4, 0, distinct_experts=[1, 2])
    fmt = WeightFormat(fp8_block=(2, 3), not_converted=("lm_head", "mlp.gate"))
    # (3, 4): 12 bytes + ceil(3/2) x ceil(4/3) = 4 float32 scales
    assert fmt.linear("model.layers.0.mlp.experts.0.gate_proj", 3, 4) == 12 + 4 * 4
    assert fmt.linear("model.layers.0.mlp.gate", 4, 4) == 32
    assert fmt.linear("model.layers.0.mlp.gate_proj", 4, 4) == 16 + 4 * 4
    assert fmt.linear("lm_head", 10, 4) == 80
    b = window_bytes(small_args(), 1, 1, 0, fmt=fmt)
    assert b["experts"] == 2 * (28 + 28 + (12 + 2 * 1 * 4))  # gate, up (3, 4); down (4, 3)


def test_expectation_floor_and_config():
    assert expected_distinct_experts(512, 10, 1) == pytest.approx(10)
    assert expected_distinct_experts(512, 10, 1000) == pytest.approx(512, rel=1e-6)
    assert floor_seconds(4.3e9) == pytest.approx(1e-3)
    assert H200_COPY_BYTES_PER_S == 4.3e12
    fmt = weight_format_from_config({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 32],
        "modules_to_not_convert": ["lm_head"]}}, 2)
    assert fmt == WeightFormat(2, (64, 32), ("lm_head",))
    assert weight_format_from_config({}, 4) == WeightFormat(4)
    with pytest.raises(ValueError, match="quant_method"):
        weight_format_from_config({"quantization_config": {"quant_method": "gptq"}}, 2)
    with pytest.raises(ValueError, match="weight_block_size"):
        weight_format_from_config({"quantization_config": {"quant_method": "fp8"}}, 2)
    with pytest.raises(ValueError, match="groups"):
        window_bytes(small_args(), 0, 1, 0)
