"""gdn_kernel's outputs (out, snapshots, final state; plain and prepared) from one strata_cuda
.so, saved to a file, or compared with another run's file bit for bit.
    python old_new.py SO save OUT.pt | python old_new.py SO compare REF.pt"""
import importlib.util
import sys

import torch
import torch.nn.functional as F

so, what, path = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("strata_cuda", so)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
DEV = "cuda"
st_ = torch.cuda.current_stream().cuda_stream
res = {}
for dtype in (torch.bfloat16, torch.float32):
    for (ng, g, h, dk, dv) in [(1, 1, 4, 128, 128), (8, 2, 32, 128, 128), (3, 5, 2, 33, 40),
                               (2, 8, 3, 64, 96), (2, 3, 2, 256, 64), (1, 17, 2, 7, 5),
                               (2, 64, 4, 128, 128)]:
        gen = torch.Generator().manual_seed(ng * 1000 + g * 10 + dk)
        q = (F.normalize(torch.randn(ng, g, h, dk, generator=gen), dim=-1) * dk ** -0.5).to(DEV, dtype)
        k = F.normalize(torch.randn(ng, g, h, dk, generator=gen), dim=-1).to(DEV, dtype)
        v = torch.randn(ng, g, h, dv, generator=gen).to(DEV, dtype)
        gg = (-torch.rand(ng, g, h, generator=gen) * 2).to(DEV, dtype)
        beta = torch.rand(ng, g, h, generator=gen).to(DEV, dtype)
        st = (torch.randn(ng + 1, h, dk, dv, generator=gen) * 0.1).to(DEV)
        gs = torch.arange(ng, device=DEV)
        out = torch.empty(ng, g, h, dv, device=DEV)
        snaps = torch.empty(ng, g, h, dk, dv, device=DEV)
        mod.gated_delta_window(q, k, v, gg, beta, st, gs, out, snaps, st_)
        fin_o = torch.empty(ng, g, h, dv, device=DEV)
        fin = torch.empty(ng, h, dk, dv, device=DEV)
        mod.gated_delta_window(q, k, v, gg, beta, st, gs, fin_o, fin, st_, final_only=True)
        key = f"plain {dtype} {(ng, g, h, dk, dv)}"
        res[key] = [out, snaps, fin_o, fin]
        # prepared: nk key heads, nv = h value heads
        nk = 1 if h % 2 else 2
        x = torch.randn(ng, g, 2 * nk * dk + h * dv + 3, generator=gen).to(DEV, dtype)
        ba = (torch.randn(ng, g, 2 * h, generator=gen) * 3).to(DEV, dtype)
        neg_a = (-torch.rand(h, generator=gen) * 4).to(DEV)
        dt_bias = torch.randn(h, generator=gen).to(DEV)
        out = torch.empty(ng, g, h, dv, device=DEV)
        snaps = torch.empty(ng, g, h, dk, dv, device=DEV)
        mod.gated_delta_window_prep(x, ba, neg_a, dt_bias, st, gs, out, snaps, nk, dk,
                                    dk ** -0.5, 1e-6, st_)
        res[f"prep {dtype} {(ng, g, h, dk, dv)}"] = [out, snaps]
torch.cuda.synchronize()
res = {kk: [t.cpu() for t in vv] for kk, vv in res.items()}
if what == "save":
    torch.save(res, path)
    print(f"saved {len(res)} cases from {so}")
else:
    ref = torch.load(path)
    bad = [kk for kk in res if not all(torch.equal(a, b) for a, b in zip(res[kk], ref[kk]))]
    print(f"compared {len(res)} cases ({sum(len(v) for v in res.values())} tensors): "
          f"{'ALL BIT-IDENTICAL' if not bad else 'DIFFER: ' + str(bad)}")
