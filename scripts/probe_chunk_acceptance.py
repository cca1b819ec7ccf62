"""Does the way a prompt is chunked change MTP acceptance? Greedy, one slot, 10 random prompts per
length; per prompt, accepted / drafted with the default chunks (256, padded to a bucket), with
the whole prompt as one exact chunk (no padding), and with eager prompt chunks.

    python scripts/probe_chunk_acceptance.py [--dtype auto] [--lengths 100,128,384,480]

On the H200 in bf16 (2026-11-29): identical in all three ways at 100, 128 and 480 tokens; at 384 four of
ten prompts differ between 256+128 and one 384 chunk (bf16 sums in another order), none with
padding. CPU float32: identical everywhere (docs/CHANGELOG.md, 2026-11-29)."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from strata.config import EMBEDDED_MODEL_DIR, StrataConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.kernels import ops
from strata.model.loader import load_checkpoint
from strata.runner import run_requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", default="100,128,384,480")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = OmegaConf.structured(StrataConfig)
    print("backend", ops.set_backend("auto", dev.type), flush=True)
    loaded = load_checkpoint(EMBEDDED_MODEL_DIR, a.dtype, dev, log=lambda s: None,
                             moe_dense_experts=int(base.model.moe_dense_experts))
    print("dtype", loaded.dtype, flush=True)

    def run(prompts: list[list[int]], **knobs) -> tuple[float, list[float]]:
        e = OmegaConf.structured(StrataConfig).engine
        e.slots, e.mode, e.batch_mtp, e.max_context, e.compile = 1, "batch", True, 1024, "off"
        for k, v in knobs.items():
            setattr(e, k, v)
        eng = Engine(loaded, e, dev, log=lambda s: None)
        try:
            m = run_requests(eng, [Request(f"r{i}", p, SamplingParams(max_tokens=a.max_tokens,
                                                                     stop_at_eos=False))
                                   for i, p in enumerate(prompts)])
        finally:
            eng.close()
        acc = sum(q["accepted"] for q in m["requests"])
        dra = sum(q["drafted"] for q in m["requests"])
        return round(acc / dra, 3), [round(q["accepted"] / q["drafted"], 2) for q in m["requests"]]

    for n in (int(x) for x in a.lengths.split(",")):
        rng = np.random.default_rng(n)
        prompts = [rng.integers(1, loaded.args.vocab_size, n).tolist() for _ in range(a.prompts)]
        t0 = time.perf_counter()
        print(n, "default chunks", *run(prompts), flush=True)
        print(n, "one exact chunk", *run(prompts, prefill_chunk=n, prefill_buckets=[n]), flush=True)
        print(n, "eager chunks", *run(prompts, prefill_graphs=False),
              f"({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
