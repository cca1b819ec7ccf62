#!/usr/bin/env python3
"""Does prefetching a decode window's weights into L2 make its kernels faster? (GPU, sm_90+)

    python scripts/probe_l2_prefetch.py [--sleep-us 10] [--json out.json]

At Qwen3-Next-80B-A3B shapes a decode window's byte-moving kernels (the DeltaNet input
projection, the output projection, the router, the routed experts) run at 30-60% of the copy
ceiling, between latency-bound kernels (conv, gated delta rule, norms, the router's top-k)
during which HBM is idle. This measures, for each such kernel at decode row counts, its time
per call in CUDA-graph replays, each call preceded by a spin of --sleep-us standing in for the
latency-bound kernels before it:

  cold    weights from HBM (weight copies or routings rotate over more bytes than L2 holds)
  pack    the prefetch in the first layout (128 pieces to a CTA), launched before the spin
  pf      ops.l2_prefetch of exactly the bytes the call reads (the default layout: one warp a
          CTA over every SM), launched before the spin
  pf0     the prefetch launched right before the call (no spin between)
  side    the prefetch on a side stream, forked at the spin and joined before the call: what a
          prefetch running beside the latency-bound kernels would give
  hot     the same weights every call (in L2 where they fit): the ceiling of what a prefetch
          can give

Each figure is the sequence's time minus the same sequence without the call (spin, prefetch),
so it is what the call adds to a window. The routed experts are prefetched by the router's
choice (`l2_prefetch` on the ids, as the router would issue it): gate/up and down, or the
down weights only (what the gate/up kernel's run leaves time for).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kernels import time_calls  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

DEV = torch.device("cuda")
ROTATE_BYTES = 320 << 20  # several times the H200's L2
BLOCK = (128, 128)
PIECE = 16 * 1024  # the prefetch kernel's piece (strata_prefetch.cu)


def spin_cycles(us: float) -> int:
    """torch.cuda._sleep cycles for about `us` microseconds at the SM clock."""
    khz = torch.cuda.get_device_properties(DEV).clock_rate if hasattr(
        torch.cuda.get_device_properties(DEV), "clock_rate") else 1_980_000
    return int(us * khz / 1000)


def fp8_weight(shape, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(*shape, device=DEV, generator=g) * 40).clamp(-440, 440).to(torch.float8_e4m3fn)
    *lead, o, i = shape
    s = torch.rand(*lead, -(-o // BLOCK[0]), -(-i // BLOCK[1]), device=DEV, generator=g) * 1e-3
    return w, s


def measure(name, copies, call, prefetch, spin, nbytes, out, pieces):
    """copies: per-iteration inputs; call(c) runs the op on copy c; prefetch(c, ctas, threads)
    prefetches what call(c) reads; pieces: that prefetch's 16 KiB pieces (for the packed layout)."""
    n = len(copies)
    sleep = (lambda: torch.cuda._sleep(spin)) if spin else (lambda: None)
    main = torch.cuda.current_stream
    side = torch.cuda.Stream()
    packed = (-(-pieces // 128), 128)

    def forked(c):
        side.wait_stream(main())
        with torch.cuda.stream(side):
            prefetch(c, 0, 0)
        sleep()
        main().wait_stream(side)

    pf = lambda c: prefetch(c, 0, 0)  # noqa: E731
    pk = lambda c: prefetch(c, *packed)  # noqa: E731
    seqs = {
        "base": [sleep] * n,
        "cold": [f for c in copies for f in (sleep, lambda c=c: call(c))],
        "pack_base": [f for c in copies for f in (lambda c=c: pk(c), sleep)],
        "pack": [f for c in copies for f in (lambda c=c: pk(c), sleep, lambda c=c: call(c))],
        "pf_base": [f for c in copies for f in (lambda c=c: pf(c), sleep)],
        "pf": [f for c in copies for f in (lambda c=c: pf(c), sleep, lambda c=c: call(c))],
        "pf0": [f for c in copies for f in (sleep, lambda c=c: pf(c), lambda c=c: call(c))],
        "side_base": [lambda c=c: forked(c) for c in copies],
        "side": [f for c in copies for f in (lambda c=c: forked(c), lambda c=c: call(c))],
        "hot": [f for c in copies for f in (sleep, lambda: call(copies[0]))],
    }
    # seconds per copy: time_calls gives a closure's share of the replayed sequence
    t = {k: time_calls(v)[0] * len(v) / n for k, v in seqs.items()}
    rec = dict(name=name, bytes=nbytes,
               cold_us=(t["cold"] - t["base"]) * 1e6,
               pack_us=(t["pack"] - t["pack_base"]) * 1e6,
               pf_us=(t["pf"] - t["pf_base"]) * 1e6,
               pf0_us=(t["pf0"] - t["pf_base"]) * 1e6,
               side_us=(t["side"] - t["side_base"]) * 1e6,
               hot_us=(t["hot"] - t["base"]) * 1e6,
               spin_us=t["base"] * 1e6,
               pack_launch_us=(t["pack_base"] - t["base"]) * 1e6,
               prefetch_launch_us=(t["pf_base"] - t["base"]) * 1e6,
               side_launch_us=(t["side_base"] - t["base"]) * 1e6)
    out.append(rec)
    print(f"{name:38s} {nbytes / 1e6:6.1f} MB  cold {rec['cold_us']:6.1f}  pack {rec['pack_us']:6.1f}"
          f"  pf {rec['pf_us']:6.1f}  pf0 {rec['pf0_us']:6.1f}  side {rec['side_us']:6.1f}"
          f"  hot {rec['hot_us']:6.1f} us  (spin {rec['spin_us']:.1f}; the prefetch adds: pack"
          f" {rec['pack_launch_us']:.1f}, pf {rec['prefetch_launch_us']:.1f}, side"
          f" {rec['side_launch_us']:.1f})", flush=True)


def dense_cases(spin, out):
    gpu = C._gpu
    st = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    for (o, i) in ((12288, 2048), (2048, 4096)):
        nb = o * i
        copies = [fp8_weight((o, i), s) for s in range(max(2, ROTATE_BYTES // nb))]
        for m in (1, 2, 16):
            x = torch.randn(m, i, device=DEV, dtype=torch.bfloat16)
            y = torch.empty(m, o, device=DEV, dtype=torch.bfloat16)
            measure(f"linear_fp8 {o}x{i} rows {m}", copies,
                    lambda c: C.gpu_linear_fp8(x, c[0], c[1], BLOCK, out=y),
                    lambda c, g, t: gpu.l2_prefetch([c[0]], None, st(), g, t), spin, nb, out,
                    -(-nb // PIECE))
        del copies
    o, i = 12352, 2048  # the DeltaNet input projection as the engine runs it (bf16 copy)
    nb = o * i * 2
    copies = [torch.randn(o, i, device=DEV, dtype=torch.bfloat16) / 45
              for _ in range(max(2, ROTATE_BYTES // nb))]
    for m in (1, 2, 16):
        x = torch.randn(m, i, device=DEV, dtype=torch.bfloat16)
        measure(f"F.linear bf16 {o}x{i} rows {m}", copies, lambda w: F.linear(x, w),
                lambda w, g, t: gpu.l2_prefetch([w], None, st(), g, t), spin, nb, out,
                -(-nb // PIECE))
    del copies
    E, H = 512, 2048  # the router (+ the shared expert's gate), bf16
    nb = (E + 1) * H * 2
    copies = [torch.randn(E + 8, H, device=DEV, dtype=torch.bfloat16) / 45
              for _ in range(max(2, ROTATE_BYTES // nb))]
    for m in (1, 2, 16):
        x = torch.randn(m, H, device=DEV, dtype=torch.bfloat16)
        measure(f"moe_route rows {m}", copies,
                lambda w: C.gpu_moe_route(x, w, E, 10, True, None, E),
                lambda w, g, t: gpu.l2_prefetch([w], None, st(), g, t), spin, nb, out,
                -(-(E + 8) * H * 2 // PIECE))
    del copies


def moe_cases(spin, out, sets: int = 16):
    gpu = C._gpu
    st = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    E, k, H, I = 512, 10, 2048, 512
    wgu, gs = fp8_weight((E + 1, 2 * I, H), 1)
    wd, ds = fp8_weight((E + 1, H, I), 2)
    per = 3 * I * H
    for m in (1, 2, 4, 8, 16):
        cases = []
        for _ in range(sets):
            idx = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(m)])
            idx = torch.cat([idx, torch.full_like(idx[:, :1], E)], 1)  # the folded shared expert
            w = torch.rand(m, k + 1, device=DEV)
            cases.append((torch.randn(m, H, device=DEV, dtype=torch.bfloat16), w / w.sum(-1, True),
                          idx, torch.empty(m, H, device=DEV, dtype=torch.bfloat16)))
        work = torch.empty(C.moe_workspace_numel(m, k + 1, I), device=DEV)
        distinct = statistics.mean(c[2].unique().numel() for c in cases)

        def call(c):
            C.gpu_moe_experts(c[0], wgu, wd, c[1], c[2], gs, ds, BLOCK, out=c[3], workspace=work)

        def pf_both(c, g, t):
            gpu.l2_prefetch([wgu, wd], c[2], st(), g, t)

        ids = m * (k + 1)  # the prefetch's rows, duplicates included
        measure(f"moe_experts fp8 rows {m} (gate/up+down)", cases, call, pf_both, spin,
                int(distinct * per), out, ids * -(-per // PIECE))
        measure(f"moe_experts fp8 rows {m} (down only)", cases, call,
                lambda c, g, t: gpu.l2_prefetch([wd], c[2], st(), g, t), spin,
                int(distinct * per), out, ids * -(-(H * I) // PIECE))
    del wgu, wd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sleep-us", type=float, default=10.0,
                    help="the spin before each call, standing in for latency-bound kernels")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("probe_l2_prefetch: needs a CUDA GPU of sm_90+ (the bulk L2 prefetch)")
        return 2
    if C._gpu is None or not hasattr(C._gpu, "l2_prefetch"):
        print("probe_l2_prefetch: the GPU extension is not built with strata_prefetch.cu")
        return 2
    spin = spin_cycles(args.sleep_us)
    out: list = []
    print(f"device {torch.cuda.get_device_name()}; spin {args.sleep_us} us = {spin} cycles",
          flush=True)
    dense_cases(spin, out)
    moe_cases(spin, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), sleep_us=args.sleep_us,
                           torch=torch.__version__, records=out), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
