"""engine.overlap (issue 18): window t+1 is planned and launched before window t is read.

Finishes are learned one window late, so the window launched meanwhile may hold groups of
requests that have already finished (or been cancelled): those groups are discarded when it is
read. The text must not change: every request's tokens, finish reason and streamed text are the
serial engine's, in every mode, with stop strings, EOS and max_tokens landing mid-window,
requests reaching the end of the context, and arrivals and cancels between windows. The
models: the echo-MTP checkpoint of test_engine_properties (drafts often accepted, so windows
commit varying counts), with the base tiny checkpoint's tokenizer for stop strings.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.engine.rotation import RotationRing
from strata.engine.scheduler import Scheduler
from strata.engine.slots import RequestState
from strata.trace import TraceWriter, replay_view
from conftest import cpu_engine_config
from test_engine_properties import make_echo_mtp

MODES = ["solo", "batch", "batch_mtp"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(single_thread):
    pass


@pytest.fixture(scope="module")
def echo_tok(tmp_path_factory, tiny_ckpt):
    """Echo-MTP weights with the tiny tokenizer (for stop strings and streamed text)."""
    path = make_echo_mtp(tmp_path_factory.mktemp("overlap-echo"))
    shutil.copy(tiny_ckpt / "tokenizer.json", path / "tokenizer.json")
    return path


def engine(model_dir, mode: str, overlap: bool, *, slots: int = 3, graphs: str = "shape",
           max_context: int = 256, window_rows: int = 8) -> Engine:
    cfg = cpu_engine_config(model_dir, max_context=max_context, mode="solo" if mode == "solo"
                            else "batch", batch_mtp=mode == "batch_mtp", slots=slots,
                            window_rows=window_rows, prefill_chunk=6, overlap=overlap,
                            graphs=graphs != "off")
    if graphs != "off":
        cfg.engine.graph_key = graphs
    return Engine.from_config(cfg, log=lambda s: None)


def requests(n: int, sampled: bool, seed: int = 7, stop: dict | None = None) -> list[Request]:
    """Staggered arrivals, prompts of 3-14 tokens, max_tokens 3-17 (ends fall mid-window)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        params = SamplingParams(max_tokens=rng.randrange(3, 18), seed=100 + i,
                                temperature=0.8 if sampled and i % 3 else 0.0,
                                top_k=20 if sampled and i % 3 == 1 else 0,
                                stop=(stop or {}).get(f"r{i}", []))
        out.append(Request(f"r{i}", [rng.randrange(1, 400) for _ in range(rng.randrange(3, 15))],
                           params, arrival_step=rng.randrange(0, 12)))
    return out


def drive(eng: Engine, reqs: list[Request], cancels: dict[int, list[str]] | None = None,
          eos: set[int] | None = None) -> dict:
    """Run to the end; returns per request (tokens, reason, streamed tokens, streamed text),
    checking the stream on the way: nothing after a request's final output, tokens streamed
    equal to those kept."""
    if eos is not None:
        eng.eos = set(eos)
    for r in reqs:
        eng.add_request(r)
    streamed: dict[str, list[int]] = {r.id: [] for r in reqs}
    text: dict[str, str] = {r.id: "" for r in reqs}
    done: set[str] = set()
    for _ in range(3000):
        if not eng.has_work():
            break
        for rid in (cancels or {}).get(eng.steps, []):
            eng.cancel(rid)
        for out in eng.step():
            assert out.id not in done, f"{out.id}: output after its final one"
            streamed[out.id] += out.new_token_ids
            text[out.id] += out.new_text
            if out.finished:
                done.add(out.id)
    assert not eng.has_work(), "the engine did not finish"
    assert done == {r.id for r in reqs}, f"requests lost: {sorted({r.id for r in reqs} - done)}"
    res = {}
    for rid, rs in eng.requests.items():
        assert streamed[rid] == rs.emitted
        assert len(rs.emitted) <= rs.req.params.max_tokens
        if rs.req.params.stop_at_eos:
            assert not set(rs.emitted) & eng.eos, f"{rid}: a token past EOS was emitted"
        res[rid] = (list(rs.emitted), rs.reason, text[rid])
    return res


def discarded_groups(eng: Engine) -> int:
    """Groups launched for requests that had finished: windows' groups minus commits."""
    ev = eng.trace.events
    groups = sum(len(set(e["layout"])) for e in ev if e["ev"] == "window")
    return groups - sum(1 for e in ev if e["ev"] == "commit")


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", MODES)
def test_overlap_keeps_the_text_in_every_mode(echo_tok, mode, sampled):
    reqs = lambda: requests(6, sampled)  # noqa: E731
    serial = drive(engine(echo_tok, mode, False), reqs())
    eng = engine(echo_tok, mode, True)
    assert drive(eng, reqs()) == serial
    assert sum(e["accepted"] for e in eng.trace.events if e["ev"] == "commit") > 0 or mode == "batch"
    assert discarded_groups(eng) > 0, "no window held a request finished in the one before"


@pytest.mark.parametrize("graphs", ["off", "layout"])
def test_overlap_keeps_the_text_without_graphs_and_with_layout_keys(echo_tok, graphs):
    serial = drive(engine(echo_tok, "batch_mtp", False, graphs=graphs), requests(5, True, seed=3))
    assert drive(engine(echo_tok, "batch_mtp", True, graphs=graphs),
                 requests(5, True, seed=3)) == serial


@pytest.mark.parametrize("mode", ["solo", "batch_mtp"])
def test_overlap_stop_strings_and_eos_mid_window(echo_tok, mode):
    base = drive(engine(echo_tok, mode, False), requests(5, False, seed=11))
    # A stop string from the middle of r1's text, and an EOS token: r0's fifth token (its
    # first occurrence in every other request ends that one too).
    text = base["r1"][2]
    stop = {"r1": [text[len(text) // 2: len(text) // 2 + 3]]}
    eos = {base["r0"][0][4]}
    serial = drive(engine(echo_tok, mode, False), requests(5, False, seed=11, stop=stop), eos=eos)
    assert serial["r1"][1] == "stop" and serial["r0"][1] == "stop"
    assert len(serial["r0"][0]) == 4
    assert drive(engine(echo_tok, mode, True), requests(5, False, seed=11, stop=stop),
                 eos=eos) == serial


@pytest.mark.parametrize("mode", ["solo", "batch_mtp"])
def test_overlap_at_the_end_of_the_context(echo_tok, mode):
    """Requests that reach max_context: a window in flight may take a slot to the end, so
    the next one passes it over rather than write past the context."""
    reqs = lambda: [Request(f"r{i}", list(range(3 + i, 3 + i + 20 + 5 * i)),  # noqa: E731
                            SamplingParams(max_tokens=64)) for i in range(3)]
    serial = drive(engine(echo_tok, mode, False, max_context=40), reqs())
    assert all(reason == "length" for _, reason, _ in serial.values())
    eng = engine(echo_tok, mode, True, max_context=40)
    assert drive(eng, reqs()) == serial
    assert all(rs.req.params.max_tokens > len(rs.emitted) for rs in eng.requests.values())


@pytest.mark.parametrize("mode", ["solo", "batch_mtp"])
def test_overlap_arrivals_and_cancels_between_windows(echo_tok, mode):
    """Cancels land one window later than in the serial engine, so a cancelled request's
    tokens are a prefix of what it would have produced; every other request is unchanged,
    though the cancels free slots that later arrivals take."""
    full = drive(engine(echo_tok, mode, False, slots=2), requests(6, True, seed=5))
    cancels = {6: ["r1"], 9: ["r4"], 13: ["r2"], 14: ["r0"]}
    serial = drive(engine(echo_tok, mode, False, slots=2), requests(6, True, seed=5), cancels)
    eng = engine(echo_tok, mode, True, slots=2)
    over = drive(eng, requests(6, True, seed=5), cancels)
    for rid, (toks, reason, _) in over.items():
        if reason == "cancel":
            assert full[rid][0][:len(toks)] == toks, rid
        else:
            assert (toks, reason) == serial[rid][:2] == full[rid][:2], rid
    assert [e for e in eng.trace.events if e["ev"] == "finish" and e["reason"] == "cancel"]


def test_overlap_trace_is_deterministic(echo_tok):
    views = []
    for _ in range(2):
        eng = engine(echo_tok, "batch_mtp", True)
        drive(eng, requests(6, True), {8: ["r2"]})
        views.append(list(replay_view(eng.trace.events)))
    assert views[0] == views[1]


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_overlap_property_no_token_past_a_finish_no_request_lost(echo_tok, data):
    """Random cohorts: the overlapped engine finishes every request once, never streams past
    a finish or writes past the context, and emits the serial engine's tokens."""
    mode = data.draw(st.sampled_from(MODES))
    slots = data.draw(st.integers(1, 3))
    max_context = data.draw(st.sampled_from([32, 64, 256]))
    n = data.draw(st.integers(1, 5))
    specs = [(data.draw(st.integers(1, 12)), data.draw(st.integers(1, 20)),
              data.draw(st.integers(0, 8)), data.draw(st.booleans())) for _ in range(n)]

    def reqs():
        return [Request(f"r{i}", [(7 * i + j) % 400 + 1 for j in range(p)],
                        SamplingParams(max_tokens=m, temperature=0.7 if s else 0.0, seed=i),
                        arrival_step=a) for i, (p, m, a, s) in enumerate(specs)]

    serial = drive(engine(echo_tok, mode, False, slots=slots, max_context=max_context), reqs())
    eng = engine(echo_tok, mode, True, slots=slots, max_context=max_context)
    assert drive(eng, reqs()) == serial
    for rs in eng.requests.values():
        assert rs.prompt_len + len(rs.emitted) <= max_context + 1
    assert all(s.inflight == 0 and s.req is None for s in eng.scheduler.slots)


def test_rows_assume_the_window_in_flight_commits_all_it_may():
    sched = Scheduler(2, mode="batch", batch_mtp=True, drafting=True, spec=4, window_rows=8,
                      decode_share=0.5, prefill_chunk=8, max_context=20, trace=TraceWriter())
    for i, slot in enumerate(sched.slots):
        slot.bind(RequestState(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=10)), i), i)
        sched.start_decoding(slot)
    a, b = sched.slots
    a.pos, b.pos = 15, 10
    assert sched.rows_for(a, lone=True) == 4
    a.inflight = 4  # up to 19 positions: one row left in the context
    assert sched.rows_for(a, lone=True) == 1
    a.inflight = 5
    assert sched.rows_for(a, lone=True) == 0
    b.req.emitted = list(range(8))  # 2 tokens left, and the window in flight may emit both
    b.inflight = 2
    assert sched.rows_for(b, lone=False) == 1
    plan = sched.plan()
    assert [s.id for s, _ in plan.groups] == [1]  # slot 0 is passed over


def test_ring_passes_over_slots_of_no_rows():
    ring = RotationRing()
    for s in (0, 1, 2):
        ring.join(s)
    assert ring.build(lambda s: 0 if s == 0 else 2, 8) == [1, 2]
    assert ring.pointer == 0
    assert ring.build(lambda s: 0, 8) == [] and ring.pointer == 0


@pytest.mark.parametrize("mode,graphs,slots,cancels", [
    ("batch_mtp", "shape", 3, {}), ("batch_mtp", "layout", 2, {7: ["r3"], 12: ["r1"]}),
    ("solo", "shape", 1, {5: ["r0"]}), ("batch", "off", 3, {})])
def test_overlapped_traces_replay_exactly(echo_tok, mode, graphs, slots, cancels):
    """The simulator plans windows against the window in flight as the engine does: the
    same windows, commits (discarded groups included) and finishes, event for event."""
    from sim.replay import replay_trace

    eng = engine(echo_tok, mode, True, slots=slots, graphs=graphs, max_context=48)
    drive(eng, requests(7, True, seed=2), cancels)
    result = replay_trace(list(eng.trace.events), name="overlap")
    assert result.ok, str(result.first_divergence)
    assert discarded_groups(eng) > 0


# ---- the default: null (auto) is on with one stage, with or without an expert cache ----
def test_overlap_auto_is_on_with_one_stage_and_recorded_resolved(echo_tok):
    from strata.config import EngineConfig, overlap_on

    assert EngineConfig().overlap is None
    assert overlap_on(EngineConfig()) and not overlap_on(EngineConfig(stages=2))
    assert overlap_on(EngineConfig(expert_cache_mib=64))  # a cache that misses overlaps too
    assert overlap_on(EngineConfig(expert_cache_mib=64, overlap=True))
    assert not overlap_on(EngineConfig(overlap=False)) and overlap_on(EngineConfig(overlap=True))
    cfg = cpu_engine_config(echo_tok, slots=2)
    eng = Engine.from_config(cfg, log=lambda s: None)
    assert eng.overlap is not None and eng.verifier.device_positions
    assert eng.trace.events[0]["engine"]["overlap"] is True  # what ran, for a replay
    cfg.engine.overlap = False
    eng = Engine.from_config(cfg, log=lambda s: None)
    assert eng.overlap is None and eng.trace.events[0]["engine"]["overlap"] is False


def test_overlap_true_with_stages_is_a_clear_error(echo_tok):
    from strata.config import ConfigError, EngineConfig, validate_engine

    with pytest.raises(ConfigError, match=r"engine.overlap=true .*engine.stages=2.*overlap=null"):
        validate_engine(EngineConfig(overlap=True, stages=2))
    validate_engine(EngineConfig(stages=2))  # auto: off with a split, no error
    validate_engine(EngineConfig(overlap=True, expert_cache_mib=64))  # the cache runs overlapped
