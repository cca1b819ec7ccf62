"""A stage process that dies under the HTTP server takes the engine-fault path: the requests in
flight end with an error naming the dead stage, the server answers 503 with Retry-After while
the engine restarts, and the restarted engine (with fresh stage processes) serves again."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from test_server import ServerProc, client, post


def _stage_pids(engine_pid: int) -> list[int]:
    """The engine process's children that are its stages (not multiprocessing's helpers)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == engine_pid and b"resource_tracker" not in cmd:
            out.append(int(d.name))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", ["false", "true"])
def test_a_dead_stage_fails_its_requests_and_restarts_the_engine(tmp_path, pipelined):
    s = ServerProc(tmp_path, "engine.stages=2", f"engine.pipeline_groups={pipelined}")
    try:
        info = s.wait_ready()
        old = info["engine_pid"]
        stages = _stage_pids(old)
        assert len(stages) == 1, stages
        side: dict = {}
        body = {"prompt": "def other():", "max_tokens": 200, "ignore_eos": True}
        t = threading.Thread(target=lambda: side.setdefault("r", post(s, "/v1/completions", body)))
        t.start()
        s.wait_metric("strata_requests_in_flight", lambda v: v >= 1, timeout=20)
        time.sleep(0.5)  # decoding
        os.kill(stages[0], signal.SIGKILL)
        t.join(60)
        r = side["r"]
        assert r.status_code == 500 and "stage 1 process" in r.json()["error"]["message"], r.text
        # while the engine restarts: 503 with Retry-After, then a new engine with new stages
        saw_503 = False
        t_end = time.monotonic() + 120
        while time.monotonic() < t_end:
            h = s.health()
            if h.status_code == 503:
                saw_503 = saw_503 or "retry-after" in h.headers
            elif h.status_code == 200 and h.json()["engine_pid"] != old:
                break
            time.sleep(0.1)
        assert saw_503
        info = s.wait_ready(not_pid=old)
        assert info["restarts"] >= 1 and _stage_pids(info["engine_pid"])
        out = client(s).completions.create(model=info["model"], prompt="def again():",
                                           max_tokens=4, temperature=0)
        assert out.usage.completion_tokens >= 1
    finally:
        s.stop()
