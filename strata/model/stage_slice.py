"""A pipeline stage's part of the network: a consecutive range of decoder layers, plus the
embedding on the first stage and the final norm, LM head, MTP layer (and the embedding the MTP
reads) on the last.

A stage model is a `Qwen3Next` built from the stage's own ModelArgs (its layer range as if it
were the whole model), so its DecodeState, state indices and layer loops cover only its layers.
Modules the stage does not own stay on the meta device (no memory). Parameter names, though,
are those of the whole model (`layers.<global index>.*`): `global_view` presents the owned
modules under them, so seeded dummy weights and checkpoint keys match a one-stage model exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.nn as nn

from strata.model.config import CheckpointError, ModelArgs


@dataclass(frozen=True)
class StageSlice:
    start: int  # first decoder layer (global index)
    stop: int   # one past the last
    first: bool
    last: bool

    def check(self, n_layers: int) -> None:
        if not 0 <= self.start < self.stop <= n_layers:
            raise CheckpointError(f"engine.stage_layers: layers {self.start}..{self.stop - 1} are "
                                  f"not inside the model's {n_layers} layers")

    def owned(self) -> tuple[str, ...]:
        """Top-level modules (besides its layers) this stage holds."""
        names = ()
        if self.first or self.last:
            names += ("embed_tokens",)  # the last stage's MTP embeds its next tokens
        if self.last:
            names += ("norm", "lm_head", "mtp")
        return names


def stage_args(args: ModelArgs, sl: StageSlice) -> ModelArgs:
    """The stage's layers as a model of their own: layer kinds and MoE/dense choice by global
    index (expressed as mlp_only_layers, so the local indices need no sparse step)."""
    sl.check(args.num_hidden_layers)
    n = sl.stop - sl.start
    dense = [j for j in range(n) if not args.is_moe_layer(sl.start + j)] if args.num_experts else []
    return replace(args, num_hidden_layers=n, layer_types=list(args.layer_types[sl.start:sl.stop]),
                   mlp_only_layers=dense, decoder_sparse_step=1)


def global_view(model: nn.Module, sl: StageSlice) -> nn.Module:
    """A module holding the stage model's owned parts under the whole model's names."""
    view = nn.Module()
    for name in sl.owned():
        child = getattr(model, name, None)
        if child is not None:
            view.add_module(name, child)
    layers = nn.Module()
    for j, layer in enumerate(model.layers):
        layers.add_module(str(sl.start + j), layer)
    view.add_module("layers", layers)
    view.args = model.args
    return view
