"""The routed experts' outputs on fixed random inputs, saved for a bit-for-bit comparison across
trees (each run with its own tree's extension on PYTHONPATH): FP8 block-128 and bf16 weights of
the 80B-A3B expert shapes with a folded shared expert (513 experts, top-10 plus the shared
one), 1-32 rows, plain ids and ids repeated within a row (one expert with many members).
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
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    E, k, H, I = 513, 11, 2048, 512

    def fp8w(shape):
        w = (torch.randn(*shape, device=dev, generator=g) * 40).clamp(-440, 440)
        s = torch.rand(*shape[:-2], shape[-2] // 128, shape[-1] // 128, device=dev,
                       generator=g) * 1e-3
        return w.to(torch.float8_e4m3fn), s

    wgu, gs = fp8w((E, 2 * I, H))
    wd, ds = fp8w((E, H, I))
    bgu = (torch.randn(E, 2 * I, H, device=dev, generator=g) / 45).to(torch.bfloat16)
    bd = (torch.randn(E, H, I, device=dev, generator=g) / 22).to(torch.bfloat16)
    out = {}
    for n in ROWS:
        idx = torch.stack([torch.randperm(E - 1, device=dev, generator=g)[:k - 1]
                           for _ in range(n)])
        idx = torch.cat([idx, torch.full_like(idx[:, :1], E - 1)], 1)  # the shared expert last
        rep = idx.clone()
        rep[:, 1:4] = rep[:, :1]
        w = torch.rand(n, k, device=dev, generator=g)
        w = w / w.sum(-1, keepdim=True)
        x = torch.randn(n, H, device=dev, generator=g).to(torch.bfloat16)
        for name, ids in (("plain", idx), ("repeat", rep)):
            out[(n, name, "fp8")] = C.gpu_moe_experts(x, wgu, wd, w, ids, gs, ds, (128, 128)).cpu()
            out[(n, name, "bf16")] = C.gpu_moe_experts(x, bgu, bd, w, ids, None, None, None).cpu()
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
