"""engine.batch_invariant: every window runs exactly window_rows rows, so a row's arithmetic
cannot depend on the window it lands in (bfloat16 GEMM kernels differ by row count on the GPU).
On CPU in float32 the text is the same with and without it; what is checked here is the shape
rule, that the engine and the simulator agree on it (warm-up keys, replay), and the text."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sim.config import register_configs
from sim.replay import replay_trace
from strata.config import StrataConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.model.tiny import make_tiny_random
from strata.trace import invariant_group_rows, invariant_shapes, read_trace, warm_window_keys

pytestmark = pytest.mark.slow  # each test runs engines in several modes (issue 20: fast subset)

register_configs()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("inv"), seed=7, tokenizer=False,
                            max_position_embeddings=512)


def test_every_window_shape_has_window_rows_rows():
    assert [invariant_group_rows(r, 8) for r in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert [invariant_group_rows(r, 12) for r in (1, 2, 3, 4, 5)] == [1, 2, 3, 4, 6]
    assert invariant_shapes(4, 8) == [(2, 4), (4, 2), (8, 1)]   # 3-row groups run as 4
    assert all(n * g == 16 for n, g in invariant_shapes(4, 16))
    keys = warm_window_keys(8, 4, 8, [1, 2, 4, 8, 16], 256, 1024, batch_invariant=True)
    assert keys == [(n, g, t) for t in (256, 512, 1024) for n, g in ((2, 4), (4, 2), (8, 1))]


def run(model_dir, tmp: Path, requests: int = 5, slots: int = 4,
        **engine) -> tuple[list[list[int]], list[dict]]:
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device, cfg.model.path = "cpu", str(model_dir)
    cfg.engine.warmup, cfg.engine.slots, cfg.engine.max_context = "on", slots, 512
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    tmp.mkdir(parents=True, exist_ok=True)
    trace = tmp / "trace.jsonl"
    eng = Engine.from_config(cfg, log=lambda s: None, trace_path=trace)
    # Staggered arrivals and lengths: windows of 1 to 4 groups, solo windows of a lone
    # request, and groups cut short by max_tokens (1 and 3 rows).
    reqs = [Request(f"r{i}", list(range(5 + i, 21 + 7 * (i % 5))),
                    SamplingParams(max_tokens=9 + 5 * (i % 5) + i // 5, stop_at_eos=False),
                    arrival_step=4 * (i % 5), stream_text=False) for i in range(requests)]
    for r in reqs:
        eng.add_request(r)
    done: dict[str, list[int]] = {}
    while eng.has_work():
        for out in eng.step():
            done.setdefault(out.id, []).extend(out.new_token_ids)
    eng.close()
    return [done[r.id] for r in reqs], read_trace(trace)


@pytest.mark.parametrize("mode,batch_mtp,graph_key", [("batch", True, "shape"),
                                                      ("batch", False, "shape"),
                                                      ("solo", False, "shape"),
                                                      ("batch", True, "layout")])
def test_invariant_windows_same_text_and_the_sim_replays_them(model_dir, tmp_path, mode,
                                                              batch_mtp, graph_key):
    base, _ = run(model_dir, tmp_path / "base", mode="solo", batch_mtp=False)
    text, events = run(model_dir, tmp_path / "inv", mode=mode, batch_mtp=batch_mtp,
                       graph_key=graph_key, batch_invariant=True)
    assert text == base  # float32: identical with and without, in every mode
    windows = [e for e in events if e["ev"] == "window"]
    assert windows
    if graph_key == "shape":
        shapes = {e["key"].split(":")[1].split("@")[0] for e in windows}
        assert all(int(n) * int(g) == 8 for n, g in (s.split("x") for s in shapes))
        warm = [e for e in events if e["ev"] == "warmup"][0]["keys"]
        assert all(int(k.split(":")[1].split("x")[0]) * int(k.split("x")[1].split("@")[0]) == 8
                   for k in warm)
    result = replay_trace(events)
    assert result.ok, str(result.first_divergence)


def test_invariant_windows_need_fewer_graphs(model_dir, tmp_path):
    _, plain = run(model_dir, tmp_path / "plain", graph_limit=0)
    _, inv = run(model_dir, tmp_path / "inv", graph_limit=0, batch_invariant=True)
    keys = lambda evs: {e["key"] for e in evs if e["ev"] == "window"}  # noqa: E731
    assert len(keys(inv)) < len(keys(plain))


def test_a_window_takes_only_the_groups_its_padded_shape_holds(model_dir, tmp_path):
    """8 slots, 2-row groups and 1-row groups of requests about to end: rows summing to 8 can
    be 5 groups ([2, 2, 1, 1, 2]), but padded to 2 rows only 4 fit. Every group taken must
    commit (none dropped), and the simulator must build the same windows."""
    # serial: every group taken commits (engine.overlap discards a finished request's group)
    text, events = run(model_dir, tmp_path / "inv", requests=12, slots=8, batch_invariant=True,
                       overlap=False)
    base, _ = run(model_dir, tmp_path / "base", requests=12, slots=8, overlap=False)
    assert text == base
    steps: dict[int, dict] = {}
    for e in events:
        st = steps.setdefault(e["step"], {"window": None, "commits": 0})
        if e["ev"] == "window":
            st["window"] = e
        elif e["ev"] == "commit":
            st["commits"] += 1
    mixed = 0
    for st in steps.values():
        w = st["window"]
        if w is None:
            continue
        runs: list[int] = []
        for i, slot in enumerate(w["layout"]):
            if i and slot == w["layout"][i - 1]:
                runs[-1] += 1
            else:
                runs.append(1)
        mixed += len(set(runs)) > 1
        assert len(runs) * invariant_group_rows(max(runs), 8) <= 8
        assert st["commits"] == len(runs)  # every group committed
    assert mixed  # windows mixing 1- and 2-row groups did occur
    result = replay_trace(events)
    assert result.ok, str(result.first_divergence)


@pytest.mark.parametrize("ring_cls", ["engine", "sim"])
def test_rotation_packs_groups_by_their_padded_rows(ring_cls):
    from sim.rotation import RotationRing as SimRing
    from strata.engine.rotation import RotationRing as EngineRing

    rows = {0: 2, 1: 2, 2: 1, 3: 1, 4: 2, 5: 2}
    ring = EngineRing() if ring_cls == "engine" else SimRing()
    for s in rows:
        ring.join(s)
    build = ring.build if ring_cls == "engine" else ring.build_window
    # By plain rows, 2+2+1+1+2 = 8 fits five groups; padded to 2 rows each only four do.
    assert build(rows.__getitem__, 8) == [0, 1, 2, 3, 4]
    ring.pointer = 0
    assert build(rows.__getitem__, 8, True) == [0, 1, 2, 3]
    # A 3-row group pads to 4 at W=8: it and one more group fill the window.
    rows3 = {0: 3, 1: 1, 2: 1, 3: 1}
    ring = EngineRing() if ring_cls == "engine" else SimRing()
    for s in rows3:
        ring.join(s)
    build = ring.build if ring_cls == "engine" else ring.build_window
    assert build(rows3.__getitem__, 8, True) == [0, 1]


def test_fixed_split_plan_is_the_same_chunk_at_every_tier():
    from strata.kernels.cyext_ops import MAX_ATTENTION_SPLITS, fixed_split_plan

    assert [fixed_split_plan(ctx, 256) for ctx in (256, 512, 1000, 4096)] == \
        [(1, 256), (2, 256), (4, 256), (16, 256)]
    assert fixed_split_plan(512, 100) == (4, 128)  # rounded up to 64 keys
    nsplit, chunk = fixed_split_plan(MAX_ATTENTION_SPLITS * 256 + 1, 256)
    assert nsplit <= MAX_ATTENTION_SPLITS and nsplit * chunk >= MAX_ATTENTION_SPLITS * 256 + 1


def test_invariant_windows_ask_attention_for_fixed_splits(model_dir, tmp_path, monkeypatch):
    from strata.kernels import cyext_ops, reference

    seen = []

    def spying(real):
        def spy(*args, split_keys=0, **kw):
            seen.append(split_keys)
            return real(*args, split_keys=split_keys, **kw)
        return spy

    text, _ = run(model_dir, tmp_path / "plain")
    # The engine binds the backend's kernels at start (strata.kernels.ops.set_backend): spy on
    # both tables it can bind from.
    monkeypatch.setitem(cyext_ops.CPU_OPS, "grouped_window_attention",
                        spying(cyext_ops.CPU_OPS["grouped_window_attention"]))
    monkeypatch.setattr(reference, "grouped_window_attention",
                        spying(reference.grouped_window_attention))
    inv_text, _ = run(model_dir, tmp_path / "inv", batch_invariant=True, invariant_split_keys=128)
    assert inv_text == text
    # Decode windows (and the warm-up's) ask for 128-key chunks; prompt chunks and the MTP
    # drafts keep the kernels' own plan.
    assert 128 in seen and 0 in seen and set(seen) <= {0, 128}
