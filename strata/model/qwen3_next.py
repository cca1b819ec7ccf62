"""Qwen3-Next (Gated DeltaNet + gated attention, MoE with shared expert) with its MTP module.

Plain PyTorch, readable top to bottom. Three ways to run the network:
  forward_train(tokens)        whole sequences, no cache (training and the no-cache reference)
  prefill(tokens, lane, ...)   one lane's prompt chunk: chunked delta rule, writes the lane's state
  verify_window(tokens, ...)   a window grid of NG groups x G rows from several lanes at once:
                               static shapes (graph-capturable), each DeltaNet row's rank-one
                               update factors, nothing committed (the engine's verifier commits
                               accepted rows by replaying their factors)
and the MTP module over the same grid (`mtp_window`) or over whole sequences (`mtp_train`).

The model knows lanes (indices into DecodeState), not requests or slots.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from strata.kernels import ops, reference
from strata.kernels.reference import topk_by_argmax  # noqa: F401 - re-exported
from strata.model.config import ModelArgs
from strata.model.fp8 import (FP8_DTYPE, Fp8Linear, dense, dequant_in_prompt, fuse_projections,
                              linear, project)
from strata.model.state import DecodeState


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm of Qwen3-Next: x_hat * (1 + w), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Plain-weight RMSNorm gated by SiLU(z), inside the DeltaNet layer: x_hat * w * silu(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(z.float())).to(dtype)


class Rotary(nn.Module):
    """Partial rotary embedding: the first `rotary_dim` channels of each head rotate.

    The tables span the whole head (D channels), so that the rotation is one expression
    (apply_rotary), not slices and concatenations, which the compiler lowered to a kernel each:
    cos is 1 and sin 0 past rotary_dim, and sin carries rotate-half's sign (negative in the
    first half), so x * cos + rotate_half(x) * sin is x's rotation, the same values as the sliced
    form (x + 0 exactly where nothing rotates)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        rd = args.rotary_dim
        inv = 1.0 / (args.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.pad = args.head_dim - rd

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (*pos.shape, D) in `dtype` (see the class)."""
        freqs = pos.float()[..., None] * self.inv_freq
        fc, fs, ones = freqs.cos(), freqs.sin(), freqs.new_ones(*freqs.shape[:-1], self.pad)
        cos = torch.cat([fc, fc, ones], dim=-1)
        sin = torch.cat([-fs, fs, ones * 0], dim=-1)
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> torch.Tensor:
    """x (..., heads, D); cos/sin (..., D) from Rotary, broadcast over heads; rd: rotary_dim.
    rotate_half swaps the halves of the first rd channels (sin carries the sign); where rd
    divides D every rd-block's halves swap, the blocks past the first meeting sin = 0, so it is a
    view and a flip (index arithmetic in a compiled kernel), else a gather."""
    d = x.shape[-1]
    if rd == 0:
        return x
    if d % rd == 0:
        swapped = x.unflatten(-1, (d // rd, 2, rd // 2)).flip(-2).flatten(-3)
    else:
        half = rd // 2
        perm = torch.cat([torch.arange(half, rd), torch.arange(half), torch.arange(rd, d)])
        swapped = x[..., perm.to(x.device)]
    return x * cos.unsqueeze(-2) + swapped * sin.unsqueeze(-2)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, prompt: bool = False,
                valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        # (prompt, valid: as SparseMoe's; a dense MLP runs every row alike)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def park_padding(weights: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, park
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded prompt chunk's routing with its padding rows (valid False) parked: every pick on
    expert `park` (an id, or a (1, 1) tensor: one the call reads anyway, the folded shared expert
    or row 0's first pick) with weight 0. A padding row's output is never read, but its picks
    would add distinct experts, whose bytes are most of a chunk's time at real scale; the real
    rows' results are the same bits (the routed-expert kernels' rows are independent)."""
    keep = valid.reshape(-1, 1)
    if not isinstance(park, torch.Tensor):
        # a fill on the device: an int through as_tensor is a copy from unpinned host memory,
        # which a CUDA graph capture refuses (eager prompt chunks, compile off)
        park = index.new_full((1, 1), int(park))
    return torch.where(keep, weights, torch.zeros_like(weights)), torch.where(keep, index, park)


class Experts(nn.Module):
    """Routed experts stored stacked: w_gate_up (E, 2I, H) and w_down (E, H, I), in the model
    dtype or, after `to_fp8`, in FP8 with block scales gu_scale / down_scale."""

    #: Rows per ops.moe_experts call: the grouped kernel's range (1 to 32 rows); longer inputs
    #: (prompt chunks) run in static slices of this many rows.
    MAX_ROWS = 32

    def __init__(self, n: int, hidden: int, inter: int):
        super().__init__()
        self.inter = inter
        self.w_gate_up = nn.Parameter(torch.empty(n, 2 * inter, hidden))
        self.w_down = nn.Parameter(torch.empty(n, hidden, inter))
        self.gu_scale: Optional[nn.Parameter] = None
        self.down_scale: Optional[nn.Parameter] = None
        self.block: Optional[tuple[int, int]] = None
        self.shared_id: Optional[int] = None  # set by fold_shared()
        self.stacks: tuple = ()
        self.shared_modules: tuple = ()  # the folded shared expert's gate, up, down
        #: The expert cache's view of this layer (strata/engine/expert_cache.py), or None.
        self.cache = None
        #: what ops.l2_prefetch declares it writes (it never does): keeps the call compiled in
        self.register_buffer("l2_token", torch.zeros(1, dtype=torch.int32), persistent=False)
        #: model.moe_dense_prefill: prompt chunks of rows x top-k >= E run every expert densely
        #: (unquantised, uncached weights only); other bits than the grouped path, so a chunk's
        #: rows must be the same in every mode (engine.prefill_slots 1) and windows never take it.
        self.dense_prefill = False

    def to_fp8(self, block: tuple[int, int]) -> None:
        """FP8 weights with block scales (layouts of strata/kernels/reference.py), on the
        device the weights are on (meta while the loader builds)."""
        n, two_i, hidden = self.w_gate_up.shape
        dev = self.w_gate_up.device
        bo, bi = block
        self.block = (int(bo), int(bi))
        self.w_gate_up = nn.Parameter(torch.empty(n, two_i, hidden, dtype=FP8_DTYPE, device=dev),
                                      requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(n, hidden, self.inter, dtype=FP8_DTYPE, device=dev),
                                   requires_grad=False)
        self.gu_scale = nn.Parameter(torch.empty(n, 2 * -(-self.inter // bo), -(-hidden // bi),
                                                 device=dev), requires_grad=False)
        self.down_scale = nn.Parameter(torch.empty(n, -(-hidden // bo), -(-self.inter // bi),
                                                   device=dev), requires_grad=False)

    def fold_shared(self, shared: nn.Module) -> bool:
        """Make the shared expert (an MLP of the experts' shape and format) expert E of stacks
        (E+1, 2I, H) and (E+1, H, I), so that one ops.moe_experts call runs it with the routed
        ones (fewer launches per MoE block). The routed and shared parameters become views of
        the stacks. Returns False (nothing changed) when the shapes or formats differ."""
        g, u, d = shared.gate_proj, shared.up_proj, shared.down_proj
        fp8 = self.gu_scale is not None
        if (g.weight.shape[0] != self.inter or g.weight.dtype != self.w_gate_up.dtype
                or any(isinstance(m, nn.Linear) == fp8 for m in (g, u, d))
                or (fp8 and any(m.block != self.block for m in (g, u, d)))):
            return False
        n = self.w_gate_up.shape[0]
        gu = _stack_views(self, "w_gate_up", [g, u], "weight")
        dn = _stack_views(self, "w_down", [d], "weight")
        self.stacks = (gu, dn, None, None)
        if fp8:
            self.stacks = (gu, dn, _stack_views(self, "gu_scale", [g, u], "weight_scale_inv"),
                           _stack_views(self, "down_scale", [d], "weight_scale_inv"))
        self.shared_id = n
        self.shared_modules = (g, u, d)
        return True

    def dense_input(self, rows: int, top_k: int, prompt: bool) -> bool:
        """Whether `rows` rows of top_k routed experts run every expert densely."""
        return (prompt and self.dense_prefill and self.cache is None and self.gu_scale is None
                and rows * top_k >= self.w_gate_up.shape[0])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                shared_weight: Optional[torch.Tensor] = None,
                shared_in_index: bool = False, prompt: bool = False,
                valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (N, H); weights (N, k) float32, index (N, k); shared_weight (N, 1): the folded
        shared expert's gate (only after fold_shared); or shared_in_index, when the last
        column of weights and index already is the folded shared expert (ops.moe_route).
        prompt: the rows are a prompt chunk's, else a decode window's (the kernels run the two
        kinds with different bits, each the same whatever rows share the call). valid (N,
        bool): a padded prompt chunk's real rows; the others are parked (park_padding) on the
        folded shared expert, or on row 0's first pick.
        Static shapes: no data-dependent control flow."""
        routed_k = index.shape[1] - int(shared_in_index)
        if self.dense_input(index.shape[0], routed_k, prompt):
            assert shared_weight is None and not shared_in_index, \
                "the dense path runs the shared expert apart"
            n_exp = self.w_gate_up.shape[0]
            # Dense over every expert with a routing matrix that is zero off the top-k: reads
            # each expert once and runs as plain matmuls, cheaper than grouping at this many rows.
            route = torch.zeros(x.shape[0], n_exp, dtype=weights.dtype, device=x.device)
            route.scatter_(1, index, weights)
            gu = torch.einsum("nh,eih->eni", x, self.w_gate_up)
            gate, up = gu.split(self.inter, dim=-1)
            out = torch.einsum("eni,ehi->enh", F.silu(gate) * up, self.w_down)
            return torch.einsum("enh,ne->nh", out, route.to(out.dtype))
        if valid is not None:
            folded = shared_in_index or shared_weight is not None
            weights, index = park_padding(weights, index, valid,
                                          self.shared_id if folded else index[:1, :1])
        cache_args, counting = (), {}
        if self.cache is not None:
            # Through the expert cache: residents from their device slots, misses from the host
            # store (the kernel reads them where they are); inside a decode window the kernel
            # also counts the rows' routing and the window's hits and misses (ExpertCache).
            c = self.cache
            wgu, wd, gus, ds = c.gate_up, c.down, c.gu_scale, c.down_scale
            cache_args = (c.slot_of, c.host_gate_up, c.host_down, c.host_gu_scale,
                          c.host_down_scale)
            counting = c.counting_args()
        elif shared_weight is not None or shared_in_index:
            wgu, wd, gus, ds = self.stacks
        else:
            wgu, wd, gus, ds = self.w_gate_up, self.w_down, self.gu_scale, self.down_scale
        if shared_weight is not None:  # the folded shared expert: id E, always in a slot
            index = torch.cat([index, torch.full_like(index[:, :1], self.shared_id)], dim=1)
            weights = torch.cat([weights, shared_weight.float()], dim=1)
        level = ops.l2_prefetch_level() if not prompt and self.cache is None else 0
        if level >= 2:
            # the chosen experts' down weights (3: and gate/up) stream into L2 while the gate/up
            # kernel runs, so that the down kernel reads them from there
            ops.l2_prefetch(self.l2_token, [wgu, wd] if level >= 3 else [wd], index)
        # Grouped by expert: each distinct expert's weights are read once for all its rows. The
        # kernels take any row count (launches of 16 or 32 rows, which change no row's result),
        # so a prompt chunk is one call and its compiled region does not depend on the chunk's
        # length; the torch reference gathers every row's experts, so it gets static slices.
        if ops.moe_experts is not reference.moe_experts:
            return ops.moe_experts(x, wgu, wd, weights, index, gus, ds, self.block, *cache_args,
                                   **counting, prompt=prompt)
        step = self.MAX_ROWS
        outs = [ops.moe_experts(x[s:s + step], wgu, wd, weights[s:s + step], index[s:s + step],
                                gus, ds, self.block, *cache_args, **counting, prompt=prompt)
                for s in range(0, x.shape[0], step)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _stack_views(experts: nn.Module, name: str, shared: list[nn.Module], attr: str) -> torch.Tensor:
    """(E+1, ...) stack of the experts' parameter `name` and the shared expert's parts (their
    `attr`s concatenated by rows); both become views of it."""
    routed = getattr(experts, name).detach()
    # (routed experts the loader left in host memory for the expert cache: the stack is made
    # there too, and the cache moves the shared expert's part back to the device)
    parts = [getattr(m, attr).detach().to(routed.device) for m in shared]
    as_bytes = routed.dtype == FP8_DTYPE  # concatenated as bytes: not every torch build cats float8
    if as_bytes:
        routed, parts = routed.view(torch.uint8), [p.view(torch.uint8) for p in parts]
    stack = torch.cat([routed, torch.cat(parts, dim=0)[None]])
    if as_bytes:
        stack = stack.view(FP8_DTYPE)
    n = routed.shape[0]
    setattr(experts, name, nn.Parameter(stack[:n], requires_grad=False))
    row = 0
    for m in shared:
        rows = getattr(m, attr).shape[0]
        setattr(m, attr, nn.Parameter(stack[n, row:row + rows], requires_grad=False))
        row += rows
    return stack


def dense_route(weights: torch.Tensor, index: torch.Tensor, n_exp: int) -> torch.Tensor:
    """(rows, n_exp): each row's top-k weights at their experts, zero elsewhere (a scatter into
    zeros, the same values), as one select per pick: pointwise, so a compiled region folds it
    into the kernel that uses it, where zeros-then-scatter took two kernels of their own."""
    experts = torch.arange(n_exp, device=index.device)
    route = weights.new_zeros(()).expand(index.shape[0], n_exp)
    for j in range(index.shape[-1]):
        route = torch.where(index[:, j, None] == experts, weights[:, j, None], route)
    return route


class SparseMoe(nn.Module):
    """Top-k softmax routing (optionally renormalised) plus a sigmoid-gated shared expert."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = Experts(args.num_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_expert = MLP(args.hidden_size, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)
        self.w_in: Optional[torch.Tensor] = None  # fused by fuse_for_inference()
        self.w_out: Optional[torch.Tensor] = None
        self.dense_experts = 0  # set by fuse_for_inference()
        self.w_router: Optional[torch.Tensor] = None  # [router | shared gate], fused
        #: (E,) float32 added to the router logits: model.dummy_routing_skew's synthetic
        #: popularity for dummy weights (strata/model/dummy.py), else None.
        self.routing_bias: Optional[torch.Tensor] = None

    def _route(self, logits: torch.Tensor):
        if self.routing_bias is not None:
            logits = logits.float() + self.routing_bias
        probs = torch.softmax(logits.float(), dim=-1)
        weights, index = topk_by_argmax(probs, self.top_k)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, index

    def forward(self, x: torch.Tensor, prompt: bool = False,
                valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """prompt: x holds a prompt chunk's rows, else a decode window's (Experts.forward).
        valid (x's leading shape, bool): a padded prompt chunk's real rows; its padding rows are
        routed to one expert the call reads anyway, with weight 0 (Experts.forward)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n_exp = self.experts.w_gate_up.shape[0]
        if self.w_in is not None and (n_exp <= self.dense_experts or x.shape[0] * self.top_k >= n_exp):
            return self._forward_fused(x, prompt).reshape(shape)
        dense = self.experts.dense_input(x.shape[0], self.top_k, prompt)
        if self.w_router is not None:
            # One op for the router, the softmax and top-k and the shared expert's gate (its
            # last column; one kernel on the GPU at decode sizes, reference.moe_route), on every
            # path, so that a row's routing never depends on which expert path runs it.
            shared_id = self.experts.shared_id
            weights, index = ops.moe_route(x, self.w_router, n_exp, self.top_k, self.norm_topk,
                                           self.routing_bias, n_exp if shared_id is None else shared_id)
            if shared_id is not None and not dense:  # the folded shared expert is expert E
                return self.experts(x, weights, index, shared_in_index=True, prompt=prompt,
                                    valid=valid).reshape(shape)
            k = self.top_k
            out = (self.experts(x, weights[:, :k], index[:, :k], prompt=prompt, valid=valid)
                   + weights[:, k:].to(x.dtype) * self.shared_expert(x))
            return out.reshape(shape)
        logits, sgate = self.gate(x), self.shared_expert_gate(x)
        weights, index = self._route(logits)
        if self.experts.shared_id is not None and not dense:
            out = self.experts(x, weights, index, shared_weight=torch.sigmoid(sgate.float()),
                               prompt=prompt, valid=valid)
        else:
            out = (self.experts(x, weights, index, prompt=prompt, valid=valid)
                   + torch.sigmoid(sgate) * self.shared_expert(x))
        return out.reshape(shape)

    def _forward_fused(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """The whole block as two matmuls: [router | shared gate | shared gate, up | every
        expert's gate, up] from x, then [shared down | every expert's down] from the gated
        activations (routing weights applied before the down projection sum the experts).
        prompt: a prompt chunk's rows (fp8.dense)."""
        n_exp, two_i, _ = self.experts.w_gate_up.shape
        inter, shared = two_i // 2, self.shared_expert.up_proj.weight.shape[0]
        sizes = [n_exp, 1, shared, shared, n_exp * two_i]
        # less the zero rows' columns (fuse_for_inference)
        y = dense(x, self.w_in, prompt)[:, :sum(sizes)]
        logits, sgate, sg, su, eg = y.split(sizes, dim=-1)
        weights, index = self._route(logits)
        route = dense_route(weights.to(x.dtype), index, n_exp)
        g, u = eg.reshape(x.shape[0], n_exp, two_i).split(inter, dim=-1)
        act_e = F.silu(g) * u * route[..., None]
        act_s = F.silu(sg) * su * torch.sigmoid(sgate)
        return dense(torch.cat([act_s, act_e.reshape(x.shape[0], n_exp * inter)], -1), self.w_out,
                     prompt)

    def grouped(self, dense_experts: int) -> bool:
        """Whether fuse_for_inference(dense_experts) runs the routed experts grouped by expert
        (ops.moe_experts), else in one dense matmul with the router and the shared expert."""
        se = self.shared_expert
        parts = (self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj, se.down_proj)
        return (self.experts.w_gate_up.shape[0] > dense_experts
                or self.experts.gu_scale is not None
                or any(not isinstance(m, nn.Linear) for m in parts))

    def fuse_for_inference(self, dense_experts: int = 0) -> None:
        self.dense_experts = dense_experts
        e = self.experts
        se = self.shared_expert
        if self.grouped(dense_experts):
            # Many experts (or FP8): routed experts through ops.moe_experts, with the shared
            # expert folded in where it has their shape, and one matmul for both gates.
            if all(isinstance(m, nn.Linear) for m in (self.gate, self.shared_expert_gate)):
                fused = fuse_projections([self.gate, self.shared_expert_gate], row_multiple=8)
                self.w_router = fused[0]
            e.fold_shared(se)
            return
        n_exp, two_i, hidden = e.w_gate_up.shape
        inter = two_i // 2
        shared = se.up_proj.weight.shape[0]
        parts = [self.gate.weight, self.shared_expert_gate.weight, se.gate_proj.weight,
                 se.up_proj.weight, e.w_gate_up.detach().reshape(n_exp * two_i, hidden)]
        # Zero rows up to a multiple of 8, so that the product's rows stay 16-byte aligned: they
        # number E(1 + 2I) + 1 + 2S, odd for an even E, and cuBLAS then runs an unaligned kernel
        # and a split-k reduction (fuse_projections' row_multiple, for the same reason).
        pad = -sum(p.shape[0] for p in parts) % 8
        w_in = torch.cat(parts + [parts[0].new_zeros(pad, hidden)]).contiguous()
        w_out = torch.cat([se.down_proj.weight,
                           e.w_down.detach().permute(1, 0, 2).reshape(hidden, n_exp * inter)], 1).contiguous()
        # The original parameters become views of the fused weights (no duplicated memory).
        o = 0
        for m in (self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj):
            n = m.weight.shape[0]
            m.weight = nn.Parameter(w_in[o:o + n], requires_grad=False)
            o += n
        e.w_gate_up = nn.Parameter(w_in[o:o + n_exp * two_i].view(n_exp, two_i, hidden),
                                   requires_grad=False)
        se.down_proj.weight = nn.Parameter(w_out[:, :shared], requires_grad=False)
        e.w_down = nn.Parameter(w_out[:, shared:].view(hidden, n_exp, inter).permute(1, 0, 2),
                                requires_grad=False)
        self.w_in, self.w_out = w_in, w_out


def decoder_moe_layers(model) -> list[tuple[int, "SparseMoe"]]:
    """(decoder layer index, its SparseMoe) of every decoder MoE layer: the layers whose routed
    experts the expert cache serves (the MTP layer's stay with the dense weights)."""
    return [(i, layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoe)]


class Attention(nn.Module):
    """Gated full attention: q_proj yields queries and a sigmoid output gate; per-head q/k norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hq, self.hkv, self.d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.d ** -0.5
        self.rd = args.rotary_dim
        h = args.hidden_size
        self.q_proj = nn.Linear(h, self.hq * self.d * 2, bias=False)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, h, bias=False)
        self.q_norm = RMSNorm(self.d, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, args.rms_norm_eps)
        self.w_qkv: Optional[torch.Tensor] = None  # fused by fuse_for_inference()
        self.s_qkv: Optional[torch.Tensor] = None  # its FP8 block scales (None: float weights)
        self.qkv_block: Optional[tuple[int, int]] = None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prompt: bool = False):
        """(q, k, v, qg): q and k normed and rotated, v contiguous, and qg, the q/gate
        projection, from which `gated` takes the gate. qg crosses the window's region boundary
        rather than the gate, a view with new head dims: where a lead dim has size 1 the gate's
        stride there is the projection's row stride when a compiled region returns it and
        its own row size when eager code does, so the region after it would trace other
        graphs behind an eagerly run first region (a compile worker's share,
        strata/engine/compile_workers.py) than behind a compiled one. qg, a slice of the
        projection's last dim, has the same strides either way. prompt: a prompt chunk's rows
        (FP8 projections marked prompt_dequant run on their weights dequantised: fp8.project)."""
        lead = x.shape[:-1]
        if self.w_qkv is not None:
            dequant = dequant_in_prompt(self.q_proj, prompt)
            qg, k, v = linear(x, self.w_qkv, self.s_qkv, self.qkv_block, dequant, prompt).split(
                [2 * self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        else:
            qg, k, v = (project(m, x, prompt) for m in (self.q_proj, self.k_proj, self.v_proj))
        q = qg.view(*lead, self.hq, 2 * self.d)[..., :self.d]
        q = apply_rotary(self.q_norm(q), cos, sin, self.rd)
        k = apply_rotary(self.k_norm(k.view(*lead, self.hkv, self.d)), cos, sin, self.rd)
        # contiguous here, inside the compiled region, so the K/V write gets it without a copy
        v = v.view(*lead, self.hkv, self.d).contiguous()
        return q, k, v, qg

    def fuse_for_inference(self) -> None:
        fused = fuse_projections([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.w_qkv, self.s_qkv, self.qkv_block = fused

    def forward_train(self, x, cos, sin):
        q, k, v, qg = self._qkv(x, cos, sin)  # (B, L, heads, D)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=self.scale,
                                           enable_gqa=self.hq != self.hkv)
        return self.o_proj(self.gated(o.transpose(1, 2), qg))

    def gated(self, o: torch.Tensor, qg: torch.Tensor) -> torch.Tensor:
        """The attention output (..., hq, D) times sigmoid of the gate, the second half of each
        head's slice of the q/gate projection qg (..., hq * 2D), heads flattened."""
        gate = qg.view(*o.shape[:-2], self.hq, 2 * self.d)[..., self.d:]
        return (o * torch.sigmoid(gate)).flatten(-2)


#: the epsilon of the gated delta rule's q/k L2 norms (the checkpoint's convention)
L2NORM_EPS = 1e-6


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule, a depthwise causal conv and a gated norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.nk, self.nv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        #: value channels per key head (the in_proj's per-key-head [q | k | v | z] layout)
        self.vpk = (self.nv // self.nk) * self.dv
        self.conv_dim = args.conv_dim
        self.kernel = args.linear_conv_kernel_dim
        h = args.hidden_size
        self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * self.nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim,
                                bias=False, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.w_in: Optional[torch.Tensor] = None  # fused by fuse_for_inference()
        self.s_in: Optional[torch.Tensor] = None  # its FP8 block scales (None: float weights)
        self.in_block: Optional[tuple[int, int]] = None
        #: -exp(A_log) and dt_bias in float32 for ops.gated_delta_window_prep (fused)
        self.neg_a: Optional[torch.Tensor] = None
        self.dt_bias_f: Optional[torch.Tensor] = None

    def fuse_for_inference(self) -> None:
        fused = fuse_projections([self.in_proj_qkvz, self.in_proj_ba])
        if fused is not None:
            self.w_in, self.s_in, self.in_block = fused
        with torch.no_grad():
            self.neg_a = -self.A_log.detach().float().exp()
            self.dt_bias_f = self.dt_bias.detach().float().contiguous()

    def _project_qkvz(self, x: torch.Tensor, with_ba: bool = True, prompt: bool = False):
        """(qkvz, z, ba): the in_proj's qkvz columns in the checkpoint's per-key-head interleaved
        order ([q | k | v | z] per key head), z per value head, and the raw b/a columns (per key
        head [b | a]); ba None when not with_ba (unfused projections only). prompt: a prompt
        chunk's rows (FP8 projections marked prompt_dequant run dequantised: fp8.project)."""
        lead = x.shape[:-1]
        if self.w_in is not None:
            dequant = dequant_in_prompt(self.in_proj_qkvz, prompt)
            qkvz, ba = linear(x, self.w_in, self.s_in, self.in_block, dequant, prompt).split(
                [2 * self.key_dim + 2 * self.value_dim, 2 * self.nv], -1)
        else:
            qkvz = project(self.in_proj_qkvz, x, prompt)
            ba = project(self.in_proj_ba, x, prompt) if with_ba else None
        z = qkvz.view(*lead, self.nk, 2 * self.dk + 2 * self.vpk)[..., 2 * self.dk + self.vpk:]
        return qkvz, z.reshape(*lead, self.nv, self.dv), ba

    def ba_in_conv(self, dtype: torch.dtype) -> bool:
        """Whether windows compute ba inside the conv's launch (causal_conv_window_qkvz_ba): an
        FP8 in_proj_qkvz beside a float in_proj_ba (not fused, as the FP8 checkpoints keep it)
        would otherwise cost a GEMM launch of 2 nv outputs for ba alone, about what the FP8
        projection saves at decode sizes. Every window shape takes the same path."""
        ba = self.in_proj_ba
        return (self.w_in is None and isinstance(self.in_proj_qkvz, Fp8Linear)
                and isinstance(ba, nn.Linear) and ba.bias is None and ba.weight.dtype == dtype
                and ops.native("causal_conv_window_qkvz_ba"))

    def _project_raw(self, x: torch.Tensor, prompt: bool = False):
        """(mixed, z, ba): as _project_qkvz, with the conv's input [q | k | v] gathered."""
        qkvz, z, ba = self._project_qkvz(x, prompt=prompt)
        return reference.qkvz_mixed(qkvz, self.nk, self.dk, self.vpk), z, ba

    def _split_ba(self, ba: torch.Tensor):
        lead = ba.shape[:-1]
        r = self.nv // self.nk
        b, a = ba.view(*lead, self.nk, 2 * r).split([r, r], dim=-1)
        return b.reshape(*lead, self.nv), a.reshape(*lead, self.nv)

    def _project(self, x: torch.Tensor, prompt: bool = False):
        """Split the fused projections in the checkpoint's per-key-head interleaved order."""
        mixed, z, ba = self._project_raw(x, prompt)
        return (mixed, z) + self._split_ba(ba)

    def _heads(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        lead = mixed.shape[:-1]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(*lead, self.nk, self.dk)
        k = k.reshape(*lead, self.nk, self.dk)
        v = v.reshape(*lead, self.nv, self.dv).contiguous()  # the kernels take contiguous rows
        # (-exp(A_log) from the parameter here, not the fused copy: training differentiates it)
        q, k, g, beta = reference.gated_delta_inputs(q, k, b, a, -self.A_log.float().exp(),
                                                     self.dt_bias, self.dk ** -0.5, L2NORM_EPS)
        return q, k, v, g, beta

    def _out(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype,
             prompt: bool = False) -> torch.Tensor:
        out = self.norm(core.to(dtype), z)
        return project(self.out_proj, out.reshape(*out.shape[:-2], self.value_dim), prompt)

    def forward_seq(self, x: torch.Tensor, conv_init: torch.Tensor, rec_init: torch.Tensor,
                    valid: Optional[torch.Tensor] = None):
        """Whole sequences x (B, L, H) from given states; returns out, final conv and rec state.

        valid (B, L) bool marks real tokens, a prefix of each row; the padded tail after it gets
        zero decay and zero write strength, so it leaves the recurrent state as the real tokens
        left it, and the final conv state is taken after the last real token."""
        mixed, z, b, a = self._project(x, prompt=True)
        ext = torch.cat([conv_init.to(x.dtype), mixed.transpose(1, 2)], dim=-1)  # (B, C, K-1+L)
        conv = F.conv1d(ext, self.conv1d.weight, groups=self.conv_dim)
        mixed = F.silu(conv).transpose(1, 2)
        q, k, v, g, beta = self._heads(mixed, b, a)
        if valid is None:
            conv_final = ext[..., ext.shape[-1] - (self.kernel - 1):]
        else:
            real = valid.sum(-1, keepdim=True)  # (B, 1): ext columns real..real+K-2 are the last inputs
            cols = real + torch.arange(self.kernel - 1, device=x.device)
            conv_final = ext.gather(-1, cols[:, None, :].expand(-1, ext.shape[1], -1))
            g = g * valid[..., None]
            beta = beta * valid[..., None]
        # one opaque op in the compiled region: its chunk loop would unroll by the length
        core, rec_final = ops.chunk_rule(q, k, v, g, beta, rec_init)
        return self._out(core, z, x.dtype, prompt=True), conv_final, rec_final

    def factor_width(self) -> int:
        """Floats of one row and head's rank-one update factors [k | delta | decay]."""
        return self.dk + self.dv + 1

    def forward_window(self, x, conv_state, rec_state, group_slot, rec_out=None, prefetch=None):
        """Window grid x (NG, G, H); states of this layer for all lanes (read, not written).
        Returns (out, conv snapshots (NG, G, C, K-1), recurrent factors (NG, G, nv,
        factor_width)): each row's rank-one update [k | delta | decay] of the recurrent state,
        which the commit replays onto it (ops.commit_accepted), where a snapshot of the state
        after every row was Dk x Dv floats a head. rec_out: where the factors go (this layer's
        slice of the window's stacked factors, so that they are written once and never copied);
        None allocates. prefetch: ops.l2_prefetch's (token, tensors), issued after the input
        projection."""
        if rec_out is None:
            rec_out = x.new_empty(*x.shape[:2], self.nv, self.factor_width(), dtype=torch.float32)
        weight = self.conv1d.weight[:, 0, :]
        if self.ba_in_conv(x.dtype):  # the conv gathers q, k, v and its extra blocks project b/a
            qkvz, z, _ = self._project_qkvz(x, with_ba=False)
            if prefetch is not None:
                ops.l2_prefetch(*prefetch)
            mixed, conv_snaps, ba = ops.causal_conv_window_qkvz_ba(
                qkvz, conv_state, weight, group_slot, self.nk, self.dk, self.vpk, x,
                self.in_proj_ba.weight)
        elif ops.native("causal_conv_window_qkvz"):  # the conv gathers q, k, v: no concatenation
            qkvz, z, ba = self._project_qkvz(x)
            if prefetch is not None:
                ops.l2_prefetch(*prefetch)
            mixed, conv_snaps = ops.causal_conv_window_qkvz(
                qkvz, conv_state, weight, group_slot, self.nk, self.dk, self.vpk)
        else:
            mixed, z, ba = self._project_raw(x)
            if prefetch is not None:
                ops.l2_prefetch(*prefetch)
            mixed, conv_snaps = ops.causal_conv_window(mixed, conv_state, weight, group_slot)
        if self.neg_a is not None and ops.native("gated_delta_window_prep"):
            # the norms and gates inside the rule's kernel: five fewer kernels a layer
            core, rec_factors = ops.gated_delta_window_prep(
                mixed, ba, self.neg_a, self.dt_bias_f, rec_state, group_slot, self.nk, self.dk,
                self.dk ** -0.5, L2NORM_EPS, factors=rec_out)
            return self._out(core, z, x.dtype), conv_snaps, rec_factors
        q, k, v, g, beta = self._heads(mixed, *self._split_ba(ba))
        core, rec_factors = ops.gated_delta_window(q, k, v, g, beta, rec_state, group_slot,
                                                   factors=rec_out)
        return self._out(core, z, x.dtype), conv_snaps, rec_factors


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int, kind: str, moe: bool):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.mlp = SparseMoe(args) if moe else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        #: what ops.l2_prefetch declares it writes (it never does): keeps the call compiled in
        self.register_buffer("l2_token", torch.zeros(1, dtype=torch.int32), persistent=False)
        self.compile_regions(None)

    def _dense_prefetch(self):
        """ops.l2_prefetch's arguments for the weights this layer reads after its mixer's
        input projection (the mixer's output projection, the router), or None when the model
        prefetches nothing (ops.l2_prefetch_level): they stream into L2 while the conv and
        gated delta rule, or the K/V write and attention, run, kernels bound by latency."""
        if ops.l2_prefetch_level() < 1:
            return None
        mixer = (self.linear_attn.out_proj if self.kind == "linear_attention"
                 else self.self_attn.o_proj)
        router = getattr(self.mlp, "w_router", None)
        return self.l2_token, [t for t in (mixer.weight, router) if t is not None]

    def _ffn(self, x: torch.Tensor, prompt: bool = False,
             valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x), prompt, valid)

    # Pure regions of a window step (no state is written inside them), so each can be compiled
    # into a few fused kernels; the K/V write between attn_pre and attn_post stays outside.
    def window_linear(self, x, conv_state, rec_state, group_slot, rec_out=None):
        h, conv_snaps, rec_factors = self.linear_attn.forward_window(
            self.input_layernorm(x), conv_state, rec_state, group_slot, rec_out,
            self._dense_prefetch())
        return self._ffn(x + h), conv_snaps, rec_factors

    def window_attn_pre(self, x, cos, sin, prompt: bool = False):
        qkv = self.self_attn._qkv(self.input_layernorm(x), cos, sin, prompt)
        prefetch = None if prompt else self._dense_prefetch()
        if prefetch is not None:
            ops.l2_prefetch(*prefetch)
        return qkv

    def window_attn_post(self, x, q, qg, k_cache, v_cache, group_slot, group_pos, ctx: int,
                         split_keys: int = 0, prompt: bool = False, valid=None):
        a = self.self_attn
        o = ops.grouped_window_attention(q, k_cache, v_cache, group_slot, group_pos, ctx, a.scale,
                                         split_keys=split_keys)
        o = project(a.o_proj, a.gated(o.reshape(*x.shape[:-1], a.hq, a.d), qg), prompt)
        return self._ffn(x + o, prompt, valid)

    def prefill_linear(self, x, conv_init, rec_init, valid=None):
        h, conv, rec = self.linear_attn.forward_seq(self.input_layernorm(x), conv_init, rec_init, valid)
        return self._ffn(x + h, prompt=True, valid=valid), conv, rec

    def window_attention(self, x, cos, sin, k_cache, v_cache, group_slot, group_pos, ctx: int,
                         variant: str = "window", split_keys: int = 0, valid=None):
        """variant: `window` (compiled for decode windows) or `prefill` (compiled with dynamic
        lengths for prompt chunks); split_keys: fixed split-K chunks (engine.batch_invariant);
        valid: a padded prompt chunk's real rows (SparseMoe parks the others)."""
        pre, post = (self.c_attn_pre, self.c_attn_post) if variant == "window" else \
            (self.p_attn_pre, self.p_attn_post)
        q, k, v, qg = pre(x, cos, sin, variant == "prefill")
        ops.write_kv(k_cache, v_cache, k, v, group_slot, group_pos)
        return post(x, q, qg, k_cache, v_cache, group_slot, group_pos, ctx, split_keys,
                    variant == "prefill", valid)

    #: The pure regions of each layer kind: (attribute, method, variant).
    REGIONS = {"linear_attention": (("c_linear", "window_linear", "window"),
                                    ("p_linear", "prefill_linear", "prefill")),
               "full_attention": (("c_attn_pre", "window_attn_pre", "window"),
                                  ("c_attn_post", "window_attn_post", "window"),
                                  ("p_attn_pre", "window_attn_pre", "prefill"),
                                  ("p_attn_post", "window_attn_post", "prefill"))}

    def compile_regions(self, compile_fn=None, prefill_fn=None, shared: Optional[dict] = None) -> None:
        """Replace the pure regions by compiled versions: `compile_fn` for decode windows,
        `prefill_fn` for prompt chunks (eager where None). `shared` ((attribute) -> function
        taking the layer first) holds functions compiled once for every layer of this kind:
        the model passes it, so all its layers of a kind run one compiled function (dynamo
        inlines the module: its guards check types and shapes, not which layer it is)."""
        for attr, method, variant in self.REGIONS[self.kind]:
            if shared is not None and attr in shared:
                setattr(self, attr, types.MethodType(shared[attr], self))
                continue
            wrap = (compile_fn if variant == "window" else prefill_fn) or (lambda f: f)
            setattr(self, attr, wrap(getattr(self, method)))

    @classmethod
    def compiled_regions(cls, kind: str, compile_fn=None, prefill_fn=None) -> dict:
        """One compiled function per region of a layer kind, each taking the layer first."""
        out = {}
        for attr, method, variant in cls.REGIONS[kind]:
            wrap = (compile_fn if variant == "window" else prefill_fn) or (lambda f: f)
            out[attr] = wrap(getattr(cls, method))
        return out


class MTP(nn.Module):
    """Multi-token prediction: fc(cat[norm_e(embed(t[i+1])), norm_h(h[i])]) -> one decoder layer."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, args.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, args.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(args, 0, "full_attention", args.num_experts > 0)])
        self.norm = RMSNorm(h, args.rms_norm_eps)

    def fuse(self, hidden: torch.Tensor, next_emb: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        return project(self.fc, torch.cat([self.pre_fc_norm_embedding(next_emb),
                                           self.pre_fc_norm_hidden(hidden)], dim=-1), prompt)


class Qwen3Next(nn.Module):
    def __init__(self, args: ModelArgs, with_mtp: bool = True):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, t, args.is_moe_layer(i)) for i, t in enumerate(args.layer_types))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(args)
        self.mtp: Optional[MTP] = MTP(args) if with_mtp else None
        self.compile_regions(None)
        # Index of each layer among its kind, for the stacked state tensors.
        self.state_index = {}
        n_lin = n_full = 0
        for i, t in enumerate(args.layer_types):
            if t == "linear_attention":
                self.state_index[i] = n_lin
                n_lin += 1
            else:
                self.state_index[i] = n_full
                n_full += 1

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """embed_tokens(tokens) as one gather over every element: outside a compiled region the
        embedding's index_select runs a loop over the ids in each thread for up to 16 of them
        (8 us for a 16-row window on an H100, where the gather takes about 2)."""
        return self.embed_tokens.weight[tokens]

    @torch.no_grad()
    def fuse_for_inference(self, moe_dense_experts: int = 0, moe_dense_prefill: bool = False) -> None:
        """Fuse projections that read the same input into single matmuls (decode is launch-bound:
        this removes about 100 matmul launches from a solo window of the tiny model). The
        checkpoint's parameters become views of the fused weights, so saving still works.
        MoE blocks of at most `moe_dense_experts` experts always take the fused dense path;
        `moe_dense_prefill`: larger unquantised ones run long inputs dense (Experts)."""
        for m in self.modules():
            if isinstance(m, SparseMoe):
                m.fuse_for_inference(moe_dense_experts)
                m.experts.dense_prefill = moe_dense_prefill
            elif m is not self and hasattr(m, "fuse_for_inference"):
                m.fuse_for_inference()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of a window's or a prompt chunk's last rows (few: fp8.project)."""
        return project(self.lm_head, hidden)

    @torch.no_grad()
    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """A copy of the LM head's rows for the token ids `ids` (dequantised where the head is
        FP8), in the model's dtype: a draft vocabulary's head (engine.draft_vocab)."""
        head = self.lm_head
        ids = ids.to(device=head.weight.device, dtype=torch.long)
        if isinstance(head, Fp8Linear):
            weight = reference.dequant_fp8_block(head.weight, head.weight_scale_inv, head.block,
                                                 self.dtype)
        else:
            weight = head.weight
        return weight.index_select(0, ids).contiguous()

    # ---- whole sequences, no cache -------------------------------------------------------
    def forward_train(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, L) -> final hidden states (B, L, H) after model.norm."""
        b, length = tokens.shape
        x = self.embed_tokens(tokens)
        cos, sin = self.rotary(torch.arange(length, device=tokens.device), x.dtype)
        for layer in self.layers:
            h = layer.input_layernorm(x)
            if layer.kind == "linear_attention":
                la = layer.linear_attn
                conv0 = torch.zeros(b, la.conv_dim, la.kernel - 1, dtype=x.dtype, device=x.device)
                rec0 = torch.zeros(b, la.nv, la.dk, la.dv, dtype=torch.float32, device=x.device)
                h, _, _ = la.forward_seq(h, conv0, rec0)
            else:
                h = layer.self_attn.forward_train(h, cos, sin)
            x = layer._ffn(x + h)
        return self.norm(x)

    def mtp_train(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """MTP over whole sequences: row i uses (h[i], t[i+1]) and predicts t[i+2].

        hidden (B, L, H), tokens (B, L) -> MTP hidden (B, L-1, H) after mtp.norm.
        """
        assert self.mtp is not None
        x = self.mtp.fuse(hidden[:, :-1], self.embed_tokens(tokens[:, 1:]))
        cos, sin = self.rotary(torch.arange(x.shape[1], device=x.device), x.dtype)
        layer = self.mtp.layers[0]
        x = layer._ffn(x + layer.self_attn.forward_train(layer.input_layernorm(x), cos, sin))
        return self.mtp.norm(x)

    # ---- one lane's prompt chunk -----------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, lane, start, state: DecodeState,
                length: Optional[torch.Tensor] = None, ctx: Optional[int] = None) -> torch.Tensor:
        """Run prompt tokens (L,) of `lane` at positions start..start+L-1, writing its KV, conv
        and recurrent state. Returns final hidden states (L, H) after model.norm.

        lane and start are ints or (1,) int64 device tensors (graph-captured chunks read them
        from device buffers). With `length` ((1,) int64), only the first `length` tokens are the
        prompt and the rest padding: their K/V rows land past the prompt, where decoding writes
        before it reads, and they leave the DeltaNet state alone. `ctx` (attention positions
        read) defaults to start + L and must cover the real tokens.

        Several lanes' chunks at once (engine.prefill_slots): tokens (S, L) and lane, start,
        length (S,) tensors of distinct lanes, each row a segment as above; returns (S, L, H).
        Only the row-wise parts (projections, MoE) see all S L rows together."""
        grid = tokens.dim() == 2
        x = self.embed(tokens if grid else tokens[None])  # (S, L, H): a window grid
        out = self.p_norm(self.prefill_layers(x, lane, start, state, length, ctx))
        return out if grid else out[0]

    def prefill_layers(self, x: torch.Tensor, lane, start, state: DecodeState,
                       length: Optional[torch.Tensor] = None, ctx: Optional[int] = None) -> torch.Tensor:
        """The decoder layers of `prefill` over embedded (or handed-over) x (S, L, H), S = 1 but
        for several lanes' chunks: what a pipeline stage runs for its layer range. Returns x
        after the last layer, before the norm."""
        n = x.shape[1]
        dev = x.device
        lane_t = torch.as_tensor(lane, dtype=torch.long, device=dev).reshape(-1)
        start_t = torch.as_tensor(start, dtype=torch.long, device=dev).reshape(-1)
        cos, sin = self.p_rope(start_t, n)
        ctx = int(start_t.max()) + n if ctx is None else ctx
        valid = None if length is None else \
            torch.arange(n, device=dev)[None] < length.reshape(-1, 1)
        for i, layer in enumerate(self.layers):
            j = self.state_index[i]
            if layer.kind == "linear_attention":
                x, conv, rec = layer.p_linear(x, state.conv[j].index_select(0, lane_t),
                                              state.rec[j].index_select(0, lane_t), valid)
                state.conv[j].index_copy_(0, lane_t, conv.to(state.conv.dtype))
                state.rec[j].index_copy_(0, lane_t, rec)
            else:
                x = layer.window_attention(x, cos, sin, state.k[j], state.v[j], lane_t, start_t, ctx,
                                           variant="prefill", valid=valid)
        return x

    # ---- the window grid ---------------------------------------------------------------------
    def verify_window(self, tokens: torch.Tensor, group_slot: torch.Tensor, group_pos: torch.Tensor,
                      ctx: int, state: DecodeState, split_keys: int = 0):
        """tokens (NG, G) at positions group_pos[g] + j of lanes group_slot[g]; split_keys > 0
        fixes the attention kernels' split-K chunks (engine.batch_invariant).

        Writes candidate K/V rows; DeltaNet states are read, not written. Returns hidden
        (NG, G, H) after model.norm, logits (NG, G, V), and per row of every linear-attention
        layer what ops.commit_accepted takes: rec, the recurrent state's rank-one update
        factors (L, NG, G, Hv, Dk + Dv + 1), and conv, the conv state's snapshots
        (L, NG, G, C, K-1).
        """
        x, rec_factors, conv_snaps = self.window_layers(self.embed(tokens), group_slot,
                                                        group_pos, ctx, state, split_keys)
        hidden, logits = self.c_head(x)
        return hidden, logits, rec_factors, conv_snaps

    def window_layers(self, x: torch.Tensor, group_slot: torch.Tensor, group_pos: torch.Tensor,
                      ctx: int, state: DecodeState, split_keys: int = 0):
        """The decoder layers of `verify_window` over embedded (or handed-over) x (NG, G, H):
        what a pipeline stage runs for its layer range. Returns x after the last layer (before
        the norm), the stacked DeltaNet recurrent factors and conv snapshots (zero layers when
        the model has none)."""
        ng, g = x.shape[:2]
        cos, sin = self.c_rope(group_pos, g)
        # every linear-attention layer writes its rows' rank-one update factors [k | delta |
        # decay] into its slice of one tensor (stacking them afterwards would copy them); the
        # commit replays the accepted rows onto the state, where snapshots of the state after
        # every row wrote Dk x Dv floats a row and head (2 MB a row and layer at the 80B's)
        nh, dk, dv = state.rec.shape[2:]
        rec_factors = torch.empty(state.rec.shape[0], ng, g, nh, dk + dv + 1,
                                  dtype=torch.float32, device=x.device)
        conv_snaps = []
        for i, layer in enumerate(self.layers):
            j = self.state_index[i]
            if layer.kind == "linear_attention":
                x, cs, _ = layer.c_linear(x, state.conv[j], state.rec[j], group_slot,
                                          rec_factors[j])
                conv_snaps.append(cs)
            else:
                x = layer.window_attention(x, cos, sin, state.k[j], state.v[j], group_slot,
                                           group_pos, ctx, split_keys=split_keys)
        if not conv_snaps:  # a layer range without DeltaNet layers commits nothing
            return x, rec_factors, state.conv.new_empty((0, ng, g) + tuple(state.conv.shape[2:]))
        return x, rec_factors, torch.stack(conv_snaps)

    def rope(self, group_pos: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (NG, rows, rotary_dim) for the positions group_pos[g] + j, j < rows (a pure
        region: compiled, the positions and both tables are one kernel)."""
        pos = group_pos[:, None] + torch.arange(rows, device=group_pos.device)[None]
        return self.rotary(pos, self.embed_tokens.weight.dtype)

    def head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.norm(x)
        return hidden, self.logits(hidden)

    def mtp_fuse_tokens(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """mtp.fuse of hidden and the next tokens' embeddings, the lookup inside the region (a
        pure one): compiled, the gather is part of the embedding norm's kernel, where looked up
        outside it was a kernel of its own in every draft step."""
        return self.mtp.fuse(hidden, self.embed_tokens(next_tokens))

    def mtp_fuse_prompt(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """mtp_fuse_tokens for a prompt chunk's rows (fp8.project's prompt path)."""
        return self.mtp.fuse(hidden, self.embed_tokens(next_tokens), prompt=True)

    def compile_regions(self, compile_fn=None, prefill_fn=None) -> None:
        """Compile the pure regions of window steps (`compile_fn`) and of prompt chunks
        (`prefill_fn`, dynamic lengths); None restores the eager versions."""
        wrap = compile_fn or (lambda f: f)
        pwrap = prefill_fn or (lambda f: f)
        # One compiled function per region and layer kind, shared by every layer of the kind
        # (and the MTP layer): compiling costs once per kind and shape, not once per layer.
        shared = {kind: DecoderLayer.compiled_regions(kind, compile_fn, prefill_fn)
                  for kind in DecoderLayer.REGIONS}
        for layer in self.layers:
            layer.compile_regions(compile_fn, prefill_fn, shared[layer.kind])
        self.c_head = wrap(self.head)
        self.c_rope = wrap(self.rope)
        self.p_rope = pwrap(self.rope)
        self.p_norm = pwrap(self.norm.forward)
        if self.mtp is not None:
            self.mtp.layers[0].compile_regions(compile_fn, prefill_fn, shared["full_attention"])
            self.c_mtp_fuse = wrap(self.mtp_fuse_tokens)
            self.c_mtp_norm = wrap(self.mtp.norm.forward)
            self.p_mtp_fuse = pwrap(self.mtp_fuse_prompt)
            self.p_mtp_norm = pwrap(self.mtp.norm.forward)

    def mtp_window(self, hidden: torch.Tensor, next_tokens: torch.Tensor, group_slot: torch.Tensor,
                   group_pos: torch.Tensor, ctx: int, state: DecodeState, with_logits: bool = True,
                   variant: str = "window", valid: Optional[torch.Tensor] = None):
        """MTP over a grid: row (g, j) at position group_pos[g]+j combines h of that row with the
        embedding of the token that follows it; writes the lane's MTP K/V rows. Returns MTP
        hidden (NG, G, H) after mtp.norm and logits (NG, G, V) (None unless with_logits).
        valid (NG, G) bool, a padded prompt chunk's real rows (variant prefill), as the decoder
        layers get them: the padding is parked in the MoE, and the prompt regions run one graph
        for both (without it the MTP layer's compiled twice, once with and once without)."""
        assert self.mtp is not None
        fuse, norm = (self.c_mtp_fuse, self.c_mtp_norm) if variant == "window" else \
            (self.p_mtp_fuse, self.p_mtp_norm)
        x = fuse(hidden, next_tokens)
        cos, sin = (self.c_rope if variant == "window" else self.p_rope)(group_pos, x.shape[1])
        x = self.mtp.layers[0].window_attention(x, cos, sin, state.mtp_k, state.mtp_v, group_slot,
                                                group_pos, ctx, variant=variant, valid=valid)
        out = norm(x)
        return out, (self.logits(out) if with_logits else None)
