"""Routed experts in prompt launches at the 80B shapes (E=512 + the folded shared expert, top-10 + 1,
H=2048, I=512, FP8 128x128, down on tensor cores): an old GPU extension against the tree's, each
in a process of its own (loaded by path as strata.kernels.strata_cuda). Per launch of 64, 128,
256 and 512 rows: whether the outputs are bit-identical (torch.equal), CUDA-graph replay medians
per call, the gate/up and down kernels' own times (the profiler, programmatic launch off), and %
of a stated copy bandwidth on the distinct experts' bytes.
    python3 docs/bench/s43/device/wide_moe.py OLD.so        (from the repository root)"""
import importlib.util
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile

import torch

sys.path.insert(0, os.getcwd())  # the repository root: strata and tests
ROWS = (64, 128, 256, 512)
E, H, I, k = 513, 2048, 512, 11


def child(so, path):
    import strata.kernels as K
    spec = importlib.util.spec_from_file_location("strata.kernels.strata_cuda", so)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    K.strata_cuda = mod
    sys.path.insert(0, "tests")
    from test_moe_kernels import experts, routing
    from strata.kernels import cyext_ops as C
    assert C._gpu is mod
    weights = experts(E, H, I, torch.float8_e4m3fn, (128, 128), device="cuda")
    torch.cuda.empty_cache()
    C.moe_launch_options(down_mma=True, pdl=True, wide_rows=512)
    res = {}
    for rows in ROWS:
        w, ids = routing(rows, k, E, hot=[512], device="cuda")
        x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows)).to("cuda", torch.bfloat16)
        out = torch.empty_like(x)
        ws = torch.empty(C.moe_workspace_numel(rows, k, I, H), device="cuda")
        run = lambda: C.gpu_moe_experts(x, *weights[:2], w, ids, *weights[2:], (128, 128),
                                        out=out, workspace=ws, prompt=True)
        run()
        torch.cuda.synchronize()
        first = out.cpu()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                run()
        g.replay()
        ts = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); g.replay(); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / 10)
        C.moe_launch_options(pdl=False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        C.moe_launch_options(pdl=True)
        kern = {name: sum(ev.device_time_total / ev.count for ev in prof.key_averages()
                          if name in ev.key) for name in ("gate_up", "down_stream")}
        res[rows] = dict(out=first, replay=out.cpu(), us=statistics.median(ts), kern=kern,
                         distinct=len(set(ids.flatten().tolist())))
    torch.save(res, path)


def main(old):
    new = os.path.join("strata", "kernels", "strata_cuda" + sysconfig.get_config_var("EXT_SUFFIX"))
    name = torch.cuda.get_device_name()
    copy = 4.3e12 if "H200" in name else 3.0e12  # bytes/s: the copy ceilings the docs use
    print(f"{name}; copy ceiling stated {copy / 1e12:.1f} TB/s; old {old}, new {new}", flush=True)
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tag, so in (("old", old), ("new", new)):
            path = os.path.join(tmp, tag + ".pt")
            subprocess.run([sys.executable, __file__, "--child", so, path], check=True)
            got[tag] = torch.load(path)
    for rows in ROWS:
        o, n = got["old"][rows], got["new"][rows]
        same = torch.equal(o["out"], n["out"]) and torch.equal(o["replay"], n["replay"])
        floor = o["distinct"] * 3 * H * I / copy * 1e6  # us to read the distinct experts once
        line = " | ".join(f"{t} {r['us']:7.1f} us ({floor / r['us']:4.0%}; gate/up "
                          f"{r['kern']['gate_up']:6.1f}, down {r['kern']['down_stream']:6.1f})"
                          for t, r in (("old", o), ("new", n)))
        print(f"rows {rows:3d} ({o['distinct']} experts, floor {floor:5.1f} us): {line} "
              f"{n['us'] / o['us'] - 1:+.1%} bits {'IDENTICAL' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
