"""Warnings, config errors, stop conditions, request validation and fault isolation.

DESIGN.md section 3 (batch_mtp off conditions: one WARNING line, serve anyway), section 4 (stop
conditions cut the emitted tokens), SCHEDULING.md (Commit; prefill ends at once on
max_tokens=1), strata/engine/request.py (RequestError names the field) and llm_engine.step
(an engine fault fails only the requests it touched).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from strata.config import ConfigError
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, RequestError, SamplingParams
from strata.model.tiny import make_tiny_random
from conftest import cpu_engine_config

torch.set_num_threads(1)

WARN = "WARNING: batch_mtp is off: "


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("STRATA_BATCH_MTP", raising=False)


@pytest.fixture(scope="session")
def tok_model(tmp_path_factory):
    """Tiny random model with a tokenizer (stop strings need text)."""
    return make_tiny_random(tmp_path_factory.mktemp("warn-tok"), seed=0)


@pytest.fixture(scope="session")
def no_mtp_model(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("warn-nomtp"), seed=0, with_mtp=False,
                            tokenizer=False)


def make_cfg(model_dir, **knobs):
    return cpu_engine_config(model_dir, **knobs)


def build(model_dir, **knobs):
    logs: list[str] = []
    eng = Engine.from_config(make_cfg(model_dir, **knobs), log=logs.append)
    eng.logs = logs
    return eng


def serve(eng, requests, max_steps=2000):
    outs = []
    for r in requests:
        eng.add_request(r)
    for _ in range(max_steps):
        if not eng.has_work():
            break
        outs.extend(eng.step())
    assert not eng.has_work()
    return outs


def reqs(n=3, max_tokens=6, **params):
    return [Request(f"w{i}", [11 + i, 40, 97, 200 + i], SamplingParams(max_tokens=max_tokens, **params),
                    arrival_step=i) for i in range(n)]


def windows(eng):
    return [ev for ev in eng.trace.events if ev["ev"] == "window"]


# ---------------------------------------------------------------------------------------------
# batch_mtp off: one warning line, and the engine still serves
# ---------------------------------------------------------------------------------------------

def check_off_and_serving(eng, reason_words):
    lines = [s for s in eng.logs if s.startswith("WARNING")]
    off = [s for s in lines if s.startswith(WARN)]
    assert len(off) == 1, f"expected one batch_mtp-off warning, got {lines}"
    assert all(w in off[0] for w in reason_words), off[0]
    assert not eng.batch_mtp
    serve(eng, reqs(3, stop_at_eos=False))
    for rs in eng.requests.values():
        assert rs.reason == "length" and len(rs.emitted) == 6
    # still exactly once after serving, in the log and in the trace
    assert len([s for s in eng.logs if s.startswith(WARN)]) == 1
    warn_ev = [ev for ev in eng.trace.events if ev["ev"] == "warning"]
    assert [ev["text"].startswith("batch_mtp is off: ") for ev in warn_ev] == [True]
    # batches as usual: one row per slot whenever two slots share a window
    for ev in windows(eng):
        if len(set(ev["layout"])) > 1:
            assert len(ev["layout"]) == len(set(ev["layout"]))


def test_spec_1_turns_batch_mtp_off_with_one_warning(tok_model):
    eng = build(tok_model, mode="batch", batch_mtp=True, spec=1)
    check_off_and_serving(eng, ["spec"])
    assert all(ev["rows"] == len(set(ev["layout"])) for ev in windows(eng))  # no drafts at all


def test_checkpoint_without_mtp_turns_batch_mtp_off_with_one_warning(no_mtp_model):
    eng = build(no_mtp_model, mode="batch", batch_mtp=True, spec=4)
    check_off_and_serving(eng, ["mtp"])


def test_warning_comes_after_the_config_trace_line(no_mtp_model):
    """SCHEDULING.md: the first trace line is `config` (a replay reads the knobs from it)."""
    eng = build(no_mtp_model, mode="batch", batch_mtp=True)
    assert eng.trace.events[0]["ev"] == "config"
    assert [ev["ev"] for ev in eng.trace.events[:2]] == ["config", "warning"]


def test_no_warning_when_batch_mtp_not_asked(no_mtp_model, tok_model):
    for model, knobs in ((no_mtp_model, dict(batch_mtp=False)), (tok_model, dict(batch_mtp=False, spec=1)),
                         (tok_model, dict(batch_mtp=True))):
        eng = build(model, **knobs)
        assert not [s for s in eng.logs if s.startswith("WARNING")], (knobs, eng.logs)


@pytest.mark.parametrize("env,cfg_value,expect", [("1", False, True), ("0", True, False),
                                                  ("", True, True), ("", False, False)])
def test_strata_batch_mtp_env(tok_model, monkeypatch, env, cfg_value, expect):
    monkeypatch.setenv("STRATA_BATCH_MTP", env)
    eng = build(tok_model, mode="batch", batch_mtp=cfg_value)
    assert eng.batch_mtp is expect
    cfg_ev = eng.trace.events[0]
    assert cfg_ev["ev"] == "config" and cfg_ev["engine"]["batch_mtp"] is expect
    if expect:  # really drafts in batch windows: 2-row groups once two slots decode
        serve(eng, reqs(2, max_tokens=8, stop_at_eos=False))
        assert any(ev["layout"].count(s) == 2 for ev in windows(eng) if len(set(ev["layout"])) > 1
                   for s in set(ev["layout"]))


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_strata_batch_mtp_env_bad_value_is_a_clear_error(tok_model, monkeypatch, value):
    monkeypatch.setenv("STRATA_BATCH_MTP", value)
    with pytest.raises(ConfigError, match="STRATA_BATCH_MTP") as exc:
        build(tok_model)
    assert repr(value) in str(exc.value) and "0 or 1" in str(exc.value)


def test_spec_above_window_rows_is_a_config_error_naming_both(tok_model):
    with pytest.raises(ConfigError) as exc:
        build(tok_model, spec=5, window_rows=4)
    msg = str(exc.value)
    assert "engine.spec" in msg and "engine.window_rows" in msg and "5" in msg and "4" in msg
    build(tok_model, spec=4, window_rows=4)  # equal is fine


# ---------------------------------------------------------------------------------------------
# Stop conditions
# ---------------------------------------------------------------------------------------------

PROMPT = "def read_config(path):\n    with open(path) as f:\n"
MODES = [dict(mode="solo"), dict(mode="batch", batch_mtp=False), dict(mode="batch", batch_mtp=True)]
MODE_IDS = ["solo", "batch", "batch_mtp"]


def baseline(model_dir, max_tokens=40, **knobs):
    eng = build(model_dir, **knobs)
    ids = eng.tokenizer.encode(PROMPT)
    serve(eng, [Request("b", ids, SamplingParams(max_tokens=max_tokens, stop_at_eos=False))])
    return eng, ids, eng.requests["b"].emitted


def pick_stop(tok, toks, n_tokens):
    """A stop string made of `n_tokens` whole tokens, whose first occurrence in the output text
    starts exactly at that token: returns (index of its first token, stop string)."""
    full = tok.decode(toks)
    for k in range(3, len(toks) - n_tokens):
        prefix = tok.decode(toks[:k])
        piece = tok.decode(toks[k:k + n_tokens])
        if ("\ufffd" in piece or len(piece.strip()) < 2
                or tok.decode(toks[:k + n_tokens]) != prefix + piece):
            continue
        if full.find(piece) == len(prefix):
            return k, piece
    pytest.fail("no usable stop string in the baseline output")


@pytest.mark.parametrize("knobs", MODES, ids=MODE_IDS)
def test_single_token_stop_string_cuts_output(tok_model, knobs):
    eng0, ids, base = baseline(tok_model, **knobs)
    tok = eng0.tokenizer
    k, stop = pick_stop(tok, base, 1)
    eng = build(tok_model, **knobs)
    outs = serve(eng, [Request("s", ids, SamplingParams(max_tokens=40, stop=[stop], stop_at_eos=False))])
    rs = eng.requests["s"]
    assert rs.reason == "stop"
    assert rs.emitted == base[:k], "tokens past (or of) the stop string were emitted"
    text = eng.final_text(rs)
    assert stop not in text and text == tok.decode(base[:k])
    streamed = [t for o in outs if o.id == "s" for t in o.new_token_ids]
    assert streamed == base[:k]
    fin = [ev for ev in eng.trace.events if ev["ev"] == "finish"]
    assert fin[-1]["reason"] == "stop" and fin[-1]["tokens"] == k


@pytest.mark.parametrize("knobs", MODES, ids=MODE_IDS)
def test_multi_token_stop_string_never_streams_its_text(tok_model, knobs):
    """A stop string spanning two tokens: the text is cut before it, the token that completes
    it is not emitted, and the streamed text equals the final text (no part of the stop string
    is streamed and then taken back)."""
    eng0, ids, base = baseline(tok_model, **knobs)
    tok = eng0.tokenizer
    k, stop = pick_stop(tok, base, 2)
    eng = build(tok_model, **knobs)
    outs = serve(eng, [Request("s", ids, SamplingParams(max_tokens=40, stop=[stop], stop_at_eos=False))])
    rs = eng.requests["s"]
    assert rs.reason == "stop"
    final = eng.final_text(rs)
    assert final == tok.decode(base[:k]) and stop not in final
    assert rs.emitted == base[: len(rs.emitted)] and len(rs.emitted) <= k + 1
    streamed_text = "".join(o.new_text for o in outs if o.id == "s")
    assert stop not in streamed_text
    assert streamed_text == final, "streamed text differs from the final text"


@pytest.mark.parametrize("knobs", MODES, ids=MODE_IDS)
def test_eos_cuts_output(tok_model, tmp_path, knobs):
    _, ids, base = baseline(tok_model, max_tokens=20, **knobs)
    # an EOS id that the model produces at output index k (first occurrence)
    k = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    eos_dir = tmp_path / "eos-model"
    shutil.copytree(tok_model, eos_dir)
    cfg = json.loads((eos_dir / "config.json").read_text())
    cfg["eos_token_id"] = base[k]
    (eos_dir / "config.json").write_text(json.dumps(cfg))
    eng = build(eos_dir, **knobs)
    serve(eng, [Request("e", ids, SamplingParams(max_tokens=20)),
                Request("n", ids, SamplingParams(max_tokens=20, stop_at_eos=False))])
    assert eng.requests["e"].reason == "stop"
    assert eng.requests["e"].emitted == base[:k], "the EOS token or tokens after it were emitted"
    assert eng.requests["n"].emitted == base and eng.requests["n"].reason == "length"


def force_drafts(eng, ref: dict):
    """Every MTP draft becomes the token the target produces at that position (from `ref`, the
    request's unforced output): drafts are accepted, so a whole group commits at once."""
    orig = eng.verifier._draft

    def forced(logits, gs, before, *rest):  # a draft sits at position before + 1
        out = orig(logits, gs, before, *rest).clone()
        for i, (lane, p) in enumerate(zip(gs.tolist(), (before + 1).tolist())):
            slot = eng.scheduler.slots[lane] if lane < len(eng.scheduler.slots) else None
            if slot is None or slot.req is None or slot.req.id not in ref:
                continue
            k = p - slot.req.prompt_len
            if 0 <= k < len(ref[slot.req.id]):
                out[i] = ref[slot.req.id][k]
        return out

    eng.verifier._draft = forced


@pytest.mark.parametrize("knobs", [MODES[0], MODES[2]], ids=["solo", "batch_mtp"])
@pytest.mark.parametrize("cut", ["eos", "stop"])
def test_stop_inside_an_accepted_group(tok_model, tmp_path, knobs, cut):
    """When the stop (EOS id or stop string) is an accepted draft, the tokens after it in the
    same commit are not emitted."""
    _, ids, base = baseline(tok_model, max_tokens=24, **knobs)
    tok = build(tok_model).tokenizer
    cut_inside = 0
    for k in range(3, 9):  # several stop positions: some land on drafts inside a group
        if cut == "eos":
            if base[k] in base[:k]:
                continue
            model = tmp_path / f"eos{k}"
            shutil.copytree(tok_model, model)
            cfg = json.loads((model / "config.json").read_text())
            cfg["eos_token_id"] = base[k]
            (model / "config.json").write_text(json.dumps(cfg))
            params = SamplingParams(max_tokens=24)
            want = base[:k]
        else:
            piece = tok.decode([base[k]])
            full = tok.decode(base)
            prefix = tok.decode(base[:k])
            if ("\ufffd" in piece or len(piece.strip()) < 2 or full.find(piece) != len(prefix)
                    or tok.decode(base[:k + 1]) != prefix + piece):
                continue
            model = tok_model
            params = SamplingParams(max_tokens=24, stop=[piece], stop_at_eos=False)
            want = base[:k]
        eng = build(model, **knobs)
        force_drafts(eng, {"c": base})
        serve(eng, [Request("c", ids, params)])
        rs = eng.requests["c"]
        assert rs.reason == "stop" and rs.emitted == want, (k, rs.emitted, want)
        last = [ev for ev in eng.trace.events if ev["ev"] == "commit"][-1]
        assert last["emitted"] <= last["accepted"]  # the commit was cut
        cut_inside += last["accepted"] > last["emitted"]
    assert cut_inside, "no stop fell on an accepted draft with tokens after it"


@pytest.mark.parametrize("knobs", MODES, ids=MODE_IDS)
def test_max_tokens_1(tok_model, knobs):
    eng = build(tok_model, **knobs)
    serve(eng, [Request("one", [5, 6, 7], SamplingParams(max_tokens=1, stop_at_eos=False)),
                Request("two", [5, 6, 8], SamplingParams(max_tokens=2, stop_at_eos=False))])
    assert len(eng.requests["one"].emitted) == 1 and eng.requests["one"].reason == "length"
    assert len(eng.requests["two"].emitted) == 2
    # it finishes at its prefill: never in a window, one finish event with 1 token
    assert not [ev for ev in eng.trace.events if ev["ev"] == "commit" and ev["req"] == "one"]
    fin = [ev for ev in eng.trace.events if ev["ev"] == "finish" and ev["req"] == "one"]
    assert len(fin) == 1 and fin[0]["tokens"] == 1 and fin[0]["reason"] == "length"
    pre = [ev for ev in eng.trace.events if ev["ev"] == "prefill" and ev["req"] == "one"]
    assert fin[0]["step"] == pre[-1]["step"]


@pytest.mark.parametrize("knobs", MODES, ids=MODE_IDS)
def test_prompt_of_max_context_minus_one(tok_model, knobs):
    max_context = 24
    eng = build(tok_model, max_context=max_context, **knobs)
    seen = []
    orig = eng.runner.decode
    eng.runner.decode = lambda groups, *a, **k: (seen.extend(groups), orig(groups, *a, **k))[1]
    serve(eng, [Request("full", list(range(1, max_context)), SamplingParams(max_tokens=10, stop_at_eos=False)),
                Request("near", list(range(3, max_context - 2)), SamplingParams(max_tokens=10, stop_at_eos=False))])
    full, near = eng.requests["full"], eng.requests["near"]
    # SCHEDULING.md: the first token sits at position max_context-1; one 1-row window runs it
    # (rows = min(base, left, max_context - pos)) and pos reaches max_context: length.
    assert full.reason == "length" and len(full.emitted) == 2
    assert near.reason == "length" and len(near.emitted) == max_context - near.prompt_len + 1
    for lane, pos, rows in seen:
        assert pos + rows <= max_context, "a window row ran past the context"
    assert eng.requests["full"].prompt_len == max_context - 1
    with pytest.raises(RequestError) as exc:
        eng.add_request(Request("over", list(range(1, max_context + 1)), SamplingParams()))
    assert exc.value.field == "prompt"


# ---------------------------------------------------------------------------------------------
# Request validation
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eng_small(tok_model):
    return build(tok_model, max_context=32)


@pytest.mark.parametrize("prompt,field", [
    ([], "prompt"),
    (list(range(1, 33)), "prompt"),  # 32 tokens: no room in a context of 32
    ([1, -1, 2], "prompt"),
    ([1, 512], "prompt"),
    ([1, 2.0], "prompt"),
    ([True, 3], "prompt"),
    ("hello", "prompt"),
])
def test_bad_prompts_raise_request_error(eng_small, prompt, field):
    with pytest.raises(RequestError) as exc:
        eng_small.add_request(Request("x", prompt, SamplingParams()))
    assert exc.value.field in (field, "prompt_ids")
    assert "x" not in eng_small.requests  # nothing was queued


@pytest.mark.parametrize("params,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop="abc"), "stop"),
])
def test_bad_sampling_params_raise_request_error(eng_small, params, field):
    with pytest.raises(RequestError) as exc:
        eng_small.add_request(Request("x", [1, 2, 3], SamplingParams(**params)))
    assert exc.value.field == field
    assert field in str(exc.value)
    assert "x" not in eng_small.requests


def test_bad_request_fields(eng_small):
    for rid in ("", None):
        with pytest.raises(RequestError) as exc:
            eng_small.add_request(Request(rid, [1, 2], SamplingParams()))
        assert exc.value.field == "id"
    with pytest.raises(RequestError) as exc:
        eng_small.add_request(Request("y", [1, 2], SamplingParams(), arrival_step=-1))
    assert exc.value.field == "arrival_step"
    with pytest.raises(RequestError) as exc:
        eng_small.add_request(Request("y", [1, 2], SamplingParams(), arrival_s=-0.5))
    assert exc.value.field == "arrival_s"
    eng_small.add_request(Request("dup", [1, 2], SamplingParams(max_tokens=1)))
    with pytest.raises(RequestError) as exc:
        eng_small.add_request(Request("dup", [1, 2], SamplingParams()))
    assert exc.value.field == "id"
    # the engine still serves after rejecting bad requests
    serve(eng_small, [])
    assert eng_small.requests["dup"].reason in ("length", "stop")


# ---------------------------------------------------------------------------------------------
# Engine faults fail only the touched requests
# ---------------------------------------------------------------------------------------------

def fault_once(obj, name, when=lambda *a: True):
    orig = getattr(obj, name)
    state = {"fired": 0}

    def wrapper(*a, **k):
        if not state["fired"] and when(*a):
            state["fired"] = 1
            raise RuntimeError("injected device fault")
        return orig(*a, **k)

    setattr(obj, name, wrapper)
    return state


def fault_run(model_dir, inject, **knobs):
    eng = build(model_dir, mode="batch", batch_mtp=True, slots=4, window_rows=4, **knobs)
    state = inject(eng) if inject else None
    rs = [Request(f"f{i}", [30 + i, 31, 32, 33 + i], SamplingParams(max_tokens=10, stop_at_eos=False),
                  arrival_step=0 if i < 4 else 12) for i in range(6)]
    outs = serve(eng, rs)
    return eng, outs, state


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_fault_fails_only_the_window_requests(tok_model, graphs):
    ref, _, _ = fault_run(tok_model, None, graphs=graphs)
    # fault in the first window that holds two groups, once all four slots decode
    eng, outs, state = fault_run(
        tok_model,
        lambda e: fault_once(e.verifier, "window",
                             when=lambda gs, gp, rows, g, ctx, filtered: e.steps >= 8 and len(gs) >= 2),
        graphs=graphs)
    assert state["fired"]
    errs = {rid for rid, rs in eng.requests.items() if rs.reason == "error"}
    assert 1 <= len(errs) <= 2  # window_rows=4 and 2-row groups: at most two slots per window
    assert any("ERROR" in s and "injected device fault" in s for s in eng.logs)
    for rid in errs:
        rs = eng.requests[rid]
        assert "injected device fault" in rs.error
        fin = [ev for ev in eng.trace.events if ev["ev"] == "finish" and ev["req"] == rid]
        assert len(fin) == 1 and fin[0]["reason"] == "error" and fin[0]["tokens"] == len(rs.emitted)
        assert rs.emitted == ref.requests[rid].emitted[: len(rs.emitted)]
    err_outs = [o for o in outs if o.finish_reason == "error"]
    assert {o.id for o in err_outs} == errs and all(o.error for o in err_outs)
    # everyone else, including the requests that arrive after the fault, is served exactly
    for rid, rs in eng.requests.items():
        if rid not in errs:
            assert rs.reason == "length"
            assert rs.emitted == ref.requests[rid].emitted, rid
    if graphs:
        ev = [e for e in eng.trace.events if e["ev"] == "evict" and e["reason"] == "error"]
        assert len(ev) <= 1  # a failed replay drops its graph; a failed capture never stored one


def test_prefill_fault_fails_only_that_request(tok_model):
    # one slot a chunk (a fault in a chunk of several fails the requests it holds)
    ref, _, _ = fault_run(tok_model, None, prefill_slots=1)
    eng, outs, state = fault_run(
        tok_model, lambda e: fault_once(e.verifier, "prefill", when=lambda tokens, meta, ctx, *_: int(meta[0]) == 2),
        prefill_slots=1)
    assert state["fired"]
    errs = {rid for rid, rs in eng.requests.items() if rs.reason == "error"}
    assert errs == {"f2"}
    assert eng.requests["f2"].emitted == []
    for rid, rs in eng.requests.items():
        if rid != "f2":
            assert rs.emitted == ref.requests[rid].emitted and rs.reason == "length"
    # the freed slot was reused by a later request
    admits = [(ev["req"], ev["slot"]) for ev in eng.trace.events if ev["ev"] == "admit"]
    assert ("f4", 2) in admits or ("f5", 2) in admits


@pytest.mark.parametrize("overlap", [False, True])
def test_admission_fault_fails_only_the_admitted_requests(tok_model, overlap):
    """A fault while binding admitted requests to their lanes (their parameters and prompts to
    the device: out of device memory, say) fails those requests and frees their slots; the
    requests already decoding and the later ones are served exactly, and the engine lives."""
    ref, _, _ = fault_run(tok_model, None, overlap=overlap)
    # the burst at step 12: f4 and f5 are bound together once two slots are free
    eng, outs, state = fault_run(
        tok_model, lambda e: fault_once(e.runner, "bind_lanes",
                                        when=lambda slots: any(s.req.req.id == "f4" for s in slots)),
        overlap=overlap)
    assert state["fired"]
    errs = {rid for rid, rs in eng.requests.items() if rs.reason == "error"}
    assert "f4" in errs and errs <= {"f4", "f5"}
    for rid in errs:
        assert "engine fault in admission" in eng.requests[rid].error
        assert "injected device fault" in eng.requests[rid].error
        assert eng.requests[rid].emitted == []
    assert {o.id for o in outs if o.finish_reason == "error"} == errs
    for rid, rs in eng.requests.items():
        if rid not in errs:
            assert rs.reason == "length" and rs.emitted == ref.requests[rid].emitted, rid
    assert not eng.has_work() and all(s.req is None for s in eng.scheduler.slots)


def test_replay_fault_evicts_the_graph_and_keeps_serving(tok_model):
    """A fault while replaying a cached graph drops that graph (evict reason=error)."""
    def inject(e):
        replaying = {"now": False}
        orig_replay = e.cache.backend.replay

        def replay(handle):  # a hit replays the graph the cache holds
            replaying["now"] = True
            try:
                return orig_replay(handle)
            finally:
                replaying["now"] = False

        e.cache.backend.replay = replay
        return fault_once(e.verifier, "window", when=lambda *a: replaying["now"])
    eng, outs, state = fault_run(tok_model, inject, graphs=True)
    assert state["fired"]
    ev = [x for x in eng.trace.events if x["ev"] == "evict" and x["reason"] == "error"]
    assert len(ev) == 1
    assert sum(rs.reason == "error" for rs in eng.requests.values()) >= 1
    assert sum(rs.reason == "length" for rs in eng.requests.values()) >= 4
