"""Bad input the server once mishandled (a reliability audit): each must be a 400 naming the
field and the value, never a 500, an engine crash or a silently accepted wrong type, and the
server must keep serving afterwards.

The parsing tests need no server; the end-to-end test starts one real server (CPU, embedded
tiny model; a few seconds) with test_server's helpers.
"""

from __future__ import annotations

import json

import pytest

from strata.engine.request import RequestError, SamplingParams
from strata.serve import protocol as P
from test_server import post, server  # noqa: F401 (server: the module's own live server)

MSG = [{"role": "user", "content": "hi"}]


def _parse(body: dict, kind: str = "completion") -> P.GenRequest:
    """The server's path: raw bytes (as a client encodes them) -> JSON -> validation."""
    return P.parse_request(P.parse_json_body(json.dumps(body).encode()), kind)


def _error(body: dict, kind: str = "completion") -> P.ApiError:
    with pytest.raises(P.ApiError) as e:
        _parse(body, kind)
    assert e.value.status == 400
    return e.value


# ---- an unpaired surrogate escape ("\ud800") in a string: was a 500 (model, echoed in the
# error) or an unclassified "TypeError: TextInputSequence must be str" (prompt, messages)


@pytest.mark.parametrize("body,kind,param", [
    ({"prompt": "ab\ud800c"}, "completion", "prompt"),
    ({"prompt": "x", "model": "\udc00"}, "completion", "model"),
    ({"prompt": "x", "stop": ["ok", "\ud800"]}, "completion", "stop[1]"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "chat", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}]}, "chat",
     "messages[0].content[0].text"),
])
def test_unpaired_surrogate_is_400_naming_the_field(body, kind, param):
    e = _error(body, kind)
    assert e.param == param and e.code == "invalid_unicode", e.body()
    assert f"'{param}'" in e.message and "surrogate" in e.message and "\\ud" in e.message
    json.dumps(e.body(), ensure_ascii=False).encode("utf-8")   # the error itself renders


def test_surrogate_pairs_and_escaped_backslashes_are_still_text():
    assert _parse({"prompt": "smile \U0001F600"}).prompt_text == "smile \U0001F600"  # \ud83d\ude00
    raw = b'{"prompt": "a \\\\ud800 literal"}'            # a backslash, then "ud800": plain text
    assert P.parse_request(P.parse_json_body(raw), "completion").prompt_text == "a \\ud800 literal"


# ---- a message role that is a list or an object: was a 500 (TypeError: unhashable type)


@pytest.mark.parametrize("role", [["user"], {"a": 1}])
def test_unhashable_role_is_400(role):
    e = _error({"messages": [{"role": role, "content": "x"}]}, "chat")
    assert e.param == "messages[0].role" and json.dumps(role) in e.message, e.body()


# ---- top_k past int64: the engine process died packing it (OverflowError) and every request
# in flight failed with it


@pytest.mark.parametrize("top_k", [2**63, 10**30])
def test_top_k_past_int64_is_rejected(top_k):
    with pytest.raises(RequestError) as re_:
        SamplingParams(top_k=top_k).validate()
    assert re_.value.field == "top_k"
    e = _error({"prompt": "x", "top_k": top_k})
    assert e.param == "top_k" and str(top_k) in e.message, e.body()
    SamplingParams(top_k=2**63 - 1).validate()          # the largest one the engine can take


# ---- wrong types accepted as the neutral value of an unsupported field (True == 1 in Python)


@pytest.mark.parametrize("field,value", [("n", True), ("best_of", True), ("top_logprobs", False),
                                         ("presence_penalty", False), ("echo", 0)])
def test_bool_is_not_a_neutral_number(field, value):
    e = _error({"prompt": "x", field: value})
    assert e.param == field and json.dumps(value) in e.message, e.body()


def test_neutral_values_still_accepted():
    _parse({"prompt": "x", "n": 1, "best_of": 1, "echo": False, "suffix": "", "logprobs": 0,
            "top_logprobs": 0, "logit_bias": {}, "presence_penalty": 0.0, "frequency_penalty": 0,
            "tools": [], "functions": [], "response_format": {"type": "text"}})
    _parse({"messages": MSG, "logprobs": False, "n": 1}, "chat")


def test_stream_options_errors_name_the_full_field():
    e = _error({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}})
    assert e.param == "stream_options.include_usage" and '"yes"' in e.message, e.body()


# ---- end to end: the same inputs against a real server, which keeps its engine and serves on


def test_bad_input_is_400_and_the_engine_survives(server):
    s = server
    before = s.health().json()
    cases = [
        ("/v1/completions", {"prompt": "x", "model": "\udc00"}, "model"),
        ("/v1/completions", {"prompt": "\ud800abc"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
         "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "x"}]},
         "messages[0].role"),
        ("/v1/completions", {"prompt": "x", "top_k": 2**63, "max_tokens": 2}, "top_k"),
        ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    ]
    for path, body, param in cases:
        r = post(s, path, body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    after = s.health().json()
    assert after["engine_pid"] == before["engine_pid"] and after["restarts"] == before["restarts"]
    r = post(s, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 3, "top_k": 2**62,
                                    "seed": 2**63 - 1}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
