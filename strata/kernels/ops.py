"""Dispatch of the grouped-decode operations to a backend (torch reference, cpu, cuda, hip).

The model calls these names; `set_backend` picks the implementation once at engine start.
"""

from __future__ import annotations

from strata.kernels import reference

_BACKEND = "torch"

write_kv = reference.write_kv
grouped_window_attention = reference.grouped_window_attention
causal_conv_window = reference.causal_conv_window
gated_delta_window = reference.gated_delta_window
commit_accepted = reference.commit_accepted
chunk_gated_delta = reference.chunk_gated_delta


def set_backend(name: str, device: str) -> str:
    """Select the kernel backend; returns the name in use."""
    global _BACKEND
    if name not in ("torch", "cpu", "cuda", "hip"):
        raise ValueError(f"backend: unknown kernel backend {name!r} (torch, cpu, cuda or hip)")
    if name != "torch":
        raise ValueError(f"backend={name}: the cyext extension is not built in this install")
    _BACKEND = name
    return _BACKEND


def backend() -> str:
    return _BACKEND
