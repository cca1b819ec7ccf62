"""Does a row's routed-expert output depend on how many rows share its launch? (80B shapes, FP8
128x128, E=512 + the folded shared expert, top-10 + 1.) Rows 0-15 alone against the same rows in
a 48-row launch and in a 512-row call (eight 64-row launches): max |diff| and bit equality."""
import sys

import torch

sys.path.insert(0, "tests")
from test_moe_kernels import experts, routing  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

E, H, I, k = 513, 2048, 512, 11
weights = experts(E, H, I, torch.float8_e4m3fn, (128, 128), device="cuda")
w, ids = routing(512, k, E, hot=[512], device="cuda")
x = torch.randn(512, H, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)


def call(n, **kw):
    return C.gpu_moe_experts(x[:n], *weights[:2], w[:n], ids[:n], *weights[2:], (128, 128), **kw)


# (the prompt argument exists from the second call of the session: rows' kind picks the kernel)
kinds = [{}] + ([{"prompt": True}] if "prompt" in C.gpu_moe_experts.__code__.co_varnames else [])
for kw in kinds:
    alone = {n: call(n, **kw) for n in (16, 32, 48, 512)}
    for n in (32, 48, 512):
        d = (alone[n][:16].float() - alone[16].float()).abs().max().item()
        print(f"{kw or 'window'}: rows 0-15 alone vs in {n} rows: max|diff| {d:.3e} equal "
              f"{torch.equal(alone[n][:16], alone[16])}", flush=True)
