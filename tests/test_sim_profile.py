"""Cost-profile fitting: a profile fitted from simulated traces gives back the profile."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from sim.config import NOMINAL_PROFILE, SIM_CONF_DIR, register_configs
from sim.costs import CostProfile
from sim.predict import run_predict
from sim.profile import FitError, fit_profile, fit_profile_files, main

register_configs()


def traces(tmp_path):
    paths = []
    for i, extra in enumerate([["engine.slots=1"], ["engine.slots=4"],
                               ["engine.slots=4", "engine.graphs=false"]]):
        with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                "workload=cohort", "workload.requests=4", "workload.prompt_tokens=600",
                "workload.max_tokens=40", "acceptance=markov", f"seed={i}",
                "engine.overlap=false", *extra])  # a profile is fitted from serial loops
        run_predict(cfg, tmp_path / str(i))
        paths.append(tmp_path / str(i) / "trace.jsonl")
    return paths


#: Traces carry `dur` in microseconds.
DUR_RESOLUTION_S = 1e-6


def test_fit_recovers_the_profile_that_made_the_traces(tmp_path):
    truth = CostProfile.load(NOMINAL_PROFILE)
    prof = fit_profile_files(traces(tmp_path))
    assert prof.host_overhead_s == pytest.approx(truth.host_overhead_s, abs=2 * DUR_RESOLUTION_S)
    for tier in prof.decode_tiers:
        for rows in prof.decode_rows:
            for action in ("hit", "capture", "eager"):
                if prof.source["counts"][action][prof.decode_tiers.index(tier)][
                        prof.decode_rows.index(rows)]:
                    assert prof.decode_time(rows, tier, action) == pytest.approx(
                        truth.decode_time(rows, tier, action), abs=DUR_RESOLUTION_S)
    for tokens in prof.prefill_tokens:
        assert prof.prefill_time(tokens) == pytest.approx(truth.prefill_time(tokens),
                                                          abs=DUR_RESOLUTION_S)
    acc = prof.acceptance
    assert 0 < acc["rate"] < 1 and acc["commits"] > 0
    assert set(acc["markov"]) == {"p_accept_after_accept", "p_accept_after_reject",
                                  "p_accept_first"}


def test_fit_fills_missing_actions_and_saves(tmp_path):
    paths = traces(tmp_path)[:1]  # graphs on only: no eager windows
    out = tmp_path / "p.json"
    assert main(["--out", str(out)] + [str(p) for p in paths]) == 0
    prof = CostProfile.load(out)
    assert prof.source["actions_copied"] == {"eager": "hit"}
    assert prof.decode_time(2, 256, "eager") == prof.decode_time(2, 256, "hit")


def test_fit_without_durations_is_an_error():
    with pytest.raises(FitError, match="no window event"):
        fit_profile([[{"ev": "window", "step": 0, "t": 0, "layout": [0], "key": "k",
                       "graph": "hit", "rows": 1}]])


def test_profile_engine_script_grid_and_fit_only(tmp_path, capsys):
    from strata.tools import profile_engine as mod
    assert mod.main(["--dry-run", "--device", "cpu", "--slots", "1,8", "--prompt-tokens", "64",
                     "--eager-slots", "8", "--work-dir", str(tmp_path)]) == 0
    cmds = [l for l in capsys.readouterr().out.splitlines() if l.startswith("[")]
    assert len(cmds) == 6  # slots 1: mtp on/off; slots 8: mtp on/off x graphs on/off
    assert all("device=cpu" in c and "-m strata workload=synthetic" in c for c in cmds)
    assert sum("engine.graphs=false" in c for c in cmds) == 2
    assert all("engine.overlap=false" in c for c in cmds)  # on a CPU: serial runs only
    # On CUDA each graph cell's smallest prompt runs once more overlapped (host.submit_s).
    assert mod.main(["--dry-run", "--device", "cuda", "--slots", "1,8", "--prompt-tokens",
                     "64,512", "--eager-slots", "8", "--work-dir", str(tmp_path)]) == 0
    cmds = [l for l in capsys.readouterr().out.splitlines() if l.startswith("[")]
    over = [c for c in cmds if "engine.overlap=true" in c]
    assert len(cmds) == 16 and len(over) == 4  # 12 serial: slots 8 also eager
    assert all("engine.graphs=true" in c and "workload.prompt_tokens=64" in c for c in over)
    out = tmp_path / "p.json"
    assert mod.main(["--fit-only", *map(str, traces(tmp_path)), "--out", str(out)]) == 0
    assert CostProfile.load(out).source["device"] == "cuda"


# --- fitting behaviour on hand-made traces ------------------------------------------------

KNOBS = {"prefill_buckets": [16, 32, 64, 128, 256], "context_tier_min": 256, "max_context": 1024}


def _trace(windows=(), prefills=(), commits=(), knobs=KNOBS):
    """A minimal trace: `config`, then the given events, one step each."""
    evs = [{"ev": "config", "step": 0, "t": 0.0, "engine": dict(knobs), "memory": {}}]
    step = 0
    for key, layout, tier, graph, dur in windows:
        evs.append({"ev": "window", "step": step, "t": step * 1.0, "layout": list(layout),
                    "key": key, "graph": graph, "rows": len(layout), "dur": dur, "ctx": tier})
        step += 1
    for tokens, ctx, dur in prefills:
        evs.append({"ev": "prefill", "step": step, "t": step * 1.0, "req": "a", "slot": 0,
                    "tokens": tokens, "dur": dur, "ctx": ctx})
        step += 1
    for req, drafted, accepted in commits:
        evs.append({"ev": "commit", "step": step, "t": step * 1.0, "req": req, "slot": 0,
                    "drafted": drafted, "accepted": accepted, "emitted": accepted + 1})
        step += 1
    return evs


def test_windows_of_equal_rows_but_different_shapes_are_costed_apart():
    # A lone slot's 1x4 window and two 2-row groups (2x2) both have 4 rows; they cost
    # differently, and the profile keeps them apart (the rows table alone mixes them).
    w = [("shape:1x4@256", [0, 0, 0, 0], 256, "hit", 0.010)] * 5 + \
        [("shape:2x2@256", [0, 0, 1, 1], 256, "hit", 0.007)] * 5
    prof = fit_profile([_trace(windows=w, prefills=[(64, 64, 0.01)])])
    assert prof.decode_time(4, 256, "hit", (1, 4)) == pytest.approx(0.010)
    assert prof.decode_time(4, 256, "hit", (2, 2)) == pytest.approx(0.007)
    assert prof.source["shape_counts"]["hit"] == [[5, 5]]
    # Shapes from layout keys and eager windows come from the layout's runs of one slot.
    lay = [("layout:3,3,5,5,5@256", [3, 3, 5, 5, 5], 256, "eager", 0.02),
           ("eager", [0, 0, 0, 0], 256, "eager", 0.020)]
    prof = fit_profile([_trace(windows=w + lay, prefills=[(64, 64, 0.01)])])
    assert "2x3" in prof.decode_shapes
    assert prof.decode_time(5, 256, "eager", (2, 3)) == pytest.approx(0.02)
    # A shape never measured for an action: another action's value times their median ratio
    # over the shapes measured for both (1x4 here: hit 0.010, eager 0.020).
    assert prof.decode_time(5, 256, "hit", (2, 3)) == pytest.approx(0.02 * 0.010 / 0.020)
    assert prof.decode_time(4, 256, "eager", (2, 2)) == pytest.approx(0.007 * 0.020 / 0.010)
    # A shape the profile never saw falls back to the rows table.
    assert prof.decode_time(4, 256, "hit", (4, 1)) == prof.decode_time(4, 256, "hit")
    # The profile round-trips through JSON with its shape table.
    again = CostProfile.from_dict(prof.to_dict())
    assert again.decode_time(4, 256, "hit", (1, 4)) == pytest.approx(0.010)


def test_few_samples_take_the_minimum_and_outliers_do_not_move_a_median():
    w = [("shape:1x2@256", [0, 0], 256, "hit", d) for d in (0.010, 0.690)] + \
        [("shape:2x2@256", [0, 0, 1, 1], 256, "hit", d) for d in (0.012, 0.011, 0.330)]
    prof = fit_profile([_trace(windows=w, prefills=[(64, 64, 0.01)])])
    assert prof.decode_time(2, 256, "hit", (1, 2)) == pytest.approx(0.010)
    assert prof.decode_time(4, 256, "hit", (2, 2)) == pytest.approx(0.012)
    assert prof.decode_time(2, 256, "hit") == pytest.approx(0.010)   # the rows table too


def test_missing_tier_scales_by_the_ratio_of_shapes_measured_at_both():
    w = [("shape:4x2@256", [0, 0, 1, 1, 2, 2, 3, 3], 256, "hit", 0.010)] * 3 + \
        [("shape:4x2@1024", [0, 0, 1, 1, 2, 2, 3, 3], 1024, "hit", 0.012)] * 3 + \
        [("shape:1x4@256", [0, 0, 0, 0], 256, "hit", 0.020)] * 3
    prof = fit_profile([_trace(windows=w, prefills=[(64, 64, 0.01)])])
    assert prof.decode_time(4, 1024, "hit", (1, 4)) == pytest.approx(0.020 * 1.2)
    assert prof.decode_time(8, 512, "hit", (4, 2)) == pytest.approx(0.011)  # log2 halfway


def test_prefill_is_costed_by_bucket_and_tier():
    # 100 and 128 tokens both run as the 128 bucket; a 128-token chunk starting at 256 reads
    # tier 512. Without buckets in the config each token count is its own point.
    pre = [(100, 100, 0.020), (128, 128, 0.022), (100, 100, 0.021),
           (256, 256, 0.040), (128, 384, 0.030), (256, 512, 0.050)]
    prof = fit_profile([_trace(windows=[("shape:1x1@256", [0], 256, "hit", 0.005)],
                               prefills=pre)])
    assert prof.prefill_tokens == [128.0, 256.0]
    assert prof.prefill_tiers == [256.0, 512.0]
    assert prof.prefill_time(128, 256) == pytest.approx(0.021)
    assert prof.prefill_time(128, 512) == pytest.approx(0.030)
    assert prof.prefill_time(256, 512) == pytest.approx(0.050)
    assert prof.source["prefill_table_counts"] == [[3, 1], [1, 1]]
    old = fit_profile([_trace(windows=[("shape:1x1@256", [0], 256, "hit", 0.005)],
                              prefills=pre, knobs={})])
    assert old.prefill_tokens == [100.0, 128.0, 256.0] and old.prefill_table is None


def test_prefill_comes_from_graph_chunks_when_a_trace_has_them():
    # A CUDA engine with graphs (no fixed graph_mib) replays prompt-chunk graphs; one with
    # graphs off runs them eagerly, several times slower. The profile is for graph runs.
    win = [("shape:1x1@256", [0], 256, "hit", 0.005)]
    graphs = _trace(windows=win, prefills=[(64, 64, 0.001)] * 3)
    graphs[0].update(engine=dict(KNOBS, graphs=True, prefill_graphs=True), memory={"graph_mib": None})
    eager = _trace(windows=win, prefills=[(64, 64, 0.013)] * 3)
    eager[0].update(engine=dict(KNOBS, graphs=False, prefill_graphs=True), memory={"graph_mib": None})
    prof = fit_profile([graphs, eager])
    assert prof.prefill_time(64, 256) == pytest.approx(0.001)
    assert prof.source["prefill_from"] == "graphs" and prof.source["prefill_eager_left_out"] == 3
    # Eager chunks only (a CPU engine, or graphs off everywhere): those are the profile.
    only = fit_profile([eager])
    assert only.prefill_time(64, 256) == pytest.approx(0.013) and only.source["prefill_from"] == "eager"


def test_prefill_tier_missing_for_a_bucket_scales_by_another_bucket():
    pre = [(64, 64, 0.010), (256, 256, 0.040), (256, 512, 0.050)]
    prof = fit_profile([_trace(windows=[("shape:1x1@256", [0], 256, "hit", 0.005)],
                               prefills=pre)])
    assert prof.prefill_time(64, 512) == pytest.approx(0.010 * 0.050 / 0.040)


def test_acceptance_position_rates_follow_the_output_position():
    from sim.acceptance import POSITION_TOKENS, PositionAcceptance
    from sim.streams import RandomStreams
    # Early drafts (positions < 2 buckets) always rejected, later ones always accepted.
    commits = []
    for r in range(40):
        emitted = 1
        while emitted < 6 * POSITION_TOKENS:
            a = 1 if emitted >= 2 * POSITION_TOKENS else 0
            commits.append((f"r{r}", 1, a))
            emitted += a + 1
    prof = fit_profile([_trace(windows=[("shape:1x1@256", [0], 256, "hit", 0.005)],
                               prefills=[(64, 64, 0.01)], commits=commits)])
    pos = prof.acceptance["position"]
    assert pos["tokens"] == POSITION_TOKENS
    assert pos["rate"][:2] == [0.0, 0.0] and all(r == 1.0 for r in pos["rate"][2:])
    assert pos["depth_factor"] == [1.0]  # single-draft groups: no deeper draft judged
    model = PositionAcceptance(pos["rate"], pos["tokens"], RandomStreams(0))

    class Req:
        index = 0
    assert model.accepted(Req(), 3, position=1) == 0
    assert model.accepted(Req(), 3, position=2 * POSITION_TOKENS) == 3
    assert model.accepted(Req(), 3, position=10_000) == 3       # the last rate holds


def test_acceptance_depth_factors_against_the_position_rates():
    # First drafts accepted half the time; a second draft, when judged, never.
    commits = []
    for r in range(80):
        commits += [(f"r{r}", 2, 1), (f"r{r}", 2, 0)]
    fit = fit_profile([_trace(windows=[("shape:1x1@256", [0], 256, "hit", 0.005)],
                              prefills=[(64, 64, 0.01)], commits=commits)]).acceptance
    assert fit["position"]["rate"] == [0.5]
    assert fit["position"]["depth_factor"] == [1.0, 0.0]
    assert fit["position"]["depth_judged"] == [160, 80]


def test_each_trace_speed_is_divided_out_before_cells_are_taken():
    # Two engine processes measured the shared 1x2 shape: one ran everything 1.44x slower
    # (1.2x above the mean speed in log terms). Each process alone measured one more shape.
    # Without the speed factors, 2x2 would be priced at the slow process's speed; with them
    # every cell is priced at the two processes' mean (geometric) speed.
    fast = [("shape:1x2@256", [0, 0], 256, "hit", 0.010)] * 30 + \
           [("shape:1x4@256", [0, 0, 0, 0], 256, "hit", 0.020)] * 30
    slow = [("shape:1x2@256", [0, 0], 256, "hit", 0.0144)] * 30 + \
           [("shape:2x2@256", [0, 0, 1, 1], 256, "hit", 0.0144 * 1.5)] * 30
    prof = fit_profile([_trace(windows=fast, prefills=[(64, 64, 0.01)]),
                        _trace(windows=slow, prefills=[(64, 64, 0.01)])])
    assert prof.source["trace_speeds"]["window"] == pytest.approx([1 / 1.2, 1.2], rel=1e-3)
    assert prof.decode_time(2, 256, "hit", (1, 2)) == pytest.approx(0.012, rel=1e-3)
    assert prof.decode_time(4, 256, "hit", (1, 4)) == pytest.approx(0.024, rel=1e-3)
    assert prof.decode_time(4, 256, "hit", (2, 2)) == pytest.approx(0.018, rel=1e-3)
    # A trace with too few samples to judge keeps factor 1 and does not move the others.
    short = [("shape:1x2@256", [0, 0], 256, "hit", 0.5)] * 3
    prof = fit_profile([_trace(windows=fast, prefills=[(64, 64, 0.01)]),
                        _trace(windows=slow, prefills=[(64, 64, 0.01)]),
                        _trace(windows=short, prefills=[(64, 64, 0.01)])])
    assert prof.source["trace_speeds"]["window"][2] == 1.0
    assert prof.decode_time(4, 256, "hit", (2, 2)) == pytest.approx(0.018, rel=1e-3)


def test_trace_speeds_come_from_shared_cells_only():
    from sim.profile import _trace_speeds

    # Most samples in cells only one trace measured: they say nothing about speed (a cell's
    # effect would just take on its one trace's speed), and must not hold the factors at 1.
    a = [("shared", 0.010)] * 30 + [("only_a", 0.02)] * 70
    b = [("shared", 0.0144)] * 30 + [("only_b", 0.03)] * 70
    lone = [("only_c", 0.05)] * 50  # shares no cell with anyone: nothing to compare it with
    f = _trace_speeds({0: a, 1: b, 2: lone})
    assert f[0] == pytest.approx(1 / 1.2) and f[1] == pytest.approx(1.2) and f[2] == 1.0


def _after_chunks(windows_before, after):
    """A trace of `windows_before`, then pairs of (prompt chunk, window right after it)."""
    evs = _trace(windows=windows_before)
    step = len(windows_before)
    for key, layout, tier, graph, dur in after:
        evs.append({"ev": "prefill", "step": step, "t": step * 1.0, "req": "a", "slot": 0,
                    "tokens": 64, "dur": 0.01, "ctx": 64})
        evs.append({"ev": "window", "step": step + 1, "t": step + 1.0, "layout": list(layout),
                    "key": key, "graph": graph, "rows": len(layout), "dur": dur, "ctx": tier})
        step += 2
    return evs


def test_windows_right_after_a_prompt_chunk_neither_judge_speed_nor_price_a_measured_cell():
    # Run b's 1x2 windows after prompt chunks are 1.4x dearer; its other windows go at a's
    # speed. They must not make b look slow (its 2x2 cell would be priced cheap), nor move
    # the 1x2 cell, which has plain samples enough.
    w12 = ("shape:1x2@256", [0, 0], 256, "hit")
    w22 = ("shape:2x2@256", [0, 0, 1, 1], 256, "hit")
    a = _trace(windows=[(*w12, 0.010)] * 30, prefills=[(64, 64, 0.01)])
    b = _after_chunks([(*w12, 0.010)] * 5 + [(*w22, 0.012)] * 30, [(*w12, 0.014)] * 30)
    prof = fit_profile([a, b])
    assert prof.source["trace_speeds"]["window"] == pytest.approx([1.0, 1.0])
    assert prof.decode_time(2, 256, "hit", (1, 2)) == pytest.approx(0.010)
    assert prof.decode_time(4, 256, "hit", (2, 2)) == pytest.approx(0.012)
    # A cell measured only right after chunks still gets a price: those samples.
    c = _after_chunks([], [(*w22, 0.02)] * 4)
    assert fit_profile([c]).decode_time(4, 256, "hit", (2, 2)) == pytest.approx(0.02)


def test_a_few_samples_at_one_tier_give_way_to_the_steady_tier_and_the_tiers_ratio():
    # 1x4 measured steadily at 256 and by 4 dear transitional windows at 512; 4x2 steadily at
    # both (512 costs 1.02x). The 1x4@512 cell is the steady 256 one times that ratio.
    w14 = ("shape:1x4@256", [0, 0, 0, 0], 256, "hit")
    w42 = ("shape:4x2@256", [0, 0, 1, 1, 2, 2, 3, 3], 256, "hit")
    w = ([(*w14, 0.010)] * 30 + [("shape:1x4@512", [0, 0, 0, 0], 512, "hit", 0.013)] * 4
         + [(*w42, 0.020)] * 30 + [("shape:4x2@512", [0, 0, 1, 1, 2, 2, 3, 3], 512, "hit",
                                    0.0204)] * 30)
    prof = fit_profile([_trace(windows=w, prefills=[(64, 64, 0.01)])])
    assert prof.decode_time(4, 512, "hit", (1, 4)) == pytest.approx(0.0102)
    assert prof.decode_time(8, 512, "hit", (4, 2)) == pytest.approx(0.0204)
    assert prof.source["shape_counts"]["hit"][1][prof.decode_shapes.index("1x4")] == 4


def test_serial_windows_with_dev_split_into_device_tables_and_a_launch_share():
    """Windows that carry `dev` (a serial engine's CUDA events) price the decode tables on
    `dev`; the rest of each replayed window's `dur` is the profile's host.launch_s, which
    engine.overlap hides. Traces of which some windows lack `dev` keep `dur` whole."""
    w = [("shape:1x4@256", [0, 0, 0, 0], 256, "hit", 0.010)] * 5
    timed = _trace(windows=w, prefills=[(64, 64, 0.01)])
    for e in timed:
        if e["ev"] == "window":
            e["dev"] = 0.0085
    prof = fit_profile([timed])
    assert prof.decode_time(4, 256, "hit", (1, 4)) == pytest.approx(0.0085)
    assert prof.host_launch_s == pytest.approx(0.0015)
    assert prof.source["launch_samples"] == 5
    assert CostProfile.from_dict(prof.to_dict()).host_launch_s == pytest.approx(0.0015)
    mixed = fit_profile([timed, _trace(windows=w, prefills=[(64, 64, 0.01)])])
    assert mixed.decode_time(4, 256, "hit", (1, 4)) == pytest.approx(0.010)
    assert mixed.host_launch_s == 0.0 and mixed.source["launch_samples"] == 0
