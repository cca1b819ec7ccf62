"""Checkpoint key <-> module parameter mapping, kept apart from the math.

Hugging Face `qwen3_next` checkpoints store `model.*` for the network, `lm_head.weight`, the MTP
module under `mtp.*`, and routed experts one tensor per expert
(`...mlp.experts.{e}.gate_proj.weight` (I, H), `up_proj` (I, H), `down_proj` (H, I)), which
strata keeps stacked (`experts.w_gate_up` (E, 2I, H), `experts.w_down` (E, H, I)). In FP8 block
checkpoints each expert weight has a `weight_scale_inv` beside it, stacked the same way into
`experts.gu_scale` (gate block rows, then up block rows) and `experts.down_scale`.
Other layouts (Qwen3.5's fused experts, `model.language_model.` prefix, split in_proj) are
added here as another `KeyMap`, with no change to the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
#: Stacked expert parameter of (part is down, the tensor is a scale).
_STACKED = {(False, False): "w_gate_up", (True, False): "w_down",
            (False, True): "gu_scale", (True, True): "down_scale"}


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter, and for experts the expert slice."""
    param: str
    expert: Optional[int] = None
    part: Optional[str] = None  # gate | up | down


@dataclass(frozen=True)
class KeyMap:
    name: str
    prefixes: tuple[str, ...]  # stripped from network keys (tried in order)

    def to_target(self, key: str) -> Optional[Target]:
        """The parameter a checkpoint key loads into, or None for an unknown key."""
        if key.startswith("mtp.") or key == "lm_head.weight":
            name = key
        else:
            for p in self.prefixes:
                if key.startswith(p):
                    name = key[len(p):]
                    break
            else:
                return None
        m = _EXPERT.match(name)
        if m:
            base, e, kind, what = m.groups()
            part = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}[kind]
            param = f"{base}.{_STACKED[(part == 'down', what == 'weight_scale_inv')]}"
            return Target(param, int(e), part)
        return Target(name)

    def checkpoint_keys(self, param: str, shape: tuple[int, ...]) -> list[tuple[str, Target]]:
        """The checkpoint keys that together make up one parameter (for saving)."""
        if param.startswith("mtp.") or param == "lm_head.weight":
            base = param
        else:
            base = self.prefixes[0] + param
        leaf = param.rsplit(".", 1)[-1]
        if ".experts." in param and leaf in _STACKED.values():
            stem = base.rsplit(".", 1)[0]
            what = "weight_scale_inv" if leaf.endswith("scale") else "weight"
            out = []
            for e in range(shape[0]):
                if leaf in ("w_down", "down_scale"):
                    out.append((f"{stem}.{e}.down_proj.{what}", Target(param, e, "down")))
                else:
                    out.append((f"{stem}.{e}.gate_proj.{what}", Target(param, e, "gate")))
                    out.append((f"{stem}.{e}.up_proj.{what}", Target(param, e, "up")))
            return out
        return [(base, Target(param))]


QWEN3_NEXT = KeyMap("qwen3_next", ("model.", "model.language_model."))
