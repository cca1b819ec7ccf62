"""Untraced twins (sim/untraced_twins.py, sim.calibrate twins=1): the pooled host factor comes
from the calibration's own twin runs; a twin slower than its traced run, a missing twin and a
calibration without twins (twins=0, the CPU's default) are each handled and said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.calibrate import calibrate, parse_args
from sim.profile import fit_profile
from sim.untraced_twins import (NO_SERVED_HOST, NO_TWIN, SLOWER_TWIN, summary,
                                untraced_host_factor)


def _events(device_s: float, trace_s: float, windows: int = 40, slots: int = 4):
    """A traced run: `windows` windows (and one prompt chunk) of device_s in all, 1 ms of host
    between them, the writer's own time trace_s by the end."""
    each = device_s / (windows + 1)
    evs = [{"ev": "config", "step": 0, "t": 0.0,
            "engine": {"prefill_buckets": [16, 32, 64], "context_tier_min": 256,
                       "max_context": 1024, "slots": slots, "graph_mib_estimate": 16.0},
            "memory": {"total_mib": 1000.0, "weights_mib": 10.0, "slot_mib": 1.0,
                       "slots": slots, "graph_mib": 16.0}},
           {"ev": "prefill", "step": 0, "t": each, "req": "a", "slot": 0, "tokens": 64,
            "dur": each, "ctx": 64, "trace_s": 0.0}]
    t = each
    for step in range(1, windows + 1):
        t += 0.001 + each
        evs.append({"ev": "window", "step": step, "t": t, "layout": [0, 0], "key": "shape:1x2@256",
                    "graph": "hit", "rows": 2, "dur": each, "ctx": 256,
                    "trace_s": trace_s * step / windows})
        evs.append({"ev": "commit", "step": step, "t": t, "req": "a", "slot": 0, "drafted": 1,
                    "accepted": 1, "emitted": 2})
    return evs


def test_the_factor_pools_the_usable_twins_and_names_every_run_left_out():
    ev = _events(0.080, 0.005)  # traced wall 0.1: host 0.015
    runs = [(ev, 0.100, 0.090),   # served host 0.010: 2/3
            (ev, 0.100, 0.110),   # a twin slower than its traced run: disturbed
            (ev, 0.100, None),    # no twin
            (ev, 0.100, 0.070)]   # an untraced wall under the device time
    out = untraced_host_factor(runs, ["a", "slow", "none", "short"])
    assert out["factor"] == pytest.approx(2 / 3, rel=1e-3) and out["runs"] == 1
    assert out["left_out"] == {"slow": SLOWER_TWIN, "none": NO_TWIN, "short": NO_SERVED_HOST}
    assert out["per_run"][1:] == [None, None, None]
    line = summary(out)
    assert "x 0.667" in line and "1 of 4" in line and "slow: " + SLOWER_TWIN in line
    with pytest.raises(ValueError, match="2 names for 1 runs"):
        untraced_host_factor(runs[:1], ["a", "b"])


def test_no_usable_twin_leaves_the_host_as_traced_and_a_pool_above_one_is_capped():
    ev = _events(0.080, 0.005)
    none = untraced_host_factor([(ev, 0.1, None), (ev, 0.1, 0.2)], ["x", "y"])
    assert none["factor"] is None and none["runs"] == 0
    assert summary(none).startswith(
        "no usable untraced twin in 2 runs: host parts priced as traced")
    # traced: 0.015 s of host once the writer's 0.005 is out; the twin leaves 0.019: 1.27
    capped = untraced_host_factor([(ev, 0.1, 0.099)])
    assert capped["factor"] == 1.0 and "capped at 1" in capped["note"]


def test_the_fit_scales_the_host_by_the_twins_or_says_why_not():
    traces = [_events(0.080, 0.005), _events(0.080, 0.005)]
    plain = fit_profile(traces)
    scaled = fit_profile(traces, walls=[(0.1, 0.09), (0.1, 0.09)], names=["p", "q"])
    assert scaled.host_overhead_s == pytest.approx(plain.host_overhead_s * 2 / 3, rel=1e-3)
    assert scaled.source["untraced_host"]["factor"] == pytest.approx(0.6667, abs=1e-4)
    kept = fit_profile(traces, walls=[None, (0.1, 0.2)], names=["p", "q"])
    assert kept.host_overhead_s == pytest.approx(plain.host_overhead_s)
    assert kept.source["untraced_host"]["factor"] is None
    assert kept.source["untraced_host"]["left_out"] == {"p": NO_TWIN, "q": SLOWER_TWIN}


class _FakeRunner:
    """Writes a synthetic trace per run; the twin's wall per run name: a factor of the
    traced wall, or None (no twin returned)."""

    def __init__(self, twin_of: dict):
        self.twin_of = twin_of

    def run(self, spec, where, twin=False):
        where.mkdir(parents=True, exist_ok=True)
        (where / "trace.jsonl").write_text("".join(
            json.dumps(e) + "\n" for e in _events(0.080, 0.005,
                                                   slots=spec.engine.get("slots", 1))))
        m = {"output_tokens": spec.requests * spec.out, "wall_s": 0.1, "start_s": 0.1}
        f = self.twin_of.get(spec.name.split("_p")[0], 0.9)
        if twin and f is not None:
            m["untraced_wall_s"] = 0.1 * f
        return m

    def source(self):
        return {"device": "cpu", "torch": "x", "dtype": "float32", "backend": "cpu",
                "commit": "test", "date": "2026-12-01"}


def _calibrate(tmp_path: Path, args: list[str], twin_of: dict) -> tuple[list[str], dict]:
    logs: list[str] = []
    opts = parse_args(["grid=tiny", f"conf={tmp_path / 'conf'}", f"work_dir={tmp_path / 'w'}",
                       *args])
    files = calibrate(opts, log=logs.append, runner=_FakeRunner(twin_of))
    return logs, json.loads(files["profile"].read_text())


def test_calibrate_says_which_runs_had_no_usable_twin(tmp_path):
    logs, prof = _calibrate(tmp_path, ["device=cuda", "name=t"], {"solo": 1.1, "mtp_n1": None})
    assert any(line.startswith("[2/") and "mtp_n1" in line and "(no untraced twin)" in line
               for line in logs)
    twin = prof["source"]["untraced_host"]
    assert twin["left_out"] == {"solo": SLOWER_TWIN, "mtp_n1": NO_TWIN}
    assert twin["factor"] == pytest.approx(0.6667, abs=1e-3)
    line = next(x for x in logs if x.startswith("calibrate: untraced twins:"))
    assert "solo: " + SLOWER_TWIN in line and "mtp_n1: " + NO_TWIN in line
    runs = {r["run"]: r for r in prof["source"]["calibration"]["runs"]}
    assert "untraced_wall_s" not in runs["mtp_n1"] and runs["solo"]["untraced_wall_s"] > 0.1


def test_calibrate_on_a_cpu_twins_off_by_default_and_warned_when_on(tmp_path):
    logs, prof = _calibrate(tmp_path / "off", ["device=cpu", "name=c"], {})
    assert "untraced_host" not in prof["source"]
    assert any("twins=0: no untraced twins, host parts priced as traced" in x for x in logs)
    logs, prof = _calibrate(tmp_path / "on", ["device=cpu", "name=c", "twins=1"], {})
    assert any("warning: twins=1 on cpu" in x for x in logs)
    assert prof["source"]["untraced_host"]["factor"] == pytest.approx(0.6667, abs=1e-3)
