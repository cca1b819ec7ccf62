"""Replay of hand-written traces.

Each trace below was worked out by hand from docs/SCHEDULING.md (the derivation is in the
comments, step by step), not produced by the simulator, so these tests check the simulator
against the written rules. The corrupted traces must fail at the right first divergence.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.replay import TraceError, load_trace, replay_file, replay_trace

REPO = Path(__file__).resolve().parent.parent

ENGINE_DEFAULTS = dict(mode="batch", batch_mtp=True, drafting=True, slots=2, spec=4,
                       window_rows=8, decode_share=0.5, prefill_chunk=4, max_context=64,
                       context_tier_min=16, shape_buckets=[1, 2, 4], graphs=True,
                       graph_key="layout", graph_limit=0, vram_reserve_mib=2048,
                       graph_mib_estimate=16.0, cpu_graph_mib=16.0, cpu_device_mib=24576,
                       eos_stop=True)
# Budget of the default memory: 24576 - 2048 - 100 - 2 x 10 = 22408 MiB, never tight.
MEMORY_DEFAULTS = dict(total_mib=24576, weights_mib=100, slot_mib=10, slots=2, graph_mib=16.0)


def config(engine=None, memory=None):
    return {"ev": "config", "step": 0, "t": 0.0,
            "engine": {**ENGINE_DEFAULTS, **(engine or {})},
            "memory": {**MEMORY_DEFAULTS, **(memory or {})}}


def ev(kind, step, **fields):
    return {"ev": kind, "step": step, "t": 0.0, **fields}


def arrive(step, req, prompt, max_tokens, filtered=None):
    """An arrive event; without `filtered` it is one written before that field existed."""
    extra = {} if filtered is None else {"filtered": filtered}
    return ev("arrive", step, req=req, prompt_tokens=prompt, max_tokens=max_tokens, **extra)


def admit(step, req, slot):
    return ev("admit", step, req=req, slot=slot)


def prefill(step, req, slot, tokens):
    return ev("prefill", step, req=req, slot=slot, tokens=tokens, dur=0.001, ctx=16)


def window(step, layout, key, graph):
    return ev("window", step, layout=list(layout), key=key, graph=graph, rows=len(layout),
              dur=0.001, ctx=16)


def evict(step, key, reason):
    return ev("evict", step, key=key, reason=reason)


def commit(step, req, slot, drafted, accepted, emitted):
    return ev("commit", step, req=req, slot=slot, drafted=drafted, accepted=accepted,
              emitted=emitted)


def finish(step, req, reason, tokens):
    return ev("finish", step, req=req, reason=reason, tokens=tokens)


def trace_two_slots_limit():
    """batch_mtp, 2 slots, layout keys, graph_limit=2, chunk 4, tier_min 16.

    a: prompt 6, max 4; b: prompt 3, max 3; both arrive at step 0.
    0: admit a->0, b->1; only prefill: a runs 4 of 6.
    1: only prefill: a runs 2, done (pos 6, emitted 1, left 3), joins the ring.
    2: mixed n=1, d=0 < 0.5: decode. Not lone (b prefills): a gets 2 rows -> (0,0), tier of
       6+2=8 is 16; capture. a accepts 1: emits 2 (pos 8, emitted 3, left 1).
    3: mixed n=2, d=1 < 1.0 fails: prefill b (3 tokens, done, joins).
    4: decode: a r=min(2, left 1)=1, b r=2 -> (0,1,1); capture. a emits 1 -> length 4;
       b accepts 0, emits 1 (emitted 2). a leaves; the pointer (0, all were taken) moves to 1.
    5: b alone, nothing prefilling: spec rows, cut to left=1 -> (1); the cache holds 2 =
       limit: evict the LRU (0,0); capture. b emits 1 -> length 3.
    """
    return [
        config(engine=dict(graph_limit=2)),
        arrive(0, "a", 6, 4), arrive(0, "b", 3, 3), admit(0, "a", 0), admit(0, "b", 1),
        prefill(0, "a", 0, 4),
        prefill(1, "a", 0, 2),
        window(2, [0, 0], "layout:0,0@16", "capture"), commit(2, "a", 0, 1, 1, 2),
        prefill(3, "b", 1, 3),
        window(4, [0, 1, 1], "layout:0,1,1@16", "capture"),
        commit(4, "a", 0, 0, 0, 1), commit(4, "b", 1, 1, 0, 1), finish(4, "a", "length", 4),
        evict(5, "layout:0,0@16", "limit"), window(5, [1], "layout:1@16", "capture"),
        commit(5, "b", 1, 0, 0, 1), finish(5, "b", "length", 3),
    ]


def trace_rotation_memory(graph_mib=16.0):
    """3 slots, W=4 (two 2-row groups per window), shape keys, graph budget of 20 MiB.

    x, y, z: prompt 1, max 5, all at step 0. Budget = 160 - 100 - 20 - 3 x 10 = 20 MiB
    before graphs: one 16 MiB graph fits, a second does not.
    0: admit x->0, y->1, z->2; prefill x (done, joins).
    1: mixed n=1 d=0: decode. x: 2 rows (0,0); tier(3)=16; shape:1x2@16; planned 16 (the
       estimate) fits in 20: capture. x accepts 0: emitted 2, pos 2.
    2: n=2 d=1: prefill y (done, joins). Ring 0,1; pointer 0.
    3: n=3 d=1 < 1.5: decode. x r=2, y r=2 -> (0,0,1,1) fills W; pointer stays 0.
       shape:2x2@16 misses; planned 16 > 20-16: evict shape:1x2@16 (memory); capture.
       x accepts 1 (emitted 4, pos 4, left 1); y accepts 0 (emitted 2, pos 2).
    4: n=4 d=2 < 2.0 fails: prefill z (done, joins). Ring 0,1,2.
    5: decode only. From 0: x r=1, y r=2 (3 rows), z r=2 would make 5 > 4: stop.
       (0,1,1); pointer -> 2. shape:2x2@16 hits. x emits 1 -> length 5; y accepts 1
       (emitted 4, left 1). x leaves; pointer (2) unmoved.
    6: from 2: z r=2, y r=1 -> (2,2,1); pointer -> 2. Hit. z accepts 1 (emitted 3, left 2);
       y emits 1 -> length 5.
    7: z alone, nothing prefilling: spec=4 rows cut to left=2 -> (2,2); shape:1x2@16 misses,
       planned 16 > 4: evict shape:2x2@16 (memory); capture. z accepts 1 -> length 5.
    With graph_mib=24 (each capture measures 24 MiB) the first capture overdraws the budget;
    at step 3 the cache evicts it (memory), 24 > 20 still, so the window runs eagerly, and so
    does every later miss (nothing left to evict).
    """
    eng = dict(slots=3, window_rows=4, graph_key="shape", vram_reserve_mib=100)
    # total 160 - reserve 100 - weights 10 - 3 slots x 10 = 20 MiB
    mem = dict(total_mib=160, weights_mib=10, slot_mib=10, slots=3, graph_mib=graph_mib)
    eager = graph_mib > 20
    events = [
        config(engine=eng, memory=mem),
        arrive(0, "x", 1, 5), arrive(0, "y", 1, 5), arrive(0, "z", 1, 5),
        admit(0, "x", 0), admit(0, "y", 1), admit(0, "z", 2), prefill(0, "x", 0, 1),
        window(1, [0, 0], "shape:1x2@16", "capture"), commit(1, "x", 0, 1, 0, 1),
        prefill(2, "y", 1, 1),
        evict(3, "shape:1x2@16", "memory"),
        window(3, [0, 0, 1, 1], "shape:2x2@16", "eager" if eager else "capture"),
        commit(3, "x", 0, 1, 1, 2), commit(3, "y", 1, 1, 0, 1),
        prefill(4, "z", 2, 1),
        window(5, [0, 1, 1], "shape:2x2@16", "eager" if eager else "hit"),
        commit(5, "x", 0, 0, 0, 1), commit(5, "y", 1, 1, 1, 2), finish(5, "x", "length", 5),
        window(6, [2, 2, 1], "shape:2x2@16", "eager" if eager else "hit"),
        commit(6, "z", 2, 1, 1, 2), commit(6, "y", 1, 0, 0, 1), finish(6, "y", "length", 5),
    ]
    if not eager:
        events.append(evict(7, "shape:2x2@16", "memory"))
    events += [window(7, [2, 2], "shape:1x2@16", "eager" if eager else "capture"),
               commit(7, "z", 2, 1, 1, 2), finish(7, "z", "length", 5)]
    return events


def trace_solo_stop_cancel_idle():
    """solo, spec 3, layout keys: stop mid-commit, stop at prefill end, idle steps, a cancel.

    p: prompt 5, max 10 (step 0); q: prompt 2, max 6 (step 3); r: prompt 3, max 4 and
    s: prompt 4, max 20 (step 20). p stops with 6 tokens, q at prefill end, s is cancelled
    while queued at step 22.
    0: admit p->0; prefill 5 (done: pos 5, emitted 1).
    1: 3 rows (0,0,0), tier(8)=16, capture; accepts 2: emitted 4, pos 8.
    2: hit; accepts 0: emitted 5.
    3: q arrives, queued (the one slot is busy). Hit; accepts 2, but the stop meets token 7:
       emits 1 -> stop with 6 tokens. Slot 0 is free from the next iteration.
    4: admit q->0; prefill 2, done; its first token stops it: finish stop, 1 token.
    5..19: idle (no events, steps still count).
    20: r, s arrive; admit r->0 (s waits); prefill 3 (done: pos 3, emitted 1, left 3).
    21: (0,0,0) tier(6)=16 hits; accepts 1: emitted 3, left 1.
    22: s is cancelled first (queued: 0 tokens). r: 1 row (0), layout:0@16 misses: capture;
        emits 1 -> length 4.
    """
    eng = dict(mode="solo", spec=3, slots=1, prefill_chunk=8)
    return [
        config(engine=eng, memory=dict(slots=1)),
        arrive(0, "p", 5, 10), admit(0, "p", 0), prefill(0, "p", 0, 5),
        window(1, [0, 0, 0], "layout:0,0,0@16", "capture"), commit(1, "p", 0, 2, 2, 3),
        window(2, [0, 0, 0], "layout:0,0,0@16", "hit"), commit(2, "p", 0, 2, 0, 1),
        arrive(3, "q", 2, 6),
        window(3, [0, 0, 0], "layout:0,0,0@16", "hit"), commit(3, "p", 0, 2, 2, 1),
        finish(3, "p", "stop", 6),
        admit(4, "q", 0), prefill(4, "q", 0, 2), finish(4, "q", "stop", 1),
        arrive(20, "r", 3, 4), arrive(20, "s", 4, 20), admit(20, "r", 0), prefill(20, "r", 0, 3),
        window(21, [0, 0, 0], "layout:0,0,0@16", "hit"), commit(21, "r", 0, 2, 1, 2),
        finish(22, "s", "cancel", 0),
        window(22, [0], "layout:0@16", "capture"), commit(22, "r", 0, 0, 0, 1),
        finish(22, "r", "length", 4),
    ]


def trace_share_tiers_cancel():
    """batch without batch_mtp, spec 2, decode_share 0.75, shape keys, graph_limit 1,
    tier_min 4, max_context 12 (tiers 4, 8, 12), chunk 2, a cancel of a decoding slot.

    u: prompt 2, max 20 and v: prompt 8, max 3 at step 0; w: prompt 2, max 5 at step 1.
    With share 0.75 mixed iterations go D D D P D D D P ... (d < 0.75 n).
    0: admit u->0, v->1; prefill u (2, done; pos 2).
    1: admit w->2. D (n=1): u 1 row, tier(3)=4, shape:1x1@4 capture. pos 3.
    2: D (n=2): tier(4)=4 hit. pos 4.   3: D (n=3): tier(5)=8 misses: evict @4 (limit), capture.
    4: P (n=4, d=3 < 3.0 fails): v 2 of 8.   5, 6, 7: D: tier 8 hits (pos 6, 7, 8).
    8: P: v 4 of 8.   9: D: tier(9) = 12 (16 capped at max_context): evict @8, capture. pos 9.
    10: u cancelled (8 tokens), leaves the ring (now empty). Only prefill: v 6 of 8.
    11: prefill v (done: pos 8, emitted 1, left 2). Ring: 1.
    12: D (n=10, d=7 < 7.5): v 1 row (w prefills), tier(9)=12 hits; emitted 2.
    13: D (n=11, d=8 < 8.25): hit; emitted 3 -> length 3.
    14: only prefill: w (2, done).
    15: w lone, nothing prefilling: spec 2 rows (2,2), tier(4)=4: shape:1x2@4; evict @12;
        capture; accepts 1: emitted 3, pos 4.
    16: (2,2) tier(6)=8: shape:1x2@8, evict, capture; accepts 0: emitted 4, left 1.
    17: 1 row (2), tier(6)=8: shape:1x1@8, evict, capture; emitted 5 -> length 5.
    """
    eng = dict(batch_mtp=False, spec=2, slots=3, decode_share=0.75, prefill_chunk=2,
               context_tier_min=4, max_context=12, graph_key="shape", graph_limit=1)
    k1 = lambda tier: f"shape:1x1@{tier}"  # noqa: E731
    return [
        config(engine=eng, memory=dict(slots=3)),
        arrive(0, "u", 2, 20), arrive(0, "v", 8, 3), admit(0, "u", 0), admit(0, "v", 1),
        prefill(0, "u", 0, 2),
        arrive(1, "w", 2, 5), admit(1, "w", 2),
        window(1, [0], k1(4), "capture"), commit(1, "u", 0, 0, 0, 1),
        window(2, [0], k1(4), "hit"), commit(2, "u", 0, 0, 0, 1),
        evict(3, k1(4), "limit"), window(3, [0], k1(8), "capture"), commit(3, "u", 0, 0, 0, 1),
        prefill(4, "v", 1, 2),
        window(5, [0], k1(8), "hit"), commit(5, "u", 0, 0, 0, 1),
        window(6, [0], k1(8), "hit"), commit(6, "u", 0, 0, 0, 1),
        window(7, [0], k1(8), "hit"), commit(7, "u", 0, 0, 0, 1),
        prefill(8, "v", 1, 2),
        evict(9, k1(8), "limit"), window(9, [0], k1(12), "capture"), commit(9, "u", 0, 0, 0, 1),
        finish(10, "u", "cancel", 8), prefill(10, "v", 1, 2),
        prefill(11, "v", 1, 2),
        window(12, [1], k1(12), "hit"), commit(12, "v", 1, 0, 0, 1),
        window(13, [1], k1(12), "hit"), commit(13, "v", 1, 0, 0, 1), finish(13, "v", "length", 3),
        prefill(14, "w", 2, 2),
        evict(15, k1(12), "limit"), window(15, [2, 2], "shape:1x2@4", "capture"),
        commit(15, "w", 2, 1, 1, 2),
        evict(16, "shape:1x2@4", "limit"), window(16, [2, 2], "shape:1x2@8", "capture"),
        commit(16, "w", 2, 1, 0, 1),
        evict(17, "shape:1x2@8", "limit"), window(17, [2], k1(8), "capture"),
        commit(17, "w", 2, 0, 0, 1), finish(17, "w", "length", 5),
    ]


def trace_context_end():
    """One slot, max_context 8, tier_min 4: a group cut by the context end; max_tokens 1.

    m: prompt 5, max 10; n: prompt 3, max 1 (both step 0; n waits for the slot).
    0: admit m->0; prefill 5 (pos 5). 1: lone: spec 4 rows cut to 8-5=3 -> (0,0,0), tier(8)=8,
    capture; accepts 2: pos 8 = max_context -> length 4. 2: admit n->0; prefill 3; its first
    token is its last (max_tokens 1) -> length 1.
    """
    eng = dict(slots=1, max_context=8, context_tier_min=4, prefill_chunk=16)
    return [
        config(engine=eng, memory=dict(slots=1)),
        arrive(0, "m", 5, 10), arrive(0, "n", 3, 1), admit(0, "m", 0), prefill(0, "m", 0, 5),
        window(1, [0, 0, 0], "layout:0,0,0@8", "capture"), commit(1, "m", 0, 2, 2, 3),
        finish(1, "m", "length", 4),
        admit(2, "n", 0), prefill(2, "n", 0, 3), finish(2, "n", "length", 1),
    ]


def trace_graphs_off_no_drafting():
    """graphs=false: every window eager, cache untouched, key reported as "eager".
    drafting unavailable: lone slots get 1 row, batch_mtp has no effect.
    a: prompt 1, max 3; b: prompt 1, max 2 (step 0), 2 slots.
    0: admit a->0, b->1; prefill a. 1: mixed: decode (0) 1 row. 2: prefill b.
    3: (0,1): a emits its 3rd -> length; b emits 2nd -> length.
    """
    eng = dict(graphs=False, drafting=False)
    return [
        config(engine=eng),
        arrive(0, "a", 1, 3), arrive(0, "b", 1, 2), admit(0, "a", 0), admit(0, "b", 1),
        prefill(0, "a", 0, 1),
        window(1, [0], "eager", "eager"), commit(1, "a", 0, 0, 0, 1),
        prefill(2, "b", 1, 1),
        window(3, [0, 1], "eager", "eager"),
        commit(3, "a", 0, 0, 0, 1), commit(3, "b", 1, 0, 0, 1),
        finish(3, "a", "length", 3), finish(3, "b", "length", 2),
    ]


def trace_fault_and_early_cancel():
    """An engine fault fails a whole window; a request is cancelled before it arrives.

    a, b: prompt 2, max 10 (step 0); c is cancelled at step 1, before its arrival (so it has
    no arrive event); d: prompt 2, max 2 (step 3). 2 slots, chunk 8.
    0: admit a->0, b->1; prefill a (done).
    1: c finishes (cancel, 0 tokens). Mixed n=1: decode (0,0), capture; a emits 1 (2 tokens).
    2: mixed n=2, d=1 < 1.0 fails: prefill b (done). Ring 0,1; pointer 0.
    3: d arrives, queued. Decode (0,0,1,1) is planned (pointer stays 0) and faults: a (2
       tokens) and b (1) finish with error, in window order; the pointer follows them out
       (0 -> 1 -> empty). Their slots are free from the next iteration.
    4: admit d->0; prefill d (done, left 1).
    5: d alone: spec rows cut to left=1 -> (0); capture; length 2.
    """
    return [
        config(engine=dict(prefill_chunk=8)),
        arrive(0, "a", 2, 10), arrive(0, "b", 2, 10), admit(0, "a", 0), admit(0, "b", 1),
        prefill(0, "a", 0, 2),
        finish(1, "c", "cancel", 0),
        window(1, [0, 0], "layout:0,0@16", "capture"), commit(1, "a", 0, 1, 0, 1),
        prefill(2, "b", 1, 2),
        arrive(3, "d", 2, 2), finish(3, "a", "error", 2), finish(3, "b", "error", 1),
        admit(4, "d", 0), prefill(4, "d", 0, 2),
        window(5, [0], "layout:0@16", "capture"), commit(5, "d", 0, 0, 0, 1),
        finish(5, "d", "length", 2),
    ]


def trace_filtered_request():
    """trace_two_slots_limit with b filtering its sampling (top-k / top-p): every window that
    holds b's slot is keyed with the `+f` suffix, the others are not.
    2: (0,0) holds only a: layout:0,0@16, capture.
    4: (0,1,1) holds b: layout:0,1,1@16+f, capture.
    5: (1): the cache holds 2 = limit: evict the LRU layout:0,0@16; layout:1@16+f, capture.
    """
    return [
        config(engine=dict(graph_limit=2)),
        arrive(0, "a", 6, 4, filtered=False), arrive(0, "b", 3, 3, filtered=True),
        admit(0, "a", 0), admit(0, "b", 1),
        prefill(0, "a", 0, 4),
        prefill(1, "a", 0, 2),
        window(2, [0, 0], "layout:0,0@16", "capture"), commit(2, "a", 0, 1, 1, 2),
        prefill(3, "b", 1, 3),
        window(4, [0, 1, 1], "layout:0,1,1@16+f", "capture"),
        commit(4, "a", 0, 0, 0, 1), commit(4, "b", 1, 1, 0, 1), finish(4, "a", "length", 4),
        evict(5, "layout:0,0@16", "limit"), window(5, [1], "layout:1@16+f", "capture"),
        commit(5, "b", 1, 0, 0, 1), finish(5, "b", "length", 3),
    ]


HAND_TRACES = {
    "filtered_request": trace_filtered_request,
    "fault_and_early_cancel": trace_fault_and_early_cancel,
    "two_slots_limit": trace_two_slots_limit,
    "rotation_memory": trace_rotation_memory,
    "rotation_memory_eager": lambda: trace_rotation_memory(graph_mib=24.0),
    "solo_stop_cancel_idle": trace_solo_stop_cancel_idle,
    "share_tiers_cancel": trace_share_tiers_cancel,
    "context_end": trace_context_end,
    "graphs_off_no_drafting": trace_graphs_off_no_drafting,
}


@pytest.mark.parametrize("name", sorted(HAND_TRACES))
def test_hand_written_trace_replays(name):
    result = replay_trace(HAND_TRACES[name]())
    assert result.ok, str(result.first_divergence)
    assert result.compared > 0


def _view_index(events, target):
    """Index of event `target` among the replayed events of `events`."""
    replayed = [e for e in events if e["ev"] in ("admit", "window", "evict", "commit", "finish")]
    return next(i for i, e in enumerate(replayed) if e is target)


def test_corrupted_layout_fails_at_that_window():
    events = trace_rotation_memory()
    bad = next(e for e in events if e["ev"] == "window" and e["step"] == 6)
    bad["layout"] = [1, 2, 2]  # the engine "started at 1": the pointer rule says 2
    result = replay_trace(events)
    assert not result.ok
    d = result.first_divergence
    assert d.index == _view_index(events, bad)
    assert d.engine[0] == "window" and d.engine[2] == (1, 2, 2)
    assert d.sim[0] == "window" and d.sim[2] == (2, 2, 1)
    assert "step 6" in str(d)


def test_filtered_flag_decides_the_key_suffix():
    events = trace_filtered_request()
    # An arrive without `filtered` (an older trace) reads as unfiltered: no suffix at step 4.
    del next(e for e in events if e["ev"] == "arrive" and e["req"] == "b")["filtered"]
    result = replay_trace(events)
    assert not result.ok
    d = result.first_divergence
    assert d.engine[:2] == ("window", 4) and d.engine[3] == "layout:0,1,1@16+f"
    assert d.sim[3] == "layout:0,1,1@16"
    # the predicted trace carries the flag the sim read
    sim_arrive = {e["req"]: e["filtered"] for e in result.sim_events if e["ev"] == "arrive"}
    assert sim_arrive == {"a": False, "b": False}
    assert replay_trace(trace_filtered_request()).ok


def test_corrupted_emitted_fails_at_that_commit():
    events = trace_two_slots_limit()
    bad = next(e for e in events if e["ev"] == "commit" and e["step"] == 2)
    bad["emitted"] = 1  # accepted 1 means 2 tokens
    result = replay_trace(events)
    d = result.first_divergence
    assert d.index == _view_index(events, bad)
    assert d.engine[-1] == 1 and d.sim[-1] == 2


def test_missing_evict_fails_at_the_evict():
    events = trace_share_tiers_cancel()
    bad = next(e for e in events if e["ev"] == "evict" and e["step"] == 9)
    idx = _view_index(events, bad)
    events.remove(bad)
    d = replay_trace(events).first_divergence
    assert d.index == idx
    assert d.sim[0] == "evict" and d.engine[0] == "window"


def test_truncated_trace_reports_missing_engine_event():
    events = trace_context_end()[:-1]  # drop n's finish
    d = replay_trace(events).first_divergence
    assert d.engine is None and d.sim[0] == "finish"
    assert "no event" in str(d)


def test_wrong_step_is_a_divergence():
    events = trace_solo_stop_cancel_idle()
    bad = next(e for e in events if e["ev"] == "admit" and e["req"] == "r")
    bad["step"] = 19  # the idle steps must count
    assert not replay_trace(events).ok


def _write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")


def test_replay_file_and_cli(tmp_path):
    good = tmp_path / "good.jsonl"
    _write(good, trace_two_slots_limit())
    assert replay_file(good).ok
    out = subprocess.run([sys.executable, "-m", "sim", "mode=replay", f"trace={good}",
                          f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("replay ok:") and len(out.stdout.strip().splitlines()) == 1

    events = trace_two_slots_limit()
    next(e for e in events if e["ev"] == "window" and e["step"] == 5)["graph"] = "hit"
    bad = tmp_path / "bad.jsonl"
    _write(bad, events)
    out = subprocess.run([sys.executable, "-m", "sim", "mode=replay", f"trace={bad}",
                          f"hydra.run.dir={tmp_path / 'run2'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "diverged" in out.stdout and "graph='hit'" in out.stdout
    assert "graph='capture'" in out.stdout


def test_malformed_trace_names_file_and_line(tmp_path):
    p = tmp_path / "t.jsonl"
    lines = [json.dumps(e) for e in trace_context_end()]
    lines[3] = lines[3][:-3]  # truncated JSON on line 4
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=rf"{p}:4: not JSON"):
        load_trace(p)

    lines = [json.dumps(e) for e in trace_context_end()]
    rec = json.loads(lines[2])
    del rec["max_tokens"]
    lines[2] = json.dumps(rec)
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=rf"{p}:3: arrive event lacks \['max_tokens'\]"):
        load_trace(p)

    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "missing.jsonl")


def test_trace_must_start_with_config():
    events = trace_context_end()[1:]
    with pytest.raises(TraceError, match="first event must be `config`"):
        replay_trace(events)
    events = trace_context_end()
    del events[0]["engine"]["graph_key"]
    with pytest.raises(TraceError, match="lacks \\['graph_key'\\]"):
        replay_trace(copy.deepcopy(events))


def test_measured_capture_sizes_come_from_the_trace():
    """A CUDA engine writes `graph_mib: null` (no fixed size) and the measured `mib` on each
    capture's window event; the replay charges those sizes in order. The eager variant of the
    rotation trace only replays when the 24 MiB it measured are what the cache plans with."""
    events = trace_rotation_memory(graph_mib=24.0)
    events[0]["memory"]["graph_mib"] = None
    for e in events:
        if e["ev"] == "window" and e["graph"] == "capture":
            e["mib"] = 24.0
    result = replay_trace(events)
    assert result.ok, str(result.first_divergence)
    # Without the sizes the replay plans with the 16 MiB estimate: the second window fits
    # after the eviction and is captured, where the engine ran it eagerly.
    for e in events:
        e.pop("mib", None)
    d = replay_trace(events).first_divergence
    assert d is not None and d.engine[:2] == ("window", 3)
    assert d.engine[4] == "eager" and d.sim[4] == "capture"


def test_h200_trace_replays():
    """A trace the engine wrote on the H200 (bf16, cuda kernels, batch_mtp, 2 requests; see
    docs/BENCHMARKS.md, "Simulator check"): measured graph memory, real durations, replayed exactly."""
    result = replay_file(REPO / "tests" / "data" / "h200_batch_mtp_n2_trace.jsonl")
    assert result.ok, str(result.first_divergence)
    assert result.compared >= 170
