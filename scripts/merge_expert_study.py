"""Merge expert-cache study JSONs (scripts/bench_expert_cache.py --part study) into one, for
scripts/sim_expert_cache_study.py --engine: a study split over several device calls, or some
budgets measured again (say with --instances 3) over an earlier study.

    python scripts/merge_expert_study.py merged.json docs/bench/s17/expert_study.json s75.json s44.json

Rows are keyed by (budget_pct, config, n): a later file's row replaces an earlier one's. The
merged meta is the last file's, with every input's meta under meta.merged_from (in order); its
protocol is the last file's. The first input's routing profile (<input>.profile.json) is
copied beside the output when it exists, since the lower budgets' first fill came from it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def load_study(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SystemExit(f"error: {path}: not found") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: {path}:{e.lineno}: not JSON: {e.msg}") from None
    rows = (d.get("study") or {}).get("rows") if isinstance(d, dict) else None
    if not isinstance(rows, list) or not rows:
        raise SystemExit(f"error: {path}: no study.rows (a bench_expert_cache.py --part study JSON?)")
    for i, r in enumerate(rows):
        missing = [k for k in ("budget_pct", "config", "n") if k not in r]
        if missing:
            raise SystemExit(f"error: {path}: study.rows[{i}] lacks {missing}")
    return d


def merge(studies: list[tuple[str, dict]]) -> dict:
    """The merged study: rows by (budget_pct, config, n), later inputs winning, in first-seen
    order; meta from the last input with every input's under merged_from."""
    rows: dict[tuple, dict] = {}
    for _, d in studies:
        for r in d["study"]["rows"]:
            rows[(r["budget_pct"], r["config"], r["n"])] = r
    last = studies[-1][1]
    meta = dict(last.get("meta", {}))
    meta["merged_from"] = [{"path": p, "meta": d.get("meta", {})} for p, d in studies]
    return {"meta": meta, "study": {"rows": list(rows.values()),
                                    "protocol": last["study"].get("protocol")}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("inputs", type=Path, nargs="+")
    a = ap.parse_args(argv)
    if a.out in a.inputs:
        raise SystemExit(f"error: {a.out}: the output is one of the inputs")
    merged = merge([(str(p), load_study(p)) for p in a.inputs])
    a.out.write_text(json.dumps(merged, indent=1) + "\n")
    profile = a.inputs[0].with_suffix(".profile.json")
    if profile.is_file():
        shutil.copyfile(profile, a.out.with_suffix(".profile.json"))
    print(f"wrote {a.out}: {len(merged['study']['rows'])} rows from {len(a.inputs)} studies"
          + (f"; routing profile {profile.name} copied" if profile.is_file() else ""))


if __name__ == "__main__":
    main()
