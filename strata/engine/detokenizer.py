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

from typing import Protocol, Sequence

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


class TextStream:
    """One request's output text: stop strings, held-back UTF-8, and the characters streamed.

    The engine appends each emitted token to the request's id list, asks `stop_hit` whether the
    text now contains a stop string (the text is cut before it), and after each commit takes
    `advance`'s new characters for the stream. A streamed chunk never ends in an incomplete
    UTF-8 sequence, nor in what could still become the start of a stop string."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (), stream: bool = False):
        self._detok = IncrementalDetokenizer(tokenizer)
        self.stop = tuple(stop)
        self.stream = stream
        self._longest_stop = max((len(x) for x in self.stop), default=0)
        self.text = ""
        self.streamed = 0  # characters of `text` already streamed
        self.stopped = False

    def stop_hit(self, ids: list[int]) -> bool:
        """Whether the text of `ids` (grown by one token) completes a stop string; if so the
        text ends before it and the stream stops growing."""
        if not self.stop:
            return False
        before = len(self.text)
        text = self.text = self._detok.update(ids)
        # A stop string not found before ends in the new text: search from one stop length
        # before it.
        lo = max(0, before - (self._longest_stop - 1))
        hit = min((i for x in self.stop if (i := text.find(x, lo)) >= 0), default=-1)
        if hit < 0:
            return False
        self.text, self.stopped = text[:hit], True
        return True

    def advance(self, ids: list[int], finished: bool) -> str:
        """Bring the text up to `ids`; returns the characters newly streamed ("" when not
        streaming)."""
        if not self.stopped:
            self.text = self._detok.finish(ids) if finished else self._detok.update(ids)
        if not self.stream:
            return ""
        end = len(self.text)
        if not finished:
            while end > self.streamed and self.text[end - 1] == REPLACEMENT:
                end -= 1  # hold back an incomplete UTF-8 sequence
            if self.stop:  # and what could still become the start of a stop string
                end = max(self.streamed, end - (self._longest_stop - 1))
        new = self.text[self.streamed:end]
        self.streamed = end
        return new
