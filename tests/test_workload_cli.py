"""Workload files and the `python -m strata` command line (DESIGN.md section 8, SCHEDULING.md
"Files a run writes").

Request-file errors name file:line and the problem; the CLI (three subprocess runs, the
embedded tiny model on CPU) writes outputs.jsonl, trace.jsonl and metrics.json into
hydra.run.dir and exits 0, exits non-zero naming the key on a bad override, and runs a
workload=file request file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from strata.config import EMBEDDED_MODEL_DIR, WorkloadConfig
from strata.model.tokenizer import Tokenizer
from strata.trace import EVENT_FIELDS, FINISH_REASONS
from strata.workload import DEFAULT_PROMPTS, WorkloadError, load_request_file, load_workload

REPO = Path(__file__).resolve().parent.parent
VOCAB = 512


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(EMBEDDED_MODEL_DIR)


def wcfg(**kw):
    w = OmegaConf.structured(WorkloadConfig)
    w.kind = "file"
    for k, v in kw.items():
        setattr(w, k, v)
    return w


def write(tmp_path, lines, name="reqs.jsonl"):
    f = tmp_path / name
    f.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return f


# ---------------------------------------------------------------------------------------------
# Request files
# ---------------------------------------------------------------------------------------------

def test_request_file_parses(tmp_path, tok):
    f = write(tmp_path, [
        {"id": "a", "prompt": "def f(x):\n", "max_tokens": 5, "arrival_step": 2, "temperature": 0.7,
         "seed": 3, "top_p": 0.9, "top_k": 10, "stop": "\n\n"},
        "",
        {"prompt_ids": [1, 2, 3]},
        {"id": "c", "prompt_ids": [7], "arrival_s": 0.25, "stop": ["x", "yy"]},
    ])
    reqs = load_request_file(str(f), wcfg(max_tokens=9, seed=4), tok, VOCAB)
    assert [r.id for r in reqs] == ["a", "req1", "c"]
    a, b, c = reqs
    assert a.prompt_ids == tok.encode("def f(x):\n") and a.prompt_text == "def f(x):\n"
    assert (a.params.max_tokens, a.params.temperature, a.params.seed, a.params.top_p,
            a.params.top_k, a.params.stop, a.arrival_step) == (5, 0.7, 3, 0.9, 10, ["\n\n"], 2)
    assert b.prompt_ids == [1, 2, 3] and b.params.max_tokens == 9 and b.params.seed == 4
    assert b.arrival_step == 0 and b.arrival_s is None
    assert c.arrival_s == 0.25 and c.arrival_step is None and c.params.stop == ["x", "yy"]


BAD_FILES = [
    ([{"id": "a", "prompt_ids": [1]}, '{"id": "b", "prompt_ids": [1,}'], 2, "not JSON"),
    ([{"id": "a", "promt": "x"}], 1, "promt"),
    ([{"id": "a", "prompt_ids": [1]}, {"id": "b", "prompt": "x", "prompt_ids": [1]}], 2, "prompt"),
    ([{"id": "a"}], 1, "prompt"),
    ([{"id": "a", "prompt_ids": [1, 512]}], 1, "512"),
    ([{"id": "a", "prompt_ids": [-1]}], 1, "-1"),
    ([{"id": "a", "prompt_ids": [1, "2"]}], 1, "prompt_ids"),
    ([{"id": "a", "prompt_ids": [1, True]}], 1, "prompt_ids"),
    ([{"id": "a", "prompt_ids": "1 2"}], 1, "prompt_ids"),
    ([{"id": "a", "prompt_ids": []}], 1, "empty"),
    ([{"id": "a", "prompt_ids": [1]}, {"id": "b", "prompt_ids": [1]}, {"id": "a", "prompt_ids": [2]}],
     3, "duplicate id 'a'"),
    ([{"id": "a", "prompt_ids": [1]}, "", '["not", "an", "object"]'], 3, "JSON object"),
    ([{"id": "a", "prompt_ids": [1], "max_tokens": 0}], 1, "max_tokens"),
    ([{"id": "a", "prompt_ids": [1], "temperature": -1}], 1, "temperature"),
    ([{"id": "a", "prompt_ids": [1], "top_p": 2}], 1, "top_p"),
    ([{"id": "a", "prompt_ids": [1], "stop": [""]}], 1, "stop"),
    ([{"id": "a", "prompt_ids": [1], "arrival_step": 1, "arrival_s": 1.0}], 1, "arrival_s"),
    ([{"id": "a", "prompt_ids": [1], "arrival_step": -2}], 1, "arrival_step"),
    ([{"id": "a", "prompt_ids": [1], "arrival_s": "soon"}], 1, "arrival_s"),
    ([{"id": "a", "prompt": 5}], 1, "prompt"),
]


@pytest.mark.parametrize("lines,line_no,word", BAD_FILES, ids=[f"{i}-{w}" for i, (_, _, w) in enumerate(BAD_FILES)])
def test_request_file_errors_name_file_and_line(tmp_path, tok, lines, line_no, word):
    f = write(tmp_path, lines)
    with pytest.raises(WorkloadError) as exc:
        load_request_file(str(f), wcfg(), tok, VOCAB)
    msg = str(exc.value)
    assert f"{f}:{line_no}:" in msg, msg
    assert word in msg, msg


def test_request_file_whole_file_errors(tmp_path, tok):
    with pytest.raises(WorkloadError, match="workload.path"):
        load_request_file(None, wcfg(), tok, VOCAB)
    with pytest.raises(WorkloadError, match="does not exist"):
        load_request_file(str(tmp_path / "missing.jsonl"), wcfg(), tok, VOCAB)
    empty = write(tmp_path, ["", "  "], "empty.jsonl")
    with pytest.raises(WorkloadError, match="no requests"):
        load_request_file(str(empty), wcfg(), tok, VOCAB)
    text = write(tmp_path, [{"prompt": "hello"}], "text.jsonl")
    with pytest.raises(WorkloadError, match=f"{text}:1:.*tokenizer"):
        load_request_file(str(text), wcfg(), None, VOCAB)


def test_builtin_workloads(tok):
    w = OmegaConf.structured(WorkloadConfig)
    w.requests, w.stagger_steps, w.max_tokens = 10, 3, 7
    reqs = load_workload(w, tok, VOCAB)
    assert [r.id for r in reqs] == [f"req{i}" for i in range(10)]
    assert [r.arrival_step for r in reqs] == [3 * i for i in range(10)]
    assert reqs[8].prompt_text == DEFAULT_PROMPTS[0] and reqs[1].prompt_ids == tok.encode(DEFAULT_PROMPTS[1])
    assert len({r.params.seed for r in reqs}) == 10 and reqs[0].params.max_tokens == 7
    w.kind, w.requests, w.prompt_tokens = "synthetic", 3, 11
    syn = load_workload(w, tok, VOCAB)
    assert [len(r.prompt_ids) for r in syn] == [11] * 3
    assert all(0 < t < VOCAB for r in syn for t in r.prompt_ids)
    assert [r.prompt_ids for r in syn] == [r.prompt_ids for r in load_workload(w, tok, VOCAB)]
    w.requests = 0
    with pytest.raises(WorkloadError, match="workload.requests"):
        load_workload(w, tok, VOCAB)
    w.kind = "poisson"
    with pytest.raises(WorkloadError, match="workload.kind"):
        load_workload(w, tok, VOCAB)


def test_mixed_arrival_clocks_from_a_request_file(tmp_path, tok):
    """A request file may give arrival_step on some lines and arrival_s on others: a request due
    at arrival_s=0 arrives at once, not behind a request due at a later step."""
    import torch

    from strata.config import StrataConfig
    from strata.engine.llm_engine import Engine

    torch.set_num_threads(1)
    f = write(tmp_path, [{"id": "late", "prompt_ids": [5, 6, 7], "max_tokens": 2, "arrival_step": 30},
                         {"id": "now", "prompt_ids": [5, 6, 8], "max_tokens": 2, "arrival_s": 0.0}])
    reqs = load_request_file(str(f), wcfg(), tok, VOCAB)
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device = "cpu"
    cfg.engine.max_context = 256
    eng = Engine.from_config(cfg, log=lambda s: None)
    for r in reqs:
        eng.add_request(r)
    while eng.has_work() and eng.steps < 100:
        eng.step()
    arrive = {ev["req"]: ev["step"] for ev in eng.trace.events if ev["ev"] == "arrive"}
    assert arrive["late"] == 30
    assert arrive["now"] < 30, f"arrival_s=0 request arrived at step {arrive['now']}"


# ---------------------------------------------------------------------------------------------
# python -m strata (three subprocess runs)
# ---------------------------------------------------------------------------------------------

def strata_cli(*overrides, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "STRATA_BATCH_MTP"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "strata", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_run_files(run_dir: Path, n_requests: int, max_tokens: dict):
    outputs = read_jsonl(run_dir / "outputs.jsonl")
    assert len(outputs) == n_requests
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    for o in outputs:
        assert {"id", "text", "token_ids", "finish_reason"} <= set(o)
        assert o["finish_reason"] in FINISH_REASONS and o["finish_reason"] != "error"
        assert isinstance(o["token_ids"], list) and all(isinstance(t, int) for t in o["token_ids"])
        assert 0 < len(o["token_ids"]) <= max_tokens[o["id"]] or o["finish_reason"] == "stop"
        if o["finish_reason"] == "length":
            assert len(o["token_ids"]) == max_tokens[o["id"]]
            assert o["text"] == tok.decode(o["token_ids"])
    trace = read_jsonl(run_dir / "trace.jsonl")
    assert trace[0]["ev"] == "config"
    assert "engine" in trace[0] and "memory" in trace[0]
    for ev in trace:
        assert ev["ev"] in EVENT_FIELDS and "step" in ev and "t" in ev
        assert set(EVENT_FIELDS[ev["ev"]]) <= set(ev)
    kinds = {ev["ev"] for ev in trace}
    assert {"arrive", "admit", "prefill", "window", "commit", "finish"} <= kinds
    fin = {ev["req"]: ev for ev in trace if ev["ev"] == "finish"}
    assert set(fin) == {o["id"] for o in outputs}
    for o in outputs:
        assert fin[o["id"]]["tokens"] == len(o["token_ids"])
        assert fin[o["id"]]["reason"] == o["finish_reason"]
    steps = [ev["step"] for ev in trace]
    assert steps == sorted(steps)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for key in ("wall_s", "output_tokens", "aggregate_tps", "acceptance", "windows", "prefills",
                "graph", "ttft_s", "e2e_s", "requests"):
        assert key in metrics, key
    assert set(metrics["graph"]) >= {"hit", "capture", "eager", "evict"}
    assert set(metrics["ttft_s"]) >= {"p50", "p95"} and set(metrics["e2e_s"]) >= {"p50", "p95"}
    assert metrics["output_tokens"] == sum(len(o["token_ids"]) for o in outputs)
    assert metrics["windows"] == sum(ev["ev"] == "window" for ev in trace)
    assert metrics["prefills"] == sum(ev["ev"] == "prefill" for ev in trace)
    assert [r["id"] for r in metrics["requests"]] == [o["id"] for o in outputs]
    for r in metrics["requests"]:
        for key in ("id", "prompt_tokens", "output_tokens", "queue_s", "ttft_s", "e2e_s", "pp_tps",
                    "tg_tps", "e2e_tps", "finish_reason"):
            assert key in r, key
    return outputs, trace, metrics


@pytest.mark.slow
def test_cli_default_workload_writes_outputs_trace_metrics(tmp_path):
    run_dir = tmp_path / "run"
    p = strata_cli("device=cpu", "workload.requests=2", "workload.max_tokens=8", "progress=false",
                   f"hydra.run.dir={run_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    outputs, trace, metrics = check_run_files(run_dir, 2, {"req0": 8, "req1": 8})
    assert [o["id"] for o in outputs] == ["req0", "req1"]
    assert trace[0]["engine"]["batch_mtp"] is True  # the default: grouped MTP on
    assert "INFO slots=" in p.stderr
    assert "req0" in p.stdout and "req1" in p.stdout  # the outputs are printed
    assert str(run_dir) in p.stderr


@pytest.mark.slow
def test_cli_bad_override_exits_nonzero_naming_the_key(tmp_path):
    p = strata_cli("device=cpu", "engine.slotz=3", f"hydra.run.dir={tmp_path / 'run'}")
    assert p.returncode != 0
    assert "slotz" in p.stderr
    assert not (tmp_path / "run" / "outputs.jsonl").exists()


@pytest.mark.slow
def test_cli_workload_file(tmp_path):
    f = write(tmp_path, [
        {"id": "text", "prompt": "def read_config(path):\n", "max_tokens": 6, "arrival_step": 0},
        {"id": "ids", "prompt_ids": [5, 6, 7, 8], "max_tokens": 4, "arrival_step": 1,
         "temperature": 0.8, "seed": 11, "top_p": 0.9},
        {"id": "late", "prompt_ids": [9, 10], "max_tokens": 3, "arrival_step": 5, "top_k": 5,
         "temperature": 1.0, "seed": 2},
    ])
    run_dir = tmp_path / "run"
    p = strata_cli("device=cpu", "workload=file", f"workload.path={f}", "engine.slots=2",
                   "print_outputs=false", "progress=false", f"hydra.run.dir={run_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    outputs, trace, _ = check_run_files(run_dir, 3, {"text": 6, "ids": 4, "late": 3})
    assert [o["id"] for o in outputs] == ["text", "ids", "late"]  # input order
    arrive = {ev["req"]: ev["step"] for ev in trace if ev["ev"] == "arrive"}
    assert arrive == {"text": 0, "ids": 1, "late": 5}
    prompt_tokens = {ev["req"]: ev["prompt_tokens"] for ev in trace if ev["ev"] == "arrive"}
    tok = Tokenizer.from_dir(EMBEDDED_MODEL_DIR)
    assert prompt_tokens == {"text": len(tok.encode("def read_config(path):\n")), "ids": 4, "late": 2}
    assert trace[0]["engine"]["slots"] == 2
