"""Where the weights go at load (strata/model/placement.py): their bytes counted on the meta
model in their final formats, a clear error before any allocation when they cannot fit the
device or the host, and the routed experts held in host memory for the expert cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata.config import ConfigError
from strata.model import placement as P
from strata.model.fp8 import contracting, dense_to_dequantize, load_quant_config
from strata.model.loader import (ASSETS_DIR, QWEN3_NEXT, _dummy_fp8_params, _to_fp8_modules, load_checkpoint,
                                 load_model_args, resolve_model_path)
from strata.model.qwen3_next import Qwen3Next

GIB = 2**30
CONF = Path(__file__).resolve().parent.parent / "conf"


def meta_80b_fp8() -> Qwen3Next:
    """The FP8 preset's Qwen3-Next-80B-A3B on the meta device, FP8 where its checkpoint is."""
    path = resolve_model_path(ASSETS_DIR / "qwen3-next-80b-a3b-fp8")
    args, quant = load_model_args(path), load_quant_config(path)
    with torch.device("meta"):
        model = Qwen3Next(args, with_mtp=True).to(torch.bfloat16)
    _to_fp8_modules(model, _dummy_fp8_params(model, quant, QWEN3_NEXT), quant.block)
    return model


def test_the_80b_fp8_weights_by_where_they_go():
    """Counted on the meta model: the 48 layers' routed experts are exactly 72 GiB of FP8 (512 x
    (1024 x 2048 + 2048 x 512) bytes a layer), held on the device or, for the cache, on the host;
    the dense layers the load dequantises count in bf16 (so on an 80 GB card the whole model
    does not fit, and with its experts on the host it takes 5-6 GiB)."""
    model = meta_80b_fp8()
    host = P.host_routed_params(model, dense_experts=16)
    assert len(host) == 2 * 48
    fp8 = P.count_weight_bytes(model, torch.bfloat16, [], [])
    deq = [m for _, m in dense_to_dequantize(model, contracting)]
    assert deq
    whole = P.count_weight_bytes(model, torch.bfloat16, deq, [])
    split = P.count_weight_bytes(model, torch.bfloat16, deq, host)
    assert whole.routed == split.routed == split.host == 48 * 512 * 3 * 2048 * 512 == 72 * GIB
    assert whole.host == 0 and whole.device > fp8.device  # the dequantised layers are larger
    assert split.device == whole.device - split.host
    assert 5 * GIB < split.device < 6 * GIB
    with pytest.raises(ConfigError) as e:
        P.check_weights_fit("qwen3-next-80b-a3b-fp8", whole, torch.device("cuda"),
                            device_free=int(78.6 * GIB), host_free=100 * GIB)
    msg = str(e.value)
    assert "qwen3-next-80b-a3b-fp8" in msg and "77.5 GiB on cuda" in msg and "78.6 GiB is free" in msg
    assert "72.0 GiB of them routed experts" in msg and "engine.expert_cache_mib=N" in msg
    # with the experts on the host it fits that card, unless the host cannot hold them
    P.check_weights_fit("m", split, torch.device("cuda"), int(78.6 * GIB), 100 * GIB)
    with pytest.raises(ConfigError, match=r"its routed experts \(the expert cache\) need 72.0 "
                                          r"GiB of host memory, and 60.0 GiB is available"):
        P.check_weights_fit("m", split, torch.device("cuda"), int(78.6 * GIB), 60 * GIB)


def test_unknown_free_memory_is_not_checked():
    need = P.WeightBytes(device=10**15, host=10**15, routed=0)
    P.check_weights_fit("m", need, torch.device("cuda"), None, None)
    P.check_weights_fit("m", need, torch.device("cpu"), None, None)


def test_materialize_leaves_the_host_params_in_host_memory():
    model = meta_80b_fp8()
    model.layers = model.layers[:2]  # (2 layers are enough)
    host = P.host_routed_params(model, dense_experts=16)
    P.materialize(model, torch.device("meta"), host)
    on_host = {id(getattr(m, n)) for m, n in host}
    assert len(on_host) == 4
    for p in model.parameters():
        assert p.device.type == ("cpu" if id(p) in on_host else "meta")
    assert all(getattr(m, n).dtype == torch.float8_e4m3fn for m, n in host)
    assert model.layers[0].mlp.experts.gu_scale.device.type == "meta"  # scales stay


def test_a_model_the_host_cannot_hold_is_a_clear_error_before_loading(tiny_ckpt, monkeypatch):
    """A CPU model whose weights exceed the host's available memory fails before any weight is
    allocated, naming the model and the numbers (it was an out-of-memory kill part way through)."""
    monkeypatch.setattr("strata.model.loader.host_available_bytes", lambda: 2**20)
    with pytest.raises(ConfigError, match=r"model ckpt-base\d*: its weights need .* GiB of host "
                                          r"memory, and 0.0 GiB is available: model.num_layers"):
        load_checkpoint(tiny_ckpt)


def test_the_80b_preset_on_a_cpu_names_the_host_memory_it_lacks(monkeypatch):
    """The composed 80B FP8 preset with dummy weights on a CPU: a ConfigError (the CLI's one
    `error:` line) naming the memory, before any weight is allocated."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from strata.config import register_configs
    from strata.engine.llm_engine import Engine

    monkeypatch.setattr("strata.model.loader.host_available_bytes", lambda: 16 * GIB)
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=["model=qwen3_next_80b_a3b_fp8",
                                               "model.load_format=dummy", "device=cpu"])
    finally:
        GlobalHydra.instance().clear()
    with pytest.raises(ConfigError, match=r"model qwen3-next-80b-a3b-fp8: its weights need "
                                          r"\d+\.\d GiB of host memory, and 16.0 GiB is available"):
        Engine.from_config(cfg, log=lambda s: None)


def test_load_progress_speaks_only_on_a_long_load(monkeypatch):
    """A line at most every every_s seconds with the share, the bytes and the time so far;
    nothing for a load done within the first interval, nor at 100%."""
    lines: list[str] = []
    clock = iter([0.0, 1.0, 12.0, 13.0, 30.0])
    monkeypatch.setattr(P.time, "perf_counter", lambda: next(clock))
    prog = P.LoadProgress(4 * GIB, lines.append, every_s=10.0)  # t0 = 0
    prog.add(GIB)       # 1 s: too soon
    prog.add(GIB)       # 12 s: 50%
    prog.add(GIB)       # 13 s: too soon after the last
    prog.add(GIB)       # 30 s: done, no line
    assert lines == ["INFO: loading weights: 50% (2.0 GiB of 4.0 GiB, 12 s)"]
