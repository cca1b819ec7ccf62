"""Torch reference implementations of the grouped-decode operations.

These define the semantics that the cyext kernels (C++ on CPU, CUDA/HIP on GPU) must match;
`strata.kernels.ops` dispatches between them. All work on the *window grid*: a window of NG
groups, each of G rows of one slot at consecutive positions (padding groups point at the
scratch slot, index S, so whatever they write lands nowhere that matters).

Layouts (S slots plus one scratch slot):
  k_cache, v_cache   (S+1, T, Hkv, D)         model dtype, one pair per full-attention layer
  conv_state         (L, S+1, C, K-1)         model dtype, L = linear-attention layers
  rec_state          (L, S+1, H, Dk, Dv)      float32
  group_slot         (NG,) int64              slot of each group
  group_pos          (NG,) int64              position of each group's first row
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             group_slot: torch.Tensor, group_pos: torch.Tensor) -> None:
    """Store the window's K/V rows (NG, G, Hkv, D) at (slot, pos + j)."""
    ng, g = k.shape[:2]
    slots = group_slot[:, None].expand(ng, g)
    pos = group_pos[:, None] + torch.arange(g, device=k.device)[None, :]
    pos = pos.clamp_(max=k_cache.shape[1] - 1)  # rows past the context are padding
    k_cache[slots, pos] = k.to(k_cache.dtype)
    v_cache[slots, pos] = v.to(v_cache.dtype)


def grouped_window_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             group_slot: torch.Tensor, group_pos: torch.Tensor, ctx: int,
                             scale: float, *, split_keys: int = 0) -> torch.Tensor:
    """Causal attention of window rows over their own slot's cache.

    `split_keys` > 0 asks the GPU kernels for split-K chunks of that many keys whatever the
    window's shape (engine.batch_invariant); one pass here, so it changes nothing.

    q: (NG, G, Hq, D). Row (g, j) sits at position p = group_pos[g] + j and attends the keys of
    slot group_slot[g] at positions 0..p (the window's own rows must already be written).
    Only the first `ctx` cache positions are read (the context tier). Returns (NG, G, Hq, D).
    """
    ng, g, hq, d = q.shape
    hkv = k_cache.shape[2]
    rep = hq // hkv
    k = k_cache[group_slot, :ctx]  # (NG, ctx, Hkv, D)
    v = v_cache[group_slot, :ctx]
    qh = q.reshape(ng, g, hkv, rep, d).permute(0, 2, 3, 1, 4).float()  # (NG, Hkv, rep, G, D)
    kh = k.permute(0, 2, 3, 1).float()  # (NG, Hkv, D, ctx)
    scores = torch.matmul(qh.reshape(ng, hkv, rep * g, d), kh).reshape(ng, hkv, rep, g, ctx) * scale
    row_pos = group_pos[:, None] + torch.arange(g, device=q.device)[None, :]  # (NG, G)
    key_pos = torch.arange(ctx, device=q.device)
    allowed = key_pos[None, None, :] <= row_pos[:, :, None]  # (NG, G, ctx)
    scores = scores.masked_fill(~allowed[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.reshape(ng, hkv, rep * g, ctx), v.permute(0, 2, 1, 3).float())
    out = out.reshape(ng, hkv, rep, g, d).permute(0, 3, 1, 2, 4).reshape(ng, g, hq, d)
    return out.to(q.dtype)


def causal_conv_window(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       group_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over each group's rows, continuing its slot's conv state.

    x: (NG, G, C); conv_state: (S+1, C, K-1) for one layer; weight: (C, K).
    Returns out (NG, G, C) and snapshots (NG, G, C, K-1): the conv state after each row.
    """
    ng, g, c = x.shape
    kw = weight.shape[1]
    prev = conv_state[group_slot].transpose(1, 2).to(x.dtype)  # (NG, K-1, C)
    ext = torch.cat([prev, x], dim=1)  # (NG, K-1+G, C)
    win = ext.unfold(1, kw, 1)  # (NG, G, C, K): window ending at each row
    out = F.silu((win.float() * weight.float()[None, None]).sum(-1)).to(x.dtype)
    snaps = win[..., 1:]  # the last K-1 inputs after each row
    return out, snaps


def qkvz_mixed(qkvz: torch.Tensor, nk: int, dk: int, vpk: int) -> torch.Tensor:
    """The conv's input [q | k | v] (..., 2 nk dk + nk vpk) from the in_proj's qkvz columns,
    per key head [q (dk) | k (dk) | v (vpk) | z (vpk)] (the checkpoint's interleaved order)."""
    lead = qkvz.shape[:-1]
    q, k, v, _ = qkvz[..., :nk * (2 * dk + 2 * vpk)].reshape(*lead, nk, 2 * dk + 2 * vpk).split(
        [dk, dk, vpk, vpk], dim=-1)
    return torch.cat([q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)], -1)


def causal_conv_window_qkvz(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                            group_slot: torch.Tensor, nk: int, dk: int, vpk: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_conv_window over qkvz_mixed(x, nk, dk, vpk): x is the in_proj's qkvz columns
    (NG, G, >= nk (2 dk + 2 vpk))."""
    return causal_conv_window(qkvz_mixed(x, nk, dk, vpk), conv_state, weight, group_slot)


def causal_conv_window_qkvz_ba(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                               group_slot: torch.Tensor, nk: int, dk: int, vpk: int,
                               x_normed: torch.Tensor, w_ba: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """causal_conv_window_qkvz and the b/a projection of the same window: x_normed (NG, G, H),
    the layer's input, times w_ba (2 nv, H)^T, in x_normed's dtype (what the layer's float
    in_proj_ba gives). Returns out, snapshots and ba (NG, G, 2 nv)."""
    out, snaps = causal_conv_window_qkvz(x, conv_state, weight, group_slot, nk, dk, vpk)
    return out, snaps, F.linear(x_normed, w_ba)


def gated_delta_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, rec_state: torch.Tensor, group_slot: torch.Tensor,
                       *, snaps: Optional[torch.Tensor] = None,
                       factors: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over each group's rows, one state snapshot per row.

    q, k: (NG, G, H, Dk), already L2-normalised (q also scaled by Dk^-0.5); v: (NG, G, H, Dv);
    g (log decay) and beta: (NG, G, H); rec_state: (S+1, H, Dk, Dv) float32 for one layer, read
    at group_slot and not modified. Returns out (NG, G, H, Dv) float32 and snapshots
    (NG, G, H, Dk, Dv) float32 (the state after each row); `snaps`: a float32 tensor of that
    shape to write them into (returned), e.g. a layer's slice of a window's stacked snapshots.

    `factors` (NG, G, H, Dk + Dv + 1) float32: instead of snapshots, each row's rank-one update
    of the state, s = s * decay; s = s + k (outer) delta, as [k | delta | decay] with exactly
    the values used (returned in the snapshots' place): commit_accepted replays rows 0..a of
    them onto the state this read, the state after row a to the bit, where a snapshot is
    Dk x Dv floats a row and head. Inside a compiled region this form runs as one opaque op
    (strata::reference_gated_delta_window_factors): inductor could round the state's update
    otherwise than the eager replay (one FMA for the two steps) and the commit would differ.
    """
    if snaps is not None and factors is not None:
        raise ValueError("gated_delta_window: snaps and factors exclude each other")
    if factors is not None and torch.compiler.is_compiling():
        return torch.ops.strata.reference_gated_delta_window_factors(
            q, k, v, g, beta, rec_state, group_slot, factors), factors
    s = rec_state[group_slot]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    dk = k.shape[-1]
    outs, states = [], []
    for j in range(q.shape[1]):
        decay = g[:, j].exp()
        s = s * decay[..., None, None]
        kv_mem = torch.einsum("nhk,nhkv->nhv", k[:, j], s)
        delta = (v[:, j] - kv_mem) * beta[:, j, :, None]
        s = s + k[:, j, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, j], s))
        if factors is None:
            states.append(s)
        else:
            factors[:, j, :, :dk] = k[:, j]
            factors[:, j, :, dk:-1] = delta
            factors[:, j, :, -1] = decay
    if factors is not None:
        return torch.stack(outs, 1), factors
    if snaps is None:
        return torch.stack(outs, 1), torch.stack(states, 1)
    snaps.copy_(torch.stack(states, 1))
    return torch.stack(outs, 1), snaps


def replay_factors(s: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """The state after one row of gated_delta_window from the state s (..., Dk, Dv) before it
    and the row's factors (..., Dk + Dv + 1) [k | delta | decay]: the window's own two torch
    ops, so the same bits."""
    dk = s.shape[-2]
    k, delta, decay = factors[..., :dk], factors[..., dk:-1], factors[..., -1]
    s = s * decay[..., None, None]
    return s + k[..., :, None] * delta[..., None, :]


def gated_delta_window_prep(x: torch.Tensor, ba: torch.Tensor, neg_a: torch.Tensor,
                            dt_bias: torch.Tensor, rec_state: torch.Tensor,
                            group_slot: torch.Tensor, nk: int, dk: int, q_scale: float,
                            eps: float, *, snaps: Optional[torch.Tensor] = None,
                            factors: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_delta_window from the layer's raw inputs, as GatedDeltaNet prepares them.

    x: the conv output (NG, G, C), channels [q (nk x Dk) | k (nk x Dk) | v (H x Dv) ...];
    ba: the in_proj's b/a columns (NG, G, >= 2H), per key head [b (rep) | a (rep)], rep =
    H / nk; neg_a = -exp(A_log) and dt_bias: float32 (H,). q and k are L2-normalised (q times
    q_scale), beta = sigmoid(b) in b's dtype, g = neg_a * softplus(a + dt_bias) in float32; then
    gated_delta_window (its out and snapshots; `snaps` and `factors` as there: the factors' k is
    the normalised k here, where the GPU kernel's is the raw k with the norm folded into delta)."""
    ng, rows, _ = x.shape
    h, dv = neg_a.shape[0], rec_state.shape[-1]
    rep = h // nk
    q = x[..., :nk * dk].reshape(ng, rows, nk, dk)
    k = x[..., nk * dk:2 * nk * dk].reshape(ng, rows, nk, dk)
    v = x[..., 2 * nk * dk:2 * nk * dk + h * dv].reshape(ng, rows, h, dv)
    bav = ba[..., :2 * h].reshape(ng, rows, nk, 2 * rep)
    q, k, g, beta = gated_delta_inputs(q, k, bav[..., :rep].reshape(ng, rows, h),
                                       bav[..., rep:].reshape(ng, rows, h), neg_a, dt_bias,
                                       q_scale, eps)
    return gated_delta_window(q, k, v, g, beta, rec_state, group_slot, snaps=snaps,
                              factors=factors)


def gated_delta_inputs(q: torch.Tensor, k: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       neg_a: torch.Tensor, dt_bias: torch.Tensor, q_scale: float, eps: float
                       ) -> tuple[torch.Tensor, ...]:
    """The rule's inputs from a linear-attention layer's own: q, k (..., nk, Dk) L2-normalised in
    float32 (q times q_scale) and repeated to the H value heads of b, a (..., H); beta =
    sigmoid(b) in b's dtype (as transformers rounds it), then float32; g = neg_a *
    softplus(a + dt_bias) in float32 (neg_a = -exp(A_log)). Returns q, k, g, beta. The model's
    own preparation (GatedDeltaNet._heads) and gated_delta_window_prep's, so the kernel that
    does it in place has one definition to match."""
    rep = b.shape[-1] // q.shape[-2]
    if rep > 1:  # (repeated first: a CPU sum over (..., H, Dk) rounds as the model always has)
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps) * q_scale
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    beta = torch.sigmoid(b).float()
    g = neg_a * F.softplus(a.float() + dt_bias)
    return q, k, g, beta


def commit_accepted(accept: torch.Tensor, group_slot: torch.Tensor, group_pos: torch.Tensor,
                    rec_factors: torch.Tensor, conv_snaps: torch.Tensor, rec_state: torch.Tensor,
                    conv_state: torch.Tensor, slot_pos: torch.Tensor) -> None:
    """Accepted-prefix commit: each group's slot takes the states after its last accepted row.

    accept: (NG,) int64, rows 0..accept[g] are committed. rec_factors: (L, NG, G, H, Dk + Dv + 1),
    the window's rows' rank-one updates (gated_delta_window's `factors`), of which rows
    0..accept[g] are replayed onto the slot's recurrent state, in place: the state the window
    read becomes the one it had after row accept[g], bit for bit. conv_snaps: (L, NG, G, C, K-1),
    the one after row accept[g] is copied. rec_state: (L, S+1, H, Dk, Dv); conv_state:
    (L, S+1, C, K-1); slot_pos: (S+1,) int64 committed length of each slot, advanced to
    group_pos + accept + 1. Groups that share a slot (padding, on the scratch slot) all replay
    onto the state they read, and one of them lands there.
    """
    ng, g = rec_factors.shape[1:3]
    idx = torch.arange(ng, device=accept.device)
    s = rec_state[:, group_slot]  # (L, NG, H, Dk, Dv)
    # every row on every group, kept where it is accepted: static shapes, no host sync
    for j in range(g):
        s = torch.where((accept >= j)[None, :, None, None, None],
                        replay_factors(s, rec_factors[:, :, j]), s)
    rec_state[:, group_slot] = s
    conv_state[:, group_slot] = conv_snaps[:, idx, accept].to(conv_state.dtype)
    slot_pos[group_slot] = group_pos + accept + 1


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, initial_state: torch.Tensor,
                      chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (prefill and training): same math as the per-row recurrence.

    q, k: (B, L, H, Dk) normalised as in gated_delta_window; v: (B, L, H, Dv); g, beta: (B, L, H);
    initial_state: (B, H, Dk, Dv) float32. Returns out (B, L, H, Dv) float32 and the final state.
    """
    b, length, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v, beta, g = (t.transpose(1, 2).float() for t in (q, k, v, beta, g))
    pad = (chunk - length % chunk) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    n = (length + pad) // chunk
    v_beta = (v * beta[..., None]).reshape(b, h, n, chunk, dv)
    k_beta = (k * beta[..., None]).reshape(b, h, n, chunk, dk)
    q = q.reshape(b, h, n, chunk, dk)
    k = k.reshape(b, h, n, chunk, dk)
    gc = g.reshape(b, h, n, chunk).cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False,
                                          unitriangular=True)
    intra = ((q @ k.transpose(-1, -2)) * decay).masked_fill(upper, 0.0)
    q_dec = q * gc.exp()[..., None]
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]
    state = initial_state.float()
    outs = []
    for i in range(n):
        v_new = new_v[:, :, i] - k_cum[:, :, i] @ state
        outs.append(q_dec[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).reshape(b, h, n * chunk, dv)[:, :, :length]
    return out.transpose(1, 2), state


# ---- FP8 block-scaled weights and routed experts ------------------------------------------------
# Hugging Face fine-grained FP8: a weight (O, I) in float8_e4m3fn with `weight_scale_inv`
# (ceil(O / bo), ceil(I / bi)) float32; the real weight is fp8 value x its block's scale.
# Stacked experts keep gate and up scales side by side: w_gate_up (E, 2I, H) has gu_scale
# (E, 2 * ceil(I / bo), ceil(H / bi)), rows [0, I) (gate) reading scale rows [0, ceil(I / bo)) and
# rows [I, 2I) (up) reading the rest, so that I need not be a multiple of bo.


def dequant_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., O, I) FP8 weight times its (..., ceil(O/bo), ceil(I/bi)) block scales, as `dtype`.
    Where the blocks tile the weight, one broadcast product (no expanded copy of the scales; a
    compiled region makes it one kernel, as a prompt chunk's dequantised projections need);
    else the scales expanded to the weight's shape. The same float32 products either way."""
    *lead, o, i = w.shape
    # a block beyond the weight is one block: expanding its scale to the block first could
    # ask for terabytes (weight_block_size is the checkpoint's word)
    bo, bi = min(int(block[0]), o), min(int(block[1]), i)
    if o % bo == 0 and i % bi == 0:
        tiles = w.view(*lead, o // bo, bo, i // bi, bi).float()
        return (tiles * scale_inv.float()[..., :, None, :, None]).to(dtype).view(w.shape)
    s = scale_inv.float().repeat_interleave(bo, -2)[..., :o, :].repeat_interleave(bi, -1)[..., :i]
    return (w.float() * s).to(dtype)


def dequant_gate_up(w_gate_up: torch.Tensor, gu_scale: torch.Tensor, block: tuple[int, int],
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stacked (..., 2I, H) FP8 gate/up weights with their side-by-side scales, as `dtype`."""
    inter = w_gate_up.shape[-2] // 2
    nb = gu_scale.shape[-2] // 2
    return torch.cat([dequant_fp8_block(w_gate_up[..., :inter, :], gu_scale[..., :nb, :], block, dtype),
                      dequant_fp8_block(w_gate_up[..., inter:, :], gu_scale[..., nb:, :], block, dtype)],
                     dim=-2)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               block: tuple[int, int]) -> torch.Tensor:
    """y = x @ W^T for an FP8 block-scaled W (O, I); x (..., I) -> (..., O) in x's dtype,
    accumulated in float32."""
    w = dequant_fp8_block(weight, scale_inv, block, torch.float32)
    return F.linear(x.float(), w).to(x.dtype)


def linear_skinny(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T for a float W (O, I): F.linear. The GPU's skinny kernel (a decode window's
    small bf16 linears, cyext_ops.skinny_bf16_takes) sums in float32 in another order, each row
    independent of the others."""
    return F.linear(x, weight)


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                topk_weight: torch.Tensor, topk_ids: torch.Tensor,
                gu_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                block: tuple[int, int] | None = None, slot_of: torch.Tensor | None = None,
                host_gate_up: torch.Tensor | None = None, host_down: torch.Tensor | None = None,
                host_gu_scale: torch.Tensor | None = None,
                host_down_scale: torch.Tensor | None = None,
                routed_counts: torch.Tensor | None = None,
                window_state: torch.Tensor | None = None,
                count_layer: torch.Tensor | None = None, *, prompt: bool = False) -> torch.Tensor:
    """Routed experts: out[n] = sum_j topk_weight[n, j] * E_e(x[n]) with e = topk_ids[n, j] and
    E_e(x) = W_down[e] @ (silu(W_gate[e] @ x) * (W_up[e] @ x)).

    x (N, H); w_gate_up (E, 2I, H) (gate rows first) and w_down (E, H, I), in x's dtype or FP8
    with gu_scale / down_scale and block (bo, bi); topk_weight (N, k) float; topk_ids (N, k)
    int64. Computed in float32 and returned in x's dtype. This reference gathers each row's
    experts (static shapes, capturable); the kernels read each distinct expert once.

    Expert cache (strata/engine/expert_cache.py): with `slot_of` (E,) int32, the weight and
    scale stacks are the device slots (S, ...) and expert e is read from slot slot_of[e] when
    slot_of[e] >= 0, else (a miss) from the host store host_gate_up / host_down /
    host_gu_scale / host_down_scale (E_h <= E, ...) at row e: pinned host memory that the GPU
    kernels read through its device-visible address, so a captured graph stays valid whichever
    experts miss. Where an expert is read from never changes the result. Here (the reference)
    a host store on another device than the ids is gathered on the host: eager only.

    Counting (with the cache; cyext/src/strata_expert_cache.h): with `routed_counts`
    (L, E_h) float32, `window_state` (2 + L * E_h,) int32 (hits, misses, then the seen flags of
    every (layer, expert)) and `count_layer` (1,) int32 holding this call's layer l, the call
    adds each routed expert e < E_h's (row, expert) pairs to routed_counts[l, e] and, for each
    distinct e whose seen flag was 0, sets it and adds 1 to window_state[0] (slot_of[e] >= 0, a
    hit) or window_state[1] (a miss). The kernels do it inside the gate/up kernel.

    `prompt`: the rows are a prompt chunk's, else a decode window's. The GPU kernels run the two
    kinds on different down kernels (other bits, each independent of the launch's other rows);
    here it changes nothing."""
    if slot_of is not None:
        if host_gate_up is None or host_down is None:
            raise ValueError("moe_experts: slot_of needs the host store (host_gate_up, host_down)")
        if routed_counts is not None:
            count_expert_reads(topk_ids, slot_of, routed_counts, window_state, count_layer)
        slot = slot_of.to(topk_ids.device)[topk_ids].long()  # (N, k); -1 = read from the host
        wgu = _cached_rows(w_gate_up, host_gate_up, slot, topk_ids)
        wd = _cached_rows(w_down, host_down, slot, topk_ids)
        if gu_scale is not None:
            wgu = dequant_gate_up(wgu, _cached_rows(gu_scale, host_gu_scale, slot, topk_ids), block)
            wd = dequant_fp8_block(wd, _cached_rows(down_scale, host_down_scale, slot, topk_ids),
                                   block)
    else:
        pair = w_gate_up[0].numel() + w_down[0].numel()
        step = max(1, _GATHER_ELEMENTS // max(1, pair * topk_ids.shape[-1]))
        if x.shape[0] > step:  # a big launch: the gathered weights by rows, not all at once
            return torch.cat([moe_experts(x[r:r + step], w_gate_up, w_down,
                                          topk_weight[r:r + step], topk_ids[r:r + step],
                                          gu_scale, down_scale, block, prompt=prompt)
                              for r in range(0, x.shape[0], step)])
        wgu, wd = w_gate_up[topk_ids], w_down[topk_ids]  # (N, k, 2I, H), (N, k, H, I)
        if gu_scale is not None:
            wgu = dequant_gate_up(wgu, gu_scale[topk_ids], block)
            wd = dequant_fp8_block(wd, down_scale[topk_ids], block)
    gu = torch.einsum("nh,nkih->nki", x.float(), wgu.float())
    gate, up = gu.split(wgu.shape[-2] // 2, dim=-1)
    out = torch.einsum("nki,nkhi->nkh", F.silu(gate) * up, wd.float())
    return torch.einsum("nkh,nk->nh", out, topk_weight.float()).to(x.dtype)


#: the most expert-weight elements moe_experts gathers at once (1 GiB in float32): each row's
#: sum is its own, so a launch of many rows (an eight-slot prompt chunk at the 80B's shapes
#: gathers ~70 GB at once) runs in slices of rows with the same result
_GATHER_ELEMENTS = 1 << 28


def count_expert_reads(topk_ids: torch.Tensor, slot_of: torch.Tensor,
                       routed_counts: torch.Tensor, window_state: torch.Tensor,
                       count_layer: torch.Tensor) -> None:
    """moe_experts' counting (see there), in place, with static shapes (capturable): ids past
    the counted experts (a folded shared expert) add nothing."""
    if window_state is None or count_layer is None:
        raise ValueError("moe_experts: routed_counts, window_state and count_layer go together")
    n_layers, n = routed_counts.shape
    dev = routed_counts.device
    layer = count_layer.to(dev).long().clamp(0, n_layers - 1)
    flat = topk_ids.reshape(-1).to(dev)
    valid = (flat < n).to(torch.int32)
    routed = torch.zeros(n, dtype=torch.int32, device=dev).scatter_add_(0, flat.clamp(max=n - 1),
                                                                        valid)
    routed_counts.index_add_(0, layer, routed.to(routed_counts.dtype)[None])
    seen = window_state[2:].view(n_layers, n)
    was = seen.index_select(0, layer)[0]
    now = routed > 0
    new = now & (was == 0)
    res = slot_of[:n].to(dev) >= 0
    window_state[0] += (new & res).sum().to(window_state.dtype)
    window_state[1] += (new & ~res).sum().to(window_state.dtype)
    seen.index_copy_(0, layer, torch.where(now, torch.ones_like(was), was)[None])


def _cached_rows(slots: torch.Tensor, host: torch.Tensor, slot: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """(N, k, ...) expert rows: slots[slot] where slot >= 0, else host[ids] (expert cache)."""
    dev = ids.device
    if slots.dtype == FP8_DTYPE_REF:  # where() is not defined for float8 everywhere: bytes
        return _cached_rows(slots.view(torch.uint8), host.view(torch.uint8), slot,
                            ids).view(FP8_DTYPE_REF)
    from_slot = slots[slot.clamp(min=0, max=max(slots.shape[0] - 1, 0))] if slots.shape[0] else \
        torch.zeros(*slot.shape, *host.shape[1:], dtype=host.dtype, device=dev)
    hid = ids.clamp(max=host.shape[0] - 1)  # ids past the store (a folded shared expert) are resident
    from_host = host[hid.to(host.device)].to(dev)
    keep = (slot >= 0).view(*slot.shape, *([1] * (host.dim() - 1)))
    return torch.where(keep, from_slot, from_host)


FP8_DTYPE_REF = getattr(torch, "float8_e4m3fn", None)


def topk_by_argmax(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the last dim as k rounds of max (descending, ties to the lower index).

    Routing picks a few of a few hundred experts per row. Each round masks the winner with a
    pointwise `where` on a column iota, never a scatter: inductor can then keep the row in
    registers and run the softmax and every round as one kernel, where a scatter (an indirect
    store) ends its kernel, and k rounds became 2k launches per MoE layer on the GPU."""
    vals, idxs = [], []
    col = torch.arange(x.shape[-1], device=x.device)
    for _ in range(k):
        v, i = x.max(-1, keepdim=True)
        vals.append(v)
        idxs.append(i)
        x = torch.where(col == i, float("-inf"), x)
    return torch.cat(vals, -1), torch.cat(idxs, -1)


def topk_by_sort(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_by_argmax's result (descending, ties to the lower index) by one stable sort of the
    last dim, for x without NaNs or negative zeros (softmax probabilities). Run eagerly (a
    prompt chunk's router past the router kernel's rows, inside an opaque op), k rounds of max
    are 4k small kernels; the sort is one."""
    vals, idxs = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k], idxs[..., :k]


def moe_route(x: torch.Tensor, w_router: torch.Tensor, num_experts: int, top_k: int,
              norm_topk: bool, routing_bias: Optional[torch.Tensor] = None,
              shared_id: int = -1, topk=topk_by_argmax) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router: the top_k experts of softmax(x @ w_router[:E]^T + routing_bias) over the
    E = num_experts experts (logits in x's dtype, the softmax in float32; descending, ties to
    the lower id), renormalised to sum 1 when norm_topk. With shared_id >= 0, w_router's row E
    is the shared expert's gate and the result has one more column: id shared_id with weight
    sigmoid(its logit) (the shared expert folded into the routed ones).

    x (N, H); w_router (R, H), R >= E (+1), rows past those unused. topk: topk_by_argmax (which
    compiles into the softmax's kernel) or topk_by_sort (eager: the same result in one kernel).
    Returns weights (N, C) float32 and ids (N, C) int64, C = top_k (+1)."""
    y = F.linear(x, w_router)
    logits = y[:, :num_experts]
    if routing_bias is not None:
        logits = logits.float() + routing_bias
    probs = torch.softmax(logits.float(), dim=-1)
    weights, index = topk(probs, top_k)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    if shared_id >= 0:
        shared = torch.sigmoid(y[:, num_experts:num_experts + 1].float())
        index = torch.cat([index, torch.full_like(index[:, :1], shared_id)], dim=1)
        weights = torch.cat([weights, shared], dim=1)
    return weights, index


def l2_prefetch(token: torch.Tensor, tensors: list[torch.Tensor],
                ids: Optional[torch.Tensor] = None) -> None:
    """A hint that `tensors` (with ids, their rows t[ids]) are read soon, so that their bytes
    stream into L2 while latency-bound kernels run (the CUDA backend, sm_90+). Changes no
    value anywhere: here it does nothing. token: a tensor the op is declared to write (it never
    does), so that a compiled region keeps the call in place rather than dropping it."""
    return None
