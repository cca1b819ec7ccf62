"""Time one decode window three ways (eager, graph replay, replay + host step) and list the
heaviest kernels of an eager window, for a given group count G rows and context tier.

    python scripts/profile_window.py --device cuda --groups 1 --rows 4
    python scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 \
        --backend auto --groups 4 --rows 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from strata.config import EMBEDDED_MODEL_DIR  # noqa: E402
from strata.engine.verifier import SlotBuffers, Verifier  # noqa: E402
from strata.kernels import ops  # noqa: E402
from strata.model.loader import load_checkpoint  # noqa: E402
from strata.model.state import DecodeState  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=EMBEDDED_MODEL_DIR)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--trace", default=None, help="write a chrome trace of one eager window")
    ap.add_argument("--compile", action="store_true", help="torch.compile the window regions")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto", help="model.load_format: auto, safetensors or dummy")
    ap.add_argument("--layers", type=int, default=None, help="model.num_layers (dummy weights only)")
    ap.add_argument("--json", default=None, help="write every kernel's count and time here")
    ap.add_argument("--filtered", action="store_true",
                    help="use the top-k/top-p (sorting) sampler instead of the sort-free one")
    a = ap.parse_args()
    dev = torch.device(a.device)
    ops.set_backend(a.backend, dev.type)
    lm = load_checkpoint(a.model, a.dtype, dev, log=lambda s: None, load_format=a.load_format,
                         num_layers=a.layers)
    lanes = max(a.groups, 1)
    state = DecodeState(lm.args, lanes, 2048, lm.dtype, dev, lm.has_mtp, spare_rows=16)
    bufs = SlotBuffers(lanes, lm.args.hidden_size, lm.dtype, dev)
    ver = Verifier(lm.model, state, bufs, lm.has_mtp)
    if a.compile:
        lm.model.compile_regions(lambda f: torch.compile(f, dynamic=None))
        ver.sample = torch.compile(ver.sample, dynamic=None)
        ver.sample_plain = torch.compile(ver.sample_plain, dynamic=None)
        ver.accepted_prefix = torch.compile(ver.accepted_prefix, dynamic=None)
    gs = torch.arange(a.groups, device=dev)
    gp = torch.full((a.groups,), 100, device=dev)
    rows = torch.full((a.groups,), a.rows, device=dev)

    def fn():
        gp.fill_(100)  # keep positions fixed so every iteration is the same work
        return ver.window(gs, gp, rows, a.rows, a.ctx, a.filtered)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        fn()
    sync()
    eager = (time.perf_counter() - t0) / a.iters
    print(f"eager window: {eager * 1e6:.1f} us  (groups={a.groups} rows={a.rows} ctx={a.ctx} "
          f"filtered={a.filtered})")
    if dev.type == "cuda":
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.graph(g, stream=s):
            out = fn()
        for _ in range(3):
            g.replay()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            g.replay()
        sync()
        rep = (time.perf_counter() - t0) / a.iters
        t0 = time.perf_counter()
        for _ in range(a.iters):
            g.replay()
            out.tolist()
        per = (time.perf_counter() - t0) / a.iters
        print(f"graph replay: {rep * 1e6:.1f} us; replay + readback: {per * 1e6:.1f} us; "
              f"speedup vs eager {eager / rep:.1f}x")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        evs = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        n_kernels = sum(e.count for e in evs)
        print(f"kernels per eager window: {n_kernels}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
        if a.trace:
            prof.export_chrome_trace(a.trace)
        if a.json:
            import json

            rows = sorted(((e.key, e.count, e.device_time_total) for e in evs), key=lambda r: -r[2])
            Path(a.json).write_text(json.dumps({
                "groups": a.groups, "rows": a.rows, "ctx": a.ctx, "eager_us": eager * 1e6,
                "replay_us": rep * 1e6, "kernels": n_kernels,
                "by_kernel": [{"name": k, "count": c, "us": round(t, 2)} for k, c, t in rows]}, indent=1))


if __name__ == "__main__":
    main()
