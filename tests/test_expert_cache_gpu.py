"""GPU: the expert cache's miss path (ops.moe_experts reading missing experts from pinned host
memory through its device address) inside a captured CUDA graph gives the same output as every
expert resident, whichever experts miss, including after the slot table changes between
replays; and an engine on the GPU emits the same tokens with a tiny cache as without one.

Skipped without a GPU or without the built extension (strata.kernels.strata_cuda).
"""

from __future__ import annotations

import pytest
import torch

from strata.kernels import cyext_ops as C

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP device"),
    pytest.mark.skipif(C.gpu_platform() is None, reason="strata_cuda extension not built"),
]

DEV = "cuda"


def _case(fp8: bool, E=64, H=256, I=128, N=8, k=4, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    wgu = torch.randn(E + 1, 2 * I, H, generator=g) * 0.05  # + a folded shared expert (id E)
    wd = torch.randn(E + 1, H, I, generator=g) * 0.05
    scales, block = (), None
    if not fp8:
        wgu, wd = wgu.to(torch.bfloat16), wd.to(torch.bfloat16)
    else:
        from strata.model.fp8 import FP8_DTYPE
        wgu, wd = ((t * 2000).clamp(-448, 448).to(FP8_DTYPE) for t in (wgu, wd))
        scales = (torch.rand(E + 1, 2 * I // 128, H // 128, generator=g) / 4000,
                  torch.rand(E + 1, H // 128, I // 128, generator=g) / 4000)
        block = (128, 128)
    x = torch.randn(N, H, generator=g).to(DEV, torch.bfloat16)
    ids = torch.cat([torch.randint(0, E, (N, k), generator=g), torch.full((N, 1), E)], 1).to(DEV)
    w = torch.rand(N, k + 1, generator=g).to(DEV)
    return [wgu, wd, *scales], block, x, ids, w


@pytest.mark.parametrize("fp8", [False, True])
def test_miss_path_in_a_graph_matches_all_resident(fp8):
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 experts need sm_89+")
    stacks, block, x, ids, w = _case(fp8)
    E = stacks[0].shape[0] - 1
    dev_full = [t.to(DEV) for t in stacks]
    full = C.gpu_moe_experts(x, dev_full[0], dev_full[1], w, ids, *(dev_full[2:] or [None, None]),
                             block)
    S = 8
    host = [t[:E].contiguous().pin_memory() for t in stacks]
    slots = [torch.empty((S + 1, *t.shape[1:]), dtype=t.dtype, device=DEV) for t in stacks]
    slot_of = torch.full((E + 1,), -1, dtype=torch.int32, device=DEV)
    out = torch.empty_like(x)
    ws = torch.empty(C.moe_workspace_numel(x.shape[0], ids.shape[1], stacks[0].shape[1] // 2),
                     device=DEV)

    def fill(resident):
        table = torch.full((E + 1,), -1, dtype=torch.int32)
        for s, e in enumerate(resident):
            table[e] = s
            for d, h in zip(slots, host):
                d[s].copy_(h[e])
        table[E] = S
        for d, t in zip(slots, stacks):
            d[S].copy_(t[E])
        slot_of.copy_(table)

    def call():
        C.gpu_moe_experts(x, slots[0], slots[1], w, ids, *(slots[2:] or [None, None]), block,
                          slot_of, host[0], host[1], *(host[2:] or [None, None]), out=out,
                          workspace=ws)

    fill(list(range(S)))
    call()  # warm: lazy initialisation outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    routed = sorted(set(ids[:, :-1].flatten().tolist()))
    for resident in (list(range(S)), routed[:S], list(range(E - S, E)), routed[-S:]):
        fill(resident)  # the slot table changes between replays; the graph stays valid
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, full), resident


def test_engine_tokens_identical_with_a_tiny_cache(tmp_path):
    from omegaconf import OmegaConf

    from strata.config import StrataConfig
    from strata.engine.llm_engine import Engine
    from strata.engine.request import Request, SamplingParams
    from strata.model.tiny import make_tiny_random

    path = make_tiny_random(tmp_path / "m", seed=3, tokenizer=False, num_experts=64,
                            num_experts_per_tok=4, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64, hidden_size=128,
                            dtype=torch.bfloat16)

    def run(mib: int):
        cfg = OmegaConf.structured(StrataConfig)
        cfg.device = "cuda"
        cfg.model.path = str(path)
        cfg.model.moe_dense_experts = 0
        cfg.engine.max_context = 256
        cfg.engine.slots = 3
        cfg.engine.expert_cache_mib = mib
        cfg.engine.expert_adapt_every = 2
        eng = Engine.from_config(cfg, log=lambda s: None)
        for i in range(3):
            eng.add_request(Request(f"r{i}", [5 + i, 9, 11 + i, 3], SamplingParams(
                max_tokens=24, stop_at_eos=False), arrival_step=i))
        while eng.has_work():
            eng.step()
        return {r: list(s.emitted) for r, s in eng.requests.items()}, eng

    ref, _ = run(0)
    out, eng = run(1)
    assert eng.expert_cache.plan.slots < 64 and eng.expert_cache.misses > 0
    assert out == ref
