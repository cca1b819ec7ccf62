"""The engine's host time per decode window, with the device work stubbed out.

The verifier's window and prompt-chunk calls are replaced by stubs that return ready-made
results of the right shape (targets, accepted counts drawn at `--accept`, drafts), so what is
timed is everything the engine does on the host around them: planning and rotation, the graph
cache lookup, filling the window's inputs, reading back its rows, committing, emitting tokens,
the trace, finishing and admitting. On a GPU that time is spent while the device waits (a window
of the tiny model is about 0.5 ms on the H200; docs/BENCHMARKS.md, "Host time").

    python scripts/host_overhead.py --n 1,4,8 --window-rows 8,16 [--trace] [--profile 25] [--overlap]

`--bind N1,N2,...` times binding a burst of admissions instead (`ModelRunner.bind_lanes`: fresh
state, sampling parameters and prompts on the device), called repeatedly on bursts of that many
`--prompt`-token requests.

    python scripts/host_overhead.py --bind 1,4,8 --prompt 128
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from strata.config import EMBEDDED_MODEL_DIR, StrataConfig  # noqa: E402
from strata.engine.llm_engine import Engine  # noqa: E402
from strata.engine.request import Request, SamplingParams  # noqa: E402
from strata.kinds import FinishReason  # noqa: E402
from strata.model.loader import load_checkpoint  # noqa: E402
from strata.runner import run_requests  # noqa: E402


def stub_device(eng: Engine, accept: float, seed: int) -> None:
    """Replace the verifier's device work by results drawn on the host, ahead of time."""
    rng = np.random.default_rng(seed)
    vocab = eng.args.vocab_size
    pool = 4096  # results cycled through: drawing per call would be host work of the stub's own
    cache: dict = {}  # (groups, rows) -> [results, next index]

    def window(gs, gp, rows, g, ctx, filtered):
        n = gs.shape[0]
        key = (n, g)
        if key not in cache:
            y = rng.integers(1, vocab, (pool, n, g))
            acc = np.minimum(rng.geometric(1.0 - accept, (pool, n)) - 1, g - 1) if g > 1 \
                else np.zeros((pool, n), dtype=np.int64)
            draft = rng.integers(1, vocab, (pool, n, 1))
            cache[key] = [torch.from_numpy(np.concatenate([y, acc[..., None], draft], -1))
                          .to(torch.long), 0]
        res = cache[key]
        res[1] = (res[1] + 1) % pool
        return res[0][res[1]]

    def prefill(tokens, meta, ctx, filtered=True):
        # (S,): a final chunk's first token, else the prompt token after the chunk (meta[:, 3])
        given = (meta if meta.dim() == 2 else meta[None])[:, 3]
        drawn = torch.from_numpy(rng.integers(1, vocab, given.shape[0]))
        return torch.where(given >= 0, given, drawn)

    eng.runner.verifier.window = window
    eng.runner.verifier.prefill = prefill


def check_served(result: dict) -> None:
    """Exit with the reason when a run's requests failed (a stub out of step with the
    verifier's calls fails every request, and a run of no windows times nothing)."""
    failed = [r["id"] for r in result["requests"] if r["finish_reason"] == FinishReason.ERROR]
    if failed or not result["windows"]:
        sys.exit(f"host_overhead: {len(failed)} of {len(result['requests'])} requests failed and "
                 f"{result['windows']} windows ran: the stubs no longer match the verifier's "
                 f"window/prefill calls (strata/engine/verifier.py)")


def measure(loaded, n: int, window_rows: int, a) -> dict:
    ecfg = OmegaConf.structured(StrataConfig).engine
    ecfg.slots, ecfg.mode, ecfg.batch_mtp, ecfg.window_rows = max(n, 1), "batch", True, window_rows
    ecfg.max_context, ecfg.overlap = a.max_context, a.overlap
    with tempfile.TemporaryDirectory() as d:
        eng = Engine(loaded, ecfg, torch.device("cpu"), log=lambda s: None,
                     trace_path=Path(d) / "trace.jsonl" if a.trace else None)
        eng.trace.keep = False  # as a benchmark or server: events only go to the file, if any
        stub_device(eng, a.accept, a.seed)
        rng = np.random.default_rng(a.seed)

        def requests(tag: str):
            return [Request(f"{tag}{i}", rng.integers(1, eng.args.vocab_size, a.prompt).tolist(),
                            SamplingParams(max_tokens=a.max_tokens, stop_at_eos=False))
                    for i in range(n)]

        # warm: first-call costs are not the steady state
        check_served(run_requests(eng, requests("w")))
        w0, t0 = eng.windows, time.perf_counter()
        prof = cProfile.Profile() if a.profile else None
        if prof:
            prof.enable()
        for r in range(a.repeats):
            run_requests(eng, requests(f"r{r}_"))
            for rs in list(eng.requests.values()):
                eng.release(rs.id)
        if prof:
            prof.disable()
        wall = time.perf_counter() - t0
        windows = eng.windows - w0
        eng.close()
    if prof:
        print(f"--- N={n} W={window_rows}: top {a.profile} by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)
    return {"n": n, "window_rows": window_rows, "windows": windows,
            "us_per_window": 1e6 * wall / max(windows, 1)}


def measure_bind(loaded, n: int, a) -> float:
    """Median microseconds of one `bind_lanes` call binding a burst of `n` requests (warm)."""
    import types

    cfg = OmegaConf.structured(StrataConfig)
    cfg.device, cfg.model.path = "cpu", str(EMBEDDED_MODEL_DIR)
    cfg.engine.slots, cfg.engine.max_context = max(n, 1), a.max_context
    eng = Engine(loaded, cfg.engine, torch.device("cpu"), log=lambda s: None)
    slots = []
    for i in range(n):
        req = Request(f"r{i}", list(range(5, 5 + a.prompt)),
                      SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=i),
                      stream_text=False)
        slots.append(types.SimpleNamespace(id=i, req=types.SimpleNamespace(
            req=req, prompt_tensor=None, t_admit=None)))
    for _ in range(BIND_WARMUP_CALLS):
        eng.runner.bind_lanes(slots)
    times = []
    for _ in range(a.bind_calls):
        t0 = time.perf_counter()
        eng.runner.bind_lanes(slots)
        times.append(time.perf_counter() - t0)
    eng.close()
    return float(np.median(times)) * 1e6


#: Untimed binding calls before the timed ones.
BIND_WARMUP_CALLS = 50


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="1,4,8")
    ap.add_argument("--window-rows", default="8,16")
    ap.add_argument("--accept", type=float, default=0.65, help="chance a draft is accepted")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace", action="store_true", help="write a trace file, as a traced run does")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="print the K functions with the most own time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overlap", action="store_true",
                    help="engine.overlap: windows launched before the previous one is read")
    ap.add_argument("--bind", default="", metavar="N1,N2",
                    help="time binding bursts of these many admissions instead of windows")
    ap.add_argument("--bind-calls", type=int, default=500, help="timed calls per burst size")
    a = ap.parse_args()
    loaded = load_checkpoint(EMBEDDED_MODEL_DIR, "float32", torch.device("cpu"), log=lambda s: None)
    if a.bind:
        print("| requests in the burst | prompt tokens | host us per burst |")
        print("|---|---|---|")
        for n in (int(x) for x in a.bind.split(",")):
            print(f"| {n} | {a.prompt} | {measure_bind(loaded, n, a):.1f} |", flush=True)
        return
    print("| N | window_rows | windows | host us per window |")
    print("|---|---|---|---|")
    for n in (int(x) for x in a.n.split(",")):
        for w in (int(x) for x in a.window_rows.split(",")):
            r = measure(loaded, n, w, a)
            print(f"| {r['n']} | {r['window_rows']} | {r['windows']} | {r['us_per_window']:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
