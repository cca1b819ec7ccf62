"""The device an engine runs on, and how much memory it has."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from strata.config import ConfigError
from strata.engine.memory import MIB


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: no CUDA device is available (use device=cpu or auto)")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device: must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def device_memory(device: torch.device,
                  cpu_device_mib: float) -> tuple[float, Optional[Callable[[], float]]]:
    """(total MiB, a function giving the free MiB now, or None): a CPU engine plans against
    `cpu_device_mib` (engine.cpu_device_mib) with arithmetic only."""
    if device.type != "cuda":
        return float(cpu_device_mib), None
    total = torch.cuda.mem_get_info(device)[1] / MIB
    return total, lambda: torch.cuda.mem_get_info(device)[0] / MIB


def empty_allocator_caches(device: torch.device) -> None:
    """Return the caching allocator's unused blocks (device, and pinned host) to the driver."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()


def allocator_reclaim(device: torch.device) -> Optional[Callable[[], None]]:
    """MemoryBudget.reclaim for `device`: empties the allocator's caches (CUDA), or None."""
    if device.type != "cuda":
        return None
    return lambda: empty_allocator_caches(device)


def device_free_used_mib(device: torch.device) -> tuple[Optional[float], Optional[float]]:
    if device.type != "cuda":
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    return free / MIB, (total - free) / MIB
