"""`--help` text, generated from the config schemas so the schema stays the one source.

Each setting's description is the `#:` comment above its field in the schema dataclass (or a
`help` entry in the field's metadata); its first sentence is the one-line description.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator

from strata.config import EMBEDDED_MODEL_DIR, StrataConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def field_comments(schema: type) -> dict[str, str]:
    """`#:` comment text above each field of a dataclass and of the dataclasses it extends
    (a field declared in a base is described there), joined into one paragraph."""
    out = {}
    for cls in reversed(schema.__mro__):
        if is_dataclass(cls):
            out.update((k, v) for k, v in _own_field_comments(cls).items() if v)
    return out


def _own_field_comments(schema: type) -> dict[str, str]:
    """`#:` comments of the fields declared in `schema`'s own class body."""
    lines, _ = inspect.getsourcelines(schema)
    src = textwrap.dedent("".join(lines))
    body = ast.parse(src).body[0]
    src_lines = src.splitlines()
    out = {}
    for node in getattr(body, "body", []):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = []
            i = node.lineno - 2
            while i >= 0 and src_lines[i].strip().startswith("#:"):
                text.insert(0, src_lines[i].strip()[2:].strip())
                i -= 1
            out[node.target.id] = " ".join(text)
    return out


def first_sentence(text: str) -> str:
    """Up to the first '. ' outside brackets and not an ellipsis ('e.g.' has no space)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "." and depth == 0 and text[i - 1:i] != "." and (i + 1 == len(text) or text[i + 1] == " "):
            return text[: i + 1]
    return text


def _default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return "???"


def _show(v: Any) -> str:
    if v == EMBEDDED_MODEL_DIR:
        return "<embedded tiny model>"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return "[" + ",".join(_show(x) for x in v) + "]"
    return str(v)


def settings(schema: type = StrataConfig, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(dotted key, schema default, one-line description) of every leaf setting."""
    hints = typing.get_type_hints(schema)
    comments = field_comments(schema)
    for f in fields(schema):
        if is_dataclass(hints[f.name]):
            yield from settings(hints[f.name], f"{prefix}{f.name}.")
            continue
        desc = f.metadata.get("help") or comments.get(f.name, "")
        yield f"{prefix}{f.name}", _show(_default(f)), first_sentence(desc)


def group_options() -> dict[str, list[str]]:
    """Config groups under conf/ (model=tiny, workload=file, ...) and their options."""
    out = {}
    for d in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in ("hydra", "sim")):
        out[d.name] = sorted(p.stem for p in d.glob("*.yaml"))
    return out


def settings_help(prog: str) -> str:
    rows = list(settings())
    width = max(len(f"{k}={v}") for k, v, _ in rows) + 2
    groups = "\n".join(f"  {g}={'|'.join(opts)}" for g, opts in group_options().items())
    lines = [f"usage: {prog} [GROUP=OPTION ...] [KEY=VALUE ...]",
             f"       {prog} -m KEY=V1,V2 ...   (a Hydra multirun sweep; --hydra-help for Hydra's flags)",
             "",
             "Config groups (a group picks a YAML file under conf/ that sets some of the keys below):",
             groups,
             "",
             "Settings (KEY=DEFAULT  description; schemas in strata/config.py):"]
    for k, v, d in rows:
        lines.append(f"  {f'{k}={v}':<{width}}{d}")
    lines += ["",
              "Environment: STRATA_BATCH_MTP=0|1 replaces engine.batch_mtp's default (an explicit",
              "engine.batch_mtp=... wins); STRATA_API_KEY is the server's key when neither",
              "server.api_key nor server.api_key_file is set."]
    return "\n".join(lines)
