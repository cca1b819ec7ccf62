"""scripts/merge_expert_study.py: a later study's rows replace an earlier one's cell by cell,
the routing profile follows the first input, and bad inputs are errors naming the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import merge_expert_study as merge  # noqa: E402


def study(path: Path, rows: list[tuple], tag: str) -> Path:
    path.write_text(json.dumps({"meta": {"tag": tag, "protocol": {"instances": 1}},
                                "study": {"rows": [{"budget_pct": b, "config": c, "n": n,
                                                    "aggregate_tps": t} for b, c, n, t in rows],
                                          "protocol": {"tag": tag}}}))
    return path


def test_later_rows_replace_earlier_cells_and_the_profile_follows_the_first(tmp_path):
    a = study(tmp_path / "a.json", [(None, "solo", 1, 10.0), (75, "solo", 2, 5.0),
                                    (75, "batch", 2, 4.0)], "a")
    (tmp_path / "a.profile.json").write_text('{"counts": []}')
    b = study(tmp_path / "b.json", [(75, "batch", 2, 6.0), (44, "solo", 1, 3.0)], "b")
    out = tmp_path / "m.json"
    merge.main([str(out), str(a), str(b)])
    m = json.loads(out.read_text())
    cells = {(r["budget_pct"], r["config"], r["n"]): r["aggregate_tps"] for r in m["study"]["rows"]}
    assert cells == {(None, "solo", 1): 10.0, (75, "solo", 2): 5.0, (75, "batch", 2): 6.0,
                     (44, "solo", 1): 3.0}
    assert m["meta"]["tag"] == "b" and m["study"]["protocol"] == {"tag": "b"}
    assert [x["path"] for x in m["meta"]["merged_from"]] == [str(a), str(b)]
    assert (tmp_path / "m.profile.json").read_text() == '{"counts": []}'


def test_bad_inputs_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"study": {"rows": [{"config": "solo", "n": 1}]}}')
    with pytest.raises(SystemExit, match=r"bad.json: study.rows\[0\] lacks \['budget_pct'\]"):
        merge.main([str(tmp_path / "m.json"), str(bad)])
    with pytest.raises(SystemExit, match="missing.json: not found"):
        merge.main([str(tmp_path / "m.json"), str(tmp_path / "missing.json")])
    bad.write_text("{")
    with pytest.raises(SystemExit, match="bad.json:1: not JSON"):
        merge.main([str(tmp_path / "m.json"), str(bad)])
    with pytest.raises(SystemExit, match="the output is one of the inputs"):
        merge.main([str(bad), str(bad)])
