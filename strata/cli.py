"""The command line shared by `python -m strata` and `python -m strata.serve`.

Hydra turns a bad override into a multi-line report (a `+key` hint, a search path, exit 1)
and saves every override, secrets included, under the run dir's `.hydra/`. So before Hydra
runs, `entry` answers `--help` from the schema, moves an API key given on the command line into
the process environment (the saved config shows `server.api_key=REDACTED`), and composes the
config once to turn any bad key or value into one `error: ...` line with exit code 2.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from strata.config import (ConfigError, batch_mtp_from_env, check_key, check_known_keys,
                           environ_set, register_configs, validate_engine, validate_model)

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
CONFIG_NAME = "config"
#: The placeholder left in argv (and so in the saved Hydra config) for a command-line key.
REDACTED = "REDACTED"
#: Where the server reads its API key when neither server.api_key nor server.api_key_file is set.
API_KEY_ENV = "STRATA_API_KEY"
API_KEY = "server.api_key"


def fail(message: str) -> None:
    """The one way a bad input ends the program: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def entry(hydra_main: Callable[[], Any], prog: str, argv: Optional[list[str]] = None) -> None:
    """Check the command line, then hand it to the Hydra-decorated `hydra_main`."""
    from strata.settings_help import settings_help

    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(settings_help(prog))
        raise SystemExit(0)
    try:
        args = hide_api_key(args)
        check_overrides(args)
    except ConfigError as e:
        fail(str(e))
    sys.argv[1:] = args
    hydra_main()


def hide_api_key(args: list[str]) -> list[str]:
    """Move the value of a `server.api_key=...` override into $STRATA_API_KEY (this process
    and its children only), leaving `server.api_key=REDACTED` for Hydra to save."""
    out = []
    for a in args:
        key, eq, value = a.partition("=")
        if eq and key.lstrip("+") == API_KEY and value not in ("", "null", REDACTED):
            os.environ[API_KEY_ENV] = value.strip("'\"")
            a = f"{key}={REDACTED}"
        out.append(a)
    return out


def _parsed_args(args: list[str]) -> Optional[Any]:
    """Hydra's own reading of the command line, or None where Hydra should speak for itself."""
    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed, _ = get_args_parser().parse_known_args(args)
    except SystemExit:
        return None
    if (parsed.hydra_help or parsed.info or parsed.shell_completion or parsed.config_path
            or parsed.config_name or parsed.config_dir or parsed.experimental_rerun):
        return None  # another config tree or an informational flag: nothing to pre-check
    return parsed


def _is_hydra(key: str) -> bool:
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def check_overrides(args: list[str], conf_dir: str = CONF_DIR, root: Optional[type] = None,
                    check: Optional[Callable[[Any], None]] = None) -> None:
    """Raise ConfigError (one line, naming the key) for an override the config cannot take,
    every value of a sweep included. `conf_dir`, `root` (its schema) and `check` (what a
    composed config must pass) are strata's unless another app (the simulator) gives its own."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parsed = _parsed_args(args)
    if parsed is None:
        return
    try:
        overrides = OverridesParser.create().parse_overrides(parsed.overrides)
    except OverrideParseException as e:
        raise ConfigError(f"cannot parse the override: {str(e).splitlines()[0]}") from None
    lines, sweeps = [], []
    for o in overrides:
        if not o.key_or_group:
            raise ConfigError(f"{o.input_line}: an override needs a key before '=' (key=value)")
        if o.key_or_group in ("hydra.run.dir", "hydra.sweep.dir"):
            check_output_dir(o.key_or_group, o.value())
        if o.key_or_group == "hydra.searchpath":
            lines.append(o.input_line)  # config groups of other trees compose from it
            continue
        if _is_hydra(o.key_or_group):
            continue
        if "/" not in o.key_or_group:
            check_key(o.key_or_group, root)
        if o.is_sweep_override():
            if not parsed.multirun:
                raise ConfigError(f"{o.input_line}: several values need -m (a sweep, one job each); "
                                  f"a list is written [a,b], a string with commas is quoted")
            prefix = "++" if o.is_force_add() else "+" if o.is_add() else ""
            try:
                values = [f"{prefix}{o.key_or_group}={v}" for v in o.sweep_string_iterator()]
            except Exception:  # a sweep only its sweeper can expand (glob, interval): its job
                continue
            if not values:
                continue
            sweeps.append((len(lines), values))
            lines.append(values[0])  # compose takes one value; the others are checked below
        else:
            lines.append(o.input_line)
    check = check or check_values
    check(compose_config(lines, conf_dir))
    for i, values in sweeps:
        for v in values[1:]:
            check(compose_config(lines[:i] + [v] + lines[i + 1:], conf_dir))


def check_values(cfg: Any) -> None:
    """The checks that need no model, on one composed config: a sweep's bad value fails
    before its first job runs, not after the jobs before it."""
    check_known_keys(cfg)
    validate_engine(cfg.engine)
    validate_model(cfg.model)


def check_output_dir(key: str, value: Any) -> None:
    """Refuse a run or sweep directory that a file stands in the way of (Hydra makes the
    directory before the job starts, and fails there with a traceback)."""
    if not isinstance(value, str) or "${" in value:
        return
    for p in (Path(value), *Path(value).parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"{key}={value}: {p} is a file, not a directory")
            return


def compose_config(overrides: list[str], conf_dir: str = CONF_DIR) -> Any:
    """The config Hydra would compose from these overrides (in `conf_dir`'s tree); ConfigError
    (one line) if it can't."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import MissingConfigException

    register_configs()  # the schemas the YAML files name (storing them again is harmless)
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            return compose(config_name=CONFIG_NAME, overrides=overrides)
    except MissingConfigException as e:
        missing = str(getattr(e, "missing_cfg_file", "") or "")
        group, _, name = missing.rpartition("/")
        options = list(getattr(e, "options", None) or [])
        options = [o for o in options if not o.endswith("_schema")]  # the schemas themselves
        if group and options:
            raise ConfigError(f"{group}={name}: no such {group} config (choose from: "
                              f"{', '.join(options)})") from None
        raise ConfigError(str(e).splitlines()[0]) from None
    except Exception as e:  # OmegaConf's and Hydra's errors, and whatever they wrap
        raise ConfigError(one_line(e)) from None


def one_line(e: BaseException) -> str:
    """Hydra's and OmegaConf's reports as one line: the override, the key, and the cause."""
    cause = e.__cause__ or e.__context__
    head = str(e).splitlines()[0] if str(e) else type(e).__name__
    if cause is None:
        return head
    key = getattr(cause, "full_key", None)
    reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    if head.startswith("Error merging override "):
        head = head[len("Error merging override "):]
    return f"{head}: {reason}" if not key or key in head else f"{head}: {key}: {reason}"


def overridden_on_command_line(key: str) -> bool:
    """Whether this Hydra job's command line set `key` (with or without a + prefix)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = list(HydraConfig.get().overrides.task)
    return any(o.key_or_group == key for o in OverridesParser.create().parse_overrides(lines))


def resolve_batch_mtp(cfg: Any) -> str:
    """Fold $STRATA_BATCH_MTP into cfg.engine.batch_mtp: the environment only replaces the
    default, an `engine.batch_mtp=...` on the command line wins. Returns where the choice came
    from, for the console. The engine reads the environment too: build it under
    `batch_mtp_env(cfg.engine.batch_mtp)` so both agree."""
    explicit = overridden_on_command_line("engine.batch_mtp")
    env = os.environ.get("STRATA_BATCH_MTP") or None
    cfg.engine.batch_mtp = batch_mtp_from_env(cfg.engine.batch_mtp, explicit=explicit)
    if explicit:
        return "command line" + (f"; STRATA_BATCH_MTP={env} ignored" if env else "")
    return f"STRATA_BATCH_MTP={env}" if env else "config"


def batch_mtp_env(chosen: bool) -> contextlib.AbstractContextManager[None]:
    """$STRATA_BATCH_MTP set to the resolved choice for the duration (one job of a multirun
    must not leak its choice into the next), then restored."""
    return environ_set("STRATA_BATCH_MTP", "1" if chosen else "0")


def run_mode(mode: str, batch_mtp: bool) -> str:
    """The name of the mode that ran: solo, batch or batch_mtp (DESIGN.md section 9)."""
    return "solo" if mode == "solo" else ("batch_mtp" if batch_mtp else "batch")
