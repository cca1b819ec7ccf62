"""A trace's own host time: the writer stamps device events with the seconds it has spent, and
a cost profile fitted from the trace takes that time out of the host gaps (an engine as
served writes no trace)."""

from __future__ import annotations

import io

import pytest

from sim.profile import _host_samples, fit_host
from strata.trace import TraceWriter


def test_writer_stamps_device_events_with_its_own_time():
    ticks = iter(range(1000))
    tw = TraceWriter(stream=io.StringIO(), clock=lambda: float(next(ticks)))
    tw.keep = True
    tw.emit("admit", req="a", slot=0)
    tw.emit("prefill", req="a", slot=0, tokens=4, dur=1.0, ctx=4)
    tw.emit("commit", req="a", slot=0, drafted=1, accepted=1, emitted=2)
    tw.emit("window", layout=[0, 0], key="k", graph="hit", rows=2, dur=1.0, ctx=8)
    admit, prefill, commit, window = tw.events
    assert "trace_s" not in admit and "trace_s" not in commit
    # each emit reads the clock twice (1 s apart here): the admit's second before the prefill,
    # both the prefill's and the commit's before the window
    assert prefill["trace_s"] == 1.0 and window["trace_s"] == 3.0
    assert tw.spent_s == 4.0
    # an engine as served (no file, nothing kept) spends nothing
    quiet = TraceWriter()
    quiet.keep = False
    assert quiet.emit("window", layout=[0], key="k", graph="hit", rows=1) is None
    assert quiet.spent_s == 0.0


def windows(gaps_us: list[float], trace_us: list[float]) -> list[dict]:
    """One 1-row window per step, 100 us each, the host gaps between them as given, the
    writer's time stamped as given (cumulative)."""
    out, t, spent = [{"ev": "config", "step": 0, "t": 0.0, "engine": {}, "memory": {}}], 0.0, 0.0
    for step, (gap, tr) in enumerate(zip([0.0] + gaps_us, [0.0] + trace_us)):
        t += (gap + 100.0) * 1e-6
        spent += tr * 1e-6
        out.append({"ev": "window", "step": step, "t": t, "layout": [0], "key": "k",
                    "graph": "hit", "rows": 1, "dur": 100e-6, "ctx": 256,
                    "trace_s": spent})
        out.append({"ev": "commit", "step": step, "t": t, "req": "a", "slot": 0,
                    "drafted": 0, "accepted": 0, "emitted": 1})
    return out


def test_host_gaps_leave_out_the_traces_own_time():
    # 40 us gaps, of which the writer spent 15 us: the engine as served spends 25 us
    samples = _host_samples(windows([40.0] * 20, [15.0] * 20))
    assert [g for *_, g in samples[1:]] == pytest.approx([25e-6] * 20)
    fixed, per_commit, *_ = fit_host(samples[1:])
    assert fixed + per_commit == pytest.approx(25e-6)
    # a trace written before the stamps keeps its gaps as measured
    old = [{k: v for k, v in e.items() if k != "trace_s"} for e in windows([40.0] * 5, [15.0] * 5)]
    assert [g for *_, g in _host_samples(old)[1:]] == pytest.approx([40e-6] * 5)
