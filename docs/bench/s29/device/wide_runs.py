"""Routed experts at the 80B shapes (E=512 + the folded shared expert, top-10 + 1, H=2048, I=512,
FP8 128x128) in wide launches: CUDA-graph replay medians per call at 32 and 64 rows for the down
kernel's run lengths (down_split_runs 0 = the rule, 1, 2, 4, 8; the same bits) and with the down
kernel's programmatic launch off, then each kernel's own time by the profiler (pdl off)."""
import statistics
import sys

import torch

sys.path.insert(0, "tests")
from test_moe_kernels import experts, routing  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

FP8 = torch.float8_e4m3fn
E, H, I, k = 513, 2048, 512, 11
weights = experts(E, H, I, FP8, (128, 128), device="cuda")


def setup(rows):
    w, ids = routing(rows, k, E, hot=[512], device="cuda")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, H, generator=gen).to("cuda", torch.bfloat16)
    out = torch.empty_like(x)
    ws = torch.empty(C.moe_workspace_numel(rows, k, I, H), device="cuda")
    return lambda: C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128), out=out,
                                     workspace=ws), out


def timed(rows, **opts):
    C.moe_launch_options(**opts)
    run, out = setup(rows)
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
    return statistics.median(ts), out.clone()


for rows in (32, 64):
    base, ref = timed(rows, down_split_runs=0, pdl=True)
    print(f"rows {rows}: rule {base:.1f} us", flush=True)
    for r in (1, 2, 4, 8):
        t, o = timed(rows, down_split_runs=r, pdl=True)
        print(f"rows {rows}: runs {r} {t:.1f} us ({t / base - 1:+.1%}) same bits {torch.equal(o, ref)}",
              flush=True)
    t, o = timed(rows, down_split_runs=0, pdl=False)
    print(f"rows {rows}: pdl off {t:.1f} us ({t / base - 1:+.1%}) same bits {torch.equal(o, ref)}",
          flush=True)
    C.moe_launch_options(down_split_runs=0, pdl=False)
    run, _ = setup(rows)
    run(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            print(f"rows {rows}: {ev.device_time_total / ev.count:8.1f} us x{ev.count:3d} {ev.key[:90]}",
                  flush=True)
    C.moe_launch_options(pdl=True)
