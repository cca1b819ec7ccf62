#!/usr/bin/env python3
"""Run a script with the attention's output gate returned as a view of the q/k/v projection
(as before the compile workers), not the contiguous copy the model made when this was written
(since then only for compile workers: copy_attention_gates): what the copy costs a window (a
measurement, not an engine switch):

    python3 docs/bench/s39/device/gate_view.py scripts/profile_window.py ARGS...
"""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from strata.model import qwen3_next  # noqa: E402
from strata.model.qwen3_next import apply_rotary, linear  # noqa: E402


def qkv_gate_view(self, x, cos, sin):
    lead = x.shape[:-1]
    if self.w_qkv is not None:
        qg, k, v = linear(x, self.w_qkv, self.s_qkv, self.qkv_block).split(
            [2 * self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
    else:
        qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    q, gate = qg.view(*lead, self.hq, 2 * self.d).chunk(2, dim=-1)
    q = apply_rotary(self.q_norm(q), cos, sin, self.rd)
    k = apply_rotary(self.k_norm(k.view(*lead, self.hkv, self.d)), cos, sin, self.rd)
    return q, k, v.view(*lead, self.hkv, self.d).contiguous(), gate


qwen3_next.Attention._qkv = qkv_gate_view
print("gate_view: the attention's gate is a view of the projection", flush=True)
script = Path(sys.argv[1]).resolve()
sys.argv = sys.argv[1:]
sys.path.insert(0, str(script.parent))
runpy.run_path(str(script), run_name="__main__")
