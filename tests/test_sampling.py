"""The two samplers: `sample_plain` (no sort) picks the token `sample` picks for rows without
top-k / top-p, and top_p = 1 never drops a token in `sample`."""

from __future__ import annotations

import pytest
import torch

from strata.engine import sampling
from strata.engine.request import SamplingParams
from strata.engine.sampling import sample, sample_plain

TEMPERATURES = [0.0, 0.05, 0.3, 0.7, 1.0, 1.5, 4.0]


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [7, 512, 4099])
def test_sample_plain_equals_sample_on_unfiltered_rows(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows_per_t = 256
    n = rows_per_t * len(TEMPERATURES)
    # Logits at several scales: flat rows make the noise decide, peaky rows the logits.
    scale = torch.tensor([0.1, 1.0, 5.0, 20.0]).repeat(n // 4 + 1)[:n, None]
    logits = torch.randn(n, vocab, generator=g) * scale
    temperature = torch.tensor(TEMPERATURES).repeat_interleave(rows_per_t)
    seed = torch.randint(0, 2**63 - 1, (n,), generator=g)
    pos = torch.randint(0, 1 << 20, (n,), generator=g)
    # Every third row filters: `sample` handles mixed rows, and only the others must agree.
    filt = torch.arange(n) % 3 == 0
    top_k = torch.where(filt, torch.full((n,), 5), torch.zeros(n, dtype=torch.long))
    top_p = torch.where(filt, torch.full((n,), 0.8), torch.ones(n))
    a = sample(logits, temperature, top_k, top_p, seed, pos)
    b = sample_plain(logits, temperature, seed, pos)
    plain = ~filt
    assert torch.equal(a[plain], b[plain])
    # the comparison is not vacuous: sampling moves tokens off the argmax at T > 0, and
    # filtering changes some of the filtered rows
    sampled = plain & (temperature > 0)
    assert (b[sampled] != logits[sampled].argmax(-1)).float().mean() > 0.2
    assert torch.equal(b[temperature == 0], logits[temperature == 0].argmax(-1))
    assert (a[filt] != b[filt]).any()


def test_sample_plain_bf16_logits_match_sample():
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(300, 333, generator=g) * 3).to(torch.bfloat16)
    t = torch.full((300,), 0.9)
    seed, pos = torch.arange(300) * 977, torch.arange(300) + 11
    zero, one = torch.zeros(300, dtype=torch.long), torch.ones(300)
    assert torch.equal(sample(logits, t, zero, one, seed, pos), sample_plain(logits, t, seed, pos))


def _near_equal_row_past_one() -> torch.Tensor:
    """A row of 100 near-equal logits and 4 far-tail ones whose cumulative sorted softmax
    rounds past 1.0 before the tail: `before > 1` there, which used to drop the tail at
    top_p = 1. Searched, not hard-coded, since the rounding depends on the float kernels."""
    for s in range(500):
        g = torch.Generator().manual_seed(s)
        logits = torch.cat([torch.randn(100, generator=g) * 0.1, torch.full((4,), -40.0)])[None]
        scaled, _ = torch.sort(logits, dim=-1, descending=True)  # as sample does at T = 1
        probs = torch.softmax(scaled, dim=-1)
        if ((probs.cumsum(-1) - probs)[0, 100:] > 1.0).all():
            return logits
    pytest.fail("no row whose cumulative softmax rounds past 1.0 was found")


def test_top_p_one_never_drops_a_token(monkeypatch):
    logits = _near_equal_row_past_one()
    tail = 101  # one of the -40 tokens: reachable only if nothing drops it

    def noise_favouring_tail(seed, pos, token):
        return (token == tail).float() * 1e3

    monkeypatch.setattr(sampling, "gumbel_noise", noise_favouring_tail)
    one = torch.ones(1)
    args = (logits, one, torch.zeros(1, dtype=torch.long))
    seed, pos = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    assert sample(*args, torch.tensor([1.0]), seed, pos).item() == tail
    assert sample_plain(logits, one, seed, pos).item() == tail
    # top_p < 1 still filters: the tail carries far less than 1e-6 of the mass
    assert sample(*args, torch.tensor([0.999999]), seed, pos).item() != tail


@pytest.mark.parametrize("params,filtered", [
    (dict(), False),
    (dict(temperature=0.8), False),
    (dict(temperature=0.8, top_p=0.9), True),
    (dict(temperature=0.8, top_k=20), True),
    (dict(temperature=0.0, top_p=0.5, top_k=3), False),  # greedy never filters
])
def test_filtered_rule(params, filtered):
    assert SamplingParams(**params).filtered is filtered


def test_lane_table_samplers_equal_the_row_samplers():
    """sample_lanes / sample_plain_lanes gather each row's parameters from per-lane tables and
    place lane i's rows at pos0[i] + offset + j: the same tokens as the row samplers fed the
    gathered parameters and positions by hand."""
    from strata.engine.sampling import sample_lanes, sample_plain_lanes

    g = torch.Generator().manual_seed(7)
    lanes_n, rows_per, offset, vocab = 5, 3, 1, 97
    temperature = torch.tensor([0.0, 0.7, 1.3, 0.0, 2.0])
    top_k = torch.tensor([0, 5, 0, 3, 0])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0])
    seed = torch.tensor([11, 22, 33, 44, 2**40 + 5])
    lanes = torch.tensor([3, 1, 4])
    pos0 = torch.tensor([10, 200, 7])
    logits = torch.randn(len(lanes) * rows_per, vocab, generator=g)
    lane = lanes.repeat_interleave(rows_per)
    pos = torch.tensor([p + offset + j for p in pos0.tolist() for j in range(rows_per)])
    want = sample(logits, temperature[lane], top_k[lane], top_p[lane], seed[lane], pos)
    got = sample_lanes(logits, lanes, pos0, rows_per, offset, temperature, top_k, top_p, seed)
    assert torch.equal(got, want)
    want_plain = sample_plain(logits, temperature[lane], seed[lane], pos)
    got_plain = sample_plain_lanes(logits, lanes, pos0, rows_per, offset, temperature, seed)
    assert torch.equal(got_plain, want_plain)


def test_accepted_prefix_counts_the_matching_prefix_within_valid_rows():
    from strata.engine.sampling import accepted_prefix

    tokens = torch.tensor([[9, 1, 2, 3], [9, 1, 7, 3], [9, 1, 2, 3], [9, 5, 2, 3]])
    targets = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    rows = torch.tensor([4, 4, 2, 4])  # group 2 has only 2 valid rows: one draft at most
    assert accepted_prefix(tokens, targets, rows).tolist() == [3, 1, 1, 0]


def _hash_reference(seed: int, pos: int, token: int) -> float:
    """The noise stream's definition in Python integers (uint32 arithmetic): a seeded request's
    text depends on these numbers, so the tensor form must keep them whatever its dtype."""
    m = 0xFFFFFFFF

    def mix(x: int) -> int:
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & m
        x = ((x ^ (x >> 15)) * 0x846CA68B) & m
        return x ^ (x >> 16)

    h = mix((token & m) ^ 0x9E3779B9)
    h = mix(h ^ (pos & m))
    h = mix(h ^ ((seed >> 32) & m))
    h = mix(h ^ (seed & m))
    return ((h >> 8) + 0.5) / (1 << 24)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_uniform_hash_keeps_the_streams_numbers(device):
    """uniform_hash (int32 tensor arithmetic) gives the uint32 definition's numbers, eagerly
    and compiled (inductor's C++ on the CPU, Triton on the GPU), at the edges of every input's
    range (negative and 64-bit seeds, positions and ids past 2**31, the synthetic stream's id)
    and broadcast as the samplers call it."""
    edges = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, -1, -(2**63), 2**63 - 1, 0x9E3779B9]
    seed, pos, tok = torch.meshgrid(*[torch.tensor(edges, device=device)] * 3, indexing="ij")
    triples = zip(seed.flatten().tolist(), pos.flatten().tolist(), tok.flatten().tolist())
    want = torch.tensor([_hash_reference(s, p, t) for s, p, t in triples],
                        dtype=torch.float32, device=device).view(seed.shape)
    assert torch.equal(sampling.uniform_hash(seed, pos, tok), want)
    seeds = torch.tensor([[7], [2**40 + 3]], device=device)
    poss = torch.tensor([[100], [2**33]], device=device)
    ids = torch.arange(0, 151936, 997, device=device)[None, :]
    want = torch.tensor([[_hash_reference(s, p, t) for t in ids[0].tolist()]
                         for s, p in zip(seeds[:, 0].tolist(), poss[:, 0].tolist())], device=device)
    assert torch.equal(sampling.uniform_hash(seeds, poss, ids), want)
    assert torch.equal(torch.compile(sampling.uniform_hash)(seeds, poss, ids), want)
