"""Every setting and script flag the docs name exists. A `group.key` in README.md or docs/*.md
(the history in CHANGELOG.md aside) is a field of that group's schema, in strata's config
(StrataConfig) or the simulator's (SimConfig); a `scripts/X.py --flag` there is a script whose
source (or a module it imports from the repository) declares that flag. A renamed or removed
knob then fails here instead of leaving docs that no longer match the code."""

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


def docs() -> list[Path]:
    return [REPO / "README.md"] + sorted(p for p in (REPO / "docs").glob("*.md")
                                         if p.name != "CHANGELOG.md")


def unknown_keys() -> dict[str, list[str]]:
    groups = schema_groups()
    streams = stream_names()
    pattern = re.compile(r"(?<![\w.])(" + "|".join(groups) + r")\.([a-z_][a-z0-9_]*)")
    bad: dict[str, list[str]] = {}
    for path in docs():
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


def script_sources(script: Path) -> str:
    """A script's source and that of the repository modules it imports (a thin main's tool
    under strata/tools, the shared argument helpers of bench_engine.py)."""
    text = script.read_text(encoding="utf-8")
    out = [text]
    for a, b in re.findall(r"^\s*from\s+([\w.]+)\s+import|^\s*import\s+([\w.]+)", text, re.M):
        name = a or b
        for cand in (REPO / "scripts" / f"{name}.py", REPO / (name.replace(".", "/") + ".py")):
            if cand.is_file():
                out.append(cand.read_text(encoding="utf-8"))
    return "\n".join(out)


def unknown_flags() -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {}
    for path in docs():
        # a command continued over lines with backslashes counts as one line
        text = re.sub(r"\\\n\s*", " ", path.read_text(encoding="utf-8"))
        for i, line in enumerate(text.splitlines(), 1):
            for m in re.finditer(r"(scripts/\w+\.py)([^`|;]*)", line):
                script = REPO / m.group(1)
                if not script.is_file():
                    bad.setdefault(m.group(1), []).append(f"{path.name} (no such script)")
                    continue
                src = script_sources(script)
                for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)):
                    if f'"{flag}"' not in src and f"'{flag}'" not in src:
                        bad.setdefault(f"{m.group(1)} {flag}", []).append(path.name)
    return bad


def test_every_script_flag_the_docs_give_exists():
    bad = unknown_flags()
    assert not bad, "docs give script flags no script declares: " + "; ".join(
        f"{k} ({', '.join(sorted(set(v)))})" for k, v in sorted(bad.items()))
