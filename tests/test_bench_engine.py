"""scripts/bench_engine.py's pieces: token-id prompts, the table of window times beside their
byte floors, and (one small CPU run) the warm-up each configuration's JSON records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_engine  # noqa: E402
from strata.byte_floor import WeightFormat, floor_seconds, window_bytes  # noqa: E402
from strata.model.tiny import tiny_args  # noqa: E402


def test_token_prompts_are_fixed_and_in_range():
    a = bench_engine.token_prompts(100, 3, 7)
    assert a == bench_engine.token_prompts(100, 3, 7)
    assert len(a) == 3 and all(len(p) == 7 and all(1 <= t < 100 for t in p) for p in a)


def test_window_times_against_the_floor():
    wt = bench_engine.WindowTimes()
    wt("window", {"key": "shape:4x2@256", "layout": [0, 0, 1, 1], "ctx": 256, "dur": 1.0})  # off
    wt.on = True
    for dur in (0.002, 0.004):
        wt("window", {"key": "shape:4x2@256", "layout": [0, 0, 1, 1], "ctx": 256, "dur": dur})
    wt("window", {"key": "eager", "layout": [3, 3, 3, 5], "ctx": 512, "dur": 0.001})
    wt("commit", {})
    args = tiny_args()
    rows = wt.table(args, WeightFormat(4), drafting=True, bandwidth=1e9)
    assert [(r["groups"], r["rows"], r["ctx"], r["windows"]) for r in rows] == [(2, 3, 512, 1), (4, 2, 256, 2)]
    floor = floor_seconds(window_bytes(args, 4, 2, 256, WeightFormat(4), drafting=True)["total"], 1e9)
    assert rows[1]["mean_ms"] == pytest.approx(3.0)
    assert rows[1]["floor_ms"] == pytest.approx(floor * 1e3)
    assert rows[1]["ratio"] == pytest.approx(0.003 / floor)


def test_window_times_keep_the_prompt_chunks_by_length():
    wt = bench_engine.WindowTimes()
    wt("prefill", {"tokens": 64, "dur": 1.0})  # off: not a timed cohort
    wt.on = True
    for tokens, dur in ((64, 0.06), (64, 0.08), (16, 0.02)):
        wt("prefill", {"req": "r", "slot": 0, "tokens": tokens, "dur": dur, "ctx": tokens})
    assert not wt.times and wt.busy_s == pytest.approx(0.16)
    wt("window", {"key": "shape:1x2@256", "layout": [0, 0], "ctx": 256, "dur": 0.04})
    assert wt.busy_s == pytest.approx(0.2)
    assert wt.prefill_table() == [{"tokens": 16, "chunks": 1, "mean_ms": pytest.approx(20.0)},
                                  {"tokens": 64, "chunks": 2, "mean_ms": pytest.approx(70.0)}]


def test_window_times_count_a_chunk_of_several_slots_once():
    """engine.prefill_slots: a chunk of three slots writes three events with the chunk's whole
    time; the device was busy for it once, and it is one chunk of its segment count."""
    wt = bench_engine.WindowTimes()
    wt.on = True
    for slot, tokens in enumerate((64, 40, 64)):
        wt("prefill", {"req": f"r{slot}", "slot": slot, "tokens": tokens, "dur": 0.09,
                       "ctx": tokens, "segments": 3})
    wt("prefill", {"req": "r3", "slot": 3, "tokens": 64, "dur": 0.05, "ctx": 64})
    for slot in (0, 1):
        wt("prefill", {"req": f"r{slot}", "slot": slot, "tokens": 16, "dur": 0.03, "ctx": 80,
                       "segments": 2})
    assert wt.busy_s == pytest.approx(0.17)
    assert wt.prefill_table() == [
        {"tokens": 64, "chunks": 1, "mean_ms": pytest.approx(50.0)},
        {"tokens": 16, "segments": 2, "chunks": 1, "mean_ms": pytest.approx(30.0)},
        {"tokens": 64, "segments": 3, "chunks": 1, "mean_ms": pytest.approx(90.0)}]


def test_overlap_both_puts_each_configuration_beside_its_overlapped_twin():
    assert bench_engine.with_overlap(["solo", "batch_mtp"], "both") == [
        "solo", "solo+overlap", "batch_mtp", "batch_mtp+overlap"]
    assert bench_engine.with_overlap(["solo"], "on") == ["solo+overlap"]
    assert bench_engine.with_overlap(["solo"], "off") == ["solo"]
    assert bench_engine.config_of("batch_mtp_w16+overlap") == {
        **bench_engine.CONFIGS["batch_mtp_w16"], "overlap": True}
    assert bench_engine.config_of("solo")["overlap"] is False
    with pytest.raises(SystemExit, match="unknown configuration 'sol'"):
        bench_engine.with_overlap(["sol"], "both")


def test_kernel_options_are_checked():
    """--kernel-options: NAME=0|1 items; a malformed item or an unknown switch is an error naming
    it, and no options with no extension is no change."""
    with pytest.raises(SystemExit, match="'pdl' is not NAME=0 or NAME=1"):
        bench_engine.set_kernel_options("pdl")
    with pytest.raises(SystemExit, match="'pdl=yes' is not NAME=0 or NAME=1"):
        bench_engine.set_kernel_options("pdl=yes")
    with pytest.raises(SystemExit, match="'pdl=2' is not NAME=0 or NAME=1"):
        bench_engine.set_kernel_options("pdl=2")  # only the counts take 0..15
    with pytest.raises(SystemExit, match="linear_split_depth is 0..15"):
        bench_engine.set_kernel_options("linear_split_depth=16")
    with pytest.raises(SystemExit, match="down_split_runs is 0..15"):
        bench_engine.set_kernel_options("down_split_runs=16")
    for rows in (16, 513):
        with pytest.raises(SystemExit, match="wide_rows is 17..512"):
            bench_engine.set_kernel_options(f"wide_rows={rows}")
    with pytest.raises(SystemExit, match="skinny_pdl_rows is 0..16"):
        bench_engine.set_kernel_options("skinny_pdl_rows=17")
    from strata.kernels import cyext_ops
    for bad in (16, 513, True, 64.0):  # checked before the extension is asked
        with pytest.raises(ValueError, match="wide_rows: .* is not a row count in 17..512"):
            cyext_ops.moe_launch_options(wide_rows=bad)
    if cyext_ops.gpu_platform() is None:
        assert bench_engine.set_kernel_options("") == {}
        with pytest.raises(SystemExit, match="needs the cyext GPU extension"):
            bench_engine.set_kernel_options("pdl=1")
        return
    saved = cyext_ops.moe_launch_options()
    try:
        with pytest.raises(SystemExit, match="unknown switch 'bogus'"):
            bench_engine.set_kernel_options("bogus=1")
        got = bench_engine.set_kernel_options("gate_up_pdl=1, pdl=0")
        assert got["gate_up_pdl"] and not got["pdl"]
        assert bench_engine.set_kernel_options("linear_split_depth=4")["linear_split_depth"] == 4
        assert bench_engine.set_kernel_options("down_split_runs=8")["down_split_runs"] == 8
    finally:
        cyext_ops.moe_launch_options(**saved)


def test_code_prompts_come_from_the_shipped_set():
    """The prompts are cut from scripts/data/code_prompts.json, not the running Python's
    standard library, so every machine benchmarks the same prompts; too many asked for is a clear
    error."""
    from strata.model.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(Path(__file__).resolve().parents[1] / "strata/assets/tiny-qwen3-next")
    texts = [p["text"] for p in json.loads(bench_engine.CODE_PROMPTS.read_text())["prompts"]]
    got = bench_engine.code_prompts(tok, 8, 64)
    assert len(got) == 8 and all(len(p) == 64 for p in got)
    assert len({tuple(p) for p in got}) == 8
    assert got[0] == tok.encode(texts[0])[:64]
    with pytest.raises(SystemExit, match="code_prompts.json holds"):
        bench_engine.code_prompts(tok, 10_000, 64)


def test_the_json_records_each_engines_warm_up(tmp_path, monkeypatch):
    """Each configuration's summary holds its engine's warm-up: seconds, graphs compiled and
    loaded from the compile cache, graphs captured (what compile workers are checked by)."""
    out = tmp_path / "bench.json"
    made = bench_engine.engine_cfg

    def warmed(*args, **kwargs):  # on the CPU the warm-up runs only when compiling (auto)
        cfg = made(*args, **kwargs)
        cfg.warmup = "on"
        return cfg

    monkeypatch.setattr(bench_engine, "engine_cfg", warmed)
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", "--configs", "solo", "--n", "1",
                                      "--prompt-tokens", "16", "--max-tokens", "4", "--repeats", "1",
                                      "--no-reverse", "--device", "cpu", "--json", str(out)])
    bench_engine.main()
    got = json.loads(out.read_text())
    warm = got["summary"]["solo@1"]["warmup"]
    assert set(warm) == {"seconds", "compiled_graphs", "cached_graphs", "window_graphs",
                         "prefill_graphs"}
    assert warm["seconds"] > 0 and warm["window_graphs"] > 0
    assert 0 <= warm["cached_graphs"] <= warm["compiled_graphs"]
    # the collector: one full pass after the warm-up (engine.gc_freeze froze the engine's
    # objects, which it skips), and each cohort's passes by generation
    full = got["gc_full"]["1"]
    assert full["ms"] >= 0 and full["objects"] > 0 and full["frozen"] > 0
    cohort = got["summary"]["solo@1"]["gc"][0]
    assert len(cohort["collections"]) == 3 and cohort["ms"] >= cohort["max_ms"] >= 0


def test_request_seeds_give_request_i_seed_k_plus_i(monkeypatch, capsys):
    """--request-seeds K: request i of a cohort samples with seed K + i (default: seed 0 for
    all, the engine's default); a negative K is a usage error naming the flag."""
    assert [bench_engine.request_seed(None, i) for i in range(3)] == [0, 0, 0]
    assert [bench_engine.request_seed(5, i) for i in range(3)] == [5, 6, 7]
    monkeypatch.setattr(sys, "argv", ["bench_engine.py", "--request-seeds", "-1", "--device", "cpu"])
    with pytest.raises(SystemExit):
        bench_engine.main()
    assert "--request-seeds: must be in [0, 2**62)" in capsys.readouterr().err
