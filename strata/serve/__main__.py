"""`python -m strata.serve [overrides]`: the OpenAI-compatible HTTP server (docs/SERVING.md).

Same Hydra config tree as `python -m strata`; the server's own knobs live under `server.*`.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

import sys

from strata.config import ConfigError, check_known_keys, register_configs

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")

register_configs()


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from strata.serve.server import serve

    try:
        check_known_keys(cfg)  # before binding a port or starting an engine
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    code = serve(cfg)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
