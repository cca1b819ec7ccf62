"""The commit a benchmark ran at, for its results file.

`STRATA_COMMIT` wins when set: a copy of the working tree on another machine (the GPU host)
may carry a stale .git, so a run there names its commit explicitly. Otherwise `git rev-parse`,
with `+dirty` when tracked files differ from it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

#: The repository root (the package's parent directory).
ROOT = Path(__file__).resolve().parents[2]


def commit_id(short: bool = True) -> str:
    env = os.environ.get("STRATA_COMMIT")
    if env:
        return env
    try:
        args = ["git", "rev-parse"] + (["--short"] if short else []) + ["HEAD"]
        head = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
