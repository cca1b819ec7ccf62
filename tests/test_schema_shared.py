"""One engine schema: the simulator's engine settings extend strata's EngineConfig, one
validator rules both, the YAML files hold no default values, and the knob lists a trace
records and a replay requires come from the schema. Likewise the workload knobs both have are
strata's WorkloadBaseConfig, declared and validated once."""

from __future__ import annotations

import inspect
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

from sim.config import SimConfigError, SimEngineConfig, SimWorkloadConfig
from sim.config import validate_engine as validate_sim_engine
from sim.config import validate_workload as validate_sim_workload
from sim.replay import REQUIRED_ENGINE_KNOBS
from strata.config import (ENGINE_KNOBS, TRACED_ENGINE_KNOBS, ConfigError, EngineConfig,
                           WorkloadBaseConfig, WorkloadConfig, validate_engine)
from strata.workload import WorkloadError, check_workload

ROOT = Path(__file__).resolve().parent.parent


def verdict(check, cfg) -> str | None:
    try:
        check(cfg)
    except (ConfigError, WorkloadError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("knobs", [
    {"prefill_buckets": []}, {"prefill_buckets": [32, 16]}, {"prefill_buckets": [0, 16]},
    {"prefill_buckets": [1]}, {"shape_buckets": []}, {"spec": 9}, {"mode": "duo"},
    {"graph_key": "exact"}, {"decode_share": 0.0}, {"max_context": 1}, {"compile": "yes"},
    {"slots": 0}, {"graph_limit": -1}, {},
])
def test_engine_and_simulator_accept_the_same_engine_values(knobs):
    engine = verdict(validate_engine, replace(EngineConfig(), **knobs))
    sim = verdict(validate_sim_engine, replace(SimEngineConfig(), **knobs))
    assert engine == sim
    if engine is not None:
        with pytest.raises(SimConfigError):
            validate_sim_engine(replace(SimEngineConfig(), **knobs))


def test_simulator_engine_schema_extends_the_engines():
    sim_only = {f.name for f in fields(SimEngineConfig)} - set(ENGINE_KNOBS)
    assert sim_only == {"drafting", "warmup_graphs", "graph_policy"}
    for f in fields(EngineConfig):
        assert getattr(SimEngineConfig(), f.name) == getattr(EngineConfig(), f.name), f.name


def test_knob_lists_come_from_the_schema():
    assert ENGINE_KNOBS == tuple(f.name for f in fields(EngineConfig))
    assert set(TRACED_ENGINE_KNOBS) <= set(ENGINE_KNOBS)
    assert set(REQUIRED_ENGINE_KNOBS) == set(TRACED_ENGINE_KNOBS) | {"drafting"}


def _yaml_schemas() -> list[tuple[str, type]]:
    out = [("conf/engine/default.yaml", EngineConfig), ("conf/sim/engine/default.yaml", SimEngineConfig),
           ("conf/sim/engine/upstream.yaml", SimEngineConfig)]
    for group, schema in (("conf/workload", WorkloadConfig), ("conf/sim/workload", SimWorkloadConfig)):
        out += [(str(p.relative_to(ROOT)), schema) for p in sorted((ROOT / group).glob("*.yaml"))]
    return out


@pytest.mark.parametrize("path, schema", _yaml_schemas())
def test_engine_and_workload_yaml_hold_only_values_that_differ_from_the_schema(path, schema):
    values = yaml.safe_load((ROOT / path).read_text())
    values.pop("defaults", None)
    defaults = schema()
    same = [k for k, v in values.items() if getattr(defaults, k) == v]
    assert not same, f"{path}: {same} repeat the schema's defaults"


def test_engine_and_simulator_workloads_extend_one_base():
    shared = [f.name for f in fields(WorkloadBaseConfig)]
    assert set(shared) == {"requests", "prompt_tokens", "max_tokens", "stagger_steps", "concurrency"}
    for schema in (WorkloadConfig, SimWorkloadConfig):
        assert issubclass(schema, WorkloadBaseConfig)
        assert [f.name for f in fields(schema)][:len(shared)] == shared
        for name in shared:
            assert getattr(schema(), name) == getattr(WorkloadBaseConfig(), name), name


@pytest.mark.parametrize("knobs", [
    {"requests": 0}, {"prompt_tokens": 0}, {"max_tokens": 0}, {"stagger_steps": -1},
    {"concurrency": -1}, {},
])
def test_engine_and_simulator_accept_the_same_shared_workload_values(knobs):
    engine = verdict(check_workload, replace(WorkloadConfig(kind="synthetic"), **knobs))
    sim = verdict(validate_sim_workload, replace(SimWorkloadConfig(kind="cohort"), **knobs))
    assert engine == sim
    assert (engine is None) == (not knobs)


@pytest.mark.parametrize("schema, base", [
    (SimEngineConfig, EngineConfig), (WorkloadConfig, WorkloadBaseConfig),
    (SimWorkloadConfig, WorkloadBaseConfig),
])
def test_an_extending_schema_declares_none_of_its_bases_knobs_again(schema, base):
    # A knob redeclared in the subclass would be a second declaration (doc, default) to drift.
    again = set(inspect.get_annotations(schema)) & {f.name for f in fields(base)}
    assert not again, f"{schema.__name__} declares {sorted(again)} again"
