"""The routed experts' outputs on fixed random inputs, saved for a bit-for-bit comparison across
trees (each run with its own tree's extension on PYTHONPATH): bench_kernels.py's FP8 block-128
and bf16 expert weights at the 80B-A3B shapes with a folded shared expert (513 experts, top-10
plus the shared one), 1-32 rows, plain ids and ids repeated within a row (one expert with many members).
Needs a GPU and the cyext GPU extension.

    python scripts/moe_bits.py save OUT.pt             # in each tree
    python scripts/moe_bits.py compare BASE.pt OTHER.pt [...]
"""

from __future__ import annotations

import argparse
import sys

import torch

ROWS = (1, 2, 3, 4, 8, 12, 16, 24, 32)


def save(path: str) -> int:
    from strata.kernels import cyext_ops as C

    if not torch.cuda.is_available() or C.gpu_platform() is None:
        print("moe_bits: needs a GPU and the cyext GPU extension", file=sys.stderr)
        return 2
    from bench_kernels import FP8_BLOCK, MOE_SHAPE, _moe_weights

    torch.manual_seed(0)  # _moe_weights' bf16 weights draw from the global generator
    E, k, H = MOE_SHAPE["E"] + 1, MOE_SHAPE["k"] + 1, MOE_SHAPE["H"]  # + the shared expert
    fp8, bf16 = _moe_weights(True, E), _moe_weights(False, E)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for n in ROWS:
        idx = torch.stack([torch.randperm(E - 1, device="cuda", generator=g)[:k - 1]
                           for _ in range(n)])
        idx = torch.cat([idx, torch.full_like(idx[:, :1], E - 1)], 1)  # the shared expert last
        rep = idx.clone()
        rep[:, 1:4] = rep[:, :1]
        w = torch.rand(n, k, device="cuda", generator=g)
        w = w / w.sum(-1, keepdim=True)
        x = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
        for name, ids in (("plain", idx), ("repeat", rep)):
            for wname, (wgu, wd, gs, ds, block) in (("fp8", fp8), ("bf16", bf16)):
                out[(n, name, wname)] = C.gpu_moe_experts(x, wgu, wd, w, ids, gs, ds,
                                                          block).cpu()
    torch.save(out, path)
    print(f"moe_bits: saved {len(out)} outputs to {path}")
    return 0


def compare(base: str, others: list[str]) -> int:
    a = torch.load(base)
    bad = 0
    for path in others:
        o = torch.load(path)
        diff = [key for key in a if key not in o or not torch.equal(a[key], o[key])]
        print(f"{path}: " + ("identical to " + base if not diff else f"DIFFERS at {diff}"))
        bad += bool(diff)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("save", help="compute and save the outputs").add_argument("out")
    cmp_ = sub.add_parser("compare", help="compare saved outputs bit for bit")
    cmp_.add_argument("base")
    cmp_.add_argument("others", nargs="+")
    a = ap.parse_args()
    return save(a.out) if a.cmd == "save" else compare(a.base, a.others)


if __name__ == "__main__":
    sys.exit(main())
