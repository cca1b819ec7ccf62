#!/usr/bin/env python3
"""One moe_experts call per (weights, variant, rows) after a warm-up, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:moe_ --launch-skip-before-match 0 \\
        --section SpeedOfLight --section WarpStateStats python3 scripts/ncu_moe.py \\
        --rows 2,32 --variants stream,+db+xsmem --weights fp8

Each case runs twice (the first call loads the module and raises the shared-memory limits);
profile the second one (every kernel of a case is named in the NVTX-free order printed here).
E=512, top-10, H=2048, I=512, uniform routing, as scripts/bench_kernels.py --moe; --shared adds
the folded shared expert (E + 1, top-11), --prompt launches as a prompt chunk's rows do (the down
kernel on tensor cores).

--linear OxI[,OxI...] instead: the FP8 linear (linear_fp8) at those shapes and --rows, in its
unsplit form, its split form (as many slots as fit, in pairs, in pairs on f16 operands, then
each of --split-depths), and cuBLAS on a bf16 copy (kernel names linear_fp8_ and nvjet / gemm:
widen --kernel-name). The forms and weights are scripts/bench_kernels.py's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from strata.kernels import cyext_ops as C  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import (FP8_BLOCK, LINEAR_FORMS, MOE_SHAPE, MOE_VARIANTS,  # noqa: E402
                           _fp8_weight, _moe_weights, moe_ids, split_depth_forms)

#: the streamed FP8 linear's forms --linear profiles (bench_kernels.LINEAR_FORMS' names)
NCU_LINEAR_FORMS = ("linear_fp8_unsplit", "linear_fp8_split", "linear_fp8_split_pair",
                    "linear_fp8_split_pair_f16")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,32")
    ap.add_argument("--variants", default="stream,+db+xsmem")
    ap.add_argument("--weights", default="fp8", help="fp8, bf16 or fp8,bf16")
    ap.add_argument("--router", action="store_true",
                    help="also the router (moe_route_kernel: E experts plus the shared gate, "
                         "top-k, renormalised) before each case's experts")
    ap.add_argument("--prompt", action="store_true",
                    help="launch as a prompt chunk's rows (gpu_moe_experts(prompt=True): the down "
                         "kernel on tensor cores, as the engine's prompt chunks run it)")
    ap.add_argument("--shared", action="store_true",
                    help="E + 1 experts, top-(k + 1) with the last id every row's (the engine's "
                         "folded shared expert), as bench_kernels.py --moe-shared")
    ap.add_argument("--linear", default="", help="OxI,...: the FP8 linear instead")
    ap.add_argument("--split-depths", default="3", help="with --linear: ring caps, comma list")
    args = ap.parse_args()
    if args.linear:
        return profile_linear(args)
    E, k, H, I = (MOE_SHAPE[n] for n in ("E", "k", "H", "I"))
    routed, top = E, k  # what the router picks from, and how many
    if args.shared:
        E, k = E + 1, k + 1
    saved = C.moe_launch_options()
    # the fused router weight's shape: the routed experts' gate rows and the shared gate, padded
    # to 8 rows
    w_router = (torch.randn(-(-(routed + 1) // 8) * 8, H, device="cuda") / H ** 0.5).to(torch.bfloat16)
    for wname in args.weights.split(","):
        wgu, wd, gs, ds, block = _moe_weights(wname == "fp8", E)
        for variant in args.variants.split(","):
            C.moe_launch_options(**MOE_VARIANTS[variant])
            for n in (int(r) for r in args.rows.split(",")):
                g = torch.Generator(device="cuda").manual_seed(n)
                ids = moe_ids(n, E, k, args.shared, generator=g, device="cuda")
                w = torch.rand(n, k, device="cuda", generator=g)
                w = w / w.sum(-1, keepdim=True)
                x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2):
                    if args.router:
                        C.gpu_moe_route(x, w_router, routed, top, True, None, routed)
                    C.gpu_moe_experts(x, wgu, wd, w, ids, gs, ds, block, prompt=args.prompt)
                torch.cuda.synchronize()
                print(f"case {wname} {variant} rows {n}: distinct {ids.unique().numel()}",
                      flush=True)
        del wgu, wd, gs, ds
        torch.cuda.empty_cache()
    C.moe_launch_options(**saved)
    return 0


def profile_linear(args) -> int:
    saved = C.moe_launch_options()
    forms = {name: LINEAR_FORMS[name] for name in NCU_LINEAR_FORMS}
    forms.update(split_depth_forms(d for d in args.split_depths.split(",") if d.strip()))
    for shape in args.linear.split(","):
        o, i = (int(v) for v in shape.lower().split("x"))
        w8, s8 = _fp8_weight((o, i), FP8_BLOCK, o + i)
        wb = w8.to(torch.bfloat16)
        for n in (int(r) for r in args.rows.split(",")):
            x = torch.randn(n, i, device="cuda", dtype=torch.bfloat16)
            for name, opts in forms.items():
                C.moe_launch_options(**opts)
                for _ in range(2):
                    C.gpu_linear_fp8(x, w8, s8, FP8_BLOCK)
                torch.cuda.synchronize()
                C.moe_launch_options(**saved)
                print(f"case linear {o}x{i} {name} rows {n}", flush=True)
            for _ in range(2):
                torch.nn.functional.linear(x, wb)
            torch.cuda.synchronize()
            print(f"case linear {o}x{i} cublas_bf16 rows {n}", flush=True)
    C.moe_launch_options(**saved)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
