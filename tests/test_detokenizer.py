"""Incremental detokenization equals decoding everything, at the cost of the new tokens."""

from __future__ import annotations

import random

import pytest

from strata.config import EMBEDDED_MODEL_DIR
from strata.engine.detokenizer import IncrementalDetokenizer
from strata.model.tokenizer import Tokenizer

TEXT = ("def naïve_café(x):\n    return 'héllo wörld — 日本語のテキスト 🙂🚀' * x  # ünïcödé\n"
        "class Ω: pass\n")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(EMBEDDED_MODEL_DIR)


class CountingDecoder:
    """The real tokenizer, counting how many tokens it was asked to decode."""

    def __init__(self, tok):
        self.tok, self.tokens = tok, 0

    def decode(self, ids):
        self.tokens += len(ids)
        return self.tok.decode(ids)


def stream(decoder, ids, rng, most=5):
    """Feed `ids` in random chunks; check every intermediate text; return the final one."""
    det = IncrementalDetokenizer(decoder)
    grown: list[int] = []
    i = 0
    while i < len(ids):
        k = rng.randint(1, most)
        grown.extend(ids[i:i + k])
        i += k
        text = det.update(grown)
        full = decoder.tok.decode(grown) if isinstance(decoder, CountingDecoder) else decoder.decode(grown)
        assert full.startswith(text)            # never ahead of, never different from, the truth
        assert not text.endswith("\ufffd")      # a split character waits for its other bytes
        if not full.endswith("\ufffd"):
            assert text == full                 # and nothing else waits
    return det.finish(grown)


@pytest.mark.parametrize("seed", range(5))
def test_text_with_multibyte_characters(tok, seed):
    ids = tok.encode(TEXT * 3)
    assert stream(tok, ids, random.Random(seed)) == tok.decode(ids)


@pytest.mark.parametrize("seed", range(5))
def test_random_token_ids(tok, seed):
    """Arbitrary ids: byte tokens that never complete a character, special tokens, anything."""
    rng = random.Random(100 + seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(400)]
    assert stream(tok, ids, rng) == tok.decode(ids)


def test_finish_keeps_a_split_character_at_the_end(tok):
    ids = tok.encode("ok 🙂")
    cut = ids[:-1]  # the emoji's last byte token missing
    det = IncrementalDetokenizer(tok)
    assert tok.decode(cut).endswith("\ufffd")
    assert not det.update(cut).endswith("\ufffd")
    assert det.finish(cut) == tok.decode(cut)


def test_cost_grows_with_the_new_tokens_not_the_length(tok):
    """Decoding everything after each of 1,000 one-token steps would decode ~500,000 tokens."""
    ids = tok.encode(TEXT * 30)[:1000]
    counting = CountingDecoder(tok)
    assert stream(counting, ids, random.Random(7), most=1) == tok.decode(ids)
    assert counting.tokens < 10 * len(ids)


class StrippingDecoder:
    """A decoder whose text for earlier tokens depends on later ones: it drops a trailing '~'
    unless another token follows (some tokenizers' clean-up rules behave like this)."""

    def decode(self, ids):
        s = "".join(chr(97 + i % 26) if i % 7 else "~" for i in ids)
        return s[:-1] if s.endswith("~") else s


def test_a_decoder_that_is_not_prefix_stable_falls_back_to_full_decodes():
    dec = StrippingDecoder()
    rng = random.Random(3)
    ids = [rng.randrange(50) for _ in range(200)]
    det = IncrementalDetokenizer(dec)
    grown: list[int] = []
    for t in ids:
        grown.append(t)
        det.update(grown)
    assert det.finish(grown) == dec.decode(ids)
