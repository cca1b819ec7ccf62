"""The MoE router kernel (ops.moe_route's one launch, cyext/src/strata_router.cu) at Qwen3-Next's
shapes (E=512 plus the shared expert's gate, H=2048, top-10), 1 to 16 rows.

Each timed launch follows a small kernel (as the router follows the layer's norm) and reads its
own copy of the router weight (the copies rotate over bench_kernels.ROTATE_BYTES, so the weights
come from HBM as in a decode window, where the experts' bytes leave nothing of them in L2);
graphs of 40 such pairs are replayed, and the small kernel's graph alone is subtracted.

    python scripts/bench_router.py --json router.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench_kernels import ROTATE_BYTES, time_calls  # noqa: E402
from provenance import commit_id  # noqa: E402
from strata.kernels import cyext_ops as C  # noqa: E402

LAUNCHES = 40


def per_launch_us(fn) -> tuple[float, str]:
    """Median microseconds per fn(i) over graph replays of fn(0) .. fn(LAUNCHES - 1), and how
    they ran (bench_kernels.time_calls: "graph", or "eager" where capture failed)."""
    t, mode = time_calls([lambda i=i: fn(i) for i in range(LAUNCHES)], min_calls=LAUNCHES)
    return t * 1e6, mode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--json", help="write the figures here (a .md goes next to it)")
    a = ap.parse_args()
    if not torch.cuda.is_available() or C.gpu_platform() is None:
        print("bench_router: needs a CUDA GPU and the cyext GPU extension", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    E, H, k = a.experts, a.hidden, a.top_k
    rows_w = -(-(E + 1) // 8) * 8
    w0 = (torch.randn(rows_w, H, device=dev) / H ** 0.5).to(torch.bfloat16)
    copies = max(2, -(-ROTATE_BYTES // (w0.numel() * 2)))
    ws = [w0] + [w0.clone() for _ in range(copies - 1)]
    table: dict[str, dict[int, float]] = {"router": {}}
    for m in [int(r) for r in a.rows.split(",")]:
        x = torch.randn(m, H, device=dev).to(torch.bfloat16)
        base, _ = per_launch_us(lambda i: x.mul_(1.0))
        both, mode = per_launch_us(lambda i: (x.mul_(1.0), C.gpu_moe_route(
            x, ws[i % len(ws)], E, k, True, None, E)))
        if mode != "graph":
            print(f"bench_router: {m} rows could not be captured", file=sys.stderr)
            return 1
        table["router"][m] = round(both - base, 2)
        print(f"router rows {m:2d}: {table['router'][m]:6.2f} us per launch", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": commit_id(), "experts": E, "hidden": H, "top_k": k,
            "weight_copies": copies, "launches_per_graph": LAUNCHES}
    rows = sorted(table["router"])
    md = [f"# router kernel, us per launch ({meta['device']}, torch {meta['torch']}, "
          f"{meta['commit']})", "", "| kernel | " + " | ".join(f"{m} rows" for m in rows) + " |",
          "| --- |" + " --- |" * len(rows)]
    md += [f"| {name} | " + " | ".join(f"{t[m]:.2f}" for m in rows) + " |" for name, t in table.items()]
    print("\n".join(md))
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "us": table}, indent=1))
        Path(a.json).with_suffix(".md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
