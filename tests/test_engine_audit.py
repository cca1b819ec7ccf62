"""A reliability audit of the engine's request lifecycle and fault handling (the engine's Python
API, and the server's knobs): no crash, no hung or silently lost request, and a clear error
naming the problem for every bad input. Each test of a defect failed before its fix; the rest
pin down edges the earlier audits (test_engine_warnings, test_engine_properties, test_overlap,
test_server_audit) did not reach: prompt chunks shared by several slots (engine.prefill_slots,
auto 8 on one device) under cancels and faults, with engine.overlap on and off.

CPU, the embedded tiny model in float32; every test takes a second or two.
"""

from __future__ import annotations

import random

import pytest
import torch
from omegaconf import OmegaConf

import strata.engine.postprocess as postprocess
from strata.config import EMBEDDED_MODEL_DIR, ConfigError, ServerConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import (TEMPERATURE_MAX, TEMPERATURE_MIN, Request, RequestError,
                                   SamplingParams)
from strata.model.tiny import make_tiny_random
from strata.serve import protocol as P
from strata.serve.server import validate_server
from conftest import cpu_engine_config


@pytest.fixture(scope="module", autouse=True)
def _one_thread(single_thread):
    pass


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("STRATA_BATCH_MTP", raising=False)


def build(model_dir=EMBEDDED_MODEL_DIR, max_context: int = 128, **knobs) -> Engine:
    cfg = cpu_engine_config(model_dir, max_context=max_context, **knobs)
    cfg.model.dtype = "float32"
    logs: list[str] = []
    eng = Engine.from_config(cfg, log=logs.append)
    eng.logs = logs
    return eng


def drive(eng: Engine, reqs=(), max_steps: int = 500) -> dict[str, list]:
    """Step until idle (bounded: a hang fails); checks that every request's streamed tokens
    are the ones it kept and that it has exactly one final output; returns its outputs."""
    for r in reqs:
        eng.add_request(r)
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not eng.has_work():
            break
        for o in eng.step():
            assert not (outs.get(o.id) and outs[o.id][-1].finished), f"{o.id}: output after its end"
            outs.setdefault(o.id, []).append(o)
    assert not eng.has_work(), f"the engine still has work after {max_steps} steps (hung)"
    for rid, rs in eng.requests.items():
        if rid in outs:
            assert [t for o in outs[rid] for t in o.new_token_ids] == rs.emitted, rid
            assert [o.finished for o in outs[rid]].count(True) == 1, rid
            assert outs[rid][-1].finish_reason == rs.reason, rid
    assert all(s.req is None for s in eng.scheduler.slots), "a slot still holds a request"
    return outs


def prompt(i: int, n: int = 20) -> list[int]:
    return [random.Random(i).randrange(1, 4000) for _ in range(n)]


def alone(rid: str, ids: list[int], params: SamplingParams) -> list[int]:
    eng = build(mode="batch", slots=1, overlap=False)
    drive(eng, [Request(rid, list(ids), params)])
    return eng.requests[rid].emitted


# ---------------------------------------------------------------------------------------------
# Defect: a positive temperature too small (or too large) for the float32 sampler. At 1e-38 the
# sort-free sampler's logits / T overflowed to +-inf and it picked the lowest token id of
# positive logit (token 1, again and again), while the filtering sampler picked the greedy
# token: a request's tokens depended on whether another request of its window used top-k.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [1e-38, 1e-45, 1e-31, 1e31, 3.5e38, 1e300])
def test_temperature_the_sampler_cannot_divide_by_is_refused(t):
    eng = build(mode="batch", slots=1)
    with pytest.raises(RequestError) as exc:
        eng.add_request(Request("t", [5, 6, 7], SamplingParams(temperature=t)))
    assert exc.value.field == "temperature" and repr(t) in str(exc.value), str(exc.value)
    assert "t" not in eng.requests
    with pytest.raises(P.ApiError) as api:  # the server's 400 names the field too
        P.parse_request({"prompt": "x", "temperature": t}, "completion")
    assert api.value.status == 400 and api.value.param == "temperature", api.value.body()


def test_temperature_at_its_bounds_runs_the_same_in_either_sampler():
    """At TEMPERATURE_MIN a request samples what greedy picks, alone (the sort-free sampler) and
    beside a top-k request (its windows run the filtering sampler); TEMPERATURE_MAX runs."""
    greedy = alone("g", prompt(1), SamplingParams(max_tokens=8, stop_at_eos=False))
    tiny = SamplingParams(max_tokens=8, temperature=TEMPERATURE_MIN, seed=3, stop_at_eos=False)
    assert alone("a", prompt(1), tiny) == greedy
    eng = build(mode="batch", slots=2, overlap=False)
    drive(eng, [Request("a", prompt(1), tiny),
                Request("k", prompt(2), SamplingParams(max_tokens=8, temperature=0.8, top_k=5,
                                                       stop_at_eos=False))])
    windows = [ev for ev in eng.trace.events if ev["ev"] == "window" and len(ev["layout"]) > 1]
    assert windows, "the two requests never shared a window"
    assert eng.requests["a"].emitted == greedy
    hot = SamplingParams(max_tokens=4, temperature=TEMPERATURE_MAX, stop_at_eos=False)
    assert len(alone("h", prompt(1), hot)) == 4


# ---------------------------------------------------------------------------------------------
# Defect: request fields of the wrong type. A tuple prompt was refused as "is empty"; params
# that were not SamplingParams raised AttributeError; a truthy non-bool stop_at_eos ("false")
# silently meant True, and a falsy one (None) silently turned EOS off.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make,field,needle", [
    (lambda: Request("x", (5, 6, 7)), "prompt", "must be a list of token ids, got tuple"),
    (lambda: Request("x", [5, 6], params=None), "params", "SamplingParams, got NoneType"),
    (lambda: Request("x", [5, 6], params={"max_tokens": 3}), "params", "got dict"),
    (lambda: Request("x", [5, 6], SamplingParams(stop_at_eos="false")), "stop_at_eos", "'false'"),
    (lambda: Request("x", [5, 6], SamplingParams(stop_at_eos=None)), "stop_at_eos", "None"),
    (lambda: Request("x", [5, 6], stream_text=1), "stream_text", "1"),
])
def test_request_fields_of_the_wrong_type_are_named(make, field, needle):
    eng = build(mode="batch", slots=1)
    with pytest.raises(RequestError) as exc:
        eng.add_request(make())
    assert exc.value.field == field and needle in str(exc.value), str(exc.value)
    assert not eng.requests
    drive(eng, [Request("ok", [5, 6], SamplingParams(max_tokens=2))])  # and it still serves
    assert eng.requests["ok"].reason in ("length", "stop")


# ---------------------------------------------------------------------------------------------
# Defect: stop strings on a checkpoint without tokenizer.json were accepted and never matched
# (the engine matches them on decoded text and had no decoder): the request ran to max_tokens.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("audit-notok"), seed=0, tokenizer=False)


def test_stop_strings_without_a_tokenizer_are_refused(no_tokenizer):
    eng = build(no_tokenizer, max_context=64, mode="batch", slots=1)
    assert eng.tokenizer is None
    with pytest.raises(RequestError) as exc:
        eng.add_request(Request("s", [1, 2, 3], SamplingParams(max_tokens=20, stop=["a"])))
    assert exc.value.field == "stop" and "tokenizer" in str(exc.value)
    drive(eng, [Request("n", [1, 2, 3], SamplingParams(max_tokens=4, stop_at_eos=False))])
    assert eng.requests["n"].reason == "length" and len(eng.requests["n"].emitted) == 4


def test_server_text_prompt_without_a_tokenizer_is_a_named_rejection(no_tokenizer):
    """The engine process's verdict: a text prompt (every chat request) on a checkpoint without
    tokenizer.json was Rejected(None, "AttributeError: 'NoneType' object has no attribute
    'encode'"); token ids still run, and stop strings with them are refused by name."""
    from strata.serve.messages import Accepted, Rejected
    from strata.serve.worker import _submit

    eng = build(no_tokenizer, max_context=64, mode="batch", slots=1)
    for body, kind in [({"prompt": "hi"}, "completion"),
                       ({"messages": [{"role": "user", "content": "hi"}]}, "chat")]:
        v = _submit(eng, "t", P.parse_request(body, kind).engine_spec())
        assert isinstance(v, Rejected) and v.field == "prompt" and "tokenizer" in v.message, v
    v = _submit(eng, "s", P.parse_request({"prompt": [1, 2], "stop": "x"}, "completion").engine_spec())
    assert isinstance(v, Rejected) and v.field == "stop", v
    v = _submit(eng, "i", P.parse_request({"prompt": [1, 2], "max_tokens": 3}, "completion").engine_spec())
    assert isinstance(v, Accepted), v
    drive(eng)
    assert eng.requests["i"].reason in ("length", "stop") and not eng.requests.keys() - {"i"}


# ---------------------------------------------------------------------------------------------
# Defect: a fault while committing a window. (1) Serial step: a request of the window that had
# just finished (max_tokens) kept its slot (the commit records finishes and frees slots after
# every group's emission; fail_touched skipped finished requests), so has_work() stayed True
# for ever and the slot was lost. (2) engine.overlap (on by default with one device): the
# commit of a landed window was outside the fault handling, so step() raised, the step's
# outputs were lost, and the window launched meanwhile was dropped unread while its requests
# went on (their host positions behind the device's).
# ---------------------------------------------------------------------------------------------

def fault_when(monkeypatch, pred):
    """Raise once in postprocess.emit (a commit's emission of one request's tokens) when
    pred(engine, request state) holds."""
    orig = postprocess.emit
    state = {"fired": 0}

    def emit(eng, rs, slot, tokens, outs):
        if not state["fired"] and pred(eng, rs):
            state["fired"] = 1
            raise RuntimeError("injected commit fault")
        return orig(eng, rs, slot, tokens, outs)

    monkeypatch.setattr(postprocess, "emit", emit)
    return state


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_commit_fault_after_a_finish_in_the_same_window_frees_every_slot(monkeypatch, overlap):
    eng = build(mode="batch", slots=2, prefill_chunk=8, overlap=overlap)
    # b's emission faults right after a finished in the same commit (a still holds its slot)
    state = fault_when(monkeypatch, lambda e, rs: rs.id == "b" and e.requests["a"].finished
                       and e.requests["a"].slot is not None)
    short = SamplingParams(max_tokens=3, stop_at_eos=False)
    outs = drive(eng, [Request("a", prompt(1), short),
                       Request("b", prompt(2), SamplingParams(max_tokens=20, stop_at_eos=False))])
    assert state["fired"]
    a, b = eng.requests["a"], eng.requests["b"]
    assert a.reason == "length" and len(a.emitted) == 3
    assert outs["a"][-1].timings is not None  # its finish recorded, once
    finishes = [ev for ev in eng.trace.events if ev["ev"] == "finish"]
    assert sorted(ev["req"] for ev in finishes) == ["a", "b"]
    assert b.reason == "error" and "injected commit fault" in b.error
    assert outs["b"][-1].error == b.error
    # the engine serves on, exactly (the freed lanes start afresh)
    drive(eng, [Request("c", prompt(3), short), Request("d", prompt(4), short)])
    assert eng.requests["c"].emitted == alone("c", prompt(3), short)
    assert eng.requests["d"].emitted == alone("d", prompt(4), short)


def test_overlapped_commit_fault_fails_the_window_and_the_engine_serves_on(monkeypatch):
    eng = build(mode="batch", slots=4, prefill_chunk=8, overlap=True)
    params = SamplingParams(max_tokens=10, stop_at_eos=False)
    state = fault_when(monkeypatch, lambda e, rs: e.windows >= 3)
    outs = drive(eng, [Request(f"r{i}", prompt(i), params) for i in range(4)])  # never raises
    assert state["fired"]
    errs = {rid for rid, rs in eng.requests.items() if rs.reason == "error"}
    assert errs and all("engine fault in decode" in eng.requests[r].error for r in errs)
    assert any("injected commit fault" in s for s in eng.logs if s.startswith("ERROR"))
    assert {rid for rid, o in outs.items() if o[-1].finish_reason == "error"} == errs
    drive(eng, [Request("next", prompt(9), params)])
    assert eng.requests["next"].emitted == alone("next", prompt(9), params)


# ---------------------------------------------------------------------------------------------
# Defect: server wait knobs that are infinite, too large to wait for, or NaN passed
# validate_server (only `< 0` was checked). server.restart_delay_s=inf: every Retry-After
# (/health while the model loads, 503s) raised OverflowError (a 500), and the supervisor
# thread died in Event.wait at the first restart, leaving the server "restarting" for ever.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["restart_delay_s", "step_timeout_s", "queue_timeout_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300])
def test_server_wait_knobs_must_be_finite(key, value):
    s = OmegaConf.structured(ServerConfig)
    setattr(s, key, value)
    with pytest.raises(ConfigError) as exc:
        validate_server(s)
    assert f"server.{key}" in str(exc.value), str(exc.value)
    validate_server(OmegaConf.structured(ServerConfig))  # the defaults pass


# ---------------------------------------------------------------------------------------------
# Checked and fine (no earlier test reached them): cancels and faults in a prompt chunk that
# several slots share, with engine.overlap on and off.
# ---------------------------------------------------------------------------------------------

def mixed(i: int) -> Request:
    return Request(f"r{i}", prompt(i, 20 + 3 * i),
                   SamplingParams(max_tokens=8, stop_at_eos=False, seed=i,
                                  temperature=0.8 if i % 2 else 0.0, top_k=30 if i % 3 == 0 else 0))


@pytest.fixture(scope="module")
def mixed_alone() -> dict[str, list[int]]:
    return {f"r{i}": alone(f"r{i}", mixed(i).prompt_ids, mixed(i).params) for i in range(6)}


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_cancels_in_a_shared_prompt_chunk_leave_the_others_exact(overlap, mixed_alone):
    eng = build(mode="batch", slots=4, prefill_chunk=8, overlap=overlap)
    for i in range(6):
        eng.add_request(mixed(i))
    early = eng.step()  # r0-r3 admitted, one chunk of four segments
    assert [ev.get("segments") for ev in eng.trace.events if ev["ev"] == "prefill"] == [4] * 4
    eng.cancel("r1")
    eng.cancel("r1")        # twice: one finish
    eng.cancel("nobody")    # unknown: nothing
    early += eng.step()
    eng.cancel("r2")        # its second chunk ran; r4 joined the chunk in r1's slot
    outs = drive(eng)
    assert [(o.id, o.finish_reason) for o in early if o.finished] == [("r1", "cancel")]
    assert eng.requests["r1"].reason == "cancel" and eng.requests["r1"].emitted == []
    assert eng.requests["r2"].reason == "cancel" and outs["r2"][-1].finished
    assert [ev["req"] for ev in eng.trace.events if ev["ev"] == "finish"].count("r1") == 1
    for rid, rs in eng.requests.items():
        if rid not in ("r1", "r2"):
            assert rs.reason == "length" and rs.emitted == mixed_alone[rid], rid
    eng.cancel("r0")        # finished: nothing
    assert not eng.has_work()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_fault_in_a_shared_prompt_chunk_fails_its_requests_only(monkeypatch, overlap, mixed_alone):
    eng = build(mode="batch", slots=4, prefill_chunk=8, overlap=overlap)
    orig, state = eng.verifier.prefill, {"fired": 0}

    def prefill(tokens, meta, ctx, filtered):
        if not state["fired"] and tokens.dim() == 2 and eng.steps == 1:  # the second chunk
            state["fired"] = 1
            raise RuntimeError("injected chunk fault")
        return orig(tokens, meta, ctx, filtered)

    monkeypatch.setattr(eng.verifier, "prefill", prefill)
    drive(eng, [mixed(i) for i in range(6)])
    assert state["fired"]
    for i in range(4):
        rs = eng.requests[f"r{i}"]
        assert rs.reason == "error" and rs.emitted == [] and "injected chunk fault" in rs.error
    for rid in ("r4", "r5"):  # admitted into the freed slots, served exactly
        assert eng.requests[rid].emitted == mixed_alone[rid]


def test_cancel_and_release_name_an_id_of_the_wrong_type():
    """(were TypeError: unhashable type, from the request table)"""
    eng = build(mode="batch", slots=1)
    for call in (eng.cancel, eng.release):
        with pytest.raises(RequestError) as exc:
            call(["x"])
        assert exc.value.field == "id" and "list" in str(exc.value)
    eng.cancel("unknown")  # an unknown id: nothing to do


def test_a_request_changed_after_it_was_added_runs_as_added():
    """The engine keeps its own copy of a validated prompt and stop list: an id past the
    vocabulary written into the caller's list afterwards never reaches the device."""
    ids = prompt(7)
    want = alone("r", ids, SamplingParams(max_tokens=6, stop_at_eos=False))
    eng = build(mode="batch", slots=1, overlap=False)
    mine = list(ids)
    params = SamplingParams(max_tokens=6, stop_at_eos=False)
    eng.add_request(Request("r", mine, params))
    mine[0] = 10 ** 9
    params.stop.append("")
    drive(eng)
    assert eng.requests["r"].emitted == want
