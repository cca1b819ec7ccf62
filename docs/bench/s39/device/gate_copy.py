#!/usr/bin/env python3
"""Run a script with the attention's output gate returned as a contiguous copy (what engines
with compile workers run, copy_attention_gates), where engines without them take it as a view
of the q/k/v projection: what the copy costs a window (a measurement, not an engine switch):

    python3 docs/bench/s39/device/gate_copy.py scripts/profile_window.py ARGS...

(Session 39's `calls.sh g` ran before the view became the default: its `gate_view.py` patched
in the view where the model copied; the comparison is the same.)
"""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from strata.model.qwen3_next import Attention  # noqa: E402

init = Attention.__init__


def init_gate_copied(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.gate_copy = True


Attention.__init__ = init_gate_copied
print("gate_copy: the attention's gate is a contiguous copy", flush=True)
script = Path(sys.argv[1]).resolve()
sys.argv = sys.argv[1:]
sys.path.insert(0, str(script.parent))
runpy.run_path(str(script), run_name="__main__")
