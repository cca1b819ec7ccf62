"""The embedded trained model (strata/assets/tiny-qwen3-next/, written by scripts/train_tiny.py).

Skipped until the directory holds model.safetensors and its model card README.md. Env
STRATA_TINY_MODEL_DIR points these tests at another directory (e.g. a fresh training run).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import rel_err
from strata.model.loader import load_checkpoint
from strata.model.state import DecodeState

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("STRATA_TINY_MODEL_DIR") or ROOT / "strata" / "assets" / "tiny-qwen3-next")
PROMPT = "def fibonacci(n):\n"
NEW = 40

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.skipif(
    not ((MODEL_DIR / "model.safetensors").is_file() and (MODEL_DIR / "README.md").is_file()),
    reason=f"no trained model in {MODEL_DIR} (run scripts/train_tiny.py)")]


@pytest.fixture(scope="module")
def lm():
    return load_checkpoint(MODEL_DIR, dtype="float32", log=lambda _m: None)


@pytest.fixture(scope="module")
def card() -> str:
    return (MODEL_DIR / "README.md").read_text()


@torch.no_grad()
def greedy(model, ids: list[int], new: int, eos: int) -> list[int]:
    """Plain greedy decoding through strata's cached path: prefill, then 1-row windows."""
    state = DecodeState(model.args, 1, len(ids) + new + 1, model.dtype, "cpu", with_mtp=False)
    h = model.prefill(torch.tensor(ids), 0, 0, state)
    out = [int(model.logits(h[-1]).argmax())]
    one = torch.tensor([0])
    from strata.kernels import ops
    slot_pos = torch.tensor([len(ids), 0])
    while len(out) < new and out[-1] != eos:
        p = len(ids) + len(out) - 1
        pos = torch.tensor([p])
        _, lg, rec, conv = model.verify_window(torch.tensor([[out[-1]]]), one, pos, p + 1, state)
        ops.commit_accepted(torch.zeros(1, dtype=torch.long), one, pos, rec, conv, state.rec,
                            state.conv, slot_pos)
        out.append(int(lg[0, 0].argmax()))
    return out


def test_directory_is_a_small_bf16_hf_checkpoint(lm, card):
    files = {f.name for f in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            "README.md"} <= files
    size = sum(f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file())
    assert size <= 16 * 2**20
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next" and cfg["dtype"] == "bfloat16"
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert json.loads((MODEL_DIR / "generation_config.json").read_text())["eos_token_id"] == 0
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in keys)
    assert any(k.startswith("mtp.") for k in keys) and lm.has_mtp
    assert lm.tokenizer is not None and lm.tokenizer.eos_ids == [0]
    assert lm.tokenizer._tok.token_to_id("<|endoftext|>") == 0
    assert 2048 <= lm.tokenizer.vocab_size <= 4096 or "--tiny" in card


def test_architecture_as_specified(lm, card):
    a = lm.args
    assert a.layer_types.count("linear_attention") >= 3 and a.layer_types.count("full_attention") >= 1
    assert a.num_experts >= 8 and a.num_experts_per_tok == 2 and a.shared_expert_intermediate_size > 0
    n = sum(p.numel() for p in lm.model.parameters())
    if "--tiny" not in card:
        assert 4e6 <= n <= 8.5e6, n


def test_model_card_reports_training_and_evaluation(card):
    assert "python3 scripts/train_tiny.py" in card
    for needle in ("Python", "held-out", "perplexity", "acceptance", "tokens"):
        assert needle in card, needle
    assert re.search(r"teacher-forced MTP agreement[^|]*\| (0\.\d+|1\.0+)", card)
    # The batch_mtp draft (spec 2) is accepted at least 60% of the time while decoding
    # held-out code prompts, in every evaluation the card reports.
    spec2 = [float(a) for a in re.findall(r"^\| 2 \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|", card, re.M)]
    assert spec2 and min(spec2) >= 0.60, spec2


@torch.no_grad()
def test_transformers_loads_it_and_greedy_matches(lm):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    ids = lm.tokenizer.encode(PROMPT)
    x = torch.tensor([ids])
    want = hf(input_ids=x, use_cache=False).logits
    assert rel_err(lm.model.logits(lm.model.forward_train(x)), want) <= 1e-4
    gen = hf.generate(x, max_new_tokens=NEW, do_sample=False, eos_token_id=0, pad_token_id=0)
    theirs = gen[0, len(ids):].tolist()
    ours = greedy(lm.model, ids, NEW, eos=0)
    assert ours == theirs, (lm.tokenizer.decode(ours), lm.tokenizer.decode(theirs))


@torch.no_grad()
def test_greedy_continuation_looks_like_python(lm):
    ids = lm.tokenizer.encode("import os\n\n\ndef main():\n")
    text = lm.tokenizer.decode(greedy(lm.model, ids, 48, eos=0))
    assert "\n" in text
    assert re.search(r"\b(return|if|for|self|print|os\.|import|def|raise|with|=)", text), text


@torch.no_grad()
def test_speculative_decoding_equals_greedy_and_accepts_drafts(lm):
    from strata.tools import eval_acceptance as ev
    prompts = [lm.tokenizer.encode(p) for p in ev.PROMPTS[:4]]
    plain = ev.speculative_generate(lm.model, prompts, 32, spec=1, eos=0)
    for spec in (2, 3):
        r = ev.speculative_generate(lm.model, prompts, 32, spec=spec, eos=0)
        assert r["outputs"] == plain["outputs"]
        assert r["mean_accepted_drafts"] > 0.0


def test_fused_dense_moe_weight_keeps_its_product_rows_aligned(lm):
    """The dense path's fused weight (router, shared gate, shared expert, every expert) has a
    multiple of 8 rows, so that its product's rows stay 16-byte aligned on the GPU (1289 rows
    ran cuBLAS's unaligned kernel and a split-k reduction), and the block's output is the
    unfused block's: the padding's columns are sliced off before anything reads them."""
    moe = lm.model.layers[0].mlp
    assert moe.w_in is not None and moe.w_in.shape[0] % 8 == 0
    x = torch.randn(5, lm.model.args.hidden_size, generator=torch.Generator().manual_seed(0))
    got = moe._forward_fused(x)
    weights, index = moe._route(moe.gate(x))
    want = moe.experts(x, weights, index) + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    assert rel_err(got, want) < 1e-5
