"""Workloads: the default code prompts, a JSON Lines request file, or synthetic requests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

from strata.config import validate_workload_base
from strata.engine.request import (Request, RequestError, SamplingParams, check_arrival,
                                   unpaired_surrogate)

#: Four distinct code prompts: the main job's default workload.
DEFAULT_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "def read_config(path):\n    with open(path) as f:\n",
    "    def __repr__(self):\n        return ",
    "for key, value in sorted(items.items()):\n",
    "try:\n    import json\nexcept ImportError:\n",
    "def parse_args(args=None):\n    parser = argparse.ArgumentParser(",
]

FIELDS = {"id", "prompt", "prompt_ids", "max_tokens", "arrival_step", "arrival_s", "temperature",
          "seed", "stop", "top_p", "top_k"}


class WorkloadError(ValueError):
    """A workload that cannot run; names the file, line and field."""


class Workload(list):
    """The requests of a workload, in input order, with where each one came from (`file:line`
    or the workload kind), so an error the engine finds later still names its source."""

    def __init__(self, requests: list[Request], origins: dict[str, str]):
        super().__init__(requests)
        self.origins = origins


def _params(d: dict[str, Any], w: Any, where: str) -> SamplingParams:
    stop = d.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    p = SamplingParams(max_tokens=d.get("max_tokens", w.max_tokens),
                       temperature=d.get("temperature", w.temperature), top_p=d.get("top_p", w.top_p),
                       top_k=d.get("top_k", w.top_k), seed=d.get("seed", w.seed), stop=stop)
    try:
        p.validate()
    except RequestError as e:
        raise WorkloadError(f"{where}: {e}") from None
    return p


def check_workload(w: Any) -> None:
    """The workload knobs that need no model: checked before the checkpoint is read."""
    if w.kind not in ("default", "file", "synthetic"):
        raise WorkloadError(f"workload.kind: must be default, file or synthetic, got {w.kind!r}")
    validate_workload_base(w, WorkloadError, made_up=w.kind != "file")
    try:  # the sampling defaults, named as the knobs they are
        SamplingParams(max_tokens=w.max_tokens, temperature=w.temperature, top_p=w.top_p,
                       top_k=w.top_k, seed=w.seed).validate()
    except RequestError as e:
        raise WorkloadError(f"workload.{e.field}: {e.message}") from None
    if w.kind == "file":
        request_file(_path(w))
        return
    if _path(w) is not None:  # a file the run would silently not read
        raise WorkloadError(f"workload.path={_path(w)}: read only by workload=file, but "
                            f"workload.kind is {w.kind}; add workload=file or drop workload.path")
    if w.seed + w.requests - 1 >= 2**63:  # request i's seed is workload.seed + i
        raise WorkloadError(f"workload.seed: request i samples with workload.seed + i, which must "
                            f"stay below 2**63 for all workload.requests={w.requests}: at most "
                            f"{2**63 - w.requests}, got {w.seed}")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _path(w: Any) -> Optional[str]:
    from omegaconf import DictConfig, OmegaConf

    return None if isinstance(w, DictConfig) and OmegaConf.is_missing(w, "path") else w.path


def request_file(path: Optional[str]) -> Path:
    """workload.path as a readable file, or a WorkloadError saying what it is instead."""
    if not path:
        raise WorkloadError("workload.path: workload=file needs workload.path=FILE")
    f = Path(path)
    if f.is_dir():
        raise WorkloadError(f"workload.path: {f} is a directory; give a JSON Lines file")
    if not f.exists():
        raise WorkloadError(f"workload.path: {f} does not exist")
    if not f.is_file():
        raise WorkloadError(f"workload.path: {f} is not a regular file")
    return f


def request_lines(f: Path) -> list[str]:
    """The file's lines, each decoded as UTF-8 on its own so a bad byte names its line."""
    try:
        raw = f.read_bytes()
    except OSError as e:
        raise WorkloadError(f"workload.path: cannot read {f}: {e.strerror}") from None
    lines = []
    for n, line in enumerate(raw.splitlines(), 1):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise WorkloadError(f"{f}:{n}: not UTF-8 text (byte {e.start + 1} of the line: "
                                f"{e.reason})") from None
    return lines


def load_workload(w: Any, tokenizer, vocab_size: int, log=_stderr) -> Workload:
    """Requests of the configured workload, in input order. Without a tokenizer (a model of
    dummy weights from a config alone) the default workload's code prompts become random
    token-id prompts, as kind=synthetic draws them."""
    check_workload(w)
    if w.kind == "file":
        return load_request_file(_path(w), w, tokenizer, vocab_size)
    if w.kind == "default" and tokenizer is None:
        log(f"INFO workload=default: the model has no tokenizer.json, so its {w.requests} prompts "
            f"are {w.prompt_tokens} random token ids each (workload.seed={w.seed}, "
            f"workload.prompt_tokens), not the code prompts")
    reqs = _generated(w, tokenizer, vocab_size)
    return Workload(reqs, {r.id: f"workload={w.kind}" for r in reqs})


def _generated(w: Any, tokenizer, vocab_size: int) -> list[Request]:
    if w.kind == "default" and tokenizer is not None:
        n = w.requests
        return [Request(f"req{i}", tokenizer.encode(DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]),
                        _params({"seed": w.seed + i}, w, "workload"),
                        arrival_step=i * w.stagger_steps,
                        prompt_text=DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)])
                for i in range(n)]
    if w.kind in ("synthetic", "default"):
        rng = np.random.default_rng(w.seed)
        low = 1 if vocab_size > 1 else 0  # id 0 is EOS in strata's tiny models
        return [Request(f"req{i}", rng.integers(low, vocab_size, w.prompt_tokens).tolist(),
                        _params({"seed": w.seed + i}, w, "workload"), arrival_step=i * w.stagger_steps)
                for i in range(w.requests)]
    raise WorkloadError(f"workload.kind: {w.kind!r} is not a generated workload")


def _check_unicode(d: dict[str, Any], where: str) -> None:
    """Refuse a string field (or list item) that is not Unicode text (request.unpaired_surrogate)."""
    for key, v in d.items():
        for text in v if isinstance(v, list) else [v]:
            problem = unpaired_surrogate(text) if isinstance(text, str) else None
            if problem:
                raise WorkloadError(f"{where}: {key} is not valid Unicode: {problem}")


def load_request_file(path: Optional[str], w: Any, tokenizer, vocab_size: int) -> Workload:
    f = request_file(path)
    out: list[Request] = []
    origins: dict[str, str] = {}
    seen: set[str] = set()
    for n, line in enumerate(request_lines(f), 1):
        if not line.strip():
            continue
        where = f"{f}:{n}"
        try:
            d = json.loads(line)
        # ValueError: also an integer of over 4300 digits; RecursionError: arrays nested deep
        except (ValueError, RecursionError) as e:
            raise WorkloadError(f"{where}: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise WorkloadError(f"{where}: each line must be a JSON object")
        unknown = sorted(set(d) - FIELDS)
        if unknown:
            raise WorkloadError(f"{where}: unknown field(s) {unknown} (known: {sorted(FIELDS)})")
        _check_unicode(d, where)
        rid = d.get("id", f"req{len(out)}")
        if isinstance(rid, int) and not isinstance(rid, bool):
            rid = str(rid)  # an integer id reads as its digits
        if not isinstance(rid, str):
            raise WorkloadError(f"{where}: id must be a string, got {rid!r}")
        if rid in seen:
            raise WorkloadError(f"{where}: duplicate id {rid!r}")
        seen.add(rid)
        if ("prompt" in d) == ("prompt_ids" in d):
            raise WorkloadError(f"{where}: give exactly one of prompt and prompt_ids")
        if "prompt" in d:
            if not isinstance(d["prompt"], str):
                raise WorkloadError(f"{where}: prompt must be a string")
            if tokenizer is None:
                raise WorkloadError(f"{where}: request {rid!r}: a text prompt needs a "
                                    f"tokenizer.json, and the model has none; give prompt_ids")
            ids = tokenizer.encode(d["prompt"])
        else:
            ids = d["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise WorkloadError(f"{where}: prompt_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise WorkloadError(f"{where}: prompt_ids: token id {bad[0]} is not in [0, {vocab_size})")
        if not ids:
            raise WorkloadError(f"{where}: prompt is empty")
        if "arrival_step" in d and "arrival_s" in d:
            raise WorkloadError(f"{where}: give at most one of arrival_step and arrival_s")
        step = d.get("arrival_step", 0 if "arrival_s" not in d else None)
        sec = d.get("arrival_s")
        try:
            check_arrival(step, sec)
        except RequestError as e:
            raise WorkloadError(f"{where}: {e.field} {e.message}") from None
        out.append(Request(rid, ids, _params(d, w, where), arrival_step=step,
                           arrival_s=None if sec is None else float(sec),
                           prompt_text=d.get("prompt")))
        origins[rid] = where
    if not out:
        raise WorkloadError(f"{f}: no requests")
    return Workload(out, origins)
