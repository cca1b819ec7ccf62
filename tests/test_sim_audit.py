"""Bad input to the simulator (`python -m sim`): every user error is one clear message naming
the file and line (or the key) and the value, exit status 2, never a traceback, and no
invalid value replayed or predicted as if it were valid. Each test is a case that crashed,
hung, was accepted and misbehaved, or exited 1 (a replay's "divergent") before its fix.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from sim.__main__ import check_overrides
from sim.calibrate import main as calibrate_main
from sim.calibrate import parse_args
from sim.config import SIM_CONF_DIR, SimConfigError, register_configs, validate
from sim.costs import CostProfile, ProfileError
from sim.experts import ExpertModelError, load_routing_profile
from sim.predict import build_scenario, load_engine_metrics
from sim.replay import TraceError, load_trace, replay_file, replay_trace
from sim.trace_acceptance import fit_from_trace

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "tests" / "data" / "h200_batch_mtp_n2_trace.jsonl"
PROFILE = Path(SIM_CONF_DIR) / "profiles" / "h200_tiny_bf16.json"
SMALL = ("workload=cohort", "workload.requests=2", "workload.prompt_tokens=64",
         "workload.max_tokens=16", "spread.enabled=false")


def events() -> list[dict]:
    return [json.loads(line) for line in TRACE.read_text().splitlines()]


def first(evs: list[dict], kind: str) -> dict:
    return next(e for e in evs if e["ev"] == kind)


def write(path: Path, evs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in evs), encoding="utf-8")
    return path


def cfg_of(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


# --- traces ----------------------------------------------------------------------------------

def test_trace_that_is_not_utf8_names_its_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(TRACE.read_bytes().split(b"\n", 1)[0] + b'\n{"ev":"warning","text":"\xff"}\n')
    with pytest.raises(TraceError, match=rf"{p}:2: not UTF-8 text"):
        load_trace(p)


def _set(kind: str, **fields):
    def edit(evs: list[dict]) -> None:
        first(evs, kind).update(fields)
    return edit


@pytest.mark.parametrize("edit, message", [
    (lambda evs: evs.insert(3, {"ev": [1], "step": 0}), r":4: unknown event \[1\]"),
    (_set("arrive", req=["a"]), r":2: arrive req must be a string, got \['a'\]"),
    (_set("arrive", prompt_tokens="many"), r":2: arrive prompt_tokens must be a non-negative "
                                           r"integer, got 'many'"),
    (_set("arrive", prompt_tokens=12.7),
     r"prompt_tokens must be a non-negative integer, got 12.7"),
    (_set("arrive", filtered="no"), r":2: arrive filtered must be true or false, got 'no'"),
    (_set("arrive", step=True), r":2: step must be a non-negative integer, got True"),
    (_set("commit", accepted=None),
     r":9: commit accepted must be a non-negative integer, got None"),
    (_set("commit", accepted=-1), r"commit accepted must be a non-negative integer, got -1"),
    (_set("commit", accepted=99), r"commit accepted=99 exceeds drafted=1"),
    (_set("finish", tokens=None), r"finish tokens must be a non-negative integer, got None"),
    (_set("finish", reason="exploded"), r"finish reason must be one of .*, got 'exploded'"),
    (_set("window", mib="x"), r":8: window mib must be a number, got 'x'"),
    (lambda evs: evs.insert(1, {"ev": "warmup", "step": 0, "keys": 5, "mib": [1]}),
     r":2: warmup keys must be a list of graph keys"),
])
def test_mistyped_event_fields_name_the_line(tmp_path, edit, message):
    """Fields a replay or an acceptance fit reads: each crashed (int(None), an unhashable req,
    float('x')) or was replayed as something the engine never ran (12.7 tokens, a 'no' that
    is true, -1 accepted drafts, an unknown finish reason)."""
    evs = events()
    edit(evs)
    p = write(tmp_path / "t.jsonl", evs)
    with pytest.raises(TraceError, match=message):
        replay_file(p)


@pytest.mark.parametrize("knob, value, message", [
    ("slots", "eight", r"config\.engine\.slots: must be int, got 'eight'"),
    ("vram_reserve_mib", [1], r"config\.engine\.vram_reserve_mib: "),
    ("slots", 2.5, r"config\.engine\.slots: .*'2\.5'"),
    ("slots", None, r"config\.engine\.slots: .*'None'"),
    ("shape_buckets", 8, r"config\.engine\.shape_buckets: "),
    ("spec", "4", r"config\.engine\.spec: must be int, got '4'"),
    ("drafting", "no", r"config\.engine\.drafting: must be bool, got 'no'"),
    ("overlap", "yes", r"config\.engine\.overlap: must be bool or null, got 'yes'"),
])
def test_mistyped_engine_knob_in_config_is_named(knob, value, message):
    """A knob of the wrong type crashed strata's validator ('<' between str and int) or was
    taken as another value (2.5 slots, "no" as true)."""
    evs = events()
    evs[0]["engine"][knob] = value
    with pytest.raises(TraceError, match=rf"trace:1: {message}"):
        replay_trace(evs)


@pytest.mark.parametrize("fact, value", [("slot_mib", "big"), ("graph_mib", "x"),
                                         ("slots", "x"), ("slots", 0), ("total_mib", -1)])
def test_bad_memory_fact_in_config_is_named(fact, value):
    """A string crashed float(); 0 slots ran 10,000 idle iterations to 'no end after max_steps'."""
    evs = events()
    evs[0]["memory"][fact] = value
    with pytest.raises(TraceError, match=rf"trace:1: config\.memory\.{fact} must be .*got "
                                         rf"{value!r}"):
        replay_trace(evs)


def test_second_config_event_is_refused():
    evs = events()
    evs.insert(5, copy.deepcopy(evs[0]))
    with pytest.raises(TraceError, match=r"trace:6: a second config event"):
        replay_trace(evs)


def test_commit_of_a_request_that_never_arrived_is_refused():
    """It was reported as a divergence (exit 1), as if the simulator were wrong."""
    evs = events()
    c = first(evs, "commit")
    evs.insert(evs.index(c) + 1, dict(c, req="ghost"))
    with pytest.raises(TraceError, match=r"trace:10: commit of request 'ghost', which never "
                                         r"arrived"):
        replay_trace(evs)


def test_request_finishing_twice_is_refused():
    """The second finish silently replaced the first (a stop's token count with another)."""
    evs = events()
    f = first(evs, "finish")
    evs.insert(evs.index(f) + 1, dict(f))
    with pytest.raises(TraceError, match=r"request 'req0' finishes twice"):
        replay_trace(evs)


def test_prompt_beyond_max_context_is_refused():
    """The engine refuses such a prompt; the replay ran to max_steps and said only 'no end'."""
    evs = events()
    first(evs, "arrive")["prompt_tokens"] = 1024
    with pytest.raises(TraceError, match=r"trace:2: request 'req0': prompt_tokens 1024 leaves "
                                         r"no room in config\.engine\.max_context=1024"):
        replay_trace(evs)


def test_valid_trace_still_replays_exactly():
    assert replay_trace(events()).ok


# --- cost profiles ---------------------------------------------------------------------------

def test_unreadable_cost_profile_is_a_profile_error(tmp_path):
    with pytest.raises(ProfileError, match=rf"{tmp_path}: cannot read the cost profile: Is a "
                                           r"directory"):
        CostProfile.load(tmp_path)
    p = tmp_path / "p.json"
    p.write_bytes(b"\xff{}")
    with pytest.raises(ProfileError, match="not UTF-8 text"):
        CostProfile.load(p)


def _profile_set(path: tuple, value):
    def edit(d: dict) -> None:
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_profile_set(("decode", "hit"), [1.0, 2.0]), r"decode\.hit must be a list of lists of "
                                                  r"numbers, got \[1\.0, 2\.0\]"),
    (_profile_set(("decode", "rows"), 5), r"decode\.rows must be a list of numbers, got 5"),
    (_profile_set(("host_overhead_s",), float("nan")), r"host_overhead_s must be a finite "
                                                       r"number, got nan"),
    (_profile_set(("host_overhead_s",), True), r"host_overhead_s must be a finite number"),
    (_profile_set(("decode", "hit", 0, 0), float("inf")), r"decode\.hit must be a finite number"),
    (_profile_set(("host",), [1]), r"host must be an object, got \[1\]"),
    (_profile_set(("source",), [1]), r"source must be an object"),
    (_profile_set(("acceptance",), "x"), r"acceptance must be an object, got 'x'"),
    (_profile_set(("source", "trace_speeds"), {"window": ["x"]}),
     r"source\.trace_speeds\.window must be a finite number, got 'x'"),
    (_profile_set(("decode", "slot_scale"), {"slots": [1.5, 4], "scale": [1, 1]}),
     r"decode\.slot_scale\.slots must be whole slot counts"),
    (lambda d: d["decode"].pop("shape_s"), r"missing field 'decode\.shape_s'"),
])
def test_cost_profile_of_a_wrong_shape_names_the_field(tmp_path, edit, message):
    """These crashed later (AttributeError on a list's .get, a str in spread's float()), or
    priced the run with NaN or infinite times, or named no field ('float' object is not
    iterable)."""
    d = json.loads(PROFILE.read_text())
    edit(d)
    p = tmp_path / "p.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=rf"{p}: {message}"):
        CostProfile.load(p)


def test_profile_acceptance_the_model_cannot_use_is_a_config_error(tmp_path):
    for acceptance, message in (({}, "has no `acceptance` section"),
                                ({"rate": 0.7}, "the `acceptance` section lacks 'markov'")):
        d = json.loads(PROFILE.read_text())
        d["acceptance"] = acceptance
        p = tmp_path / "p.json"
        p.write_text(json.dumps(d))
        with pytest.raises(SimConfigError, match=message):
            build_scenario(cfg_of(*SMALL, f"profile={p}", "acceptance.from_profile=true"))


# --- acceptance.from_trace, routing profiles, compare_with -----------------------------------

def test_from_trace_with_mistyped_commits_is_a_config_error(tmp_path):
    evs = events()
    first(evs, "commit")["accepted"] = "x"
    with pytest.raises(SimConfigError, match=r"acceptance\.from_trace: .*:9: commit accepted"):
        fit_from_trace(write(tmp_path / "t.jsonl", evs))
    p = tmp_path / "u.jsonl"
    p.write_bytes(b"\xff\n")
    with pytest.raises(SimConfigError, match=r"acceptance\.from_trace: .*:1: not UTF-8"):
        fit_from_trace(p)


ROUTING = {"model": "m", "layers": [0, 1], "experts": 4, "top_k": 2, "tokens": 8,
           "counts": [[1, 2, 3, 4], [4, 3, 2, 1]]}


@pytest.mark.parametrize("edit, message", [
    ({"layers": 2}, r"layers must be a list .*got 2"),
    ({"layers": None}, r"layers must be a list"),
    ({"counts": [[1, 2, 3, float("nan")], [4, 3, 2, 1]]}, r"counts\[0\] must be 4 finite"),
    ({"counts": [[1, 2, 3, 4], [4, 3, 2, float("inf")]]}, r"counts\[1\] must be 4 finite"),
    ({"experts": True}, r"experts must be a positive int, got True"),
])
def test_routing_profile_of_a_wrong_shape_is_named(tmp_path, edit, message):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({**ROUTING, **edit}))
    with pytest.raises(ExpertModelError, match=rf"{p}: {message}"):
        load_routing_profile(p)


def test_unreadable_routing_profile_is_named(tmp_path):
    with pytest.raises(ExpertModelError, match="cannot read the routing profile: Is a directory"):
        load_routing_profile(tmp_path)
    p = tmp_path / "r.json"
    p.write_bytes(b"\xff")
    with pytest.raises(ExpertModelError, match="not UTF-8 text"):
        load_routing_profile(p)


@pytest.mark.parametrize("content, message", [
    (b"\xff", "not UTF-8 text"),
    (b"[1, 2]", r"must be a JSON object \(an engine metrics\.json\)"),
    (b'{"aggregate_tps": "fast"}', "aggregate_tps must be a number, got 'fast'"),
    (b'{"aggregate_tps": true}', "aggregate_tps must be a number, got True"),
    (b"{}", "none of the compared figures"),
])
def test_bad_engine_metrics_for_compare_with(tmp_path, content, message):
    p = tmp_path / "metrics.json"
    p.write_bytes(content)
    with pytest.raises(SimConfigError, match=rf"compare_with: {p}: {message}"):
        load_engine_metrics(p)
    with pytest.raises(SimConfigError, match="Is a directory"):
        load_engine_metrics(tmp_path)


# --- config values ---------------------------------------------------------------------------

def test_negative_seed_is_a_config_error():
    with pytest.raises(SimConfigError, match="seed: must be >= 0, got -1"):
        validate(cfg_of(*SMALL, "seed=-1"))


def test_prompt_beyond_max_context_is_refused_in_predict():
    """It was simulated: each request prefilled past the context and 'finished' with one token.
    A range of prompt sizes that only reaches past the context is said on the info line."""
    with pytest.raises(SimConfigError, match=r"workload\.prompt_tokens: 4096 leaves no room in "
                                             r"engine\.max_context=4096"):
        validate(cfg_of(*SMALL, "workload.prompt_tokens=4096"))
    validate(cfg_of(*SMALL, "workload.prompt_tokens=4095"))
    validate(cfg_of("mode=replay", "trace=x", "engine.max_context=16"))  # (no workload)
    _, info = build_scenario(cfg_of(*SMALL, "workload.prompt_tokens_max=5000"))
    assert "WARNING: workload.prompt_tokens_max=5000 reaches engine.max_context=4096" in info


@pytest.mark.parametrize("args, message", [
    (["workload.requests=abc"], r"workload\.requests=abc: Value 'abc' of type 'str' could not "
                                r"be converted to Integer"),
    (["hardware=nope"], r"hardware=nope: no such hardware config \(choose from: cpu_tiny"),
    (["workload.foo=1"], r"workload\.foo: unknown key \(known: burst_gap_s"),
    (["+workload.foo=1"], r"workload\.foo: unknown key"),
    (["engine.slotz=2"], r"engine\.slotz: unknown key.*slots"),
    (["engine.slots=1,2"], r"engine\.slots=1,2: several values need -m"),
    (["-m", "engine.slots=1,x"], r"engine\.slots=x: Value 'x'"),
])
def test_bad_override_is_one_line(args, message):
    with pytest.raises(SimConfigError, match=message):
        check_overrides(args)


def test_good_overrides_pass_the_check():
    check_overrides(["mode=predict", "hardware=h200_tiny_bf16", *SMALL, "hydra.run.dir=/tmp/x"])
    check_overrides(["-m", "engine.slots=1,2", "engine.graph_key=layout,shape"])


def test_bad_override_exits_2_without_a_traceback(tmp_path):
    """Hydra's report exited 1, which a replay's caller reads as 'divergent'."""
    out = subprocess.run([sys.executable, "-m", "sim", "mode=replay", f"trace={TRACE}",
                          "workload.requests=abc", f"hydra.run.dir={tmp_path}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: workload.requests=abc:") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# --- calibrate -------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["device=tpu"], "device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["device=cuda:x"], "device must be cpu, cuda or cuda:N"),
    (["device=cpu", "threads=-1"], "threads must be >= 0"),
    (["device=cpu", "max_context=-5"], "max_context must exceed grid tiny's longest prompt"),
    (["device=cuda", "max_context=256"], "max_context must exceed grid quick's longest prompt "
                                         r"\(700 tokens\), got 256"),
])
def test_calibrate_arguments(args, message):
    """Each was a torch traceback (an unknown device type, set_num_threads(-1)) or, for a
    too-short context, the engine refusing the grid's long prompts minutes into the runs."""
    with pytest.raises(SimConfigError, match=message):
        parse_args(args)


def test_calibrate_bad_model_or_missing_cuda_exits_2(tmp_path, capsys):
    """A missing model directory (CheckpointError) and device=cuda on a machine without CUDA
    (an AssertionError from torch) were tracebacks, not exit 2."""
    assert calibrate_main(["device=cpu", f"model={tmp_path / 'none'}",
                           f"conf={tmp_path / 'conf'}"]) == 2
    assert "model.path:" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert calibrate_main(["device=cuda", f"conf={tmp_path / 'conf'}"]) == 2
        assert "no CUDA device is available" in capsys.readouterr().err
