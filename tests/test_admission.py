"""Binding admitted requests to slots: a burst is bound at once, exactly as one at a time."""

from __future__ import annotations

import pytest

from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.model.tiny import make_tiny_random
from conftest import cpu_engine_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_random(tmp_path_factory.mktemp("admit"), seed=0, tokenizer=False)


def request(i, arrival_step=0):
    return Request(f"a{i}", [5 + i] * (3 + i),
                   SamplingParams(max_tokens=4, temperature=0.5 + i / 10, top_p=1.0 - i / 20,
                                  top_k=i, seed=100 + i, stop_at_eos=False),
                   arrival_step=arrival_step)


def test_a_burst_binds_every_lane_and_leaves_the_others(model_dir):
    # one slot a chunk, so that the first step's chunk leaves the other lanes as bound
    eng = Engine.from_config(cpu_engine_config(model_dir, slots=4, prefill_slots=1),
                             log=lambda s: None)
    st, bufs = eng.state, eng.bufs
    st.conv.fill_(1.0)
    st.rec.fill_(1.0)
    bufs.temperature.fill_(9.0)
    for i in range(3):
        eng.add_request(request(i))
    eng.step()  # admits all three, then runs one prompt chunk
    for lane in range(3):
        rs = eng.scheduler.slots[lane].req
        p = rs.req.params
        assert rs.prompt_tensor.tolist() == rs.req.prompt_ids
        assert bufs.temperature[lane].item() == pytest.approx(p.temperature)
        assert bufs.top_p[lane].item() == pytest.approx(p.top_p)
        assert (bufs.top_k[lane].item(), bufs.seed[lane].item()) == (p.top_k, p.seed)
        if lane > 0:  # lane 0 ran its prompt chunk: its state moved on from zero
            assert not st.conv[:, lane].any() and not st.rec[:, lane].any()
    assert st.conv[:, 3].eq(1.0).all() and st.rec[:, 3].eq(1.0).all()  # not admitted
    assert bufs.temperature[3].item() == 9.0


def test_burst_and_one_at_a_time_give_the_same_tokens(model_dir):
    # Sampled with per-request seeds: a parameter bound to the wrong lane changes the tokens.
    def run(stagger):
        eng = Engine.from_config(cpu_engine_config(model_dir, slots=4), log=lambda s: None)
        outs = {}
        for i in range(4):
            eng.add_request(request(i, arrival_step=i * stagger * 6))
        while eng.has_work():
            for o in eng.step():
                outs.setdefault(o.id, []).extend(o.new_token_ids)
        return outs
    assert run(0) == run(1)

