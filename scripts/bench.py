"""Serving benchmark (DESIGN.md section 7) against the HTTP server, one server per configuration.

For every cell of the grid (prompt tokens P x output tokens O) and every N in --n, a cohort of N
distinct prompts is sent at once as streaming requests; each configuration runs the same
cohorts. Configurations, side by side in one run:

    solo        python -m strata.serve engine.mode=solo            (one request at a time, MTP)
    batch       python -m strata.serve engine.batch_mtp=false      (plain batch, one row per slot)
    batch_mtp   python -m strata.serve engine.batch_mtp=true       (grouped MTP in batch slots)
    hf          transformers generate() on the same checkpoint and prompts, batched at N
                (in-process, left padding, greedy, min_new_tokens = O)

Each server is started fresh (a subprocess on a loopback port), warmed, timed, and stopped;
then the configurations run again in reverse order, on fresh servers, as the control. Results:
JSON (every request), a markdown table (medians over --repeats), a PNG plot. docs/BENCH.md.

    python scripts/bench.py --device cuda --model /models/Qwen3-Next --n 1,2,4,8 \\
        --prompt-tokens 512,2048 --output-tokens 128,512 --repeats 3
    python scripts/bench.py --smoke          # a tiny CPU run on the embedded model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata.config import EMBEDDED_MODEL_DIR  # noqa: E402
from strata.metrics import RequestTimes, ratio  # noqa: E402
from strata.metrics import request_metrics as metrics_of  # noqa: E402
from strata.serve.metrics import parse_metrics  # noqa: E402
from prompt_material import CODE_PROMPTS, prompt_texts  # noqa: E402

SERVER_CONFIGS = {
    "solo": ["engine.mode=solo", "engine.batch_mtp=false"],
    "batch": ["engine.mode=batch", "engine.batch_mtp=false"],
    "batch_mtp": ["engine.mode=batch", "engine.batch_mtp=true"],
}
ALL_CONFIGS = ["solo", "batch", "batch_mtp", "hf"]


# ------------------------------------------------------------------------------------- prompts

def corpus_ids(tokenizer: Any, need: int) -> list[int]:
    """Token ids of the shipped prompt material (scripts/prompt_material.py: standard-library
    source excerpts, the same on every machine), at least `need`."""
    ids: list[int] = []
    for text in prompt_texts():
        ids.extend(tokenizer.encode(text))
        if len(ids) >= need:
            return ids
    raise SystemExit(f"error: not enough prompt material in {CODE_PROMPTS.name} "
                     f"({len(ids)} of {need} tokens)")


def make_prompts(tokenizer: Any, n_max: int, p_max: int, eos: set[int]) -> list[list[int]]:
    """n_max distinct prompts of p_max tokens (shorter cells take prefixes); no EOS ids inside."""
    stride = p_max + 97
    ids = [t for t in corpus_ids(tokenizer, n_max * stride + p_max) if t not in eos]
    return [ids[i * stride: i * stride + p_max] for i in range(n_max)]


# ------------------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m strata.serve` in its own session on a loopback port."""

    def __init__(self, name: str, overrides: list[str], run_dir: Path, start_timeout: float):
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = run_dir / "server.log"
        self.cmd = [sys.executable, "-m", "strata.serve", "server.host=127.0.0.1",
                    f"server.port={self.port}", f"hydra.run.dir={run_dir}", *overrides]
        env = {k: v for k, v in os.environ.items() if k != "STRATA_BATCH_MTP"}
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        t_end = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {name} exited ({self.proc.returncode}); see "
                                   f"{self.log_path}:\n{self.tail()}")
            try:
                r = httpx.get(self.base + "/health", timeout=5)
                if r.status_code == 200:
                    self.info = r.json()
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > t_end:
                self.stop()
                raise RuntimeError(f"server {name} not ready after {start_timeout} s:\n{self.tail()}")
            time.sleep(0.25)

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def metrics(self) -> dict[str, float]:
        try:
            return parse_metrics(httpx.get(self.base + "/metrics", timeout=10).text)
        except httpx.HTTPError:
            return {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the session we started (engine included)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)
        self.log.close()


# ------------------------------------------------------------------------------------- cohorts

async def one_request(client: httpx.AsyncClient, base: str, prompt: list[int], out_tokens: int,
                      start: asyncio.Event) -> dict:
    body = {"prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    await start.wait()
    rec: dict = {"prompt_tokens": len(prompt), "t_send": time.perf_counter(), "t_first": None,
                 "t_last": None, "n_first": 0, "n_out": 0, "text": "", "error": None,
                 "timings": None, "finish_reason": None}
    try:
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                now = time.perf_counter()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    rec["error"] = ev["error"].get("message")
                    continue
                if ev.get("timings"):
                    rec["timings"] = ev["timings"]
                if ev.get("choices"):
                    ch = ev["choices"][0]
                    rec["text"] += ch.get("text") or ""
                    rec["finish_reason"] = ch.get("finish_reason") or rec["finish_reason"]
                u = ev.get("usage")
                if u:
                    n = u["completion_tokens"]
                    if n > rec["n_out"]:
                        if rec["t_first"] is None:
                            rec["t_first"], rec["n_first"] = now, n
                        rec["t_last"] = now
                        rec["n_out"] = n
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["t_end"] = time.perf_counter()
    return rec


async def run_cohort_async(base: str, prompts: list[list[int]], out_tokens: int,
                           timeout: float) -> list[dict]:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = asyncio.Event()
        tasks = [asyncio.create_task(one_request(client, base, p, out_tokens, start)) for p in prompts]
        await asyncio.sleep(0.01)
        start.set()
        return list(await asyncio.gather(*tasks))


def request_metrics(rec: dict, cohort: list[dict]) -> dict:
    """PP, TG, E2E of one streamed request (strata.metrics' definitions, on the client's
    clock: arrival = send; `n_first` tokens came with the first chunk)."""
    t = rec.get("timings") or {}
    times = RequestTimes("", rec["prompt_tokens"], rec["n_out"], rec["t_send"],
                         first=rec["t_first"], last=rec["t_last"], finish=rec["t_end"],
                         prefill_s=t.get("prefill_s") or 0.0, first_tokens=rec["n_first"])
    full = metrics_of(times)
    m = {k: full[k] for k in ("ttft_s", "e2e_s", "output_tokens", "prompt_tokens", "tg_tps",
                              "e2e_tps", "pp_tps")}
    m["error"] = rec["error"]
    if t.get("prefill_s"):
        m["pp_source"], m["queue_s"] = "engine", t.get("queue_s")
    elif rec["t_first"] is not None:
        # Approximation: the request waited in the queue until the last other request of its
        # cohort that finished before its first token (slots free up when requests finish).
        before = [o["t_end"] for o in cohort if o is not rec and o["t_end"] < rec["t_first"]]
        start = max([rec["t_send"], *before])
        m["queue_s"] = start - rec["t_send"]
        m["pp_tps"], m["pp_source"] = ratio(rec["prompt_tokens"], rec["t_first"] - start), "approx"
    else:
        m["pp_tps"], m["pp_source"], m["queue_s"] = None, None, None
    return m


def cohort_summary(reqs: list[dict], wall: float) -> dict:
    def med(key: str) -> Optional[float]:
        vals = [r[key] for r in reqs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    ttfts = [r["ttft_s"] for r in reqs if r.get("ttft_s") is not None]
    total = sum(r["output_tokens"] for r in reqs)
    return {"pp_tps": med("pp_tps"), "tg_tps": med("tg_tps"), "e2e_tps": med("e2e_tps"),
            "aggregate_tps": ratio(total, wall), "wall_s": wall, "output_tokens": total,
            "ttft_max_s": max(ttfts) if ttfts else None, "ttft_med_s": med("ttft_s"),
            "errors": sum(1 for r in reqs if r.get("error"))}


def server_cohort(server: Server, prompts: list[list[int]], out_tokens: int, timeout: float) -> dict:
    recs = asyncio.run(run_cohort_async(server.base, prompts, out_tokens, timeout))
    wall = max(r["t_end"] for r in recs) - min(r["t_send"] for r in recs)
    reqs = [request_metrics(r, recs) for r in recs]
    return {"summary": cohort_summary(reqs, wall), "requests": reqs,
            "texts": [r["text"] for r in recs]}


# ------------------------------------------------------------------------------------- peer

class HFPeer:
    """transformers' generate() on the same checkpoint, batched at N with left padding."""

    def __init__(self, model_path: str, device: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = torch.device(device)
        dt = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}[dtype]
        if dt is None:
            dt = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dt).to(self.device).eval()
        self.pad = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def generate(self, prompts: list[list[int]], out_tokens: int) -> tuple[list[float], list]:
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch
        times: list[float] = []
        sync = self._sync

        class Clock(BaseStreamer):
            def put(self, value):  # first call: the prompt; then one call per new token
                sync()
                times.append(time.perf_counter())

            def end(self):
                pass

        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_tokens,
                                      min_new_tokens=out_tokens, do_sample=False,
                                      pad_token_id=self.pad, streamer=Clock())
        sync()
        t_end = time.perf_counter()
        return [t0, *times[1:], t_end], out[:, width:].tolist()

    def cohort(self, prompts: list[list[int]], out_tokens: int, tokenizer: Any) -> dict:
        stamps, toks = self.generate(prompts, out_tokens)
        t0, t_end = stamps[0], stamps[-1]
        t_first, t_last = stamps[1], stamps[-2]
        n = len(prompts)
        wall = t_end - t0
        reqs = []
        for p, out in zip(prompts, toks):
            reqs.append({"prompt_tokens": len(p), "output_tokens": len(out), "ttft_s": t_first - t0,
                         "e2e_s": wall, "queue_s": 0.0, "error": None, "pp_source": "batch",
                         # the whole batch prefills together: PP counts every prompt's tokens
                         "pp_tps": sum(len(q) for q in prompts) / (t_first - t0),
                         "tg_tps": ratio(len(out) - 1, t_last - t_first) if t_last > t_first else None,
                         "e2e_tps": len(out) / wall})
        texts = [tokenizer.decode(t) for t in toks]
        return {"summary": cohort_summary(reqs, wall), "requests": reqs, "texts": texts,
                "batch": n}

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------- report

def environment(args: argparse.Namespace) -> dict:
    import torch

    env: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "python": platform.python_version(),
                 "platform": platform.platform(), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "args": vars(args)}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env["cpu_count"] = os.cpu_count()
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            env["nvidia_smi"] = q.stdout.strip()
            env["driver"] = q.stdout.strip().splitlines()[0].split(",")[1].strip() if q.stdout else None
        except (OSError, subprocess.SubprocessError, IndexError):
            env["driver"] = None
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT,
                                  timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    from provenance import commit_id

    env["commit"] = commit_id(short=False)
    env["dirty"] = env["commit"].endswith("+dirty")
    return env


def fmt(v: Optional[float], nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def markdown(res: dict) -> str:
    cfgs, passes = res["configs"], res["passes"]
    out = ["# strata serving benchmark", ""]
    e = res["env"]
    out.append(f"- date {e['date']}; commit `{e['commit'][:12]}`{' (dirty)' if e['dirty'] else ''}; "
               f"torch {e['torch']} (CUDA {e['cuda']}); transformers {e.get('transformers')}")
    out.append(f"- device: {e.get('gpu') or e.get('cpu')}" + (f"; driver {e['driver']}" if e.get("driver") else ""))
    out.append(f"- model `{res['model']}`; repeats {res['repeats']} (median); "
               f"reverse-order control repeats {res['reverse_repeats']}; warmup {res['warmup']}")
    out.append("- PP = prompt tokens / engine prefill time (hf: batch prompt tokens / time to first "
               "token); TG = tokens after the first / first-to-last streamed token; E2E = tokens / "
               "request wall time incl. queueing; Agg = cohort tokens / cohort wall time. t/s; "
               "medians over requests, then over repeats. TTFTmax = slowest first token (s).")
    out.append("")
    for pi, pname in enumerate(passes):
        out.append(f"## {'Main pass' if pi == 0 else 'Reverse-order control'}: "
                   f"{' -> '.join(res['orders'][pi])}")
        out.append("")
        out.append("| P | O | N | config | PP | TG | E2E | Agg | TTFTmax | Agg vs solo | same text as solo |")
        out.append("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
        for cell in res["cells"]:
            key = f"{cell['P']}x{cell['O']}x{cell['N']}"
            base = res["summary"].get(pname, {}).get("solo", {}).get(key, {})
            for c in cfgs:
                s = res["summary"].get(pname, {}).get(c, {}).get(key)
                if not s:
                    continue
                same = res["identity"].get(pname, {}).get(c, {}).get(key)
                out.append(f"| {cell['P']} | {cell['O']} | {cell['N']} | {c} | {fmt(s['pp_tps'])} | "
                           f"{fmt(s['tg_tps'])} | {fmt(s['e2e_tps'])} | {fmt(s['aggregate_tps'])} | "
                           f"{fmt(s['ttft_max_s'], 2)} | "
                           f"{fmt(ratio(s['aggregate_tps'], base.get('aggregate_tps')), 2)} | "
                           f"{'-' if same is None else ('yes' if same else 'NO')} |")
        out.append("")
    if res.get("errors"):
        out.append("## Errors")
        out.extend(f"- {x}" for x in res["errors"][:50])
        out.append("")
    return "\n".join(out)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(c["P"], c["O"]) for c in res["cells"]})
    metrics = [("aggregate_tps", "aggregate tok/s"), ("e2e_tps", "E2E tok/s per stream"),
               ("ttft_max_s", "slowest TTFT (s)")]
    fig, axes = plt.subplots(len(metrics), len(cells), figsize=(4.2 * len(cells), 3.2 * len(metrics)),
                             squeeze=False)
    pname = res["passes"][0]
    for j, (P, O) in enumerate(cells):
        for i, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            for c in res["configs"]:
                pts = []
                for cell in res["cells"]:
                    if (cell["P"], cell["O"]) != (P, O):
                        continue
                    s = res["summary"].get(pname, {}).get(c, {}).get(f"{P}x{O}x{cell['N']}")
                    if s and s.get(key) is not None:
                        pts.append((cell["N"], s[key]))
                if pts:
                    pts.sort()
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests N")
            ax.set_ylabel(label)
            if i == 0:
                ax.set_title(f"prompt {P} / output {O}")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"strata serving benchmark ({res['env'].get('gpu') or res['env'].get('cpu') or ''})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------- main

def parse_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL_DIR, help="checkpoint dir (default: embedded tiny)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda (servers and the hf peer)")
    ap.add_argument("--dtype", default="auto", help="model.dtype for the servers and the peer")
    ap.add_argument("--n", default="1,2,4,8", help="concurrent requests per cohort")
    ap.add_argument("--prompt-tokens", default="512", help="prompt lengths (list)")
    ap.add_argument("--output-tokens", default="128", help="output lengths (list)")
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS), help="subset/order of " + ",".join(ALL_CONFIGS))
    ap.add_argument("--repeats", type=int, default=3, help="timed cohorts per cell (median)")
    ap.add_argument("--reverse-repeats", type=int, default=1,
                    help="repeats of the reverse-order control pass (0: no control pass)")
    ap.add_argument("--warmup", choices=("full", "short", "none"), default="full",
                    help="untimed cohort per cell before timing: same shape, 8 output tokens, or none")
    ap.add_argument("--slots", type=int, default=0, help="engine.slots (default: the largest N)")
    ap.add_argument("--spec", type=int, default=4, help="engine.spec")
    ap.add_argument("--max-context", type=int, default=0,
                    help="engine.max_context (default: largest P + largest O + 64)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Hydra override for every server (repeatable), e.g. --set backend=cuda")
    ap.add_argument("--out", default="", help="output dir (default: outputs/bench/<date-time>)")
    ap.add_argument("--timeout", type=float, default=1800, help="per-request timeout (s)")
    ap.add_argument("--start-timeout", type=float, default=900, help="server start timeout (s)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny CPU run: --device cpu --n 1,2 --prompt-tokens 16 --output-tokens 8 "
                         "--repeats 1 --warmup short")
    a = ap.parse_args()
    if a.smoke:
        a.device, a.n, a.prompt_tokens, a.output_tokens = "cpu", "1,2", "16", "8"
        a.repeats, a.warmup = 1, "short"

    import torch
    from tqdm import tqdm

    from strata.model.tokenizer import Tokenizer

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    ns, ps, os_ = parse_list(a.n), parse_list(a.prompt_tokens), parse_list(a.output_tokens)
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    for c in configs:
        if c not in ALL_CONFIGS:
            ap.error(f"--configs: unknown configuration {c!r} (choose from {ALL_CONFIGS})")
    if a.repeats < 1 or not ns or not ps or not os_ or min(ns + ps + os_) < 1:
        ap.error("--repeats, --n, --prompt-tokens and --output-tokens must be positive")
    out_dir = Path(a.out or ROOT / "outputs" / "bench" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if os.environ.get("STRATA_BATCH_MTP"):
        print("note: STRATA_BATCH_MTP is set here; the servers run without it (configs decide)")

    tok = Tokenizer.from_dir(a.model)
    prompts_all = make_prompts(tok, max(ns), max(ps), set(tok.eos_ids))
    max_ctx = a.max_context or (max(ps) + max(os_) + 64)
    common = [f"device={a.device}", f"model.path={a.model}", f"model.dtype={a.dtype}",
              f"engine.slots={a.slots or max(ns)}", f"engine.spec={a.spec}",
              f"engine.max_context={max_ctx}", f"server.max_pending={4 * max(ns) + 16}",
              f"server.queue_timeout_s={a.timeout}", "server.log_level=warning", *a.set]
    cells = [{"P": p, "O": o, "N": n} for p in ps for o in os_ for n in ns]
    orders = [configs] + ([configs[::-1]] if a.reverse_repeats > 0 else [])
    passes = ["main"] + (["reverse"] if a.reverse_repeats > 0 else [])
    res: dict = {"env": environment(a), "model": a.model, "configs": configs, "cells": cells,
                 "orders": orders, "passes": passes, "repeats": a.repeats,
                 "reverse_repeats": a.reverse_repeats, "warmup": a.warmup, "common_overrides": common,
                 "runs": [], "summary": {}, "identity": {}, "errors": [], "servers": {}}
    total = sum(len(cells) * (a.repeats if pi == 0 else a.reverse_repeats) * len(order)
                for pi, order in enumerate(orders))
    bar = tqdm(total=total, unit="cohort", disable=a.no_progress, dynamic_ncols=True)

    def save() -> None:
        (out_dir / "results.json").write_text(json.dumps(res, indent=1))

    try:
        for pi, (pname, order) in enumerate(zip(passes, orders)):
            reps = a.repeats if pi == 0 else a.reverse_repeats
            for c in order:
                bar.set_description(f"{pname}: {c} (starting)")
                server = peer = None
                try:
                    if c == "hf":
                        peer = HFPeer(a.model, a.device, a.dtype)
                    else:
                        server = Server(c, common + SERVER_CONFIGS[c],
                                        out_dir / "servers" / f"{pi}-{c}", a.start_timeout)
                        res["servers"][f"{pname}/{c}"] = server.info
                except Exception as e:  # a configuration that cannot start is reported, not fatal
                    res["errors"].append(f"{pname}/{c}: cannot start: {e}")
                    bar.update(len(cells) * reps)
                    continue
                try:
                    for cell in cells:
                        prompts = [p[:cell["P"]] for p in prompts_all[:cell["N"]]]
                        key = f"{cell['P']}x{cell['O']}x{cell['N']}"
                        bar.set_description(f"{pname}: {c} P={cell['P']} O={cell['O']} N={cell['N']}")

                        def cohort(o: int) -> dict:
                            if peer is not None:
                                return peer.cohort(prompts, o, tok)
                            return server_cohort(server, prompts, o, a.timeout)

                        if a.warmup != "none":
                            cohort(cell["O"] if a.warmup == "full" else min(8, cell["O"]))
                        runs = []
                        for rep in range(reps):
                            r = cohort(cell["O"])
                            r.update(pass_=pname, config=c, rep=rep, **cell)
                            if r["summary"]["errors"]:
                                errs = [q["error"] for q in r["requests"] if q.get("error")]
                                res["errors"].append(f"{pname}/{c}/{key}/rep{rep}: {errs[0]}")
                            runs.append(r)
                            res["runs"].append({k: v for k, v in r.items() if k != "texts"})
                            bar.update(1)
                        summ = {k: statistics.median([r["summary"][k] for r in runs
                                                      if r["summary"].get(k) is not None] or [None])
                                if k != "errors" else sum(r["summary"]["errors"] for r in runs)
                                for k in runs[0]["summary"]}
                        res["summary"].setdefault(pname, {}).setdefault(c, {})[key] = summ
                        res.setdefault("_texts", {}).setdefault(pname, {}).setdefault(c, {})[key] = runs[0]["texts"]
                        save()
                    if server is not None:
                        res["servers"][f"{pname}/{c}"]["metrics"] = {
                            k: v for k, v in server.metrics().items()
                            if k.startswith(("strata_draft_acceptance_rate", "strata_graph_",
                                             "strata_slots", "strata_engine_restarts_total"))}
                finally:
                    if server is not None:
                        server.stop()
                    if peer is not None:
                        peer.close()
    finally:
        bar.close()
        texts = res.pop("_texts", {})
        for pname, by_cfg in texts.items():           # greedy identity vs solo, same cohort
            ref = by_cfg.get("solo", {})
            for c, by_key in by_cfg.items():
                for key, t in by_key.items():
                    if key in ref:
                        res["identity"].setdefault(pname, {}).setdefault(c, {})[key] = t == ref[key]
        save()
        md = markdown(res)
        (out_dir / "results.md").write_text(md + "\n")
        print(md)
        if not a.no_plot and res["summary"]:
            plot(res, out_dir / "bench.png")
        print(f"\nwrote {out_dir / 'results.json'}, {out_dir / 'results.md'}"
              + ("" if a.no_plot else f", {out_dir / 'bench.png'}"))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
