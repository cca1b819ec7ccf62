"""Wide launches (FP8, E=512 + the folded shared expert, top-10 + 1, H=2048, I=512): the down
kernel's ring as 2 stages a warp (the rule: 10 warps at 64 rows) against 1 (16 warps), by the
experiment-only STRATA_EXP_DN; CUDA-graph replay medians and the down kernel's own time."""
import os
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


def timed(rows):
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
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    parts = {ev.key.split("(")[0].split("::")[-1][:20]: ev.device_time_total / ev.count
             for ev in prof.key_averages() if ev.device_time_total > 0}
    return statistics.median(ts), out.clone(), parts


for rows in (24, 32, 48, 64):
    res = {}
    for dn in (None, "1", "2", "3"):
        for gu in (None, "2"):
            os.environ.pop("STRATA_EXP_DN", None); os.environ.pop("STRATA_EXP_GU", None)
            if dn: os.environ["STRATA_EXP_DN"] = dn
            if gu: os.environ["STRATA_EXP_GU"] = gu
            t, o, parts = timed(rows)
            res[(dn, gu)] = o
            same = torch.equal(o, res[(None, None)])
            print(f"rows {rows} dn {dn} gu {gu}: {t:.1f} us same bits {same} "
                  + " ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)
