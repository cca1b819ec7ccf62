"""The plain sampler (sampling.sample_plain_lanes, compiled as the engine compiles it) with the
noise hash in int32 arithmetic (the tree's) against the earlier int64 form (16-bit product
halves), the same tokens both ways: us per call, CUDA-graph replay, at the embedded model's
vocabulary (4,096: 1 and 16 rows) and the 80B's (151,936: 4 rows)."""
import sys

import torch

sys.path.insert(0, "scripts")
from bench_kernels import time_calls  # noqa: E402
from strata.engine import sampling as S  # noqa: E402

M = 0xFFFFFFFF


def _mul32(x, c):
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & M


def _mix32(x):
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def hash_int64(seed, pos, token):
    h = _mix32((token & M) ^ 0x9E3779B9)
    h = _mix32(h ^ (pos & M))
    h = _mix32(h ^ ((seed >> 32) & M))
    h = _mix32(h ^ (seed & M))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


new_hash = S.uniform_hash
dev = torch.device("cuda")
for vocab, rows_list in ((4096, (1, 16)), (151936, (4,))):
    for rows in rows_list:
        logits = torch.randn(rows, vocab, device=dev).to(torch.bfloat16)
        lanes = torch.arange(rows, device=dev)
        pos0 = torch.full((rows,), 100, device=dev)
        temp = torch.zeros(rows, device=dev)
        temp[::2] = 0.7  # half the rows sample, half are greedy
        seed = torch.arange(rows, device=dev) * 7919
        res = {}
        for name, h in (("int64", hash_int64), ("int32", new_hash)):
            S.uniform_hash = h
            torch._dynamo.reset()
            f = torch.compile(S.sample_plain_lanes, dynamic=False)
            run = lambda: f(logits, lanes, pos0, 1, 1, temp, seed)  # noqa: E731
            out = run().clone()
            t, _ = time_calls([run], min_calls=20)
            res[name] = (t * 1e6, out)
        S.uniform_hash = new_hash
        same = torch.equal(res["int64"][1], res["int32"][1])
        print(f"vocab {vocab} rows {rows}: int64 {res['int64'][0]:.2f} us, int32 "
              f"{res['int32'][0]:.2f} us, the same tokens: {same}", flush=True)
