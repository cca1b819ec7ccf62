"""Where gate_up_runs differs from 16-row launches: per case, eager and replayed, the rows and
features that differ and by how much, with runs off and on (and the gate/up alone via
moe_launch_options down toggles when available)."""
import sys

import torch

sys.path.insert(0, "tests")
from test_moe_kernels import FP8, _replay_with_new_ids, experts, routing  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

H, I = 2048, 512


def diff(a, b):
    d = (a.float() - b.float()).abs()
    bad = (a != b).any(-1)
    rows = bad.nonzero().flatten().tolist()
    return f"{len(rows)} rows differ {rows[:12]} max {d.max().item():.3g} rel {(d.norm() / b.float().norm()).item():.2e}"


for N, E, k, wide_rows, hot in [(17, 513, 11, 64, True), (40, 513, 11, 64, True), (40, 513, 11, 64, False),
                                (64, 1024, 16, 64, True), (128, 513, 11, 128, True), (128, 513, 11, 128, False),
                                (512, 513, 11, 512, True)]:
    weights = experts(E, H, I, FP8, (128, 128), device="cuda")
    w, ids = routing(N, k, E, hot=[E - 1] if hot else None, device="cuda")
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    saved = C.moe_launch_options()
    C.moe_launch_options(fp8_wide=False, fp8_launch16=True)
    run = lambda prompt: C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128), prompt=prompt)  # noqa
    want, wantp = run(False), run(True)
    want_r = _replay_with_new_ids(x, weights, w.clone(), ids.clone(), (128, 128), 8)
    res = {}
    for runs in (False, True):
        C.moe_launch_options(fp8_wide=True, wide_rows=wide_rows, gate_up_runs=runs)
        res[runs] = (run(False), run(True), _replay_with_new_ids(x, weights, w.clone(), ids.clone(), (128, 128), 8))
    C.moe_launch_options(**saved)
    members = torch.bincount(ids.flatten(), minlength=E)
    print(f"N={N} E={E} k={k} wide={wide_rows} hot={hot} pairs={N * k} most members {members.max().item()}")
    for runs in (False, True):
        g, gp, gr = res[runs]
        print(f"  runs={int(runs)} eager: {diff(g, want)} | prompt: {diff(gp, wantp)} | replay: {diff(gr, want_r)}")
    g1, g0 = res[True][0], res[False][0]
    print(f"  runs 1 vs runs 0 eager: {diff(g1, g0)}", flush=True)
