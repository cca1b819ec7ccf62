"""Per-lane decode state: attention KV, DeltaNet conv and recurrent state, MTP KV.

Lane `lanes` (the last one) is scratch: padding groups of a window point at it, so whatever
they write lands where nothing reads. Layouts are those of strata/kernels/reference.py.
"""

from __future__ import annotations

import torch

from strata.model.config import ModelArgs


class DecodeState:
    def __init__(self, args: ModelArgs, lanes: int, max_context: int, dtype: torch.dtype,
                 device: torch.device | str, with_mtp: bool, spare_rows: int = 0,
                 stacks: tuple[int, int] | None = None):
        """`spare_rows` positions past max_context take the writes of padding rows and chained
        drafts of a slot at the end of its context, so they never land on a live row.
        `stacks`: (full-attention, linear-attention) layers the K/V and DeltaNet stacks are
        allocated for, at least the model's: a compile worker's model is the first few layers
        of the engine's, and compiled regions guard on the size of the stack their views come
        from, so its state keeps the engine's stack sizes (strata/engine/compile_workers.py)."""
        self.lanes = lanes
        self.scratch = lanes
        self.max_context = max_context
        n = lanes + 1
        capacity = max_context + spare_rows
        n_full = len(args.full_layers)
        n_lin = len(args.linear_layers)
        full_stack, lin_stack = stacks or (n_full, n_lin)
        full_stack, lin_stack = max(full_stack, n_full, 1), max(lin_stack, n_lin)
        kv = (n, capacity, args.num_key_value_heads, args.head_dim)
        self.k = torch.zeros((full_stack,) + kv, dtype=dtype, device=device)[:n_full]
        self.v = torch.zeros((full_stack,) + kv, dtype=dtype, device=device)[:n_full]
        self.conv = torch.zeros(lin_stack, n, args.conv_dim, args.linear_conv_kernel_dim - 1,
                                dtype=dtype, device=device)
        self.rec = torch.zeros(lin_stack, n, args.linear_num_value_heads, args.linear_key_head_dim,
                               args.linear_value_head_dim, dtype=torch.float32, device=device)
        if lin_stack > n_lin:  # (a view only where the stack is larger: the engine's are not)
            self.conv, self.rec = self.conv[:n_lin], self.rec[:n_lin]
        self.with_mtp = with_mtp
        mtp_shape = kv if with_mtp else (n, 1, args.num_key_value_heads, args.head_dim)
        # views into a stack of one, as self.k[j] / self.v[j] are into theirs: a compiled prompt
        # region guards on its K/V cache's base, so the MTP layer then runs the decoder layers'
        # graph instead of tracing one of its own
        self.mtp_k = torch.zeros((1,) + mtp_shape, dtype=dtype, device=device)[0]
        self.mtp_v = torch.zeros((1,) + mtp_shape, dtype=dtype, device=device)[0]

    def reset_lanes(self, lanes: "torch.Tensor") -> None:
        """Fresh requests in `lanes` (a device index tensor) start from zero DeltaNet state;
        stale K/V rows are masked by position."""
        self.conv.index_fill_(1, lanes, 0)
        self.rec.index_fill_(1, lanes, 0)

    @staticmethod
    def bytes_per_lane(args: ModelArgs, max_context: int, dtype: torch.dtype, with_mtp: bool) -> dict:
        """Device bytes one lane needs, split into main state and MTP draft state."""
        el = torch.empty((), dtype=dtype).element_size()
        kv_row = 2 * args.num_key_value_heads * args.head_dim * el
        main = len(args.full_layers) * max_context * kv_row
        main += len(args.linear_layers) * (
            args.conv_dim * (args.linear_conv_kernel_dim - 1) * el
            + args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4)
        draft = max_context * kv_row if with_mtp else 0
        return {"main": main, "draft": draft}
