"""Edge and bad input found by fuzzing a live server (a second reliability audit): each case
once gave a 500 or stalled the engine, and must now be a 400 naming the field, or be served
without holding up the other requests.

The parsing and encoder tests need no server; the end-to-end test starts one real server (CPU,
embedded tiny model) with test_server's helpers.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from strata.serve import protocol as P
from strata.serve.worker import THREAD_ENCODE_CHARS, _Encoder
from test_server import post, running

ASSETS = Path(__file__).resolve().parents[1] / "strata" / "assets" / "tiny-qwen3-next"


def _error(body: dict, kind: str = "completion") -> P.ApiError:
    with pytest.raises(P.ApiError) as e:
        P.parse_request(P.parse_json_body(json.dumps(body).encode()), kind)
    assert e.value.status == 400
    return e.value


# ---- a float field given an integer too large for a float (JSON allows 4300 digits): was a 500
# "internal server error: OverflowError: int too large to convert to float" (math.isfinite)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [10**400, -10**400], ids=["1e400", "-1e400"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_float_field_with_huge_int_is_400(field, value, kind):
    body = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "x"}]}
    e = _error({**body, field: value}, kind)
    assert e.param == field and "finite number" in e.message, e.body()
    assert str(value)[:20] in e.message


def test_float_fields_still_take_ints_and_floats():
    body = {"prompt": "x", "temperature": 2, "top_p": 1}
    r = P.parse_request(P.parse_json_body(json.dumps(body).encode()), "completion")
    assert (r.temperature, r.top_p) == (2.0, 1.0)


# ---- a long text prompt: the engine process encoded it inline, holding its step loop (about
# 1 s per MB here): every other stream froze, and no heartbeat went out, so with
# server.step_timeout_s below the encode time the engine was killed as hung


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("tokenizers")
    from strata.model.tokenizer import Tokenizer
    return Tokenizer.from_dir(ASSETS)


def test_thread_encoder_gives_the_tokenizers_ids(tokenizer):
    enc = _Encoder(tokenizer)
    for text in ["def f(x):\n    return x", "caf\u00e9 \U0001F600 <|endoftext|> \x00 end",
                 "-" * 5000, " " * 3000 + "\n\n\t"]:
        assert tokenizer.encode_nogil(text) == tokenizer.encode(text), text[:20]
    long = "a" * (THREAD_ENCODE_CHARS + 1)
    assert enc.wants({"prompt": long, "prompt_ids": None})
    assert not enc.wants({"prompt": long[:THREAD_ENCODE_CHARS], "prompt_ids": None})
    assert not enc.wants({"prompt": None, "prompt_ids": [1] * (THREAD_ENCODE_CHARS + 1)})
    assert not _Encoder(None).wants({"prompt": long, "prompt_ids": None})   # no tokenizer


def test_thread_encoder_reports_each_prompt_once_with_its_cancel(tokenizer):
    enc = _Encoder(tokenizer)
    enc.start("a", {"prompt": "x " * 40000})
    enc.start("b", {"prompt": "y " * 40000})
    assert enc.cancel("b") and not enc.cancel("zzz")
    got: dict = {}
    t_end = time.monotonic() + 60
    while enc.pending and time.monotonic() < t_end:
        for rid, spec, ids, cancelled in enc.finished():
            got[rid] = (ids, cancelled)
        time.sleep(0.01)
    assert set(got) == {"a", "b"} and not enc.pending and not enc.cancelled
    assert got["a"] == (tokenizer.encode("x " * 40000), False)
    assert got["b"][1] is True
    enc.pool.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a context that fits a prompt past THREAD_ENCODE_CHARS; a heartbeat watchdog shorter than
    # the encode time of the big prompt below
    yield from running(tmp_path_factory, "serve_fuzz", "engine.max_context=4096",
                       "server.step_timeout_s=4")


@pytest.mark.slow
def test_huge_text_prompt_does_not_stall_the_engine(server, tokenizer):
    s = server
    before = s.health().json()
    gaps: list[float] = []
    events: list = []
    big_done = threading.Event()

    def streamer():
        body = {"prompt": "def f():", "max_tokens": 4000, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.Client(timeout=60) as hc:
            with hc.stream("POST", s.base + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                last = None
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    if last is not None and not big_done.is_set():
                        gaps.append(now - last)
                    last = now
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if big_done.is_set() or data == "[DONE]":
                        break          # hang up: cancels the rest

    t = threading.Thread(target=streamer)
    t.start()
    s.wait_metric("strata_busy_slots", lambda v: v >= 1, timeout=20)
    t0 = time.monotonic()
    big = "hello world " * (12_000_000 // 12)     # ~12 MB: about 10 s to encode here
    r = post(s, "/v1/completions", {"prompt": big, "max_tokens": 2}, timeout=120)
    took = time.monotonic() - t0
    big_done.set()
    t.join(60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "leave no room" in err["message"], err
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
    assert len(gaps) >= 5 and max(gaps) < min(3.0, took / 2), (max(gaps), took)
    after = s.health().json()
    assert after["engine_pid"] == before["engine_pid"] and after["restarts"] == 0, after

    # a long prompt that fits takes the same path and is served (the same token count)
    dashes = "-" * (THREAD_ENCODE_CHARS + 5000)
    r = post(s, "/v1/completions", {"prompt": dashes, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(dashes))
    s.wait_metric("strata_requests_in_flight", lambda v: v == 0)
    s.wait_metric("strata_busy_slots", lambda v: v == 0)

    # the huge-int float fields over HTTP: 400, and the server serves on
    r = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                         "temperature": 10**400, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = post(s, "/v1/completions", {"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
