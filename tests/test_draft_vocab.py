"""engine.draft_vocab: drafts choose among K tokens, read from a copy of the LM head's rows;
engine.draft_head=fp8: drafts read an FP8 copy of the head (or of those rows).

The text is the one without it (greedy and seeded sampling, solo and batch_mtp, compiled
samplers too), every draft lies in the vocabulary, an unfiltered draft is the full vocabulary's
token whenever that token is among the K, the end-of-text ids are always in it, the byte floor
counts K head rows per draft pass, and every bad setting or file is a ConfigError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo
from conftest import cpu_engine_config

from strata.byte_floor import WeightFormat, window_bytes
from strata.config import ConfigError, EngineConfig, validate_engine
from strata.engine import verifier
from strata.engine.draft_vocab import draft_tokens, draft_vocab_ids, read_ranking
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.engine.sampling import sample, sample_plain
from strata.model.fp8 import FP8_DTYPE, Fp8Linear
from strata.model.tiny import make_tiny_random

torch.set_num_threads(1)
VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("draft_vocab"), seed=3, tokenizer=False,
                            vocab_size=VOCAB)


# ---- which tokens ---------------------------------------------------------------------------
def test_the_lowest_ids_and_every_end_of_text_id_ascending():
    assert draft_tokens(6, 100, eos=[99, 50]) == [0, 1, 2, 3, 50, 99]
    assert draft_tokens(3, 100, eos=[]) == [0, 1, 2]


def test_a_ranking_in_its_order_without_repeats():
    assert draft_tokens(4, 100, eos=[7], ranking=[40, 7, 40, 3, 90, 1]) == [3, 7, 40, 90]


@pytest.mark.parametrize("size, eos, ranking, needle", [
    (0, [], None, "not in \\[1, 100\\]"), (101, [], None, "not in \\[1, 100\\]"),
    (1, [5, 6], None, "end-of-text"), (5, [], [1, 2, 2], "holds only 2"),
])
def test_sizes_that_cannot_be_met_are_errors(size, eos, ranking, needle):
    with pytest.raises(ConfigError, match=f"engine.draft_vocab: .*{needle}"):
        draft_tokens(size, 100, eos, ranking)


def test_a_size_of_the_whole_vocabulary_is_no_draft_vocabulary():
    assert draft_vocab_ids(EngineConfig(draft_vocab=100), 100, [1]) is None
    assert draft_vocab_ids(EngineConfig(), 100, [1]) is None
    ids = draft_vocab_ids(EngineConfig(draft_vocab=10), 100, [99])
    assert ids.dtype == torch.long and ids.tolist() == list(range(9)) + [99]


def test_ranking_files(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([5, 4, 3]))
    assert read_ranking(listed, 10) == [5, 4, 3]
    obj = tmp_path / "obj.json"  # scripts/draft_vocab.py's output
    obj.write_text(json.dumps({"tokens": [2, 1], "tokenizer": "x"}))
    assert read_ranking(obj, 10) == [2, 1]


@pytest.mark.parametrize("text, needle", [
    (None, "no such file"), ("[1, 2", "not a JSON list"), ('{"counts": [1]}', "JSON list of token ids"),
    ("[1, 2.5]", "JSON list of token ids"), ("[1, true]", "JSON list of token ids"),
    ("[1, 10]", "token id 10 is outside"), ("[-1]", "token id -1 is outside"),
])
def test_bad_ranking_files_name_the_file(tmp_path, text, needle):
    path = tmp_path / "ranking.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match="engine.draft_vocab_file: .*ranking.json") as e:
        read_ranking(path, 10)
    assert needle in str(e.value)


@pytest.mark.parametrize("knobs, key", [
    (dict(draft_vocab=-1), "draft_vocab"),
    (dict(draft_vocab_file="r.json"), "draft_vocab_file"),
    (dict(draft_vocab=64, stages=2), "draft_vocab"),
    (dict(draft_head="bf8"), "draft_head"),
    (dict(draft_head="fp8", stages=2), "draft_head"),
])
def test_bad_settings_name_the_key(knobs, key):
    with pytest.raises(ConfigError, match=f"engine.{key}:"):
        validate_engine(EngineConfig(**knobs))


# ---- the samplers over a subset of the vocabulary -------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_a_subset_draws_the_full_vocabularys_token_whenever_it_is_in_the_subset(temperature):
    g = torch.Generator().manual_seed(0)
    rows, vocab = 400, 300
    logits = torch.randn(rows, vocab, generator=g) * 3
    temp = torch.full((rows,), temperature)
    seed = torch.randint(0, 2 ** 40, (rows,), generator=g)
    pos = torch.randint(0, 10_000, (rows,), generator=g)
    ids = torch.randperm(vocab, generator=g)[:150].sort().values
    top_k, top_p = torch.zeros(rows, dtype=torch.long), torch.ones(rows)
    for draw in (lambda lg, tok=None: sample_plain(lg, temp, seed, pos, tok),
                 lambda lg, tok=None: sample(lg, temp, top_k, top_p, seed, pos, tok)):
        full = draw(logits)
        sub = draw(logits[:, ids], ids)
        inside = torch.isin(full, ids)
        assert torch.isin(sub, ids).all()
        assert torch.equal(sub[inside], full[inside])
        assert 0 < int(inside.sum()) < rows
        # the whole vocabulary passed as ids is the same as none
        assert torch.equal(draw(logits, torch.arange(vocab)), full)


# ---- the draft head --------------------------------------------------------------------------
def test_the_draft_head_of_an_fp8_lm_head_is_its_dequantised_rows(model_dir):
    from strata.kernels.reference import dequant_fp8_block
    from strata.model.loader import load_checkpoint

    model = load_checkpoint(model_dir, log=lambda s: None).model
    hidden = model.args.hidden_size
    head = Fp8Linear(hidden, VOCAB, (32, 32))
    g = torch.Generator().manual_seed(1)
    head.weight.data = (torch.randn(VOCAB, hidden, generator=g) * 20).to(FP8_DTYPE)
    head.weight_scale_inv.data = torch.rand(*head.weight_scale_inv.shape, generator=g) + 0.1
    model.lm_head = head
    ids = torch.tensor([0, 5, 33, VOCAB - 1])
    rows = model.lm_head_rows(ids)
    full = dequant_fp8_block(head.weight, head.weight_scale_inv, (32, 32), model.dtype)
    assert rows.dtype == model.dtype and torch.equal(rows, full[ids])


def test_the_fp8_draft_head_is_the_heads_blocks_scaled_by_their_amax(monkeypatch):
    """draft_vocab.fp8_head: 128 x 128 blocks each scaled by amax / 448 (an FP8 checkpoint's
    own format), quantised a slice of rows at a time with the same bits as all at once; its
    logits are the float head's within FP8's rounding."""
    from strata.engine import draft_vocab
    from strata.kernels.reference import dequant_fp8_block
    from strata.model.quantize import quantize_block

    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 256, generator=g).to(torch.bfloat16)
    head = draft_vocab.fp8_head(w)
    q, scale = quantize_block(w, (128, 128))
    assert head.block == (128, 128) and head.weight.dtype == FP8_DTYPE
    assert torch.equal(head.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(head.weight_scale_inv, scale)
    monkeypatch.setattr(draft_vocab, "QUANTIZE_ROWS", 128)  # three slices, the last partial
    sliced = draft_vocab.fp8_head(w)
    assert torch.equal(sliced.weight.view(torch.uint8), head.weight.view(torch.uint8))
    assert torch.equal(sliced.weight_scale_inv, head.weight_scale_inv)
    back = dequant_fp8_block(head.weight, head.weight_scale_inv, head.block, torch.float32)
    assert ((back - w.float()).abs() <= w.float().abs().amax() / 16).all()  # e4m3: 3 bits
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16)
    assert torch.allclose(head(x).float(), x.float() @ back.T, rtol=2e-2, atol=2e-2)
    assert draft_vocab.head_mib(head) == pytest.approx((300 * 256 + 3 * 2 * 4) / 2**20)
    assert draft_vocab.head_mib(None) == 0.0


def test_an_fp8_lm_head_serves_the_drafts_as_it_is(model_dir):
    from strata.engine.draft_vocab import draft_head
    from strata.model.loader import load_checkpoint

    model = load_checkpoint(model_dir, log=lambda s: None).model
    ecfg = EngineConfig(draft_head="fp8")
    ids, head = draft_head(model, ecfg, [0])
    assert ids is None and isinstance(head, Fp8Linear) and head.out_features == VOCAB
    model.lm_head = head  # an FP8 head already: drafts read it, no copy
    assert draft_head(model, ecfg, [0]) == (None, None)
    ids, head = draft_head(model, EngineConfig(draft_head="fp8", draft_vocab=64), [0])
    assert ids.numel() == 64 and isinstance(head, Fp8Linear) and head.out_features == 64


# ---- the engine ------------------------------------------------------------------------------
def run(model_dir, mode, batch_mtp, temperature, draft_vocab, logs=None, top_k=0, top_p=1.0,
        **knobs):
    cfg = cpu_engine_config(model_dir, mode=mode, batch_mtp=batch_mtp, slots=3,
                            draft_vocab=draft_vocab, **knobs)
    eng = Engine.from_config(cfg, log=(logs.append if logs is not None else lambda s: None))
    g = torch.Generator().manual_seed(2)
    for i in range(3):
        ids = torch.randint(1, VOCAB, (5 + 3 * i,), generator=g).tolist()
        eng.add_request(Request(f"r{i}", ids, SamplingParams(
            max_tokens=12 + 3 * i, temperature=temperature, seed=i, stop_at_eos=False,
            top_k=top_k, top_p=top_p),
            arrival_step=i, stream_text=False))
    drafts = set()
    while eng.has_work():
        eng.step()
        drafts.update(eng.bufs.draft[:-1].tolist())
    out = {k: v.emitted for k, v in eng.requests.items()}
    stats = (eng.drafted, eng.accepted, eng.verifier.draft_ids)
    eng.close()
    return out, drafts, stats


@pytest.mark.parametrize("mode, batch_mtp", [("solo", False), ("batch", True)])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (0.9, 0, 1.0),
                                                       (0.9, 20, 0.8)])
def test_the_text_is_the_whole_vocabularys_and_every_draft_is_in_the_subset(
        model_dir, mode, batch_mtp, temperature, top_k, top_p):
    sampling = dict(top_k=top_k, top_p=top_p)
    ref, _, (drafted, _, none) = run(model_dir, mode, batch_mtp, temperature, 0, **sampling)
    assert none is None and drafted > 0
    logs: list[str] = []
    out, drafts, (_, _, ids) = run(model_dir, mode, batch_mtp, temperature, 48, logs, **sampling)
    assert out == ref
    assert ids is not None and ids.numel() == 48
    assert drafts <= set(ids.tolist()) | {0}  # lanes never used hold 0, itself in the subset
    assert any("engine.draft_vocab=48: drafts choose among 48 of 512 tokens" in s for s in logs)


@pytest.mark.parametrize("mode, batch_mtp", [("solo", False), ("batch", True)])
@pytest.mark.parametrize("temperature, draft_vocab", [(0.0, 0), (0.9, 0), (0.0, 48)])
def test_an_fp8_draft_head_keeps_the_text(model_dir, mode, batch_mtp, temperature, draft_vocab):
    """engine.draft_head=fp8: drafts from an FP8 copy of the head (of the draft vocabulary's
    rows with one), the same text greedy and seeded, every draft a token of the vocabulary."""
    ref, _, (drafted, _, _) = run(model_dir, mode, batch_mtp, temperature, draft_vocab)
    logs: list[str] = []
    out, drafts, (fp8_drafted, _, ids) = run(model_dir, mode, batch_mtp, temperature, draft_vocab,
                                             logs, draft_head="fp8")
    assert out == ref and drafted > 0 and fp8_drafted > 0
    allowed = set(range(VOCAB)) if ids is None else set(ids.tolist()) | {0}
    assert drafts <= allowed
    needle = ("in FP8 (engine.draft_head=fp8)" if draft_vocab
              else "engine.draft_head=fp8: drafts read an FP8 copy of the LM head")
    assert any(needle in s for s in logs), logs


@pytest.mark.slow
@torch._dynamo.config.patch(suppress_errors=False)  # a compile failure must fail the test
def test_compiled_samplers_with_a_draft_vocabulary_keep_the_text(model_dir, monkeypatch):
    ref = run(model_dir, "batch", True, 0.9, 0)[0]
    torch._dynamo.reset()
    for name in ("sample", "sample_plain"):
        monkeypatch.setitem(verifier.PURE_FUNCTIONS, name,
                            torch.compile(verifier.PURE_FUNCTIONS[name], backend="aot_eager",
                                          dynamic=True))
    assert run(model_dir, "batch", True, 0.9, 48)[0] == ref


def test_the_engine_refuses_a_vocabulary_larger_than_the_models(model_dir):
    with pytest.raises(ConfigError, match="engine.draft_vocab: 513 is not in \\[1, 512\\]"):
        Engine.from_config(cpu_engine_config(model_dir, draft_vocab=513), log=lambda s: None)


def test_the_trace_records_the_setting(model_dir):
    eng = Engine.from_config(cpu_engine_config(model_dir, draft_vocab=32), log=lambda s: None)
    config = next(ev for ev in eng.trace.events if ev["ev"] == "config")
    eng.close()
    assert config["engine"]["draft_vocab"] == 32 and config["engine"]["draft_vocab_file"] is None


# ---- the byte floor --------------------------------------------------------------------------
def test_the_byte_floor_counts_the_draft_heads_rows():
    from strata.model.config import load_model_args
    from strata.model.loader import resolve_model_path

    args = load_model_args(resolve_model_path("qwen3-next-80b-a3b"))
    fmt = WeightFormat(float_bytes=2)
    full = window_bytes(args, 1, 4, 256, fmt, drafting=True)
    cut = window_bytes(args, 1, 4, 256, fmt, drafting=True, draft_vocab=32768)
    passes = 2 + 1  # rows - 2 chain passes and the pass over the committed rows
    assert full["mtp"] - cut["mtp"] == passes * (args.vocab_size - 32768) * args.hidden_size * 2
    assert full["head"] == cut["head"]  # the verify head reads every token
    assert window_bytes(args, 1, 4, 256, fmt, drafting=True, draft_vocab=0) == full
    with pytest.raises(ValueError, match="draft_vocab"):
        window_bytes(args, 1, 4, 256, fmt, drafting=True, draft_vocab=args.vocab_size + 1)
    # engine.draft_head=fp8: a byte a weight and a float32 scale a 128 x 128 block
    fp8 = window_bytes(args, 1, 4, 256, fmt, drafting=True, draft_fp8=True)
    fp8_cut = window_bytes(args, 1, 4, 256, fmt, drafting=True, draft_vocab=32768, draft_fp8=True)
    h = args.hidden_size
    for rows, part in ((args.vocab_size, fp8), (32768, fp8_cut)):
        head_bytes = rows * h + -(-rows // 128) * -(-h // 128) * 4
        assert full["mtp"] - part["mtp"] == passes * (args.vocab_size * h * 2 - head_bytes)


# ---- scripts/draft_vocab.py ------------------------------------------------------------------
def test_the_ranking_script_orders_every_token_by_its_count(tmp_path):
    import importlib.util

    from strata.config import EMBEDDED_MODEL_DIR
    from strata.model.tokenizer import Tokenizer

    path = Path(__file__).resolve().parent.parent / "scripts" / "draft_vocab.py"
    spec = importlib.util.spec_from_file_location("draft_vocab_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = "def f(x):\n    return x + 1\n" * 5 + "import os\n"
    (tmp_path / "a.py").write_text(text)
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe\x00")  # not text: skipped
    out = script.main(["--corpus", str(tmp_path), "--out", str(tmp_path / "r.json")])
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    counts = {}
    for t in tok.encode(text):
        counts[t] = counts.get(t, 0) + 1
    vocab = len(out["tokens"])
    assert sorted(out["tokens"]) == list(range(vocab))
    assert out["tokens"][:len(counts)] == sorted(counts, key=lambda t: (-counts[t], t))
    assert out["counts"] == sorted(counts.values(), reverse=True)
    assert read_ranking(tmp_path / "r.json", vocab) == out["tokens"]


def test_the_memory_plan_counts_the_draft_head_with_the_weights(model_dir):
    from strata.engine.memory import plan_engine_memory
    from strata.model.loader import load_checkpoint

    loaded = load_checkpoint(model_dir, log=lambda s: None)
    ecfg = EngineConfig()
    plain = plan_engine_memory(loaded, ecfg, torch.device("cpu"), 256, None)
    with_head = plan_engine_memory(loaded, ecfg, torch.device("cpu"), 256, None,
                                   extra_weights_mib=64.0)
    assert with_head.budget.weights_mib == pytest.approx(plain.budget.weights_mib + 64.0)
