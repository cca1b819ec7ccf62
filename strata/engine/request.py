"""Requests, their sampling parameters, and what the engine reports back for them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional


def _finite(v: int | float) -> bool:
    """math.isfinite, False for an int too large for a float (JSON may hold one)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def unpaired_surrogate(text: str) -> Optional[str]:
    """Why `text` is not Unicode text, or None. JSON's "\\ud800" escape decodes to an unpaired
    surrogate, which the tokenizer and every UTF-8 encoder (an error message echoing it) fail
    on, and which no generated text can match."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"unpaired surrogate {ascii(text[e.start])[1:-1]} at character {e.start}"
    return None


#: The positive temperatures the sampler can divide float32 logits by: below TEMPERATURE_MIN,
#: logits / T overflows to +-inf, and the sort-free sampler then picks the lowest token id of
#: positive logit while the filtering one picks the greedy token (so the tokens depended on
#: whether another request of the window filtered); past TEMPERATURE_MAX the float32 copy of T
#: overflows (a numpy RuntimeWarning, then an infinite temperature).
TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-30, 1e30


class RequestError(ValueError):
    """A request the engine cannot take; `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    #: Stop at the model's EOS token(s).
    stop_at_eos: bool = True

    @property
    def filtered(self) -> bool:
        """Sampling needs top-k / top-p filtering (the sorting sampler); greedy never does."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise RequestError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not _finite(v):
                raise RequestError(name, f"must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise RequestError("temperature", f"must be >= 0, got {self.temperature}")
        if self.temperature and not TEMPERATURE_MIN <= self.temperature <= TEMPERATURE_MAX:
            raise RequestError("temperature", f"must be 0 (greedy) or in [{TEMPERATURE_MIN:g}, "
                                              f"{TEMPERATURE_MAX:g}] (the sampler divides "
                                              f"float32 logits by it), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        # Upper bound: top_k and seed travel to the device in an int64 buffer (model_runner).
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) \
                or not 0 <= self.top_k < 2**63:
            raise RequestError("top_k", f"must be an integer in [0, 2**63) (0 = off), "
                                        f"got {self.top_k!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise RequestError("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop", "must be a list of non-empty strings")
        # (a truthy string such as "false" silently meant True)
        if not isinstance(self.stop_at_eos, bool):
            raise RequestError("stop_at_eos", f"must be a bool, got {self.stop_at_eos!r}")


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    #: Engine iteration at which the request arrives (None: at once / at `arrival_s`).
    arrival_step: Optional[int] = None
    #: Seconds after the engine's start at which the request arrives (wall-clock workloads).
    arrival_s: Optional[float] = None
    prompt_text: Optional[str] = None
    #: Decode text as tokens are emitted (for streaming); off, text is decoded once at the end.
    stream_text: bool = True

    def validate(self, vocab: int, max_context: int) -> None:
        """Raise RequestError naming the problem if a model of `vocab` tokens and slots of
        `max_context` positions cannot run this request."""
        if not isinstance(self.id, str) or not self.id:
            raise RequestError("id", "must be a non-empty string")
        ids = self.prompt_ids
        if not isinstance(ids, list):  # (a tuple or a string was reported as "is empty")
            raise RequestError("prompt", f"must be a list of token ids, got "
                                         f"{type(ids).__name__}")
        if not ids:
            raise RequestError("prompt", "is empty")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RequestError("prompt", f"token id at index {i} ({t!r}) is not in [0, {vocab})")
        if len(ids) >= max_context:
            raise RequestError("prompt", f"{len(ids)} tokens leave no room in the context of "
                                         f"{max_context} positions (at most {max_context - 1})")
        if not isinstance(self.params, SamplingParams):  # (was an AttributeError)
            raise RequestError("params", f"must be a SamplingParams, got "
                                         f"{type(self.params).__name__}")
        self.params.validate()
        if not isinstance(self.stream_text, bool):
            raise RequestError("stream_text", f"must be a bool, got {self.stream_text!r}")
        check_arrival(self.arrival_step, self.arrival_s)


def check_arrival(step: Any, sec: Any) -> None:
    """RequestError for an arrival the engine cannot wait for. Bounded: the arrival heaps
    compare them as floats, and an infinite arrival_s would keep the engine waiting for ever."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)
                             or not 0 <= step < 2**63):
        raise RequestError("arrival_step", f"must be an integer in [0, 2**63), got {step!r}")
    if sec is not None and (not isinstance(sec, (int, float)) or isinstance(sec, bool)
                            or not _finite(sec) or sec < 0):
        raise RequestError("arrival_s", f"must be a finite number >= 0, got {sec!r}")


@dataclass
class RequestOutput:
    """What one engine iteration produced for one request (a streaming delta)."""
    id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: Optional[str] = None  # stop | length | cancel | error
    error: Optional[str] = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    #: On the final output: queue, prefill, first-token, decode and end-to-end times, drafts.
    timings: Optional[dict] = None
