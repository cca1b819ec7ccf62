"""Does gate_up_runs leave act entries unwritten? The workspace filled with NaN before each call:
the NaNs left in it and the output rows with NaN, runs off and on, several shapes."""
import sys

import torch

sys.path.insert(0, "tests")
from test_moe_kernels import FP8, experts, routing  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

E, k, H, I = 513, 11, 2048, 512
weights = experts(E, H, I, FP8, (128, 128), device="cuda")
saved = C.moe_launch_options()
for N, prompt, hot in [(17, False, True), (40, False, True), (128, False, True), (128, True, True),
                       (40, False, False), (512, True, True)]:
    w, ids = routing(N, k, E, hot=[E - 1] if hot else None, device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    line = []
    for runs in (False, True, True):
        C.moe_launch_options(**saved)
        C.moe_launch_options(fp8_wide=True, wide_rows=max(64, N), gate_up_runs=runs)
        ws = torch.full((C.moe_workspace_numel(N, k, I, H),), float("nan"), device="cuda")
        out = torch.full_like(x, float("nan"))
        C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128), out=out, workspace=ws,
                          prompt=prompt)
        torch.cuda.synchronize()
        act = ws.isnan()
        rows = out.isnan().any(-1).nonzero().flatten().tolist()
        line.append(f"runs={int(runs)} ws NaN {int(act.sum())} of {ws.numel()} (first at "
                    f"{int(act.nonzero()[0]) if act.any() else -1}), out NaN rows {rows[:10]}")
    print(f"N={N} prompt={prompt} hot={hot}: " + " | ".join(line), flush=True)
C.moe_launch_options(**saved)
