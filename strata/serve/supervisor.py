"""Server side of the engine process: start it, talk to it, restart it when it dies.

One supervisor thread per server. For each engine *generation* it spawns a process running
`worker.run_worker`, opens two one-way pipes (commands out, events in), and reads events until
the pipe reports EOF (the process exited, whatever the cause: a crash, SIGKILL, the OOM killer).
Then it fails every request of that generation, waits `server.restart_delay_s`, and starts the
next generation. Everything that touches request state runs on the asyncio loop
(`call_soon_threadsafe`), so handlers never race with each other.

Why pipes and not multiprocessing.Queue: the server closes its copies of the child's ends, so a
dead child is seen as EOF at once and a half-written message can never block the reader; a
sender thread per generation keeps a slow or dead child from blocking the event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import queue
import threading
import time
from typing import Any, Callable, Optional

from strata.serve.messages import (Accepted, Cancel, Fatal, Outputs, OutputRow, Ready, Rejected,
                                   Stats, Stop, Submit)
from strata.serve.metrics import ServerMetrics
from strata.serve.worker import run_worker

log = logging.getLogger("strata.serve")

#: Longest pause between restarts of an engine that keeps dying before it is ready.
MAX_BACKOFF_S = 30.0


class Handle:
    """One request in flight: its events arrive on `q` (see worker.py for their shapes)."""

    __slots__ = ("rid", "gen", "q", "t_submit", "t_first", "prompt_tokens", "cancelled")
    #: Outcome counted when the engine confirms a cancel: "cancel" (client gone) or "timeout".

    def __init__(self, rid: str, gen: int):
        self.rid = rid
        self.gen = gen
        self.q: asyncio.Queue = asyncio.Queue()
        self.t_submit = time.monotonic()
        self.t_first: Optional[float] = None
        self.prompt_tokens = 0
        self.cancelled: Optional[str] = None


class EngineSupervisor:
    def __init__(self, cfg_dict: dict, restart_delay_s: float = 1.0,
                 on_fatal: Optional[Callable[[str], None]] = None, step_timeout_s: float = 0.0):
        self.cfg_dict = cfg_dict
        self.restart_delay_s = max(0.0, float(restart_delay_s))
        self.step_timeout_s = max(0.0, float(step_timeout_s))
        self.on_fatal = on_fatal
        self.metrics = ServerMetrics()
        # Loop-thread state.
        self.state = "loading"          # loading | ready | restarting | failed | stopped
        self.info: dict = {}
        self.generation = 0
        self.pid: Optional[int] = None
        self.handles: dict[str, Handle] = {}
        self.fatal_message: Optional[str] = None
        self.last_exit: Optional[str] = None
        self._sendq: Optional[queue.SimpleQueue] = None
        # Thread state.
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._proc: Optional[Any] = None

    # ------------------------------------------------------------------ loop-thread API
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="strata-supervisor", daemon=True)
        self._thread.start()
        atexit.register(self._kill_now)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def retry_after(self) -> int:
        return max(1, int(self.restart_delay_s + 0.999))

    def submit(self, rid: str, spec: dict) -> Handle:
        h = Handle(rid, self.generation)
        self.handles[rid] = h
        assert self._sendq is not None
        self._sendq.put(Submit(rid, spec))
        return h

    def cancel(self, rid: str, outcome: str = "cancel") -> None:
        """Ask the engine to drop a request; `outcome` labels it in strata_requests_total."""
        h = self.handles.get(rid)
        if h is None or h.cancelled:
            return
        h.cancelled = outcome
        if h.gen == self.generation and self._sendq is not None:
            self._sendq.put(Cancel(rid))

    async def shutdown(self) -> None:
        self._stop.set()
        if self._sendq is not None:
            self._sendq.put(Stop())
        self._fail_all(None, "the server is shutting down; the request was not completed")
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 15.0)
        self._kill_now()
        self.state = "stopped"

    # ------------------------------------------------------------------ event handlers (loop)
    def _post(self, fn: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _on_starting(self, gen: int, sendq: queue.SimpleQueue, pid: Optional[int]) -> None:
        self.generation = gen
        self._sendq = sendq
        self.pid = pid
        if self.state != "stopped":
            self.state = "loading"

    def _on_event(self, gen: int, msg: Any) -> None:
        if gen != self.generation:
            return
        if isinstance(msg, Outputs):
            for row in msg.rows:
                self._on_output(row)
        elif isinstance(msg, Stats):
            self.metrics.on_stats(msg.stats)
        elif isinstance(msg, Accepted):
            h = self.handles.get(msg.req_id)
            if h is not None:
                h.prompt_tokens = msg.prompt_tokens
                self.metrics.prompt_tokens += msg.prompt_tokens
                h.q.put_nowait(("accepted", msg.prompt_tokens))
        elif isinstance(msg, Rejected):
            h = self.handles.pop(msg.req_id, None)
            self.metrics.reject("invalid")
            if h is not None:
                h.q.put_nowait(("rejected", msg.field, msg.message))
        elif isinstance(msg, Ready):
            self.info = dict(msg.info)
            self.pid = self.info.get("pid", self.pid)
            if self.state != "stopped":
                self.state = "ready"
            log.info("engine ready (pid %s, generation %d): model=%s max_context=%s slots=%s",
                     self.pid, gen, self.info.get("model_name"), self.info.get("max_context"),
                     self.info.get("slots"))
        elif isinstance(msg, Fatal):
            self.last_exit = str(msg.message).strip().splitlines()[0]

    def _on_output(self, row: OutputRow) -> None:
        h = self.handles.get(row.req_id)
        if h is None:
            return
        now = time.monotonic()
        if h.t_first is None and row.new_token_ids:
            h.t_first = now
            self.metrics.ttft.observe(now - h.t_submit)
        if row.finished:
            reason = row.finish_reason
            self.handles.pop(row.req_id, None)
            self.metrics.finished((h.cancelled or "cancel") if reason == "cancel" else (reason or "stop"))
            if reason in ("stop", "length"):
                self.metrics.duration.observe(now - h.t_submit)
        h.q.put_nowait(("out", row))

    def _on_exit(self, gen: int, exitcode: Optional[int], fatal: Optional[str],
                 final: bool) -> None:
        self.metrics.on_engine_exit()
        if final or self._stop.is_set():
            self.state = "stopped"
            self._fail_all(gen, "the engine process stopped; the request was not completed")
            return
        self.metrics.restarts += 1
        self.state = "restarting"
        why = f"exit code {exitcode}" if exitcode is None or exitcode >= 0 else f"signal {-exitcode}"
        detail = ""
        if fatal:
            detail = ": " + fatal.strip().splitlines()[0]
        self.last_exit = f"engine process {self.pid} died ({why}){detail}"
        log.error("%s; failing %d in-flight request(s); restarting in %.1f s", self.last_exit,
                  sum(1 for h in self.handles.values() if h.gen == gen), self.restart_delay_s)
        self._fail_all(gen, f"{self.last_exit}; the request was not completed. The server is "
                            "restarting the engine: retry shortly")

    def _on_failed(self, message: str) -> None:
        self.state = "failed"
        self.fatal_message = message
        if self.on_fatal is not None:
            self.on_fatal(message)

    def _fail_all(self, gen: Optional[int], message: str) -> None:
        for rid, h in list(self.handles.items()):
            if gen is None or h.gen == gen:
                self.handles.pop(rid, None)
                self.metrics.finished("error")
                h.q.put_nowait(("error", message))

    # ------------------------------------------------------------------ supervisor thread
    def _run(self) -> None:
        ctx = mp.get_context("spawn")
        gen = 0
        ever_ready = False
        backoff = self.restart_delay_s
        while not self._stop.is_set():
            gen += 1
            cmd_r, cmd_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_worker, args=(self.cfg_dict, cmd_r, out_w, gen),
                               name=f"strata-engine-{gen}", daemon=False)
            try:
                proc.start()
            except Exception as e:
                self._post(self._on_failed, f"cannot start the engine process: {type(e).__name__}: {e}")
                return
            self._proc = proc
            cmd_r.close()
            out_w.close()
            sendq: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_sender, args=(sendq, cmd_w), daemon=True,
                             name=f"strata-sender-{gen}").start()
            self._post(self._on_starting, gen, sendq, proc.pid)
            log.info("engine process %d started (generation %d); loading the model", proc.pid, gen)

            ready, fatal = False, None
            last_msg = time.monotonic()
            while True:
                try:
                    if not out_r.poll(0.5):
                        if not proc.is_alive() and not out_r.poll(0.05):
                            break
                        silent = time.monotonic() - last_msg
                        if ready and self.step_timeout_s and silent > self.step_timeout_s and fatal is None:
                            # Alive but silent: a hung step (a stuck device call, a deadlock).
                            fatal = (f"engine hung: no step or heartbeat for {silent:.0f} s "
                                     f"(server.step_timeout_s={self.step_timeout_s:g})")
                            log.error("engine process %d: %s; killing it", proc.pid, fatal)
                            proc.kill()
                        continue
                    msg = out_r.recv()
                    last_msg = time.monotonic()
                except (EOFError, OSError):
                    break
                except Exception as e:  # an event that does not unpickle: log it, keep going
                    log.error("bad message from the engine process: %s: %s", type(e).__name__, e)
                    continue
                if isinstance(msg, Ready):
                    ready = True
                elif isinstance(msg, Fatal):
                    fatal = str(msg.message).strip()
                    tb = msg.traceback
                    log.error("engine process %d: %s%s", proc.pid, fatal,
                              f"\n{tb.rstrip()}" if tb else "")
                self._post(self._on_event, gen, msg)
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
            sendq.put(None)
            out_r.close()
            stopping = self._stop.is_set()
            final = not ready and not ever_ready
            self._post(self._on_exit, gen, proc.exitcode, fatal, stopping or final)
            if stopping:
                return
            if final:
                self._post(self._on_failed, fatal or "the engine failed to start: its process "
                           f"exited with code {proc.exitcode} before it was ready")
                return
            if ready:
                ever_ready = True
                backoff = self.restart_delay_s
            else:
                backoff = min(MAX_BACKOFF_S, max(2 * backoff, self.restart_delay_s, 0.5))
            self._stop.wait(backoff if not ready else self.restart_delay_s)

    def _kill_now(self) -> None:
        """Last resort (the engine process ignores SIGTERM; see worker.py)."""
        p = self._proc
        if p is not None and p.is_alive():
            p.kill()
            p.join(3.0)


def _sender(sendq: queue.SimpleQueue, conn: Any) -> None:
    while True:
        msg = sendq.get()
        if msg is None:
            break
        try:
            conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            break
    try:
        conn.close()
    except OSError:
        pass
