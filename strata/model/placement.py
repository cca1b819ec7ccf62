"""Where a model's weights go at load, and whether they fit there, before any is allocated.

With the expert cache on a GPU (engine.expert_cache_mib > 0) the decoder's routed experts are
materialised in host memory, never on the device: the cache then moves each layer's residents
into device slots (strata/engine/expert_cache.py), so a model whose experts do not fit the card
(Qwen3-Next-80B-A3B in FP8 on an 80 GB GPU) loads. Everything else is materialised on the
device.

The weights' bytes are counted on the model while it is still on the meta device, in their
final formats (dense FP8 layers that load dequantises count in the model dtype), and checked
against what the device and the host have free: a model that cannot fit is a ConfigError naming
the numbers and what to set, instead of an out-of-memory kill part way through the load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from strata.config import ConfigError

GIB = 2**30
#: Host memory left free beyond the weights (the interpreter, torch, the tokenizer, buffers).
HOST_MARGIN = 2 * GIB
#: Device memory left free beyond the weights: the load's scratch copies (a dense FP8 layer
#: dequantised through float32, a dummy layer's experts drawn before they go to the host) and
#: an engine's least state and graphs; weights that leave less would fail later in the load or
#: at the engine's memory plan.
DEVICE_MARGIN = 2 * GIB


@dataclass
class WeightBytes:
    """Bytes of a model's weights by where they will be held."""
    device: int
    #: Routed experts held in host memory (the expert cache's host store), 0 without.
    host: int
    #: Every decoder layer's routed expert weights, wherever held (what the cache can take).
    routed: int


def host_routed_params(model: nn.Module, dense_experts: int) -> list[tuple[nn.Module, str]]:
    """(Experts module, parameter name) of the weights the expert cache serves from host memory:
    w_gate_up and w_down of every decoder MoE layer that runs its experts grouped (a layer of
    few float experts runs them in one dense matmul, which the cache refuses). Their FP8 scales
    stay on the device."""
    return [(moe.experts, name) for moe in _decoder_moe(model)
            if moe.grouped(dense_experts) for name in ("w_gate_up", "w_down")]


def _decoder_moe(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' SparseMoe blocks (not the MTP layer's), of a whole model or of a
    pipeline stage's view of one (whose `layers` is a module of its layers by index)."""
    from strata.model.qwen3_next import SparseMoe

    return [m for name, m in model.named_modules()
            if isinstance(m, SparseMoe) and name.startswith("layers.")]


def count_weight_bytes(model: nn.Module, dtype: torch.dtype, dequantized: list[nn.Module],
                       host: list[tuple[nn.Module, str]]) -> WeightBytes:
    """The weights' bytes (model on any device, meta included): `dequantized` modules' weights
    in `dtype` (load dequantises them), `host` parameters in host memory."""
    size = torch.empty((), dtype=dtype).element_size()
    deq = {id(m.weight) for m in dequantized}
    held = {id(getattr(m, n)) for m, n in host}
    device = host_bytes = 0
    for p in model.parameters():  # tied parameters once
        n = p.numel() * (size if id(p) in deq else p.element_size())
        if id(p) in held:
            host_bytes += n
        else:
            device += n
    routed = sum(getattr(moe.experts, n).numel() * getattr(moe.experts, n).element_size()
                 for moe in _decoder_moe(model) for n in ("w_gate_up", "w_down"))
    return WeightBytes(device, host_bytes, routed)


def host_available_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_available_bytes(device: torch.device) -> Optional[int]:
    """A CUDA device's free memory, counting what this process's allocator holds unused (an
    earlier engine's cached blocks); None for the CPU (its weights are host memory)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def check_weights_fit(name: str, need: WeightBytes, device: torch.device,
                      device_free: Optional[int], host_free: Optional[int]) -> None:
    """ConfigError when the weights cannot be held: on the device (a CUDA one) `need.device`
    against `device_free`, in host memory the CPU model's weights or the host-held experts
    against `host_free` (None: not known, not checked)."""
    if device.type == "cuda" and device_free is not None \
            and need.device + DEVICE_MARGIN > device_free:
        hint = "a GPU with more memory"
        if need.host == 0 and need.routed:
            rest = need.device - need.routed
            room = device_free - rest - DEVICE_MARGIN - 4 * GIB  # KV, state and graphs beside
            hint = ("engine.expert_cache_mib=N to hold the routed experts in host memory and N "
                    "MiB of them on the device"
                    + (f" (about {room // 2**20} would leave 4 GiB for KV, state and graphs)"
                       if room > 0 else "")
                    + ", model.num_layers=N with dummy weights, or " + hint)
        raise ConfigError(
            f"model {name}: its weights need {_gib(need.device)} on {device}"
            + (f" ({_gib(need.routed)} of them routed experts)" if need.host == 0 and need.routed
               else f" (beside {_gib(need.host)} of routed experts in host memory)" if need.host
               else "")
            + f", and {_gib(device_free)} is free: use {hint}")
    host_need = need.device + need.host if device.type == "cpu" else need.host
    if host_need and host_free is not None and host_need + HOST_MARGIN > host_free:
        what = "its weights" if device.type == "cpu" else "its routed experts (the expert cache)"
        raise ConfigError(
            f"model {name}: {what} need {_gib(host_need)} of host memory, and "
            f"{_gib(host_free)} is available"
            + (": model.num_layers=N with dummy weights, or a GPU (device=cuda)"
               if device.type == "cpu" else ""))


def materialize(model: nn.Module, device: torch.device,
                host: list[tuple[nn.Module, str]]) -> None:
    """model.to_empty(device), but the `host` parameters uninitialised in host memory."""
    held = [(m, n, getattr(m, n)) for m, n in host]
    for m, n, _ in held:
        del m._parameters[n]
    model.to_empty(device=device)
    for m, n, p in held:
        m.register_parameter(n, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"),
                                             requires_grad=False))


class LoadProgress:
    """`log` a line on the bytes filled so far, at most every `every_s` seconds, for a load that
    runs long (a full-depth model: tens of GiB drawn or read): silent for a small model."""

    def __init__(self, total_bytes: int, log, every_s: float = 10.0):
        self.total, self.log, self.every_s = max(1, int(total_bytes)), log, every_s
        self.done = 0
        self.t0 = self.last = time.perf_counter()

    def add(self, nbytes: int) -> None:
        self.done += int(nbytes)
        now = time.perf_counter()
        if now - self.last >= self.every_s and self.done < self.total:
            self.last = now
            self.log(f"INFO: loading weights: {100 * self.done / self.total:.0f}% "
                     f"({_gib(self.done)} of {_gib(self.total)}, {now - self.t0:.0f} s)")
