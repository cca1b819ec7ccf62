"""The samplers at a real vocabulary (151,936): the two-stage argmax equals torch's argmax
(ties to the lowest id), and the samplers compiled by inductor pick the tokens eager picks (and
the synthetic accept step, compiled beside them, decides as eager does)."""

from __future__ import annotations

import pytest
import torch

from strata.engine.sampling import chunked_argmax, sample_lanes, sample_plain_lanes, synthetic_window

VOCAB = 151_936


@pytest.mark.parametrize("n", [7, 4096, 4097, 10_007, VOCAB])
def test_chunked_argmax_equals_argmax_with_ties(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 5, (6, n), generator=g).float()  # many ties everywhere
    x[1] = 0.0                                               # a row of one value: index 0
    x[2, -1] = 9.0                                           # the maximum in the padded chunk
    x[3, :] = float("-inf")
    x[3, n // 2] = 1.0
    x[4, [n - 1, n // 3]] = 7.0                              # tie across chunks: the lower id
    assert torch.equal(chunked_argmax(x), x.argmax(-1))


def lanes_inputs(rows_per: int, lanes: int):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(lanes * rows_per, VOCAB, generator=g).to(torch.bfloat16)
    logits[0, [5, 150_000]] = 30.0  # an exact tie at the top: the lower id wins
    table = lanes + 1
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 0.5][:table])
    top_k = torch.tensor([0, 50, 0, 0, 20][:table])
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 0.8][:table])
    seed = torch.arange(table, dtype=torch.long) * 7919
    idx = torch.arange(lanes, dtype=torch.long)
    pos0 = torch.tensor([3, 17, 250, 9][:lanes])
    return logits, idx, pos0, temperature, top_k, top_p, seed


DEVICES = [pytest.param("cpu", marks=pytest.mark.slow),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_samplers_compile_at_real_vocabulary(device, monkeypatch):
    import torch._dynamo

    # An engine compiling in this process sets suppress_errors (fall back to eager): here a
    # compile error must fail the test.
    monkeypatch.setattr(torch._dynamo.config, "suppress_errors", False)
    torch._dynamo.reset()
    logits, idx, pos0, temperature, top_k, top_p, seed = (
        t.to(device) for t in lanes_inputs(rows_per=2, lanes=3))
    plain = torch.compile(sample_plain_lanes, fullgraph=True)
    filtered = torch.compile(sample_lanes, fullgraph=True)
    want = sample_plain_lanes(logits, idx, pos0, 2, 1, temperature, seed)
    assert want[0] == 5
    assert torch.equal(plain(logits, idx, pos0, 2, 1, temperature, seed), want)
    want_f = sample_lanes(logits, idx, pos0, 2, 1, temperature, top_k, top_p, seed)
    assert torch.equal(filtered(logits, idx, pos0, 2, 1, temperature, top_k, top_p, seed), want_f)

    tokens = torch.arange(12, device=device).view(3, 4) + 100
    targets = torch.arange(12, device=device).view(3, 4) + 200
    rows = torch.tensor([4, 2, 4], device=device)
    args = (tokens, targets, rows, idx, pos0, seed, 0.8)
    got = torch.compile(synthetic_window, fullgraph=True)(*args)
    want = synthetic_window(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("device", DEVICES)
def test_samplers_compile_over_a_draft_vocabulary(device, monkeypatch):
    """engine.draft_vocab's drafts: logits over 32,768 of the 151,936 tokens with their ids;
    compiled, the samplers return the ids eager returns."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "suppress_errors", False)
    torch._dynamo.reset()
    logits, idx, pos0, temperature, top_k, top_p, seed = (
        t.to(device) for t in lanes_inputs(rows_per=1, lanes=3))
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:32_768]
    ids = ids.sort().values.to(device)
    sub = logits[:, ids].contiguous()
    want = sample_plain_lanes(sub, idx, pos0, 1, 1, temperature, seed, ids)
    assert torch.isin(want, ids).all()
    plain = torch.compile(sample_plain_lanes, fullgraph=True)
    assert torch.equal(plain(sub, idx, pos0, 1, 1, temperature, seed, ids), want)
    want_f = sample_lanes(sub, idx, pos0, 1, 1, temperature, top_k, top_p, seed, ids)
    filtered = torch.compile(sample_lanes, fullgraph=True)
    assert torch.equal(filtered(sub, idx, pos0, 1, 1, temperature, top_k, top_p, seed, ids), want_f)
