"""Markdown table and plots of a Hydra multirun: metrics against the swept overrides.

Works on the sweep directory of `python -m strata -m ...` or `python -m sim -m ...` (any Hydra
app whose runs write `metrics.json` into their output dir). Every run dir below DIR that holds
`.hydra/overrides.yaml` is one row; its `metrics.json` is flattened (`graph.hit`,
`ttft_s.p50`, ...; lists such as per-request records are left out). Overrides that differ
between runs are the swept keys; the ones all runs share are listed once.

    python scripts/sweep_report.py multirun/2026-01-01/12-00-00
    python scripts/sweep_report.py DIR --metrics aggregate_tps,ttft_s.p95 --x engine.slots --out report/

Writes DIR/sweep_report.md (the table, with the plot linked), DIR/sweep_report.json (the rows)
and DIR/sweep_report.png (one panel per metric that varies: metric against --x, one line per
combination of the other swept keys); --out puts them elsewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import yaml

MISSING = "missing"


def parse_override(text: str) -> tuple[str, Any]:
    """`engine.slots=4` -> ("engine.slots", 4); `+a=b`/`++a=b` -> ("a", "b"); `~a` -> ("a", None)."""
    text = text.strip()
    if text.startswith("~"):
        key, _, val = text[1:].partition("=")
        return key, "<deleted>"
    key, _, val = text.lstrip("+").partition("=")
    try:
        v = yaml.safe_load(val) if val != "" else ""
    except yaml.YAMLError:
        v = val
    if isinstance(v, (dict, list)):
        v = val            # keep sweeps of structured values readable
    return key, v


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        pass               # per-request records and the like: not a run-level metric
    else:
        out[prefix[:-1]] = obj
    return out


def find_runs(root: Path) -> list[Path]:
    runs = [p.parent.parent for p in root.rglob(".hydra/overrides.yaml")]
    # A multirun dir's own .hydra (if any) is not a run unless it has metrics.

    def order(p: Path):
        rel = p.relative_to(root).parts
        return [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in rel]

    return sorted(set(runs), key=order)


def load_run(run: Path, root: Path) -> dict:
    ov = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) or []
    overrides = dict(parse_override(str(o)) for o in ov)
    row: dict = {"run": str(run.relative_to(root)) or ".", "overrides": overrides, "metrics": {},
                 "status": "ok"}
    mf = run / "metrics.json"
    if not mf.is_file():
        row["status"] = "no metrics.json"
        return row
    try:
        row["metrics"] = flatten(json.loads(mf.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        row["status"] = f"bad metrics.json ({e})"
    return row


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def sort_key(v: Any):
    return (0, float(v), "") if is_num(v) else (1, 0.0, str(v))


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if v != v:
            return "nan"
        a = abs(v)
        if a == 0 or 0.01 <= a < 1e6:
            return f"{v:.4g}" if a < 100 else f"{v:,.1f}"
        return f"{v:.3g}"
    s = str(v)
    return s.replace("|", "\\|")


def analyse(rows: list[dict], metrics_arg: Optional[str]) -> tuple[list[str], dict, list[str]]:
    keys: list[str] = []
    for r in rows:
        for k in r["overrides"]:
            if k not in keys:
                keys.append(k)
    swept, fixed = [], {}
    for k in keys:
        vals = {json.dumps(r["overrides"].get(k, MISSING), sort_keys=True, default=str) for r in rows}
        if len(vals) > 1:
            swept.append(k)
        else:
            fixed[k] = rows[0]["overrides"].get(k)
    if metrics_arg:
        metrics = [m.strip() for m in metrics_arg.split(",") if m.strip()]
    else:
        metrics = []
        for r in rows:
            for k, v in r["metrics"].items():
                if k not in metrics and (is_num(v) or isinstance(v, str)):
                    metrics.append(k)
    return swept, fixed, metrics


def table(rows: list[dict], swept: list[str], metrics: list[str]) -> str:
    head = ["run", *swept, *metrics, "status"]
    out = ["| " + " | ".join(fmt(h) for h in head) + " |",
           "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|"]
    for r in rows:
        cells = [r["run"], *(r["overrides"].get(k, MISSING) for k in swept),
                 *(r["metrics"].get(m) for m in metrics), r["status"]]
        out.append("| " + " | ".join(fmt(c) for c in cells) + " |")
    return "\n".join(out)


def plot(rows: list[dict], swept: list[str], metrics: list[str], x: str, path: Path) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_metrics = [m for m in metrics if any(is_num(r["metrics"].get(m)) for r in rows)]
    varying = [m for m in num_metrics
               if len({r["metrics"].get(m) for r in rows if is_num(r["metrics"].get(m))}) > 1]
    num_metrics = varying or num_metrics     # constant metrics are in the table; plot the rest
    if not num_metrics:
        return False
    others = [k for k in swept if k != x]
    xs_all = sorted({r["overrides"].get(x, MISSING) if x else "" for r in rows}, key=sort_key)
    numeric_x = bool(x) and all(is_num(v) for v in xs_all)
    pos = {v: i for i, v in enumerate(xs_all)}
    cols = min(3, len(num_metrics))
    nrows = math.ceil(len(num_metrics) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), squeeze=False)
    for i, m in enumerate(num_metrics):
        ax = axes[i // cols][i % cols]
        series: dict[tuple, list] = {}
        for r in rows:
            y = r["metrics"].get(m)
            if not is_num(y):
                continue
            label = tuple((k, r["overrides"].get(k, MISSING)) for k in others)
            xv = r["overrides"].get(x, MISSING) if x else ""
            series.setdefault(label, []).append((xv, y))
        for label, pts in sorted(series.items(), key=lambda kv: [sort_key(v) for _, v in kv[0]]):
            pts.sort(key=lambda p: sort_key(p[0]))
            xs = [p[0] if numeric_x else pos[p[0]] for p in pts]
            name = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in label) or m
            ax.plot(xs, [p[1] for p in pts], marker="o", label=name)
        if not numeric_x:
            ax.set_xticks(range(len(xs_all)))
            ax.set_xticklabels([str(v) for v in xs_all], rotation=30, ha="right")
        elif len(xs_all) <= 12:
            ax.set_xticks([float(v) for v in xs_all])
            ax.set_xticklabels([fmt(v) for v in xs_all])
        ax.set_title(m)
        ax.set_xlabel(x or "run")
        ax.grid(True, alpha=0.3)
        if len(series) > 1 and i == 0:
            ax.legend(fontsize=7)
    for j in range(len(num_metrics), nrows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", help="a Hydra multirun directory (holds one dir per run)")
    ap.add_argument("--out", help="where to write the report (default: the sweep dir)")
    ap.add_argument("--metrics", help="comma-separated metric keys (default: every scalar)")
    ap.add_argument("--x", help="override on the plots' x axis (default: the first swept key)")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)

    root = Path(a.sweep_dir)
    if not root.is_dir():
        print(f"error: {root} is not a directory", file=sys.stderr)
        return 2
    runs = find_runs(root)
    if not runs:
        print(f"error: no Hydra runs under {root} (no */.hydra/overrides.yaml)", file=sys.stderr)
        return 2
    rows = [load_run(r, root) for r in runs]
    swept, fixed, metrics = analyse(rows, a.metrics)
    x = a.x or (swept[0] if swept else "")
    if a.x and a.x not in swept and a.x not in fixed:
        print(f"error: --x {a.x} is not an override of these runs ({', '.join(swept) or 'none'})",
              file=sys.stderr)
        return 2
    rows.sort(key=lambda r: [sort_key(r["overrides"].get(k, MISSING)) for k in swept])

    out = Path(a.out) if a.out else root
    out.mkdir(parents=True, exist_ok=True)
    png = out / "sweep_report.png"
    plotted = False if a.no_plot else plot(rows, swept, metrics, x, png)
    md = [f"# Sweep report: {root}", "",
          f"{len(rows)} runs ({sum(r['status'] == 'ok' for r in rows)} with metrics); "
          f"swept: {', '.join(f'`{k}`' for k in swept) or 'nothing'}."]
    if fixed:
        md.append("Shared overrides: " + ", ".join(f"`{k}={v}`" for k, v in fixed.items()) + ".")
    md += ["", table(rows, swept, metrics), ""]
    if plotted:
        md += [f"![metrics against {x or 'run'}]({png.name})", ""]
    (out / "sweep_report.md").write_text("\n".join(md))
    (out / "sweep_report.json").write_text(json.dumps(
        {"sweep_dir": str(root), "swept": swept, "fixed": fixed, "metrics": metrics, "rows": rows},
        indent=1, default=str))
    print("\n".join(md))
    print(f"wrote {out / 'sweep_report.md'}" + (f", {png}" if plotted else ""), file=sys.stderr)
    return 0

