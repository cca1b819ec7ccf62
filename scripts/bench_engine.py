"""In-process engine benchmark: solo one-at-a-time, plain batch and batch_mtp side by side.

For each N in --n, a cohort of N distinct code prompts arrives at once; every configuration runs
the same cohort, --repeats times (median reported), in forward order and then in reverse order
(controls). Optionally transformers' generate() on the same checkpoint and prompts, batched at N.
Beside each configuration, the mean time of each window shape it ran and that shape's byte floor
(strata/byte_floor.py: the bytes the window must read over the measured copy bandwidth), its
prompt chunks' times by length, and the share of each cohort's wall time the device was busy in
windows and prompt chunks (the rest is host time the device did not hide).

    python scripts/bench_engine.py --device cuda --n 1,2,4,8 --repeats 3 --json out.json --md out.md

At scale, on dummy weights (a model preset or a directory with only config.json; prompts are
random token ids when there is no tokenizer):

    python scripts/bench_engine.py --preset qwen3_next_80b_a3b_fp8 --load-format dummy \
        --layers 48 --synthetic-acceptance 0.8 --configs solo_spec2,batch,batch_mtp --n 1,2,4,8
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from strata.byte_floor import (H200_COPY_BYTES_PER_S, floor_seconds, weight_format_from_config,  # noqa: E402
                               window_bytes)
from strata.config import DRAFT_HEADS, StrataConfig, check_known_keys, register_configs  # noqa: E402
from strata.engine.compiling import deterministic_default, inductor_pdl  # noqa: E402
from strata.kernels.cyext_ops import MOE_WIDE_MAX_ROWS, SKINNY_BF16_MAX_ROWS  # noqa: E402
from strata.engine.llm_engine import Engine  # noqa: E402
from strata.engine.request import Request, SamplingParams  # noqa: E402
from strata.kernels import ops  # noqa: E402
from strata.model.loader import FP8_DENSE, load_model  # noqa: E402
from strata.runner import run_requests  # noqa: E402
from prompt_material import CODE_PROMPTS, prompt_texts  # noqa: E402
from provenance import commit_id  # noqa: E402


def code_prompts(tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """n distinct prompts of prompt_tokens tokens: the first texts of CODE_PROMPTS, in order,
    that are long enough (at least prompt_tokens + 10 tokens), each cut to its first
    prompt_tokens tokens."""
    out = []
    for text in prompt_texts():
        ids = tokenizer.encode(text)
        if len(ids) >= prompt_tokens + 10:
            out.append(ids[:prompt_tokens])
        if len(out) == n:
            return out
    raise SystemExit(f"error: {CODE_PROMPTS.name} holds {len(out)} prompts of at least "
                     f"{prompt_tokens + 10} tokens; {n} were asked for")


def token_prompts(vocab: int, n: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """n random token-id prompts (ids 1 .. vocab-1, fixed seed): for models without a tokenizer."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, prompt_tokens), generator=g).tolist()


def add_model_args(ap, preset=None, load_format=None, layers=None) -> None:
    """The arguments model_config reads (--preset, --model, --dtype, --load-format, --layers,
    --fp8-dense), with a script's own defaults."""
    ap.add_argument("--preset", default=preset,
                    help=f"a model preset, conf/model/NAME.yaml (default: {preset or 'the tiny model'})")
    ap.add_argument("--model", help="a checkpoint directory (model.path; overrides the preset's)")
    ap.add_argument("--dtype", help="model.dtype (default: the preset's; auto without a preset)")
    ap.add_argument("--load-format", default=load_format,
                    help="model.load_format: auto, safetensors or dummy")
    ap.add_argument("--layers", type=int, default=layers,
                    help="model.num_layers: the first N decoder layers"
                         + (f" (default: {layers})" if layers else ""))
    ap.add_argument("--fp8-dense", choices=FP8_DENSE,
                    help="model.fp8_dense: FP8 checkpoints' dense layers (default: the config's)")


def model_config(a):
    """The `model` group as `python -m strata` would compose it: the preset (conf/model/NAME.yaml),
    then --model, --dtype, --load-format, --layers and --fp8-dense as overrides (an unknown knob is Hydra's
    error naming it)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    overrides = [f"model={a.preset}"] if a.preset else []
    if a.model:
        overrides.append(f"model.path={a.model}")
    if a.dtype:
        overrides.append(f"model.dtype={a.dtype}")
    if a.load_format:
        overrides.append(f"model.load_format={a.load_format}")
    if a.layers:
        overrides.append(f"model.num_layers={a.layers}")
    if a.fp8_dense:
        overrides.append(f"model.fp8_dense={a.fp8_dense}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    check_known_keys(cfg)
    return cfg.model


def window_grid(fields: dict) -> tuple[int, int]:
    """(groups, rows per group) a `window` trace event ran: a shape key's padded bucket, else
    its layout's distinct slots and deepest group."""
    key, layout = fields["key"], fields["layout"]
    if key.startswith("shape:"):
        groups, rows = (int(x) for x in key[6:].split("@")[0].split("x"))
        return groups, rows
    return len(set(layout)), max(layout.count(s) for s in set(layout))


class WindowTimes:
    """Collects the window events of an engine's timed cohorts: (groups, rows, ctx) -> durations
    (padded shapes count as the engine runs them: a shape key's bucket), and its prompt chunks'
    durations by their tokens (what the simulator's experts.prefill_scale prices)."""

    def __init__(self):
        self.times: dict[tuple[int, int, int], list[float]] = {}
        #: prompt chunks' durations by (segments, tokens of the first segment): a chunk of
        #: several slots (engine.prefill_slots) writes one event per slot, counted once here
        self.prefills: dict[tuple[int, int], list[float]] = {}
        #: Device seconds of the windows and prompt chunks since the last reset (a cohort's:
        #: its wall time less this is the host time the device did not hide).
        self.busy_s = 0.0
        #: The current cohort's windows as (groups, rows, misses or None, seconds) and prompt
        #: chunks as (tokens, seconds): where a cohort's time went (cohort_summary).
        self.cohort_windows: list[tuple[int, int, Optional[int], float]] = []
        self.cohort_prefills: list[tuple[int, float]] = []
        self._chunk_left = 0  # events still to come of a chunk of several slots
        self.on = False

    def start_cohort(self) -> None:
        self.busy_s = 0.0
        self.cohort_windows, self.cohort_prefills = [], []

    def cohort_summary(self) -> dict:
        """The cohort's windows by (groups x rows): count, mean ms and, with an expert cache,
        mean misses; its prompt chunks' count and mean ms."""
        shapes: dict[str, list] = {}
        for groups, rows, misses, dur in self.cohort_windows:
            shapes.setdefault(f"{groups}x{rows}", []).append((misses, dur))
        out = {}
        for key, ws in sorted(shapes.items()):
            out[key] = {"windows": len(ws), "mean_ms": statistics.fmean(d for _, d in ws) * 1e3}
            if ws[0][0] is not None:
                out[key]["mean_misses"] = statistics.fmean(m for m, _ in ws)
        chunks = [d for _, d in self.cohort_prefills]
        return {"windows": out, "prefill_chunks": len(chunks),
                "prefill_mean_ms": statistics.fmean(chunks) * 1e3 if chunks else None}

    def __call__(self, ev: str, fields: dict) -> None:
        if not self.on or ev not in ("prefill", "window"):
            return
        dur = float(fields["dur"])
        if ev == "prefill":
            if self._chunk_left:  # a later slot of a chunk: counted with its first
                self._chunk_left -= 1
                return
            segs = int(fields.get("segments", 1))
            self._chunk_left = segs - 1
            self.busy_s += dur
            self.prefills.setdefault((segs, int(fields["tokens"])), []).append(dur)
            self.cohort_prefills.append((int(fields["tokens"]), dur))
            return
        self.busy_s += dur
        groups, rows = window_grid(fields)
        self.times.setdefault((groups, rows, int(fields["ctx"])), []).append(dur)
        self.cohort_windows.append((groups, rows, fields.get("misses"), dur))

    def prefill_table(self) -> list[dict]:
        return [{"tokens": t, **({"segments": g} if g > 1 else {}), "chunks": len(d),
                 "mean_ms": statistics.fmean(d) * 1e3}
                for (g, t), d in sorted(self.prefills.items())]

    def table(self, args, fmt, drafting: bool, bandwidth: float, draft_vocab: int = 0,
              draft_fp8: bool = False) -> list[dict]:
        out = []
        for (groups, rows, ctx), durs in sorted(self.times.items()):
            b = window_bytes(args, groups, rows, ctx, fmt, drafting=drafting,
                             draft_vocab=draft_vocab, draft_fp8=draft_fp8)
            floor = floor_seconds(b["total"], bandwidth)
            mean = statistics.fmean(durs)
            out.append({"groups": groups, "rows": rows, "ctx": ctx, "windows": len(durs),
                        "mean_ms": mean * 1e3, "floor_ms": floor * 1e3, "ratio": mean / floor,
                        "bytes": b})
        return out


CONFIGS = {
    "solo": dict(mode="solo", batch_mtp=False),
    "solo_spec4": dict(mode="solo", batch_mtp=False, spec=4),
    "solo_eager": dict(mode="solo", batch_mtp=False, graphs=False),
    "solo_nospec": dict(mode="solo", batch_mtp=False, spec=1),
    "solo_spec2": dict(mode="solo", batch_mtp=False, spec=2),
    "solo_spec3": dict(mode="solo", batch_mtp=False, spec=3),
    "solo_spec5": dict(mode="solo", batch_mtp=False, spec=5),
    "batch": dict(mode="batch", batch_mtp=False),
    "batch_mtp": dict(mode="batch", batch_mtp=True),
    "batch_mtp_eager": dict(mode="batch", batch_mtp=True, graphs=False),
    "batch_mtp_w16": dict(mode="batch", batch_mtp=True, window_rows=16),
    # engine.batch_mtp_drafts=null: up to spec - 1 drafts a group where the window has room
    "batch_mtp_deep": dict(mode="batch", batch_mtp=True, batch_mtp_drafts=None),
    "batch_mtp_w16_deep": dict(mode="batch", batch_mtp=True, window_rows=16, batch_mtp_drafts=None),
    "batch_mtp_w24_deep": dict(mode="batch", batch_mtp=True, window_rows=24, batch_mtp_drafts=None),
    "batch_mtp_w32_deep": dict(mode="batch", batch_mtp=True, window_rows=32, batch_mtp_drafts=None),
    # eight slots' groups of 5 rows: spec 5 (four drafts a group)
    "batch_mtp_w40_deep": dict(mode="batch", batch_mtp=True, window_rows=40, batch_mtp_drafts=None,
                               spec=5),
    # engine.draft_vocab: drafts among 32,768 tokens (a vocabulary larger than that, such as
    # the 80B models' 151,936), against the same configuration without it in one process
    "solo_draft32k": dict(mode="solo", batch_mtp=False, draft_vocab=32768),
    "solo_spec2_draft32k": dict(mode="solo", batch_mtp=False, spec=2, draft_vocab=32768),
    "batch_mtp_w16_draft32k": dict(mode="batch", batch_mtp=True, window_rows=16,
                                   draft_vocab=32768),
    # engine.draft_head=fp8: drafts read an FP8 copy of the LM head (half a bf16 head's bytes)
    "solo_draft_fp8": dict(mode="solo", batch_mtp=False, draft_head="fp8"),
    "solo_draft32k_fp8": dict(mode="solo", batch_mtp=False, draft_vocab=32768, draft_head="fp8"),
    "batch_mtp_w16_draft_fp8": dict(mode="batch", batch_mtp=True, window_rows=16,
                                    draft_head="fp8"),
    # engine.batch_invariant: every window runs window_rows rows. Greedy text is compared with
    # the first configuration listed, so list solo_inv first to check the invariant ones.
    "solo_inv": dict(mode="solo", batch_mtp=False, batch_invariant=True),
    "batch_inv": dict(mode="batch", batch_mtp=False, batch_invariant=True),
    "batch_mtp_inv": dict(mode="batch", batch_mtp=True, batch_invariant=True),
    "batch_mtp_eager_inv": dict(mode="batch", batch_mtp=True, graphs=False, batch_invariant=True),
}


#: --overlap: engine.overlap off, on, or each configuration both ways.
OVERLAP_CHOICES = ("off", "on", "both")
#: The name of a configuration's overlapped twin.
OVERLAP_SUFFIX = "+overlap"


def with_overlap(names: list[str], overlap: str) -> list[str]:
    """Configuration names for --overlap: as given (off), all overlapped (on), or each
    followed by its overlapped twin (both)."""
    for name in names:
        if name not in CONFIGS:
            raise SystemExit(f"error: --configs: unknown configuration {name!r} "
                             f"(known: {', '.join(CONFIGS)})")
    twins = {"off": ("",), "on": (OVERLAP_SUFFIX,), "both": ("", OVERLAP_SUFFIX)}[overlap]
    return [name + t for name in names for t in twins]


def config_of(name: str) -> dict:
    """A configuration's engine settings; NAME+overlap adds engine.overlap=true."""
    base = name.removesuffix(OVERLAP_SUFFIX)
    return {**CONFIGS[base], "overlap": name != base}


def engine_cfg(base: dict, name: str, n: int, args) -> object:
    """Command-line settings first, then the configuration's own (which win)."""
    cfg = OmegaConf.structured(StrataConfig).engine
    cfg.graphs = args.graphs
    cfg.max_context = args.max_context
    cfg.window_rows = args.window_rows
    cfg.spec = args.spec
    # bench_expert_cache.py has no --prefill-slots: one slot a chunk, as its studies ran
    cfg.prefill_slots = getattr(args, "prefill_slots", 1)
    cfg.compile_specialize_one = getattr(args, "specialize_one", "on") == "on"
    if hasattr(args, "compile_workers"):  # given (a number, or None for auto); else the schema's
        cfg.compile_workers = args.compile_workers
    cfg.vram_every = 0
    cfg.synthetic_acceptance = args.synthetic_acceptance
    cfg.draft_vocab = getattr(args, "draft_vocab", 0)
    cfg.draft_vocab_file = getattr(args, "draft_vocab_file", None)
    cfg.draft_head = getattr(args, "draft_head", "model")
    for k, v in base.items():
        setattr(cfg, k, v)
    cfg.slots = max(1, n) if cfg.mode == "batch" else 1
    return cfg


def request_seed(seed0: Optional[int], i: int) -> int:
    """Request i's sampling seed: 0 (the engine's default) unless --request-seeds gives k,
    then k + i. Greedy text does not depend on it; engine.synthetic_acceptance's decisions do
    (a hash of seed and position), so with one seed the cohort's requests, whose prompts are
    of one length, all draw the same sequence of decisions."""
    return 0 if seed0 is None else seed0 + i


def make_engine(loaded, device, ecfg, prompts, max_tokens, seed0: Optional[int] = None) -> Engine:
    """An engine for one (configuration, N), warmed on one cohort: compiles and captures are
    not what the timed cohorts measure, and repeats reuse its graphs as a server would."""
    # Warm-up and warnings go to stderr: how long compiling takes is worth seeing.
    eng = Engine(loaded, ecfg, device,
                 log=lambda s: s.startswith(("INFO warm-up", "INFO compile workers", "WARNING"))
                 and print(s, file=sys.stderr))
    eng.trace.keep = False
    eng.window_times = WindowTimes()
    eng.trace.listener = eng.window_times
    run_requests(eng, [Request(f"w{i}", list(p), SamplingParams(max_tokens=max_tokens, stop_at_eos=False,
                                                                seed=request_seed(seed0, i)))
                       for i, p in enumerate(prompts)])
    eng.requests.clear()
    return eng


class GcPauses:
    """The garbage collector's passes inside `with`: how many of each generation and the host
    time they took (the device idles through a pass longer than the windows launched ahead)."""

    def __enter__(self) -> "GcPauses":
        self.count, self.ms, self.max_ms, self._t0 = [0, 0, 0], 0.0, 0.0, 0.0
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1e3
        self.count[info["generation"]] += 1
        self.ms += ms
        self.max_ms = max(self.max_ms, ms)

    def summary(self) -> dict:
        return {"collections": list(self.count), "ms": round(self.ms, 3),
                "max_ms": round(self.max_ms, 3)}


def run_cohort(eng: Engine, device, prompts, max_tokens, seed0: Optional[int] = None) -> dict:
    reqs = [Request(f"r{i}", list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                     stop_at_eos=False, seed=request_seed(seed0, i)))
            for i, p in enumerate(prompts)]
    before = eng.stats()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.window_times.start_cohort()
    eng.window_times.on = True
    with GcPauses() as gc_pauses:
        run_requests(eng, reqs)
    eng.window_times.on = False
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    after = eng.stats()
    d = {k: after[k] - before[k] for k in ("output_tokens", "drafted", "accepted", "windows",
                                            "graph_hits", "graph_captures", "graph_eager",
                                            "graph_evictions")}
    out = {"aggregate_tps": d["output_tokens"] / wall, "wall_s": wall,
           # the share of the cohort's wall time the device spent in windows and prompt chunks
           "device_busy": eng.window_times.busy_s / wall if wall > 0 else None,
           "acceptance": d["accepted"] / d["drafted"] if d["drafted"] else None,
           "windows": d["windows"],
           "gc": gc_pauses.summary(),
           "time_by_shape": eng.window_times.cohort_summary(),
           "graph": {"hit": d["graph_hits"], "capture": d["graph_captures"],
                     "eager": d["graph_eager"], "evict": d["graph_evictions"]},
           "tokens": [eng.requests[r.id].emitted for r in reqs]}
    # the cohort's greedy text in 16 hex digits: compared across processes (cold compile
    # caches, compile workers) where the tokens themselves stay in this one
    out["text_digest"] = hashlib.sha1(json.dumps(out["tokens"]).encode()).hexdigest()[:16]
    eng.requests.clear()
    return out


def hf_model(path, device, dtype, dummy_args=None):
    """transformers' Qwen3NextForCausalLM: the checkpoint, or with dummy_args (ModelArgs) a
    random one of the same config, depth and dtype, initialised on the device."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    if dummy_args is None:
        return Qwen3NextForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    d = dummy_args.to_hf_dict()
    d.pop("dtype", None)
    d.pop("torch_dtype", None)
    config = Qwen3NextConfig(**d)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3NextForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def hf_generate(path, device, prompts, max_tokens, dtype, dummy_args=None) -> float:
    model = hf_model(path, device, dtype, dummy_args)
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
    tps = n * max_tokens / (time.perf_counter() - t0)
    del model
    return tps


#: --kernel-options that take a count rather than 0|1, and its range
COUNT_OPTIONS = {"linear_split_depth": (0, 15), "down_split_runs": (0, 15),
                 "wide_rows": (17, MOE_WIDE_MAX_ROWS), "l2_prefetch": (0, 3),
                 "skinny_pdl_rows": (0, SKINNY_BF16_MAX_ROWS)}


def set_kernel_options(spec: str) -> dict:
    """Apply --kernel-options (NAME=0|1,..., or a count in its COUNT_OPTIONS range) to the GPU
    extension's launch switches; returns the switches in force (empty without the extension
    and without options)."""
    wanted = {}
    for item in filter(None, (t.strip() for t in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not value.isdigit() or (name not in COUNT_OPTIONS
                                              and value not in ("0", "1")):
            counts = ", ".join(f"{k}={lo}..{hi}" for k, (lo, hi) in COUNT_OPTIONS.items())
            raise SystemExit(f"error: --kernel-options: {item!r} is not NAME=0 or NAME=1 "
                             f"({counts})")
        lo, hi = COUNT_OPTIONS.get(name, (0, 1))
        if not lo <= int(value) <= hi:
            raise SystemExit(f"error: --kernel-options: {item!r}: {name} is {lo}..{hi}")
        wanted[name] = int(value) if name in COUNT_OPTIONS else value == "1"
    try:
        from strata.kernels import cyext_ops
        if cyext_ops.gpu_platform() is None:
            raise ImportError
    except ImportError:
        if wanted:
            raise SystemExit("error: --kernel-options needs the cyext GPU extension")
        return {}
    known = cyext_ops.moe_launch_options()
    for name in wanted:
        if name not in known:
            raise SystemExit(f"error: --kernel-options: unknown switch {name!r} "
                             f"(known: {', '.join(known)})")
    return cyext_ops.moe_launch_options(**wanted)


def write_results(a, ns, names, results, loaded, device, backend) -> None:
    """Write the JSON and the markdown table for the N done so far (a run cut short by a time
    limit still leaves every finished N behind)."""
    summary = {}
    for key, runs in results.items():
        if key in ("identity", "windows", "prefills", "warmups", "gc_full"):
            continue
        summary[key] = {"median_tps": statistics.median(r["aggregate_tps"] for r in runs),
                        "acceptance": runs[0].get("acceptance"),
                        "device_busy": runs[0].get("device_busy"),
                        "text_digest": runs[0].get("text_digest"),
                        "gc": [r.get("gc") for r in runs]}
        if key in results.get("windows", {}):
            summary[key]["windows"] = results["windows"][key]
        if key in results.get("prefills", {}):
            summary[key]["prefills"] = results["prefills"][key]
        if key in results.get("warmups", {}):
            summary[key]["warmup"] = results["warmups"][key]
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
            "torch": torch.__version__, "dtype": str(loaded.dtype), "model": str(a.model),
            "commit": commit_id(), "pdl": inductor_pdl(),
            "inductor_deterministic": deterministic_default(),
            "date": time.strftime("%Y-%m-%d"), "backend": backend, "args": vars(a)}
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "summary": summary,
                                            "identity": results.get("identity", {}),
                                            "gc_full": results.get("gc_full", {})}, indent=2))
    floors = ["", "| config@N | groups x rows | ctx | windows | mean ms | floor ms | ratio |",
              "|---|---|---|---|---|---|---|"]
    for key, rows in results.get("windows", {}).items():
        for w in rows:
            floors.append(f"| {key} | {w['groups']} x {w['rows']} | {w['ctx']} | {w['windows']} | "
                          f"{w['mean_ms']:.3f} | {w['floor_ms']:.3f} | {w['ratio']:.2f} |")
    lines = ["| N | " + " | ".join(names) + (" | hf generate" if a.hf else "") + " | acceptance (batch_mtp) |",
             "|---|" + "---|" * (len(names) + (2 if a.hf else 1))]
    for n in ns:
        cells = [f"{summary[f'{c}@{n}']['median_tps']:.0f}" for c in names]
        if a.hf:
            cells.append(f"{summary[f'hf_generate@{n}']['median_tps']:.1f}")
        acc = summary.get(f"batch_mtp@{n}", {}).get("acceptance")
        cells.append("-" if acc is None else f"{acc:.3f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    table = "\n".join(lines + floors)
    print(table, flush=True)
    if a.md:
        Path(a.md).write_text(table + "\n")


def trace_cohort(eng: Engine, device, prompts, max_tokens, seed0: Optional[int], path: Path) -> Path:
    """One more cohort under torch.profiler (host and device activity), its chrome trace
    written to `path`: where the device idles between and inside an engine's windows."""
    from torch.profiler import ProfilerActivity, profile

    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_cohort(eng, device, prompts, max_tokens, seed0)
    prof.export_chrome_trace(str(path))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--n", default="1,2,4,8")
    ap.add_argument("--configs", default="solo,batch,batch_mtp",
                    help="comma list of: " + ", ".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--token-prompts", action="store_true",
                    help="random token-id prompts even when the model has a tokenizer")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--window-rows", type=int, default=8)
    ap.add_argument("--prefill-slots", type=int, default=None,
                    help="engine.prefill_slots: the prefilling slots one prompt chunk may hold "
                         "(default: the engine's, 8 on one device)")
    ap.add_argument("--synthetic-acceptance", type=float, default=None,
                    help="engine.synthetic_acceptance: accept each draft with this probability")
    ap.add_argument("--request-seeds", type=int, default=None, metavar="K",
                    help="request i of a cohort samples with seed K + i (default: every request "
                         "seed 0, the engine's default): with --synthetic-acceptance each "
                         "request then draws its own accept decisions, where one seed gives "
                         "the whole cohort one sequence (greedy text is the same either way)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="engine.draft_vocab: drafts choose among this many tokens (0: all)")
    ap.add_argument("--draft-head", choices=DRAFT_HEADS, default="model",
                    help="engine.draft_head: fp8 drafts from an FP8 copy of the LM head")
    ap.add_argument("--draft-vocab-file", default=None,
                    help="engine.draft_vocab_file: their ranking (scripts/draft_vocab.py)")
    ap.add_argument("--specialize-one", choices=("on", "off"), default="on",
                    help="engine.compile_specialize_one: a group or row count of 1 compiled apart")
    ap.add_argument("--compile-workers", type=lambda v: None if v == "auto" else int(v),
                    default=argparse.SUPPRESS,
                    help="engine.compile_workers: processes that compile the first engine's "
                         "warm-up graphs in parallel, N or auto (default: the engine's, off)")
    ap.add_argument("--bandwidth", type=float, default=H200_COPY_BYTES_PER_S,
                    help="bytes/s of the byte floor (default: the H200's measured copy rate)")
    ap.add_argument("--graphs", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--hf", action="store_true", help="also time transformers generate() (batched at N)")
    ap.add_argument("--no-reverse", action="store_true")
    ap.add_argument("--overlap", choices=OVERLAP_CHOICES, default="off",
                    help="engine.overlap for every configuration; both: each configuration twice, "
                         f"the overlapped one named NAME{OVERLAP_SUFFIX}, side by side")
    ap.add_argument("--kernel-options", default="",
                    help="GPU kernel launch switches for this run, NAME=0|1 comma-separated "
                         "(cyext_ops.moe_launch_options, e.g. gate_up_pdl=1; "
                         "linear_split_depth=0..15, down_split_runs=0..15): an A/B of one "
                         "extension in two processes")
    ap.add_argument("--trace-dir", default=None, metavar="DIR",
                    help="after the timed cohorts at each N, run one more cohort per "
                         "configuration under torch.profiler and write its chrome trace to "
                         "DIR/NAME@N.json (the device's kernels and gaps in the engine as it "
                         "runs; the profiler slows the host, so the cohort is not timed)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args()
    if a.request_seeds is not None and not 0 <= a.request_seeds < 2**62:
        ap.error(f"--request-seeds: must be in [0, 2**62), got {a.request_seeds}")

    device = torch.device(a.device)
    backend = ops.set_backend(a.backend, device.type)
    a.kernel_options = set_kernel_options(a.kernel_options)
    if a.dtype is None and a.preset is None:
        a.dtype = "auto"  # the checkpoint's own dtype, as before presets
    mcfg = model_config(a)
    a.model = mcfg.path
    loaded = load_model(mcfg, device, log=lambda s: None)
    dummy = mcfg.get("load_format") == "dummy"
    config_json = json.loads((loaded.path / "config.json").read_text())
    fmt = weight_format_from_config(config_json, torch.empty((), dtype=loaded.dtype).element_size())
    ns = [int(x) for x in a.n.split(",")]
    names = with_overlap(a.configs.split(","), a.overlap)
    if loaded.tokenizer is None or a.token_prompts:
        prompts_all = token_prompts(loaded.args.vocab_size, max(ns), a.prompt_tokens)
    else:
        prompts_all = code_prompts(loaded.tokenizer, max(ns), a.prompt_tokens)
    results: dict = {}
    orders = [names] if a.no_reverse else [names, names[::-1]]
    for n in ns:
        prompts = prompts_all[:n]
        engines = {name: make_engine(loaded, device, engine_cfg(config_of(name), name, n, a),
                                     prompts, a.max_tokens, a.request_seeds) for name in names}
        for name, eng in engines.items():
            if eng.warmup_done is not None:
                results.setdefault("warmups", {})[f"{name}@{n}"] = eng.warmup_done.facts()
        t_gc = time.perf_counter()
        gc.collect()  # what one full pass costs the host now, with the engines warmed up
        full = {"ms": (time.perf_counter() - t_gc) * 1e3, "objects": len(gc.get_objects()),
                "frozen": gc.get_freeze_count()}  # (engine.gc_freeze: skipped by the passes)
        results.setdefault("gc_full", {})[str(n)] = full
        print(f"N={n} a full garbage collection: {full['ms']:.1f} ms over {full['objects']} "
              f"objects ({full['frozen']} more frozen)", flush=True)
        for order_i, order in enumerate(orders):
            for rep in range(a.repeats if order_i == 0 else 1):
                for name in order:
                    r = run_cohort(engines[name], device, prompts, a.max_tokens, a.request_seeds)
                    key = f"{name}@{n}" + ("" if order_i == 0 else "@rev")
                    results.setdefault(key, []).append(r)
                    print(f"N={n} {key:<22} rep {rep}: {r['aggregate_tps']:9.1f} tok/s  "
                          f"accept {r['acceptance'] if r['acceptance'] is not None else float('nan'):.3f}  "
                          f"windows {r['windows']} graph {r['graph']}  device busy "
                          f"{r['device_busy'] or 0:.1%} of the wall  gc {r['gc']['collections']} "
                          f"{r['gc']['ms']:.2f} ms  text {r['text_digest']}",
                          flush=True)
        for name, eng in engines.items():
            dv = eng.verifier.draft_ids
            rows = eng.window_times.table(loaded.args, fmt, eng.verifier.drafting, a.bandwidth,
                                          0 if dv is None else int(dv.numel()),
                                          eng.cfg.draft_head == "fp8")
            results.setdefault("windows", {})[f"{name}@{n}"] = rows
            for w in rows:
                print(f"N={n} {name:<16} window {w['groups']}x{w['rows']}@{w['ctx']}: "
                      f"{w['mean_ms']:.3f} ms over {w['windows']}, byte floor {w['floor_ms']:.3f} ms, "
                      f"ratio {w['ratio']:.2f}", flush=True)
            chunks = eng.window_times.prefill_table()
            results.setdefault("prefills", {})[f"{name}@{n}"] = chunks
            for c in chunks:
                slots = f" x {c['segments']} slots" if "segments" in c else ""
                print(f"N={n} {name:<16} prompt chunk of {c['tokens']} tokens{slots}: "
                      f"{c['mean_ms']:.3f} ms over {c['chunks']}", flush=True)
            if a.trace_dir:  # after the tables: the traced cohort's times are not in them
                path = trace_cohort(eng, device, prompts, a.max_tokens, a.request_seeds,
                                    Path(a.trace_dir) / f"{name}@{n}.json")
                print(f"N={n} {name}: trace of one cohort in {path}", flush=True)
            eng.close()
        del engines
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # greedy identity across configurations (the same cohort); synthetic acceptance commits
        # drafts, which differ between configurations, so there it is not expected
        ref = results[f"{names[0]}@{n}"][0]["tokens"]
        for name in names[1:]:
            same = results[f"{name}@{n}"][0]["tokens"] == ref
            note = " (synthetic acceptance: not expected)" if a.synthetic_acceptance is not None else ""
            print(f"N={n} greedy text {name} vs {names[0]}: {'identical' if same else 'DIFFERENT'}{note}")
            results.setdefault("identity", {})[f"{name}@{n}"] = same
        if a.hf:
            tps = hf_generate(a.model, device, prompts, min(a.max_tokens, 64), loaded.dtype,
                              dummy_args=loaded.args if dummy else None)
            results[f"hf_generate@{n}"] = [{"aggregate_tps": tps}]
            print(f"N={n} hf_generate: {tps:.1f} tok/s")
        write_results(a, ns[:ns.index(n) + 1], names, results, loaded, device, backend)


if __name__ == "__main__":
    main()
