"""Randomised scenarios: every request finishes, nothing raises, and greedy/sampled text is the same
in one-at-a-time solo, plain batch and batch_mtp, with prompts at chunk and context limits,
stop strings, staggered arrivals, random graph keys and limits, and cancels mid-flight."""

import random

import pytest
import torch
from omegaconf import OmegaConf

from strata.config import EMBEDDED_MODEL_DIR, StrataConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams

torch.set_num_threads(1)
MAX_CONTEXT = 96


def run(scn: dict, mode: str, batch_mtp: bool, slots: int, cancels: int = 0, graphs: bool = True):
    cfg = OmegaConf.structured(StrataConfig)
    cfg.device, cfg.model.path, cfg.model.dtype = "cpu", EMBEDDED_MODEL_DIR, "float32"
    e = cfg.engine
    e.mode, e.batch_mtp, e.slots, e.graphs = mode, batch_mtp, slots, graphs
    e.graph_key, e.graph_limit, e.prefill_chunk = scn["key"], scn["limit"], scn["chunk"]
    e.window_rows, e.spec, e.max_context, e.context_tier_min = scn["W"], scn["spec"], MAX_CONTEXT, 16
    eng = Engine.from_config(cfg, log=lambda s: None)
    for r in scn["requests"]():
        eng.add_request(r)
    rng = random.Random(scn["seed"])
    cancel_at = {rng.randint(0, 30): f"r{rng.randrange(scn['n'])}" for _ in range(cancels)}
    steps = 0
    while eng.has_work():
        if steps in cancel_at:
            eng.cancel(cancel_at[steps])
        eng.step()
        steps += 1
        assert steps < 3000, "the engine did not finish"
    out = {}
    for k, rs in eng.requests.items():
        assert rs.finished and rs.reason in ("stop", "length", "cancel"), (k, rs.reason, rs.error)
        out[k] = (rs.emitted, rs.reason)
    eng.close()
    return out


def scenario(seed: int) -> dict:
    rng = random.Random(1000 + seed)
    chunk = rng.choice([4, 8, 16, 64])
    w = rng.choice([4, 8, 16])
    n = rng.randint(2, 6)

    def requests():
        r = random.Random(seed)
        out = []
        for i in range(n):
            plen = max(1, min(MAX_CONTEXT - 1, r.choice([1, 2, chunk - 1, chunk, chunk + 1, 30, MAX_CONTEXT - 2, MAX_CONTEXT - 1])))
            stop = [r.choice(["e", "(", "\n"])] if r.random() < 0.3 else []
            out.append(Request(f"r{i}", [r.randrange(1, 4000) for _ in range(plen)],
                               SamplingParams(max_tokens=r.randint(1, 30), temperature=r.choice([0.0, 0.0, 0.7]),
                                              seed=i, stop=stop, stop_at_eos=r.random() < 0.5),
                               arrival_step=r.randint(0, 10), stream_text=r.random() < 0.5))
        return out

    return {"seed": seed, "chunk": chunk, "W": w, "spec": rng.randint(1, min(4, w)), "n": n,
            "key": rng.choice(["shape", "layout"]), "limit": rng.randint(0, 5),
            "slots": rng.randint(1, 6), "requests": requests}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_scenarios_agree_across_modes(seed):
    scn = scenario(seed)
    base = run(scn, "solo", False, 1)
    for mode, bm, graphs in (("batch", False, seed % 2 == 0), ("batch", True, True), ("batch", True, False)):
        assert run(scn, mode, bm, scn["slots"], graphs=graphs) == base, (mode, bm, graphs)
    run(scn, "batch", True, scn["slots"], cancels=3)  # cancels: everything still finishes
