"""In-process engine benchmark: solo one-at-a-time, plain batch and batch_mtp side by side.

For each N in --n, a cohort of N distinct code prompts arrives at once; every configuration runs
the same cohort, --repeats times (median reported), in forward order and then in reverse order
(controls). Optionally transformers' generate() on the same checkpoint and prompts, batched at N.

    python scripts/bench_engine.py --device cuda --n 1,2,4,8 --repeats 3 --json out.json --md out.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from strata.config import EMBEDDED_MODEL_DIR, StrataConfig  # noqa: E402
from strata.engine.llm_engine import Engine  # noqa: E402
from strata.engine.request import Request, SamplingParams  # noqa: E402
from strata.kernels import ops  # noqa: E402
from strata.model.loader import load_checkpoint  # noqa: E402
from strata.runner import run_requests  # noqa: E402
from provenance import commit_id  # noqa: E402


def code_prompts(tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """Distinct prompts cut from standard-library files (deterministic)."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py"))[5:]
    out = []
    for f in files:
        ids = tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= prompt_tokens + 10:
            out.append(ids[:prompt_tokens])
        if len(out) == n:
            return out
    raise SystemExit("not enough prompt material")


CONFIGS = {
    "solo": dict(mode="solo", batch_mtp=False),
    "solo_eager": dict(mode="solo", batch_mtp=False, graphs=False),
    "solo_nospec": dict(mode="solo", batch_mtp=False, spec=1),
    "solo_spec2": dict(mode="solo", batch_mtp=False, spec=2),
    "solo_spec3": dict(mode="solo", batch_mtp=False, spec=3),
    "batch": dict(mode="batch", batch_mtp=False),
    "batch_mtp": dict(mode="batch", batch_mtp=True),
    "batch_mtp_eager": dict(mode="batch", batch_mtp=True, graphs=False),
    "batch_mtp_w16": dict(mode="batch", batch_mtp=True, window_rows=16),
    # engine.batch_invariant: every window runs window_rows rows. Greedy text is compared with
    # the first configuration listed, so list solo_inv first to check the invariant ones.
    "solo_inv": dict(mode="solo", batch_mtp=False, batch_invariant=True),
    "batch_inv": dict(mode="batch", batch_mtp=False, batch_invariant=True),
    "batch_mtp_inv": dict(mode="batch", batch_mtp=True, batch_invariant=True),
    "batch_mtp_eager_inv": dict(mode="batch", batch_mtp=True, graphs=False, batch_invariant=True),
}


def engine_cfg(base: dict, name: str, n: int, args) -> object:
    """Command-line settings first, then the configuration's own (which win)."""
    cfg = OmegaConf.structured(StrataConfig).engine
    cfg.graphs = args.graphs
    cfg.max_context = args.max_context
    cfg.window_rows = args.window_rows
    cfg.spec = args.spec
    cfg.vram_every = 0
    for k, v in base.items():
        setattr(cfg, k, v)
    cfg.slots = max(1, n) if cfg.mode == "batch" else 1
    return cfg


def make_engine(loaded, device, ecfg, prompts, max_tokens) -> Engine:
    """An engine for one (configuration, N), warmed on one cohort: compiles and captures are
    not what the timed cohorts measure, and repeats reuse its graphs as a server would."""
    # Warm-up and warnings go to stderr: how long compiling takes is worth seeing.
    eng = Engine(loaded, ecfg, device,
                 log=lambda s: s.startswith(("INFO warm-up", "WARNING")) and print(s, file=sys.stderr))
    eng.trace.keep = False
    run_requests(eng, [Request(f"w{i}", list(p), SamplingParams(max_tokens=max_tokens, stop_at_eos=False))
                       for i, p in enumerate(prompts)])
    eng.requests.clear()
    return eng


def run_cohort(eng: Engine, device, prompts, max_tokens) -> dict:
    reqs = [Request(f"r{i}", list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                     stop_at_eos=False))
            for i, p in enumerate(prompts)]
    before = eng.stats()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_requests(eng, reqs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    after = eng.stats()
    d = {k: after[k] - before[k] for k in ("output_tokens", "drafted", "accepted", "windows",
                                            "graph_hits", "graph_captures", "graph_eager",
                                            "graph_evictions")}
    out = {"aggregate_tps": d["output_tokens"] / wall, "wall_s": wall,
           "acceptance": d["accepted"] / d["drafted"] if d["drafted"] else None,
           "windows": d["windows"],
           "graph": {"hit": d["graph_hits"], "capture": d["graph_captures"],
                     "eager": d["graph_eager"], "evict": d["graph_evictions"]},
           "tokens": [eng.requests[r.id].emitted for r in reqs]}
    eng.requests.clear()
    return out


def hf_generate(path, device, prompts, max_tokens, dtype) -> float:
    from transformers import Qwen3NextForCausalLM

    model = Qwen3NextForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    n = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return n * max_tokens / (time.perf_counter() - t0)


def write_results(a, ns, names, results, loaded, device, backend) -> None:
    """Write the JSON and the markdown table for the N done so far (a run cut short by a time
    limit still leaves every finished N behind)."""
    summary = {}
    for key, runs in results.items():
        if key == "identity":
            continue
        summary[key] = {"median_tps": statistics.median(r["aggregate_tps"] for r in runs),
                        "acceptance": runs[0].get("acceptance")}
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
            "torch": torch.__version__, "dtype": str(loaded.dtype), "model": str(a.model),
            "commit": commit_id(),
            "date": time.strftime("%Y-%m-%d"), "backend": backend, "args": vars(a)}
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "summary": summary,
                                            "identity": results.get("identity", {})}, indent=2))
    lines = ["| N | " + " | ".join(names) + (" | hf generate" if a.hf else "") + " | acceptance (batch_mtp) |",
             "|---|" + "---|" * (len(names) + (2 if a.hf else 1))]
    for n in ns:
        cells = [f"{summary[f'{c}@{n}']['median_tps']:.0f}" for c in names]
        if a.hf:
            cells.append(f"{summary[f'hf_generate@{n}']['median_tps']:.1f}")
        acc = summary.get(f"batch_mtp@{n}", {}).get("acceptance")
        cells.append("-" if acc is None else f"{acc:.3f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table, flush=True)
    if a.md:
        Path(a.md).write_text(table + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=EMBEDDED_MODEL_DIR)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--n", default="1,2,4,8")
    ap.add_argument("--configs", default="solo,batch,batch_mtp",
                    help="comma list of: " + ", ".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--window-rows", type=int, default=8)
    ap.add_argument("--graphs", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--hf", action="store_true", help="also time transformers generate() (batched at N)")
    ap.add_argument("--no-reverse", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args()

    device = torch.device(a.device)
    backend = ops.set_backend(a.backend, device.type)
    loaded = load_checkpoint(a.model, a.dtype, device, log=lambda s: None)
    ns = [int(x) for x in a.n.split(",")]
    names = a.configs.split(",")
    prompts_all = code_prompts(loaded.tokenizer, max(ns), a.prompt_tokens)
    results: dict = {}
    orders = [names] if a.no_reverse else [names, names[::-1]]
    for n in ns:
        prompts = prompts_all[:n]
        engines = {name: make_engine(loaded, device, engine_cfg(CONFIGS[name], name, n, a), prompts,
                                     a.max_tokens) for name in names}
        for order_i, order in enumerate(orders):
            for rep in range(a.repeats if order_i == 0 else 1):
                for name in order:
                    r = run_cohort(engines[name], device, prompts, a.max_tokens)
                    key = f"{name}@{n}" + ("" if order_i == 0 else "@rev")
                    results.setdefault(key, []).append(r)
                    print(f"N={n} {key:<22} rep {rep}: {r['aggregate_tps']:9.1f} tok/s  "
                          f"accept {r['acceptance'] if r['acceptance'] is not None else float('nan'):.3f}  "
                          f"windows {r['windows']} graph {r['graph']}", flush=True)
        for eng in engines.values():
            eng.close()
        del engines
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # greedy identity across configurations (the same cohort)
        ref = results[f"{names[0]}@{n}"][0]["tokens"]
        for name in names[1:]:
            same = results[f"{name}@{n}"][0]["tokens"] == ref
            print(f"N={n} greedy text {name} vs {names[0]}: {'identical' if same else 'DIFFERENT'}")
            results.setdefault("identity", {})[f"{name}@{n}"] = same
        if a.hf:
            tps = hf_generate(a.model, device, prompts, min(a.max_tokens, 64), loaded.dtype)
            results[f"hf_generate@{n}"] = [{"aggregate_tps": tps}]
            print(f"N={n} hf_generate: {tps:.1f} tok/s")
        write_results(a, ns[:ns.index(n) + 1], names, results, loaded, device, backend)


if __name__ == "__main__":
    main()
