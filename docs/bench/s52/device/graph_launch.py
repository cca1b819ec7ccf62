"""What a CUDA graph of small linears costs the host to launch, and the device to run, with the
linears on cuBLAS or on the skinny kernel (its launch switches varied): one reading of why
batch_mtp at N=8 slowed with skinny_bf16=1 is that the window's graph launches slower. Also
two such graphs launched in turn (an engine alternates window shapes and prompt chunks; a
solo engine replays one graph): whether a graph of dependent launches costs more to launch
after another graph than after itself.

    python3 docs/bench/s52/device/graph_launch.py [LINEARS=60] [ROWS=16]
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from strata.kernels import cyext_ops

n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 16
dev = torch.device("cuda")
g0 = torch.Generator(device=dev).manual_seed(0)
ws = [torch.randn(512, 512, device=dev, dtype=torch.bfloat16, generator=g0) * 0.04 for _ in range(n)]
x = torch.randn(rows, 512, device=dev, dtype=torch.bfloat16, generator=g0)


def chain(lin):
    y = x
    for w in ws:
        y = lin(y, w)
    return y


def capture(lin):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            chain(lin)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(lin)
    return g, out


def measure(name, lin):
    g, out = capture(lin)
    other, _ = capture(lin)
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    lat = []
    for _ in range(300):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        lat.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()
    for _ in range(300):
        g.replay()
    host = (time.perf_counter() - t0) / 300
    e1.record()
    torch.cuda.synchronize()
    dev_us = e0.elapsed_time(e1) / 300 * 1e3
    print(f"{name:34s} launch from idle: median {statistics.median(lat) * 1e6:7.1f} us, "
          f"max {max(lat) * 1e6:7.1f}; back to back: host {host * 1e6:7.1f} us a launch, "
          f"device {dev_us:7.1f} us a replay", flush=True)
    e0.record()
    t0 = time.perf_counter()
    for i in range(300):
        (other if i % 2 else g).replay()
    host = (time.perf_counter() - t0) / 300
    e1.record()
    torch.cuda.synchronize()
    print(f"{'':34s} two graphs in turn: host {host * 1e6:7.1f} us a launch, device "
          f"{e0.elapsed_time(e1) / 300 * 1e3:7.1f} us a replay", flush=True)
    for turn in (False, True):  # the overlapped engine: launch t+1, then wait for t
        prev = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(300):
            (other if turn and i % 2 else g).replay()
            ev = torch.cuda.Event()
            ev.record()
            if prev is not None:
                prev.synchronize()
            prev = ev
        prev.synchronize()
        wall = (time.perf_counter() - t0) / 300
        print(f"{'':34s} launch t+1 then wait for t ({'two graphs' if turn else 'one graph'}): "
              f"{wall * 1e6:7.1f} us a window against {dev_us:7.1f} us of device", flush=True)
    return out.float()


print(f"{n} linears 512 -> 512, {rows} rows, bf16, {torch.cuda.get_device_name()}")
# linear_pdl=1 below means dependents at every row count (the default limit is 4 rows)
cyext_ops.moe_launch_options(skinny_pdl_rows=cyext_ops.SKINNY_BF16_MAX_ROWS)
ref = measure("cuBLAS (F.linear)", F.linear)
for pdl in (1, 0):
    for mma in (1, 0):
        cyext_ops.moe_launch_options(linear_pdl=bool(pdl), linear_mma=bool(mma))
        got = measure(f"skinny linear_pdl={pdl} linear_mma={mma}", cyext_ops.gpu_linear_skinny)
        print(f"  max |diff| against cuBLAS {(got - ref).abs().max().item():.3g}")
cyext_ops.moe_launch_options(linear_pdl=True, linear_mma=True,
                             skinny_pdl_rows=cyext_ops.SKINNY_BF16_PDL_MAX_ROWS)
