"""Dispatch of the grouped-decode operations to a backend (torch reference, cpu, cuda, hip).

`auto` picks the built extension for the device (cpu or cuda/hip) and falls back to torch.

The model calls these names at call time (`ops.grouped_window_attention(...)`, not a reference
taken at import), and `set_backend` rebinds them once at engine start:

    torch  strata.kernels.reference for every op (any device)
    cpu    the C++ kernels of the cyext extension strata.kernels.strata_cpu (CPU tensors)
    cuda   the CUDA kernels of strata.kernels.strata_cuda (NVIDIA GPU, CUDA build of torch)
    hip    the same module built with STRATA_BACKEND=hip (AMD GPU, ROCm build of torch)

Ops a backend does not implement fall back to the torch reference (today: moe_route,
causal_conv_window_qkvz, causal_conv_window_qkvz_ba and gated_delta_window_prep on the CPU,
where the model then gathers the conv's input, projects b/a and prepares the rule's inputs
itself; chunk_gated_delta, the prefill path, runs the decode kernel's recurrence on cpu, cuda and
hip, and the chunked reference on torch; l2_prefetch, a hint, does nothing off the GPU;
linear_skinny is F.linear off the GPU).
`implementations()` tells which is in use for each op, `native(op)` whether one runs on the
backend's own kernel. All ops keep the reference signatures and return values.
"""

from __future__ import annotations

import torch

from strata.kernels import cyext_ops, reference

_BACKEND = "torch"
OPS = ("write_kv", "grouped_window_attention", "causal_conv_window", "causal_conv_window_qkvz",
       "causal_conv_window_qkvz_ba", "gated_delta_window", "gated_delta_window_prep",
       "commit_accepted", "chunk_gated_delta", "moe_experts", "linear_fp8", "linear_skinny",
       "moe_route", "l2_prefetch")
_IMPL: dict[str, str] = {name: "torch" for name in OPS}

write_kv = reference.write_kv
grouped_window_attention = reference.grouped_window_attention
causal_conv_window = reference.causal_conv_window
causal_conv_window_qkvz = reference.causal_conv_window_qkvz
causal_conv_window_qkvz_ba = reference.causal_conv_window_qkvz_ba
gated_delta_window = reference.gated_delta_window
gated_delta_window_prep = reference.gated_delta_window_prep
commit_accepted = reference.commit_accepted
chunk_gated_delta = reference.chunk_gated_delta
moe_experts = reference.moe_experts
linear_fp8 = reference.linear_fp8
linear_skinny = reference.linear_skinny
moe_route = reference.moe_route
l2_prefetch = reference.l2_prefetch


def _kernels_for(name: str, dev: torch.device) -> dict:
    if name == "torch":
        return {}
    if name == "cpu":
        if dev.type != "cpu":
            raise ValueError(f"backend=cpu: device {dev} is not the CPU (the cpu backend runs "
                             f"the C++ kernels on CPU tensors)")
        if not cyext_ops.cpu_available():
            raise ValueError(f"backend=cpu: the cyext CPU extension strata.kernels.strata_cpu is "
                             f"not built in this install ({cyext_ops.CPU_IMPORT_ERROR}); build "
                             f"it with `pip install -e .`")
        return cyext_ops.CPU_OPS
    # cuda / hip
    if dev.type != "cuda":
        raise ValueError(f"backend={name}: device {dev} is not a GPU device (want cuda[:N]; "
                         f"ROCm builds of torch also call the GPU 'cuda')")
    platform = cyext_ops.gpu_platform()
    if platform is None:
        raise ValueError(f"backend={name}: the cyext GPU extension strata.kernels.strata_cuda is "
                         f"not built in this install ({cyext_ops.GPU_IMPORT_ERROR}); rebuild "
                         f"with nvcc on PATH (STRATA_CUDA=1 pip install -e .) or, for AMD, "
                         f"STRATA_BACKEND=hip")
    if platform != name:
        raise ValueError(f"backend={name}: the GPU extension in this install was built for "
                         f"{platform}, not {name}")
    torch_platform = "hip" if getattr(torch.version, "hip", None) else "cuda"
    if torch_platform != name:
        raise ValueError(f"backend={name}: this torch is a {torch_platform} build")
    if not torch.cuda.is_available():
        raise ValueError(f"backend={name}: torch sees no GPU on this machine (device {dev})")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"backend={name}: device {dev} does not exist "
                         f"({torch.cuda.device_count()} GPUs)")
    return cyext_ops.GPU_OPS


def set_backend(name: str, device: str | torch.device = "cpu") -> str:
    """Select the kernel backend for `device`; returns the name in use.

    Raises ValueError naming `backend=` when the backend is unknown, its extension is not built,
    or the device does not match (e.g. backend=cuda with a CPU device)."""
    global _BACKEND
    if name not in ("auto", "torch", "cpu", "cuda", "hip"):
        raise ValueError(f"backend={name!r}: unknown kernel backend (auto, torch, cpu, cuda or hip)")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"backend={name}: bad device {device!r} ({exc})") from None
    if name == "auto":  # the built kernels for this device, else the torch reference
        name = "torch"
        candidates = ["cpu"] if dev.type == "cpu" else [cyext_ops.gpu_platform() or "cuda"]
        for cand in candidates:
            try:
                _kernels_for(cand, dev)
                name = cand
                break
            except ValueError:
                pass
    kernels = _kernels_for(name, dev)
    g = globals()
    for op in OPS:
        g[op] = kernels.get(op, getattr(reference, op))
        _IMPL[op] = name if op in kernels else "torch"
    _BACKEND = name
    return _BACKEND


def backend() -> str:
    return _BACKEND


def native(op: str) -> bool:
    """Whether the backend runs `op` on its own kernel (not the torch reference)."""
    return _IMPL[op] != "torch"


def l2_prefetch_level() -> int:
    """What the model prefetches into L2 ahead of the kernels that read it (ops.l2_prefetch):
    0 nothing, else cyext_ops.moe_launch_options(l2_prefetch=)'s level where the backend has
    the kernel."""
    return cyext_ops.l2_prefetch_level() if native("l2_prefetch") else 0


def skinny_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the model runs a decode window's x @ weight^T as ops.linear_skinny (the GPU's
    skinny kernel, cyext_ops.skinny_bf16_takes) rather than F.linear."""
    return native("linear_skinny") and cyext_ops.skinny_bf16_takes(x, weight)


def implementations() -> dict[str, str]:
    """Which backend serves each op right now (ops a backend lacks say 'torch')."""
    return dict(_IMPL)


def chunk_rule_eager(q, k, v, g, beta, initial_state):
    """chunk_rule outside a compiled region (and the custom op's body)."""
    core, state = chunk_gated_delta(q, k, v, g, beta, initial_state)  # the backend's, bound now
    # fresh tensors (a custom op's results may not alias its inputs or each other): the
    # reference's core is a view of its padded chunk grid
    core = core.clone(memory_format=torch.contiguous_format)
    if state.data_ptr() == initial_state.data_ptr():
        state = state.clone()
    return core, state


def chunk_rule(q, k, v, g, beta, initial_state):
    """chunk_gated_delta (the backend's) for a prompt chunk inside a compiled region, as one
    opaque op: the reference's chunk loop unrolls by the prompt's length (and pads by length
    % 64), so a traced region recompiled, MoE and all, for every prompt bucket; and a graph
    break around it (torch.compiler.disable) split the region into four graphs. Eager calls go
    straight to the backend (the dispatcher costs microseconds). Returns fresh (core, state)."""
    if torch.compiler.is_compiling():
        return torch.ops.strata.chunk_rule(q, k, v, g, beta, initial_state)
    return chunk_rule_eager(q, k, v, g, beta, initial_state)

