#!/usr/bin/env python3
"""Soak a live strata server (docs/SERVING.md) with a realistic request mix, and check it.

    python scripts/soak_server.py --base http://127.0.0.1:8000 --duration 360 --concurrency 6
    python scripts/soak_server.py --start engine.slots=2 --duration 180 --json soak.json

N client threads (httpx, one connection pool each, a seeded random stream each) loop until
--duration ends, each request picked among:

- normal: /v1/completions or /v1/chat/completions, stream or not, greedy or sampled
  (temperature, top_p, top_k, seed), max_tokens 1..64, sometimes stop strings, a text prompt of
  a few words to ~2k characters or (completions) a list of token ids, sometimes
  stream_options.include_usage;
- probe: one of a few fixed greedy (and seeded sampled) requests, re-issued all through the run
  (stream or not); every answer must have the same text;
- disconnect: a stream closed after k chunks, or a non-stream request abandoned after a short
  client timeout (the server must cancel it and free its slot);
- bad: an invalid request, which must get a 4xx whose error body names the param at fault.

Checks: nothing 5xx; nothing over --timeout (counted as hung, with its request body); a 200
has choices, a finish_reason in {stop, length} and usage.completion_tokens <= max_tokens; a
stream has no error event and ends with `data: [DONE]`; a stop string never appears in the text;
bad requests get 4xx naming the param; the probes' texts agree. At the end, the server's
/health in_flight and /metrics strata_busy_slots / strata_requests_in_flight must drop to 0
within --drain-timeout (else a slot leak), and the finished-request count in /metrics must
match what the clients saw (else a lost request). Exit code 1 on any failure, 2 on a setup
error (no server).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Optional

import httpx

from bench import Server
from strata.serve.metrics import parse_metrics
from prompt_material import prompt_texts

FINISH_OK = {"stop", "length"}
STOPS = ["\n", "\n\n", "def ", "return", " the", ")", ":", "self", "import", "#", "zzqx"]


# ------------------------------------------------------------------------------ prompt text
#: the benchmarks' prompt material (scripts/data/code_prompts.json), one text to cut from
MAT = "\n\n".join(prompt_texts())


def prompt_text(rng: random.Random) -> str:
    """A few words to ~2k characters, log-uniform in length, cut from the material."""
    n = int(round(10 ** rng.uniform(1.2, 3.3)))  # 16 .. 2000 characters
    n = max(8, min(n, 2000))
    start = rng.randrange(0, len(MAT) - n - 1)
    s = MAT[start:start + n]
    return s if s.strip() else "Hello there, " + s


# ------------------------------------------------------------------------------ requests
def sampling(rng: random.Random, body: dict) -> str:
    if rng.random() < 0.4:
        body["temperature"] = 0
        return "greedy"
    body["temperature"] = round(rng.uniform(0.3, 1.5), 3)
    if rng.random() < 0.6:
        body["top_p"] = round(rng.uniform(0.5, 1.0), 3)
    if rng.random() < 0.4:
        body["top_k"] = rng.choice([-1, 0, 1, 5, 20, 50])
    if rng.random() < 0.6:
        body["seed"] = rng.randrange(0, 2 ** 63)
    return "sampled"


def normal_request(rng: random.Random) -> tuple[str, dict]:
    endpoint = rng.choice(["completions", "chat"])
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 64)}
    if endpoint == "completions":
        if rng.random() < 0.2:
            body["prompt"] = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 400))]
        else:
            body["prompt"] = prompt_text(rng)
    else:
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": prompt_text(rng)[:300]})
        msgs.append({"role": "user", "content": prompt_text(rng)})
        if rng.random() < 0.2:
            msgs += [{"role": "assistant", "content": prompt_text(rng)[:200]},
                     {"role": "user", "content": [{"type": "text", "text": prompt_text(rng)[:200]}]}]
        body["messages"] = msgs
    sampling(rng, body)
    if rng.random() < 0.25:
        k = rng.randint(1, 3)
        body["stop"] = rng.choice(STOPS) if k == 1 else rng.sample(STOPS, k)
    body["stream"] = rng.random() < 0.5
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    return endpoint, body


def make_probes() -> list[tuple[str, dict]]:
    """Fixed requests whose text must not change over the run (greedy, or sampled with a seed:
    "the same prompt, seed and parameters give the same text whatever runs beside it")."""
    long_prompt = MAT[1000:2500]
    return [
        ("completions", {"prompt": "def fib(n):", "max_tokens": 48, "temperature": 0}),
        ("completions", {"prompt": long_prompt, "max_tokens": 32, "temperature": 0}),
        ("completions", {"prompt": [17, 400, 23, 99, 512, 7, 300, 42], "max_tokens": 24,
                         "temperature": 0, "ignore_eos": True}),
        ("completions", {"prompt": "import os\nimport sys\n", "max_tokens": 64, "temperature": 0,
                         "stop": ["\n\n"]}),
        ("chat", {"messages": [{"role": "user", "content": "Write a function that sorts a list."}],
                  "max_tokens": 40, "temperature": 0}),
        ("completions", {"prompt": "class Queue:", "max_tokens": 40, "temperature": 0.8,
                         "top_p": 0.9, "seed": 1234}),
        ("chat", {"messages": [{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": "Explain a hash map."}],
                  "max_tokens": 32, "temperature": 1.0, "top_k": 20, "seed": 7}),
    ]


def bad_request(rng: random.Random) -> tuple[str, Any, Optional[str], str]:
    """(endpoint, body (dict, or raw bytes), the param the error must name or None, label)."""
    chat_ok = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, Any, Optional[str], str]] = [
        ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens=0"),
        ("completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "max_tokens=str"),
        ("completions", {"prompt": "hi", "temperature": -1}, "temperature", "temperature<0"),
        ("completions", {"prompt": "hi", "top_p": 0}, "top_p", "top_p=0"),
        ("completions", {"prompt": "hi", "top_k": "x"}, "top_k", "top_k=str"),
        ("completions", {"prompt": "hi", "seed": "s"}, "seed", "seed=str"),
        ("completions", {"prompt": ""}, "prompt", "empty prompt"),
        ("completions", {"max_tokens": 4}, "prompt", "no prompt"),
        ("completions", {"prompt": [999999999], "max_tokens": 2}, "prompt", "id out of vocab"),
        ("completions", {"prompt": [5] * 6000, "max_tokens": 2}, "prompt", "prompt over context"),
        ("completions", {"prompt": ["a", "b"]}, "prompt", "two prompts"),
        ("completions", {"prompt": "hi", "model": "no-such-model"}, "model", "unknown model"),
        ("completions", {"prompt": "hi", "n": 2}, "n", "n=2"),
        ("completions", {"prompt": "hi", "logprobs": 3}, "logprobs", "logprobs"),
        ("completions", {"prompt": "hi", "stop": [""]}, "stop", "empty stop"),
        ("completions", {"prompt": "hi", "stream": "yes"}, "stream", "stream=str"),
        ("chat", {"messages": []}, "messages", "no messages"),
        ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "bad role"),
        ("chat", {"messages": chat_ok, "max_completion_tokens": -3}, "max_completion_tokens",
         "max_completion_tokens<0"),
        ("chat", {"messages": chat_ok, "stream_options": 5, "stream": True}, "stream_options",
         "stream_options=int"),
        ("completions", b'{"prompt": "hi", "max_tokens": ', None, "malformed JSON"),
        ("completions", b'[1, 2]', None, "not an object"),
    ]
    return rng.choice(cases)


# ------------------------------------------------------------------------------ results
class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_kind: Counter = Counter()
        self.ok_by_kind: Counter = Counter()
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, list[dict]] = defaultdict(list)
        self.hung: list[dict] = []
        self.probe_texts: dict[int, Counter] = defaultdict(Counter)
        self.probe_first: dict[int, str] = {}
        self.mismatches: list[dict] = []
        self.finished_200 = 0      # generation requests the server answered 200 (stream or not)
        self.abandoned = 0         # disconnects that may or may not have been accepted
        self.inflight: dict[int, tuple[float, str, dict]] = {}
        self.seq = 0

    def start(self, kind: str, body: Any) -> int:
        with self.lock:
            self.seq += 1
            self.inflight[self.seq] = (time.monotonic(), kind, body)
            return self.seq

    def end(self, tok: int) -> None:
        with self.lock:
            self.inflight.pop(tok, None)

    def record(self, kind: str, latency: float, error: Optional[str] = None,
               detail: str = "", body: Any = None, hung: bool = False) -> None:
        with self.lock:
            self.by_kind[kind] += 1
            if hung:
                self.hung.append({"kind": kind, "latency_s": round(latency, 3), "detail": detail,
                                  "body": body})
            if error is None:
                self.ok_by_kind[kind] += 1
                self.lat[kind].append(latency)
            else:
                self.errors[error].append({"kind": kind, "detail": detail[:500], "body": body,
                                           "latency_s": round(latency, 3)})

    def probe(self, idx: int, text: str, body: dict, stream: bool) -> None:
        with self.lock:
            self.probe_texts[idx][text] += 1
            ref = self.probe_first.setdefault(idx, text)
            if text != ref:
                i = next((j for j, (a, b) in enumerate(zip(ref, text)) if a != b),
                         min(len(ref), len(text)))
                self.mismatches.append({"probe": idx, "stream": stream, "first_diff_at": i,
                                        "expected": ref, "got": text, "body": body})

    def n_errors(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.errors.values())


def pct(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def short_body(body: Any) -> Any:
    """A request body for printing: long prompts cut."""
    if isinstance(body, bytes):
        return body[:120].decode("utf-8", "replace")
    b = dict(body)
    p = b.get("prompt")
    if isinstance(p, str) and len(p) > 120:
        b["prompt"] = p[:120] + f"...({len(p)} chars)"
    elif isinstance(p, list) and len(p) > 12:
        b["prompt"] = p[:12] + [f"...({len(p)} ids)"]
    if "messages" in b:
        b["messages"] = [{**m, "content": (m["content"][:80] + f"...({len(m['content'])} chars)")
                          if isinstance(m.get("content"), str) and len(m["content"]) > 80
                          else m.get("content")} for m in b["messages"]]
    return b


# ------------------------------------------------------------------------------ one request
class Failure(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def text_of(choice: dict, endpoint: str, stream: bool) -> str:
    if endpoint == "completions":
        return choice.get("text") or ""
    d = choice.get("delta" if stream else "message") or {}
    return d.get("content") or ""


def check_json_200(r: httpx.Response, endpoint: str, body: dict) -> str:
    try:
        j = r.json()
    except Exception:
        raise Failure("bad_json", f"200 with a non-JSON body: {r.text[:200]!r}")
    ch = j.get("choices")
    if not isinstance(ch, list) or not ch:
        raise Failure("no_choices", f"200 without choices: {json.dumps(j)[:300]}")
    fr = ch[0].get("finish_reason")
    if fr not in FINISH_OK:
        raise Failure("bad_finish_reason", f"finish_reason {fr!r}")
    u = j.get("usage")
    if not isinstance(u, dict) or "completion_tokens" not in u:
        raise Failure("no_usage", f"200 without usage: {json.dumps(j)[:300]}")
    if u["completion_tokens"] > body["max_tokens"]:
        raise Failure("over_max_tokens",
                      f"completion_tokens {u['completion_tokens']} > max_tokens {body['max_tokens']}")
    return text_of(ch[0], endpoint, False)


def read_stream(r: httpx.Response, endpoint: str, body: dict, t0: float, timeout: float,
                close_after: Optional[int] = None) -> tuple[str, bool]:
    """The streamed text, and whether the client closed it early (close_after chunks)."""
    parts: list[str] = []
    finish = None
    done = False
    n = 0
    usage_tokens = None
    for line in r.iter_lines():
        if time.monotonic() - t0 > timeout:
            raise Failure("hung", f"stream still open after {timeout:g} s ({n} chunks)")
        if not line:
            continue
        if not line.startswith("data: "):
            raise Failure("bad_sse", f"unexpected SSE line {line[:120]!r}")
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        if done:
            raise Failure("bad_sse", "data after [DONE]")
        try:
            j = json.loads(data)
        except Exception:
            raise Failure("bad_sse", f"SSE data is not JSON: {data[:120]!r}")
        if "error" in j:
            raise Failure("stream_error_event", json.dumps(j["error"])[:300])
        n += 1
        if close_after is not None and n >= close_after:
            return "".join(parts), True
        for c in j.get("choices") or []:
            parts.append(text_of(c, endpoint, True))
            if c.get("finish_reason") is not None:
                if finish is not None:
                    raise Failure("bad_sse", "two finish_reasons in one stream")
                finish = c["finish_reason"]
        if j.get("usage") and not j.get("choices"):
            usage_tokens = j["usage"].get("completion_tokens")
    if not done:
        if close_after is not None:
            return "".join(parts), False
        raise Failure("stream_truncated", f"stream ended without [DONE] after {n} chunks")
    if finish not in FINISH_OK:
        raise Failure("bad_finish_reason", f"stream finish_reason {finish!r}")
    if usage_tokens is not None and usage_tokens > body["max_tokens"]:
        raise Failure("over_max_tokens",
                      f"completion_tokens {usage_tokens} > max_tokens {body['max_tokens']}")
    return "".join(parts), False


def check_stop(text: str, body: dict) -> None:
    stop = body.get("stop")
    if not stop:
        return
    for s in [stop] if isinstance(stop, str) else stop:
        if s in text:
            raise Failure("stop_in_text", f"stop string {s!r} appears in the text {text[:200]!r}")


def error_param(r: httpx.Response) -> tuple[Optional[dict], str]:
    try:
        e = r.json().get("error")
        return (e if isinstance(e, dict) else None), r.text[:300]
    except Exception:
        return None, r.text[:300]


class Worker(threading.Thread):
    def __init__(self, i: int, args: argparse.Namespace, stats: Stats, deadline: float,
                 probes: list[tuple[str, dict]]):
        super().__init__(name=f"soak-{i}", daemon=True)
        self.rng = random.Random(args.seed * 1_000_003 + i)
        self.args = args
        self.stats = stats
        self.deadline = deadline
        self.probes = probes
        self.client = httpx.Client(base_url=args.base, headers=headers(args),
                                   timeout=httpx.Timeout(args.timeout, connect=10.0))

    def run(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                x = self.rng.random()
                if x < 0.10:
                    self.probe()
                elif x < 0.18:
                    self.bad()
                elif x < 0.26:
                    self.disconnect()
                else:
                    endpoint, body = normal_request(self.rng)
                    kind = f"{'cmpl' if endpoint == 'completions' else 'chat'}/" \
                           f"{'stream' if body['stream'] else 'json'}/" \
                           f"{'greedy' if body['temperature'] == 0 else 'sampled'}"
                    self.generate(kind, endpoint, body)
        finally:
            self.client.close()

    def url(self, endpoint: str) -> str:
        return "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"

    def generate(self, kind: str, endpoint: str, body: dict) -> Optional[str]:
        """Send a request that must succeed; record it; its text, or None on failure."""
        st = self.stats
        tok = st.start(kind, body)
        t0 = time.monotonic()
        self.got200 = False
        try:
            if body.get("stream"):
                with self.client.stream("POST", self.url(endpoint), json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        raise Failure(f"http_{r.status_code}", r.text[:300])
                    self.answered()
                    text, _ = read_stream(r, endpoint, body, t0, self.args.timeout)
            else:
                r = self.client.post(self.url(endpoint), json=body)
                if r.status_code != 200:
                    raise Failure(f"http_{r.status_code}", r.text[:300])
                self.answered()
                text = check_json_200(r, endpoint, body)
            check_stop(text, body)
            dt = time.monotonic() - t0
            if dt > self.args.timeout:
                raise Failure("hung", f"took {dt:.1f} s")
            st.record(kind, dt)
            return text
        except (Failure, httpx.HTTPError) as e:
            self.failed(kind, t0, e, body)
        finally:
            st.end(tok)
        return None

    def failed(self, kind: str, t0: float, e: Exception, body: dict,
               gone_on_failure: bool = False) -> None:
        """Record a request's failure: a Failure (the client gave the request up too where
        `gone_on_failure`), or httpx's timeout or transport error (the client gave it up)."""
        dt = time.monotonic() - t0
        if isinstance(e, Failure):
            self.stats.record(kind, dt, e.kind, e.detail, body, hung=e.kind == "hung")
            if not gone_on_failure:
                return
        elif isinstance(e, httpx.TimeoutException):
            self.stats.record(kind, dt, "hung", f"{type(e).__name__} after {dt:.1f} s", body,
                              hung=True)
        else:
            self.stats.record(kind, dt, "transport", f"{type(e).__name__}: {e}", body)
        self.gave_up()

    def answered(self) -> None:
        """The request got its 200: the server finishes it once (stop, length, or cancel)."""
        self.got200 = True
        with self.stats.lock:
            self.stats.finished_200 += 1

    def gave_up(self) -> None:
        """The client left a request (timeout, broken connection) before its 200: the server
        may have finished it, cancelled it, or never submitted it."""
        if not self.got200:
            with self.stats.lock:
                self.stats.abandoned += 1

    def probe(self) -> None:
        idx = self.rng.randrange(len(self.probes))
        endpoint, base = self.probes[idx]
        body = dict(base, stream=self.rng.random() < 0.5)
        text = self.generate(f"probe/{'stream' if body['stream'] else 'json'}", endpoint, body)
        if text is not None:
            self.stats.probe(idx, text, body, body["stream"])

    def bad(self) -> None:
        endpoint, body, param, label = bad_request(self.rng)
        st = self.stats
        tok = st.start("bad", body)
        t0 = time.monotonic()
        try:
            if isinstance(body, bytes):
                r = self.client.post(self.url(endpoint), content=body,
                                     headers={"Content-Type": "application/json"})
            else:
                r = self.client.post(self.url(endpoint), json=body)
            dt = time.monotonic() - t0
            err, raw = error_param(r)
            if not 400 <= r.status_code < 500:
                st.record("bad", dt, f"bad_input_got_{r.status_code}", f"{label}: {raw}",
                          short_body(body))
            elif err is None or not err.get("message"):
                st.record("bad", dt, "bad_input_no_error_body", f"{label}: {raw}", short_body(body))
            elif param is not None and err.get("param") != param:
                st.record("bad", dt, "bad_input_wrong_param",
                          f"{label}: expected param {param!r}, got {err.get('param')!r}",
                          short_body(body))
            elif dt > self.args.timeout:
                st.record("bad", dt, "hung", f"{label}: took {dt:.1f} s", short_body(body), hung=True)
            else:
                st.record("bad", dt)
        except httpx.TimeoutException as e:
            st.record("bad", time.monotonic() - t0, "hung", f"{label}: {type(e).__name__}",
                      short_body(body), hung=True)
        except httpx.HTTPError as e:
            st.record("bad", time.monotonic() - t0, "transport", f"{label}: {type(e).__name__}: {e}",
                      short_body(body))
        finally:
            st.end(tok)

    def disconnect(self) -> None:
        endpoint, body = normal_request(self.rng)
        body["max_tokens"] = self.rng.randint(8, 64)
        st = self.stats
        t0 = time.monotonic()
        if self.rng.random() < 0.7:
            kind = "disconnect/stream"
            body["stream"] = True
            k = self.rng.randint(0, 6)
            tok = st.start(kind, body)
            self.got200 = False
            try:
                with self.client.stream("POST", self.url(endpoint), json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        raise Failure(f"http_{r.status_code}", r.text[:300])
                    if k > 0:
                        _, closed = read_stream(r, endpoint, body, t0, self.args.timeout,
                                                close_after=k)
                        if not closed:
                            with st.lock:
                                st.finished_200 += 1   # finished before the client left
                        else:
                            with st.lock:
                                st.abandoned += 1
                    else:
                        with st.lock:
                            st.abandoned += 1
                    # leaving the `with` closes the connection mid-stream
                st.record(kind, time.monotonic() - t0)
            except (Failure, httpx.HTTPError) as e:
                self.failed(kind, t0, e, body, gone_on_failure=True)
            finally:
                st.end(tok)
        else:
            kind = "disconnect/json"
            body["stream"] = False
            wait = round(self.rng.uniform(0.02, 0.6), 3)
            tok = st.start(kind, body)
            self.got200 = False
            try:
                with httpx.Client(base_url=self.args.base, headers=headers(self.args),
                                  timeout=httpx.Timeout(wait, connect=10.0)) as c:
                    r = c.post(self.url(endpoint), json=body)
                if r.status_code != 200:
                    raise Failure(f"http_{r.status_code}", r.text[:300])
                self.answered()
                check_json_200(r, endpoint, body)
                st.record(kind, time.monotonic() - t0)
            except Failure as f:
                st.record(kind, time.monotonic() - t0, f.kind, f.detail, body)
            except httpx.TimeoutException:
                with st.lock:
                    st.abandoned += 1
                st.record(kind, time.monotonic() - t0)   # the point: the client gave up
            except httpx.HTTPError as e:
                st.record(kind, time.monotonic() - t0, "transport", f"{type(e).__name__}: {e}", body)
                self.gave_up()
            finally:
                st.end(tok)


# ------------------------------------------------------------------------------ server state
def headers(args: argparse.Namespace) -> dict:
    key = args.api_key or os.environ.get("STRATA_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def server_state(base: str) -> dict:
    with httpx.Client(base_url=base, timeout=5.0) as c:
        h = c.get("/health")
        m = parse_metrics(c.get("/metrics").text)
    hj = h.json()
    finished = {k: v for k, v in m.items() if k.startswith("strata_requests_total")}
    return {"health_status": h.status_code, "in_flight": hj.get("in_flight"),
            "engine_pid": hj.get("engine_pid"), "restarts": hj.get("restarts"),
            "busy_slots": m.get("strata_busy_slots"), "slots": m.get("strata_slots"),
            "requests_in_flight": m.get("strata_requests_in_flight"),
            "finished": finished, "finished_total": sum(finished.values()),
            "rejected": {k: v for k, v in m.items() if k.startswith("strata_requests_rejected_total")}}


def wait_drained(base: str, limit: float) -> tuple[bool, dict, float]:
    t0 = time.monotonic()
    s: dict = {}
    while True:
        try:
            s = server_state(base)
            if s["in_flight"] == 0 and s["busy_slots"] == 0 and s["requests_in_flight"] == 0:
                return True, s, time.monotonic() - t0
        except Exception as e:
            s = {"error": f"{type(e).__name__}: {e}"}
        if time.monotonic() - t0 > limit:
            return False, s, time.monotonic() - t0
        time.sleep(0.25)


# ------------------------------------------------------------------------------ main
def run_probes_quiet(args: argparse.Namespace, stats: Stats, probes: list) -> None:
    """Each probe once, alone, streamed and not: the references the run must reproduce."""
    w = Worker(10_000, args, stats, 0.0, probes)
    try:
        for idx, (endpoint, base) in enumerate(probes):
            for stream in (False, True):
                body = dict(base, stream=stream)
                text = w.generate(f"probe/{'stream' if stream else 'json'}", endpoint, body)
                if text is not None:
                    stats.probe(idx, text, body, stream)
    finally:
        w.client.close()


def soak(args: argparse.Namespace) -> int:
    probes = make_probes()
    stats = Stats()
    try:
        before = server_state(args.base)
    except Exception as e:
        print(f"error: cannot reach {args.base}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if before["health_status"] != 200:
        print(f"error: {args.base}/health answers {before['health_status']}", file=sys.stderr)
        return 2
    print(f"soak {args.base}: {args.duration:g} s, concurrency {args.concurrency}, seed "
          f"{args.seed}, timeout {args.timeout:g} s; engine pid {before['engine_pid']}", flush=True)

    run_probes_quiet(args, stats, probes)
    t_start = time.monotonic()
    deadline = t_start + args.duration
    workers = [Worker(i, args, stats, deadline, probes) for i in range(args.concurrency)]
    for w in workers:
        w.start()
    warned: set[int] = set()
    next_report = t_start + args.progress
    while any(w.is_alive() for w in workers):
        time.sleep(0.5)
        now = time.monotonic()
        with stats.lock:
            for tok, (t0, kind, body) in stats.inflight.items():
                if now - t0 > args.timeout and tok not in warned:
                    warned.add(tok)
                    print(f"  !! {kind} request running {now - t0:.0f} s (past --timeout): "
                          f"{json.dumps(short_body(body))[:300]}", flush=True)
            oldest = max((now - t0 for t0, _, _ in stats.inflight.values()), default=0.0)
        if now >= next_report:
            next_report += args.progress
            with stats.lock:
                n = sum(stats.by_kind.values())
                lat = [x for k, v in stats.lat.items() if not k.startswith(("bad", "disc")) for x in v]
            try:
                s = server_state(args.base)
                srv = f"server in_flight {s['in_flight']} busy {s['busy_slots']:.0f}"
            except Exception as e:
                srv = f"server state unreadable: {type(e).__name__}"
            p50 = pct(lat, 50)
            print(f"  [{now - t_start:5.0f} s] {n} requests, {stats.n_errors()} errors, "
                  f"{len(stats.hung)} hung, {len(stats.mismatches)} mismatches, oldest in flight "
                  f"{oldest:.1f} s, p50 {p50 if p50 is None else round(p50, 3)} s; {srv}",
                  flush=True)
    for w in workers:
        w.join()
    run_probes_quiet(args, stats, probes)   # and once more on a quiet server
    elapsed = time.monotonic() - t_start

    drained, after, drain_s = wait_drained(args.base, args.drain_timeout)
    return report(args, stats, before, after, drained, drain_s, elapsed, probes)


def report(args: argparse.Namespace, stats: Stats, before: dict, after: dict, drained: bool,
           drain_s: float, elapsed: float, probes: list) -> int:
    failures: list[str] = []
    total = sum(stats.by_kind.values())
    print()
    print(f"== soak summary: {total} requests in {elapsed:.0f} s ({total / max(elapsed, 1e-9):.2f}/s), "
          f"concurrency {args.concurrency}, seed {args.seed}, server slots {after.get('slots')}")
    print(f"{'kind':<24}{'n':>6}{'ok':>6}{'p50 s':>9}{'p99 s':>9}{'max s':>9}")
    for k in sorted(stats.by_kind):
        lat = stats.lat.get(k, [])
        f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{k:<24}{stats.by_kind[k]:>6}{stats.ok_by_kind[k]:>6}{f(pct(lat, 50)):>9}"
              f"{f(pct(lat, 99)):>9}{f(max(lat) if lat else None):>9}")
    all_lat = [x for k, v in stats.lat.items() if not k.startswith(("bad", "disc")) for x in v]
    if all_lat:
        print(f"{'all generation':<24}{len(all_lat):>6}{'':>6}{pct(all_lat, 50):>9.3f}"
              f"{pct(all_lat, 99):>9.3f}{max(all_lat):>9.3f}")

    n_err = sum(len(v) for v in stats.errors.values())
    print(f"errors: {n_err}" + ("" if not n_err else ""))
    for kind, items in sorted(stats.errors.items()):
        print(f"  {kind}: {len(items)}  e.g. [{items[0]['kind']}] {items[0]['detail'][:200]}")
        if kind != "hung":
            print(f"      body: {json.dumps(short_body(items[0]['body']))[:300]}")
    if n_err:
        failures.append(f"{n_err} failed requests")
    print(f"hung (> {args.timeout:g} s): {len(stats.hung)}")
    for h in stats.hung[:10]:
        print(f"  [{h['kind']}] {h['latency_s']} s {h['detail'][:120]}\n      body: "
              f"{json.dumps(short_body(h['body']))[:400]}")
    print(f"probes: {sum(sum(c.values()) for c in stats.probe_texts.values())} answers over "
          f"{len(probes)} fixed requests; determinism mismatches: {len(stats.mismatches)}")
    for idx in sorted(stats.probe_texts):
        c = stats.probe_texts[idx]
        if len(c) > 1:
            print(f"  probe {idx}: {len(c)} distinct texts, counts {sorted(c.values(), reverse=True)}")
    for m in stats.mismatches[:5]:
        print(f"  probe {m['probe']} (stream={m['stream']}) differs at char {m['first_diff_at']}: "
              f"expected {m['expected'][:80]!r} got {m['got'][:80]!r}")
    if stats.mismatches:
        failures.append(f"{len(stats.mismatches)} determinism mismatches")

    # Server side: drained, no restarts, and every request the clients saw accounted for.
    print(f"drain: {'ok' if drained else 'FAILED'} in {drain_s:.1f} s: in_flight "
          f"{after.get('in_flight')}, busy_slots {after.get('busy_slots')}, "
          f"strata_requests_in_flight {after.get('requests_in_flight')}")
    if not drained:
        failures.append(f"slot leak: server not idle {args.drain_timeout:g} s after the run: {after}")
    if after.get("restarts") is not None and after.get("restarts") != before.get("restarts"):
        failures.append(f"engine restarted during the run ({before.get('restarts')} -> "
                        f"{after.get('restarts')}, pid {before.get('engine_pid')} -> "
                        f"{after.get('engine_pid')})")
    if "finished_total" in after:
        d_fin = after["finished_total"] - before["finished_total"]
        by = {k.split('"')[1] if '"' in k else k: int(v - before["finished"].get(k, 0))
              for k, v in after["finished"].items() if v - before["finished"].get(k, 0)}
        print(f"server finished {d_fin:.0f} requests {by}; clients: {stats.finished_200} answered "
              f"200, {stats.abandoned} abandoned (each may be finished or cancelled, or refused "
              f"before submission)")
        # Every 200 the clients read was a finished request; an abandoned one counts at most once.
        if d_fin < stats.finished_200:
            failures.append(f"lost requests: the clients got {stats.finished_200} answers but the "
                            f"server counts {d_fin:.0f} finished")
        if d_fin > stats.finished_200 + stats.abandoned:
            failures.append(f"the server counts {d_fin:.0f} finished requests, more than the "
                            f"clients' {stats.finished_200} answers + {stats.abandoned} abandoned")
        errs = by.get("error", 0) + by.get("timeout", 0)
        if errs:
            failures.append(f"server metrics count {errs} requests finished as error/timeout")

    print("RESULT: " + ("PASS" if not failures else "FAIL"))
    for f in failures:
        print(f"  - {f}")
    if args.json:
        out = {"pass": not failures, "failures": failures, "args": {k: v for k, v in vars(args).items()
                                                                      if k != "api_key"},
               "elapsed_s": elapsed, "requests": dict(stats.by_kind), "ok": dict(stats.ok_by_kind),
               "latency_s": {k: {"p50": pct(v, 50), "p99": pct(v, 99), "max": max(v)}
                             for k, v in stats.lat.items() if v},
               "latency_all_generation_s": {"p50": pct(all_lat, 50), "p99": pct(all_lat, 99)},
               "errors": {k: v for k, v in stats.errors.items()},
               "hung": stats.hung, "mismatches": stats.mismatches,
               "probe_variants": {str(i): len(c) for i, c in stats.probe_texts.items()},
               "drained": drained, "drain_s": drain_s, "server_before": before,
               "server_after": after, "finished_200": stats.finished_200,
               "abandoned": stats.abandoned}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"summary written to {args.json}")
    return 1 if failures else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Extra arguments after --start are Hydra overrides for "
                                        "the started server, e.g. engine.slots=2.")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--base", default=None, help="URL of a running server (http://127.0.0.1:8000)")
    g.add_argument("--start", action="store_true",
                   help="start a server (python -m strata.serve) on a free port with the "
                        "remaining arguments as overrides; stop it at the end")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    ap.add_argument("--concurrency", type=int, default=6, help="client threads (default 6)")
    ap.add_argument("--seed", type=int, default=0, help="seeds every worker's random stream")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="per-request limit (s); a request past it counts as hung (default 60)")
    ap.add_argument("--json", default=None, help="write a JSON summary here")
    ap.add_argument("--drain-timeout", type=float, default=5.0,
                    help="seconds for the server to go idle after the run (default 5)")
    ap.add_argument("--progress", type=float, default=10.0, help="seconds between progress lines")
    ap.add_argument("--api-key", default=None, help="Bearer key (default $STRATA_API_KEY)")
    ap.add_argument("--startup-timeout", type=float, default=180.0,
                    help="--start: seconds to wait for /health 200")
    ap.add_argument("--server-dir", default=None,
                    help="--start: the server's run directory (its server.log there)")
    args, extra = ap.parse_known_args()
    if extra and not args.start:
        ap.error(f"unrecognized arguments: {' '.join(extra)} (overrides need --start)")
    if args.concurrency < 1 or args.duration <= 0 or args.timeout <= 0:
        ap.error("--concurrency, --duration and --timeout must be positive")
    server = None
    if args.start:
        run_dir = Path(args.server_dir or tempfile.mkdtemp(prefix="strata-soak-run-"))
        print(f"starting a server: {' '.join(extra)} (log {run_dir / 'server.log'})", flush=True)
        try:
            server = Server("soak", extra, run_dir, args.startup_timeout)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        print(f"server ready at {server.base}", flush=True)
        args.base = server.base
    elif args.base is None:
        args.base = "http://127.0.0.1:8000"
    args.base = args.base.rstrip("/")
    try:
        code = soak(args)
    finally:
        if server is not None:
            server.stop()
            print(f"server stopped; log {server.log_path}")
    sys.exit(code)


if __name__ == "__main__":
    main()
