"""How often gate_up_runs gives other bits than the round-robin wide launch, by call kind and
launch option: 20 calls each, the count of calls with a differing row (and the rows)."""
import sys

import torch

sys.path.insert(0, "tests")
from test_moe_kernels import FP8, experts, routing  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

E, k, H, I = 513, 11, 2048, 512
weights = experts(E, H, I, FP8, (128, 128), device="cuda")
saved = C.moe_launch_options()
for N, prompt in [(17, False), (40, False), (17, True), (64, True), (128, True), (128, False)]:
    w, ids = routing(N, k, E, hot=[E - 1], device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    run = lambda: C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128), prompt=prompt)  # noqa
    for label, opts in [("default", {}), ("pdl off", dict(pdl=False)),
                        ("down_split off", dict(down_split=False)),
                        ("gate_up_pdl on", dict(gate_up_pdl=True))]:
        C.moe_launch_options(**saved)
        C.moe_launch_options(fp8_wide=True, wide_rows=max(64, N), gate_up_runs=False, **opts)
        ref = run()
        C.moe_launch_options(gate_up_runs=True)
        bad, rows = 0, set()
        for _ in range(20):
            got = run()
            torch.cuda.synchronize()
            d = (got != ref).any(-1).nonzero().flatten().tolist()
            bad += bool(d)
            rows.update(d)
        print(f"N={N} prompt={prompt} {label}: {bad}/20 calls differ, rows {sorted(rows)[:20]}",
              flush=True)
C.moe_launch_options(**saved)
