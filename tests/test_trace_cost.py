"""A trace's own host time: the writer stamps device events with the seconds it has spent, and
a cost profile fitted from the trace takes that time out of the host gaps (an engine as
served writes no trace)."""

from __future__ import annotations

import io

import pytest

from sim.profile import FitError, _host_samples, fit_host
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


def test_untraced_twin_walls_scale_the_host_time():
    from sim.profile import untraced_host_factor

    # 21 windows of 100 us, 20 gaps of 40 us of which the writer spent 15: traced wall 2.9 ms,
    # the fit's host time 0.5 ms; untraced twins of 2.5 ms and 2.35 ms spend 0.4 and 0.25 ms
    ev = windows([40.0] * 20, [15.0] * 20)
    one = untraced_host_factor([(ev, 2.9e-3, 2.5e-3)])
    assert one["factor"] == pytest.approx(0.8) and one["per_run"] == [0.8]
    both = untraced_host_factor([(ev, 2.9e-3, 2.5e-3), (ev, 2.9e-3, 2.35e-3)])
    assert both["factor"] == pytest.approx(0.65) and both["runs"] == 2  # pooled: 0.65 / 1.0
    # a twin faster than its device time alone says nothing about the host: left out
    odd = untraced_host_factor([(ev, 2.9e-3, 2.5e-3), (ev, 2.9e-3, 2.0e-3)])
    assert odd["factor"] == pytest.approx(0.8) and odd["per_run"] == [0.8, None]
    # no usable run: no factor (the host parts stay as traced), not an error
    assert untraced_host_factor([(ev, 2.9e-3, 2.0e-3)])["factor"] is None
    assert untraced_host_factor([])["factor"] is None


def test_fit_scales_every_host_part_by_the_twins_factor():
    from sim.profile import fit_profile

    ev = windows([40.0] * 20, [15.0] * 20)
    last = ev[-1]
    ev.append({"ev": "prefill", "step": last["step"] + 5, "t": last["t"] + 1e-3, "req": "b",
               "slot": 0, "tokens": 16, "dur": 100e-6, "ctx": 16, "trace_s": 300e-6})
    # device 2.2 ms, trace 0.3 ms: traced wall 3.0 ms has 0.5 ms of host, served 0.4
    plain = fit_profile([ev])
    twinned = fit_profile([ev], walls=[(3.0e-3, 2.6e-3)])
    assert twinned.source["untraced_host"]["factor"] == pytest.approx(0.8)
    assert twinned.host_overhead_s == pytest.approx(0.8 * plain.host_overhead_s)
    assert twinned.host_per_commit_s == pytest.approx(0.8 * plain.host_per_commit_s)
    assert twinned.decode_s == plain.decode_s  # device times as measured
    none = fit_profile([ev], walls=[None])  # a run without its twin: host as traced, said
    assert none.host_overhead_s == pytest.approx(plain.host_overhead_s)
    assert none.source["untraced_host"]["factor"] is None
    assert none.source["untraced_host"]["left_out"] == {"0": "no untraced twin"}
    with pytest.raises(FitError, match="walls: 2 entries for 1 traces"):
        fit_profile([ev], walls=[None, None])
