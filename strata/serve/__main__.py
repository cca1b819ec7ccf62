"""`python -m strata.serve [overrides]`: the OpenAI-compatible HTTP server (docs/SERVING.md).

Same Hydra config tree as `python -m strata`; the server's own knobs live under `server.*`.
`--help` lists every setting. A bad setting is one `error: ...` line and exit code 2, before a
port is bound or an engine started.
"""

from __future__ import annotations

import os

import hydra
from omegaconf import DictConfig

from strata.cli import API_KEY_ENV, CONF_DIR, REDACTED, entry, fail, resolve_batch_mtp
from strata.config import ConfigError, check_known_keys, register_configs, validate_engine

register_configs()


def check_server_config(cfg: DictConfig) -> None:
    """Every check that needs no model, so a bad setting fails before anything starts.

    A key from any source ends up in $STRATA_API_KEY, with `server.api_key=REDACTED` in the
    config the server (and its engine process) is handed."""
    from strata.serve.api_key import resolve_api_key
    from strata.serve.server import validate_server

    check_known_keys(cfg)
    validate_engine(cfg.engine)
    if int(cfg.server.default_max_tokens) < 1:
        raise ConfigError(f"server.default_max_tokens: must be >= 1, got {cfg.server.default_max_tokens}")
    key = resolve_api_key(cfg.server)
    cfg.server.api_key_file = None
    cfg.server.api_key = REDACTED if key else None
    if key:
        os.environ[API_KEY_ENV] = key
    validate_server(cfg.server)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    from strata.serve.server import serve

    try:
        check_server_config(cfg)
        resolve_batch_mtp(cfg)
        # One job per process: the engine process is spawned with this environment.
        os.environ["STRATA_BATCH_MTP"] = "1" if cfg.engine.batch_mtp else "0"
    except ConfigError as e:
        fail(str(e))
    code = serve(cfg)
    if code:
        raise SystemExit(code)


def main() -> None:
    entry(hydra_main, "python -m strata.serve")


if __name__ == "__main__":
    main()
