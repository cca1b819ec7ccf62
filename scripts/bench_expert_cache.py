"""The expert cache on a GPU: (a) the miss path's read bandwidth against pinned host-to-device
copies, and (b) whether batching pays at cache budgets holding 100/75/44/25% of the routed
experts (docs/EXPERT_CACHE.md).

(a) bandwidth: a pinned host-to-device copy of --copy-mib, and ops.moe_experts at the model's
    layer shapes with every routed expert missing (all read from pinned host memory inside the
    kernel; the FP8 scales stay on the device, as in the engine), replayed from a CUDA graph;
    bytes = distinct experts x weight bytes of one expert. Also
    the same call with every expert resident (HBM). Prints miss-path / copy (goal >= 0.8).
(b) study: for each budget (and first the no-cache engine), for each configuration, one engine
    with --max-n slots (warmed on one cohort: compiles and captures are not what is timed),
    then cohorts of N distinct prompts at each N, --repeats times; aggregate tok/s and the hit
    rate of the timed windows. --instances K builds K such engines one after another and takes
    the median of their medians: engines that run the same work differ by a few percent (most
    of it host time between the serial loop's windows), as much as batching's gain in some
    cells, so one engine per cell cannot tell that gain's sign there. The 100% budget runs with adaptation off, and its first
    configuration's engine writes the routing profile of the lower budgets' first fill
    (engine.expert_profile). The protocol (recorded in the JSON's meta.protocol):
    - --fresh-cache-per-cell (default): before every timed cohort (each configuration, N and
      repeat) the cache returns to its first fill with its adaptation state cleared
      (ExpertCache.reset), so no cell inherits the warm-up's or an earlier cell's swaps;
      --no-fresh-cache-per-cell carries the cache through them (the protocol before).
    - --profile-prompts disjoint (default): the profile routes --profile-requests prompts drawn
      as the cohorts' are (token_prompts, seed PROFILE_SEED instead of 0), none of them a timed
      one, run untimed after the warm-up on a reset cache; `timed`: the 100% engine's own routed
      counts over its warm-up cohort and timed cells (the protocol before).

    python scripts/bench_expert_cache.py --part bandwidth
    python scripts/bench_expert_cache.py --part study --layers 8 --skew 1.0 --json study.json

The study runs the serial engine (engine.overlap=false, as its simulator check models);
`--overlap both` adds each configuration's overlapped twin (NAME+overlap) beside it.

A study split over two GPU calls: `--budgets 100,75 --json a.json`, then `--budgets 44,25
--no-baseline --profile a.profile.json --json b.json`. A study without the baseline loads the
routed experts into host memory (the loader's `routed_on_host`), so one whose experts do not
fit the card runs: `--part study --layers 48 --budgets 75,44 --no-baseline` on an 80 GB GPU.

Defaults: model=qwen3_next_80b_a3b_fp8 with dummy weights, synthetic acceptance 0.8. At full
depth the warm-up alone compiles for ~120 s per engine shape, so the study defaults to
--layers 8 (misses scale with depth, and so does everything else: the per-token ratios hold).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench_engine import (OVERLAP_CHOICES, add_model_args, config_of, engine_cfg,  # noqa: E402
                          make_engine, model_config, run_cohort, token_prompts, with_overlap)
from provenance import commit_id  # noqa: E402
from strata.engine.expert_cache import (expert_bytes, moe_layers, plan_expert_cache,  # noqa: E402
                                        scale_bytes)
from strata.kernels import cyext_ops as C  # noqa: E402
from strata.kernels import ops  # noqa: E402
from strata.model.loader import load_model  # noqa: E402

BUDGETS = (100, 75, 44, 25)
#: --profile-prompts disjoint: the routing profile's prompts are token_prompts with this seed
#: (the timed cohorts' are seed 0's).
PROFILE_SEED = 1
PROFILE_CHOICES = ("disjoint", "timed")


# ---- (a) bandwidth ---------------------------------------------------------------------------
def _time(fn, reps: int) -> float:
    """Best seconds of one fn() over `reps` timed runs (CUDA events)."""
    best = math.inf
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


def copy_bandwidth(mib: int, reps: int) -> float:
    """Bytes/s of one pinned host-to-device copy of `mib` MiB."""
    src = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    return src.numel() / _time(lambda: dst.copy_(src, non_blocking=True), reps)


def miss_bandwidth(experts_mod, rows: int, reps: int, streamed_miss: bool = False) -> dict:
    """moe_experts on `rows` rows routed to distinct experts, every one missing (host store)
    and every one resident (slots), replayed from CUDA graphs: bytes/s of expert reads.
    `miss` is the per-block kernels' miss path; streamed_miss: also the misses through the
    streamed kernels (`miss_streamed`, the default for a cache that misses on sm_90+)."""
    e = experts_mod
    E, k = e.w_gate_up.shape[0], min(10, e.w_gate_up.shape[0] // rows)
    fp8 = e.gu_scale is not None
    full = [t.detach() for t in (e.w_gate_up, e.w_down) + ((e.gu_scale, e.down_scale) if fp8 else ())]
    # weights in pinned host memory, every expert's FP8 scales on the device (as the engine)
    host = [t[:E].to("cpu").contiguous().pin_memory() for t in full[:2]] + full[2:]
    one = [t[:1].clone() for t in full]  # one slot, never used (every expert misses)
    H = full[0].shape[2]
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(rows * k, device="cuda").view(rows, k) % E
    w = torch.full((rows, k), 1.0 / k, device="cuda")
    out = torch.empty_like(x)
    ws = torch.empty(C.moe_workspace_numel(rows, k, full[0].shape[1] // 2), device="cuda")
    missing = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    block = e.block
    scales = lambda ts: ts[2:] if fp8 else [None, None]  # noqa: E731

    def miss():
        C.gpu_moe_experts(x, one[0], one[1], w, ids, *scales(one), block, missing, host[0],
                          host[1], *scales(host), out=out, workspace=ws)

    def resident():
        C.gpu_moe_experts(x, full[0], full[1], w, ids, *scales(full), block, out=out,
                          workspace=ws)

    def replayed(fn) -> dict:
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        t = _time(g.replay, reps)
        return {"seconds": t, "bytes": nbytes, "bytes_per_s": nbytes / t}

    nbytes = len(set(ids.flatten().tolist())) * (expert_bytes(e) - scale_bytes(e))  # over the bus
    before = C.moe_launch_options()
    try:  # "miss": the per-block kernels' miss path (on sm_90+ the streamed one is the default)
        C.moe_launch_options(stream_miss=False)
        res = {"miss": replayed(miss)}
        # what the streamed kernels must reproduce bit for bit
        per_block = out.clone() if streamed_miss else None
        res["resident"] = replayed(resident)
    finally:
        C.moe_launch_options(stream_miss=before["stream_miss"])
    if streamed_miss:
        # the same misses through the streamed kernels' bulk copies (moe_launch_options
        # stream_miss, sm_90+): last, since a fault of the copies would end the process
        try:
            C.moe_launch_options(stream=True, stream_all=True, stream_miss=True)
            miss()
            torch.cuda.synchronize()
            same = bool(torch.equal(out, per_block))
            res["miss_streamed"] = {**replayed(miss), "same_bits": same}
        finally:
            C.moe_launch_options(**{k: before[k] for k in ("stream", "stream_all", "stream_miss")})
    return res


def part_bandwidth(a, loaded) -> dict:
    copy = copy_bandwidth(a.copy_mib, a.reps)
    experts = moe_layers(loaded.model)[0][1].experts
    print(f"pinned host->device copy ({a.copy_mib} MiB): {copy / 1e9:.2f} GB/s")
    rows_out = []
    for rows in (int(r) for r in a.rows.split(",")):
        r = miss_bandwidth(experts, rows, a.reps, a.streamed_miss)
        ratio = r["miss"]["bytes_per_s"] / copy
        rows_out.append({"rows": rows, **r, "miss_over_copy": ratio})
        print(f"rows {rows:>2}: {r['miss']['bytes'] / 2**20:.0f} MiB of experts; per-block miss path "
              f"{r['miss']['bytes_per_s'] / 1e9:.2f} GB/s ({ratio:.0%} of the copy; goal >= 80%), "
              f"resident {r['resident']['bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
        if "miss_streamed" in r:
            ms = r["miss_streamed"]
            print(f"         streamed kernels' miss path {ms['bytes_per_s'] / 1e9:.2f} GB/s "
                  f"({ms['bytes_per_s'] / copy:.0%} of the copy), same bits as the per-block "
                  f"kernels: {ms['same_bits']}", flush=True)
    return {"copy_bytes_per_s": copy, "kernel": rows_out}


# ---- (b) study -------------------------------------------------------------------------------
def routing_profile(c, loaded, counts: torch.Tensor, windows: int, protocol: dict) -> dict:
    """A routing profile (docs/EXPERT_CACHE.md) from a cache that holds every expert and never
    adapts: `counts` (layers, E), what its `windows` routed; `protocol`: which prompts they
    were (meta.protocol's "profile")."""
    counts = counts.cpu().round().long()
    return {"model": loaded.path.name, "layers": c.plan.layers, "experts": c.plan.experts,
            "top_k": loaded.args.num_experts_per_tok,
            "tokens": int(counts[0].sum()) // loaded.args.num_experts_per_tok,
            "counts": counts.tolist(), "windows": windows, "distinct_per_window": {},
            "protocol": protocol}


def study_budgets(a) -> list:
    """The study's budgets in run order: the no-cache engine (None) first, then --budgets."""
    return ([] if a.no_baseline else [None]) + [int(b) for b in a.budgets.split(",")]


def profile_path_of(a) -> Path:
    """The routing profile the lower budgets start from: --profile, else written beside --json."""
    return Path(a.profile or Path(a.json or "expert_cache_study.json").with_suffix(".profile.json"))


def profile_requests(a, ns: list[int]) -> int:
    """--profile-requests, or (0) as many requests as the 100% engine routed under the timed
    protocol: its warm-up cohort and every timed cohort."""
    return a.profile_requests or max(ns) + sum(ns) * a.repeats


def study_protocol(a) -> dict:
    """meta.protocol: whether each timed cohort starts from a fresh cache, and where the lower
    budgets' first fill comes from: "prompts" disjoint or timed (--profile-prompts), the
    profile's own record when --profile names one ("unrecorded" in a profile from before), None
    when there is none and no 100% budget writes one (the lowest ids)."""
    ns = [int(n) for n in a.n.split(",")]
    path = profile_path_of(a)
    profile = None
    if a.profile is not None:
        try:
            profile = json.loads(path.read_text()).get("protocol") or {"prompts": "unrecorded"}
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --profile {path}: {e}") from None
    elif 100 in study_budgets(a):
        config = with_overlap(a.configs.split(","), a.overlap)[0]
        profile = {"prompts": a.profile_prompts, "config": config}
        if a.profile_prompts == "disjoint":
            profile.update(seed=PROFILE_SEED, requests=profile_requests(a, ns))
    return {"fresh_cache_per_cell": a.fresh_cache_per_cell, "repeats": a.repeats,
            "instances": a.instances,
            "profile": None if profile is None else {**profile, "path": str(path)}}


def disjoint_prompts(vocab: int, n: int, prompt_tokens: int, timed: list[list[int]]) -> list[list[int]]:
    """n prompts drawn as the timed cohorts' are (token_prompts), from seed PROFILE_SEED; an
    error if one of them is a timed prompt."""
    out = token_prompts(vocab, n, prompt_tokens, seed=PROFILE_SEED)
    if any(p in timed for p in out):
        raise SystemExit("error: a routing-profile prompt is one of the timed prompts")
    return out


def median_run(runs: list[dict]) -> dict:
    """The median cohort by tok/s (one cohort of N x 96 tokens is noisy); of an even count,
    the upper of the two middle ones (of two, the faster)."""
    return sorted(runs, key=lambda x: x["aggregate_tps"])[len(runs) // 2]


def study_row(instances: list[list[dict]], pct, mib: int, slots, name: str, n: int,
              repeats: int, expert_bytes: int, warm: list[float]) -> dict:
    """A study cell from its cohorts, one list per engine instance (--instances): tok/s is the
    median over the instances of each one's median cohort (an engine instance's own speed
    differs from the next one's by a few percent, most of it host time between windows of the
    serial loop: docs/BENCHMARKS.md), the hit rate over every cohort; bus bytes, the device
    share and the windows' times are those of the median instance's median cohort."""
    meds = [median_run(runs) for runs in instances]
    r = median_run(meds)
    every = [x for runs in instances for x in runs]
    h, m = sum(x["hits"] for x in every), sum(x["misses"] for x in every)
    return {"budget_pct": pct, "expert_cache_mib": mib, "repeats": repeats,
            "instances": len(instances),
            "runs_tps": [x["aggregate_tps"] for x in every],
            "runs_misses": [x["misses"] for x in every],
            "instances_tps": [x["aggregate_tps"] for x in meds],
            "slots": slots, "config": name, "n": n,
            "aggregate_tps": r["aggregate_tps"], "acceptance": r["acceptance"],
            "windows": sum(x["windows"] for x in every),
            "hit_rate": h / (h + m) if h + m else None,
            # one cohort's bytes, whatever --repeats and --instances
            "bus_bytes": r["misses"] * expert_bytes, "warm_s": statistics.fmean(warm),
            # where the cell's time went: engines that run the same work differ here
            "device_busy": r["device_busy"], "time_by_shape": r["time_by_shape"]}


def time_engine(a, loaded, device, ecfg, prompts, ns: list[int], profiling: bool,
                profile_path: Path, protocol: dict) -> tuple[dict, float, Optional[int], bool]:
    """One engine of `ecfg`, warmed, then every N timed --repeats times. `profiling`: the 100%
    engine that writes the lower budgets' routing profile (--profile-prompts disjoint: first,
    from other prompts; timed: afterwards, from every window it ran). Returns ({n: runs},
    warm-up seconds, the cache's slots or None, whether it wrote the profile)."""
    t0 = time.perf_counter()
    eng = make_engine(loaded, device, ecfg, prompts[:max(ns)], a.max_tokens)
    warm_s = time.perf_counter() - t0
    c = eng.expert_cache
    wrote = False
    if profiling and a.profile_prompts == "disjoint":
        c.reset()  # the warm-up cohort's routing is the timed prompts'
        w0 = c.windows
        extra = disjoint_prompts(loaded.args.vocab_size, profile_requests(a, ns),
                                 a.prompt_tokens, prompts)
        for k in range(0, len(extra), max(ns)):
            run_cohort(eng, device, extra[k:k + max(ns)], a.max_tokens)
        profile_path.write_text(json.dumps(routing_profile(
            c, loaded, c.routed, c.windows - w0, protocol["profile"])) + "\n")
        wrote, profiling = True, False
    # --profile-prompts timed: the profile is every window's routing, resets or not
    carried = torch.zeros_like(c.routed) if profiling else None
    runs_by_n = {}
    for n in ns:
        runs = []
        for _ in range(a.repeats):
            if c is not None and a.fresh_cache_per_cell:
                if profiling:
                    carried += c.routed
                c.reset()
            h0, m0 = (c.hits, c.misses) if c else (0, 0)
            runs.append(run_cohort(eng, device, prompts[:n], a.max_tokens))
            runs[-1].update(hits=c.hits - h0 if c else 0, misses=c.misses - m0 if c else 0)
        runs_by_n[n] = runs
    if profiling:  # --profile-prompts timed
        profile_path.write_text(json.dumps(routing_profile(
            c, loaded, carried + c.routed, c.windows, protocol["profile"])) + "\n")
        wrote = True
    slots = c.plan.slots if c else None
    eng.close()
    del eng
    torch.cuda.empty_cache()
    return runs_by_n, warm_s, slots, wrote


def part_study(a, loaded, device, save=lambda rows: None) -> dict:
    """`save(rows)` after every engine, so that a run cut by its time limit keeps its rows."""
    plan = plan_expert_cache(loaded.model, 1e12)
    ns = [int(n) for n in a.n.split(",")]
    names = with_overlap(a.configs.split(","), a.overlap)
    prompts = token_prompts(loaded.args.vocab_size, max(ns), a.prompt_tokens)
    budgets = study_budgets(a)
    profile_path = profile_path_of(a)
    protocol = study_protocol(a)
    have_profile = a.profile is not None
    results = []
    for pct in budgets:  # no cache first: every cache after it re-plans from the host store
        mib = 0
        if pct is not None:
            mib = int(math.ceil(plan.routed_mib() * pct / 100)) + (1 if pct == 100 else 0)
        for name in names:
            ecfg = engine_cfg(config_of(name), name, max(ns), a)
            ecfg.expert_cache_mib = mib
            ecfg.expert_adapt_every = 0 if pct == 100 else a.adapt_every
            per_instance, warm = [], []  # each engine's {n: runs}, warm-up seconds
            for _instance in range(a.instances):
                ecfg.expert_profile = str(profile_path) if have_profile and pct != 100 else None
                runs_by_n, warm_s, slots, wrote = time_engine(
                    a, loaded, device, ecfg, prompts, ns, pct == 100 and not have_profile,
                    profile_path, protocol)
                have_profile = have_profile or wrote
                per_instance.append(runs_by_n)
                warm.append(warm_s)
            for n in ns:
                row = study_row([r[n] for r in per_instance], pct, mib, slots, name, n,
                                a.repeats, plan.expert_bytes, warm)
                results.append(row)
                hr = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.3f}"
                spread = ("" if a.instances == 1 else " (engines: " + ", ".join(
                    f"{t:.1f}" for t in row["instances_tps"]) + ")")
                print(f"budget {'none' if pct is None else f'{pct}%':>4} {name:<10} N={n}: "
                      f"{row['aggregate_tps']:8.1f} tok/s, hit rate {hr}{spread}", flush=True)
            save(results)
    return {"rows": results, "table": study_table(results, names, ns, budgets),
            "protocol": protocol}


def study_table(rows: list[dict], names: list[str], ns: list[int], budgets) -> str:
    """Markdown: aggregate tok/s per (budget, N), each configuration, and batch_mtp's gain over
    solo (the sign batching's gain takes)."""
    by = {(r["budget_pct"], r["config"], r["n"]): r for r in rows}
    head = "| budget | N | " + " | ".join(names) + " | hit rate | batch_mtp / solo |"
    lines = [head, "|" + "---|" * (len(names) + 4)]
    for pct in budgets:
        for n in ns:
            cells = [f"{by[(pct, c, n)]['aggregate_tps']:.0f}" if (pct, c, n) in by else "-"
                     for c in names]
            hr = by.get((pct, names[-1], n), {}).get("hit_rate")
            solo, bm = by.get((pct, "solo", n)), by.get((pct, "batch_mtp", n))
            gain = f"{bm['aggregate_tps'] / solo['aggregate_tps'] - 1:+.1%}" if solo and bm else "-"
            label = "no cache" if pct is None else f"{pct}%"
            lines.append(f"| {label} | {n} | " + " | ".join(cells)
                         + f" | {'-' if hr is None else f'{hr:.3f}'} | {gain} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="both", choices=("bandwidth", "study", "both"))
    add_model_args(ap, preset="qwen3_next_80b_a3b_fp8", load_format="dummy", layers=8)
    ap.add_argument("--skew", type=float, default=1.0, help="model.dummy_routing_skew (SYNTHETIC)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--rows", default="1,4,8,32", help="bandwidth: window rows routed")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--streamed-miss", action="store_true",
                    help="bandwidth: also the misses through the streamed kernels' bulk copies "
                         "(moe_launch_options stream_miss, the default on sm_90+)")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                    help="percent of the routed experts each cache holds")
    ap.add_argument("--configs", default="solo,batch,batch_mtp")
    ap.add_argument("--overlap", choices=OVERLAP_CHOICES, default="off",
                    help="engine.overlap for every configuration; both: each configuration "
                         "twice, the overlapped one named NAME+overlap, side by side")
    ap.add_argument("--n", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=1,
                    help="study: cohorts per cell, each from a fresh cache (--fresh-cache-"
                         "per-cell); the median's tok/s and bus bytes reported, the hit rate "
                         "over all")
    ap.add_argument("--instances", type=int, default=1,
                    help="study: engines built per (budget, configuration), each timing every N "
                         "--repeats times; a cell is the median of the engines' medians (an "
                         "engine's speed differs from the next one's by a few percent)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--window-rows", type=int, default=8)
    ap.add_argument("--synthetic-acceptance", type=float, default=0.8)
    ap.add_argument("--adapt-every", type=int, default=8, help="engine.expert_adapt_every")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the no-cache engine (a study split over several GPU calls)")
    ap.add_argument("--profile", help="the lower budgets' first fill (default: the routing "
                                      "profile of this run's 100%% budget, written beside --json)")
    ap.add_argument("--fresh-cache-per-cell", action=argparse.BooleanOptionalAction, default=True,
                    help="study: reset the expert cache to its first fill before every timed "
                         "cohort (each configuration, N and repeat); --no-fresh-cache-per-cell "
                         "carries it through the warm-up and the earlier cells")
    ap.add_argument("--profile-prompts", choices=PROFILE_CHOICES, default="disjoint",
                    help="study: what the 100%% budget's routing profile routes: prompts "
                         "disjoint from the timed ones, drawn the same way (seed "
                         f"{PROFILE_SEED}), or the timed cells themselves (the protocol before)")
    ap.add_argument("--profile-requests", type=int, default=0,
                    help="study, --profile-prompts disjoint: requests the profile routes, in "
                         "cohorts of max N (0: max N + sum of N x --repeats, the 100%% engine's "
                         "warm-up and timed requests)")
    ap.add_argument("--graphs", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.instances < 1 or a.profile_requests < 0:
        ap.error("--repeats and --instances must be at least 1 and --profile-requests at least 0")
    return a


def main() -> None:
    a = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_expert_cache.py measures a GPU: no CUDA device here")
    device = torch.device("cuda")
    backend = ops.set_backend(a.backend, device.type)
    mcfg = model_config(a)
    mcfg.moe_dense_experts = 0
    mcfg.dummy_routing_skew = a.skew
    t0 = time.perf_counter()
    # every engine caching (no baseline): the experts load into host memory, so a model whose
    # experts do not fit the card runs (the full-depth FP8 80B on an 80 GB GPU)
    on_host = a.part == "study" and a.no_baseline
    loaded = load_model(mcfg, device, log=lambda s: None, routed_on_host=on_host)
    print(f"loaded {loaded.path.name} ({a.layers} layers, skew {a.skew}"
          f"{', routed experts in host memory' if on_host else ''}) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    out = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "commit": commit_id(), "date": time.strftime("%Y-%m-%d"),
                    "backend": backend, "args": vars(a)}}
    if a.part in ("bandwidth", "both"):
        out["bandwidth"] = part_bandwidth(a, loaded)
    if a.part in ("study", "both"):
        out["meta"]["protocol"] = study_protocol(a)

        def save(rows):
            if a.json:
                Path(a.json).write_text(json.dumps({**out, "study": {"rows": rows, "partial": True}},
                                                   indent=2) + "\n")
        out["study"] = part_study(a, loaded, device, save)
        print(out["study"]["table"])
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
