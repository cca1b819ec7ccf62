"""Bad input on `python -m strata`'s command line (the CLI audit): each case here crashed with a
traceback, hung, ran on an invalid value or failed late before its fix. Every one is now a
one-line error naming the key or file:line and the value, exit code 2.

Most checks call the validators and loaders directly; three run `python -m strata` (slow).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from strata import cli
from strata.config import (EMBEDDED_MODEL_DIR, ConfigError, EngineConfig, ModelConfig,
                           WorkloadConfig, validate_engine, validate_model)
from strata.engine.request import Request, RequestError, SamplingParams
from strata.model.config import CheckpointError, load_model_args
from strata.model.tokenizer import Tokenizer
from strata.workload import WorkloadError, check_workload, load_request_file

REPO = Path(__file__).resolve().parent.parent
VOCAB = 4096


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(EMBEDDED_MODEL_DIR)


def wcfg(**kw):
    w = OmegaConf.structured(WorkloadConfig)
    for k, v in kw.items():
        setattr(w, k, v)
    return w


# ------------------------------------------------------------------ engine and model knobs
@pytest.mark.parametrize("key, value", [
    ("graph_mib_estimate", math.inf),  # was an OverflowError traceback in the memory plan
    ("graph_mib_estimate", math.nan),
    ("cpu_graph_mib", math.nan),       # was accepted: `nan < 0` is false
    ("cpu_graph_mib", math.inf),
])
def test_non_finite_engine_sizes_are_refused(key, value):
    e = EngineConfig(**{key: value})
    with pytest.raises(ConfigError, match=rf"engine\.{key}: must be a finite number >= 0, got {value}"):
        validate_engine(e)


@pytest.mark.parametrize("skew", [math.nan, math.inf])
def test_non_finite_routing_skew_is_refused(skew):
    # was accepted with load_format=dummy: NaN router logits, every request "stop" at 0 tokens
    with pytest.raises(ConfigError, match=rf"model\.dummy_routing_skew: .*got {skew}"):
        validate_model(ModelConfig(dummy_routing_skew=skew))


@pytest.mark.parametrize("path", ["", "  "])
def test_empty_model_path_names_the_key(path):
    # was "config.json: missing": Path("") is the working directory
    with pytest.raises(ConfigError, match=r"model\.path: must name a checkpoint directory, got "):
        validate_model(ModelConfig(path=path))


# ------------------------------------------------------------------ workload knobs
@pytest.mark.parametrize("key, value, word", [
    ("temperature", -1.0, "must be >= 0"),
    ("temperature", math.nan, "finite"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_k", -1, "top_k"),
    ("seed", -1, "seed"),
])
def test_workload_sampling_defaults_fail_before_the_model_loads(key, value, word):
    # were checked only after the checkpoint was read, as "workload: temperature: ..."
    with pytest.raises(WorkloadError) as exc:
        check_workload(wcfg(**{key: value}))
    assert str(exc.value).startswith(f"workload.{key}: "), exc.value
    assert word in str(exc.value)


def test_generated_seed_past_int64_names_workload_seed():
    # request i samples with seed + i: was "workload: seed: ... got 2**63", a value never given
    with pytest.raises(WorkloadError, match=r"workload\.seed: .*workload\.requests=2.*got 9223372036854775807"):
        check_workload(wcfg(seed=2**63 - 1, requests=2))
    check_workload(wcfg(seed=2**63 - 2, requests=2))


@pytest.mark.parametrize("kind", ["default", "synthetic"])
def test_workload_path_without_workload_file_is_refused(tmp_path, kind):
    # was silently ignored: the default prompts ran and the file's requests were lost
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"prompt": "x"}\n')
    with pytest.raises(WorkloadError, match=rf"workload\.path={f}: .*workload=file"):
        check_workload(wcfg(kind=kind, path=str(f)))


# ------------------------------------------------------------------ request files
BAD_LINES = [
    # tracebacks: ValueError (int over 4300 digits), RecursionError, TypeError (tokenizer),
    # OverflowError (float() of a huge int)
    ('{"id": "a", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "not JSON"),
    ('{"id": "a", "prompt": "x", "stop": ' + "[" * 100000 + "]" * 100000 + "}", "not JSON"),
    ('{"id": "a", "prompt": "x\\ud800y"}', "prompt is not valid Unicode: unpaired surrogate \\ud800"),
    ('{"id": "a\\udc00", "prompt": "x"}', "id is not valid Unicode"),
    ('{"id": "a", "prompt": "x", "stop": ["ok", "\\ud800"]}', "stop is not valid Unicode"),
    ('{"id": "a", "prompt": "x", "temperature": 1' + "0" * 400 + "}", "temperature"),
    ('{"id": "a", "prompt": "x", "top_p": 1' + "0" * 400 + "}", "top_p"),
    ('{"id": "a", "prompt": "x", "arrival_s": 1' + "0" * 400 + "}", "arrival_s"),
    ('{"id": "a", "prompt": "x", "arrival_step": 1' + "0" * 400 + "}", "arrival_step"),
    # accepted, then the run waited for ever
    ('{"id": "a", "prompt": "x", "arrival_s": Infinity}', "arrival_s must be a finite number >= 0, got inf"),
    ('{"id": "a", "prompt": "x", "arrival_s": 1e400}', "arrival_s must be a finite number >= 0, got inf"),
    # accepted with the wrong type
    ('{"id": "a", "prompt": "x", "arrival_s": true}', "arrival_s must be a finite number >= 0, got True"),
    ('{"id": null, "prompt": "x"}', "id must be a string, got None"),
    ('{"id": ["a"], "prompt": "x"}', "id must be a string, got ['a']"),
    ('{"id": {"a": 1}, "prompt": "x"}', "id must be a string"),
    ('{"id": true, "prompt": "x"}', "id must be a string, got True"),
]


@pytest.mark.parametrize("line, word", BAD_LINES, ids=[f"{i}" for i in range(len(BAD_LINES))])
def test_bad_request_line_is_a_workload_error_naming_file_and_line(tmp_path, tok, line, word):
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"id": "ok", "prompt_ids": [1, 2]}\n' + line + "\n")
    with pytest.raises(WorkloadError) as exc:
        load_request_file(str(f), wcfg(kind="file"), tok, VOCAB)
    msg = str(exc.value)
    assert msg.startswith(f"{f}:2: "), msg
    assert word in msg, msg
    msg.encode("utf-8")  # printable: no surrogate echoed back


def test_integer_ids_still_read_as_their_digits(tmp_path, tok):
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"id": 7, "prompt_ids": [1]}\n{"id": "b", "prompt_ids": [2], "arrival_s": 0}\n')
    reqs = load_request_file(str(f), wcfg(kind="file"), tok, VOCAB)
    assert [r.id for r in reqs] == ["7", "b"] and reqs[1].arrival_s == 0.0


@pytest.mark.parametrize("kw, field", [
    ({"arrival_s": math.inf}, "arrival_s"),
    ({"arrival_s": True}, "arrival_s"),
    ({"arrival_step": 2**63}, "arrival_step"),
    ({"arrival_step": True}, "arrival_step"),
])
def test_request_refuses_arrivals_that_never_come(kw, field):
    # the engine's own guard (the arrival heaps take float(); an infinite arrival never comes)
    with pytest.raises(RequestError) as exc:
        Request("a", [1, 2], SamplingParams(), **kw).validate(VOCAB, 64)
    assert exc.value.field == field


@pytest.mark.parametrize("name", ["temperature", "top_p"])
def test_sampling_params_refuse_ints_too_large_for_a_float(name):
    with pytest.raises(RequestError) as exc:  # was an OverflowError from math.isfinite
        SamplingParams(**{name: 10**400}).validate()
    assert exc.value.field == name


# ------------------------------------------------------------------ command-line overrides
@pytest.mark.parametrize("args, needles", [
    # a sweep's out-of-range value: was found only when its job started, after the jobs before
    (["-m", "engine.slots=1,0"], ["engine.slots: must be >= 1, got 0"]),
    (["-m", "model.moe_dense_experts=4,-1"], ["model.moe_dense_experts: must be >= 0, got -1"]),
    (["engine.graph_mib_estimate=inf"], ["engine.graph_mib_estimate", "inf"]),
    (["=5"], ["=5: an override needs a key"]),  # was "error: : unknown key"
])
def test_override_values_are_checked_before_hydra_runs(args, needles):
    with pytest.raises(ConfigError) as exc:
        cli.check_overrides(list(args))
    for n in needles:
        assert n in str(exc.value), (n, str(exc.value))


def test_run_dir_under_a_file_is_refused(tmp_path):
    # Hydra made the directory and died with a FileExistsError traceback
    f = tmp_path / "afile"
    f.write_text("")
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        for target in (f, f / "sub"):
            with pytest.raises(ConfigError, match=rf"{key}={target}: {f} is a file"):
                cli.check_overrides([f"{key}={target}"])
    cli.check_overrides([f"hydra.run.dir={tmp_path / 'new' / 'run'}"])
    cli.check_overrides(["hydra.run.dir=outputs/${now:%Y}"])


# ------------------------------------------------------------------ checkpoints (not fixed here)
@pytest.mark.parametrize("raw", [b"[1, 2]", b"null", b'{"a": "\xff"}',
                                 b'{"model_type": "x", "text_config": "x"}'],
                         ids=["list", "null", "non-utf8", "text_config-str"])
def test_malformed_config_json_is_a_checkpoint_error(tmp_path, raw):
    (tmp_path / "config.json").write_bytes(raw)
    with pytest.raises(CheckpointError, match="config.json"):
        load_model_args(tmp_path)


def test_string_rope_parameters_is_a_checkpoint_error(tmp_path):
    cfg = json.loads((Path(EMBEDDED_MODEL_DIR) / "config.json").read_text())
    cfg["rope_parameters"] = "x"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope_parameters"):
        load_model_args(tmp_path)


# ------------------------------------------------------------------ python -m strata (slow)
def strata_cli(*args, flags=(), timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "STRATA_BATCH_MTP"}
    env["OMP_NUM_THREADS"] = "1"
    # flags (-m) before the overrides: argparse takes no flag between them
    return subprocess.run([sys.executable, "-m", "strata", *flags, "device=cpu", "progress=false",
                           "print_outputs=false", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr and "HYDRA_FULL_ERROR" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), p.stderr
    for n in needles:
        assert n in last, (n, last)


@pytest.mark.slow
def test_cli_unpaired_surrogate_prompt_is_one_error_line(tmp_path):
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"id": "a", "prompt": "x\\ud800", "max_tokens": 2}\n')
    p = strata_cli("workload=file", f"workload.path={f}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_error(p, f"{f}:1:", "prompt", "\\ud800")
    assert not (tmp_path / "run" / "outputs.jsonl").exists()


@pytest.mark.slow
def test_cli_run_dir_that_is_a_file_is_one_error_line(tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    assert_one_error(strata_cli(f"hydra.run.dir={f}"), "hydra.run.dir", "is a file")


@pytest.mark.slow
def test_cli_sweep_with_a_bad_value_runs_no_job(tmp_path):
    sweep = tmp_path / "sweep"
    p = strata_cli("workload.requests=1", "workload.max_tokens=2", "engine.slots=1,0",
                   f"hydra.sweep.dir={sweep}", flags=("-m",))
    assert_one_error(p, "engine.slots: must be >= 1, got 0")
    assert not sweep.exists()  # job 0 (slots=1) did not run first
