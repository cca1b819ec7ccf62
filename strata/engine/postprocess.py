"""Postprocessing what the device returned: a prompt chunk's or a decode window's commit (the
trace events, positions, counters, finished slots), a request's emission up to a stop
condition with its output delta, and a finished request's record."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from strata.engine.detokenizer import TextStream
from strata.engine.graph_cache import GraphRun
from strata.engine.request import RequestOutput
from strata.engine.slots import RequestState, Slot
from strata.engine.window import WindowShape
from strata.kinds import FinishReason
from strata.metrics import engine_request_times, request_timings

if TYPE_CHECKING:
    from strata.engine.llm_engine import Engine


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


def emit(eng: "Engine", rs: RequestState, slot: Slot, tokens: list[int], outs: dict) -> int:
    """emit_tokens for `rs` in `slot`, counted and timed by the engine; returns how many."""
    n = emit_tokens(rs, tokens, output_of(rs, outs), eos=eng.eos, tokenizer=eng.tokenizer,
                    context_full=slot.pos >= eng.max_context)
    if n:
        rs.t_last = eng.now()
        eng.output_tokens += n
    return n


def record_finish(eng: "Engine", rs: RequestState, out: Optional[RequestOutput] = None) -> None:
    """A finished request's time, `finish` trace event and (into `out`) timings."""
    rs.t_finish = eng.now()
    rs.prompt_tensor = None  # device memory goes back at once
    eng.trace.emit("finish", req=rs.id, reason=rs.reason, tokens=len(rs.emitted))
    if out is not None:
        out.timings = request_timings(engine_request_times(rs))


def commit_prompt(eng: "Engine", slot: Slot, n: int, first: Optional[int], dur: float,
                  outs: dict, segments: int = 1) -> None:
    """A prompt chunk of `n` tokens ran in `dur` s; `first`: the request's first output token
    when the chunk ended its prompt (else None). A finished prompt emits it and starts decoding.
    `segments` > 1: the chunk held that many slots' chunks (engine.prefill_slots), each
    committed by its own call; `dur` is the whole chunk's, and its event says so."""
    rs = slot.req
    slot.prefilled += n
    rs.prefill_s += dur
    eng.prefills += 1
    extra = {"segments": segments} if segments > 1 else {}
    eng.trace.emit("prefill", req=rs.id, slot=slot.id, tokens=n, dur=round(dur, 6),
                   ctx=slot.prefilled, **extra)
    if first is None:
        return
    slot.pos = rs.prompt_len
    rs.t_first = eng.now()
    emit(eng, rs, slot, [first], outs)
    if rs.finished:
        record_finish(eng, rs, outs.get(rs.id))
        eng.scheduler.release(slot)
    else:
        eng.scheduler.start_decoding(slot)


def commit_window(eng: "Engine", groups: list, layout: tuple, w: WindowShape, run: GraphRun,
                  rows: list, dur: float, outs: dict, launched: Optional[int] = None) -> None:
    """The window event, then each group's commit and emission, then the finishes.
    `groups`: (slot, rows, request) as launched; a group whose request has finished or
    left its slot since (engine.overlap, pipelined slot groups) is discarded. `launched`
    (pipelined slot groups): the step that launched the window, which the event records."""
    eng.windows += 1
    trace = eng.trace
    tracing = trace.active  # a server or benchmark builds none of these events
    expert_cache = eng.expert_cache
    swap = None
    extra = {}
    if expert_cache is not None:
        hits, misses, swap = expert_cache.after_window(run.expert_counts)
        extra = {"hits": hits, "misses": misses,
                 "bus_bytes": misses * expert_cache.plan.expert_bytes}
    if tracing:
        # A capture's measured size: replaying a GPU trace needs it to decide what fits.
        if run.mib is not None:
            extra["mib"] = round(run.mib, 3)
        if launched is not None:
            extra["launched"] = launched
        if run.device_s is not None:  # a serial window: the device's share of `dur`
            extra["dev"] = round(run.device_s, 6)
        trace.emit("window", layout=list(layout), key=w.key or "eager", graph=run.action,
                   rows=len(layout), dur=round(dur, 6), ctx=w.tier, **extra)
    ended = []
    for (slot, r, rs), row in zip(groups, rows):
        if rs.finished or slot.req is not rs:
            continue
        a = row[w.rows]
        slot.pos += a + 1
        n = emit(eng, rs, slot, row[: a + 1], outs)
        rs.drafted += r - 1
        rs.accepted += a
        eng.drafted += r - 1
        eng.accepted += a
        if tracing:
            trace.emit("commit", req=rs.id, slot=slot.id, drafted=r - 1, accepted=a, emitted=n)
        if rs.finished:
            ended.append(slot)
    for slot in ended:
        record_finish(eng, slot.req, outs.get(slot.req.id))
        eng.scheduler.release(slot)
    if swap is not None:
        trace.emit("expert_swap", experts=swap[0], bytes=swap[1])
