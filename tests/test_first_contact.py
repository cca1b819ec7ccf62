"""What a new user meets first (issue 20, item 7): bad inputs are one `error:` line with exit
code 2, `--help` describes every setting from the schema, an explicit override beats the
environment and the console names the mode, errors name file:line and request id, the API key
never reaches the run dir in clear, server.default_max_tokens, the prompt/completion boundary.

Most checks call the functions behind the command line; a few run `python -m strata` and
`python -m strata.serve` as a user would (each a few seconds on the CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from strata import cli
from strata.config import ConfigError, ServerConfig, batch_mtp_from_env, check_key
from strata.serve.api_key import resolve_api_key
from strata.serve.app import gives_max_tokens
from strata.settings_help import first_sentence, settings, settings_help
from strata.workload import WorkloadError, check_workload, load_request_file

REPO = Path(__file__).resolve().parents[1]
VOCAB = 256


def run_cli(module: str, *args: str, env: dict | None = None, timeout: float = 300):
    base = {k: v for k, v in os.environ.items() if k not in ("STRATA_BATCH_MTP", "STRATA_API_KEY")}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO,
                          env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, no traceback, exactly one `error:` line (the last), which holds every needle."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr and "HYDRA_FULL_ERROR" not in res.stderr, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and res.stderr.strip().splitlines()[-1] == errors[0], res.stderr
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


# ------------------------------------------------------------------ bad command-line overrides
@pytest.mark.parametrize("args, needles", [
    (["engine.batchmtp=false"], ["engine.batchmtp: unknown key; did you mean engine.batch_mtp?"]),
    (["enigne.slots=2"], ["did you mean engine?"]),
    (["+engine.foo=1"], ["engine.foo: unknown key"]),
    (["~engine.slot"], ["did you mean engine.slots?"]),
    (["engine.slots=abc"], ["engine.slots=abc", "Integer"]),
    (["workload=nope"], ["workload=nope", "default, file, synthetic"]),
    (["engine.slots=1,2"], ["engine.slots=1,2", "-m"]),
    (["-m", "engine.slots=1,x"], ["engine.slots=x", "Integer"]),
    (["-m", "workload=default,nope"], ["workload=nope"]),
    (["engine.slots=[1"], ["cannot parse"]),
])
def test_bad_override_is_one_error_naming_the_key(args, needles):
    parsed_args = list(args)
    with pytest.raises(ConfigError) as exc:
        cli.check_overrides(parsed_args)
    msg = str(exc.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_check_key_accepts_every_setting_and_group():
    for key, _default, _desc in settings():
        check_key(key)
    for group in ("engine", "workload", "server", "model", "backend"):
        check_key(group)


def test_mistyped_key_end_to_end_is_one_line_exit_2():
    res = run_cli("strata", "engine.batchmtp=false")
    assert_one_error(res, "did you mean engine.batch_mtp?")
    assert "To append to your config" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_serve_bad_setting_is_one_line_exit_2_and_key_never_on_disk(tmp_path):
    """The server refuses a bad port before binding; Hydra has saved the run dir by then, and
    the key given on the command line is not in it."""
    run_dir = tmp_path / "run"
    res = run_cli("strata.serve", "server.port=70000", "server.api_key=sekret-XYZ-123",
                  f"hydra.run.dir={run_dir}")
    assert_one_error(res, "server.port")
    saved = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "overrides.yaml" for p in saved), saved
    for p in saved:
        text = p.read_text(errors="replace")
        assert "sekret-XYZ-123" not in text, p
    assert cli.REDACTED in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert cli.REDACTED in (run_dir / ".hydra" / "config.yaml").read_text()


@pytest.mark.slow
def test_serve_checks_default_max_tokens_and_key_file(tmp_path):
    res = run_cli("strata.serve", "server.default_max_tokens=0", f"hydra.run.dir={tmp_path}")
    assert_one_error(res, "server.default_max_tokens")
    res = run_cli("strata.serve", f"server.api_key_file={tmp_path}", f"hydra.run.dir={tmp_path}")
    assert_one_error(res, "server.api_key_file", "is a directory")


# ------------------------------------------------------------------ --help
@pytest.mark.parametrize("module", ["strata", "strata.serve"])
def test_help_lists_every_setting_with_its_description(module):
    res = run_cli(module, "--help")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for key, default, desc in settings():
        assert desc, f"{key} has no description in the schema"
        row = next((ln for ln in lines if ln.strip().startswith(f"{key}=")), None)
        assert row is not None, f"--help misses {key}"
        assert desc in row and f"{key}={default}" in row, row
    assert "workload=default|file|synthetic" in res.stdout
    assert "STRATA_BATCH_MTP" in res.stdout and "STRATA_API_KEY" in res.stdout


def test_help_descriptions_are_first_sentences():
    assert first_sentence("Rows of one window (W). More here.") == "Rows of one window (W)."
    assert first_sentence("Say a (b. c) d. e") == "Say a (b. c) d."
    assert first_sentence("an explicit x=... wins. Next") == "an explicit x=... wins."
    text = settings_help("python -m strata")
    assert "engine.window_rows=8" in text and "Rows of one verifier forward (W)." in text


@pytest.mark.parametrize("schema", ["strata.config:StrataConfig", "sim.config:SimConfig"])
def test_every_setting_of_both_schemas_has_its_own_description(schema):
    """A `#:` block shared by several fields describes only the first: each needs its own."""
    import importlib

    module, name = schema.split(":")
    rows = list(settings(getattr(importlib.import_module(module), name)))
    assert rows
    missing = [key for key, _default, desc in rows if not desc.strip()]
    assert not missing, f"{schema}: settings without a description: {missing}"


# ------------------------------------------------------------------ workload files
def wcfg(**kw):
    from strata.config import WorkloadConfig

    return OmegaConf.structured(WorkloadConfig(kind="file", **kw))


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [1 + (b % (VOCAB - 1)) for b in text.encode()]


def test_invalid_utf8_names_the_line(tmp_path):
    f = tmp_path / "req.jsonl"
    f.write_bytes(b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "\xff\xfe"}\n')
    with pytest.raises(WorkloadError, match=r"req.jsonl:2: not UTF-8 text"):
        load_request_file(str(f), wcfg(path=str(f)), _Tok(), VOCAB)


def test_directory_as_workload_path_says_directory(tmp_path):
    with pytest.raises(WorkloadError, match="is a directory"):
        check_workload(wcfg(path=str(tmp_path)))
    with pytest.raises(WorkloadError, match="does not exist"):
        check_workload(wcfg(path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(WorkloadError, match="needs workload.path"):
        check_workload(OmegaConf.merge(OmegaConf.structured(wcfg()), {"path": "???"}))


@pytest.mark.slow
def test_workload_path_is_checked_before_the_model_loads(tmp_path):
    res = run_cli("strata", "workload=file", f"workload.path={tmp_path}",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_error(res, "is a directory")
    assert "INFO slots=" not in res.stderr  # no engine was built


def test_workload_origins_name_file_lines(tmp_path):
    f = tmp_path / "req.jsonl"
    f.write_text('{"id": "a", "prompt_ids": [1, 2]}\n\n{"id": "b", "prompt_ids": [3]}\n')
    reqs = load_request_file(str(f), wcfg(path=str(f)), _Tok(), VOCAB)
    assert reqs.origins == {"a": f"{f}:1", "b": f"{f}:3"}


# ------------------------------------------------------------------ environment vs override
@pytest.mark.parametrize("env, cfg_value, explicit, want", [
    (None, True, False, True), ("1", False, False, True), ("0", True, False, False),
    ("1", False, True, False), ("0", True, True, True), ("", False, False, False),
])
def test_explicit_batch_mtp_beats_the_environment(monkeypatch, env, cfg_value, explicit, want):
    if env is None:
        monkeypatch.delenv("STRATA_BATCH_MTP", raising=False)
    else:
        monkeypatch.setenv("STRATA_BATCH_MTP", env)
    assert batch_mtp_from_env(cfg_value, explicit=explicit) is want


@pytest.mark.slow
def test_run_names_mode_and_locates_request_errors(tmp_path):
    """One small run: STRATA_BATCH_MTP=1 with an explicit engine.batch_mtp=false runs batch,
    says so, writes mode into metrics.json, and frames each prompt and completion. A second
    one with an over-long prompt names its file:line and request id."""
    f = tmp_path / "req.jsonl"
    f.write_text(json.dumps({"id": "only", "prompt": "def f(x):", "max_tokens": 2}) + "\n")
    run_dir = tmp_path / "run"
    res = run_cli("strata", "engine.batch_mtp=false", "workload=file", f"workload.path={f}",
                  "device=cpu", "engine.max_context=64", "progress=false",
                  f"hydra.run.dir={run_dir}", env={"STRATA_BATCH_MTP": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((run_dir / "metrics.json").read_text())["mode"] == "batch"
    assert "INFO mode: batch (" in res.stderr and "STRATA_BATCH_MTP=1 ignored" in res.stderr
    out = res.stdout
    assert "mode: batch\n" in out
    assert "--- only: prompt\ndef f(x):\n--- only: completion (length, 2 tokens)\n" in out

    f.write_text(json.dumps({"id": "ok", "prompt_ids": [5, 6]}) + "\n"
                 + json.dumps({"id": "too-long", "prompt_ids": [5] * 80}) + "\n")
    res = run_cli("strata", "workload=file", f"workload.path={f}", "device=cpu",
                  "engine.max_context=64", f"hydra.run.dir={tmp_path / 'run2'}")
    assert_one_error(res, f"{f}:2: request 'too-long': prompt:", "64 positions")


# ------------------------------------------------------------------ the API key
def scfg(**kw):
    return OmegaConf.structured(ServerConfig(**kw))


def test_api_key_sources(tmp_path):
    key_file = tmp_path / "key.txt"
    key_file.write_text("from-file\n")
    assert resolve_api_key(scfg(), {}) is None
    assert resolve_api_key(scfg(), {cli.API_KEY_ENV: "from-env"}) == "from-env"
    assert resolve_api_key(scfg(api_key_file=str(key_file)), {cli.API_KEY_ENV: "e"}) == "from-file"
    assert resolve_api_key(scfg(api_key="given"), {cli.API_KEY_ENV: "e"}) == "given"
    assert resolve_api_key(scfg(api_key=cli.REDACTED), {cli.API_KEY_ENV: "moved"}) == "moved"
    with pytest.raises(ConfigError, match="placeholder"):
        resolve_api_key(scfg(api_key=cli.REDACTED), {})
    with pytest.raises(ConfigError, match="at most one"):
        resolve_api_key(scfg(api_key="a", api_key_file=str(key_file)), {})
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve_api_key(scfg(api_key_file=str(key_file)), {})
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_api_key(scfg(api_key_file=str(tmp_path / "nope")), {})


def test_command_line_key_moves_to_the_environment(monkeypatch):
    # setenv first, so the key hide_api_key writes is undone after the test (the server
    # tests that follow in this process must not inherit it)
    monkeypatch.setenv(cli.API_KEY_ENV, "before")
    out = cli.hide_api_key(["server.port=1", "server.api_key=s3cret", "device=cpu"])
    assert out == ["server.port=1", f"server.api_key={cli.REDACTED}", "device=cpu"]
    assert os.environ[cli.API_KEY_ENV] == "s3cret"
    assert cli.hide_api_key(["server.api_key=null"]) == ["server.api_key=null"]


# ------------------------------------------------------------------ server.default_max_tokens
def test_default_max_tokens_applies_when_a_request_gives_none():
    assert not gives_max_tokens({"prompt": "x"}, "completion")
    assert not gives_max_tokens({"messages": [], "max_tokens": None}, "chat")
    assert gives_max_tokens({"prompt": "x", "max_tokens": 3}, "completion")
    assert gives_max_tokens({"messages": [], "max_completion_tokens": 3}, "chat")
    assert not gives_max_tokens({"prompt": "x", "max_completion_tokens": 3}, "completion")
    assert ServerConfig().default_max_tokens >= 1


@pytest.mark.slow
def test_server_default_max_tokens_and_key_file_end_to_end(tmp_path):
    """A real server: its key from server.api_key_file, and a chat without max_tokens
    generates server.default_max_tokens tokens, not the rest of the context."""
    import httpx
    from test_server import ServerProc

    key_file = tmp_path / "key.txt"
    key_file.write_text("file-key-42\n")
    s = ServerProc(tmp_path, f"server.api_key_file={key_file}", "server.default_max_tokens=3")
    try:
        s.wait_ready()
        chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        r = httpx.post(s.base + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 401
        auth = {"Authorization": "Bearer file-key-42"}
        r = httpx.post(s.base + "/v1/chat/completions", json=chat, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        r = httpx.post(s.base + "/v1/completions", json={"prompt": "x", "ignore_eos": True},
                       headers=auth, timeout=120)
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        s.stop()
    for p in tmp_path.rglob("*"):
        if p.is_file() and p != key_file:
            assert "file-key-42" not in p.read_text(errors="replace"), p
