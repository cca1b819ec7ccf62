"""One definition of request metrics (DESIGN.md section 7): strata.metrics, which the engine,
the simulator and the benchmarks map their records onto."""

from __future__ import annotations

import pytest

from sim.metrics import request_times
from sim.scheduler import RequestRecord
from sim.workload import SimRequest
from strata.metrics import RequestTimes, aggregate, request_metrics


def test_definitions_by_hand():
    t = RequestTimes("a", prompt_tokens=100, output_tokens=11, arrive=1.0, admit=1.5, first=2.0,
                     last=4.0, finish=4.5, prefill_s=0.25)
    m = request_metrics(t)
    assert m["pp_tps"] == 400.0                # 100 prompt tokens / 0.25 s of prefill
    assert m["tg_tps"] == 5.0                  # (11 - 1) tokens / (4.0 - 2.0) s
    assert m["e2e_tps"] == pytest.approx(11 / 3.5)
    assert (m["ttft_s"], m["queue_s"], m["e2e_s"]) == (1.0, 0.5, 3.5)


def test_undefined_figures_are_none():
    cut = RequestTimes("b", 100, 0, arrive=1.0, admit=1.5, prefill_s=0.1, reason="cancel")
    m = request_metrics(cut)  # cancelled mid-prefill: no first token, no PP
    assert m["pp_tps"] is None and m["tg_tps"] is None and m["ttft_s"] is None
    one = request_metrics(RequestTimes("c", 10, 1, 0.0, first=1.0, last=1.0, finish=1.0, prefill_s=1))
    assert one["tg_tps"] is None  # a single token has no decode rate


def test_aggregate_spans_first_arrival_to_last_finish():
    ts = [RequestTimes("a", 1, 10, arrive=0.0, first=1.0, finish=2.0),
          RequestTimes("b", 1, 30, arrive=1.0, first=3.0, finish=4.0)]
    agg = aggregate(ts)
    assert agg["aggregate_tps"] == 40 / 4.0 and agg["ttft_s"]["p50"] == 1.5


def test_the_simulator_maps_its_records_onto_the_same_definitions():
    req = SimRequest.__new__(SimRequest)
    req.id, req.prompt_tokens = "s", 100
    rec = RequestRecord(req, arrive_s=1.0, admit_s=1.5, prefill_device_s=0.25, first_token_s=2.0,
                        last_token_s=4.0, finish_s=4.5, tokens=11, reason="length")
    same = RequestTimes("s", 100, 11, 1.0, 1.5, 2.0, 4.0, 4.5, 0.25, reason="length")
    assert request_metrics(request_times(rec)) == request_metrics(same)
