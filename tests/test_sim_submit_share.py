"""What a serial window's idle device waits for its submission (cost profile `host.submit_s`,
by shape `decode.submit_s`): priced from overlapped traces beside serial ones, paid by the
serial loop inside each window's device time, and skipped by engine.overlap's windows that
are queued behind the one before."""

from __future__ import annotations

import copy

import pytest

from sim.config import SIM_CONF_DIR
from sim.costs import CostProfile
from sim.predict import run_predict
from sim.profile import fit_profile
from test_sim_launch_share import _cfg  # the same small cohort
from test_sim_profile import KNOBS

SUBMIT_S = 80e-6


def _with_submit(by_shape: bool = False) -> tuple[CostProfile, CostProfile]:
    base = CostProfile.load(f"{SIM_CONF_DIR}/profiles/h200_tiny_bf16.json")  # (has shapes)
    base.host_submit_s, base.decode_shape_submit_s = 0.0, None
    sub = copy.deepcopy(base)
    sub.host_submit_s = SUBMIT_S
    if by_shape:
        sub.decode_shape_submit_s = [SUBMIT_S] * len(sub.decode_shapes)
        sub.host_submit_s = 0.0  # the shapes' own figures are what count
    return base, sub


@pytest.mark.parametrize("mode", ["engine.mode=solo", "engine.batch_mtp=true"])
def test_the_serial_loop_pays_the_submission_inside_its_windows(tmp_path, mode):
    base, sub = _with_submit()
    a = run_predict(_cfg(mode, "engine.overlap=false"), tmp_path / "a", profile=base)
    b = run_predict(_cfg(mode, "engine.overlap=false"), tmp_path / "b", profile=sub)
    assert [e for e in a.run.events] == [e for e in b.run.events]


@pytest.mark.parametrize("by_shape", [False, True])
@pytest.mark.parametrize("mode", ["engine.mode=solo", "engine.batch_mtp=true"])
def test_overlapped_windows_queued_behind_another_skip_their_submission(tmp_path, mode,
                                                                       by_shape):
    base, sub = _with_submit(by_shape)
    a = run_predict(_cfg(mode, "engine.overlap=true"), tmp_path / "a", profile=base)
    b = run_predict(_cfg(mode, "engine.overlap=true"), tmp_path / "b", profile=sub)
    assert b.metrics["aggregate_tps"] > a.metrics["aggregate_tps"]
    wa = [e["dur"] for e in a.run.events if e["ev"] == "window"]
    wb = [e["dur"] for e in b.run.events if e["ev"] == "window"]
    assert len(wa) == len(wb)
    # A window launched onto an idle device (the first, and each after a prompt chunk) takes
    # its whole time; a queued one as much less as its submission, never less.
    shorter = [x - y for x, y in zip(wa, wb) if y < x - 1e-9]
    assert wb[0] == pytest.approx(wa[0]) and shorter
    assert all(d <= SUBMIT_S + 1e-9 for d in shorter)
    assert max(shorter) == pytest.approx(SUBMIT_S, abs=2e-6)


def test_the_submission_round_trips_and_is_checked():
    _, sub = _with_submit()
    sub.decode_shape_submit_s = [SUBMIT_S / 2] * len(sub.decode_shapes)
    again = CostProfile.from_dict(sub.to_dict())
    assert again.host_submit_s == SUBMIT_S
    assert again.decode_shape_submit_s == sub.decode_shape_submit_s
    assert again.submit_time((1, 4)) == SUBMIT_S / 2 and again.submit_time(None) == SUBMIT_S
    d = sub.to_dict()
    d["host"]["submit_s"] = -1e-6
    with pytest.raises(ValueError, match="host.submit_s"):
        CostProfile.from_dict(d)
    d = sub.to_dict()
    d["decode"]["submit_s"] = d["decode"]["submit_s"][1:]
    with pytest.raises(ValueError, match="decode.submit_s"):
        CostProfile.from_dict(d)


def _run(shape: str, rows: int, tier: int, durs: list[float], overlap: bool, dev: float = 0.0,
         gap: float = 0.0) -> list[dict]:
    """A trace of one window shape, serial (each window `dur` with `dev` beside it) or
    overlapped (windows `gap` seconds apart: back to back when `gap` is their `dur`)."""
    evs = [{"ev": "config", "step": 0, "t": 0.0, "engine": {**KNOBS, "overlap": overlap},
            "memory": {}},
           {"ev": "prefill", "step": 0, "t": 0.0, "req": "a", "slot": 0, "tokens": 64,
            "dur": 0.01, "ctx": 64}]
    t = 1.0
    g, r = shape.split("x")
    layout = [i for i in range(int(g)) for _ in range(int(r))]
    for i, d in enumerate(durs, start=2):
        t += gap or 2 * d
        e = {"ev": "window", "step": i, "t": t, "layout": layout, "key": f"shape:{shape}@{tier}",
             "graph": "hit", "rows": rows, "dur": d, "ctx": tier}
        if not overlap:
            e["dev"] = d - 0.00004
        evs.append(e)
    return evs


def test_the_fit_prices_the_submission_from_device_bound_overlapped_runs_by_shape():
    n = 30
    serial = [_run("1x4", 4, 256, [0.00050] * n, False),  # dev 460 us
              _run("4x1", 4, 256, [0.00034] * n, False),  # dev 300 us
              _run("8x2", 16, 256, [0.00044] * n, False)]  # dev 400 us
    queued = [_run("1x4", 4, 256, [0.00043] * n, True, gap=0.00043),  # 30 us less
              _run("4x1", 4, 256, [0.00029] * n, True, gap=0.00029),  # 10 us less
              # a host-bound run (its windows 20% further apart than they take) tells nothing
              _run("8x2", 16, 256, [0.00045] * n, True, gap=0.00054)]
    prof = fit_profile(serial + queued)
    # Overlapped runs price only the submission: the tables are the serial runs' `dev`.
    assert prof.decode_time(4, 256, "hit", (1, 4)) == pytest.approx(0.00046)
    assert prof.source["traces"] == 3
    assert prof.source["submit"]["device_bound_traces"] == 2
    by = dict(zip(prof.decode_shapes, prof.decode_shape_submit_s))
    assert by["1x4"] == pytest.approx(30e-6) and by["4x1"] == pytest.approx(10e-6)
    # The overall figure: the median over the queued windows (30 of each: their mean); 8x2,
    # never seen device-bound and with no measured shape of its depth, takes it.
    assert prof.host_submit_s == pytest.approx(20e-6) and by["8x2"] == prof.host_submit_s
    # With a device-bound 2x2 run, 8x2 takes that shape's figure (the same rows per group).
    prof = fit_profile(serial + queued + [_run("2x2", 4, 256, [0.00040] * n, False),
                                          _run("2x2", 4, 256, [0.00035] * n, True, gap=0.00035)])
    by = dict(zip(prof.decode_shapes, prof.decode_shape_submit_s))
    assert by["8x2"] == by["2x2"] == pytest.approx(10e-6)
    # Without serial `dev`, overlapped traces are fitted as before, with no submission.
    plain = fit_profile([_run("1x4", 4, 256, [0.00043] * n, True, gap=0.00043)])
    assert plain.host_submit_s == 0.0 and plain.decode_shape_submit_s is None
    assert plain.decode_time(4, 256, "hit", (1, 4)) == pytest.approx(0.00043)


def _slots_run(slots: int, durs: list[float], overlap: bool, gap: float = 0.0) -> list[dict]:
    evs = _run("4x2", 8, 256, durs, overlap, gap=gap)
    evs[0]["memory"] = {"slots": slots}
    return evs


def test_a_queued_window_costs_its_overlapped_time_whatever_the_slot_count():
    # Serial 4x2 windows of an 8-slot engine took 8% longer than a 4-slot one's, overlapped
    # ones the same (H200): the slot count's share is in the serial submission.
    n = 30
    prof = fit_profile([_slots_run(4, [0.000356] * n, False),  # dev 316 us
                        _slots_run(8, [0.000386] * n, False),  # dev 346 us
                        _slots_run(4, [0.000307] * n, True, gap=0.000307),
                        _slots_run(8, [0.000307] * n, True, gap=0.000307)])
    assert prof.decode_slot_scale is not None
    table = prof.decode_time(8, 256, "hit", (4, 2))
    submit = prof.submit_time((4, 2))
    # The submission is priced against the slot-normalized table, so that table less it is
    # the overlapped windows' time.
    assert table - submit == pytest.approx(0.000307, rel=1e-6)
    for slots, dev in ((4, 0.000316), (8, 0.000346)):
        scaled = prof.for_slots(slots)
        assert scaled.window_slot_factor == pytest.approx(dev / table, rel=1e-3)
        assert scaled.decode_time(8, 256, "hit", (4, 2)) == pytest.approx(dev, rel=1e-3)


@pytest.mark.parametrize("slots", [4, 8])
def test_the_overlapped_loop_takes_queued_windows_without_the_slot_scale(tmp_path, slots):
    _, sub = _with_submit()
    f = 0.9 if slots == 4 else 1.1
    sub.decode_slot_scale = {"slots": [4, 8], "scale": [0.9, 1.1]}
    run = run_predict(_cfg("engine.batch_mtp=true", f"engine.slots={slots}", "engine.overlap=true",
                           "engine.prefill_slots=1"), tmp_path, profile=sub)
    table = sub.decode_time(8, 256, "hit", (4, 2))  # (unscaled: the runs' average engine)
    durs = {e["dur"] for e in run.run.events if e["ev"] == "window"
            and e["key"] == "shape:4x2@256" and e["graph"] == "hit"}
    # A queued window is its table time without the slot scale, less the submission; one
    # launched onto an idle device (after a prompt chunk) takes it all, slot scale included.
    assert min(durs) == pytest.approx(table - SUBMIT_S, abs=1e-6)  # (events in us)
    assert any(d == pytest.approx(table * f, abs=1e-6) for d in durs)
