"""Postprocessing a request's new tokens: emission up to a stop condition, and its output delta."""

from __future__ import annotations

from typing import Any, Optional

from strata.engine.detokenizer import TextStream
from strata.engine.request import RequestOutput
from strata.engine.slots import RequestState
from strata.kinds import FinishReason


def output_of(rs: RequestState, outs: dict[str, RequestOutput]) -> RequestOutput:
    """This iteration's output of `rs` in `outs`, made on first use."""
    out = outs.get(rs.id)
    if out is None:  # (setdefault would build an output per call: this runs per commit)
        out = outs[rs.id] = RequestOutput(rs.id, [], "", prompt_tokens=rs.prompt_len)
    return out


def emit_tokens(rs: RequestState, tokens: list[int], out: RequestOutput, *, eos: set[int],
                context_full: bool, tokenizer: Optional[Any]) -> int:
    """Emit `tokens` in order until a stop condition (EOS, a stop string, max_tokens, or the
    context full after them); returns how many were emitted. The token that completes a stop
    string is not emitted."""
    p = rs.req.params
    stream = rs.text_stream
    if stream is None and tokenizer is not None and (rs.req.stream_text or p.stop):
        stream = rs.text_stream = TextStream(tokenizer, p.stop, rs.req.stream_text)
    n = 0
    for tok in tokens:
        if rs.left <= 0:
            break
        if p.stop_at_eos and tok in eos:
            rs.finished, rs.reason = True, FinishReason.STOP
            break
        rs.emitted.append(tok)
        out.new_token_ids.append(tok)
        if stream is not None and stream.stop_hit(rs.emitted):
            rs.emitted.pop()
            out.new_token_ids.pop()
            rs.finished, rs.reason = True, FinishReason.STOP
            break
        n += 1
        if rs.left <= 0:
            rs.finished, rs.reason = True, FinishReason.LENGTH
            break
    if not rs.finished and context_full:
        rs.finished, rs.reason = True, FinishReason.LENGTH
    if stream is not None:
        out.new_text += stream.advance(rs.emitted, rs.finished)
    out.output_tokens = len(rs.emitted)
    if rs.finished:
        out.finished, out.finish_reason = True, rs.reason
    return n
