"""Position-keyed sampling: the token at position i is argmax(filtered_logits / T + g(seed, i)).

The Gumbel noise g is a pure function of (seed, position, token id): a counter-based integer hash
computed with tensor ops on the device, so it needs no host generator, lives inside CUDA graphs,
and makes sampled output depend only on prompt, seed and parameters, never on batching or
timing. Drafts use the same noise, so verification is exact: a draft is accepted only when it
equals the token the target would have sampled.

`sample` filters (top-k, top-p) on the sorted vocabulary; `sample_plain` skips the sort for
windows in which no request filters (greedy or plain temperature), and picks the same tokens.
Both take an optional `token` (V',) of ascending ids when the logits cover only those tokens
(engine.draft_vocab's drafts): each column's noise is its token's, and the chosen column is
returned as its token id, so an unfiltered draft (greedy or plain temperature) is the token the
full vocabulary would have sampled whenever that token is among them (top-k / top-p then filter
the given tokens only).
Every argmax over the vocabulary is `chunked_argmax`: two small reductions instead of one over
151,936 entries, which inductor failed to generate code for on the GPU.

`synthetic_prefix` is engine.synthetic_acceptance: accept decisions drawn from the same hash,
keyed by (seed, position) only, for benchmarks on weights whose drafts would never match.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _i32(x: int) -> int:
    """The int32 whose bits are the uint32 x (a constant for int32 tensor arithmetic)."""
    return x - (1 << 32) if x >= 1 << 31 else x


def _low32(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 x as int32 (two's complement, exact)."""
    return (((x & _MASK32) ^ 0x80000000) - 0x80000000).to(torch.int32)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int32 x read as uint32."""
    return (x >> n) & ((1 << (32 - n)) - 1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int32 tensors read as uint32: the
    products wrap mod 2**32, the right shifts are logical. In int32 rather than in int64
    (uint32 values, products split into 16-bit halves so as not to overflow) because the
    hash runs once per vocabulary entry and row in every sampler: int64 arithmetic costs the
    GPU two to four instructions an operation, and a sampler over one row runs in one CTA."""
    x = (x ^ _shr(x, 16)) * _i32(0x7FEB352D)
    x = (x ^ _shr(x, 15)) * _i32(0x846CA68B)
    return x ^ _shr(x, 16)


def uniform_hash(seed: torch.Tensor, pos: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Uniform(0, 1) float32 (never 0 or 1), a pure function of broadcastable int64 tensors seed,
    pos and token ids (their low 32 bits; the seed's high 32 bits too)."""
    h = _mix32(_low32(token) ^ _i32(0x9E3779B9))
    h = _mix32(h ^ _low32(pos))
    h = _mix32(h ^ _low32(seed >> 32))
    h = _mix32(h ^ _low32(seed))
    return (_shr(h, 8).float() + 0.5) * (1.0 / (1 << 24))


def gumbel_noise(seed: torch.Tensor, pos: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, float32, for broadcastable int64 tensors seed, pos and token ids."""
    return -torch.log(-torch.log(uniform_hash(seed, pos, token)))


#: Largest chunk of the first argmax stage; a vocabulary is split into equal chunks of at most
#: this many entries when it has such a divisor, else padded up to a multiple of it.
ARGMAX_CHUNK = 4096


def _argmax_chunk(n: int) -> int:
    """The chunk length of a two-stage argmax over n entries: the largest divisor of n in
    [ARGMAX_CHUNK / 4, ARGMAX_CHUNK] (151,936 = 64 x 2,374), else ARGMAX_CHUNK (padding)."""
    for c in range(min(n, ARGMAX_CHUNK), ARGMAX_CHUNK // 4 - 1, -1):
        if n % c == 0:
            return c
    return ARGMAX_CHUNK


def chunked_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of a 2-D float tensor, ties to the lowest index, as two
    reductions: within chunks, then over the chunk maxima (the first chunk holding the maximum
    holds its lowest index). Identical to x.argmax(-1) for inputs without NaN."""
    rows, n = x.shape
    if n <= ARGMAX_CHUNK:
        return x.argmax(-1)
    c = _argmax_chunk(n)
    pad = -n % c
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    parts = x.reshape(rows, -1, c)
    best, where = parts.max(-1)  # max(-1) returns the first maximal index of each chunk
    chunk = best.argmax(-1, keepdim=True)
    return chunk[:, 0] * c + where.gather(1, chunk)[:, 0]


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, pos: torch.Tensor, token: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one token per row, keyed by the position the token will occupy.

    logits (R, V); temperature, top_p float (R,); top_k, seed, pos int64 (R,). temperature 0 is
    greedy. `token`: the ids of the logits' columns (module docstring), None: 0 .. V-1. Static
    shapes, no host synchronisation.
    """
    logits = logits.float()
    greedy = chunked_argmax(logits)
    sampled = filtered_sample(logits, temperature, top_k, top_p, seed, pos, token)
    choice = torch.where(temperature > 0, sampled, greedy)
    return choice if token is None else token[choice]


@torch.library.custom_op("strata::filtered_sample", mutates_args=())
def filtered_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor,
                    token: torch.Tensor | None = None) -> torch.Tensor:
    """The sampled column of every row after top-k / top-p filtering of the sorted vocabulary
    (float32 logits (R, V)); `sample` picks it for rows with temperature > 0. `token`: the
    columns' token ids, which key the noise (None: the column is the token id).

    An opaque operator for torch.compile: the sort, the scan over the vocabulary and their
    masks run as the library's kernels. Inductor's own code for them at a vocabulary of 151,936
    failed to build on CUDA ("Ambiguous type"), and a compiled sampler has to work at every
    vocabulary. Still graph-capturable: no host synchronisation."""
    vocab = logits.shape[-1]
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k_eff = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = rank[None, :] >= k_eff[:, None]
    scaled = sorted_logits / temp[:, None]
    probs = torch.softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly before each rank; rank 0 is always kept
    # top_p = 1 keeps everything: float error can push `before` past 1.0 in the far tail.
    drop = drop | ((before > top_p[:, None]) & (top_p[:, None] < 1.0))
    noise = gumbel_noise(seed[:, None], pos[:, None], order if token is None else token[order])
    choice = chunked_argmax(scaled.masked_fill(drop, float("-inf")) + noise)
    return order.gather(1, choice[:, None])[:, 0]


@filtered_sample.register_fake
def _filtered_sample_shape(logits, temperature, top_k, top_p, seed, pos, token=None):
    return logits.new_empty(logits.shape[:1], dtype=torch.long)


def sample_plain(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                 pos: torch.Tensor, token: torch.Tensor | None = None) -> torch.Tensor:
    """`sample` for rows without top-k / top-p: no sort, only elementwise ops and argmax.

    Each token's score is the same float arithmetic as in `sample` (logits.float() / T, plus the
    same noise), so the chosen token is the same. The one difference: an exact float tie between
    two tokens' scores goes to the lower token id here, to the earlier one in sort order there.
    `token`: the columns' ascending token ids, as in `sample`.
    """
    logits = logits.float()
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    ids = torch.arange(logits.shape[-1], device=logits.device) if token is None else token
    noise = gumbel_noise(seed[:, None], pos[:, None], ids[None, :])
    # One (rows, V) score and one argmax for greedy and sampled rows alike: greedy rows score
    # the plain logits.
    hot = (temperature > 0)[:, None]
    choice = chunked_argmax(torch.where(hot, logits / temp[:, None] + noise, logits))
    return choice if token is None else token[choice]


def _rows(lanes: torch.Tensor, pos0: torch.Tensor, rows_per: int, offset: int):
    """Lane and position of each row when lane i owns rows_per consecutive rows at positions
    pos0[i] + offset + j."""
    j = torch.arange(rows_per, device=lanes.device)
    return lanes.repeat_interleave(rows_per), (pos0[:, None] + j + offset).reshape(-1)


def sample_lanes(logits: torch.Tensor, lanes: torch.Tensor, pos0: torch.Tensor, rows_per: int,
                 offset: int, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seed: torch.Tensor, token: torch.Tensor | None = None) -> torch.Tensor:
    """`sample` with each row's parameters read from per-lane tables inside the sampler (so a
    compiled sampler fuses the gathers instead of launching one per table)."""
    lane, pos = _rows(lanes, pos0, rows_per, offset)
    return sample(logits, temperature[lane], top_k[lane], top_p[lane], seed[lane], pos, token)


def sample_plain_lanes(logits: torch.Tensor, lanes: torch.Tensor, pos0: torch.Tensor, rows_per: int,
                       offset: int, temperature: torch.Tensor, seed: torch.Tensor,
                       token: torch.Tensor | None = None) -> torch.Tensor:
    """`sample_plain` with per-lane parameter tables, as `sample_lanes`."""
    lane, pos = _rows(lanes, pos0, rows_per, offset)
    return sample_plain(logits, temperature[lane], seed[lane], pos, token)


def accepted_prefix(tokens: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per group: how many drafts are accepted, the longest prefix with d_(j+1) == y_j among
    the group's valid rows. tokens, targets (NG, G); rows (NG,)."""
    j = torch.arange(1, tokens.shape[1], device=tokens.device)
    match = (tokens[:, 1:] == targets[:, :-1]) & (j[None, :] < rows[:, None])
    return match.long().cumprod(1).sum(1)


#: The hash stream's token id of the synthetic accept decisions: no vocabulary reaches it, so
#: they never reuse a token's noise.
SYNTHETIC_STREAM = 0xFFFFFFFF


def synthetic_prefix(rows: torch.Tensor, seed: torch.Tensor, pos0: torch.Tensor, g: int,
                     p: float) -> torch.Tensor:
    """engine.synthetic_acceptance: per group, how many drafts are accepted when the draft at
    position pos0 + j (j = 1 .. g-1, among the group's `rows` valid rows) is accepted with
    probability p, given that the drafts before it were. The decision at a position is a pure
    function of (seed, position): every mode and window shape takes the same one.
    rows, seed, pos0 (NG,) int64 -> (NG,) int64."""
    j = torch.arange(1, g, device=rows.device)
    u = uniform_hash(seed[:, None], pos0[:, None] + j, torch.full_like(j, SYNTHETIC_STREAM))
    take = (u < p) & (j[None, :] < rows[:, None])
    return take.long().cumprod(1).sum(1)


def synthetic_commit(tokens: torch.Tensor, targets: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
    """The committed rows of a synthetically accepted window: y_j = d_(j+1) for j < a (the
    drafts, as if verified), the target at j = a, targets after it. tokens, targets (NG, G)."""
    j = torch.arange(tokens.shape[1], device=tokens.device)
    drafts = torch.cat([tokens[:, 1:], targets[:, -1:]], 1)
    return torch.where(j[None, :] < accept[:, None], drafts, targets)


def synthetic_window(tokens: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor, lanes: torch.Tensor,
                     pos0: torch.Tensor, seed: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A window's synthetic accept counts and committed rows in one pure function (compiled
    with the samplers): seeds read from the per-lane table `seed` at `lanes`; tokens, targets
    (NG, G). Returns (accept (NG,), committed (NG, G))."""
    accept = synthetic_prefix(rows, seed[lanes], pos0, tokens.shape[1], p)
    return accept, synthetic_commit(tokens, targets, accept)
