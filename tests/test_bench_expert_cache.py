"""scripts/bench_expert_cache.py's study part on the CPU at a tiny size: the protocol it runs
(a fresh cache per timed cohort, a routing profile from prompts other than the timed ones) and
what it records of it in the study JSON's meta.protocol, which the simulator check reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import bench_expert_cache as bench  # noqa: E402
import sim_expert_cache_study as study  # noqa: E402
from strata.model.loader import load_checkpoint  # noqa: E402
from strata.model.tiny import make_tiny_random  # noqa: E402

torch.set_num_threads(1)
TINY = ["--n", "1,2", "--configs", "solo,batch_mtp", "--budgets", "100,25", "--repeats", "2",
        "--prompt-tokens", "5", "--max-tokens", "6", "--max-context", "64", "--adapt-every", "2",
        "--profile-requests", "3"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = make_tiny_random(tmp_path_factory.mktemp("bench-experts"), seed=7, tokenizer=False,
                            num_experts=64, num_experts_per_tok=4, moe_intermediate_size=48,
                            shared_expert_intermediate_size=48)
    return load_checkpoint(path, moe_dense_experts=0, log=lambda s: None)


def test_protocol_defaults_and_what_meta_records(tmp_path):
    a = bench.parse_args(["--json", str(tmp_path / "s.json")])
    assert a.fresh_cache_per_cell and a.profile_prompts == "disjoint" and a.repeats == 1
    p = bench.study_protocol(a)
    assert p == {"fresh_cache_per_cell": True, "repeats": 1, "instances": 1,
                 "profile": {"prompts": "disjoint", "config": "solo", "seed": bench.PROFILE_SEED,
                             "requests": 8 + 15, "path": str(tmp_path / "s.profile.json")}}
    old = bench.study_protocol(bench.parse_args(
        ["--no-fresh-cache-per-cell", "--profile-prompts", "timed", "--repeats", "3"]))
    assert old["fresh_cache_per_cell"] is False and old["repeats"] == 3
    assert old["profile"]["prompts"] == "timed" and "requests" not in old["profile"]
    # a split study's second call: the profile file's own record (or "unrecorded")
    prof = tmp_path / "a.profile.json"
    prof.write_text(json.dumps({"counts": [], "protocol": {"prompts": "disjoint", "requests": 5}}))
    given = bench.study_protocol(bench.parse_args(["--budgets", "44,25", "--profile", str(prof)]))
    assert given["profile"] == {"prompts": "disjoint", "requests": 5, "path": str(prof)}
    prof.write_text(json.dumps({"counts": []}))
    assert bench.study_protocol(bench.parse_args(
        ["--profile", str(prof)]))["profile"]["prompts"] == "unrecorded"
    assert bench.study_protocol(bench.parse_args(["--budgets", "44"]))["profile"] is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])
    # the simulator check says which protocol its engine study ran
    assert "a fresh cache per cell, 1 cohort(s) per cell; the routing profile from 23 prompts " \
           "disjoint" in study.protocol_note({"protocol": p})
    assert "carried across cells" in study.protocol_note({"protocol": old})
    assert "not recorded" in study.protocol_note({"args": {}})


def test_profile_prompts_are_drawn_as_the_cohorts_and_disjoint():
    timed = bench.token_prompts(1000, 8, 16)
    extra = bench.disjoint_prompts(1000, 5, 16, timed)
    assert extra == bench.token_prompts(1000, 5, 16, seed=bench.PROFILE_SEED)
    assert not any(p in timed for p in extra)
    with pytest.raises(SystemExit, match="one of the timed prompts"):
        bench.disjoint_prompts(1000, 3, 16, extra)


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "carried"])
def test_study_runs_end_to_end_on_the_cpu(loaded, tmp_path, fresh):
    """Every (budget, configuration, N) row, --repeats cohorts each; with a fresh cache per
    cell every repeat of a cell reads the same misses (the same state, the same windows); the
    profile routes the disjoint prompts and says so."""
    out = tmp_path / "study.json"
    args = TINY + ["--json", str(out)] + ([] if fresh else ["--no-fresh-cache-per-cell"])
    a = bench.parse_args(args)
    res = bench.part_study(a, loaded, torch.device("cpu"))
    rows = res["rows"]
    assert [(r["budget_pct"], r["config"], r["n"]) for r in rows] == [
        (b, c, n) for b in (None, 100, 25) for c in ("solo", "batch_mtp") for n in (1, 2)]
    assert res["protocol"] == bench.study_protocol(a) and res["protocol"]["fresh_cache_per_cell"] is fresh
    prof = json.loads(out.with_suffix(".profile.json").read_text())
    assert prof["protocol"]["prompts"] == "disjoint" and prof["protocol"]["requests"] == 3
    assert prof["windows"] > 0 and prof["tokens"] > 0
    low = [r for r in rows if r["budget_pct"] == 25]
    assert all(len(r["runs_tps"]) == len(r["runs_misses"]) == 2 for r in rows)
    assert all(0 < r["hit_rate"] < 1 and r["bus_bytes"] > 0 for r in low)
    same = [r["runs_misses"][0] == r["runs_misses"][1] for r in low]
    assert all(same) if fresh else not all(same)  # carried: the second repeat starts adapted
    assert "| 25% | 2 |" in res["table"]
    for r in rows:  # where each cell's time went: every window of the median cohort, one chunk
        by_shape = r["time_by_shape"]  # per prompt (64 tokens, one chunk each)
        assert by_shape["prefill_chunks"] == r["n"] and by_shape["prefill_mean_ms"] > 0
        assert all(w["windows"] > 0 and w["mean_ms"] > 0 for w in by_shape["windows"].values())
        assert all(("mean_misses" in w) == (r["budget_pct"] is not None)
                   for w in by_shape["windows"].values())
        assert 0 < r["device_busy"] <= 1.0 + 1e-6


def test_timed_profile_counts_every_window_with_or_without_resets(loaded, tmp_path):
    """--profile-prompts timed (the protocol before): the 100% engine's routing over its warm-up
    and timed cohorts, the same whether a fresh cache per cell zeroed its counts meanwhile."""
    profiles = []
    for extra in ([], ["--no-fresh-cache-per-cell"]):
        out = tmp_path / f"study{len(profiles)}.json"
        a = bench.parse_args(TINY + ["--json", str(out), "--profile-prompts", "timed",
                                     "--budgets", "100", "--no-baseline", "--configs", "solo"]
                             + extra)
        bench.part_study(a, loaded, torch.device("cpu"))
        profiles.append(json.loads(out.with_suffix(".profile.json").read_text()))
    assert profiles[0]["protocol"]["prompts"] == "timed"
    assert profiles[0]["counts"] == profiles[1]["counts"]
    assert profiles[0]["windows"] == profiles[1]["windows"] > 0


def test_several_engine_instances_per_cell(loaded):
    """--instances 2: each (budget, configuration) builds two engines; a cell keeps every
    cohort and each engine's median, and its tok/s is one of those medians."""
    a = bench.parse_args(TINY[:4] + ["--budgets", "25", "--no-baseline", "--repeats", "1",
                                     "--instances", "2"] + TINY[8:])
    res = bench.part_study(a, loaded, torch.device("cpu"))
    assert res["protocol"]["instances"] == 2
    assert "on each of 2 engines" in study.protocol_note({"protocol": res["protocol"]})
    for r in res["rows"]:
        assert r["instances"] == 2 and len(r["runs_tps"]) == len(r["instances_tps"]) == 2
        assert r["aggregate_tps"] in r["instances_tps"]
        assert r["runs_misses"][0] == r["runs_misses"][1]  # the same first fill and windows


def test_instances_must_be_positive():
    with pytest.raises(SystemExit):
        bench.parse_args(TINY + ["--instances", "0"])


def test_merged_study_names_each_budgets_cohorts():
    """A merged study whose budgets ran other cohorts or engines says which ran how."""
    rows = [{"budget_pct": None, "repeats": 3}, {"budget_pct": 100, "repeats": 3},
            {"budget_pct": 75, "repeats": 2, "instances": 3},
            {"budget_pct": 75, "repeats": 2, "instances": 3}]
    note = study.per_budget_cohorts(rows)
    assert note == ("no cache, 100%: 3 cohort(s) per cell; 75%: 2 cohort(s) per cell on each "
                    "of 3 engines (the median of their medians)")
    assert study.per_budget_cohorts(rows[:2]) is None
    p = {"fresh_cache_per_cell": True, "repeats": 2, "instances": 3}
    assert note in study.protocol_note({"protocol": p, "per_budget_cohorts": note})
