"""The HTTP face: FastAPI routes over an `EngineSupervisor` (docs/SERVING.md describes them).

Request flow: authenticate -> read the body (size-capped, strict UTF-8, strict JSON) -> validate
(protocol.parse_request) -> check the model name -> admission (429 past server.max_pending, 503
while the engine loads or restarts) -> submit to the engine process -> wait for its verdict
(accepted, or rejected with the field at fault: 400) -> stream (SSE) or collect the output.
A client that goes away cancels its request; the engine frees its slot at its next step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from strata.serve import protocol as P
from strata.serve.api_key import resolve_api_key
from strata.serve.supervisor import EngineSupervisor, Handle

log = logging.getLogger("strata.serve")

#: Largest request body accepted (bytes); more gets 413.
MAX_BODY_BYTES = 32 << 20


class SSEResponse(StreamingResponse):
    """Server-sent events that stop (and cancel the request) as soon as the client leaves.

    Starlette only listens for the disconnect on ASGI servers older than spec 2.4; this always
    does, so a client that hangs up while its request still waits in the queue is noticed too.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def run() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        tg.cancel_scope.cancel()
                        break
        finally:
            # Also covers a client gone before the generator ever ran (its finally never runs).
            self.on_close()


def coalesce_outs(q: asyncio.Queue, ev: tuple) -> tuple[tuple, Optional[tuple]]:
    """Join the output rows already queued behind the output event `ev` into one row (token
    ids and text concatenated, the rest from the latest), up to a finished row. Under load the
    engine emits faster than one client's stream is written, and every SSE event costs the
    server process ~150 us of CPU whatever it carries. Returns the merged event and the first
    queued event that is not an output row (to be handled next), if one was taken."""
    row = ev[1]
    while not row.finished and not q.empty():
        nxt = q.get_nowait()
        if nxt[0] != "out":
            return ("out", row), nxt
        row = row.joined(nxt[1])
    return ("out", row), None


def gives_max_tokens(body: dict, kind: str) -> bool:
    """Whether a request body sets its own output length (else server.default_max_tokens)."""
    keys = ("max_tokens", "max_completion_tokens") if kind == "chat" else ("max_tokens",)
    return any(body.get(k) is not None for k in keys)


def _err(e: P.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(cfg_dict: dict, server_cfg: Any) -> FastAPI:
    scfg = server_cfg
    api_key: Optional[str] = resolve_api_key(scfg)
    default_max_tokens = int(scfg.default_max_tokens)
    max_pending = int(scfg.max_pending)
    queue_timeout = float(scfg.queue_timeout_s) if scfg.queue_timeout_s and scfg.queue_timeout_s > 0 else None
    fatal_hooks: list = []

    def on_fatal(msg: str) -> None:
        for hook in fatal_hooks:
            hook(msg)

    sup = EngineSupervisor(cfg_dict, restart_delay_s=scfg.restart_delay_s, on_fatal=on_fatal,
                           step_timeout_s=scfg.step_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sup.start(asyncio.get_running_loop())
        yield
        await sup.shutdown()

    app = FastAPI(title="strata", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.sup = sup
    app.state.fatal_hooks = fatal_hooks

    def served_name() -> Optional[str]:
        return scfg.model_name or sup.info.get("model_name")

    def unavailable() -> P.ApiError:
        if sup.state == "failed":
            return P.ApiError(503, f"the engine failed: {sup.fatal_message}", code="engine_failed")
        what = {"loading": "the model is loading", "restarting": "the engine is restarting",
                "stopped": "the server is shutting down"}.get(sup.state, sup.state)
        return P.ApiError(503, f"{what}; retry shortly", code="engine_unavailable",
                          headers={"Retry-After": str(sup.retry_after())})

    def check_auth(request: Request) -> None:
        if not api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                  api_key.encode()):
            sup.metrics.reject("unauthorized")
            raise P.ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > MAX_BODY_BYTES:
            raise P.ApiError(413, f"request body is {cl} bytes; the limit is {MAX_BODY_BYTES}",
                             code="body_too_large")
        buf = bytearray()
        try:
            async for part in request.stream():
                buf += part
                if len(buf) > MAX_BODY_BYTES:
                    raise P.ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes",
                                     code="body_too_large")
        except ClientDisconnect:
            raise P.ApiError(400, "client disconnected while sending the body") from None
        return bytes(buf)

    # ---------------------------------------------------------------- errors
    @app.exception_handler(P.ApiError)
    async def _api_error(request: Request, e: P.ApiError) -> JSONResponse:
        return _err(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(
            e.status_code, str(e.detail))
        return JSONResponse(P.error_body(msg, P._default_type(e.status_code)),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(P.error_body(f"internal server error: {type(e).__name__}: {e}",
                                         "server_error", code="internal_error"), status_code=500)

    # ---------------------------------------------------------------- plain endpoints
    # HEAD too: load balancers and uptime monitors probe with it (the status without the body)
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        body = {"status": "ok" if sup.ready else sup.state, "model": served_name(),
                "engine_pid": sup.pid, "generation": sup.generation,
                "restarts": sup.metrics.restarts, "max_context": sup.info.get("max_context"),
                "in_flight": len(sup.handles)}
        if sup.last_exit:
            body["last_exit"] = sup.last_exit
        if sup.ready:
            return JSONResponse(body)
        headers = {} if sup.state == "failed" else {"Retry-After": str(sup.retry_after())}
        return JSONResponse(body, status_code=503, headers=headers)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = sup.metrics.render(up=sup.ready, state=sup.state, in_flight=len(sup.handles),
                                  max_pending=max_pending, model=served_name())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": served_name(), "object": "model", "created": int(sup.metrics.started),
                "owned_by": "strata", "max_model_len": sup.info.get("max_context")}

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        if served_name() is None:
            raise unavailable()
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        check_auth(request)
        if served_name() is None:
            raise unavailable()
        if model_id != served_name():
            raise P.ApiError(404, f"model '{model_id}' is not served here; this server serves "
                             f"'{served_name()}'", param="model", code="model_not_found")
        return JSONResponse(model_card())

    # ---------------------------------------------------------------- generation
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def next_event(h: Handle, deadline: Optional[float]) -> tuple:
        if deadline is None:
            return await h.q.get()
        try:
            return await asyncio.wait_for(h.q.get(), max(0.0, deadline - time.monotonic()))
        except (asyncio.TimeoutError, TimeoutError):
            return ("timeout",)

    def timeout_message() -> str:
        return (f"the request waited longer than server.queue_timeout_s ({queue_timeout:g} s) "
                "for its first token; the server is overloaded")

    def failure_response(ev: tuple, rid: str) -> Optional[Response]:
        """The response for an engine event that ends a request before it completes, else None."""
        if ev[0] == "timeout":
            sup.cancel(rid, "timeout")
            return _err(P.ApiError(503, timeout_message(), code="queue_timeout",
                                   headers={"Retry-After": str(sup.retry_after())}))
        if ev[0] == "error":
            return _err(P.ApiError(500, ev[1], code="engine_failure",
                                   headers={"Retry-After": str(sup.retry_after())}))
        return None

    async def generate(request: Request, kind: str) -> Response:
        try:
            check_auth(request)
            body = P.parse_json_body(await read_body(request))
            req = P.parse_request(body, kind)
            if not gives_max_tokens(body, kind):
                req.max_tokens = default_max_tokens  # not the rest of the context
            name = served_name()
            if req.model is not None and name is not None and req.model != name:
                raise P.bad(f"model '{req.model}' is not served here; this server serves "
                            f"'{name}' (GET /v1/models)", param="model", code="model_not_found")
            if len(sup.handles) >= max_pending:
                sup.metrics.reject("overloaded")
                raise P.ApiError(429, f"too many requests in flight ({len(sup.handles)}; "
                                 f"server.max_pending={max_pending}); retry shortly",
                                 code="too_many_requests", headers={"Retry-After": "1"})
            if not sup.ready:
                sup.metrics.reject("unavailable")
                raise unavailable()
        except P.ApiError as e:
            if e.status == 400:
                sup.metrics.reject("invalid")
            return _err(e)

        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        created = P.now()
        model_name = served_name() or ""
        deadline = time.monotonic() + queue_timeout if queue_timeout else None
        h = sup.submit(rid, req.engine_spec())
        try:
            ev = await next_event(h, deadline)
        except asyncio.CancelledError:
            sup.cancel(rid)
            raise
        if ev[0] == "rejected":
            field, message = ev[1], ev[2]
            param = {"prompt_ids": "prompt"}.get(field, field)
            if kind == "chat" and param == "prompt":
                param = "messages"
            text = f"'{param}' {message}" if param else message
            return _err(P.ApiError(400, text, param=param, code="invalid_request"))
        failed = failure_response(ev, rid)
        if failed is not None:
            return failed
        prompt_tokens = ev[1]
        if req.stream:
            return SSEResponse(stream(req, h, rid, created, model_name, prompt_tokens, deadline),
                               on_close=lambda: sup.cancel(rid))
        return await collect(request, req, h, rid, created, model_name, prompt_tokens, deadline)

    async def stream(req: P.GenRequest, h: Handle, rid: str, created: int, model_name: str,
                     prompt_tokens: int, deadline: Optional[float]) -> AsyncIterator[bytes]:
        done = False
        out_tokens = 0
        held: Optional[tuple] = None  # an event taken from the queue while coalescing
        try:
            if req.kind == "chat":
                yield P.sse(P.chunk(req, rid, model_name, created, None, role=True,
                                    usage_now=P.usage(prompt_tokens, 0)))
            while True:
                if held is not None:
                    ev, held = held, None
                else:
                    ev = await next_event(h, deadline if out_tokens == 0 else None)
                if ev[0] == "out":
                    ev, held = coalesce_outs(h.q, ev)
                if ev[0] == "timeout":
                    sup.cancel(rid, "timeout")
                    done = True
                    yield P.sse(P.error_body(timeout_message(), "service_unavailable",
                                             code="queue_timeout"))
                    yield P.sse("[DONE]")
                    return
                if ev[0] == "error":
                    done = True
                    yield P.sse(P.error_body(ev[1], "server_error", code="engine_failure"))
                    yield P.sse("[DONE]")
                    return
                row = ev[1]
                text, finished, reason, timings = row.new_text, row.finished, row.finish_reason, row.timings
                out_tokens = row.output_tokens or out_tokens + len(row.new_token_ids)
                if finished and reason in ("error", "cancel"):
                    done = True
                    msg = row.error or ("the engine cancelled the request" if reason == "cancel"
                                    else "the engine failed the request")
                    yield P.sse(P.error_body(msg, "server_error", code="engine_failure"))
                    yield P.sse("[DONE]")
                    return
                if text:
                    yield P.sse(P.chunk(req, rid, model_name, created, text,
                                        usage_now=P.usage(prompt_tokens, out_tokens)))
                if finished:
                    done = True
                    yield P.sse(P.chunk(req, rid, model_name, created, "", reason=reason,
                                        usage_now=P.usage(prompt_tokens, out_tokens),
                                        timings=timings))
                    if req.include_usage:
                        yield P.sse(P.usage_chunk(req, rid, model_name, created, prompt_tokens,
                                                  out_tokens))
                    yield P.sse("[DONE]")
                    return
        finally:
            if not done:          # the client went away (or the stream broke): free the slot
                sup.cancel(rid)

    async def wait_disconnect(request: Request) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    async def collect(request: Request, req: P.GenRequest, h: Handle, rid: str, created: int,
                      model_name: str, prompt_tokens: int, deadline: Optional[float]) -> Response:
        async def run() -> Response:
            texts: list[str] = []
            out_tokens = 0
            while True:
                ev = await next_event(h, deadline if out_tokens == 0 else None)
                failed = failure_response(ev, rid)
                if failed is not None:
                    return failed
                row = ev[1]
                out_tokens = row.output_tokens or out_tokens + len(row.new_token_ids)
                texts.append(row.new_text)
                if row.finished:
                    reason = row.finish_reason
                    if reason in ("error", "cancel"):
                        msg = row.error or f"the engine ended the request ({reason})"
                        return _err(P.ApiError(500, msg, code="engine_failure"))
                    return JSONResponse(P.full_response(req, rid, model_name, created,
                                                        "".join(texts), reason, prompt_tokens,
                                                        out_tokens, row.timings))

        work = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished = work.done()
            if not finished:          # the client went away first (or we were cancelled)
                work.cancel()
                sup.cancel(rid)
            gone.cancel()
        if not finished:
            return Response(status_code=499)   # nobody is listening any more
        return work.result()

    return app

