"""Routed experts at the 80B shapes (E=512 + the folded shared expert, top-10 + 1, H=2048,
I=512, FP8 128x128), 16-row launches against wide launches (fp8_wide), CUDA-graph replay
medians per call at 16, 32, 48 and 64 rows; checks the bits agree (the first run's x was
unseeded, so its 'same bits False' compared different inputs; the GPU test
test_gpu_moe_fp8_wide_launches_same_bits holds the bits)."""
import statistics
import sys

import torch

sys.path.insert(0, "tests")
from test_moe_kernels import experts, routing  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

FP8 = torch.float8_e4m3fn
E, H, I, k = 513, 2048, 512, 11
weights = experts(E, H, I, FP8, (128, 128), device="cuda")


def timed(rows, wide):
    C.moe_launch_options(fp8_wide=wide, fp8_launch16=not wide)
    w, ids = routing(rows, k, E, hot=[512], device="cuda")
    gen = torch.Generator().manual_seed(rows)  # the same x in both forms: their bits compared
    x = torch.randn(rows, H, generator=gen).to("cuda", torch.bfloat16)
    out = torch.empty_like(x)
    ws = torch.empty(C.moe_workspace_numel(rows, k, I, H), device="cuda")
    run = lambda: C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128), out=out, workspace=ws)
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


for rows in (16, 32, 48, 64):
    t16, o16 = timed(rows, False)
    tw, ow = timed(rows, True)
    print(f"rows {rows}: 16-row launches {t16:.1f} us, wide {tw:.1f} us ({tw / t16 - 1:+.1%}), "
          f"same bits {torch.equal(o16, ow)}", flush=True)
