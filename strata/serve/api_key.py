"""Where the server's API key comes from, without it ever being written to disk by strata.

In order: `server.api_key` (a key given on the command line arrives here as REDACTED, its value
moved to $STRATA_API_KEY by strata.cli before Hydra saves the config), `server.api_key_file`,
then $STRATA_API_KEY. No key: /v1/* is open.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

from strata.cli import API_KEY_ENV, REDACTED
from strata.config import ConfigError


def resolve_api_key(scfg: Any, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The key /v1/* requires, or None; ConfigError naming the setting when it cannot be read."""
    key = scfg.api_key
    key_file = scfg.api_key_file
    if key is not None and key_file is not None:
        raise ConfigError("server.api_key and server.api_key_file: give at most one")
    if key == REDACTED:
        key = environ.get(API_KEY_ENV)
        if not key:
            raise ConfigError(f"server.api_key: {REDACTED} is the placeholder of a saved config; "
                              f"give the key in ${API_KEY_ENV} or server.api_key_file")
        return key
    if key is not None:
        if not str(key):
            raise ConfigError("server.api_key: must be null (no key) or a non-empty string")
        return str(key)
    if key_file is not None:
        return read_key_file(str(key_file))
    return environ.get(API_KEY_ENV) or None


def read_key_file(path: str) -> str:
    f = Path(path)
    if f.is_dir():
        raise ConfigError(f"server.api_key_file: {f} is a directory, not a key file")
    try:
        text = f.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"server.api_key_file: {f} does not exist") from None
    except UnicodeDecodeError:
        raise ConfigError(f"server.api_key_file: {f} is not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"server.api_key_file: cannot read {f}: {e.strerror}") from None
    lines = text.splitlines()
    key = lines[0].strip() if lines else ""
    if not key:
        raise ConfigError(f"server.api_key_file: {f} is empty (its first line is the key)")
    return key
