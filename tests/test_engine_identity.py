"""Output identity across modes (DESIGN.md section 4, last bullet; SCHEDULING.md).

Every request's token ids must be the same whether it runs one at a time (`engine.mode=solo`),
in plain batch slots (`batch_mtp=false`) or with grouped MTP verification (`batch_mtp=true`),
whatever runs beside it: cohorts of N = 1, 2, 3, 4, 5, 8 requests with staggered arrivals and
different prompt and output lengths, graphs off and on (shape and layout keys). Sampled output
(position-keyed Gumbel noise) must be identical too. The sampled pool mixes requests that filter
(top-k / top-p) with plain-temperature and greedy ones: a window holding a filtering request
samples every row with the sorting sampler, any other window with the sort-free one, so a plain
request's tokens must not depend on who shares its windows.

Random models accept drafts almost never, so a second checkpoint ("echo-MTP") makes the MTP
head a copy of the main model's bigram path: its draft for position i+2 is the main model's
prediction from token t[i+1] alone, which agrees with the real target often but not always.
Those runs must commit real accepted drafts (sum of commit.accepted > 0) and still be identical.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import run_cohort
from omegaconf import OmegaConf

from strata.config import StrataConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.engine.sampling import sample
from strata.model.loader import save_checkpoint
from strata.model.qwen3_next import Qwen3Next
from strata.model.tiny import init_random, tiny_args

torch.set_num_threads(1)  # the tiny model is faster on one thread, and CI has 2 shared cores

MAX_CONTEXT = 256
PREFILL_CHUNK = 5  # several prompts take more than one chunk, interleaved with decode windows

# (prompt tokens, max_tokens, arrival_step) of the request pool; cohort N = the first N.
POOL = [(7, 10, 0), (3, 6, 0), (12, 9, 1), (5, 12, 2), (17, 7, 2), (1, 8, 4), (9, 11, 5),
        (4, 5, 9)]
GRAPHS = ["off", "shape", "layout"]
# Cohorts: (N requests, slots, window rows). N <= slots: all N run concurrently; W=6 and W=8
# with 8 slots rotate batch_mtp groups through the ring; the last case queues 8 over 3 slots.
COHORTS = [(1, 4, 8), (2, 4, 8), (3, 4, 6), (4, 4, 8), (5, 8, 6), (8, 8, 8), (8, 3, 4)]
COHORT_IDS = [f"n{n}-s{s}-w{w}" for n, s, w in COHORTS]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("STRATA_BATCH_MTP", raising=False)


@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    """Tiny random Qwen3-Next + MTP with peaky logits (head_std=0.5, as make_tiny_random) and
    layer weights of std 0.1 instead of 0.02, so that the next token depends on the whole
    context (attention, DeltaNet state), not mostly on the last token: a wrong K/V row or a
    wrong DeltaNet state commit changes the output."""
    path = tmp_path_factory.mktemp("identity-random")
    torch.manual_seed(3)
    model = init_random(Qwen3Next(tiny_args(eos_token_id=[0]), with_mtp=True), seed=3, std=0.1,
                        head_std=0.5, norm_std=0.1)
    save_checkpoint(model, path)
    return path


@torch.no_grad()
def make_echo_mtp(path, seed: int = 1, alpha: float = 0.7):
    """A checkpoint whose MTP draft often equals the main model's target.

    The main model keeps its random layers, their residual contributions scaled by `alpha`, so
    its logits are dominated by the bigram path lm_head(norm(embed(t_i))). The MTP passes the
    embedding half of its fc input through (fc = [I, W_h] with W_h small random: the draft
    still depends on h), and its mtp.norm weight equals model.norm's, so its draft for t[i+2] is
    about the bigram prediction from t[i+1]: right when the context does not change the argmax.
    """
    args = tiny_args(eos_token_id=[0])
    torch.manual_seed(seed)
    m = init_random(Qwen3Next(args, with_mtp=True), seed=seed, head_std=0.5, norm_std=0.1)

    def scale_layer(layer):
        if layer.kind == "linear_attention":
            layer.linear_attn.out_proj.weight.mul_(alpha)
        else:
            layer.self_attn.o_proj.weight.mul_(alpha)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            mlp.experts.w_down.mul_(alpha)
            mlp.shared_expert.down_proj.weight.mul_(alpha)
        else:
            mlp.down_proj.weight.mul_(alpha)

    for layer in m.layers:
        scale_layer(layer)
    h = args.hidden_size
    m.mtp.fc.weight[:, :h] = torch.eye(h)  # the hidden half keeps its small random weights
    m.mtp.pre_fc_norm_embedding.weight.zero_()
    m.mtp.norm.weight.copy_(m.norm.weight)
    scale_layer(m.mtp.layers[0])
    m.lm_head.weight[0] = 0.0  # EOS (id 0) rarely wins: outputs run to max_tokens
    save_checkpoint(m, path)
    return path


@pytest.fixture(scope="session")
def echo_model(tmp_path_factory):
    return make_echo_mtp(tmp_path_factory.mktemp("identity-echo"))


def pool_requests(n: int, sampled: bool, vocab: int = 512) -> list[Request]:
    rng = random.Random(1234)
    out = []
    for i, (plen, max_tokens, arrival) in enumerate(POOL):
        ids = [rng.randrange(1, vocab) for _ in range(plen)]
        if sampled:
            # i % 4: 0 top-k and top-p, 1 plain temperature, 2 top-p, 3 greedy (top_p is
            # ignored at temperature 0, so it does not filter)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 4 == 3 else 0.8,
                                    top_p=1.0 if i % 4 == 1 else 0.9,
                                    top_k=20 if i % 4 == 0 else 0, seed=1000 + 7 * i)
        else:
            params = SamplingParams(max_tokens=max_tokens)
        out.append(Request(f"r{i}", ids, params, arrival_step=arrival))
    return out[:n]


def engine_for(model_dir, mode: str, graphs: str = "off", slots: int = 4, window_rows: int = 8,
               spec: int = 4, overlap: bool | None = None, prefill_slots: int = 1,
               batch_mtp_drafts: int | None = 1) -> Engine:
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device = "cpu"
    cfg.model.path = str(model_dir)
    e = cfg.engine
    e.mode = "solo" if mode == "solo" else "batch"
    e.batch_mtp = mode == "batch_mtp"
    e.slots, e.window_rows, e.spec = slots, window_rows, spec
    e.max_context = MAX_CONTEXT
    e.prefill_chunk = PREFILL_CHUNK
    e.prefill_slots = prefill_slots
    e.batch_mtp_drafts = batch_mtp_drafts
    e.graphs = graphs != "off"
    e.overlap = overlap
    if graphs != "off":
        e.graph_key = graphs
    return Engine.from_config(cfg, log=lambda s: None)


def run(model_dir, mode: str, requests: list[Request], **kw):
    eng = engine_for(model_dir, mode, **kw)
    run_cohort(eng, requests, 2000)
    outs = {rid: (list(rs.emitted), rs.reason) for rid, rs in eng.requests.items()}
    return outs, eng


_REFS: dict = {}


def solo_reference(model_dir, sampled: bool):
    """Every pool request run one at a time (solo, eager): the ground truth."""
    key = (str(model_dir), sampled)
    if key not in _REFS:
        outs, eng = run(model_dir, "solo", pool_requests(len(POOL), sampled))
        for i, (plen, max_tokens, _) in enumerate(POOL):
            toks, reason = outs[f"r{i}"]
            assert reason in ("length", "stop")
            assert reason == "stop" or len(toks) == max_tokens
        # solo is one at a time: no window ever holds two slots
        assert all(len(set(ev["layout"])) == 1 for ev in eng.trace.events if ev["ev"] == "window")
        _REFS[key] = (outs, eng)
    return _REFS[key]


def commits(eng):
    return [ev for ev in eng.trace.events if ev["ev"] == "commit"]


def assert_same(outs, ref, n):
    for i in range(n):
        rid = f"r{i}"
        assert outs[rid] == ref[rid], f"{rid}: {outs[rid]} != solo {ref[rid]}"


def assert_grouped_mtp_ran(eng):
    """batch_mtp really verified 2-row groups of several slots in one window."""
    assert eng.batch_mtp
    multi = [ev for ev in eng.trace.events if ev["ev"] == "window" and len(set(ev["layout"])) > 1]
    assert multi, "no window held two slots"
    assert any(ev["layout"].count(s) == 2 for ev in multi for s in set(ev["layout"]))


@pytest.mark.slow
@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("n,slots,w", COHORTS, ids=COHORT_IDS)
def test_greedy_identity_random_model(random_model, n, slots, w, graphs):
    ref, _ = solo_reference(random_model, sampled=False)
    for mode in ("batch", "batch_mtp"):
        outs, eng = run(random_model, mode, pool_requests(n, False), graphs=graphs, slots=slots,
                        window_rows=w)
        assert_same(outs, ref, n)
        if mode == "batch_mtp" and n >= 2:
            assert_grouped_mtp_ran(eng)
        if mode == "batch" and n >= 2:
            assert not eng.batch_mtp
            # plain batch: several slots in a window only ever as 1-row groups
            for ev in eng.trace.events:
                if ev["ev"] == "window" and len(set(ev["layout"])) > 1:
                    assert len(ev["layout"]) == len(set(ev["layout"]))
        actions = {ev["graph"] for ev in eng.trace.events if ev["ev"] == "window"}
        if graphs == "off":
            assert actions == {"eager"}
        else:
            assert "capture" in actions
            keys = {ev["key"] for ev in eng.trace.events if ev["ev"] == "window"}
            assert all(k.startswith(graphs + ":") for k in keys)


def assert_shared_chunks(eng):
    """Some prompt chunk held several slots' chunks (engine.prefill_slots), and its events say
    so, one per slot of the chunk."""
    by_step: dict = {}
    for ev in eng.trace.events:
        if ev["ev"] == "prefill":
            by_step.setdefault(ev["step"], []).append(ev)
    shared = [evs for evs in by_step.values() if len(evs) > 1]
    assert shared, "no prompt chunk held two slots"
    for evs in by_step.values():
        assert all(ev.get("segments", 1) == len(evs) for ev in evs)
        assert len({ev["slot"] for ev in evs}) == len(evs)


@pytest.mark.parametrize("sampled", [False, True])
def test_prefill_slots_identity(random_model, sampled):
    """Prompt chunks holding up to three slots' chunks (engine.prefill_slots=3, prompts of 1-17
    tokens in chunks of 5, staggered arrivals) give every request the tokens it gets alone."""
    ref, _ = solo_reference(random_model, sampled=sampled)
    for mode in ("batch", "batch_mtp"):
        outs, eng = run(random_model, mode, pool_requests(len(POOL), sampled), slots=8,
                        window_rows=6, prefill_slots=3)
        assert_same(outs, ref, len(POOL))
        assert_shared_chunks(eng)


def test_prefill_slots_near_the_end_of_the_context(random_model):
    """A chunk's segments are padded to the bucket of the longest, so a short segment near the
    end of the context pads past it (its K/V padding rows are clamped there): a 60-token prompt
    of a 64-position context in chunks of 24 (buckets 8 and 32) beside shorter prompts gives
    every request the tokens it gets with one slot a chunk."""
    outs = {}
    for slots in (1, 3):
        cfg = OmegaConf.structured(StrataConfig)
        cfg.device, cfg.model.path = "cpu", str(random_model)
        e = cfg.engine
        e.mode, e.batch_mtp, e.slots, e.max_context = "batch", True, 3, 64
        e.prefill_chunk, e.prefill_buckets, e.prefill_slots = 24, [8, 32], slots
        eng = Engine.from_config(cfg, log=lambda s: None)
        rng = random.Random(9)
        reqs = [Request(f"r{i}", [rng.randrange(1, 512) for _ in range(plen)],
                        SamplingParams(max_tokens=3), arrival_step=arrival)
                for i, (plen, arrival) in enumerate(((60, 0), (20, 0), (10, 1), (9, 2)))]
        run_cohort(eng, reqs, 200)
        outs[slots] = {rid: (list(rs.emitted), rs.reason) for rid, rs in eng.requests.items()}
        if slots > 1:
            assert_shared_chunks(eng)
    assert outs[3] == outs[1]


@pytest.mark.slow
@pytest.mark.parametrize("graphs,overlap", [("shape", True), ("layout", False)])
def test_prefill_slots_identity_graphs(random_model, graphs, overlap):
    ref, _ = solo_reference(random_model, sampled=False)
    outs, eng = run(random_model, "batch_mtp", pool_requests(len(POOL), False), graphs=graphs,
                    slots=3, window_rows=4, overlap=overlap, prefill_slots=8)
    assert_same(outs, ref, len(POOL))
    assert_shared_chunks(eng)


@pytest.mark.parametrize("graphs", ["shape", "layout"])
def test_solo_identity_with_graphs(random_model, graphs):
    ref, _ = solo_reference(random_model, sampled=False)
    outs, eng = run(random_model, "solo", pool_requests(len(POOL), False), graphs=graphs)
    assert_same(outs, ref, len(POOL))
    assert any(ev["graph"] == "hit" for ev in eng.trace.events if ev["ev"] == "window")


@pytest.mark.slow
@pytest.mark.parametrize("n,slots,w", COHORTS, ids=COHORT_IDS)
def test_sampled_identity_random_model(random_model, n, slots, w):
    ref, _ = solo_reference(random_model, sampled=True)
    greedy, _ = solo_reference(random_model, sampled=False)
    # sampling really samples: some request differs from its greedy output
    assert any(ref[f"r{i}"][0] != greedy[f"r{i}"][0] for i in range(len(POOL)))
    for k, mode in enumerate(("batch", "batch_mtp")):
        graphs = GRAPHS[(COHORTS.index((n, slots, w)) + k) % 3]
        outs, _ = run(random_model, mode, pool_requests(n, True), graphs=graphs, slots=slots,
                      window_rows=w)
        assert_same(outs, ref, n)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("n,w,graphs,overlap", [(2, 8, "off", False), (3, 12, "shape", True),
                                                (4, 8, "layout", None)])
def test_deeper_batch_mtp_groups_identity(random_model, sampled, n, w, graphs, overlap):
    """engine.batch_mtp_drafts=null: slots that leave the window room verify up to spec - 1
    drafts each in one window (W // D rows a group), and every request's tokens are still the
    solo reference's, greedy and sampled."""
    ref, _ = solo_reference(random_model, sampled=sampled)
    outs, eng = run(random_model, "batch_mtp", pool_requests(n, sampled), graphs=graphs,
                    slots=4, window_rows=w, overlap=overlap, batch_mtp_drafts=None)
    assert_same(outs, ref, n)
    deep = [ev for ev in eng.trace.events if ev["ev"] == "window" and len(set(ev["layout"])) > 1
            and max(ev["layout"].count(s) for s in set(ev["layout"])) > 2]
    assert deep, "no window held several slots' groups of more than 2 rows"
    for ev in deep:  # never more rows a group than the window's share, nor than spec
        assert max(ev["layout"].count(s) for s in set(ev["layout"])) <= min(4, w // 2)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_solo_reference_equals_no_cache_decoding(random_model, sampled):
    """The ground truth itself: each request's output equals a plain loop that recomputes the
    whole sequence without any cache (forward_train) and samples the token at position i with
    the documented position-keyed rule (DESIGN.md section 4)."""
    ref, eng = solo_reference(random_model, sampled)
    model = eng.model
    for r in pool_requests(len(POOL), sampled):
        p = r.params
        seq = list(r.prompt_ids)
        out = []
        with torch.no_grad():
            while len(out) < p.max_tokens:
                logits = model.logits(model.forward_train(torch.tensor([seq])))[0, -1:]
                tok = int(sample(logits, torch.tensor([float(p.temperature)]), torch.tensor([p.top_k]),
                                 torch.tensor([float(p.top_p)]), torch.tensor([p.seed]),
                                 torch.tensor([len(seq)]))[0])
                if tok in eng.eos:
                    break
                out.append(tok)
                seq.append(tok)
        assert ref[r.id][0] == out, r.id


def test_sampling_depends_on_seed(random_model):
    a, _ = run(random_model, "batch_mtp", pool_requests(2, True))
    reqs = pool_requests(2, True)
    for r in reqs:
        r.params.seed += 1
    b, _ = run(random_model, "batch_mtp", reqs)
    assert a != b


def window_requests(eng):
    """(window event, the requests of its slots) for every window of the engine's trace."""
    by_slot, out = {}, []
    for ev in eng.trace.events:
        if ev["ev"] == "admit":
            by_slot[ev["slot"]] = ev["req"]
        elif ev["ev"] == "window":
            out.append((ev, {by_slot[s] for s in ev["layout"]}))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("graphs", ["shape", "layout"])
@pytest.mark.parametrize("mode", ["solo", "batch_mtp"])
def test_filtered_key_suffix_only_on_windows_with_a_filtering_request(random_model, mode, graphs):
    """One top_p=0.9 request among plain ones: exactly the windows that hold it are keyed `+f`
    (they run the sorting sampler), and the plain requests' tokens equal their solo runs."""
    def requests():
        reqs = pool_requests(len(POOL), True)
        for r in reqs:
            if r.id != "r2":  # r2 alone filters; r3 and r7 stay greedy, the rest plain
                r.params.top_k, r.params.top_p = 0, 1.0
        return reqs

    reqs = requests()
    # serial: window_requests reads a window's slots against the admissions before it
    outs, eng = run(random_model, mode, reqs, graphs=graphs, overlap=False)
    arrive = {ev["req"]: ev["filtered"] for ev in eng.trace.events if ev["ev"] == "arrive"}
    assert arrive == {r.id: r.id == "r2" for r in reqs}
    windows = window_requests(eng)
    suffixed = [ev["key"].endswith("+f") for ev, _ in windows]
    assert suffixed == ["r2" in held for _, held in windows]
    assert any(suffixed) and not all(suffixed)
    assert all(ev["key"].startswith(graphs + ":") for ev, _ in windows)
    # without r2 no window filters: the plain requests' tokens must not change
    plain, _ = run(random_model, "solo", [r for r in requests() if r.id != "r2"])
    for rid, toks in plain.items():
        assert outs[rid] == toks, rid


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("n,slots,w", COHORTS, ids=COHORT_IDS)
def test_identity_with_accepted_drafts(echo_model, n, slots, w, sampled):
    ref, solo_eng = solo_reference(echo_model, sampled)
    solo_c = commits(solo_eng)
    assert sum(c["accepted"] for c in solo_c) > 0
    for k, mode in enumerate(("batch", "batch_mtp")):
        graphs = GRAPHS[(COHORTS.index((n, slots, w)) + k + int(sampled)) % 3]
        outs, eng = run(echo_model, mode, pool_requests(n, sampled), graphs=graphs, slots=slots,
                        window_rows=w)
        assert_same(outs, ref, n)
        cs = commits(eng)
        if mode == "batch_mtp":
            accepted = sum(c["accepted"] for c in cs)
            drafted = sum(c["drafted"] for c in cs)
            assert accepted > 0, "no draft was accepted: the accept path is not exercised"
            if n >= 2:
                assert_grouped_mtp_ran(eng)
                # accepted 2-row groups of concurrent slots, not only lone solo windows
                steps_multi = {ev["step"] for ev in eng.trace.events
                               if ev["ev"] == "window" and len(set(ev["layout"])) > 1}
                assert any(c["accepted"] == 1 and c["step"] in steps_multi for c in cs)
            if n >= 3:
                assert accepted < drafted, "every draft accepted: the reject path is not exercised"
        for c in cs:
            assert 0 <= c["accepted"] <= c["drafted"]
            assert c["emitted"] <= c["accepted"] + 1


def force_drafts(eng, ref):
    """Make every MTP draft the token the target will produce at that position (read from the
    solo reference): the verifier then accepts (nearly) every draft, whatever the model."""
    orig = eng.verifier._draft

    def forced(logits, gs, before, *rest):  # a draft sits at position before + 1
        out = orig(logits, gs, before, *rest).clone()
        for i, (lane, p) in enumerate(zip(gs.tolist(), (before + 1).tolist())):
            slot = eng.scheduler.slots[lane] if lane < len(eng.scheduler.slots) else None
            if slot is None or slot.req is None:
                continue
            toks, _ = ref[slot.req.id]
            k = p - slot.req.prompt_len  # output index of the token at position p
            if 0 <= k < len(toks):
                out[i] = toks[k]
        return out

    eng.verifier._draft = forced


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["solo", "batch", "batch_mtp"])
def test_identity_with_forced_drafts(random_model, mode, sampled):
    """Drafts forced equal to the targets on a context-sensitive model: every commit but a
    request's last accepts all its drafts (solo: spec-1 per window), and the output is the
    unforced solo output."""
    ref, _ = solo_reference(random_model, sampled)
    graphs = ("off", "shape", "layout")[(["solo", "batch", "batch_mtp"].index(mode) + sampled) % 3]
    # serial: under engine.overlap a lone request's rows assume the window in flight commits
    # all it may, so its last windows draft less (tests/test_overlap.py has its identity)
    eng = engine_for(random_model, mode, graphs=graphs, slots=4, window_rows=8, overlap=False)
    force_drafts(eng, ref)
    reqs = pool_requests(len(POOL), sampled)
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        eng.step()
    for r in reqs:
        rs = eng.requests[r.id]
        assert (rs.emitted, rs.reason) == ref[r.id], r.id
    cs = commits(eng)
    assert sum(c["accepted"] for c in cs) > 0
    last = {c["req"]: i for i, c in enumerate(cs)}
    for i, c in enumerate(cs):
        if i != last[c["req"]]:
            assert c["accepted"] == c["drafted"], c
        assert c["emitted"] == c["accepted"] + 1 or i == last[c["req"]]
    if mode == "solo":
        assert any(c["accepted"] == 3 for c in cs)  # spec=4: three drafts accepted per window
