"""The simulator's JSON inputs (cost and routing profiles, engine metrics, bench JSONs), read
with one error per problem that names the file: missing, unreadable, not UTF-8, not JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path, what: str, error: type[Exception], prefix: str = "") -> Any:
    """The JSON value in file `path` (a `what`, e.g. "cost profile"); `error` with a message
    `prefix`path[:line]: ... for a file that cannot be read as JSON."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{prefix}{p}: not found ({what})") from None
    except OSError as e:  # a directory, no permission
        raise error(f"{prefix}{p}: cannot read the {what}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise error(f"{prefix}{p}: not UTF-8 text ({what})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{prefix}{p}:{e.lineno}: not JSON ({what}): {e.msg}") from None
