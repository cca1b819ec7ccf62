"""Routed experts of a prompt chunk at the 80B shapes (E=512 + the folded shared expert, top-10
+ 1, H=2048, I=512, FP8 128x128, prompt rows) in one wide launch (wide_rows 512), the gate/up
as moe_gate_up_mma (items of expert x tile dealt round-robin, x read from L2) against
moe_gate_up_runs (moe_launch_options(gate_up_runs=True): member runs of 16, contiguous ranges,
the run's x in shared memory): CUDA-graph replay per call, each kernel's own time (the
profiler), % of the copy ceiling on one pass over the distinct experts, and the bits."""
import sys

import torch

sys.path.insert(0, "tests")
sys.path.insert(0, "scripts")
from bench_kernels import time_calls  # noqa: E402
from test_moe_kernels import experts, routing  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

FP8 = torch.float8_e4m3fn
E, H, I, k = 513, 2048, 512, 11
COPY = 4.3e12  # bytes/s, the measured copy ceiling (REAL_SCALE_NOTES)
EXPERT_BYTES = 3 * H * I + (2 * I // 128 * H // 128 + H // 128 * I // 128) * 4  # FP8 + scales
weights = experts(E, H, I, FP8, (128, 128), device="cuda")


def timed(rows, runs):
    C.moe_launch_options(fp8_wide=True, wide_rows=512, pdl=True, gate_up_runs=runs)
    w, ids = routing(rows, k, E, hot=[512], device="cuda")
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows)).to("cuda", torch.bfloat16)
    out = torch.empty_like(x)
    ws = torch.empty(C.moe_workspace_numel(rows, k, I, H), device="cuda")
    run = lambda: C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128), out=out,  # noqa: E731
                                    workspace=ws, prompt=True)
    t = time_calls([run], min_calls=10)[0] * 1e6  # us per call, graph-replayed
    C.moe_launch_options(pdl=False)
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    kern = {ev.key.split("<")[0].split("(")[0][-22:]: ev.device_time_total / 5
            for ev in prof.key_averages() if "moe_" in ev.key}
    C.moe_launch_options(pdl=True)
    distinct = len(set(ids.flatten().tolist()))
    return t, kern, out.clone(), distinct


for rows in (64, 256, 512) if len(sys.argv) < 2 else map(int, sys.argv[1].split(",")):
    base = None
    for runs in (False, True):
        t, kern, out, distinct = timed(rows, runs)
        base = out if base is None else base
        floor_us = distinct * EXPERT_BYTES / COPY * 1e6
        print(f"rows {rows} gate_up_runs {int(runs)}: {t:.1f} us per call ({floor_us / t:.0%} of "
              f"the copy ceiling on one pass over its {distinct} experts, floor {floor_us:.1f} us), "
              f"kernels {', '.join(f'{n} {v:.1f}' for n, v in sorted(kern.items()))} us, "
              f"same bits as gate_up_runs 0: {torch.equal(out, base)}", flush=True)
C.moe_launch_options(gate_up_runs=False)
