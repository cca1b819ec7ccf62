"""Write a routing profile: per MoE layer, how often each routed expert is chosen on a workload.

The engine runs the workload with its expert cache holding every routed expert (so nothing is
slower and the tokens are the model's) and counts, on the device, each decode window's routed
(row, expert) selections per layer and its distinct experts. The JSON is the shared contract of
docs/EXPERT_CACHE.md: engine.expert_profile reads it for the cache's first fill, and the
simulator fits its routing model from it.

    python scripts/profile_routing.py --out profile.json                     # the tiny model
    python scripts/profile_routing.py --preset qwen3_next_80b_a3b_fp8 --load-format dummy \\
        --layers 12 --skew 1.0 --synthetic-acceptance 0.8 --out skew1.json   # on a GPU

The tiny model runs its 8-expert MoE dense by default; the script sets
model.moe_dense_experts=0 so that its routing goes through the cache's counters.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from bench_engine import add_model_args, code_prompts, model_config, token_prompts, window_grid  # noqa: E402
from strata.config import StrataConfig  # noqa: E402
from strata.engine.expert_cache import plan_expert_cache  # noqa: E402
from strata.engine.llm_engine import Engine  # noqa: E402
from strata.engine.request import Request, SamplingParams  # noqa: E402
from strata.kernels import ops  # noqa: E402
from strata.model.loader import load_model  # noqa: E402
from strata.runner import run_requests  # noqa: E402


def profile(loaded, device, prompts: list[list[int]], max_tokens: int, slots: int,
            mode: str, batch_mtp: bool, synthetic_acceptance, window_rows: int,
            spec: int) -> dict:
    """Run `prompts` on an engine whose cache holds every expert; returns the profile dict."""
    plan = plan_expert_cache(loaded.model, 1e12)  # slots = every expert
    ecfg = OmegaConf.structured(StrataConfig).engine
    ecfg.mode, ecfg.batch_mtp, ecfg.slots = mode, batch_mtp, slots
    ecfg.window_rows, ecfg.spec = window_rows, spec
    ecfg.max_context = max(len(p) for p in prompts) + max_tokens + window_rows + 2
    ecfg.synthetic_acceptance = synthetic_acceptance
    ecfg.expert_cache_mib = int(math.ceil(plan.routed_mib())) + 1
    ecfg.expert_adapt_every = 0  # `routed` then accumulates every window
    ecfg.vram_every = 0
    eng = Engine(loaded, ecfg, device, log=lambda s: s.startswith("WARNING") and print(s, file=sys.stderr))
    windows: list[tuple[int, int]] = []  # (rows routed, distinct (layer, expert) pairs)

    def listen(ev: str, fields: dict) -> None:
        if ev == "window":
            groups, rows = window_grid(fields)
            windows.append((groups * rows, fields["hits"] + fields["misses"]))

    eng.trace.keep = False
    eng.trace.listener = listen
    run_requests(eng, [Request(f"p{i}", list(p), SamplingParams(max_tokens=max_tokens,
                                                                 stop_at_eos=False))
                       for i, p in enumerate(prompts)])
    cache = eng.expert_cache
    counts = cache.routed.cpu().numpy().round().astype(np.int64)
    top_k = loaded.args.num_experts_per_tok
    by_rows: dict[int, list[float]] = {}
    for rows, distinct in windows:
        by_rows.setdefault(rows, []).append(distinct / plan.moe_layers)
    return {"model": loaded.path.name, "layers": plan.layers, "experts": plan.experts,
            "top_k": top_k, "tokens": int(counts[0].sum() // top_k), "counts": counts.tolist(),
            "windows": len(windows),
            "distinct_per_window": {str(r): round(float(np.mean(v)), 4)
                                    for r, v in sorted(by_rows.items())}}


def summary(prof: dict) -> str:
    """Popularity in a few numbers: the share of selections the top 10/25/50% of each layer's
    experts take (mean over layers), and the distinct experts per layer by window rows."""
    counts = np.array(prof["counts"], dtype=np.float64)
    srt = -np.sort(-counts, axis=1)
    tot = srt.sum(1, keepdims=True).clip(min=1)
    cum = (srt / tot).cumsum(1)
    e = counts.shape[1]
    share = {f"top {p}%": float(cum[:, max(1, round(e * p / 100)) - 1].mean()) for p in (10, 25, 50)}
    return (f"{prof['model']}: {prof['tokens']} tokens, {prof['windows']} windows, "
            f"{len(prof['layers'])} MoE layers x {e} experts (top-{prof['top_k']}); "
            + ", ".join(f"{k} of experts take {v:.1%}" for k, v in share.items())
            + "; distinct experts per layer by window rows: "
            + ", ".join(f"{r}: {d}" for r, d in prof["distinct_per_window"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="model.dummy_routing_skew (dummy weights only; SYNTHETIC popularity)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--mode", default="batch", choices=("solo", "batch"))
    ap.add_argument("--batch-mtp", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--window-rows", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--token-prompts", action="store_true",
                    help="random token-id prompts (automatic when the model has no tokenizer)")
    ap.add_argument("--synthetic-acceptance", type=float, default=None)
    ap.add_argument("--out", required=True, help="the profile JSON to write")
    a = ap.parse_args()
    device = torch.device(a.device)
    mcfg = model_config(a)
    mcfg.moe_dense_experts = 0
    mcfg.dummy_routing_skew = a.skew
    backend = ops.set_backend(a.backend, device.type)
    loaded = load_model(mcfg, device, log=lambda s: print(s, file=sys.stderr))
    if a.token_prompts or loaded.tokenizer is None:
        prompts = token_prompts(loaded.args.vocab_size, a.requests, a.prompt_tokens)
    else:
        prompts = code_prompts(loaded.tokenizer, a.requests, a.prompt_tokens)
    prof = profile(loaded, device, prompts, a.max_tokens, a.slots, a.mode, a.batch_mtp,
                   a.synthetic_acceptance, a.window_rows, a.spec)
    prof["skew"] = a.skew
    prof["backend"] = backend
    Path(a.out).write_text(json.dumps(prof) + "\n")
    print(summary(prof))


if __name__ == "__main__":
    main()
