"""conf/hydra/launcher/*: each composes with the Hydra compose API (no plugin needed); with its
plugin installed it also instantiates, and joblib_local runs a real (simulator) sweep."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from strata.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

LAUNCHERS = {
    # config name: (_target_, pip package, importable module, fields that must be there)
    "joblib_local": ("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
                     "hydra-joblib-launcher", "hydra_plugins.hydra_joblib_launcher",
                     {"n_jobs": 2, "prefer": "processes"}),
    "slurm": ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
              "hydra-submitit-launcher", "hydra_plugins.hydra_submitit_launcher",
              {"gpus_per_node": 1, "tasks_per_node": 1, "array_parallelism": 16}),
    "slurm_local": ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
                    "hydra-submitit-launcher", "hydra_plugins.hydra_submitit_launcher",
                    {"tasks_per_node": 1}),
    "ray_cluster": ("hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher",
                    "hydra-ray-launcher", "hydra_plugins.hydra_ray_launcher",
                    {"ray": {"init": {"address": None}, "remote": {"num_cpus": 4, "num_gpus": 1}}}),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _compose(name: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[f"hydra/launcher={name}"], return_hydra_config=True)


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_config_composes(name):
    target, _pip, _mod, fields = LAUNCHERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # e.g. Hydra's "validated against ConfigStore schema"
        cfg = _compose(name)
    lc = cfg.hydra.launcher
    assert lc._target_ == target
    from omegaconf import OmegaConf
    got = OmegaConf.to_container(lc, resolve=False)
    for k, v in fields.items():
        assert got[k] == v, (k, got[k])
    # the app's own config is untouched by the launcher choice
    assert cfg.engine.mode == "batch" and "launcher" not in cfg


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_instantiates_when_plugin_installed(name):
    target, pip, module, _ = LAUNCHERS[name]
    if not _installed(module):
        pytest.skip(f"plugin not installed (pip install {pip}); the config still composes")
    cfg = _compose(name)
    from omegaconf import OmegaConf
    lc = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    # ${hydra.*} interpolations resolve only inside a Hydra run: give them plain values here
    lc = {k: ("x" if isinstance(v, str) and "${" in v else v) for k, v in lc.items()}
    launcher = instantiate(OmegaConf.create(lc))
    assert type(launcher).__module__ + "." + type(launcher).__name__ == target


@pytest.mark.slow
def test_joblib_local_runs_a_real_sweep(tmp_path):
    if not _installed("hydra_plugins.hydra_joblib_launcher"):
        pytest.skip("hydra-joblib-launcher not installed (pip install hydra-joblib-launcher)")
    sweep = tmp_path / "mr"
    # The simulator has its own config tree (conf/sim); hydra.searchpath lends it conf/'s
    # launcher configs. `python -m strata -m hydra/launcher=joblib_local ...` needs nothing extra.
    r = subprocess.run([sys.executable, "-m", "sim", "-m", f"hydra.searchpath=[file://{CONF}]",
                        "hydra/launcher=joblib_local", "engine.slots=1,2", "workload=cohort",
                        "workload.requests=2", "workload.prompt_tokens=32", "workload.max_tokens=8",
                        "print_outputs=false", f"hydra.sweep.dir={sweep}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Joblib.Parallel(n_jobs=2" in r.stdout + r.stderr
    assert (sweep / "0" / "metrics.json").is_file() and (sweep / "1" / "metrics.json").is_file()
