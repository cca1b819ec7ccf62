"""Plot an expert-cache engine study (scripts/bench_expert_cache.py --part study --json):
batch and batch_mtp's aggregate tok/s over solo's, per N, one line per cache budget.

    python scripts/plot_expert_study.py docs/bench/s18/expert_study.json docs/img/expert_cache_study.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: plot_expert_study.py STUDY.json OUT.png", file=sys.stderr)
        return 2
    src, out = Path(argv[0]), Path(argv[1])
    try:
        rows = json.loads(src.read_text(encoding="utf-8"))["study"]["rows"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        print(f"error: {src}: not an expert-cache study JSON ({e})", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["budget_pct"], r["config"], r["n"]): r["aggregate_tps"] for r in rows}
    budgets = sorted({r["budget_pct"] for r in rows if r["budget_pct"] is not None}, reverse=True)
    ns = sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8), sharey=True)
    for ax, mode in zip(axes, ("batch", "batch_mtp")):
        for pct in budgets:
            gain = [100 * (by[(pct, mode, n)] / by[(pct, "solo", n)] - 1) for n in ns]
            ax.plot(ns, gain, marker="o", label=f"cache {pct}%")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("requests in flight (N)")
        ax.set_title(f"{mode} over solo")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("aggregate tok/s gain (%)")
    axes[1].legend()
    fig.suptitle("Expert cache budget vs batching's gain (H200, 8 layers of FP8 80B-A3B, SYNTHETIC)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
