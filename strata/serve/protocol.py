"""OpenAI wire format: request parsing and validation, the chat template, response bodies.

Pure functions with no server state, so they are easy to test and to read. Every validation
failure raises `ApiError` naming the offending field (`param`), which the app turns into an
OpenAI-style JSON error: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from strata.engine.request import RequestError, SamplingParams, unpaired_surrogate

#: Most stop strings a request may carry.
MAX_STOP = 16
#: Stop string added to every chat request: the template's next user turn (see chat_prompt).
CHAT_STOP = "\nUser:"

_ROLE_LABEL = {"system": "System", "developer": "System", "user": "User",
               "assistant": "Assistant", "tool": "Tool"}


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type_: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def _default_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            405: "invalid_request_error", 413: "invalid_request_error",
            429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")


def error_body(message: str, type_: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# --------------------------------------------------------------------------------------------
# Parsing


@dataclass
class GenRequest:
    """A validated completion or chat request, ready for the engine."""
    kind: str                            # "completion" | "chat"
    model: Optional[str]
    prompt_text: Optional[str] = None    # exactly one of prompt_text / prompt_ids is set
    prompt_ids: Optional[list[int]] = None
    max_tokens: Optional[int] = None     # None: fill the context (chat) -- see engine_spec
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    seed_given: bool = False
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    ignore_eos: bool = False

    def engine_spec(self) -> dict:
        """The plain dict sent to the engine process (see worker.submit)."""
        return {"prompt": self.prompt_text, "prompt_ids": self.prompt_ids,
                "max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": list(self.stop), "ignore_eos": self.ignore_eos}


def parse_json_body(raw: bytes) -> dict:
    """Strict UTF-8, strict JSON, must be an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"request body is not valid UTF-8 (byte {e.start}: {e.reason})",
                  code="invalid_utf8") from None
    if not text.strip():
        raise bad("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise bad(f"malformed JSON in request body: {e.msg} (line {e.lineno}, column {e.colno})",
                  code="invalid_json") from None
    except ValueError as e:
        raise bad(f"malformed JSON in request body: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad("malformed JSON in request body: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {type(body).__name__}",
                  code="invalid_json")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _text(v: str, param: str) -> str:
    """`v`, or 400 when it is not Unicode text (request.unpaired_surrogate)."""
    problem = unpaired_surrogate(v)
    if problem:
        raise bad(f"'{param}' is not valid Unicode: {problem}", param=param,
                  code="invalid_unicode")
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt_bool(body: dict, key: str, default: bool = False, prefix: str = "") -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        name = prefix + key  # the field's full path, e.g. stream_options.include_usage
        raise bad(f"'{name}' must be a boolean, got {json.dumps(v)[:40]}", param=name)
    return v


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:       # an int too large for a float
        return False


def _opt_num(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    # An int too large for a float (JSON allows 4300 digits) is not finite either: math.isfinite
    # raised OverflowError on it (a 500).
    if not _is_num(v) or not _finite(v):
        raise bad(f"'{key}' must be a finite number, got {json.dumps(v)[:40]}", param=key)
    return float(v)


def _token_list(v: list, param: str) -> list[int]:
    for i, t in enumerate(v):
        if not _is_int(t):
            raise bad(f"'{param}' token ids must be integers; item {i} is {json.dumps(t)[:40]}",
                      param=param, code="invalid_token_ids")
        if t < 0:
            raise bad(f"'{param}' token ids must be >= 0; item {i} is {t}",
                      param=param, code="invalid_token_ids")
    return list(v)


def _parse_prompt(body: dict, req: GenRequest) -> None:
    if "prompt" not in body or body["prompt"] is None:
        raise bad("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                 # ["text"] or [[1, 2, 3]]: one prompt in batch form
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise bad(f"'prompt' holds {len(p)} prompts; this server takes one prompt per request",
                  param="prompt", code="unsupported")
    if isinstance(p, str):
        if p == "":
            raise bad("'prompt' is empty", param="prompt", code="empty_prompt")
        req.prompt_text = _text(p, "prompt")
    elif isinstance(p, list):
        if not p:
            raise bad("'prompt' is empty", param="prompt", code="empty_prompt")
        req.prompt_ids = _token_list(p, "prompt")
    else:
        raise bad("'prompt' must be a string or a list of token ids", param="prompt")


def _message_text(msg: dict, i: int) -> str:
    content = msg.get("content")
    param = f"messages[{i}].content"
    if content is None:
        if msg.get("role") == "assistant":
            return ""
        raise bad(f"'{param}' is required", param=param)
    if isinstance(content, str):
        return _text(content, param)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad(f"'{param}[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}};"
                          " only text is supported", param=param)
            parts.append(_text(part["text"], f"{param}[{j}].text"))
        return "".join(parts)
    raise bad(f"'{param}' must be a string or a list of text parts", param=param)


def chat_prompt(messages: list[dict]) -> str:
    """The plain-text chat template (docs/SERVING.md): one block per message, then the cue.

        System: <system text>
        <blank line>
        User: <user text>
        <blank line>
        Assistant:

    The model continues after "Assistant:"; generation stops at "\\nUser:" (CHAT_STOP).
    """
    blocks = [f"{_ROLE_LABEL[m['role']]}: {m['text']}" for m in messages]
    blocks.append("Assistant:")
    return "\n\n".join(blocks)


def _parse_messages(body: dict) -> str:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLE_LABEL:  # a list/dict is unhashable
            raise bad(f"'messages[{i}].role' must be one of {sorted(_ROLE_LABEL)}, got "
                      f"{json.dumps(role)[:40]}", param=f"messages[{i}].role")
        out.append({"role": role, "text": _message_text(m, i)})
    return chat_prompt(out)


def _neutral(*values: Any):
    """Accepts None or one of `values`, a JSON bool only where the neutral value is one
    (Python's True == 1 would otherwise let `"n": true` through)."""
    return lambda v: v is None or any(v == n and isinstance(v, bool) == isinstance(n, bool)
                                      for n in values)


# Fields we know but do not implement: rejected when set to anything but their neutral value.
_UNSUPPORTED = {
    "n": _neutral(1),
    "best_of": _neutral(1),
    "echo": _neutral(False),
    "suffix": _neutral(""),
    "logprobs": _neutral(False, 0),
    "top_logprobs": _neutral(0),
    "logit_bias": _neutral({}),
    "presence_penalty": _neutral(0),
    "frequency_penalty": _neutral(0),
    "tools": _neutral([]),
    "functions": _neutral([]),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
}


def parse_request(body: dict, kind: str) -> GenRequest:
    """Validate an OpenAI completion (`kind="completion"`) or chat request body."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", param="model")
    if model is not None:
        _text(model, "model")  # echoed in the unknown-model error
    req = GenRequest(kind=kind, model=model)

    for key, ok in _UNSUPPORTED.items():
        if key in body and not ok(body[key]):
            raise bad(f"'{key}' is not supported by this server (got {json.dumps(body[key])[:60]})",
                      param=key, code="unsupported")

    if kind == "completion":
        _parse_prompt(body, req)
    else:
        req.prompt_text = _parse_messages(body)

    mt = body.get("max_tokens")
    if mt is None and kind == "chat":
        mt = body.get("max_completion_tokens")
        mkey = "max_completion_tokens"
    else:
        mkey = "max_tokens"
    if mt is None:
        req.max_tokens = 16 if kind == "completion" else None
    elif not _is_int(mt):
        raise bad(f"'{mkey}' must be a positive integer, got {json.dumps(mt)[:40]}", param=mkey)
    elif mt < 1:
        raise bad(f"'{mkey}' must be a positive integer, got {mt}", param=mkey)
    else:
        req.max_tokens = mt

    req.temperature = _opt_num(body, "temperature", 1.0)
    req.top_p = _opt_num(body, "top_p", 1.0)
    tk = body.get("top_k")
    if tk is None or tk == -1:
        req.top_k = 0
    elif not _is_int(tk):
        raise bad(f"'top_k' must be an integer (0 or -1 = off), got {json.dumps(tk)[:40]}", param="top_k")
    else:
        req.top_k = tk
    seed = body.get("seed")
    if seed is None:
        req.seed = secrets.randbits(63)
    elif not _is_int(seed):
        raise bad(f"'seed' must be an integer, got {json.dumps(seed)[:40]}", param="seed")
    else:
        req.seed, req.seed_given = seed, True

    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [_text(stop, "stop")]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = [_text(x, f"stop[{i}]") for i, x in enumerate(stop)]
    else:
        raise bad("'stop' must be a string or a list of strings", param="stop")
    if any(s == "" for s in stops):
        raise bad("'stop' strings must be non-empty", param="stop")
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' holds {len(stops)} strings; at most {MAX_STOP}", param="stop")
    if kind == "chat" and CHAT_STOP not in stops:
        stops.append(CHAT_STOP)
    req.stop = stops

    req.stream = _opt_bool(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", param="stream_options")
        req.include_usage = _opt_bool(so, "include_usage", prefix="stream_options.")
        req.continuous_usage = _opt_bool(so, "continuous_usage_stats", prefix="stream_options.")
    req.ignore_eos = _opt_bool(body, "ignore_eos")

    # The engine's own rules, checked here too so the message names the request field.
    try:
        SamplingParams(max_tokens=req.max_tokens or 1, temperature=req.temperature,
                       top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                       stop=req.stop).validate()
    except RequestError as e:
        param = mkey if e.field == "max_tokens" else e.field
        raise bad(f"'{param}' {e.message}", param=param) from None
    return req


# --------------------------------------------------------------------------------------------
# Responses


def finish_reason(engine_reason: Optional[str]) -> Optional[str]:
    """OpenAI finish reasons are stop|length; the engine also says cancel|error."""
    if engine_reason == "length":
        return "length"
    if engine_reason is None:
        return None
    return "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(req: GenRequest, rid: str, model: str, created: int, text: str,
                  reason: Optional[str], prompt_tokens: int, completion_tokens: int,
                  timings: Optional[dict] = None) -> dict:
    if req.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason(reason)}
        obj = "chat.completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
           "usage": usage(prompt_tokens, completion_tokens)}
    if timings:
        out["timings"] = timings
    return out


def chunk(req: GenRequest, rid: str, model: str, created: int, text: Optional[str],
          reason: Optional[str] = None, role: bool = False,
          usage_now: Optional[dict] = None, timings: Optional[dict] = None) -> dict:
    """One streamed chunk: a text delta (or the chat role opener, or the final reason)."""
    if req.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason(reason)}
        obj = "text_completion"
    else:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        elif text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None,
                  "finish_reason": finish_reason(reason)}
        obj = "chat.completion.chunk"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = usage_now if req.continuous_usage else None
    if timings:
        out["timings"] = timings     # extension: engine timings of the request (final chunk)
    return out


def usage_chunk(req: GenRequest, rid: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def sse(data: Any) -> bytes:
    if isinstance(data, str):
        return f"data: {data}\n\n".encode()
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def now() -> int:
    return int(time.time())
