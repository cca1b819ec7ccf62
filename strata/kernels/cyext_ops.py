"""Adapters between the reference signatures (strata.kernels.reference) and the cyext kernels.

The Cython modules (strata.kernels.strata_cpu / strata_cuda, built from cyext/) take every
output, the attention's split-K workspace and the stream explicitly; the functions here allocate
outputs and scratch with torch on the inputs' device (on the current stream, so that inside CUDA
graph capture they come from the graph's memory pool), pick the attention's split plan and pass
`torch.cuda.current_stream().cuda_stream`. They keep the reference signatures and return values, so
`strata.kernels.ops.set_backend` can swap them in; a few keyword-only extras (`out=`, `snaps=`,
`factors=`, `workspace=`, `nsplit=`) let a caller reuse preallocated buffers.

Index tensors (group_slot, group_pos, accept) are converted to contiguous int64 when they are not.
With STRATA_KERNEL_CHECKS=1 the GPU wrappers validate slot indices on the host first (this
synchronises, so it is skipped during graph capture); otherwise a bad slot is clamped on the device
(it lands on the scratch slot), because a kernel cannot raise.
"""

from __future__ import annotations

import functools
import os

import torch

from strata.kernels import reference

try:
    from strata.kernels import strata_cpu as _cpu
    CPU_IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # not built
    _cpu = None
    CPU_IMPORT_ERROR = exc

try:
    from strata.kernels import strata_cuda as _gpu
    GPU_IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # not built (no nvcc at install time) or broken
    _gpu = None
    GPU_IMPORT_ERROR = exc

# ---------------------------------------------------------------------------------------------
# availability


def cpu_available() -> bool:
    return _cpu is not None


def gpu_platform() -> str | None:
    """'cuda' or 'hip' when the GPU extension is built (it imports without a GPU), else None."""
    return _gpu.gpu_platform() if _gpu is not None else None


def _index(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    return t if t.is_contiguous() else t.contiguous()


def _compiling() -> bool:
    """True while torch.compile (dynamo) traces: the wrappers then emit the strata:: custom ops
    registered below instead of calling into Cython, so compiled regions need no graph break."""
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # very old torch
        return False


def _checks_enabled() -> bool:
    return os.environ.get("STRATA_KERNEL_CHECKS", "0") not in ("", "0")


def _validate_slots(op: str, group_slot: torch.Tensor, nslots: int) -> None:
    if not _checks_enabled() or (group_slot.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if group_slot.numel() and (int(group_slot.min()) < 0 or int(group_slot.max()) >= nslots):
        raise ValueError(f"{op}: group_slot values must be in [0, {nslots}), got "
                         f"{group_slot.tolist()}")


# ---------------------------------------------------------------------------------------------
# CPU (C++) backend


def cpu_write_kv(k_cache, v_cache, k, v, group_slot, group_pos) -> None:
    if _compiling():
        return torch.ops.strata.write_kv(k_cache, v_cache, k, v, group_slot, group_pos)
    _cpu.write_kv(k_cache, v_cache, k.contiguous(), v.contiguous(), _index(group_slot),
                  _index(group_pos))


def cpu_grouped_window_attention(q, k_cache, v_cache, group_slot, group_pos, ctx, scale, *,
                                 out=None, split_keys=0):
    """One pass over the keys: `split_keys` (a GPU split-K setting) changes nothing here."""
    if _compiling() and out is None:
        return torch.ops.strata.grouped_window_attention(q, k_cache, v_cache, group_slot,
                                                         group_pos, ctx, float(scale),
                                                         int(split_keys))
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _cpu.grouped_window_attention(q, k_cache, v_cache, _index(group_slot), _index(group_pos),
                                  int(ctx), float(scale), out)
    return out


def cpu_causal_conv_window(x, conv_state, weight, group_slot, *, out=None, snaps=None):
    if _compiling() and out is None and snaps is None:
        return torch.ops.strata.causal_conv_window(x, conv_state, weight, group_slot)
    x = x.contiguous()
    ng, g, c = x.shape
    kw = weight.shape[1]
    if out is None:
        out = torch.empty_like(x)
    if snaps is None:
        snaps = torch.empty(ng, g, c, kw - 1, dtype=x.dtype, device=x.device)
    _cpu.causal_conv_window(x, conv_state, weight.contiguous(), _index(group_slot), out, snaps)
    return out, snaps


def _gdn_compiled(q, k, v, g, beta, rec_state, group_slot, snaps, factors):
    """The rule's custom op inside a compiled region (no `out=`): (out, per-row tensor)."""
    if factors is not None:  # each row's rank-one update factors into the caller's tensor
        return (torch.ops.strata.gated_delta_window_factors_into(q, k, v, g, beta, rec_state,
                                                                 group_slot, factors), factors)
    if snaps is not None:  # snapshots into the caller's tensor
        return (torch.ops.strata.gated_delta_window_into(q, k, v, g, beta, rec_state,
                                                         group_slot, snaps), snaps)
    return torch.ops.strata.gated_delta_window(q, k, v, g, beta, rec_state, group_slot)


def _gdn_rows(snaps, factors, ng, rows, h, dk, dv, device):
    """The rule's per-row output: `factors` (NG, G, H, Dk + Dv + 1) when given, else the
    snapshots (NG, G, H, Dk, Dv), allocated when `snaps` is None. Returns (tensor, factors?)."""
    if snaps is not None and factors is not None:
        raise ValueError("gated_delta_window: snaps and factors exclude each other")
    if factors is not None:
        return factors, True
    if snaps is None:
        snaps = torch.empty(ng, rows, h, dk, dv, dtype=torch.float32, device=device)
    return snaps, False


def cpu_gated_delta_window(q, k, v, g, beta, rec_state, group_slot, *, out=None, snaps=None,
                           factors=None):
    """`factors`: each row's rank-one update [k | delta | decay] (reference.gated_delta_window)
    in place of the snapshots."""
    if _compiling() and out is None:
        return _gdn_compiled(q, k, v, g, beta, rec_state, group_slot, snaps, factors)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    ng, rows, h, dk = k.shape
    dv = v.shape[-1]
    if out is None:
        out = torch.empty(ng, rows, h, dv, dtype=torch.float32, device=q.device)
    per_row, as_factors = _gdn_rows(snaps, factors, ng, rows, h, dk, dv, q.device)
    _cpu.gated_delta_window(q, k, v, g, beta, rec_state, _index(group_slot), out, per_row,
                            factors=as_factors)
    return out, per_row


def _recurrent_chunk(run, q, k, v, g, beta, initial_state):
    """A prompt chunk's gated delta rule (reference.chunk_gated_delta's arguments and results)
    by the decode kernel's per-row recurrence, each sequence a group of L rows, keeping only
    the final state: `run(q, k, v, g, beta, state, slots, out, final)` calls the extension."""
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    b, length, h, dk = k.shape
    dv = v.shape[-1]
    state = initial_state.float().contiguous()
    out = torch.empty(b, length, h, dv, dtype=torch.float32, device=q.device)
    final = torch.empty(b, h, dk, dv, dtype=torch.float32, device=q.device)
    run(q, k, v, g, beta, state, torch.arange(b, device=q.device), out, final)
    return out, final


def cpu_chunk_gated_delta(q, k, v, g, beta, initial_state, chunk: int = 64):
    """reference.chunk_gated_delta on the C++ recurrence (`chunk` has no role in it)."""
    return _recurrent_chunk(
        lambda *a: _cpu.gated_delta_window(*a, final_only=True), q, k, v, g, beta, initial_state)


def cpu_commit_accepted(accept, group_slot, group_pos, rec_factors, conv_snaps, rec_state,
                        conv_state, slot_pos) -> None:
    if _compiling():
        return torch.ops.strata.commit_accepted(accept, group_slot, group_pos, rec_factors,
                                                conv_snaps, rec_state, conv_state, slot_pos)
    _cpu.commit_accepted(_index(accept), _index(group_slot), _index(group_pos),
                         rec_factors.contiguous(), conv_snaps.contiguous(), rec_state, conv_state,
                         slot_pos)


def _block_args(op: str, w: torch.Tensor, gu_or_scale, block) -> tuple[int, int]:
    """(bo, bi) for the kernels: the FP8 block, or (1, 1) for float weights (scales unused)."""
    if w.dtype != getattr(torch, "float8_e4m3fn", None):
        return 1, 1
    if block is None or gu_or_scale is None:
        raise ValueError(f"{op}: float8_e4m3fn weights need their block scales and block=(bo, bi)")
    bo, bi = (int(b) for b in block)
    return bo, bi


def _moe_inputs(x, topk_weight, topk_ids):
    return (x.contiguous(), topk_weight.to(torch.float32).contiguous(), _index2d(topk_ids))


def _index2d(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    return t if t.is_contiguous() else t.contiguous()


#: The expert cache's optional arguments of moe_experts (reference.moe_experts), in order:
#: its slot table and host store, then its counting.
CACHE_ARGS = ("slot_of", "host_gate_up", "host_down", "host_gu_scale", "host_down_scale",
              "routed_counts", "window_state", "count_layer")


def _cache_kwargs(slot_of, host_gate_up, host_down, host_gu_scale, host_down_scale,
                  routed_counts=None, window_state=None, count_layer=None) -> dict:
    counting = (routed_counts, window_state, count_layer)
    if slot_of is None:
        if any(t is not None for t in counting):
            raise ValueError("moe_experts: routed_counts, window_state and count_layer count the "
                             "expert cache's reads: they need slot_of")
        return {}
    out = {"slot_of": slot_of, "host_gate_up": host_gate_up, "host_down": host_down,
           "host_gu_scale": host_gu_scale, "host_down_scale": host_down_scale}
    if any(t is not None for t in counting):
        out.update(routed_counts=routed_counts, window_state=window_state, count_layer=count_layer)
    return out


def _moe_op(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale, down_scale, block, slot_of,
            host_gate_up, host_down, host_gu_scale, host_down_scale, routed_counts,
            window_state, count_layer, prompt=False):
    """moe_experts as the custom op torch.compile sees: `strata::moe_experts_counted` (its
    counting tensors mutated) with the cache's counting, else `strata::moe_experts` (a mutable
    argument that is None breaks inductor's lowering)."""
    blk = None if block is None else [int(b) for b in block]
    if routed_counts is not None:
        return torch.ops.strata.moe_experts_counted(
            x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale, down_scale, blk, slot_of,
            host_gate_up, host_down, host_gu_scale, host_down_scale, routed_counts,
            window_state, count_layer, prompt)
    return torch.ops.strata.moe_experts(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale,
                                        down_scale, blk, slot_of, host_gate_up, host_down,
                                        host_gu_scale, host_down_scale, prompt)


def cpu_moe_experts(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale=None, down_scale=None,
                    block=None, slot_of=None, host_gate_up=None, host_down=None,
                    host_gu_scale=None, host_down_scale=None, routed_counts=None,
                    window_state=None, count_layer=None, *, out=None, prompt=False):
    """Routed experts on the CPU, grouped by expert: each distinct expert's rows are decoded
    once for all the rows routed to it (reference.moe_experts semantics, the expert cache's
    slots, host store and counting included). `prompt` changes nothing here: one set of bits
    for every row."""
    cache = _cache_kwargs(slot_of, host_gate_up, host_down, host_gu_scale, host_down_scale,
                          routed_counts, window_state, count_layer)
    if _compiling() and out is None:
        return _moe_op(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale, down_scale, block,
                       slot_of, host_gate_up, host_down, host_gu_scale, host_down_scale,
                       routed_counts, window_state, count_layer, prompt)
    bo, bi = _block_args("moe_experts", w_gate_up, gu_scale, block)
    x, topk_weight, topk_ids = _moe_inputs(x, topk_weight, topk_ids)
    if out is None:
        out = torch.empty_like(x)
    if cache and gu_scale is not None:
        cache["host_gu_scale"] = host_gu_scale.float().contiguous()
        cache["host_down_scale"] = host_down_scale.float().contiguous()
    _cpu.moe_experts(x, w_gate_up.contiguous(), w_down.contiguous(), topk_weight, topk_ids,
                     None if gu_scale is None else gu_scale.float().contiguous(),
                     None if down_scale is None else down_scale.float().contiguous(), bo, bi, out,
                     **cache)
    return out


def cpu_linear_fp8(x, weight, scale_inv, block, *, out=None):
    """y = x @ dequant(weight)^T on the CPU (FP8 decoded exactly, per-element block scale)."""
    if _compiling() and out is None:
        return torch.ops.strata.linear_fp8(x, weight, scale_inv, [int(b) for b in block])
    bo, bi = _block_args("linear_fp8", weight, scale_inv, block)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device) \
        if out is None else out.view(x2.shape[0], weight.shape[0])
    _cpu.linear_fp8(x2, weight.contiguous(), scale_inv.float().contiguous(), bo, bi, y)
    return y.view(*lead, weight.shape[0])


CPU_OPS = {
    "write_kv": cpu_write_kv,
    "grouped_window_attention": cpu_grouped_window_attention,
    "causal_conv_window": cpu_causal_conv_window,
    "gated_delta_window": cpu_gated_delta_window,
    "commit_accepted": cpu_commit_accepted,
    "chunk_gated_delta": cpu_chunk_gated_delta,
    "moe_experts": cpu_moe_experts,
    "linear_fp8": cpu_linear_fp8,
}

# ---------------------------------------------------------------------------------------------
# GPU (CUDA / HIP) backend


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _mma_rows_per_block(rows: int) -> int:
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


def attention_plan(ng: int, hkv: int, rows: int, ctx: int, d: int, sm_count: int,
                   mma: bool) -> tuple[int, int]:
    """(nsplit, chunk) of the split-K attention: enough blocks to fill the GPU once
    (ng * hkv * row-blocks * nsplit <= sm_count * blocks-per-SM), chunks a multiple of 64 keys and
    long enough (>= 256 keys and >= 8 * rows) that the fp32 partials stay small next to the K/V
    bytes. ctx small or many groups: nsplit == 1, a single pass with no workspace."""
    if mma:
        per_block = _mma_rows_per_block(rows)
        blocks_per_sm = 1 if d > 128 else (2 if d > 64 else 3)
    else:
        per_block = 16
        blocks_per_sm = 4
    units = ng * hkv * -(-rows // per_block)
    target = max(1, (sm_count * blocks_per_sm) // max(units, 1))
    min_chunk = max(256, 8 * rows)
    nsplit = max(1, min(target, -(-ctx // min_chunk)))
    chunk = -(-ctx // nsplit)
    chunk = -(-chunk // 64) * 64
    nsplit = -(-ctx // chunk)
    return nsplit, chunk


#: Most split-K chunks the CUDA kernel takes (MAX_SPLITS in strata_kernels.cu).
MAX_ATTENTION_SPLITS = 4096


def fixed_split_plan(ctx: int, split_keys: int) -> tuple[int, int]:
    """(nsplit, chunk) with chunks of `split_keys` keys (rounded up to 64) whatever the
    window: a row's partials then cover the same keys at every context tier and group count,
    and the splits past its position are empty (weight 0 in the combine), so its result does
    not depend on the window it is in. Past MAX_ATTENTION_SPLITS chunks, longer chunks."""
    chunk = max(64, -(-int(split_keys) // 64) * 64)
    nsplit = -(-ctx // chunk)
    if nsplit > MAX_ATTENTION_SPLITS:
        per_split = -(-ctx // MAX_ATTENTION_SPLITS)
        chunk = -(-per_split // 64) * 64
        nsplit = -(-ctx // chunk)
    return nsplit, chunk


def gpu_write_kv(k_cache, v_cache, k, v, group_slot, group_pos) -> None:
    if _compiling():
        return torch.ops.strata.write_kv(k_cache, v_cache, k, v, group_slot, group_pos)
    group_slot = _index(group_slot)
    _validate_slots("write_kv", group_slot, k_cache.shape[0])
    _gpu.write_kv(k_cache, v_cache, k.contiguous(), v.contiguous(), group_slot,
                  _index(group_pos), _stream(k))


def gpu_grouped_window_attention(q, k_cache, v_cache, group_slot, group_pos, ctx, scale, *,
                                 out=None, workspace=None, nsplit=None, use_mma=True,
                                 split_keys=0):
    """Split-K attention (see attention_plan; `split_keys` > 0: fixed_split_plan). workspace:
    optional float32 scratch of at least `attention_workspace_numel` elements; allocated here
    with torch.empty when missing."""
    if _compiling() and out is None and workspace is None and nsplit is None and use_mma:
        return torch.ops.strata.grouped_window_attention(q, k_cache, v_cache, group_slot,
                                                         group_pos, ctx, float(scale),
                                                         int(split_keys))
    ctx = int(ctx)
    q = q.contiguous()
    if q.data_ptr() % 16:
        q = q.clone()  # 16-byte loads on the tensor-core path
    ng, g, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"grouped_window_attention: q has {hq} heads, not a multiple of the "
                         f"caches' {hkv} KV heads")
    rows = (hq // hkv) * g
    group_slot = _index(group_slot)
    _validate_slots("grouped_window_attention", group_slot, k_cache.shape[0])
    mma = bool(use_mma) and _gpu.has_mma() and _gpu.attn_mma_supported(d, rows) and \
        q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
    if nsplit is None and split_keys:
        nsplit, chunk = fixed_split_plan(ctx, split_keys)
    elif nsplit is None:
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        nsplit, chunk = attention_plan(ng, hkv, rows, ctx, d, _sm_count(index), mma)
    else:
        nsplit = max(1, min(int(nsplit), ctx, 4096))
        chunk = -(-ctx // nsplit)
        nsplit = -(-ctx // chunk)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    need = _gpu.attention_workspace_numel(ng, hkv, rows, d, nsplit)
    if need and (workspace is None or workspace.numel() < need):
        workspace = torch.empty(need, dtype=torch.float32, device=q.device)
    # Fixed splits ask the tensor-core path for one m-tile per block too (use_mma=2): the
    # keys are then shared among a block's warps the same way for every window shape.
    mma_mode = (2 if split_keys else 1) if use_mma else 0
    _gpu.grouped_window_attention(q, k_cache, v_cache, group_slot, _index(group_pos), ctx,
                                  float(scale), out, workspace if need else None, nsplit, chunk,
                                  _stream(q), mma_mode)
    return out


def attention_workspace_numel(q, k_cache, ctx, split_keys: int = 0) -> int:
    """float32 scratch elements gpu_grouped_window_attention needs for these shapes (0 = none)."""
    ng, g, hq, d = q.shape
    hkv = k_cache.shape[2]
    rows = (hq // hkv) * g
    if split_keys:
        nsplit, _ = fixed_split_plan(int(ctx), split_keys)
        return _gpu.attention_workspace_numel(ng, hkv, rows, d, nsplit)
    mma = _gpu.has_mma() and _gpu.attn_mma_supported(d, rows) and \
        q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    nsplit, _ = attention_plan(ng, hkv, rows, int(ctx), d, _sm_count(index), mma)
    return _gpu.attention_workspace_numel(ng, hkv, rows, d, nsplit)


def gpu_causal_conv_window(x, conv_state, weight, group_slot, *, out=None, snaps=None):
    if _compiling() and out is None and snaps is None:
        return torch.ops.strata.causal_conv_window(x, conv_state, weight, group_slot)
    x = x.contiguous()
    ng, g, c = x.shape
    kw = weight.shape[1]
    group_slot = _index(group_slot)
    _validate_slots("causal_conv_window", group_slot, conv_state.shape[0])
    if out is None:
        out = torch.empty_like(x)
    if snaps is None:
        snaps = torch.empty(ng, g, c, kw - 1, dtype=x.dtype, device=x.device)
    _gpu.causal_conv_window(x, conv_state, weight.contiguous(), group_slot, out, snaps,
                            _stream(x))
    return out, snaps


def _conv_outputs(op: str, x, conv_state, weight, group_slot):
    """The gathering convs' checked slot ids and their outputs: the conv (NG, G, C) and its
    snapshots (NG, G, C, K-1), in x's dtype."""
    (ng, g), (c, kw) = x.shape[:2], weight.shape
    group_slot = _index(group_slot)
    _validate_slots(op, group_slot, conv_state.shape[0])
    return (group_slot, torch.empty(ng, g, c, dtype=x.dtype, device=x.device),
            torch.empty(ng, g, c, kw - 1, dtype=x.dtype, device=x.device))


def gpu_causal_conv_window_qkvz(x, conv_state, weight, group_slot, nk, dk, vpk):
    """reference.causal_conv_window_qkvz in one kernel: the conv gathers its q, k and v channels
    from the in_proj's interleaved columns (a row-strided view is read in place)."""
    if _compiling():
        return torch.ops.strata.causal_conv_window_qkvz(x, conv_state, weight, group_slot, nk, dk,
                                                        vpk)
    group_slot, out, snaps = _conv_outputs("causal_conv_window_qkvz", x, conv_state, weight,
                                           group_slot)
    _gpu.causal_conv_window_qkvz(x, conv_state, weight.contiguous(), group_slot, out, snaps,
                                 int(nk), int(dk), int(vpk), _stream(x))
    return out, snaps


def gpu_causal_conv_window_qkvz_ba(x, conv_state, weight, group_slot, nk, dk, vpk, x_normed,
                                   w_ba):
    """reference.causal_conv_window_qkvz_ba in one launch: the gathering conv's blocks and, past
    them, blocks that compute ba = x_normed . w_ba^T (float32 sums in an order fixed by H, so a
    row's ba is the same bits in any window). For FP8 in_proj_qkvz layers whose in_proj_ba stays
    float, which would otherwise launch a GEMM of 2 nv outputs for ba alone."""
    if _compiling():
        return torch.ops.strata.causal_conv_window_qkvz_ba(x, conv_state, weight, group_slot, nk,
                                                           dk, vpk, x_normed, w_ba)
    group_slot, out, snaps = _conv_outputs("causal_conv_window_qkvz_ba", x, conv_state, weight,
                                           group_slot)
    ba = torch.empty(*x.shape[:2], w_ba.shape[0], dtype=x.dtype, device=x.device)
    _gpu.causal_conv_window_qkvz_ba(x, conv_state, weight.contiguous(), group_slot, out, snaps,
                                    int(nk), int(dk), int(vpk), x_normed, w_ba, ba, _stream(x))
    return out, snaps, ba


def gpu_gated_delta_window(q, k, v, g, beta, rec_state, group_slot, *, out=None, snaps=None,
                           factors=None):
    """`factors`: each row's rank-one update [k | delta | decay] (reference.gated_delta_window)
    in place of the snapshots: a few hundred bytes a row and head written instead of Dk x Dv
    floats."""
    if _compiling() and out is None:
        return _gdn_compiled(q, k, v, g, beta, rec_state, group_slot, snaps, factors)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    ng, rows, h, dk = k.shape
    dv = v.shape[-1]
    group_slot = _index(group_slot)
    _validate_slots("gated_delta_window", group_slot, rec_state.shape[0])
    if out is None:
        out = torch.empty(ng, rows, h, dv, dtype=torch.float32, device=q.device)
    per_row, as_factors = _gdn_rows(snaps, factors, ng, rows, h, dk, dv, q.device)
    _gpu.gated_delta_window(q, k, v, g, beta, rec_state, group_slot, out, per_row, _stream(q),
                            factors=as_factors)
    return out, per_row


def gpu_gated_delta_window_prep(x, ba, neg_a, dt_bias, rec_state, group_slot, nk, dk, q_scale,
                                eps, *, snaps=None, factors=None):
    """reference.gated_delta_window_prep in one kernel (the norms, gates and rule). `factors`:
    each row's [k | delta | decay] as the kernel's update used them (k raw: the kernel folds
    its norm into delta), in place of the snapshots."""
    if _compiling():
        if factors is not None:
            return (torch.ops.strata.gated_delta_window_prep_factors_into(
                x, ba, neg_a, dt_bias, rec_state, group_slot, nk, dk, q_scale, eps, factors),
                factors)
        if snaps is None:
            return torch.ops.strata.gated_delta_window_prep(x, ba, neg_a, dt_bias, rec_state,
                                                            group_slot, nk, dk, q_scale, eps)
        return (torch.ops.strata.gated_delta_window_prep_into(
            x, ba, neg_a, dt_bias, rec_state, group_slot, nk, dk, q_scale, eps, snaps), snaps)
    ng, rows, _ = x.shape
    h, dv = neg_a.shape[0], rec_state.shape[-1]
    group_slot = _index(group_slot)
    _validate_slots("gated_delta_window_prep", group_slot, rec_state.shape[0])
    out = torch.empty(ng, rows, h, dv, dtype=torch.float32, device=x.device)
    per_row, as_factors = _gdn_rows(snaps, factors, ng, rows, h, dk, dv, x.device)
    _gpu.gated_delta_window_prep(x, ba, neg_a, dt_bias, rec_state, group_slot, out, per_row,
                                 int(nk), int(dk), float(q_scale), float(eps), _stream(x),
                                 factors=as_factors)
    return out, per_row


def gpu_chunk_gated_delta(q, k, v, g, beta, initial_state, chunk: int = 64):
    """reference.chunk_gated_delta on the decode kernel's recurrence: one launch per layer,
    where the chunked reference ran batched triangular solves and a few hundred kernels (the
    tiny model's 64-token chunk: 89 us a layer; full depth 4.6 ms of a 68 ms chunk). Its heads
    run in parallel and each head's rows in order, which at prompt-chunk lengths (<= 256
    rows) costs less than the solves. Dk > 256: the reference."""
    if k.shape[-1] > 256:
        return reference.chunk_gated_delta(q, k, v, g, beta, initial_state, chunk)
    return _recurrent_chunk(
        lambda *a: _gpu.gated_delta_window(*a, _stream(q), final_only=True),
        q, k, v, g, beta, initial_state)


def gpu_commit_accepted(accept, group_slot, group_pos, rec_factors, conv_snaps, rec_state,
                        conv_state, slot_pos) -> None:
    """The factors' replay in one kernel (Dk <= 256; larger: the reference)."""
    if _compiling():
        return torch.ops.strata.commit_accepted(accept, group_slot, group_pos, rec_factors,
                                                conv_snaps, rec_state, conv_state, slot_pos)
    if rec_state.shape[-2] > 256:
        return reference.commit_accepted(accept, group_slot, group_pos, rec_factors, conv_snaps,
                                         rec_state, conv_state, slot_pos)
    group_slot = _index(group_slot)
    _validate_slots("commit_accepted", group_slot, rec_state.shape[1])
    _gpu.commit_accepted(_index(accept), group_slot, _index(group_pos), rec_factors.contiguous(),
                         conv_snaps.contiguous(), rec_state, conv_state, slot_pos,
                         _stream(rec_state))


#: Shapes the GPU routed-expert kernel takes (cyext/src/strata_moe.cu); others use the reference.
MOE_MAX_ROWS = 32
MOE_MAX_PAIRS = 512
#: Rows of a wide FP8 launch where the extension takes no more (moe_launch_options(fp8_wide=)),
#: the default (moe_launch_options(wide_rows=): a prompt chunk of several slots' chunks,
#: engine.prefill_slots, reads each expert once per launch; eight slots' 64-token chunks measured
#: 139 ms in 128-row launches against 182 in 64-row ones on an H200, and one layer's 512 rows
#: 1.34 ms in one launch against 2.62 in four of 128 on an H100, the same bits), and the most it
#: takes (launches of more than 1,632 pairs keep the down kernel's results in the workspace:
#: eight slots' chunks in one launch read the experts once where four 128-row launches read
#: nearly all of them four times).
MOE_WIDE_ROWS = 64
MOE_WIDE_DEFAULT_ROWS = 512
MOE_WIDE_MAX_ROWS = 512
_moe_wide_rows = MOE_WIDE_DEFAULT_ROWS
#: Rows per moe_experts launch for FP8 weights without the expert cache (moe_launch_options(
#: fp8_wide=, fp8_launch16=)): MOE_WIDE_ROWS where the extension takes the launch wide (x staged
#: in global memory: one launch of 64 rows measured 469 us against 553 for four of 16 on an
#: H200), else 16, since the streamed kernels stage x beside their ring and at 32 rows keep too
#: few stages (two launches of 16 rows measured 16% faster than one of 32, though they read more
#: experts). bf16 keeps 32, and so does the cache, whose misses are read over the bus once per
#: launch (the simulator's experts.call_rows).
_moe_fp8_launch_rows = MOE_WIDE_ROWS
MOE_MAX_ROW_BYTES = 8192
#: Rows the skinny linear kernel takes; more rows use the reference (dequantise + matmul).
LINEAR_SKINNY_MAX_ROWS = 32


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % 16 == 0 else t.clone()


def moe_kernel_supported(x, w_gate_up, k: int, block=None) -> bool:
    """True when gpu_moe_experts runs these shapes on the kernel (rows beyond 32, or for FP8
    without the expert cache beyond wide_rows (512) where the launch runs wide and 16 where it
    does not, are split into launches of that many rows, which changes no row's result), False
    when it falls
    back to the reference: H or I not a multiple of 16, a weight row over 8 KiB, top-k over 16,
    or FP8 with a scale block whose columns are not a multiple of 16."""
    hidden = x.shape[-1]
    inter = w_gate_up.shape[-2] // 2
    esz = w_gate_up.element_size()
    if hidden % 16 or inter % 16 or not 1 <= k <= MOE_MAX_PAIRS // MOE_MAX_ROWS:
        return False
    if max(hidden, inter) * esz > MOE_MAX_ROW_BYTES:
        return False
    if w_gate_up.dtype == getattr(torch, "float8_e4m3fn", None):
        return block is not None and int(block[1]) % 16 == 0
    return True


def _count_field(flags: int, name: str, value, shift: int) -> int:
    """flags with the 4-bit count `name` at bit `shift` set to value (0..15; None: as it is)."""
    if value is None:
        return flags
    count = int(value)
    if not 0 <= count <= 15:
        raise ValueError(f"{name}: {value!r} is not in 0..15")
    return (flags & ~(15 << shift)) | (count << shift)


def moe_launch_options(pdl=None, early=None, wide=None, db=None, xsmem=None, stream=None,
                       stream_all=None, linear_stream=None, linear_pipe=None,
                       stream_miss=None, gate_up_pdl=None, linear_split=None,
                       linear_split_depth=None, linear_split_pair=None,
                       linear_f16=None, gate_up_mma=None, down_split=None,
                       down_split_runs=None, fp8_launch16=None, fp8_wide=None,
                       route_chunks=None, down_mma=None, wide_rows=None,
                       l2_prefetch=None, fused=None, gate_up_runs=None, linear_pdl=None,
                       linear_mma=None, skinny_bf16=None, skinny_pdl_rows=None) -> dict:
    """Read or set moe_experts' launch switches on the GPU extension (process-wide; each gives
    the same bits unless it says otherwise): `stream` (on by default), the streamed kernels on
    sm_90+ without the expert cache, or with one (see `stream_miss` for a cache that can miss),
    where they measured faster (weights through shared memory by the bulk copy engine,
    cyext/src/strata_moe_stream.cu); `stream_all` (off), the streamed kernels
    at every size they take (tests, benchmarks); `pdl` (on), the down kernel as a programmatic
    dependent launch (sm_90+); and for the per-block kernels: `early` (on), weight loads before
    the duplicate check at small windows; `wide` (off: measured slower), two features per
    gate/up warp where weight rows are short (FP8); `db` (on), double-buffered weight loads in
    the down kernel; `xsmem` (on), the window's x rows staged in shared memory by each gate/up
    block. Also `linear_stream` (on): linear_fp8 on the streamed tensor-core kernel where it
    takes the shapes (cyext/src/strata_linear_stream.cu; other bits than the skinny kernel),
    and `linear_pipe` (off: measured slower at 1-4 rows): that kernel in its piped form
    (k-range weight pieces on their own barriers, x copied by the consumer warps, a
    software-pipelined block loop) rather than the unpiped first version; the same bits.
    `linear_split` (on): that kernel's split form where it takes the shapes (in >= 2048), each
    tile's k range over all the CTA's warps and the tiles through one ring in order, so the
    arithmetic runs while later tiles land; other bits than the unsplit forms (the split-k sum
    in another order), a row still the same bits in any launch; `linear_split_depth` (0: as
    many as fit), its cap on tile slots in flight per CTA, 0-15 (the same bits at any depth);
    `linear_split_pair` (on), its warps taking two tiles per step (the same bits);
    `linear_f16` (off), the split form on f16 operands (weights decoded in one instruction per
    pair, x scaled per row by a power of two into f16: the bf16 operands' sums where every
    element of a row lies within 2^28 of the row's largest).
    `stream_miss` (on): an expert cache that can miss runs the streamed kernels too, their bulk
    copies reading missing experts from the pinned host store (same bits; off, the per-block
    kernels read them through mapped host memory). `gate_up_pdl` (off): the streamed gate/up
    kernel as a programmatic dependent launch of the kernel before it (the router), so that its
    launch overlaps the router's tail; the same bits. `gate_up_mma` (on): the streamed gate/up
    kernel on tensor cores for FP8 weights in 128-k blocks (weights decoded to f16, x scaled per
    row by a power of two into f16, the sums in MMAs), for every FP8 window of up to 32 rows:
    other bits than the CUDA-core kernels (the per-block ones, which an expert cache with
    `stream_miss` off runs, and the C++ twin), a row's result still the same bits in any launch.
    `down_split` (on): from 3 rows the streamed down kernel takes an expert's members in runs
    of at most 2, each run an item with its own copy of the expert's rows,
    so that an expert of many members (the folded shared expert) is not one warp's chain; the
    same bits. `down_split_runs` (0: that rule), 1-15 members per run instead (the same bits).
    `fp8_launch16` (on; this module's, not the extension's): gpu_moe_experts launches FP8 weights
    without the expert cache 16 rows at a time (off: 32), rows being independent; the same bits.
    `fp8_wide` (on): such weights launch up to 64 rows at a time where the extension takes them
    wide (moe_wide_takes: sm_90+, the tensor-core gate/up), x staged in global memory by a small
    kernel so that the ring keeps the whole shared memory: a 64-token prompt chunk reads its
    distinct experts once instead of in four 16-row launches; windows of up to 16 rows are
    unchanged. The same bits.
    `down_mma` (on): a prompt chunk's rows (gpu_moe_experts(prompt=True)) run the streamed
    down kernel on tensor cores: each expert's down rows decode to f16 once per 16 members
    instead of once per member, each member's act is scaled by a power of two per 64-k chunk
    into f16, the sums run in MMAs. Other bits than the CUDA-core down kernel, which decode
    windows keep (act rounds to f16: relative 2^-12). Chosen by the rows' kind, not their
    count, so a row's result depends neither on the other rows of its launch nor on how many
    there are (engine.prefill_slots puts several slots' chunks in one launch).
    `fused` (off): a decode window of up to 16 rows (FP8, the tensor-core gate/up) runs its
    gate/up and down kernels as one grid (moe_fused_mma): each CTA's producer streams its down
    rows as soon as its gate/up copies are out, and a down item waits only for its own expert's
    act (a counter per expert, gpu_moe_experts' per-layer `sync`), not for the whole gate/up
    grid; the same bits. Off: on an H100 it ran 1-22% slower than the two grids at 1-16 rows
    (docs/KERNELS.md).
    `gate_up_runs` (on): a wide launch's tensor-core gate/up (moe_gate_up_runs) takes items
    of (member run of at most 16, tile of 4 features), each CTA a contiguous range of them, so
    that its consecutive items are tiles of one run and the run's x rows are staged once in
    shared memory, instead of items of (expert, tile) dealt round-robin whose MMA passes read
    their members' x rows from L2 (at 512 rows four times the weight bytes); the folded shared
    expert's members are many runs, so no item is a long chain; in a big launch (more than
    1,632 pairs) the tensor-core down kernel likewise (moe_down_runs: the run's act in shared
    memory as f16 chunks instead of each of its H / 16 CTAs reading every member's float32 act
    from L2; its results in the workspace, summed by a small combine kernel). The same bits.
    `route_chunks` (off; this module's): gpu_moe_route runs more than ROUTE_MAX_ROWS rows (prompt
    chunks) on the router kernel, ROUTE_MAX_ROWS rows a launch (rows are independent), instead
    of the reference, whose top-k is one stable sort (19 us of a 64-token chunk's layer on an
    H200; the kernel measured level with it). Other bits than the reference (the kernel's
    logits may differ in their last bf16 bit): a prompt chunk then routes as the windows do.
    `wide_rows` (512; this module's): rows of a wide launch, 17 to MOE_WIDE_MAX_ROWS (512),
    where the extension takes that many (else 64): a prompt chunk of several slots' chunks
    (engine.prefill_slots) reads each distinct expert once per launch, so larger launches read
    fewer expert bytes (the simulator's experts.prefill_launch_rows); the same bits. Launches
    of more than 1,632 pairs (above 128 rows at top-11) keep the down kernel's results in the
    workspace (H floats a pair) rather than in shared memory.
    `l2_prefetch` (0, off; this module's): the model prefetches into L2 the weights its next
    kernels read in a decode window (ops.l2_prefetch, cyext/src/strata_prefetch.cu): from 1,
    a layer's mixer output projection and router once its input projection has run (through
    the conv and gated delta rule, or the K/V write and attention); from 2, also the routed
    experts' down weights once the router has chosen them (through the gate/up kernel); 3,
    their gate/up weights too. Read when a region is compiled, so set it before the engine's
    warm-up; the same bits.
    `linear_pdl` (on): the skinny linear kernel (bf16 weights, and FP8 ones the streamed kernel
    does not take) as a programmatic dependent launch (sm_90+): its first weight chunks load
    while the kernel before it ends; the same bits.
    `linear_mma` (on): the skinny linear's bf16 weights of in_features a multiple of 32 up to
    1024, at most 16 rows, on tensor cores (linear_bf16_mma, sm_90+: every weight byte loaded
    before the kernel's wait) rather than CUDA cores; other bits, a row the same bits in any
    launch either way.
    `skinny_bf16` (on; this module's): the model's bf16 linears in decode windows whose weight
    is small (SKINNY_BF16_MAX_IN inputs, SKINNY_BF16_MAX_ELEMENTS elements: the embedded model's,
    not the 80B's) run on the skinny linear, up to SKINNY_BF16_MAX_ROWS rows, instead of cuBLAS
    (ops.linear_skinny): a launch-bound window's GEMMs then load their weights during the
    kernel before (as programmatic dependents up to `skinny_pdl_rows` rows). Other
    bits than cuBLAS (fp32 sums in a fixed order; a row the same bits in any launch). Read
    when a region is compiled, so set it before the engine's warm-up.
    `skinny_pdl_rows` (SKINNY_BF16_PDL_MAX_ROWS, 4; the extension's linear_pdl_rows): the
    skinny linear's bf16 launches of up to this many rows run as programmatic dependents (with
    `linear_pdl` on), more rows as plain launches; 0 to SKINNY_BF16_MAX_ROWS. Read at launch
    (or capture), so set it before the engine's warm-up; the same bits.
    None leaves a switch as it is. Returns the switches now in force."""
    if wide_rows is not None and not (isinstance(wide_rows, int) and not isinstance(wide_rows, bool)
                                      and 17 <= wide_rows <= MOE_WIDE_MAX_ROWS):
        raise ValueError(f"wide_rows: {wide_rows!r} is not a row count in 17..{MOE_WIDE_MAX_ROWS}")
    if skinny_pdl_rows is not None and not (
            isinstance(skinny_pdl_rows, int) and not isinstance(skinny_pdl_rows, bool)
            and 0 <= skinny_pdl_rows <= SKINNY_BF16_MAX_ROWS):
        raise ValueError(f"skinny_pdl_rows: {skinny_pdl_rows!r} is not a row count in "
                         f"0..{SKINNY_BF16_MAX_ROWS}")
    flags = _gpu.moe_set_options(-1)
    for bit, on in ((1, pdl), (2, early), (4, wide), (8, db), (16, xsmem), (32, stream),
                    (64, stream_all), (128, linear_stream), (256, linear_pipe),
                    (1024, stream_miss), (4096, gate_up_pdl), (8192, linear_split),
                    (16384, linear_split_pair), (32768, linear_f16), (1 << 20, gate_up_mma),
                    (1 << 21, down_split), (1 << 26, fp8_wide), (1 << 27, down_mma),
                    (1 << 28, fused), (1 << 29, gate_up_runs), (512, linear_pdl),
                    (2048, linear_mma)):
        if on is not None:
            flags = (flags | bit) if on else (flags & ~bit)
    flags = _count_field(flags, "linear_split_depth", linear_split_depth, 16)
    flags = _count_field(flags, "down_split_runs", down_split_runs, 22)
    _gpu.moe_set_options(flags)
    global _moe_fp8_launch_rows
    if fp8_launch16 is not None:
        _moe_fp8_launch_rows = 16 if fp8_launch16 else MOE_MAX_ROWS
    if fp8_wide is not None:
        _moe_fp8_launch_rows = MOE_WIDE_ROWS if fp8_wide else 16
    global _route_chunks, _moe_wide_rows, _l2_prefetch, _skinny_bf16
    if skinny_bf16 is not None:
        _skinny_bf16 = bool(skinny_bf16)
    if skinny_pdl_rows is not None:
        _gpu.linear_pdl_rows(skinny_pdl_rows)
    if l2_prefetch is not None:
        if not (isinstance(l2_prefetch, int) and 0 <= int(l2_prefetch) <= L2_PREFETCH_MAX):
            raise ValueError(f"l2_prefetch: {l2_prefetch!r} is not a level in "
                             f"0..{L2_PREFETCH_MAX}")
        if l2_prefetch and not hasattr(_gpu, "l2_prefetch"):
            raise ValueError("l2_prefetch: this build of the GPU extension has no L2 prefetch "
                             "kernel (cyext/src/strata_prefetch.cu); rebuild it")
        _l2_prefetch = int(l2_prefetch)
    if route_chunks is not None:
        _route_chunks = bool(route_chunks)
    if wide_rows is not None:
        _moe_wide_rows = wide_rows
    return {"pdl": bool(flags & 1), "early": bool(flags & 2), "wide": bool(flags & 4),
            "db": bool(flags & 8), "xsmem": bool(flags & 16), "stream": bool(flags & 32),
            "stream_all": bool(flags & 64), "linear_stream": bool(flags & 128),
            "linear_pipe": bool(flags & 256), "stream_miss": bool(flags & 1024),
            "gate_up_pdl": bool(flags & 4096), "linear_split": bool(flags & 8192),
            "linear_split_depth": (flags >> 16) & 15,
            "linear_split_pair": bool(flags & 16384), "linear_f16": bool(flags & 32768),
            "gate_up_mma": bool(flags & (1 << 20)), "down_split": bool(flags & (1 << 21)),
            "down_split_runs": (flags >> 22) & 15,
            "fp8_launch16": _moe_fp8_launch_rows == 16,
            "fp8_wide": bool(flags & (1 << 26)) and _moe_fp8_launch_rows == MOE_WIDE_ROWS,
            "route_chunks": _route_chunks, "down_mma": bool(flags & (1 << 27)),
            "wide_rows": _moe_wide_rows, "l2_prefetch": _l2_prefetch,
            "fused": bool(flags & (1 << 28)), "gate_up_runs": bool(flags & (1 << 29)),
            "linear_pdl": bool(flags & 512), "linear_mma": bool(flags & 2048),
            "skinny_bf16": _skinny_bf16, "skinny_pdl_rows": _gpu.linear_pdl_rows(-1)}


def conv_launch_options(serial=None, gdn_pdl=None) -> dict:
    """Read or set causal_conv_window's launch switches on the GPU extension (process-wide; all
    settings give the same bits): `serial` (off), the earlier kernel where one thread per channel
    walks the group's rows, instead of one thread per (channel, row); `gdn_pdl` (on), the
    prepared delta rule (gated_delta_window_prep) as a programmatic dependent launch of the conv
    before it (sm_90+): its blocks start while the conv finishes and wait for it before their
    first read. None leaves a switch as it is. Returns the switches now in force."""
    flags = _gpu.conv_set_options(-1)
    if serial is not None:
        flags = (flags | 1) if serial else (flags & ~1)
    if gdn_pdl is not None:
        flags = (flags | 2) if gdn_pdl else (flags & ~2)
    _gpu.conv_set_options(flags)
    return {"serial": bool(flags & 1), "gdn_pdl": bool(flags & 2)}


def _zeros_per_weight(registry: dict, weight: torch.Tensor, numel: int) -> torch.Tensor:
    """A persistent int32 buffer of `numel` zeros for one weight (a layer), on its device: the
    counters a kernel leaves zero after each launch (the router's ticket, the fused experts'
    counters)."""
    key = (weight.device.index or 0, weight.data_ptr())
    t = registry.get(key)
    if t is None:
        t = registry[key] = torch.zeros(numel, dtype=torch.int32, device=weight.device)
    return t


#: One int32 sync buffer per routed-expert stack (a MoE layer), zero between launches: the
#: fused kernel's ticket and per-expert counters (moe_launch_options(fused=)), which each launch
#: leaves zero.
_MOE_SYNC: dict[tuple[int, int], torch.Tensor] = {}


def _moe_sync(w_gate_up: torch.Tensor) -> "torch.Tensor | None":
    if not hasattr(_gpu, "moe_sync_ints"):
        return None
    return _zeros_per_weight(_MOE_SYNC, w_gate_up, _gpu.moe_sync_ints())


def moe_workspace_numel(rows: int, k: int, inter: int, hidden: int = 0) -> int:
    """float32 scratch elements gpu_moe_experts needs for up to `rows` rows per launch (at most
    32, or MOE_WIDE_MAX_ROWS for a wide launch, whose staged x needs `hidden`)."""
    return _gpu.moe_workspace_numel(min(int(rows), MOE_WIDE_MAX_ROWS if hidden else MOE_MAX_ROWS),
                                    int(k), int(inter), int(hidden))


def _validate_ids(op: str, ids: torch.Tensor, num_experts: int) -> None:
    if not _checks_enabled() or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"{op}: topk_ids values must be in [0, {num_experts}), got "
                         f"{ids.tolist()}")


def gpu_moe_experts(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale=None,
                    down_scale=None, block=None, slot_of=None, host_gate_up=None, host_down=None,
                    host_gu_scale=None, host_down_scale=None, routed_counts=None,
                    window_state=None, count_layer=None, *, out=None, workspace=None,
                    prompt=False):
    """Routed experts on the GPU, grouped by expert on the device: each distinct expert's
    gate/up and down weights are read once for all of its rows (two kernels per launch of up to
    32 rows; FP8 wide_rows (512; moe_launch_options) where the launch runs wide, else 16;
    fixed grids, no host sync: capturable). Rows are independent: a row's
    result is bit-identical whatever rows share the call, and however many. `prompt`: the rows
    are a prompt chunk's (else a decode window's); FP8 prompt rows take the down kernel on
    tensor cores (moe_launch_options(down_mma=)), with other bits than a window's, so that a
    row's bits follow its kind, never the launch's size. Shapes the kernel does not take
    (moe_kernel_supported) run the reference. workspace: optional float32 scratch of
    moe_workspace_numel(N, k, I).
    With the expert cache (slot_of and the host store, reference.moe_experts), missing
    experts are read from pinned host memory inside the kernel: still capturable; with its
    counting tensors (routed_counts, window_state, count_layer) the gate/up kernel also counts."""
    cache = _cache_kwargs(slot_of, host_gate_up, host_down, host_gu_scale, host_down_scale,
                          routed_counts, window_state, count_layer)
    if _compiling() and out is None and workspace is None:
        return _moe_op(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale, down_scale, block,
                       slot_of, host_gate_up, host_down, host_gu_scale, host_down_scale,
                       routed_counts, window_state, count_layer, prompt)
    k = topk_ids.shape[-1]
    if not moe_kernel_supported(x, w_gate_up, k, block):
        res = reference.moe_experts(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale,
                                    down_scale, block, **cache)
        if out is not None:
            out.copy_(res)
            return out
        return res
    bo, bi = _block_args("moe_experts", w_gate_up, gu_scale, block)
    x, topk_weight, topk_ids = _moe_inputs(x, topk_weight, topk_ids)
    x = _aligned(x)
    _validate_ids("moe_experts", topk_ids, slot_of.shape[0] if cache else w_gate_up.shape[0])
    n = x.shape[0]
    inter = w_gate_up.shape[1] // 2
    if out is None:
        out = torch.empty_like(x)
    step = _moe_fp8_launch_rows if gu_scale is not None and not cache else MOE_MAX_ROWS
    if step == MOE_WIDE_ROWS:  # wide: wide_rows rows a launch where taken, else 64, else 16
        step = 16  # windows of up to 16 rows, or shapes or x the wide launch does not take
        if n > 16 and x.dtype == torch.bfloat16:
            for rows in dict.fromkeys((_moe_wide_rows, MOE_WIDE_ROWS)):
                if _gpu.moe_wide_takes(min(n, rows), k, w_gate_up.shape[0], x.shape[-1], inter,
                                       bo, bi, x.device.index):
                    step = rows
                    break
    need = _gpu.moe_workspace_numel(min(n, step), k, inter, x.shape[-1])
    if workspace is None or workspace.numel() < need or workspace.data_ptr() % 16:
        workspace = torch.empty(need, dtype=torch.float32, device=x.device)
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    if gu_scale is not None:
        gu_scale, down_scale = gu_scale.float().contiguous(), down_scale.float().contiguous()
    stream = _stream(x)
    sync = None if cache or prompt else _moe_sync(w_gate_up)
    for r0 in range(0, n, step):  # rows are independent: launches of fewer change no result
        r1 = min(n, r0 + step)
        o = out if (r0 == 0 and r1 == n) else out[r0:r1]
        _gpu.moe_experts(x[r0:r1], w_gate_up, w_down, topk_weight[r0:r1], topk_ids[r0:r1],
                         gu_scale, down_scale, bo, bi, o, workspace, stream, **cache,
                         prompt=prompt, sync=sync)
    return out


def gpu_linear_fp8(x, weight, scale_inv, block, *, out=None):
    """y = x @ dequant(weight)^T, fp32 accumulation, each row independent of the others (x's
    leading dims flattened). Where the streamed kernel takes the shapes (sm_90+, bf16 x,
    in_features a power of two in 1024..8192: cyext/src/strata_linear_stream.cu), every row
    count runs on it (tensor cores, 16 rows per launch), so decode windows and prompt chunks
    give a row the same bits. Else up to 32 rows the skinny kernel (FP8 decoded in registers,
    each weight byte read once for all rows); more rows, in_features not a multiple of 16, or
    scale blocks whose columns are not a multiple of 16: the reference (dequantise to float32
    and matmul)."""
    if _compiling() and out is None:
        return torch.ops.strata.linear_fp8(x, weight, scale_inv, [int(b) for b in block])
    bo, bi = _block_args("linear_fp8", weight, scale_inv, block)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    # (the kernel reads W and writes y by 16-byte copies and words: both aligned, else the
    # skinny kernel, whose bits differ, would take the call)
    streamed = weight.data_ptr() % 16 == 0 and _gpu.linear_stream_takes(x2, weight, bo, bi)
    if not streamed and (x2.shape[0] > LINEAR_SKINNY_MAX_ROWS or x.shape[-1] % 16 or bi % 16):
        res = reference.linear_fp8(x, weight, scale_inv, block)
        if out is not None:
            out.copy_(res)
            return out
        return res
    x2 = _aligned(x2.contiguous())
    into = out is not None and not (streamed and out.data_ptr() % 16)
    y = out.view(x2.shape[0], weight.shape[0]) if into else \
        torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _gpu.linear_skinny(x2, weight.contiguous(), scale_inv.float().contiguous(), bo, bi, y,
                       _stream(x))
    if out is not None and not into:
        out.view(x2.shape[0], weight.shape[0]).copy_(y)
        return out
    return y.view(*lead, weight.shape[0])


def _cuda_sm90(device: torch.device) -> bool:
    """A CUDA (not HIP) GPU of sm_90+: where the tensor-core linears run (the streamed FP8
    linear, the skinny linear's bf16 form, whose CUDA-core form ran at half cuBLAS's speed in a
    window)."""
    return (device.type == "cuda" and not getattr(torch.version, "hip", None)
            and _capability(device.index if device.index is not None
                            else torch.cuda.current_device()) >= (9, 0))


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def linear_fp8_streams(device) -> bool:
    """Whether linear_fp8 runs on the streamed FP8 tensor-core kernel on `device` (a CUDA GPU of
    sm_90+ with the GPU extension built and the switch on): model.fp8_dense=auto keeps the
    dense layers FP8 there."""
    device = torch.device(device)
    if _gpu is None or not torch.cuda.is_available() or not _cuda_sm90(device):
        return False
    return moe_launch_options()["linear_stream"]


_skinny_bf16 = True  # moe_launch_options(skinny_bf16=)
#: What the model runs on the skinny kernel under moe_launch_options(skinny_bf16=): up to this
#: many rows (decode windows), weights of at most this many inputs (a row's chunks load in one
#: group before the kernel's wait) and elements (where cuBLAS is launch-bound, not byte-bound).
SKINNY_BF16_MAX_ROWS = 16
SKINNY_BF16_MAX_IN = 1024
SKINNY_BF16_MAX_ELEMENTS = 1 << 22
#: The skinny linear's bf16 launches run as programmatic dependents (linear_pdl) only up to this
#: many rows by default: the extension's own limit (strata_gpu_linear_pdl_rows, which says why),
#: moe_launch_options(skinny_pdl_rows=) moves it.
SKINNY_BF16_PDL_MAX_ROWS = 4


def skinny_bf16_takes(x, weight) -> bool:
    """Whether the model runs x @ weight^T as linear_skinny: moe_launch_options(skinny_bf16=)
    on, bf16 x and weight (a 2-D parameter), in_features a multiple of 32 (the kernel's
    tensor-core form) up to SKINNY_BF16_MAX_IN, a small weight. Read without touching the
    extension or the device (a region's trace calls it); gpu_linear_skinny runs F.linear where
    the GPU is not a CUDA one of sm_90+."""
    return (_skinny_bf16 and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
            and weight.shape[1] % 32 == 0 and weight.shape[1] <= SKINNY_BF16_MAX_IN
            and weight.numel() <= SKINNY_BF16_MAX_ELEMENTS)


def gpu_linear_skinny(x, weight, *, out=None):
    """reference.linear_skinny (x @ weight^T) for a bfloat16 weight: up to SKINNY_BF16_MAX_ROWS
    rows (x's leading dims flattened) on the skinny linear (on tensor cores where
    moe_launch_options' linear_mma takes the shapes, else CUDA cores; fp32 sums in a fixed
    order, each row independent of the others; a programmatic dependent launch under
    linear_pdl up to moe_launch_options' skinny_pdl_rows rows, so `weight` must be one the
    kernels just before it do not write), more rows F.linear."""
    if _compiling() and out is None:
        return torch.ops.strata.linear_skinny(x, weight)
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    if (rows > SKINNY_BF16_MAX_ROWS or x.dtype != torch.bfloat16
            or weight.dtype != torch.bfloat16 or x.shape[-1] % 16 or weight.data_ptr() % 16
            or not _cuda_sm90(x.device)):
        res = reference.linear_skinny(x, weight)
        return out.copy_(res) if out is not None else res
    return gpu_linear_bf16_skinny(x, weight, out=out)


def gpu_linear_bf16_skinny(x, weight, *, out=None):
    """The skinny linear on a bfloat16 W at up to 32 rows, whatever the shapes: gpu_linear_skinny's
    kernel call, and the micro-benchmark against F.linear. `out` may be of any layout (the
    kernel writes contiguous 16-byte aligned rows, else a copy of them)."""
    lead = x.shape[:-1]
    x2 = _aligned(x.reshape(-1, x.shape[-1]).contiguous())
    into = out is not None and out.is_contiguous() and out.data_ptr() % 16 == 0
    y = out.view(x2.shape[0], weight.shape[0]) if into else \
        torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _gpu.linear_skinny(x2, weight.contiguous(), None, 1, 1, y, _stream(x))
    if out is not None and not into:
        return out.copy_(y.view(*lead, weight.shape[0]))
    return y.view(*lead, weight.shape[0])


#: One int32 ticket per router weight (a MoE layer), zero between launches: the router kernel's
#: last CTA finds itself by it (cyext/src/strata_router.cu).
_ROUTE_TICKETS: dict[tuple[int, int], torch.Tensor] = {}
#: Rows the router kernel takes per launch; more rows (prompt chunks) run the reference, or with
#: moe_launch_options(route_chunks=) the kernel in launches of this many.
ROUTE_MAX_ROWS = 32
_route_chunks = False


def route_kernel_supported(x, w_router, num_experts: int, top_k: int) -> bool:
    """True when gpu_moe_route runs on the router kernel: bf16 x (1..32 rows) and w_router, H a
    multiple of 8 up to 4096, 1 <= top_k <= 32, top_k <= num_experts <= 1024."""
    h = x.shape[-1]
    return (x.dtype == torch.bfloat16 and w_router.dtype == torch.bfloat16 and h % 8 == 0
            and 8 <= h <= 4096 and 1 <= x.numel() // h <= ROUTE_MAX_ROWS
            and 1 <= top_k <= min(32, num_experts) and num_experts <= 1024
            and w_router.shape[-1] == h)


def _route_ticket(w_router: torch.Tensor) -> torch.Tensor:
    return _zeros_per_weight(_ROUTE_TICKETS, w_router, 1)


def gpu_moe_route(x, w_router, num_experts, top_k, norm_topk, routing_bias=None, shared_id=-1):
    """The MoE router (reference.moe_route) in one launch for decode windows (up to 32 rows):
    the router matmul, softmax, top-k, renormalisation and the folded shared expert's column,
    each row independent of the others. Other shapes (and prompt chunks) run the reference."""
    if _compiling():
        return torch.ops.strata.moe_route(x, w_router, int(num_experts), int(top_k),
                                          bool(norm_topk), routing_bias, int(shared_id))
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    first = x.reshape(-1, x.shape[-1])[:ROUTE_MAX_ROWS] if _route_chunks else x
    if not route_kernel_supported(first, w_router, int(num_experts), int(top_k)):
        # eager here (an opaque op under compile): the top-k by one sort, not 4k small kernels
        return reference.moe_route(x, w_router, num_experts, top_k, norm_topk, routing_bias,
                                   shared_id, topk=reference.topk_by_sort)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    w = _aligned(w_router.contiguous())
    cols = int(top_k) + (1 if shared_id >= 0 else 0)
    weights = torch.empty(rows, cols, dtype=torch.float32, device=x.device)
    ids = torch.empty(rows, cols, dtype=torch.int64, device=x.device)
    step = min(rows, ROUTE_MAX_ROWS)
    logits = torch.empty(step * (int(num_experts) + 1), dtype=torch.float32, device=x.device)
    bias = None if routing_bias is None else routing_bias.float().contiguous()
    for r0 in range(0, rows, step):  # one launch at a time: they share the ticket
        r1 = min(rows, r0 + step)
        _gpu.moe_route(_aligned(x2[r0:r1]), w, int(num_experts), int(top_k), bool(norm_topk),
                       bias, int(shared_id), logits, weights[r0:r1], ids[r0:r1],
                       _route_ticket(w_router), _stream(x))
    return weights, ids


_l2_prefetch = 0  # moe_launch_options(l2_prefetch=)
#: the levels of moe_launch_options(l2_prefetch=): 1 dense weights, 2 + experts' down, 3 + gate/up
L2_PREFETCH_MAX = 3


def l2_prefetch_level() -> int:
    """moe_launch_options(l2_prefetch=), read without touching the extension."""
    return _l2_prefetch


def gpu_l2_prefetch(token, tensors, ids=None):
    """reference.l2_prefetch on the GPU: one launch that prefetches into L2 the bytes of up to
    4 tensors, or with ids (int64, any shape) their rows t[ids], ids out of range skipped
    (strata_prefetch.cu; nothing before sm_90). Writes nothing, token included."""
    if _compiling():
        torch.ops.strata.l2_prefetch(token, list(tensors), ids)
        return None
    def takes(t):  # the kernel takes 16-byte aligned ranges and rows: a hint skips the rest
        unit = t.numel() if ids is None else t.numel() // t.shape[0]
        return (t.numel() and t.is_contiguous() and t.data_ptr() % 16 == 0
                and unit * t.element_size() % 16 == 0)

    tensors = [t for t in tensors if takes(t)]
    if not tensors or not hasattr(_gpu, "l2_prefetch"):
        return None
    if ids is not None:
        ids = ids.contiguous()
    _gpu.l2_prefetch(tensors, ids, _stream(tensors[0]))
    return None


GPU_OPS = {
    "write_kv": gpu_write_kv,
    "grouped_window_attention": gpu_grouped_window_attention,
    "causal_conv_window": gpu_causal_conv_window,
    "causal_conv_window_qkvz": gpu_causal_conv_window_qkvz,
    "causal_conv_window_qkvz_ba": gpu_causal_conv_window_qkvz_ba,
    "gated_delta_window": gpu_gated_delta_window,
    "gated_delta_window_prep": gpu_gated_delta_window_prep,
    "commit_accepted": gpu_commit_accepted,
    "chunk_gated_delta": gpu_chunk_gated_delta,
    "moe_experts": gpu_moe_experts,
    "linear_fp8": gpu_linear_fp8,
    "linear_skinny": gpu_linear_skinny,
    "moe_route": gpu_moe_route,
    "l2_prefetch": gpu_l2_prefetch,
}


# ---------------------------------------------------------------------------------------------
# torch.library custom ops: what torch.compile sees in place of the Cython calls (one opaque
# node per op, with fake implementations for shape propagation). Eager calls never go through
# them (the dispatcher costs microseconds); the op bodies call the eager wrappers above, on the
# CPU or GPU kernels by the tensors' device.


Tensor = torch.Tensor  # module level: the custom-op schemas are inferred from the annotations


def _eager(name: str, device: torch.device):
    table = GPU_OPS if device.type == "cuda" else CPU_OPS
    return table[name] if name in table else getattr(reference, name)


def _register_custom_ops() -> None:
    if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
        return
    if hasattr(torch.ops, "strata") and hasattr(torch.ops.strata, "grouped_window_attention"):
        return  # registered already (module reloaded)
    @torch.library.custom_op("strata::write_kv", mutates_args=("k_cache", "v_cache"))
    def _write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, group_slot: Tensor,
                  group_pos: Tensor) -> None:
        _eager("write_kv", k.device)(k_cache, v_cache, k, v, group_slot, group_pos)

    @torch.library.custom_op("strata::grouped_window_attention", mutates_args=())
    def _gwa(q: Tensor, k_cache: Tensor, v_cache: Tensor, group_slot: Tensor, group_pos: Tensor,
             ctx: int, scale: float, split_keys: int) -> Tensor:
        return _eager("grouped_window_attention", q.device)(q, k_cache, v_cache, group_slot,
                                                             group_pos, ctx, scale,
                                                             split_keys=split_keys)

    @_gwa.register_fake
    def _(q, k_cache, v_cache, group_slot, group_pos, ctx, scale, split_keys):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.custom_op("strata::causal_conv_window", mutates_args=())
    def _conv(x: Tensor, conv_state: Tensor, weight: Tensor,
              group_slot: Tensor) -> tuple[Tensor, Tensor]:
        return _eager("causal_conv_window", x.device)(x, conv_state, weight, group_slot)

    @_conv.register_fake
    def _(x, conv_state, weight, group_slot):
        ng, g, c = x.shape
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                x.new_empty(ng, g, c, weight.shape[1] - 1))

    @torch.library.custom_op("strata::causal_conv_window_qkvz", mutates_args=())
    def _conv_qkvz(x: Tensor, conv_state: Tensor, weight: Tensor, group_slot: Tensor, nk: int,
                   dk: int, vpk: int) -> tuple[Tensor, Tensor]:
        return _eager("causal_conv_window_qkvz", x.device)(x, conv_state, weight, group_slot, nk,
                                                           dk, vpk)

    @_conv_qkvz.register_fake
    def _(x, conv_state, weight, group_slot, nk, dk, vpk):
        ng, g = x.shape[:2]
        c, kw = weight.shape
        return x.new_empty(ng, g, c), x.new_empty(ng, g, c, kw - 1)

    @torch.library.custom_op("strata::causal_conv_window_qkvz_ba", mutates_args=())
    def _conv_qkvz_ba(x: Tensor, conv_state: Tensor, weight: Tensor, group_slot: Tensor, nk: int,
                      dk: int, vpk: int, x_normed: Tensor,
                      w_ba: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return _eager("causal_conv_window_qkvz_ba", x.device)(x, conv_state, weight, group_slot,
                                                              nk, dk, vpk, x_normed, w_ba)

    @_conv_qkvz_ba.register_fake
    def _(x, conv_state, weight, group_slot, nk, dk, vpk, x_normed, w_ba):
        ng, g = x.shape[:2]
        c, kw = weight.shape
        return (x.new_empty(ng, g, c), x.new_empty(ng, g, c, kw - 1),
                x.new_empty(ng, g, w_ba.shape[0]))

    @torch.library.custom_op("strata::gated_delta_window", mutates_args=())
    def _gdn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, rec_state: Tensor,
             group_slot: Tensor) -> tuple[Tensor, Tensor]:
        return _eager("gated_delta_window", q.device)(q, k, v, g, beta, rec_state, group_slot)

    @_gdn.register_fake
    def _(q, k, v, g, beta, rec_state, group_slot):
        ng, rows, h, dk = k.shape
        dv = v.shape[-1]
        return (q.new_empty(ng, rows, h, dv, dtype=torch.float32),
                q.new_empty(ng, rows, h, dk, dv, dtype=torch.float32))

    @torch.library.custom_op("strata::gated_delta_window_into", mutates_args=("snaps",))
    def _gdn_into(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, rec_state: Tensor,
                  group_slot: Tensor, snaps: Tensor) -> Tensor:
        return _eager("gated_delta_window", q.device)(q, k, v, g, beta, rec_state, group_slot,
                                                       snaps=snaps)[0]

    # The rule's `out` where its per-row output (snapshots or factors) goes into the caller's
    # buffer: one fake for the ops below that take one.
    def _gdn_out_fake(q, k, v, g, beta, rec_state, group_slot, per_row):
        ng, rows, h, _ = k.shape
        return q.new_empty(ng, rows, h, v.shape[-1], dtype=torch.float32)

    _gdn_into.register_fake(_gdn_out_fake)

    @torch.library.custom_op("strata::gated_delta_window_factors_into", mutates_args=("factors",))
    def _gdn_factors_into(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          rec_state: Tensor, group_slot: Tensor, factors: Tensor) -> Tensor:
        return _eager("gated_delta_window", q.device)(q, k, v, g, beta, rec_state, group_slot,
                                                       factors=factors)[0]

    _gdn_factors_into.register_fake(_gdn_out_fake)

    # The reference's factor form (reference.gated_delta_window) in a compiled region: eager,
    # so that its state update rounds as the commit's eager replay does.
    @torch.library.custom_op("strata::reference_gated_delta_window_factors",
                             mutates_args=("factors",))
    def _gdn_factors_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         rec_state: Tensor, group_slot: Tensor, factors: Tensor) -> Tensor:
        return reference.gated_delta_window(q, k, v, g, beta, rec_state, group_slot,
                                            factors=factors)[0]

    _gdn_factors_ref.register_fake(_gdn_out_fake)

    @torch.library.custom_op("strata::gated_delta_window_prep", mutates_args=())
    def _gdn_prep(x: Tensor, ba: Tensor, neg_a: Tensor, dt_bias: Tensor, rec_state: Tensor,
                  group_slot: Tensor, nk: int, dk: int, q_scale: float,
                  eps: float) -> tuple[Tensor, Tensor]:
        return _eager("gated_delta_window_prep", x.device)(x, ba, neg_a, dt_bias, rec_state,
                                                           group_slot, nk, dk, q_scale, eps)

    @_gdn_prep.register_fake
    def _(x, ba, neg_a, dt_bias, rec_state, group_slot, nk, dk, q_scale, eps):
        ng, rows, _ = x.shape
        h, dv = neg_a.shape[0], rec_state.shape[-1]
        return (x.new_empty(ng, rows, h, dv, dtype=torch.float32),
                x.new_empty(ng, rows, h, dk, dv, dtype=torch.float32))

    @torch.library.custom_op("strata::gated_delta_window_prep_into", mutates_args=("snaps",))
    def _gdn_prep_into(x: Tensor, ba: Tensor, neg_a: Tensor, dt_bias: Tensor, rec_state: Tensor,
                       group_slot: Tensor, nk: int, dk: int, q_scale: float, eps: float,
                       snaps: Tensor) -> Tensor:
        return _eager("gated_delta_window_prep", x.device)(
            x, ba, neg_a, dt_bias, rec_state, group_slot, nk, dk, q_scale, eps, snaps=snaps)[0]

    # The prepared rule's `out` where its per-row output goes into the caller's buffer.
    def _gdn_prep_out_fake(x, ba, neg_a, dt_bias, rec_state, group_slot, nk, dk, q_scale, eps,
                           per_row):
        ng, rows, _ = x.shape
        return x.new_empty(ng, rows, neg_a.shape[0], rec_state.shape[-1], dtype=torch.float32)

    _gdn_prep_into.register_fake(_gdn_prep_out_fake)

    @torch.library.custom_op("strata::gated_delta_window_prep_factors_into",
                             mutates_args=("factors",))
    def _gdn_prep_factors_into(x: Tensor, ba: Tensor, neg_a: Tensor, dt_bias: Tensor,
                               rec_state: Tensor, group_slot: Tensor, nk: int, dk: int,
                               q_scale: float, eps: float, factors: Tensor) -> Tensor:
        return _eager("gated_delta_window_prep", x.device)(
            x, ba, neg_a, dt_bias, rec_state, group_slot, nk, dk, q_scale, eps,
            factors=factors)[0]

    _gdn_prep_factors_into.register_fake(_gdn_prep_out_fake)

    @torch.library.custom_op("strata::commit_accepted",
                             mutates_args=("rec_state", "conv_state", "slot_pos"))
    def _commit(accept: Tensor, group_slot: Tensor, group_pos: Tensor, rec_factors: Tensor,
                conv_snaps: Tensor, rec_state: Tensor, conv_state: Tensor,
                slot_pos: Tensor) -> None:
        _eager("commit_accepted", rec_state.device)(accept, group_slot, group_pos, rec_factors,
                                                     conv_snaps, rec_state, conv_state, slot_pos)

    @torch.library.custom_op("strata::moe_experts", mutates_args=())
    def _moe(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weight: Tensor,
             topk_ids: Tensor, gu_scale: Tensor | None, down_scale: Tensor | None,
             block: list[int] | None, slot_of: Tensor | None = None,
             host_gate_up: Tensor | None = None, host_down: Tensor | None = None,
             host_gu_scale: Tensor | None = None, host_down_scale: Tensor | None = None,
             prompt: bool = False) -> Tensor:
        return _eager("moe_experts", x.device)(x, w_gate_up, w_down, topk_weight, topk_ids,
                                                gu_scale, down_scale, block, slot_of,
                                                host_gate_up, host_down, host_gu_scale,
                                                host_down_scale, prompt=prompt)

    @_moe.register_fake
    def _(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale, down_scale, block,
          slot_of=None, host_gate_up=None, host_down=None, host_gu_scale=None,
          host_down_scale=None, prompt=False):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    # The expert cache's counting: its tensors are mutated (required, not optional, arguments).
    @torch.library.custom_op("strata::moe_experts_counted",
                             mutates_args=("routed_counts", "window_state"))
    def _moe_counted(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weight: Tensor,
                     topk_ids: Tensor, gu_scale: Tensor | None, down_scale: Tensor | None,
                     block: list[int] | None, slot_of: Tensor, host_gate_up: Tensor,
                     host_down: Tensor, host_gu_scale: Tensor | None,
                     host_down_scale: Tensor | None, routed_counts: Tensor,
                     window_state: Tensor, count_layer: Tensor, prompt: bool = False) -> Tensor:
        return _eager("moe_experts", x.device)(x, w_gate_up, w_down, topk_weight, topk_ids,
                                                gu_scale, down_scale, block, slot_of,
                                                host_gate_up, host_down, host_gu_scale,
                                                host_down_scale, routed_counts, window_state,
                                                count_layer, prompt=prompt)

    @_moe_counted.register_fake
    def _(x, w_gate_up, w_down, topk_weight, topk_ids, gu_scale, down_scale, block, slot_of,
          host_gate_up, host_down, host_gu_scale, host_down_scale, routed_counts, window_state,
          count_layer, prompt=False):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    # The router kernel's ticket (a per-layer int32, cyext_ops._route_ticket) is left as found:
    # no argument is mutated.
    @torch.library.custom_op("strata::moe_route", mutates_args=())
    def _moe_route(x: Tensor, w_router: Tensor, num_experts: int, top_k: int, norm_topk: bool,
                   routing_bias: Tensor | None, shared_id: int) -> tuple[Tensor, Tensor]:
        return _eager("moe_route", x.device)(x, w_router, num_experts, top_k, norm_topk,
                                              routing_bias, shared_id)

    @_moe_route.register_fake
    def _(x, w_router, num_experts, top_k, norm_topk, routing_bias, shared_id):
        cols = top_k + (1 if shared_id >= 0 else 0)
        m = x.numel() // x.shape[-1]
        return (x.new_empty(m, cols, dtype=torch.float32), x.new_empty(m, cols, dtype=torch.int64))

    # The chunked gated delta rule of whichever backend ops has bound (not the device's
    # extension, as the ops above): ops.chunk_rule inside a compiled region.
    @torch.library.custom_op("strata::chunk_rule", mutates_args=())
    def _chunk_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    initial_state: Tensor) -> tuple[Tensor, Tensor]:
        from strata.kernels import ops  # (ops imports this module)

        return ops.chunk_rule_eager(q, k, v, g, beta, initial_state)

    @_chunk_rule.register_fake
    def _(q, k, v, g, beta, initial_state):
        b, length, h, dk = k.shape
        dv = v.shape[-1]
        return (q.new_empty(b, length, h, dv, dtype=torch.float32),
                q.new_empty(b, h, dk, dv, dtype=torch.float32))

    # token: declared written (never written) so that a compiled region keeps the call: an op
    # with no result and no mutation is dead code to it
    @torch.library.custom_op("strata::l2_prefetch", mutates_args=("token",))
    def _l2_prefetch(token: Tensor, tensors: list[Tensor], ids: Tensor | None) -> None:
        _eager("l2_prefetch", token.device)(token, tensors, ids)

    @torch.library.custom_op("strata::linear_fp8", mutates_args=())
    def _linear_fp8(x: Tensor, weight: Tensor, scale_inv: Tensor, block: list[int]) -> Tensor:
        return _eager("linear_fp8", x.device)(x, weight, scale_inv, block)

    @_linear_fp8.register_fake
    def _(x, weight, scale_inv, block):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.custom_op("strata::linear_skinny", mutates_args=())
    def _linear_skinny(x: Tensor, weight: Tensor) -> Tensor:
        return _eager("linear_skinny", x.device)(x, weight)

    @_linear_skinny.register_fake
    def _(x, weight):
        return x.new_empty(*x.shape[:-1], weight.shape[0])


try:
    _register_custom_ops()
except Exception as exc:  # noqa: BLE001 - compile support is optional; eager calls still work
    import warnings

    warnings.warn(f"strata.kernels.cyext_ops: torch custom ops not registered ({exc}); "
                  f"torch.compile will graph-break at the cyext kernels")
