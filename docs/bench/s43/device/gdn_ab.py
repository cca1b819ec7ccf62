"""gdn_kernel old against new: every output bit for bit, and the time per launch.

    python3 docs/bench/s43/device/gdn_ab.py OLD.so      (from the repo root; the new extension
                                                          in strata/kernels/)

Each extension runs in a child process of its own (two statically linked CUDA runtimes never
share one), on the same inputs (CPU seeds). Timed: the 80B shapes (H=32, Dk=Dv=128, bf16):
decode windows in factor mode through the prepared form (groups x rows 1x2, 1x4, 8x2, 8x4) and
prompt chunks in final-state mode through the plain form (1x64, 8x64); a CUDA graph of N
launches replayed R times, the median per launch, with the prepared form's programmatic
dependent launch on (the default) and off (conv_set_options bit 2; the old .so has none).
Checked only: odd shapes, snapshots, several chunks, Dk up to 256, float32 inputs."""
import glob
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

N, R = 50, 30  # launches per graph, replays
H, DK, DV, NK = 32, 128, 128, 16
TIMED = [("prep", 1, 2), ("prep", 1, 4), ("prep", 8, 2), ("prep", 8, 4),
         ("final", 1, 64), ("final", 8, 64)]
# (form, ng, g, h, nk, dk, dv, dtype): equality only
BF, F32, F16 = torch.bfloat16, torch.float32, torch.float16
CHECKED = [("prep", 2, 17, 4, 2, 128, 128, BF), ("prep", 3, 5, 6, 3, 33, 40, F32),
           ("prep", 2, 3, 2, 1, 256, 64, BF), ("prep", 1, 9, 4, 4, 7, 5, F16),
           ("final", 2, 17, 3, 0, 64, 96, BF), ("final", 3, 9, 2, 0, 256, 64, F32),
           ("final", 1, 1, 4, 0, 128, 128, BF), ("final", 2, 64, 4, 0, 128, 128, BF)]


def inputs(form, ng, g, h, nk, dk, dv, dtype):
    gen = torch.Generator().manual_seed(ng * 100003 + g * 1009 + h * 101 + dk * 7 + dv)
    st = (torch.randn(ng + 1, h, dk, dv, generator=gen) * 0.1).cuda()
    gs = torch.randperm(ng, generator=gen).cuda()
    if form == "prep":
        x = torch.randn(ng, g, 2 * nk * dk + h * dv + 3, generator=gen).to("cuda", dtype)
        ba = (torch.randn(ng, g, 2 * h, generator=gen) * 3).to("cuda", dtype)
        neg_a = (-torch.rand(h, generator=gen) * 4).cuda()
        dt_bias = torch.randn(h, generator=gen).cuda()
        return dict(x=x, ba=ba, neg_a=neg_a, dt_bias=dt_bias, st=st, gs=gs)
    q = F.normalize(torch.randn(ng, g, h, dk, generator=gen), dim=-1) * dk ** -0.5
    q = q.to("cuda", dtype)
    k = F.normalize(torch.randn(ng, g, h, dk, generator=gen), dim=-1).to("cuda", dtype)
    v = torch.randn(ng, g, h, dv, generator=gen).to("cuda", dtype)
    gg = (-torch.rand(ng, g, h, generator=gen) * 2).to("cuda", dtype)
    beta = torch.rand(ng, g, h, generator=gen).to("cuda", dtype)
    return dict(q=q, k=k, v=v, gg=gg, beta=beta, st=st, gs=gs)


def runner(mod, form, mode, ng, g, h, nk, dk, dv, t):
    """A closure launching the kernel once, and its outputs."""
    out = torch.empty(ng, g, h, dv, device="cuda")
    if mode == "factors":
        per = torch.empty(ng, g, h, dk + dv + 1, device="cuda")
    elif mode == "snaps":
        per = torch.empty(ng, g, h, dk, dv, device="cuda")
    else:
        per = torch.empty(ng, h, dk, dv, device="cuda")
    if form == "prep":
        def run():
            mod.gated_delta_window_prep(t["x"], t["ba"], t["neg_a"], t["dt_bias"], t["st"],
                                        t["gs"], out, per, nk, dk, dk ** -0.5, 1e-6,
                                        torch.cuda.current_stream().cuda_stream,
                                        factors=mode == "factors")
    else:
        def run():
            mod.gated_delta_window(t["q"], t["k"], t["v"], t["gg"], t["beta"], t["st"], t["gs"],
                                   out, per, torch.cuda.current_stream().cuda_stream,
                                   final_only=mode == "final")
    return run, [out, per]


def time_us(run):
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(N):
            run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(R):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / N)
    return sorted(times)[len(times) // 2]


def child(so, path):
    spec = importlib.util.spec_from_file_location("strata_cuda", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    flags = mod.conv_set_options(-1)
    res, times = {}, {}
    cases = [(f, ng, g, H, NK if f == "prep" else 0, DK, DV, torch.bfloat16) for f, ng, g in TIMED]
    for form, ng, g, h, nk, dk, dv, dtype in cases + CHECKED:
        t = inputs(form, ng, g, h, nk, dk, dv, dtype)
        modes = ("factors", "snaps") if form == "prep" else ("final", "snaps")
        if ng * g * h > 2048:  # no snapshots of the timed prompt chunks (1 GB at 8x64)
            modes = modes[:1]
        for mode in modes:
            key = f"{form} {mode} {ng}x{g} h{h} dk{dk} dv{dv} {str(dtype)[6:]}"
            run, outs = runner(mod, form, mode, ng, g, h, nk, dk, dv, t)
            for o in outs:
                o.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            res[key] = [o.cpu() for o in outs]
            timed = (form, ng, g) in TIMED and mode in ("factors", "final") and h == H
            if timed:
                times[key] = {"pdl": time_us(run)}
                if form == "prep":
                    mod.conv_set_options(flags & ~2)
                    times[key]["plain"] = time_us(run)
                    mod.conv_set_options(flags)
                    for o in outs:  # the same bits with and without the attribute
                        o.fill_(float("nan"))
                    run()
                    torch.cuda.synchronize()
                    assert all(torch.equal(a.cpu(), b) for a, b in zip(outs, res[key])), key
    torch.save({"res": res, "times": times, "gpu": torch.cuda.get_device_name()}, path)


def main():
    old = sys.argv[1]
    sfx = importlib.machinery.EXTENSION_SUFFIXES[0]
    new = glob.glob(f"strata/kernels/strata_cuda{sfx}")
    if not new:
        sys.exit(f"no strata/kernels/strata_cuda{sfx}: build or unpack the new extension first")
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, so in (("old", old), ("new", new[0])):
            path = os.path.join(tmp, name + ".pt")
            subprocess.run([sys.executable, __file__, "--child", os.path.abspath(so), path],
                           check=True)
            got[name] = torch.load(path)
    a, b = got["old"]["res"], got["new"]["res"]
    bad = [k for k in a if not all(torch.equal(x, y) for x, y in zip(a[k], b[k]))]
    n = sum(len(v) for v in a.values())
    print(f"{got['new']['gpu']}: {len(a)} cases, {n} tensors: "
          f"{'ALL BIT-IDENTICAL' if not bad else 'DIFFER: ' + str(bad)}")
    print(f"{'case (us per launch, median)':44s} {'old':>8s} {'new':>8s} {'ratio':>6s} "
          f"{'new-noPDL':>9s}")
    for k, t in got["new"]["times"].items():
        o = got["old"]["times"][k]["pdl"]
        nn = t["pdl"]
        extra = f"{t['plain']:9.2f}" if "plain" in t else ""
        print(f"{k:44s} {o:8.2f} {nn:8.2f} {nn / o:6.3f} {extra}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
