#!/usr/bin/env python3
"""Run scripts/bench_engine.py with inductor settings changed first (a measurement of what the
settings cost the warm-up, not an engine knob):

    python3 docs/bench/s38/device/inductor_run.py triton.autotune_pointwise=0 -- BENCH_ARGS...

Each KEY=VALUE before `--` sets torch._inductor.config's KEY (dotted) to the int VALUE. At exit
it prints torch's compile-time table (dynamo, AOT, inductor, by phase): where the warm-up's
compile time goes."""
import atexit
import runpy
import sys
from pathlib import Path

import torch._inductor.config as inductor_config
from torch._dynamo.utils import compile_times


def report() -> None:
    """The compile-time table summed over graphs (its 14 largest phases) and the cache counters."""
    from torch._dynamo.utils import counters

    totals = sorted(_phase_totals(), reverse=True)
    print("inductor_run: compile time by phase (s, calls):", flush=True)
    for total, n, name in totals[:14]:
        print(f"  {total:8.1f} {n:4d}  {name}", flush=True)
    hits = {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
            if "cache" in k}
    print(f"inductor_run: caches {hits}", flush=True)


def _phase_totals() -> list[tuple[float, int, str]]:
    out = []
    for line in compile_times(repr="str").splitlines()[2:]:
        name, *values = line.split(", ")
        try:
            times = [float(v) for v in values]
        except ValueError:
            continue
        out.append((sum(times), len(times), name))
    return out


atexit.register(report)
sep = sys.argv.index("--")
for item in sys.argv[1:sep]:
    key, value = item.split("=", 1)
    *path, leaf = key.split(".")
    obj = inductor_config
    for part in path:
        obj = getattr(obj, part)
    if not hasattr(obj, leaf):
        raise SystemExit(f"inductor_run: no inductor setting {key}")
    setattr(obj, leaf, type(getattr(obj, leaf))(int(value)))
    print(f"inductor_run: {key} = {getattr(obj, leaf)!r}", flush=True)
script = Path(__file__).resolve().parents[4] / "scripts" / "bench_engine.py"
sys.argv = [str(script)] + sys.argv[sep + 1:]
sys.path.insert(0, str(script.parent))
runpy.run_path(str(script), run_name="__main__")
