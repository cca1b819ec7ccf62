"""Every setting the docs name exists: a `group.key` in README.md or docs/*.md (the history in
CHANGELOG.md aside) is a field of that group's schema, in strata's config (StrataConfig) or the
simulator's (SimConfig). A renamed or removed knob then fails here instead of leaving docs that
no longer match the code."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from sim.config import SimConfig
from strata.config import StrataConfig

REPO = Path(__file__).resolve().parent.parent
#: `group.key` lookalikes that are files (`memory.py`, `engine.json`), not settings; a module's
#: member (`sim.acceptance.fit_acceptance`) is left out by the pattern (no dot before it).
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "log", "tgz", "txt", "png", "pt"}


def schema_groups() -> dict[str, set[str]]:
    """Group name -> its field names, over both config roots."""
    groups: dict[str, set[str]] = {}
    for root in (StrataConfig, SimConfig):
        for f in dataclasses.fields(root):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
                else f.default
            if dataclasses.is_dataclass(default):
                groups.setdefault(f.name, set()).update(x.name for x in dataclasses.fields(default))
    return groups


def stream_names() -> set[str]:
    """The simulator's random streams (`workload.arrivals`, ...): named like settings, documented
    as streams."""
    names = set()
    for path in (REPO / "sim").glob("*.py"):
        names.update(re.findall(r"stream\(\"([a-z_.]+)\"\)", path.read_text(encoding="utf-8")))
    return names


def unknown_keys() -> dict[str, list[str]]:
    groups = schema_groups()
    streams = stream_names()
    pattern = re.compile(r"(?<![\w.])(" + "|".join(groups) + r")\.([a-z_][a-z0-9_]*)")
    docs = [REPO / "README.md"] + sorted(p for p in (REPO / "docs").glob("*.md")
                                         if p.name != "CHANGELOG.md")
    bad: dict[str, list[str]] = {}
    for path in docs:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in pattern.finditer(line):
                name = m.group(0)
                if m.group(2) in FILE_SUFFIXES or name in streams:
                    continue
                if m.group(2) not in groups[m.group(1)]:
                    bad.setdefault(name, []).append(f"{path.relative_to(REPO)}:{i}")
    return bad


def test_the_schemas_have_the_groups_the_docs_use():
    groups = schema_groups()
    for name in ("engine", "model", "server", "workload", "experts", "memory", "acceptance"):
        assert groups.get(name), name


def test_every_setting_the_docs_name_exists():
    bad = unknown_keys()
    assert not bad, "docs name settings no schema has: " + "; ".join(
        f"{k} ({', '.join(v[:3])})" for k, v in sorted(bad.items()))
