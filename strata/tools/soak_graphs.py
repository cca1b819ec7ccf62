"""Graph-cache soak: many distinct window layouts under a bounded cache and a VRAM reserve.

Keeps up to 12 slots busy with staggered requests of random prompt and output lengths until the
engine has run --windows windows and seen --min-layouts distinct graph keys, once per reserve.
Until --min-layouts keys are seen, the number of requests in flight changes every
--churn-windows windows (1 to slots + 2), and some requests filter (top-k: the sorting sampler,
another graph), so that windows keep taking new memberships and samplers (at a steady full
load the rotation repeats a few dozen layouts, and the soak is about many); the rest of the
windows run at full load.
Reports crashes, failed requests, captures, evictions, MiB per graph and the device-memory curve
(used MiB sampled every --sample windows; "flat" = its spread after the first eviction).

    python scripts/soak_graphs.py --device cuda --reserves 700,2048,4096 --graph-key layout

The engine runs as it does in production (the built kernels, compiled regions); a warm-up soak
first compiles the window shapes (--warm-windows, not reported), so the timed soaks measure
the cache and not the compiler.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from strata.config import EMBEDDED_MODEL_DIR, StrataConfig
from strata.engine.llm_engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.kernels import ops
from strata.model.loader import load_checkpoint


def soak(loaded, device, a, reserve: int, graph_key: str) -> dict:
    ecfg = OmegaConf.structured(StrataConfig).engine
    ecfg.slots, ecfg.batch_mtp, ecfg.window_rows = a.slots, True, a.window_rows
    ecfg.graph_key, ecfg.graph_limit, ecfg.vram_reserve_mib = graph_key, a.limit, reserve
    ecfg.max_context, ecfg.compile, ecfg.vram_every = a.max_context, a.compile, 0
    ecfg.context_tier_min = a.tier_min
    log_lines: list[str] = []
    eng = Engine(loaded, ecfg, device, log=log_lines.append)
    eng.trace.keep = False  # the soak keeps its own counters, not every event
    rng = np.random.default_rng(a.seed)
    vocab = loaded.args.vocab_size
    keys: set[str] = set()
    curve: list[tuple[int, float]] = []
    n_req = failed = crashes = 0
    first_evict_at = None
    target, next_churn = a.slots + 2, a.churn_windows
    t0 = time.perf_counter()

    def listen(ev, f):
        nonlocal first_evict_at
        if ev == "window":
            keys.add(f["key"])
        elif ev == "evict" and first_evict_at is None:
            first_evict_at = eng.windows

    eng.trace.listener = listen
    while eng.windows < a.windows or (len(keys) < a.min_layouts and time.perf_counter() - t0 < a.max_seconds):
        if time.perf_counter() - t0 > a.max_seconds:
            break
        if len(keys) >= a.min_layouts:
            target = a.slots + 2  # enough layouts seen: the rest of the windows at full load
        elif eng.windows >= next_churn:
            target, next_churn = int(rng.integers(1, a.slots + 3)), eng.windows + a.churn_windows
        in_flight = sum(1 for rs in eng.requests.values() if not rs.finished)
        while in_flight < target:
            plen = int(rng.integers(4, a.max_prompt))
            temperature = float(rng.choice([0.0, 0.8]))
            top_k = int(rng.choice([0, 20])) if temperature > 0 else 0
            eng.add_request(Request(f"s{n_req}", rng.integers(1, vocab, plen).tolist(),
                                    SamplingParams(max_tokens=int(rng.integers(2, a.max_tokens)),
                                                   temperature=temperature, top_k=top_k,
                                                   seed=n_req, stop_at_eos=False),
                                    arrival_step=eng.steps + int(rng.integers(0, 3)), stream_text=False))
            n_req += 1
            in_flight += 1
        try:
            for o in eng.step():
                if o.finished:
                    failed += o.finish_reason == "error"
                    eng.release(o.id)
        except Exception as e:  # the engine must never raise out of step(); count it
            crashes += 1
            print(f"CRASH: {type(e).__name__}: {e}", flush=True)
            break
        if eng.windows % a.sample == 0 and (not curve or curve[-1][0] != eng.windows):
            used = (torch.cuda.mem_get_info(device)[1] - torch.cuda.mem_get_info(device)[0]) / 2**20 \
                if device.type == "cuda" else eng.cache.graphs_mib
            # With the graphs held: captures differ in size (2-36 MiB by window shape), so the
            # used memory moves with the mix the LRU holds; what is not graphs must stay put.
            curve.append((eng.windows, round(used, 1), round(eng.cache.graphs_mib, 1)))
    c = eng.cache
    sizes = [e.mib for e in c.entries.values()]
    after = [(u, g) for w, u, g in curve if first_evict_at is not None and w >= first_evict_at]
    res = {"reserve_mib": reserve, "graph_key": graph_key, "graph_limit": a.limit,
           "windows": eng.windows, "distinct_keys": len(keys), "requests": n_req,
           "failed_requests": failed, "crashes": crashes, "captures": c.captures,
           "evictions": c.evictions, "eager_windows": c.eager, "hits": c.hits,
           "mib_per_graph": round(float(np.median(sizes)), 2) if sizes else None,
           "graphs_mib_held": round(c.graphs_mib, 1), "first_evict_at_window": first_evict_at,
           "used_mib_spread_after_first_evict":
               round(max(u for u, _ in after) - min(u for u, _ in after), 1) if after else None,
           "used_mib_max_rise_after_first_evict":
               round(max(u for u, _ in after) - after[0][0], 1) if after else None,
           "non_graph_mib_spread_after_first_evict":
               round(max(u - g for u, g in after) - min(u - g for u, g in after), 1) if after else None,
           "curve": curve, "seconds": round(time.perf_counter() - t0, 1),
           "warnings": [x for x in log_lines if x.startswith("WARNING")]}
    eng.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=EMBEDDED_MODEL_DIR)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reserves", default="700,2048,4096")
    ap.add_argument("--graph-keys", default="layout")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--slots", type=int, default=12)
    ap.add_argument("--window-rows", type=int, default=8)
    ap.add_argument("--windows", type=int, default=10000)
    ap.add_argument("--min-layouts", type=int, default=500)
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--tier-min", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=48)
    ap.add_argument("--churn-windows", type=int, default=40,
                    help="windows between changes of the number of requests in flight")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--compile", default="auto", help="engine.compile (auto: on for CUDA)")
    ap.add_argument("--backend", default="auto", help="kernel backend (auto: the built kernels)")
    ap.add_argument("--warm-windows", type=int, default=400,
                    help="windows of an unreported warm-up soak that compiles the shapes first")
    ap.add_argument("--warm-seconds", type=float, default=180.0)
    ap.add_argument("--sample", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    device = torch.device(a.device)
    print(f"kernels: backend={ops.set_backend(a.backend, device.type)}", flush=True)
    loaded = load_checkpoint(a.model, a.dtype, device, log=lambda s: None)
    results = []
    if a.warm_windows > 0:
        t0 = time.perf_counter()
        warm = argparse.Namespace(**{**vars(a), "windows": a.warm_windows, "min_layouts": 1,
                                     "max_seconds": a.warm_seconds})
        r = soak(loaded, device, warm, max(int(x) for x in a.reserves.split(",")),
                 a.graph_keys.split(",")[0])
        print(f"warm-up: {r['windows']} windows in {time.perf_counter() - t0:.1f} s (not reported)",
              flush=True)
    for key in a.graph_keys.split(","):
        for reserve in [int(x) for x in a.reserves.split(",")]:
            r = soak(loaded, device, a, reserve, key)
            results.append(r)
            print(f"key={key} reserve={reserve}: windows {r['windows']}, distinct keys {r['distinct_keys']}, "
                  f"requests {r['requests']}, failed {r['failed_requests']}, crashes {r['crashes']}, "
                  f"captures {r['captures']}, evictions {r['evictions']}, eager {r['eager_windows']}, "
                  f"MiB/graph {r['mib_per_graph']}, used MiB after 1st eviction: spread "
                  f"{r['used_mib_spread_after_first_evict']}, most rise "
                  f"{r['used_mib_max_rise_after_first_evict']}, spread less graphs held "
                  f"{r['non_graph_mib_spread_after_first_evict']}; {r['seconds']} s", flush=True)
            if a.json:  # after every soak: a run cut by a time limit keeps the finished ones
                Path(a.json).write_text(json.dumps(results, indent=1))

