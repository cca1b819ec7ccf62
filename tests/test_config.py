"""Hydra configuration: the conf/ tree composes against the schemas in strata/config.py.

Every group option composes, the YAML defaults equal the schema defaults, an unknown key or a
wrong type is an error that names the key, and validate_engine rejects values a schema cannot
express with a ConfigError naming `engine.<key>`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from strata.config import (EMBEDDED_MODEL_DIR, BackendConfig, ConfigError, EngineConfig,
                           ServerConfig, StrataConfig, WorkloadConfig, register_configs,
                           validate_engine)

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("model", "engine", "backend", "workload", "server")


@pytest.fixture(scope="module")
def hydra_ctx():
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


def cfg_of(*overrides):
    return compose("config", overrides=list(overrides))


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def all_messages(exc: BaseException) -> str:
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def test_defaults_compose_to_the_schema_defaults(hydra_ctx):
    cfg = cfg_of()
    assert cfg.device == "auto" and cfg.model.path == EMBEDDED_MODEL_DIR
    assert cfg.model.dtype in ("auto", "float32", "bfloat16", "float16")
    for name, schema in (("engine", EngineConfig), ("backend", BackendConfig),
                         ("server", ServerConfig)):
        got = OmegaConf.to_container(cfg[name])
        want = dataclasses.asdict(schema())
        assert got == want, f"conf/{name} default differs from the {schema.__name__} schema"
    w = OmegaConf.to_container(cfg.workload)
    assert w["kind"] == "default" and set(w) == {f.name for f in dataclasses.fields(WorkloadConfig)}
    # the composed tree is typed: it merges into the root schema without loss
    merged = OmegaConf.merge(OmegaConf.structured(StrataConfig), cfg)
    assert OmegaConf.to_container(merged) == OmegaConf.to_container(cfg)
    validate_engine(cfg.engine)


def test_every_group_has_options():
    for g in GROUPS:
        assert options(g), f"conf/{g} has no options"
    assert set(options("backend")) >= {"torch", "cpu", "cuda", "hip"}
    assert set(options("workload")) >= {"default", "file", "synthetic"}


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes(hydra_ctx, group, option):
    cfg = cfg_of(f"{group}={option}")
    node = cfg[group]
    if group == "backend":
        assert node.name == option
    if group == "workload":
        assert node.kind == option
    if group == "engine":
        validate_engine(node)
    # every field the option sets is a schema field with a value of the schema's type
    OmegaConf.merge(OmegaConf.structured(StrataConfig), cfg)


def test_workload_file_composes_with_a_path(hydra_ctx):
    cfg = cfg_of("workload=file", "workload.path=/tmp/requests.jsonl")
    assert cfg.workload.kind == "file" and cfg.workload.path == "/tmp/requests.jsonl"


def test_overrides_of_every_type_apply(hydra_ctx):
    cfg = cfg_of("engine.slots=8", "engine.graphs=false", "engine.decode_share=0.25",
                 "engine.shape_buckets=[1,3,9]", "engine.mode=solo", "device=cpu",
                 "workload=synthetic", "workload.prompt_tokens=12", "server.api_key=secret",
                 "model.path=/x/y")
    assert cfg.engine.slots == 8 and cfg.engine.graphs is False
    assert cfg.engine.decode_share == 0.25 and list(cfg.engine.shape_buckets) == [1, 3, 9]
    assert cfg.engine.mode == "solo" and cfg.device == "cpu"
    assert cfg.workload.kind == "synthetic" and cfg.workload.prompt_tokens == 12
    assert cfg.server.api_key == "secret" and cfg.model.path == "/x/y"


@pytest.mark.parametrize("override,key", [
    ("engine.slotz=3", "slotz"),
    ("engine.window_row=4", "window_row"),
    ("workload.prompt=hi", "prompt"),
    ("server.hostname=x", "hostname"),
    ("devices=cpu", "devices"),
])
def test_unknown_key_is_an_error_naming_it(hydra_ctx, override, key):
    with pytest.raises(Exception) as exc:
        cfg_of(override)
    msg = all_messages(exc.value)
    assert key in msg
    assert override.split("=")[0] in msg


@pytest.mark.parametrize("override,key", [
    ("engine.slots=abc", "engine.slots"),
    ("engine.graphs=maybe", "engine.graphs"),
    ("engine.decode_share=half", "engine.decode_share"),
    ("engine.shape_buckets=[1,x]", "engine.shape_buckets"),
    ("engine.vram_reserve_mib=1.5GB", "engine.vram_reserve_mib"),
    ("server.port=http", "server.port"),
    ("workload.max_tokens=many", "workload.max_tokens"),
    ("print_outputs=sometimes", "print_outputs"),
])
def test_wrong_type_is_an_error_naming_the_key(hydra_ctx, override, key):
    with pytest.raises(Exception) as exc:
        cfg_of(override)
    assert key in all_messages(exc.value)


def test_unknown_group_option_is_an_error(hydra_ctx):
    with pytest.raises(Exception) as exc:
        cfg_of("engine=turbo")
    msg = all_messages(exc.value)
    assert "engine/turbo" in msg and "default" in msg  # names the available options


BAD_ENGINE = [
    ("mode", "fast"),
    ("mode", "batch_mtp"),
    ("graph_key", "exact"),
    ("slots", 0),
    ("window_rows", 0),
    ("spec", 0),
    ("decode_share", 0.0),
    ("decode_share", 1.5),
    ("decode_share", -0.5),
    ("prefill_chunk", 0),
    ("prefill_slots", 0),
    ("graph_limit", -1),
    ("vram_reserve_mib", -1),
    ("max_context", 1),
    ("context_tier_min", 0),
    ("shape_buckets", []),
    ("shape_buckets", [2, 1]),
    ("shape_buckets", [1, 1, 2]),
    ("shape_buckets", [0, 4]),
    ("compile", "maybe"),
    ("batch_mtp_drafts", 0),
    ("batch_mtp_drafts", 4),  # > spec - 1 = 3
    ("compile_workers", -1),
]


@pytest.mark.parametrize("key,value", BAD_ENGINE, ids=[f"{k}={v}" for k, v in BAD_ENGINE])
def test_validate_engine_rejects_bad_values(key, value):
    e = OmegaConf.structured(EngineConfig)
    setattr(e, key, value)
    with pytest.raises(ConfigError) as exc:
        validate_engine(e)
    assert str(exc.value).startswith(f"engine.{key}:"), str(exc.value)
    assert str(value) in str(exc.value) or repr(value) in str(exc.value)


def test_validate_engine_spec_and_window_rows():
    e = OmegaConf.structured(EngineConfig)
    e.spec, e.window_rows = 9, 8
    with pytest.raises(ConfigError) as exc:
        validate_engine(e)
    assert "engine.spec" in str(exc.value) and "engine.window_rows" in str(exc.value)
    e.spec = 8
    validate_engine(e)
    e.spec, e.window_rows = 1, 1
    validate_engine(e)


def test_validate_engine_batch_mtp_drafts_up_to_spec_less_one():
    e = OmegaConf.structured(EngineConfig)
    for spec, drafts in ((4, 3), (4, None), (2, 1), (1, 1)):  # 1 stands whatever the spec
        e.spec, e.batch_mtp_drafts = spec, drafts
        validate_engine(e)
    e.spec, e.batch_mtp_drafts = 2, 2
    with pytest.raises(ConfigError, match=r"^engine.batch_mtp_drafts: .*engine.spec - 1 = 1"):
        validate_engine(e)


def test_validate_engine_prefill_slots_on_one_device_only():
    e = OmegaConf.structured(EngineConfig)
    e.stages, e.overlap, e.prefill_slots = 2, False, 4
    with pytest.raises(ConfigError) as exc:
        validate_engine(e)
    assert str(exc.value).startswith("engine.prefill_slots:") and "engine.stages=2" in str(exc.value)
    e.prefill_slots = 1
    validate_engine(e)


def test_validate_engine_prefill_slots_not_with_batch_invariant():
    """batch_invariant fixes every matmul's row count; several slots' chunks change it."""
    e = OmegaConf.structured(EngineConfig)
    e.batch_invariant, e.prefill_slots = True, 2
    with pytest.raises(ConfigError, match=r"^engine.prefill_slots: .*batch_invariant"):
        validate_engine(e)
    e.prefill_slots = 1
    validate_engine(e)


def test_validate_engine_accepts_edges():
    e = OmegaConf.structured(EngineConfig)
    e.decode_share, e.graph_limit, e.vram_reserve_mib, e.max_context = 1.0, 0, 0, 2
    e.shape_buckets = [1]
    validate_engine(e)


@pytest.mark.parametrize("key", ["graph_mib_estimate", "cpu_graph_mib", "cpu_device_mib",
                                 "vram_every"])
def test_validate_engine_rejects_negative_sizes(key):
    """Memory sizes and the vram period cannot be negative (a negative graph size would grow
    the budget with every capture)."""
    e = OmegaConf.structured(EngineConfig)
    setattr(e, key, -1)
    with pytest.raises(ConfigError) as exc:
        validate_engine(e)
    assert str(exc.value).startswith(f"engine.{key}:")


def test_bad_device_and_backend_are_errors_naming_the_key(tmp_path):
    from strata.engine.llm_engine import Engine, resolve_device

    with pytest.raises(ConfigError, match="device"):
        resolve_device("gpu")
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device = "cpu"
    cfg.backend.name = "cuda"  # GPU kernels on a CPU device
    with pytest.raises(ValueError, match="backend"):
        Engine.from_config(cfg, log=lambda s: None)
    cfg.backend.name = "torch"
    cfg.engine.window_rows = 2  # spec 4 > 2: rejected before the model loads
    cfg.model.path = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="engine.spec"):
        Engine.from_config(cfg, log=lambda s: None)


def test_appended_unknown_keys_are_refused_by_name():
    """Hydra's `+group.key=v` gets past the schema at compose time; the engine refuses it."""
    from hydra import compose, initialize_config_dir

    from strata.config import ConfigError, check_known_keys, register_configs

    register_configs()
    conf = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "conf")
    GlobalHydra.instance().clear()
    for override, name in (("+engine.slotz=3", "engine.slotz"), ("+model.foo=1", "model.foo"),
                           ("+server.bogus=1", "server.bogus"), ("+nonsense=1", "nonsense")):
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            cfg = compose("config", overrides=[override])
        with pytest.raises(ConfigError, match=name):
            check_known_keys(cfg)
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        check_known_keys(compose("config"))  # the defaults pass


def test_prefill_slots_auto_resolves_as_documented():
    """engine.prefill_slots=null (the default) runs 8 slots a chunk on one device and 1 where a
    chunk must hold one slot or with the expert cache; a set value wins; 0 is an error that
    names null as the alternative."""
    from strata.config import AUTO_PREFILL_SLOTS, prefill_slots_of

    e = EngineConfig()
    assert e.prefill_slots is None and prefill_slots_of(e) == AUTO_PREFILL_SLOTS == 8
    assert prefill_slots_of(e, dense_prefill=True) == 1
    for key, value in (("stages", 2), ("batch_invariant", True), ("expert_cache_mib", 64)):
        assert prefill_slots_of(dataclasses.replace(e, **{key: value})) == 1, key
        validate_engine(dataclasses.replace(e, **{key: value}))  # the auto never conflicts
    assert prefill_slots_of(dataclasses.replace(e, prefill_slots=3)) == 3
    with pytest.raises(ConfigError, match="must be >= 1 or null"):
        validate_engine(dataclasses.replace(e, prefill_slots=0))
    with pytest.raises(ConfigError, match="prefill_slots"):
        validate_engine(dataclasses.replace(e, stages=2, prefill_slots=2))
