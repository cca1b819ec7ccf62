"""Time decode windows (and with --prefill prompt chunks) three ways (eager, graph replay, replay
+ host step) and show where a window's device time goes: the kernels of one graph replay (count, busy time against the
replay's wall time), and every kernel attributed to the region of the model that launched it
(each layer kind's regions, the head, the samplers), per layer of the kind.

    python scripts/profile_window.py --device cuda --groups 1 --rows 4
    python scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 \
        --backend auto --compile --shapes 1x2,4x2 --json prof.json
    python scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy \
        --backend auto --compile --shapes 1x2 --prefill 64 --json prof.json

--compile compiles the regions the way the engine does (strata.engine.compiling); several
--shapes run in one process in the given order, as an engine's warm-up would compile them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from strata.config import DRAFT_HEADS, EMBEDDED_MODEL_DIR  # noqa: E402
from strata.engine.compiling import deterministic_default, inductor_pdl  # noqa: E402
from strata.engine.draft_vocab import draft_head  # noqa: E402
from strata.engine.verifier import SlotBuffers, Verifier  # noqa: E402
from strata.kernels import ops  # noqa: E402
from strata.model.loader import FP8_DENSE, load_checkpoint  # noqa: E402
from strata.model.state import DecodeState  # noqa: E402

#: The per-layer regions that attribution labels: (attribute, label suffix).
LAYER_REGIONS = ("c_linear", "c_attn_pre", "c_attn_post")


def parse_shapes(a) -> list[tuple[int, int]]:
    if not a.shapes:
        return [(a.groups, a.rows)]
    out = []
    for s in a.shapes.split(","):
        g, r = s.lower().split("x")
        out.append((int(g), int(r)))
    return out


def short(name: str, n: int = 90) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


class Attribution:
    """Wraps the model's regions so that each call synchronises before and after itself inside
    a profiler range named after the region; a kernel then belongs to the range whose host
    interval holds its start (kineto puts host and device times on one clock)."""

    def __init__(self, model, verifier):
        self.saved = []
        self.layer_count = defaultdict(int)
        for layer in list(model.layers) + ([model.mtp.layers[0]] if model.mtp is not None else []):
            mtp = model.mtp is not None and layer is model.mtp.layers[0]
            kind = "mtp" if mtp else ("linear" if layer.kind == "linear_attention" else "full")
            self.layer_count[kind] += 1
            for attr in LAYER_REGIONS:
                if attr in layer.__dict__:
                    self._wrap(layer, attr, f"{kind}:{attr[2:]}")
            self._wrap_method(layer, "window_attention", f"{kind}:attention(all)")
        for attr, label in (("c_head", "head:norm+lm_head"), ("c_rope", "rope"),
                            ("c_mtp_fuse", "mtp:fuse"), ("c_mtp_norm", "mtp:norm")):
            if attr in model.__dict__ or hasattr(model, attr):
                self._wrap(model, attr, label)
        for attr, label in (("draft_logits", "draft lm_head"),
                            ("sample", "sampler(filtered)"), ("sample_plain", "sampler(plain)"),
                            ("accepted_prefix", "accept"), ("synthetic_window", "accept")):
            self._wrap(verifier, attr, label)
        self._wrap(ops, "write_kv", "write_kv")
        self._wrap(ops, "chunk_gated_delta", "chunk rule (prefill)")
        self._wrap(ops, "commit_accepted", "commit")

    def _wrap(self, obj, attr, label):
        orig = getattr(obj, attr)
        self.saved.append((obj, attr, obj.__dict__.get(attr, None), attr in obj.__dict__))

        def wrapped(*args, **kw):
            torch.cuda.synchronize()
            with torch.profiler.record_function("@" + label):
                out = orig(*args, **kw)
                torch.cuda.synchronize()
            return out

        setattr(obj, attr, wrapped)

    def _wrap_method(self, obj, attr, label):
        self._wrap(obj, attr, label)

    def restore(self):
        for obj, attr, val, had in reversed(self.saved):
            if had:
                setattr(obj, attr, val)
            else:
                delattr(obj, attr)


def attribute(prof) -> dict:
    """{label: {kernel name: [count, us]}} with the innermost enclosing range winning."""
    evs = prof.events()
    ranges = [(e.time_range.start, e.time_range.end, e.name[1:]) for e in evs
              if e.device_type.name == "CPU" and e.name.startswith("@")]
    ranges.sort(key=lambda r: r[1] - r[0])  # innermost first
    out: dict = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for e in evs:
        if e.device_type.name != "CUDA" or e.name.startswith("@"):
            continue  # (the ranges themselves also appear on the device timeline)
        t = e.time_range.start
        label = next((r[2] for r in ranges if r[0] <= t <= r[1]), "other")
        cell = out[label][e.name]
        cell[0] += 1
        cell[1] += e.time_range.end - e.time_range.start
    return out


def measure(fn, title: str, res: dict, a, lm, ver, dev) -> dict:
    """Time `fn` (a window or a prompt chunk) eagerly, then on the GPU as one CUDA graph: its
    replay, replay + readback, the kernels of a replay and each region's kernels (one
    uncaptured call with synchronising region wrappers). Returns `res` with the figures."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    sync()
    warm = time.perf_counter() - t0
    iters = max(a.iters // 4, 5) if a.compile else a.iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    eager = (time.perf_counter() - t0) / iters
    print(f"\n=== {title}: warm-up {warm:.1f} s; eager {eager * 1e6:.1f} us")
    res = {**res, "warmup_s": warm, "eager_us": eager * 1e6}
    if dev.type != "cuda":
        return res
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g, stream=s):
        out = fn()
    for _ in range(5):
        g.replay()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        g.replay()
    sync()
    rep = (time.perf_counter() - t0) / a.iters
    t0 = time.perf_counter()
    for _ in range(a.iters):
        g.replay()
        out.tolist()
    per = (time.perf_counter() - t0) / a.iters
    print(f"graph replay: {rep * 1e6:.1f} us; replay + readback: {per * 1e6:.1f} us; "
          f"speedup vs eager {eager / rep:.1f}x")
    res.update(replay_us=rep * 1e6, replay_readback_us=per * 1e6)
    from torch.profiler import ProfilerActivity, profile

    n_rep = 5
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(n_rep):
            g.replay()
        sync()
    if a.trace:
        prof.export_chrome_trace(a.trace)
    kern = [e for e in prof.events()
            if e.device_type.name == "CUDA" and not e.name.startswith("@")]
    busy = sum(e.time_range.end - e.time_range.start for e in kern) / n_rep
    by = defaultdict(lambda: [0, 0.0])
    for e in kern:
        by[e.name][0] += 1
        by[e.name][1] += e.time_range.end - e.time_range.start
    print(f"graph replay kernels: {len(kern) / n_rep:.0f} per window, busy {busy:.1f} us of "
          f"{rep * 1e6:.1f} us ({100 * busy / (rep * 1e6):.0f}%; the rest is gaps between kernels)")
    top = sorted(by.items(), key=lambda kv: -kv[1][1])
    # A programmatic dependent starts before the kernel it depends on ends and waits for it, so
    # its time here includes that wait (busy above 100%); the regions below are timed with
    # synchronising wrappers and hold only each kernel's own work.
    print(f"{'us/window':>10} {'n':>5}  kernel (graph replay; a dependent's time includes its "
          f"wait for the kernel before it)")
    for name, (c, t) in top[: a.top]:
        print(f"{t / n_rep:10.1f} {c / n_rep:5.0f}  {short(name)}")
    res.update(replay_kernels=len(kern) / n_rep, replay_busy_us=busy,
               replay_by_kernel=[{"name": k, "count": c / n_rep, "us": round(t / n_rep, 2)}
                                 for k, (c, t) in top])
    # attribution: one window with synchronising region wrappers (not captured)
    att = Attribution(lm.model, ver)
    try:
        fn()
        sync()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof2:
            fn()
            sync()
        table = attribute(prof2)
    except Exception as exc:  # keep the replay figures when attribution fails
        import traceback

        traceback.print_exc()
        print(f"attribution failed: {exc!r}")
        table = {}
    finally:
        att.restore()
    per_kind = dict(att.layer_count)
    print(f"\nby region (one window; per-layer figures divide by the layers of the kind: {per_kind})")
    print(f"{'region':28} {'kernels':>8} {'us':>9} {'per layer: n':>13} {'us':>8}")
    regions = []
    for label, kernels in sorted(table.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())):
        n = sum(v[0] for v in kernels.values())
        t = sum(v[1] for v in kernels.values())
        kind = label.split(":")[0]
        div = per_kind.get(kind, 1)
        print(f"{label:28} {n:8d} {t:9.1f} {n / div:13.1f} {t / div:8.1f}")
        regions.append({"region": label, "kernels": n, "us": round(t, 2), "layers": div,
                        "by_kernel": sorted(([k, v[0], round(v[1], 2)] for k, v in kernels.items()),
                                            key=lambda r: -r[2])})
    for r in regions[:6]:
        print(f"  -- {r['region']}: top kernels")
        for k, c, t in r["by_kernel"][:8]:
            print(f"     {t:8.1f} us {c:4d}x  {short(k, 80)}")
    res["regions"] = regions
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=EMBEDDED_MODEL_DIR)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--shapes", default=None, help="window shapes GxR, comma-separated (e.g. 1x2,4x2)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--trace", default=None, help="write a chrome trace of one graph replay")
    ap.add_argument("--compile", action="store_true", help="torch.compile the window regions")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto", help="model.load_format: auto, safetensors or dummy")
    ap.add_argument("--layers", type=int, default=None, help="model.num_layers (dummy weights only)")
    ap.add_argument("--fp8-dense", default="windows", choices=FP8_DENSE,
                    help="model.fp8_dense: FP8 checkpoints' dense layers")
    ap.add_argument("--prefill", default=None,
                    help="also prompt chunks of these token counts (comma-separated, e.g. 64): "
                         "one final chunk on lane 0 from position 0, as the engine's prefill")
    ap.add_argument("--prefill-slots", type=int, default=1,
                    help="with --prefill: each prompt chunk holds this many slots' chunks of that "
                         "many tokens (lanes 0..S-1, distinct tokens), as engine.prefill_slots "
                         "puts them in one chunk")
    ap.add_argument("--json", default=None, help="write every kernel's count and time here")
    ap.add_argument("--filtered", action="store_true",
                    help="use the top-k/top-p (sorting) sampler instead of the sort-free one")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per table")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="engine.draft_vocab: drafts choose among the lowest K token ids (0: all)")
    ap.add_argument("--draft-head", choices=DRAFT_HEADS, default="model",
                    help="engine.draft_head: fp8 drafts from an FP8 copy of the LM head")
    ap.add_argument("--kernel-options", default="",
                    help="GPU launch switches NAME=0|1 or a count, as bench_engine.py takes them "
                         "(e.g. l2_prefetch=2)")
    a = ap.parse_args()
    if a.prefill_slots < 1:
        ap.error(f"--prefill-slots must be >= 1, got {a.prefill_slots}")
    from bench_engine import set_kernel_options

    options = set_kernel_options(a.kernel_options)
    dev = torch.device(a.device)
    ops.set_backend(a.backend, dev.type)
    t0 = time.perf_counter()
    lm = load_checkpoint(a.model, a.dtype, dev, log=lambda s: None, load_format=a.load_format,
                         num_layers=a.layers, fp8_dense=a.fp8_dense)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; backend: {ops.implementations()}")
    shapes = parse_shapes(a)
    lanes = max(max(g for g, _ in shapes), a.prefill_slots if a.prefill else 1)
    state = DecodeState(lm.args, lanes, 2048, lm.dtype, dev, lm.has_mtp, spare_rows=16)
    bufs = SlotBuffers(lanes, lm.args.hidden_size, lm.dtype, dev)
    # distinct tokens and MTP states per lane, so that the groups of a window route to different
    # experts as the engine's requests do (zeroed buffers gave every group the same inputs, the
    # same routes, and a MoE layer reading one group's experts)
    gen = torch.Generator(device=dev).manual_seed(0)
    bufs.pending[:lanes] = torch.randint(1, lm.args.vocab_size, (lanes,), device=dev, generator=gen)
    bufs.draft[:lanes] = torch.randint(1, lm.args.vocab_size, (lanes,), device=dev, generator=gen)
    bufs.mtp_h[:lanes] = torch.randn(lanes, lm.args.hidden_size, device=dev, generator=gen).to(lm.dtype)
    functions = None
    if a.compile:
        from strata.engine.compiling import compiled_functions

        functions = compiled_functions(lm.model, dev)
    draft_ids, head = draft_head(lm.model, SimpleNamespace(draft_vocab=a.draft_vocab,
                                                           draft_vocab_file=None,
                                                           draft_head=a.draft_head),
                                 lm.args.eos_token_id)
    ver = Verifier(lm.model, state, bufs, lm.has_mtp, functions=functions,
                   draft_ids=draft_ids, draft_head=head)
    report = {"model": str(a.model), "layers": a.layers, "compile": a.compile, "ctx": a.ctx,
              "torch": torch.__version__, "shapes": [],
              "pdl": inductor_pdl(), "inductor_deterministic": deterministic_default(),
              "kernel_options": options, "draft_vocab": a.draft_vocab,
              "draft_head": a.draft_head}
    for groups, rows_per in shapes:
        gs = torch.arange(groups, device=dev)
        gp = torch.full((groups,), 100, device=dev)
        rows = torch.full((groups,), rows_per, device=dev)

        def fn():
            gp.fill_(100)  # keep positions fixed so every iteration is the same work
            return ver.window(gs, gp, rows, rows_per, a.ctx, a.filtered)

        title = f"window {groups}x{rows_per} (ctx {a.ctx}, filtered={a.filtered}, compile={a.compile})"
        report["shapes"].append(measure(fn, title, {"groups": groups, "rows": rows_per}, a, lm,
                                        ver, dev))
    for tokens in [int(t) for t in a.prefill.split(",")] if a.prefill else []:
        slots = a.prefill_slots
        chunk = torch.randint(1, lm.args.vocab_size, (slots, tokens), device=dev)
        # lanes 0..S-1 from position 0, every token real, the final chunk (samples and drafts)
        meta = torch.tensor([[lane, 0, tokens, -1] for lane in range(slots)], device=dev)
        if slots == 1:  # one lane's chunk, as the engine passes it
            chunk, meta = chunk[0], meta[0]

        def fn_prefill():
            return ver.prefill(chunk, meta, a.ctx, a.filtered)

        title = (f"prompt chunk of {tokens} tokens" + (f" x {slots} slots" if slots > 1 else "")
                 + f" (ctx {a.ctx}, compile={a.compile}, filtered={a.filtered})")
        report.setdefault("prefill", []).append(
            measure(fn_prefill, title, {"tokens": tokens, "slots": slots}, a, lm, ver, dev))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
