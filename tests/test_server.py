"""The HTTP server, end to end: the real `python -m strata.serve` with the embedded tiny model.

Each server runs as a subprocess in its own session on a free loopback port (CPU, small
context). Every wait is bounded; a fixture's teardown stops its server (SIGINT, then SIGKILL of
the session it started). Extra overrides for every server: env STRATA_TEST_SERVE_OVERRIDES.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from strata.serve.metrics import parse_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CTX = 256           # engine.max_context of the test servers
START_TIMEOUT = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, run_dir: Path, *overrides: str):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = run_dir / "server.log"
        extra = os.environ.get("STRATA_TEST_SERVE_OVERRIDES", "").split()
        cmd = [sys.executable, "-m", "strata.serve", f"server.port={self.port}", "device=cpu",
               f"engine.max_context={CTX}", "server.restart_delay_s=0.5",
               f"hydra.run.dir={run_dir}", *overrides, *extra]
        self.log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def health(self) -> httpx.Response:
        return httpx.get(self.base + "/health", timeout=5)

    def wait_ready(self, timeout: float = START_TIMEOUT, not_pid: int | None = None) -> dict:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                r = self.health()
                if r.status_code == 200 and r.json()["engine_pid"] != not_pid:
                    return r.json()
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"server not ready after {timeout} s:\n{self.logs()}")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.base + "/metrics", timeout=5).text)

    def wait_metric(self, name: str, pred, timeout: float = 20.0) -> float:
        t_end = time.monotonic() + timeout
        v = None
        while time.monotonic() < t_end:
            v = self.metrics().get(name)
            if v is not None and pred(v):
                return v
            time.sleep(0.1)
        pytest.fail(f"{name} = {v} after {timeout} s:\n{self.logs()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:  # the session this test started: the server and its engine process
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)
        self.log.close()

    def assert_clean_log(self) -> None:
        """No handler crashed and nothing but the test's own SIGKILL took the engine down."""
        text = self.log_path.read_text(errors="replace")
        for bad in ("Exception in ASGI application", "internal error on", "Traceback"):
            assert bad not in text, f"{bad!r} in the server log:\n{text[-6000:]}"


def running(tmp_path_factory, name: str, *overrides: str):
    """A module fixture's server (yield from it): ready, then stopped, its log clean."""
    s = ServerProc(tmp_path_factory.mktemp(name), *overrides)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()
    s.assert_clean_log()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running(tmp_path_factory, "serve")


def client(server: ServerProc, key: str = "none") -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.base + "/v1", api_key=key, timeout=60, max_retries=0)


def post(server: ServerProc, path: str, body, timeout: float = 60, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **kw.pop("headers", {})}, **kw)


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
            if data == "[DONE]":
                break
    return events


# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_health_models_metrics(server):
    h = server.health().json()
    assert h["status"] == "ok" and h["engine_pid"] > 0 and h["max_context"] == CTX
    head = httpx.head(server.base + "/health", timeout=5)  # monitors probe with HEAD
    assert head.status_code == 200 and head.content == b""
    models = httpx.get(server.base + "/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == h["model"]
    m = server.metrics()
    for name in ("strata_up", "strata_busy_slots", "strata_output_tokens_per_second",
                 "strata_draft_acceptance_rate", "strata_graph_cache_entries",
                 "strata_graph_captures_total", "strata_graph_evictions_total"):
        assert name in m, name
    assert m["strata_up"] == 1
    assert httpx.get(server.base + "/nope", timeout=5).json()["error"]["message"]


@pytest.mark.slow
def test_openai_client_completions_and_chat(server):
    c = client(server)
    model = server.health().json()["model"]
    full = c.completions.create(model=model, prompt="def add(a, b):", max_tokens=8, temperature=0)
    assert full.usage.completion_tokens >= 1 and full.usage.prompt_tokens > 0
    assert full.choices[0].finish_reason in ("stop", "length")
    parts, reasons = [], []
    for ch in c.completions.create(model=model, prompt="def add(a, b):", max_tokens=8,
                                   temperature=0, stream=True):
        parts.append(ch.choices[0].text)
        reasons.append(ch.choices[0].finish_reason)
    assert "".join(parts) == full.choices[0].text    # greedy: streaming == non-streaming
    assert reasons[-1] == full.choices[0].finish_reason
    # a stop string cut from that output ends the same request just before it
    text = full.choices[0].text
    cut = next((i for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2]), None)
    if cut is not None:
        stop = text[cut:cut + 2]
        s = c.completions.create(model=model, prompt="def add(a, b):", max_tokens=8,
                                 temperature=0, stop=[stop])
        assert s.choices[0].text == text[:text.find(stop)]
        assert s.choices[0].finish_reason == "stop"

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    chat = c.chat.completions.create(model=full.model, messages=msgs, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    text, last = "", None
    stream = c.chat.completions.create(messages=msgs, max_tokens=6, temperature=0, stream=True,
                                       model=full.model, stream_options={"include_usage": True})
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            last = ch.choices[0].finish_reason or last
        else:
            assert ch.usage.completion_tokens == chat.usage.completion_tokens
    assert text == chat.choices[0].message.content and last == chat.choices[0].finish_reason

    # token-id prompt, seeded sampling is reproducible
    a = c.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0.8, seed=7)
    b = c.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0.8, seed=7)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == 4


@pytest.mark.slow
def test_sixteen_concurrent_clients(server):
    c = client(server)
    model = server.health().json()["model"]

    def one(i: int):
        prompt = f"# request {i}\nimport os\ndef f{i}(x):"
        if i % 2:
            n, reason = 0, None
            for ch in c.completions.create(model=model, prompt=prompt, max_tokens=4,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
                if ch.choices:
                    reason = ch.choices[0].finish_reason or reason
                else:
                    n = ch.usage.completion_tokens
            return n, reason
        r = c.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        return r.usage.completion_tokens, r.choices[0].finish_reason

    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(16), timeout=150))
    assert len(results) == 16
    for n, reason in results:
        assert 1 <= n <= 4 and reason in ("stop", "length")
    server.wait_metric("strata_busy_slots", lambda v: v == 0)


BAD = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', "malformed JSON", None),
    ("/v1/completions", b'[1, 2]', "JSON object", None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-17"}, "gpt-17", "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "positive integer", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "positive integer", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "positive integer", "max_tokens"),
    ("/v1/completions", {"prompt": list(range(1, CTX + 40))}, "context", "prompt"),
    ("/v1/completions", {"prompt": "def f(x): return x\n" * 200}, "context", "prompt"),
    ("/v1/completions", b'{"prompt": "caf\xe9 \xff"}', "UTF-8", None),
    ("/v1/completions", {"prompt": ""}, "empty", "prompt"),
    ("/v1/completions", {"prompt": []}, "empty", "prompt"),
    ("/v1/completions", {"prompt": [1, -2, 3]}, ">= 0", "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, "not in", "prompt"),
    ("/v1/completions", {"prompt": [1, 2.5]}, "integers", "prompt"),
    ("/v1/completions", {}, "required", "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, ">= 0", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "(0, 1]", "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 1.5}, "integer", "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed", "seed"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "non-empty", "stop"),
    ("/v1/completions", {"prompt": "x", "n": 3}, "not supported", "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "boolean", "stream"),
    ("/v1/chat/completions", {"messages": []}, "non-empty", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role",
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": -1}, "positive integer", "max_tokens"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path,body,needle,param", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_requests_are_400(server, path, body, needle, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.slow
def test_client_disconnect_frees_slot(server):
    before = server.metrics().get('strata_requests_total{outcome="cancel"}', 0)
    body = {"prompt": "def long_function():", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as hc:
        with hc.stream("POST", server.base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 1:       # the request holds a slot while it streams
                        server.wait_metric("strata_busy_slots", lambda v: v >= 1, timeout=10)
                    if got == 2:
                        break          # hang up mid-stream
    server.wait_metric('strata_requests_total{outcome="cancel"}', lambda v: v >= before + 1)
    server.wait_metric("strata_busy_slots", lambda v: v == 0)
    server.wait_metric("strata_requests_in_flight", lambda v: v == 0)

    # the same for a non-streaming request whose client times out
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", {"prompt": "x", "max_tokens": 10**6, "ignore_eos": True},
             timeout=0.5)
    server.wait_metric('strata_requests_total{outcome="cancel"}', lambda v: v >= before + 2)
    server.wait_metric("strata_busy_slots", lambda v: v == 0)


@pytest.mark.slow
def test_abusive_burst_does_not_wedge(server):
    def garbage(i: int) -> int:
        bodies = [os.urandom(64 + i), b"{" * 5000, b'{"prompt": ' + b"[" * 3000,
                  b'{"prompt": "x", "max_tokens": 1e400}', b"\x00" * 100]
        return post(server, "/v1/completions", bodies[i % len(bodies)], timeout=30).status_code

    def huge(i: int) -> int:
        try:  # huge max_tokens is clipped to the context; the client gives up after 1 s
            return post(server, "/v1/completions", {"prompt": f"x{i}", "max_tokens": 10**12,
                                                    "ignore_eos": True}, timeout=1.0).status_code
        except httpx.TimeoutException:
            return -1

    def half_open(i: int) -> int:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                          b"Content-Type: application/json\r\n\r\n{\"prompt\": \"ab")
            else:
                s.sendall(b"GET /health HTTP/1.1\r\nHo")
            time.sleep(0.2)
        return 0

    def stream_and_drop(i: int) -> int:
        with httpx.Client(timeout=10) as hc:
            with hc.stream("POST", server.base + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": f"hi {i}"}],
                                 "max_tokens": 10**9, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        break
                return r.status_code

    jobs = ([(garbage, i) for i in range(40)] + [(huge, i) for i in range(8)]
            + [(half_open, i) for i in range(40)] + [(stream_and_drop, i) for i in range(8)])
    with ThreadPoolExecutor(48) as ex:
        codes = [f.result(timeout=120) for f in [ex.submit(fn, i) for fn, i in jobs]]
    assert all(c == 400 for c in codes[:40]), codes[:40]
    assert all(c in (200, 429, -1) for c in codes[40:48])
    # still serving, and everything is released
    server.wait_metric("strata_requests_in_flight", lambda v: v == 0, timeout=60)
    server.wait_metric("strata_busy_slots", lambda v: v == 0)
    assert server.health().status_code == 200
    r = post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.slow
def test_engine_crash_mid_stream_then_recovery(server):
    old_pid = server.health().json()["engine_pid"]
    restarts = server.metrics()["strata_engine_restarts_total"]
    body = {"prompt": "def crash():", "max_tokens": 200, "ignore_eos": True, "stream": True}
    events: list = []
    side: dict = {}

    def nonstreaming():   # a second request in flight when the engine dies
        side["r"] = post(server, "/v1/completions", {"prompt": "def other():", "max_tokens": 200,
                                                     "ignore_eos": True}, timeout=60)

    t = threading.Thread(target=nonstreaming)
    with httpx.Client(timeout=60) as hc:
        with hc.stream("POST", server.base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            t.start()
            server.wait_metric("strata_requests_in_flight", lambda v: v >= 2, timeout=20)
            os.kill(old_pid, signal.SIGKILL)
            events = sse_events(lines)
    t.join(60)
    assert events[-1] == "[DONE]", events
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and "died" in errors[0]["error"]["message"], errors
    assert side["r"].status_code == 500 and "died" in side["r"].json()["error"]["message"]

    # while it restarts: 503 with Retry-After
    h = server.health()
    assert h.status_code == 503 and "retry-after" in h.headers
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and "retry-after" in r.headers

    info = server.wait_ready(not_pid=old_pid)
    assert info["restarts"] >= 1
    assert server.metrics()["strata_engine_restarts_total"] == restarts + 1
    out = client(server).completions.create(model=info["model"], prompt="def again():",
                                            max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    yield from running(tmp_path_factory, "serve_key", "server.api_key=sekret-key",
                       "server.max_pending=2", "server.model_name=tiny-test")


@pytest.mark.slow
def test_api_key_and_backpressure(keyed_server):
    s = keyed_server
    body = {"prompt": "x", "max_tokens": 2}
    r = post(s, "/v1/completions", body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(s, "/v1/completions", body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(s.base + "/v1/models", timeout=5).status_code == 401
    assert s.health().status_code == 200              # health and metrics stay open
    c = client(s, key="sekret-key")
    assert [m.id for m in c.models.list().data] == ["tiny-test"]
    assert c.completions.create(model="tiny-test", prompt="x", max_tokens=2).usage.total_tokens > 1
    with pytest.raises(openai.AuthenticationError):
        client(s, key="nope").completions.create(model="tiny-test", prompt="x", max_tokens=2)

    # bounded queue: server.max_pending=2 -> the third concurrent request gets 429
    long = {"prompt": "y", "max_tokens": 150, "ignore_eos": True}
    auth = {"Authorization": "Bearer sekret-key"}

    def fire(_):
        try:
            return post(s, "/v1/completions", long, headers=auth, timeout=2.0).status_code
        except httpx.TimeoutException:
            return -1     # still running when the client gave up (and cancelled it)

    with ThreadPoolExecutor(6) as ex:
        codes = list(ex.map(fire, range(6), timeout=60))
    assert codes.count(429) >= 1, codes
    s.wait_metric("strata_requests_in_flight", lambda v: v == 0)
    s.wait_metric("strata_busy_slots", lambda v: v == 0)
    assert c.completions.create(model="tiny-test", prompt="x", max_tokens=2).usage.total_tokens > 1


@pytest.mark.slow
def test_hung_engine_is_killed_and_its_requests_fail(tmp_path_factory):
    """A ready engine that stops answering (frozen with SIGSTOP) is detected by the heartbeat
    watchdog: its requests get an error naming the hang, and the server serves again."""
    s = ServerProc(tmp_path_factory.mktemp("serve_hang"), "server.step_timeout_s=2")
    try:
        old_pid = s.wait_ready()["engine_pid"]
        body = {"prompt": "def hang():", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as hc:
            with hc.stream("POST", s.base + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        break
                t0 = time.monotonic()
                os.kill(old_pid, signal.SIGSTOP)
                events = sse_events(lines)
        assert events[-1] == "[DONE]", events
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and "hung" in errors[0]["error"]["message"], errors
        assert time.monotonic() - t0 < 30
        info = s.wait_ready(not_pid=old_pid)
        assert info["restarts"] >= 1
        r = post(s, "/v1/completions", {"prompt": "ok", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
    finally:
        s.stop()


def test_queued_output_rows_coalesce_into_one_event():
    """Rows already queued for a streaming request are written as one SSE event, up to the
    finished row; an error queued behind them is kept for the next turn, not lost."""
    import asyncio

    from strata.serve.app import coalesce_outs
    from strata.serve.messages import OutputRow

    def row(ids, text, finished=False, reason=None, ot=0):
        return OutputRow("r1", ids, text, finished, reason, None, 5, ot, {"t": ot} if finished else None)

    q: asyncio.Queue = asyncio.Queue()
    for r in (row([2], "b", ot=2), row([3, 4], "cd", ot=4), row([5], "e", True, "length", 5),
              row([6], "f", ot=6)):
        q.put_nowait(("out", r))
    ev, held = coalesce_outs(q, ("out", row([1], "a", ot=1)))
    assert ev == ("out", OutputRow("r1", [1, 2, 3, 4, 5], "abcde", True, "length", None, 5, 5, {"t": 5}))
    assert held is None and q.qsize() == 1  # nothing past the finished row is taken

    q = asyncio.Queue()
    q.put_nowait(("out", row([2], "b", ot=2)))
    q.put_nowait(("error", "engine died"))
    q.put_nowait(("out", row([3], "c", ot=3)))
    ev, held = coalesce_outs(q, ("out", row([1], "a", ot=1)))
    assert (ev[1].new_token_ids, ev[1].new_text) == ([1, 2], "ab") and held == ("error", "engine died")
    assert q.qsize() == 1
