"""Routed experts at the 80B shapes (E=512 + the folded shared expert, top-10 + 1, H=2048, I=512,
FP8 128x128), the down kernel on CUDA cores against tensor cores (down_mma), 1-64 rows:
CUDA-graph replay medians per call (gate/up and down together), the down kernel's own time (the
profiler, its programmatic launch off), % of the copy ceiling on the distinct experts' bytes."""
import statistics
import sys

import torch

sys.path.insert(0, "tests")
from test_moe_kernels import experts, routing  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

FP8 = torch.float8_e4m3fn
E, H, I, k = 513, 2048, 512, 11
COPY = 4.3e12  # bytes/s, the measured copy ceiling (REAL_SCALE_NOTES)
weights = experts(E, H, I, FP8, (128, 128), device="cuda")


def setup(rows):
    w, ids = routing(rows, k, E, hot=[512], device="cuda")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, H, generator=gen).to("cuda", torch.bfloat16)
    out = torch.empty_like(x)
    ws = torch.empty(C.moe_workspace_numel(rows, k, I, H), device="cuda")
    distinct = len(set(ids.flatten().tolist()))
    return (lambda: C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128), out=out,
                                      workspace=ws)), out, distinct


def timed(rows, down_mma):
    C.moe_launch_options(down_mma=down_mma, pdl=True)
    run, out, distinct = setup(rows)
    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            run()
    ts = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / 20)
    C.moe_launch_options(pdl=False)
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    down = [ev.device_time_total / ev.count for ev in prof.key_averages()
            if "down_stream" in ev.key]
    C.moe_launch_options(pdl=True)
    return statistics.median(ts), (down or [0.0])[0], out.clone(), distinct


import os  # noqa: E402

for rows in (1, 2, 4, 8, 16, 32, 64) if len(sys.argv) < 2 else map(int, sys.argv[1].split(",")):
    t0, d0, o0, distinct = timed(rows, False)
    t1, d1, o1, _ = timed(rows, True)
    floor_us = distinct * 3 * 2048 * 512 / COPY * 1e6
    rel = ((o1.float() - o0.float()).norm() / o0.float().norm()).item()
    print(f"rows {rows:2d}: cuda cores {t0:6.1f} us (down {d0:6.1f}, {floor_us / t0:4.0%}) | "
          f"tensor cores {t1:6.1f} us (down {d1:6.1f}, {floor_us / t1:4.0%}) {t1 / t0 - 1:+.1%} "
          f"rel diff {rel:.1e}", flush=True)
