"""Incremental detokenization: the text of a growing token list at the cost of its new tokens.

Decoding a request's whole output after every window costs O(length) per window (about 80 us
per 1,000 tokens with the tiny model's tokenizer), so O(length^2) over the request, and it runs
on the host while the GPU waits: at 2,000 tokens and 8 streaming requests that is more host time
per window than the window itself. Here each update decodes only the tokens since the previous
update, twice: `decode(ids[prefix:read])` and `decode(ids[prefix:])`; the new text is what the
second adds to the first. Both start at the same token, so a decoder that treats the first token
of a sequence specially (a stripped leading space) treats both alike.

The text never ends in an incomplete UTF-8 sequence: while the newest tokens decode to a
trailing U+FFFD (a multi-byte character split across tokens), they wait for the next update.
`finish()` takes them as they are, so the final text equals `decode(ids)`.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder):
        self._tok = tokenizer
        self.text = ""
        self._prefix = 0  # first token of the last decoded segment
        self._read = 0    # tokens whose text is in `self.text`

    def update(self, ids: list[int]) -> str:
        """Bring `text` up to `ids` (the same list, grown since the last call); returns it."""
        return self._advance(ids, final=False)

    def finish(self, ids: list[int]) -> str:
        """The final text: as `update`, but tokens ending in a split character count too."""
        return self._advance(ids, final=True)

    def _advance(self, ids: list[int], final: bool) -> str:
        if len(ids) <= self._read:
            return self.text
        prefix_text = self._tok.decode(ids[self._prefix:self._read])
        full = self._tok.decode(ids[self._prefix:])
        if not full.startswith(prefix_text):
            # A decoder whose text for earlier tokens depends on later ones: decode it all.
            self.text = self._tok.decode(ids)
            self._prefix = self._read = len(ids)
        elif final or not full.endswith(REPLACEMENT):
            self.text += full[len(prefix_text):]
            self._prefix, self._read = self._read, len(ids)
        return self.text
