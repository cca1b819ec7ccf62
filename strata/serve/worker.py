"""The engine process: owns `Engine`, loops `step()`, talks to the server over two pipes.

Started by `supervisor.EngineSupervisor` with multiprocessing's *spawn* context. The engine is
single-threaded and this process is its only driver.

Messages: strata.serve.messages (dataclasses of builtins, so the server never needs torch to
unpickle them): Submit, Cancel and Stop in; Ready, Accepted, Rejected, Outputs, Stats and Fatal
out.

The process exits when the server goes away (either pipe breaks), on Stop, or with a
non-zero code (after Fatal) when the engine raises. SIGINT and SIGTERM are ignored: a
terminal's Ctrl-C (or `timeout`, or a service manager) signals the whole process group, and the
server, which gets the same signal, shuts its engine down itself (SIGKILL still works).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Any, Optional

from strata.serve.messages import (Accepted, Cancel, Fatal, Outputs, OutputRow, Ready, Rejected,
                                   Stats, Stop, Submit)

STATS_EVERY_S = 0.25
IDLE_POLL_S = 0.25
#: Text prompts longer than this (characters) are encoded on a thread (_Encoder) while the
#: loop keeps stepping. Inline, a prompt near the 32 MiB body limit held the loop for tens of
#: seconds (about 1 s per MB on a slow CPU): every other request's stream froze, and no
#: heartbeat went out (past server.step_timeout_s the engine was killed as hung).
THREAD_ENCODE_CHARS = 1 << 16


def _log(msg: str) -> None:
    print(f"[engine {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _plain(v: Any) -> Any:
    """Builtins only on the wire (the server does not import torch or numpy to unpickle)."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float, str)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "item"):
        try:
            return v.item()
        except Exception:
            pass
    return str(v)


def _release(eng: Any, rid: str, timings: Optional[dict]) -> Optional[dict]:
    """Drop the engine's record of a finished request; its timings came on the final output."""
    try:
        eng.release(rid)
    except Exception as e:  # never let bookkeeping kill the worker
        _log(f"could not release {rid}: {e}")
    if not timings:
        return None
    r = lambda v: None if v is None else round(float(v), 6)  # noqa: E731
    return {"queue_s": r(timings.get("queue_s")), "prefill_s": r(timings.get("prefill_s")),
            "first_token_s": r(timings.get("ttft_s")), "decode_s": r(timings.get("decode_s")),
            "drafted": int(timings.get("drafted") or 0), "accepted": int(timings.get("accepted") or 0)}


def _build_cfg(cfg_dict: dict) -> Any:
    from omegaconf import OmegaConf

    from strata.config import StrataConfig

    return OmegaConf.merge(OmegaConf.structured(StrataConfig), cfg_dict)


def _submit(eng: Any, rid: str, spec: dict, ids: Optional[list[int]] = None) -> Accepted | Rejected:
    """Add a request to the engine; `ids`: its text prompt, already encoded (_Encoder)."""
    from strata.engine.request import Request, RequestError, SamplingParams

    try:
        if ids is None:
            if spec.get("prompt_ids") is not None:
                ids = list(spec["prompt_ids"])
            elif eng.tokenizer is None:  # (was "AttributeError: 'NoneType' object has no ...")
                return Rejected(rid, "prompt", "is text, and this checkpoint has no "
                                               "tokenizer.json to encode it: send the prompt as "
                                               "token ids")
            else:
                ids = eng.tokenizer.encode(spec["prompt"])
        if not ids:
            return Rejected(rid, "prompt", "prompt is empty (it encodes to no tokens)")
        room = int(eng.max_context) - len(ids)
        mt = spec.get("max_tokens")
        # No max_tokens: fill the context. More than fits: clip (the request ends with
        # finish_reason "length" at the context end). A prompt that leaves no room is the
        # engine's to reject (an over-long prompt), so it sees the asked value.
        if mt is None:
            mt = max(room, 1)
        elif room >= 1 and mt > room:
            mt = room
        params = SamplingParams(max_tokens=mt, temperature=spec["temperature"],
                                top_p=spec["top_p"], top_k=spec["top_k"], seed=spec["seed"],
                                stop=list(spec["stop"]), stop_at_eos=not spec.get("ignore_eos"))
        eng.add_request(Request(id=rid, prompt_ids=ids, params=params, prompt_text=spec.get("prompt")))
    except RequestError as e:
        return Rejected(rid, e.field, e.message)
    except Exception as e:  # a bad input the engine did not classify: still the request's fault
        return Rejected(rid, None, f"{type(e).__name__}: {e}")
    return Accepted(rid, len(ids))


class _Encoder:
    """Encodes long text prompts on one thread, off the step loop, with
    `Tokenizer.encode_nogil` (the same ids as `encode`, without holding the GIL), so the loop
    steps (and sends its heartbeat) while a long prompt is encoded."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.pool: Optional[Any] = None
        self.pending: dict[str, tuple[Any, dict]] = {}   # rid -> (future, spec)
        self.cancelled: set[str] = set()

    def wants(self, spec: dict) -> bool:
        text = spec.get("prompt")
        return (self.tokenizer is not None and spec.get("prompt_ids") is None
                and isinstance(text, str) and len(text) > THREAD_ENCODE_CHARS)

    def start(self, rid: str, spec: dict) -> None:
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="strata-encode")
        self.pending[rid] = (self.pool.submit(self.tokenizer.encode_nogil, spec["prompt"]), spec)

    def cancel(self, rid: str) -> bool:
        if rid in self.pending:
            self.cancelled.add(rid)
            return True
        return False

    def finished(self) -> list[tuple[str, dict, Any, bool]]:
        """(rid, spec, ids or the exception, cancelled meanwhile) of each encoding done."""
        out = []
        for rid, (fut, spec) in list(self.pending.items()):
            if fut.done():
                del self.pending[rid]
                exc = fut.exception()
                out.append((rid, spec, exc if exc is not None else fut.result(),
                            rid in self.cancelled))
                self.cancelled.discard(rid)
        return out


def run_worker(cfg_dict: dict, cmd_conn: Any, out_conn: Any, generation: int) -> None:
    """Process entry point (spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def send(msg: Any) -> None:
        try:
            out_conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            _log("server went away; exiting")
            os._exit(0)

    try:
        from strata.engine.llm_engine import Engine

        cfg = _build_cfg(cfg_dict)
        eng = Engine.from_config(cfg, log=_log)
        eng.trace.keep = False  # a server runs for ever: keep no trace events in memory
        tok = eng.tokenizer
        info = {"model_name": str(eng.model_name), "max_context": int(eng.max_context),
                "pid": os.getpid(), "generation": generation,
                "vocab_size": getattr(tok, "vocab_size", None),
                "eos_ids": list(getattr(tok, "eos_ids", []) or [])}
        try:
            info["slots"] = int(eng.stats().get("slots", 0))
        except Exception:
            pass
    except BaseException as e:
        from strata.config import ConfigError
        from strata.model.config import CheckpointError

        known = isinstance(e, (ConfigError, CheckpointError))   # the message says it all
        send(Fatal(f"engine failed to start: {type(e).__name__}: {e}",
                   None if known else traceback.format_exc()))
        out_conn.close()
        os._exit(2)
    send(Ready(info))

    live: set[str] = set()
    encoder = _Encoder(tok)
    last_stats = 0.0
    was_busy = False
    while True:
        busy = eng.has_work()
        try:
            if cmd_conn.poll(0 if busy else (0.01 if encoder.pending else IDLE_POLL_S)):
                while True:
                    cmd = cmd_conn.recv()
                    if isinstance(cmd, Submit):
                        if encoder.wants(cmd.spec):
                            encoder.start(cmd.req_id, cmd.spec)   # accepted or rejected later
                        else:
                            ev = _submit(eng, cmd.req_id, cmd.spec)
                            if isinstance(ev, Accepted):
                                live.add(cmd.req_id)
                            send(ev)
                    elif isinstance(cmd, Cancel):
                        if cmd.req_id in live:
                            eng.cancel(cmd.req_id)
                        else:
                            encoder.cancel(cmd.req_id)
                    elif isinstance(cmd, Stop):
                        _log("stop requested; closing the engine")
                        try:
                            eng.close()
                        finally:
                            out_conn.close()
                            os._exit(0)
                    if not cmd_conn.poll(0):
                        break
        except (EOFError, OSError):
            _log("server went away; exiting")
            os._exit(0)

        for rid, spec, ids, cancelled in encoder.finished():
            if isinstance(ids, BaseException):
                ev = Rejected(rid, None, f"{type(ids).__name__}: {ids}")
            else:
                ev = _submit(eng, rid, spec, ids)
            if isinstance(ev, Accepted):
                live.add(rid)
                if cancelled:          # the client left while it was encoded: ends as cancel
                    eng.cancel(rid)
            send(ev)

        busy = eng.has_work()
        if busy:
            try:
                outs = eng.step()
            except Exception as e:
                send(Fatal(f"engine step failed: {type(e).__name__}: {e}", traceback.format_exc()))
                out_conn.close()
                os._exit(3)
            if outs:
                rows = []
                for o in outs:
                    timings = _release(eng, o.id, o.timings) if o.finished else None
                    rows.append(OutputRow(o.id, list(o.new_token_ids), o.new_text,
                                          bool(o.finished), None if o.finish_reason is None else str(o.finish_reason), o.error,
                                          int(o.prompt_tokens or 0), int(o.output_tokens or 0),
                                          timings))
                    if o.finished:
                        live.discard(o.id)
                send(Outputs(rows))
            if getattr(eng, "fault", None):  # a dead stage process: restart the whole engine
                send(Fatal(f"engine stopped: {eng.fault}", None))
                out_conn.close()
                os._exit(3)
            busy = eng.has_work()
        now = time.monotonic()
        if now - last_stats >= STATS_EVERY_S or (was_busy and not busy):
            try:
                st = {str(k): _plain(v) for k, v in dict(eng.stats()).items()}
            except Exception as e:
                st = {"stats_error": f"{type(e).__name__}: {e}"}
            send(Stats(st))
            last_stats = now
        was_busy = busy
