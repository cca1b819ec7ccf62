"""`python -m sim`: the simulator's Hydra app (config tree: conf/sim/, schemas: sim/config.py).

    python -m sim mode=replay trace=FILE          exit 0 identical, 1 divergent, 2 bad input
    python -m sim mode=predict profile=FILE workload=poisson hydra.run.dir=DIR
    python -m sim -m engine.slots=1,2,4,8 engine.graph_key=layout,shape   (one run per subdir)
    python -m sim mode=predict hardware=h200_tiny_bf16 workload=cohort ...   (a hardware preset)
    python -m sim calibrate device=cuda           (sim/calibrate.py: measure, write a preset)
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from strata.config import ConfigError, check_known_keys

from .config import SIM_CONF_DIR, SimConfig, SimConfigError, register_configs, validate
from .costs import ProfileError
from .predict import main_predict
from .replay import main_replay
from .scheduler import SimulationError

register_configs()


@hydra.main(config_path=SIM_CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        validate(cfg)
        if cfg.mode == "replay":
            rc = main_replay(to_absolute_path(cfg.trace), cfg.print_outputs)
        else:
            for key in ("profile", "compare_with"):
                if cfg[key]:
                    cfg[key] = to_absolute_path(cfg[key])
            if cfg.acceptance.from_trace:
                cfg.acceptance.from_trace = to_absolute_path(cfg.acceptance.from_trace)
            cfg.spread.profiles = [to_absolute_path(p) for p in cfg.spread.profiles]
            rc = main_predict(cfg, HydraConfig.get().runtime.output_dir)
    except (SimConfigError, ProfileError, SimulationError) as e:
        print(f"error: {e}", file=sys.stderr)
        rc = 2
    if rc:
        sys.exit(rc)


def check_overrides(args: list[str]) -> None:
    """Compose the config once before Hydra runs, every value of a sweep included, so that an
    override it cannot take (an unknown key, a value of the wrong type, a missing group
    option, a syntax error) is one `error:` line and exit 2 like any bad input: Hydra prints a
    report and exits 1, which a replay's caller reads as a divergence. strata's own check
    (strata.cli.check_overrides) over the simulator's tree and schema."""
    from strata.cli import check_overrides as check_tree

    try:
        check_tree(args, SIM_CONF_DIR, SimConfig, lambda cfg: check_known_keys(cfg, SimConfig))
    except ConfigError as e:
        raise SimConfigError(str(e)) from None


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "calibrate":
        # Not a Hydra run: it measures the engine and writes config files for later runs.
        from .calibrate import main as calibrate_main

        sys.exit(calibrate_main(sys.argv[2:]))
    try:
        check_overrides(sys.argv[1:])
    except SimConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
