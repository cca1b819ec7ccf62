"""The smallest case gate_up_runs gets wrong (17 rows, one expert of 17 members: runs of 16 and
1, a decode call), for compute-sanitizer."""
import sys

import torch

sys.path.insert(0, "tests")
from test_moe_kernels import FP8, experts, routing  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

N, E, k, H, I = int(sys.argv[1]) if len(sys.argv) > 1 else 17, 513, 11, 2048, 512
prompt = len(sys.argv) > 2 and sys.argv[2] == "prompt"
weights = experts(E, H, I, FP8, (128, 128), device="cuda")
w, ids = routing(N, k, E, hot=[E - 1], device="cuda")
x = torch.randn(N, H, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
outs = []
for runs in (False, True):
    C.moe_launch_options(fp8_wide=True, wide_rows=max(64, N), gate_up_runs=runs)
    outs.append(C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128), prompt=prompt))
    torch.cuda.synchronize()
bad = (outs[0] != outs[1]).any(-1).nonzero().flatten().tolist()
print("rows differing:", bad, flush=True)
