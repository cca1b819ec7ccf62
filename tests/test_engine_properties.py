"""Property tests of rotation and commit bookkeeping (DESIGN.md sections 3-4, SCHEDULING.md).

- RotationRing alone (hypothesis state sequences): windows never exceed W, take ring-contiguous
  slots from the pointer, are maximal, move the pointer by the written rules; joins never move
  the pointer; a leaving pointer slot hands it to its ring successor; no slot starves.
- Small engine runs (hypothesis over modes, slots, W, spec, chunking, arrivals and cancels): the
  trace is checked event by event against an independent model of SCHEDULING.md (admission to
  the lowest free slot in FIFO order, the decode_share rule, group rows
  min(base, left, max_context - pos), pointer rules, commit accounting); each window's group
  positions equal prompt + committed tokens; the host's slot.pos equals the device's pos; the
  pending token is the last emitted one.
- After decoding, a lane's MTP K/V rows 0..pos-1 (and the main full-attention K/V rows) equal a
  fresh no-cache recompute over the committed sequence (no positional holes).
- A cancelled request frees its slot at once: the next queued request is admitted into it in
  the same iteration.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.engine.rotation import RotationRing
from strata.model.loader import save_checkpoint
from strata.model.qwen3_next import Qwen3Next
from strata.model.tiny import init_random, make_tiny_random, tiny_args
from conftest import cpu_engine_config

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("STRATA_BATCH_MTP", raising=False)


# ---------------------------------------------------------------------------------------------
# RotationRing alone
# ---------------------------------------------------------------------------------------------

def successor(members: list[int], slot: int) -> int:
    i = members.index(slot)
    return members[(i + 1) % len(members)]


ring_ops = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 7)),
        st.tuples(st.just("leave"), st.integers(0, 7)),
        st.tuples(st.just("build"), st.integers(1, 8),
                  st.lists(st.integers(1, 8), min_size=8, max_size=8)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(ring_ops)
def test_rotation_ring_rules(ops):
    ring = RotationRing()
    waiting: dict[int, int] = {}  # windows since a member's last turn (or its join)
    for op in ops:
        members = list(ring.members)
        before = ring.pointer
        if op[0] == "join":
            s = op[1]
            if s in members:
                with pytest.raises(ValueError):
                    ring.join(s)
                continue
            ring.join(s)
            waiting[s] = 0
            assert ring.pointer == before, "a joining slot moved the pointer"
        elif op[0] == "leave":
            s = op[1]
            if s not in members:
                continue
            ring.leave(s)
            waiting.pop(s)
            rest = [m for m in members if m != s]
            if before == s:
                later = [m for m in rest if m > s]
                expect = later[0] if later else (rest[0] if rest else None)
                assert ring.pointer == expect
            else:
                assert ring.pointer == before
        else:
            _, w, row_list = op
            rows = {s: min(row_list[s], w) for s in range(8)}  # a group never exceeds W
            taken = ring.build(lambda s: rows[s], w)
            if not members:
                assert taken == []
                continue
            start = before if before in members else members[0]
            assert taken[0] == start
            i0 = members.index(start)
            assert taken == [members[(i0 + k) % len(members)] for k in range(len(taken))]
            used = sum(rows[s] for s in taken)
            assert used <= w
            if len(taken) < len(members):  # maximal: the next group would not fit
                nxt = members[(i0 + len(taken)) % len(members)]
                assert used + rows[nxt] > w
                assert ring.pointer == nxt
            else:
                assert ring.pointer == start
            assert ring.pointer == successor(members, taken[-1])
            for s in members:
                waiting[s] = 0 if s in taken else waiting[s] + 1
                # no starvation: a member waits fewer windows than there are slot ids
                assert waiting[s] <= 7
        assert ring.members == sorted(ring.members)
        assert ring.pointer is None or ring.pointer in ring.members or not ring.members


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True), st.integers(1, 8),
       st.data())
def test_static_ring_every_slot_gets_a_turn_each_cycle(slots, w, data):
    ring = RotationRing()
    for s in slots:
        ring.join(s)
    n = len(slots)
    last_turn = {s: -1 for s in slots}
    for k in range(3 * n):
        rows = {s: data.draw(st.integers(1, w)) for s in slots}
        for s in ring.build(lambda s: rows[s], w):
            assert k - last_turn[s] <= n
            last_turn[s] = k
    assert all(k >= 2 * n for k in last_turn.values())


# ---------------------------------------------------------------------------------------------
# Engine runs checked against SCHEDULING.md
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("props-random"), seed=5, tokenizer=False)


@torch.no_grad()
def make_echo_mtp(path, seed: int = 2, alpha: float = 0.7):
    """MTP that copies the main model's bigram path (see test_engine_identity.py): real accepts."""
    args = tiny_args(eos_token_id=[0])
    torch.manual_seed(seed)
    m = init_random(Qwen3Next(args, with_mtp=True), seed=seed, head_std=0.5, norm_std=0.1)

    def scale(layer):
        (layer.linear_attn.out_proj if layer.kind == "linear_attention"
         else layer.self_attn.o_proj).weight.mul_(alpha)
        layer.mlp.experts.w_down.mul_(alpha)
        layer.mlp.shared_expert.down_proj.weight.mul_(alpha)

    for layer in m.layers:
        scale(layer)
    h = args.hidden_size
    m.mtp.fc.weight[:, :h] = torch.eye(h)  # the hidden half keeps its small random weights
    m.mtp.pre_fc_norm_embedding.weight.zero_()
    m.mtp.norm.weight.copy_(m.norm.weight)
    scale(m.mtp.layers[0])
    m.lm_head.weight[0] = 0.0
    save_checkpoint(m, path)
    return path


@pytest.fixture(scope="session")
def echo_dir(tmp_path_factory):
    return make_echo_mtp(tmp_path_factory.mktemp("props-echo"))


def build_engine(model_dir, **knobs) -> Engine:
    """An engine on the serial step (engine.overlap=false unless asked): the trace model and the
    per-step host/device checks below are the serial loop's (tests/test_overlap.py covers the
    overlapped one)."""
    knobs.setdefault("overlap", False)
    return Engine.from_config(cpu_engine_config(model_dir, **knobs), log=lambda s: None)


class TraceModel:
    """An independent reading of SCHEDULING.md, fed the engine's trace event by event."""

    def __init__(self, config_ev: dict, n_slots: int):
        e = config_ev["engine"]
        self.mode, self.spec, self.w = e["mode"], e["spec"], e["window_rows"]
        self.batch_mtp, self.drafting = e["batch_mtp"], e["drafting"]
        # rule 3: a batch_mtp group's drafts at most (null: spec - 1; a trace without it: 1)
        d = e.get("batch_mtp_drafts", 1)
        self.drafts = self.spec - 1 if d is None else d
        self.share, self.chunk = e["decode_share"], e["prefill_chunk"]
        self.max_context = e["max_context"]
        # rule 5: a prompt chunk holds up to this many prefilling slots (resolved by the engine)
        self.prefill_slots = e.get("prefill_slots") or 1
        self.in_chunk: list[dict] = []  # the slots of the chunk whose prefill events are coming
        self.n_slots = n_slots
        self.free = set(range(n_slots))
        self.queue: list[str] = []
        self.req: dict[str, dict] = {}
        self.members: list[int] = []
        self.pointer = None
        self.by_slot: dict[int, str] = {}
        self.admit_seq = 0
        self.mixed_n = self.mixed_d = 0
        self.window: list[tuple[int, int]] = []  # (slot, rows) of the current window
        self.wait: dict[int, int] = {}
        self.step = -1
        self.windows_positions: list[list[tuple[int, int, int]]] = []

    # -- helpers --
    def prefilling(self):
        return [r for r in self.req.values() if r["phase"] == "prefill"]

    def _end_step(self):
        for r in self.req.values():
            if r["phase"] == "joining":
                r["phase"] = "decode"
                self.members = sorted(self.members + [r["slot"]])
                self.wait[r["slot"]] = 0

    def _leave(self, slot: int):
        self.members.remove(slot)
        self.wait.pop(slot, None)
        if self.pointer == slot:
            later = [m for m in self.members if m > slot]
            self.pointer = later[0] if later else (self.members[0] if self.members else None)

    def _kind(self, decode: bool):
        if self.prefilling() and self.members:
            self.mixed_n += 1
            expect = self.mixed_d < self.share * self.mixed_n
            assert decode == expect, f"step {self.step}: decode_share rule broken"
            self.mixed_d += int(decode)
        elif self.members:
            assert decode, f"step {self.step}: only decoding slots, yet a prefill ran"
        else:
            assert not decode and self.prefilling()

    def rows_for(self, slot: int, lone: bool) -> int:
        r = self.req[self.by_slot[slot]]
        spec = self.spec if self.drafting else 1
        if self.mode == "solo" or lone:
            base = spec
        else:
            base = (max(2, min(1 + self.drafts, self.w // len(self.members)))
                    if self.batch_mtp and self.drafting else 1)
        return min(base, r["max_tokens"] - r["emitted"], self.max_context - r["pos"])

    # -- events --
    def feed(self, ev: dict):
        if ev["step"] != self.step:
            assert ev["step"] > self.step
            self._end_step()
            self.step = ev["step"]
        kind = ev["ev"]
        if kind == "arrive":
            self.req[ev["req"]] = dict(prompt=ev["prompt_tokens"], max_tokens=ev["max_tokens"],
                                       phase="queued", emitted=0, pos=0, prefilled=0, slot=None)
            self.queue.append(ev["req"])
        elif kind == "admit":
            assert self.queue and self.queue[0] == ev["req"], "admission is not FIFO"
            self.queue.pop(0)
            assert self.free and ev["slot"] == min(self.free), "not the lowest free slot"
            self.free.discard(ev["slot"])
            r = self.req[ev["req"]]
            self.admit_seq += 1
            r.update(phase="prefill", slot=ev["slot"], seq=self.admit_seq)
            self.by_slot[ev["slot"]] = ev["req"]
        elif kind == "prefill":
            if not self.in_chunk:  # a chunk's first event: the earliest admitted slots, in order
                self._kind(decode=False)
                self.in_chunk = sorted(self.prefilling(), key=lambda r: r["seq"])[:self.prefill_slots]
                assert ev.get("segments", 1) == len(self.in_chunk), \
                    "a prompt chunk did not hold the earliest admitted slots, up to prefill_slots"
            r = self.req[ev["req"]]
            assert r is self.in_chunk.pop(0), "prefill ran a slot other than the earliest admitted"
            assert ev["slot"] == r["slot"]
            assert ev["tokens"] == min(self.chunk, r["prompt"] - r["prefilled"])
            r["prefilled"] += ev["tokens"]
            if r["prefilled"] == r["prompt"]:
                r.update(phase="joining", pos=r["prompt"], emitted=1)
        elif kind == "window":
            self._kind(decode=True)
            assert self.members
            lay = ev["layout"]
            assert ev["rows"] == len(lay) <= self.w, "window exceeds window_rows"
            groups = []
            for s in lay:
                if groups and groups[-1][0] == s:
                    groups[-1][1] += 1
                else:
                    groups.append([s, 1])
            slots = [g[0] for g in groups]
            assert len(set(slots)) == len(slots), "a slot's rows are not contiguous"
            lone = len(self.members) == 1 and not self.prefilling()
            rows = {s: self.rows_for(s, lone) for s in self.members}
            start = self.pointer if self.pointer in self.members else self.members[0]
            i0 = self.members.index(start)
            n = len(self.members)
            expect, used = [], 0
            for k in range(n):
                s = self.members[(i0 + k) % n]
                if used + rows[s] > self.w:
                    break
                expect.append(s)
                used += rows[s]
            assert slots == expect, f"step {self.step}: window {slots}, rules say {expect}"
            for s, r in groups:
                assert r == rows[s], f"step {self.step}: slot {s} got {r} rows, rules say {rows[s]}"
            self.pointer = self.members[(self.members.index(slots[-1]) + 1) % n]
            for s in self.members:
                self.wait[s] = 0 if s in slots else self.wait[s] + 1
                assert self.wait[s] < self.n_slots, f"slot {s} starves"
            self.window = [(s, r) for s, r in groups]
            self.windows_positions.append(
                [(s, self.req[self.by_slot[s]]["pos"], r) for s, r in groups])
        elif kind == "commit":
            s, rows = self.window.pop(0)
            assert ev["slot"] == s and ev["req"] == self.by_slot[s]
            assert ev["drafted"] == rows - 1
            assert 0 <= ev["accepted"] <= ev["drafted"]
            assert 0 <= ev["emitted"] <= ev["accepted"] + 1
            r = self.req[ev["req"]]
            r["emitted"] += ev["emitted"]
            r["pos"] += ev["accepted"] + 1
            r["last_commit_full"] = ev["emitted"] == ev["accepted"] + 1
            assert r["pos"] <= self.max_context
        elif kind == "finish":
            assert not self.window, "finish before all commits of the window"
            if ev["req"] not in self.req:  # cancelled before it arrived
                assert ev["reason"] == "cancel" and ev["tokens"] == 0
                self.req[ev["req"]] = dict(phase="done", slot=None, emitted=0)
                return
            r = self.req[ev["req"]]
            if ev["reason"] == "cancel":
                assert r["phase"] in ("queued", "prefill", "decode")
                if r["phase"] == "queued":
                    self.queue.remove(ev["req"])
            elif ev["reason"] == "length":
                assert r["emitted"] == r["max_tokens"] or r["pos"] >= self.max_context
                assert r["emitted"] == ev["tokens"]
            elif ev["reason"] == "stop":
                assert ev["tokens"] <= r["emitted"]
            if ev["reason"] != "stop":
                assert ev["tokens"] == r["emitted"] or r["phase"] in ("queued", "prefill")
            if r["phase"] == "decode":
                self._leave(r["slot"])
            if r["slot"] is not None and r["phase"] != "queued":
                self.free.add(r["slot"])
                self.by_slot.pop(r["slot"], None)
            r["phase"] = "done"
        assert len(self.free) + len(self.by_slot) == self.n_slots


def drive(eng: Engine, requests, cancels=(), check_state=True, max_steps=3000):
    """Run to the end; cancel (step, req id) pairs before the given steps. Records every
    window's groups as the runner saw them, and checks host/device bookkeeping each step."""
    seen: list[list[tuple[int, int, int]]] = []
    orig = eng.runner.decode

    def rec(groups, *a, **k):
        seen.append(list(groups))
        return orig(groups, *a, **k)

    eng.runner.decode = rec
    for r in requests:
        eng.add_request(r)
    cancels = sorted(cancels)
    for _ in range(max_steps):
        if not eng.has_work():
            break
        while cancels and cancels[0][0] <= eng.steps:
            eng.cancel(cancels.pop(0)[1])
        eng.step()
        if check_state:
            for s in eng.scheduler.slots:
                if s.phase == "decode":
                    rs = s.req
                    assert int(eng.bufs.pos[s.id]) == s.pos, "host and device pos differ"
                    assert int(eng.bufs.pending[s.id]) == rs.emitted[-1], \
                        "the pending token is not the last emitted token"
                    assert s.pos == rs.prompt_len + len(rs.emitted) - 1
    assert not eng.has_work()
    return seen


def check_trace(eng: Engine, seen):
    events = eng.trace.events
    assert events[0]["ev"] == "config"
    model = TraceModel(events[0], len(eng.scheduler.slots))
    for ev in events[1:]:
        model.feed(ev)
    model._end_step()
    assert model.windows_positions == [[(s, p, r) for s, p, r in g] for g in seen], \
        "window group positions differ from prompt + committed tokens"
    for rid, rs in eng.requests.items():
        fin = [ev for ev in events if ev["ev"] == "finish" and ev["req"] == rid]
        assert len(fin) == 1, f"{rid} finished {len(fin)} times"
        assert fin[0]["tokens"] == len(rs.emitted)
        assert len(rs.emitted) <= rs.req.params.max_tokens
    return model


request_spec = st.tuples(st.integers(1, 14), st.integers(1, 14), st.integers(0, 8))


# no shrinking: a failing engine example is reported as drawn (shrinking costs minutes on 2 cores)
@pytest.mark.slow
@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
@given(
    reqs=st.lists(request_spec, min_size=1, max_size=5),
    mode=st.sampled_from(["solo", "batch", "batch", "batch_mtp", "batch_mtp"]),
    slots=st.integers(1, 4),
    w=st.integers(1, 8),
    spec_frac=st.integers(1, 8),
    chunk=st.sampled_from([2, 5, 256]),
    share=st.sampled_from([0.5, 0.25, 1.0, 0.75]),
    max_context=st.sampled_from([20, 256]),
    cancels=st.lists(st.tuples(st.integers(0, 25), st.integers(0, 4)), max_size=2),
    echo=st.booleans(),
)
def test_engine_trace_follows_scheduling_rules(model_dir, echo_dir, reqs, mode, slots, w,
                                               spec_frac, chunk, share, max_context, cancels,
                                               echo):
    spec = min(spec_frac, w)
    eng = build_engine(echo_dir if echo else model_dir, mode="solo" if mode == "solo" else "batch",
                       batch_mtp=mode == "batch_mtp", slots=slots, window_rows=w, spec=spec,
                       prefill_chunk=chunk, decode_share=share, max_context=max_context,
                       context_tier_min=8, graphs=True, graph_limit=2)
    rng = random.Random(len(reqs) * 31 + w)
    requests = []
    for i, (plen, mt, arr) in enumerate(reqs):
        plen = min(plen, max_context - 1)
        requests.append(Request(f"q{i}", [rng.randrange(1, 512) for _ in range(plen)],
                                SamplingParams(max_tokens=mt, stop_at_eos=False),
                                arrival_step=arr))
    seen = drive(eng, requests, [(k, f"q{j}") for k, j in cancels if j < len(reqs)])
    check_trace(eng, seen)
    for rid, rs in eng.requests.items():
        if rs.reason == "length":
            assert (len(rs.emitted) == rs.req.params.max_tokens
                    or rs.prompt_len + len(rs.emitted) - 1 >= max_context)


def test_trace_model_catches_a_wrong_window(model_dir):
    """The checker above can fail: a run whose pointer is tampered with is rejected."""
    eng = build_engine(model_dir, mode="batch", batch_mtp=False, slots=3, window_rows=2, spec=2)
    reqs = [Request(f"q{i}", [5 + i, 6, 7], SamplingParams(max_tokens=6, stop_at_eos=False))
            for i in range(3)]
    orig = eng.scheduler.ring.build

    def skewed(rows_of, w, *rest):
        taken = orig(rows_of, w, *rest)
        eng.scheduler.ring.pointer = eng.scheduler.ring.members[0]  # always restart at the front
        return taken

    eng.scheduler.ring.build = skewed
    seen = drive(eng, reqs)
    with pytest.raises(AssertionError, match="starves|rules say"):
        check_trace(eng, seen)


# ---------------------------------------------------------------------------------------------
# State after decode equals a fresh recompute (no positional holes in the MTP KV)
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def recompute_kv(model, seq: list[int]):
    """K/V of the main full-attention layers and of the MTP layer over `seq`, no cache."""
    toks = torch.tensor([seq])
    captured = []
    attns = [layer.self_attn for layer in model.layers if layer.kind == "full_attention"]
    for a in attns:
        def wrap(x, cos, sin, _orig=a._qkv):
            out = _orig(x, cos, sin)
            captured.append((out[1][0], out[2][0]))
            return out
        a._qkv = wrap
    try:
        hidden = model.forward_train(toks)
    finally:
        for a in attns:
            del a._qkv
    x = model.mtp.fuse(hidden[:, :-1], model.embed_tokens(toks[:, 1:]))
    cos, sin = model.rotary(torch.arange(x.shape[1]), x.dtype)
    layer = model.mtp.layers[0]
    _, k, v, _ = layer.self_attn._qkv(layer.input_layernorm(x), cos, sin)
    return captured, (k[0], v[0])


@pytest.mark.parametrize("mode,spec,chunk", [("batch_mtp", 4, 4), ("solo", 4, 256),
                                             ("batch", 3, 3), ("batch_mtp", 2, 256)])
def test_committed_state_matches_recompute(echo_dir, mode, spec, chunk):
    eng = build_engine(echo_dir, mode="solo" if mode == "solo" else "batch",
                       batch_mtp=mode == "batch_mtp", slots=2, window_rows=4, spec=spec,
                       prefill_chunk=chunk)
    rng = random.Random(9)
    reqs = [Request(f"q{i}", [rng.randrange(1, 512) for _ in range(plen)],
                    SamplingParams(max_tokens=mt, stop_at_eos=False), arrival_step=arr)
            for i, (plen, mt, arr) in enumerate([(6, 9, 0), (9, 12, 0), (3, 10, 2), (11, 7, 3)])]
    snaps = {}
    for r in reqs:
        eng.add_request(r)
    lanes = {}
    while eng.has_work():
        eng.step()
        for s in eng.scheduler.slots:
            if s.req is not None:
                lanes[s.req.id] = s.id
        for ev in eng.trace.events:
            if ev["ev"] == "finish" and ev["step"] == eng.steps - 1 and ev["req"] not in snaps:
                lane = lanes[ev["req"]]
                rs = eng.requests[ev["req"]]
                pos = rs.prompt_len + len(rs.emitted) - 1  # committed positions
                st_ = eng.state
                snaps[ev["req"]] = (lane, pos, [(st_.k[j, lane, :pos].clone(), st_.v[j, lane, :pos].clone())
                                                for j in range(st_.k.shape[0])],
                                    (st_.mtp_k[lane, :pos].clone(), st_.mtp_v[lane, :pos].clone()))
    assert set(snaps) == {r.id for r in reqs}
    if mode != "batch":
        assert eng.accepted > 0  # accepted drafts commit several positions at once
    for r in reqs:
        rs = eng.requests[r.id]
        assert rs.reason == "length" and len(rs.emitted) == r.params.max_tokens
        lane, pos, main_kv, (mk, mv) = snaps[r.id]
        seq = (r.prompt_ids + rs.emitted)[: pos + 1]
        ref_main, (rk, rv) = recompute_kv(eng.model, seq)
        for (k, v), (ck, cv) in zip(main_kv, ref_main):
            torch.testing.assert_close(k, ck[:pos], atol=2e-4, rtol=1e-3)
            torch.testing.assert_close(v, cv[:pos], atol=2e-4, rtol=1e-3)
        assert rk.shape[0] == pos
        torch.testing.assert_close(mk, rk, atol=2e-4, rtol=1e-3,
                                   msg=lambda m: f"{r.id}: MTP K differs from recompute: {m}")
        torch.testing.assert_close(mv, rv, atol=2e-4, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# Cancel frees the slot at once
# ---------------------------------------------------------------------------------------------

def test_cancel_frees_slot_for_same_iteration_admission(model_dir):
    eng = build_engine(model_dir, mode="batch", batch_mtp=True, slots=2)
    reqs = [Request(f"c{i}", [3 + i, 9, 27, 81], SamplingParams(max_tokens=12, stop_at_eos=False))
            for i in range(3)]
    for r in reqs:
        eng.add_request(r)
    while not all(s.phase == "decode" for s in eng.scheduler.slots):
        eng.step()
    assert eng.requests["c2"].slot is None  # queued
    victim = eng.scheduler.slots[0].req.id
    k = eng.steps
    eng.cancel(victim)
    eng.step()
    evs = [ev for ev in eng.trace.events if ev["step"] == k]
    names = [(ev["ev"], ev.get("req")) for ev in evs]
    assert ("finish", victim) in names and ("admit", "c2") in names
    assert names.index(("finish", victim)) < names.index(("admit", "c2"))
    fin = next(ev for ev in evs if ev["ev"] == "finish")
    assert fin["reason"] == "cancel" and fin["tokens"] == len(eng.requests[victim].emitted)
    assert next(ev for ev in evs if ev["ev"] == "admit")["slot"] == 0
    assert eng.requests[victim].reason == "cancel"
    emitted_at_cancel = len(eng.requests[victim].emitted)
    while eng.has_work():
        eng.step()
    assert len(eng.requests[victim].emitted) == emitted_at_cancel  # nothing after the cancel
    # the request admitted into the cancelled slot decodes exactly as it does alone
    alone = build_engine(model_dir, mode="batch", batch_mtp=True, slots=2)
    alone.add_request(Request("c2", list(reqs[2].prompt_ids), SamplingParams(max_tokens=12, stop_at_eos=False)))
    while alone.has_work():
        alone.step()
    assert eng.requests["c2"].emitted == alone.requests["c2"].emitted
    assert eng.requests["c2"].reason == "length"


def test_cancel_queued_and_prefilling_requests(model_dir):
    eng = build_engine(model_dir, mode="batch", batch_mtp=True, slots=1, prefill_chunk=2)
    eng.add_request(Request("p", list(range(1, 11)), SamplingParams(max_tokens=4)))
    eng.add_request(Request("q", [4, 5], SamplingParams(max_tokens=4)))
    eng.add_request(Request("r", [6, 7, 8], SamplingParams(max_tokens=3, stop_at_eos=False)))
    eng.step()  # p admitted, first prefill chunk; q and r queued
    assert eng.scheduler.slots[0].phase == "prefill"
    eng.cancel("p")
    eng.cancel("q")
    eng.step()
    for rid in ("p", "q"):
        assert eng.requests[rid].reason == "cancel"
        assert eng.requests[rid].emitted == []
    # the slot p held was freed by the cancel and taken by r in the same iteration
    admits = [ev for ev in eng.trace.events if ev["ev"] == "admit" and ev["step"] == 1]
    assert [(ev["req"], ev["slot"]) for ev in admits] == [("r", 0)]
    while eng.has_work():
        eng.step()
    assert eng.requests["r"].reason == "length" and len(eng.requests["r"].emitted) == 3
    reasons = sorted((ev["req"], ev["reason"]) for ev in eng.trace.events if ev["ev"] == "finish")
    assert reasons == [("p", "cancel"), ("q", "cancel"), ("r", "length")]


@pytest.mark.parametrize("arrival", [{"arrival_step": 10_000}, {"arrival_s": 3600.0}])
def test_cancelled_future_request_leaves_no_work(model_dir, arrival):
    """A request cancelled before its arrival finishes at once and leaves nothing to wait for:
    `while engine.has_work(): engine.step()` (strata.runner) must not keep stepping (or, for
    arrival_s, sleeping) until the cancelled request's arrival time."""
    eng = build_engine(model_dir, mode="batch", slots=1)
    eng.add_request(Request("f", [4, 5], SamplingParams(max_tokens=4), **arrival))
    eng.cancel("f")
    eng.step()
    assert eng.requests["f"].reason == "cancel"
    assert [ev["ev"] for ev in eng.trace.events if ev.get("req") == "f"] == ["finish"]
    assert not eng.has_work(), "a cancelled future request keeps the engine busy until it arrives"
