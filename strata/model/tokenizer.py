"""Tokenizer from a checkpoint's `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from strata.model.config import CheckpointError

EOS_NAMES = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>")


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_ids: list[int]):
        self._tok = tok
        self.eos_ids = eos_ids
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        f = path / "tokenizer.json"
        try:
            tok = HFTokenizer.from_file(str(f))
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise CheckpointError(f"{f}: cannot load tokenizer ({e})") from None
        eos: list[int] = []
        gen = path / "generation_config.json"
        if gen.is_file():
            try:
                val = json.loads(gen.read_text()).get("eos_token_id")
                eos = [val] if isinstance(val, int) else list(val or [])
            except (json.JSONDecodeError, AttributeError, TypeError) as e:
                raise CheckpointError(f"{gen}: cannot read 'eos_token_id' "
                                      f"({type(e).__name__}: {e})") from None
        if not eos:
            eos = [i for n in EOS_NAMES if (i := tok.token_to_id(n)) is not None]
        return cls(tok, eos)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_nogil(self, text: str) -> list[int]:
        """`encode`'s ids through the library's `encode_batch`, which releases the GIL while it
        works (`encode` holds it): for a caller that encodes on a thread beside a loop."""
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
