"""The routed experts of one FP8 80B layer (E = 512 + the folded shared expert, top-10 + 1,
2048 x 512 in 128 x 128 blocks) at 1-16 rows: the two grids against the fused one
(moe_launch_options(fused=)), each a CUDA graph of 16 launches over 16 routings (so that most
experts come from HBM), µs a launch, the same bits checked. Any sm_90 GPU."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts"))
from bench_kernels import _moe_weights, moe_ids  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

E, K, H, I, SETS = 513, 11, 2048, 512, 16
wgu, wd, gs, ds, block = _moe_weights(True, E)
per_expert = wgu[0].numel() + wd[0].numel()
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
print("rows | two grids µs | fused µs | change | distinct experts | fused GB/s on them | same bits")
saved = C.moe_launch_options()
for n in (1, 2, 4, 8, 16):
    g = torch.Generator(device="cuda").manual_seed(n)
    ids = [moe_ids(n, E, K, True, generator=g, device="cuda") for _ in range(SETS)]
    ws = [torch.rand(n, K, device="cuda", generator=g) for _ in range(SETS)]
    ws = [w / w.sum(-1, keepdim=True) for w in ws]
    xs = [torch.randn(n, H, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(SETS)]
    distinct = sum(len(torch.unique(i)) for i in ids) / SETS
    res = {}
    for fused in (False, True):
        C.moe_launch_options(**saved)
        C.moe_launch_options(fused=fused)
        outs = [torch.empty_like(x) for x in xs]
        wsp = torch.empty(C.moe_workspace_numel(n, K, I), device="cuda")
        for s in range(SETS):  # eager once (the sync buffer, the first launch's set-up)
            C.gpu_moe_experts(xs[s], wgu, wd, ws[s], ids[s], gs, ds, block, out=outs[s], workspace=wsp)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for s in range(SETS):
                C.gpu_moe_experts(xs[s], wgu, wd, ws[s], ids[s], gs, ds, block, out=outs[s],
                                  workspace=wsp)
        graph.replay()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            t0.record()
            graph.replay()
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1) * 1000 / SETS)
        res[fused] = (sorted(times)[len(times) // 2], [o.clone() for o in outs])
    same = all(torch.equal(a, b) for a, b in zip(res[False][1], res[True][1]))
    a, b = res[False][0], res[True][0]
    gbs = distinct * per_expert / (b * 1e-6) / 1e9
    print(f"{n} | {a:.1f} | {b:.1f} | {100 * (b - a) / a:+.1f}% | {distinct:.1f} | {gbs:.0f} | {same}")
C.moe_launch_options(**saved)
