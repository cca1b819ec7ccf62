#!/usr/bin/env python3
"""Evaluate a qwen3_next checkpoint on held-out Python code: perplexity and MTP acceptance.

    python3 scripts/eval_acceptance.py [--model DIR] [--files F.py ...] [--json OUT.json]

Measures, on held-out source files (by default the held-out split of this interpreter's standard
library, the same rule scripts/train_tiny.py trains with):
  1. perplexity and next-token accuracy of the main model;
  2. greedy MTP acceptance, teacher-forced: the fraction of positions i where the MTP's greedy
     draft for t[i+2] (from h[i] and the true t[i+1]) equals the main model's greedy prediction
     for t[i+2] (from the true prefix): the chance that a batch_mtp draft is accepted under
     greedy decoding;
  3. speculative greedy decoding with chained MTP drafts (spec = verify rows per window, as
     `engine.spec`), run through the model's cached window path (prefill, verify_window,
     commit_accepted, mtp_window): accepted drafts per window, per-depth acceptance, and
     whether the output equals plain greedy decoding;
and prints a few greedy continuations of code prompts. Runs on CPU and CUDA.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from strata.config import EMBEDDED_MODEL_DIR
from strata.kernels import ops
from strata.model.loader import LoadedModel, load_checkpoint
from strata.model.qwen3_next import Qwen3Next
from strata.model.state import DecodeState

DEFAULT_MODEL = Path(EMBEDDED_MODEL_DIR)
HELDOUT_PER_MILLE = 30  # 3% of files
SPLIT_RULE = ("a file is held out when int(sha1(relative_posix_path).hexdigest()[:8], 16) % 1000 "
              f"< {HELDOUT_PER_MILLE}, the path taken relative to the stdlib directory")
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n        return",
    "for i in range(len(",
    "try:\n    import",
]


# ---- data ------------------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_heldout(rel: str) -> bool:
    """The deterministic held-out split: ~3% of files, by a hash of the relative path."""
    return int(hashlib.sha1(rel.encode("utf-8")).hexdigest()[:8], 16) % 1000 < HELDOUT_PER_MILLE


def stdlib_files(root: Optional[Path] = None) -> list[tuple[str, Path]]:
    """All *.py files of the standard library (test suite included, site-packages excluded),
    as (relative posix path, path), sorted by relative path."""
    root = Path(root) if root else stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts):
            continue
        if p.is_file():
            out.append((rel.as_posix(), p))
    out.sort(key=lambda x: x[0])
    return out


def read_text(path: Path) -> Optional[str]:
    """A file's text, or None when it is not valid UTF-8 (a few test files are meant to be)."""
    try:
        return path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def heldout_texts(root: Optional[Path] = None) -> list[tuple[str, str]]:
    out = []
    for rel, p in stdlib_files(root):
        if is_heldout(rel):
            t = read_text(p)
            if t:
                out.append((rel, t))
    return out


def encode_stream(tok, texts: Sequence[str], eos: int = 0) -> torch.Tensor:
    """Documents concatenated, each followed by the end-of-text token: one int64 stream.

    `tok` is a `tokenizers.Tokenizer` or strata's Tokenizer wrapper."""
    raw = getattr(tok, "_tok", tok)
    ids: list[int] = []
    for enc in raw.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def chunks(stream: torch.Tensor, seq_len: int, max_tokens: Optional[int] = None) -> torch.Tensor:
    """Non-overlapping windows of seq_len predicted tokens: (N, seq_len + 1), consecutive rows
    share one token (the last input of one is the first of the next)."""
    if max_tokens:
        stream = stream[: max_tokens + 1]
    n = (stream.numel() - 1) // seq_len
    if n == 0:
        raise ValueError(f"held-out stream of {stream.numel()} tokens is shorter than seq_len+1")
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None]
    return stream[idx]


# ---- teacher-forced metrics --------------------------------------------------------------------
@torch.no_grad()
def eval_teacher_forced(model: Qwen3Next, stream: torch.Tensor, seq_len: int = 512,
                        batch: int = 16, max_tokens: Optional[int] = None) -> dict:
    """Perplexity, next-token accuracy, and (with MTP) greedy draft acceptance on a token stream."""
    device = model.embed_tokens.weight.device
    data = chunks(stream, seq_len, max_tokens)
    nll = correct = count = 0.0
    m_nll = m_correct = m_accept = m_count = 0.0
    for s in range(0, data.shape[0], batch):
        x = data[s:s + batch].to(device)
        inp, tgt = x[:, :-1], x[:, 1:]
        h = model.forward_train(inp)
        logits = model.logits(h).float()
        nll += F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum").item()
        pred = logits.argmax(-1)  # pred[:, i] is the main model's greedy guess for t[i+1]
        correct += (pred == tgt).sum().item()
        count += tgt.numel()
        if model.mtp is not None:
            ml = model.logits(model.mtp_train(h, inp)).float()  # row i predicts t[i+2]
            mtgt = x[:, 2:]
            m_nll += F.cross_entropy(ml.flatten(0, 1), mtgt.flatten(), reduction="sum").item()
            mpred = ml.argmax(-1)
            m_correct += (mpred == mtgt).sum().item()
            m_accept += (mpred == pred[:, 1:]).sum().item()
            m_count += mtgt.numel()
    out = {"tokens": int(count), "seq_len": seq_len, "loss": nll / count,
           "perplexity": math.exp(nll / count), "accuracy": correct / count}
    if m_count:
        out.update({"mtp_loss": m_nll / m_count, "mtp_perplexity": math.exp(m_nll / m_count),
                    "mtp_accuracy": m_correct / m_count, "mtp_greedy_acceptance": m_accept / m_count})
    return out


# ---- cached speculative decoding (the engine's window path, in miniature) ----------------------
@torch.no_grad()
def speculative_generate(model: Qwen3Next, prompts: Sequence[Sequence[int]], max_new: int,
                         spec: int = 1, eos: Optional[int] = None) -> dict:
    """Greedy decoding of several prompts at once, each a lane of one window grid.

    spec = 1: one row per lane per window (plain greedy). spec > 1: a lane's group is
    [pending, d1 .. d(spec-1)] with chained MTP drafts; the longest prefix of drafts that equal
    the verifier's greedy tokens is accepted and committed. Lanes that are done point their
    group at the scratch lane. Returns the generated ids and acceptance statistics.
    """
    device = model.embed_tokens.weight.device
    use_mtp = spec > 1 and model.mtp is not None
    spec = spec if use_mtp else 1
    n = len(prompts)
    max_ctx = max(len(p) for p in prompts) + max_new + 2 * spec + 2
    state = DecodeState(model.args, n, max_ctx, model.dtype, device, with_mtp=use_mtp)
    slot_pos = torch.zeros(n + 1, dtype=torch.long, device=device)
    outputs: list[list[int]] = [[] for _ in range(n)]
    pending = torch.zeros(n, dtype=torch.long, device=device)
    drafts = torch.zeros(n, max(spec - 1, 1), dtype=torch.long, device=device)
    m_last = None
    if use_mtp:
        m_last = torch.zeros(n, model.args.hidden_size, dtype=model.dtype, device=device)
    for lane, p in enumerate(prompts):
        toks = torch.tensor(list(p), dtype=torch.long, device=device)
        h = model.prefill(toks, lane, 0, state)
        y = model.logits(h[-1]).argmax(-1)
        pending[lane] = y
        slot_pos[lane] = toks.numel()
        outputs[lane].append(int(y))
        if use_mtp:
            nxt = torch.cat([toks[1:], y[None]])
            one = torch.tensor([lane], device=device)
            m, ml = model.mtp_window(h[None], nxt[None], one, torch.zeros_like(one),
                                     toks.numel(), state)
            m_last[lane] = m[0, -1]
            drafts[lane, 0] = ml[0, -1].argmax(-1)
    lanes = torch.arange(n, device=device)

    def chain(active_slot: torch.Tensor, base_pos: torch.Tensor) -> None:
        """Drafts d2 .. d(spec-1): MTP rows at base_pos + s - 2 fed with (m_(s-1), d_(s-1))."""
        m = m_last
        for s in range(2, spec):
            pos = base_pos + (s - 2)
            ctx = int(pos.max()) + 1
            m, ml = model.mtp_window(m[:, None], drafts[:, s - 2, None], active_slot, pos, ctx, state)
            m = m[:, 0]
            drafts[:, s - 1] = ml[:, 0].argmax(-1)

    done = [False] * n
    for lane in range(n):
        done[lane] = len(outputs[lane]) >= max_new or (eos is not None and outputs[lane][-1] == eos)
    active_slot = torch.where(torch.tensor(done, device=device), state.scratch, lanes)
    if use_mtp:
        chain(active_slot, slot_pos[:n].clone())
    windows = 0
    accepted_hist = [0] * spec  # windows that accepted exactly a drafts
    depth_tried = [0] * spec
    depth_ok = [0] * spec
    while not all(done):
        active = torch.tensor([not d for d in done], device=device)
        group_slot = torch.where(active, lanes, torch.full_like(lanes, state.scratch))
        group_pos = torch.where(active, slot_pos[:n], torch.zeros_like(lanes))
        rows = torch.cat([pending[:, None], drafts[:, : spec - 1]], 1) if spec > 1 else pending[:, None]
        ctx = int(group_pos.max()) + spec
        hidden, logits, rec_factors, conv_snaps = model.verify_window(rows, group_slot,
                                                                      group_pos, ctx, state)
        target = logits.argmax(-1)  # (n, spec)
        if spec > 1:
            match = (rows[:, 1:] == target[:, :-1]).long()
            accept = match.cumprod(1).sum(1)
        else:
            accept = torch.zeros(n, dtype=torch.long, device=device)
        ops.commit_accepted(accept, group_slot, group_pos, rec_factors, conv_snaps, state.rec,
                            state.conv, slot_pos)
        acc_l = accept.tolist()
        rows_l, tgt_l = rows.tolist(), target.tolist()
        for lane in range(n):
            if done[lane]:
                continue
            a = acc_l[lane]
            windows += 1
            accepted_hist[a] += 1
            for d in range(1, spec):
                if d <= a + 1 and d <= spec - 1:
                    depth_tried[d] += 1
                    depth_ok[d] += int(d <= a)
            for tkn in rows_l[lane][1:a + 1] + [tgt_l[lane][a]]:
                if len(outputs[lane]) < max_new and not done[lane]:
                    outputs[lane].append(tkn)
                    if eos is not None and tkn == eos:
                        done[lane] = True
            if len(outputs[lane]) >= max_new:
                done[lane] = True
        idx = torch.arange(n, device=device)
        pending = target[idx, accept]
        if use_mtp:
            # The MTP runs over every committed row j with (h[j], t[j+1]); target[:, j] is
            # t[j+1] for every accepted row, and row `accept` yields the next first draft.
            m, ml = model.mtp_window(hidden, target, group_slot, group_pos, ctx, state)
            m_last = m[idx, accept]
            drafts[:, 0] = ml[idx, accept].argmax(-1)
            active_slot = torch.where(torch.tensor(done, device=device), state.scratch, lanes)
            chain(active_slot, torch.where(active_slot == state.scratch, 0, slot_pos[:n]))
    emitted = sum(len(o) for o in outputs) - n  # the first token of each comes from prefill
    res = {"spec": spec, "lanes": n, "max_new": max_new, "windows": windows,
           "tokens_per_window": emitted / max(windows, 1), "outputs": outputs}
    if spec > 1:
        res["accepted_drafts_hist"] = accepted_hist
        res["mean_accepted_drafts"] = sum(a * c for a, c in enumerate(accepted_hist)) / max(windows, 1)
        res["depth_acceptance"] = [depth_ok[d] / max(depth_tried[d], 1) for d in range(1, spec)]
    return res


def greedy_generate(model: Qwen3Next, ids: Sequence[int], max_new: int, eos: Optional[int] = None,
                    spec: int = 1) -> list[int]:
    return speculative_generate(model, [ids], max_new, spec=spec, eos=eos)["outputs"][0]


# ---- the whole evaluation ----------------------------------------------------------------------
def evaluate(model_or_path, files: Optional[Sequence[str | Path]] = None,
             root: Optional[str | Path] = None, device: str = "auto",
             dtype: str = "auto", seq_len: int = 512, batch: int = 16,
             max_tokens: Optional[int] = None, specs: Sequence[int] = (2, 3, 4),
             spec_prompts: int = 16, spec_new: int = 96, sample_new: int = 64,
             prompts: Sequence[str] = PROMPTS, log=print) -> dict:
    """Run every measurement; `model_or_path` is a checkpoint directory or a LoadedModel."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    lm = model_or_path if isinstance(model_or_path, LoadedModel) else \
        load_checkpoint(model_or_path, dtype=dtype, device=device, log=log)
    if lm.tokenizer is None:
        raise SystemExit(f"{lm.path}: no tokenizer.json; evaluation needs one")
    model, tok = lm.model, lm.tokenizer
    eos = tok.eos_ids[0] if tok.eos_ids else None
    t0 = time.time()
    if files:
        docs = [(str(f), read_text(Path(f))) for f in files]
        docs = [(name, t) for name, t in docs if t]
        source = "given files"
    else:
        root = Path(root).resolve() if root else stdlib_root()
        docs = heldout_texts(root)
        source = f"held-out split of {root} (running Python {sys.version.split()[0]})"
    stream = encode_stream(tok, [t for _, t in docs], eos=eos if eos is not None else 0)
    res: dict = {"model": str(lm.path), "device": str(device), "dtype": str(lm.dtype).replace("torch.", ""),
                 "data": {"source": source, "files": len(docs), "tokens": int(stream.numel()),
                          "split_rule": None if files else SPLIT_RULE}}
    seq_len = min(seq_len, max(8, (stream.numel() - 1)))
    res["heldout"] = eval_teacher_forced(model, stream, seq_len=seq_len, batch=batch,
                                         max_tokens=max_tokens)
    # Prompts for speculative decoding: the first lines of held-out files, cut to <= 96 tokens.
    spec_ids = []
    for _, t in docs[:: max(1, len(docs) // max(spec_prompts, 1))][:spec_prompts]:
        ids = tok.encode(t)[:96]
        if len(ids) >= 8:
            spec_ids.append(ids)
    res["speculative"] = {}
    if spec_ids:
        base = speculative_generate(model, spec_ids, spec_new, spec=1, eos=eos)
        for s in specs:
            if model.mtp is None or s < 2:
                continue
            r = speculative_generate(model, spec_ids, spec_new, spec=s, eos=eos)
            same = sum(a == b for a, b in zip(r["outputs"], base["outputs"]))
            r["same_as_greedy"] = same / len(spec_ids)
            r.pop("outputs")
            res["speculative"][str(s)] = r
    res["samples"] = []
    for p in prompts:
        ids = tok.encode(p)
        out = greedy_generate(model, ids, sample_new, eos=eos)
        if eos is not None and eos in out:
            out = out[: out.index(eos)]
        res["samples"].append({"prompt": p, "continuation": tok.decode(out)})
    res["seconds"] = time.time() - t0
    return res


def format_report(res: dict) -> str:
    h = res["heldout"]
    lines = [f"model {res['model']} ({res['dtype']} on {res['device']})",
             f"data: {res['data']['source']}: {res['data']['files']} files, "
             f"{res['data']['tokens']} tokens",
             f"held-out: loss {h['loss']:.4f}  perplexity {h['perplexity']:.3f}  "
             f"next-token accuracy {h['accuracy']:.4f}  ({h['tokens']} tokens, seq {h['seq_len']})"]
    if "mtp_greedy_acceptance" in h:
        lines.append(f"MTP: loss {h['mtp_loss']:.4f}  perplexity {h['mtp_perplexity']:.3f}  "
                     f"accuracy (t[i+2]) {h['mtp_accuracy']:.4f}  greedy acceptance "
                     f"{h['mtp_greedy_acceptance']:.4f}")
    for s, r in res.get("speculative", {}).items():
        depth = " ".join(f"{x:.3f}" for x in r["depth_acceptance"])
        lines.append(f"spec={s}: {r['tokens_per_window']:.3f} tokens/window, mean accepted drafts "
                     f"{r['mean_accepted_drafts']:.3f}, per-depth acceptance [{depth}], "
                     f"output same as greedy for {r['same_as_greedy']:.0%} of {r['lanes']} prompts")
    for smp in res.get("samples", []):
        lines.append("---- prompt: " + repr(smp["prompt"]))
        lines.append(smp["prompt"] + smp["continuation"])
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory")
    ap.add_argument("--files", nargs="*", help="evaluate on these files instead of the held-out split")
    ap.add_argument("--stdlib", help="source tree whose held-out split to use (default: this "
                    "interpreter's standard library)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=None, help="cap on held-out tokens scored")
    ap.add_argument("--spec", type=int, nargs="*", default=[2, 3, 4],
                    help="verify rows per window for the speculative decoding runs")
    ap.add_argument("--spec-prompts", type=int, default=16)
    ap.add_argument("--spec-new", type=int, default=96)
    ap.add_argument("--sample-new", type=int, default=64)
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    res = evaluate(a.model, files=a.files, root=a.stdlib, device=a.device, dtype=a.dtype, seq_len=a.seq_len,
                   batch=a.batch, max_tokens=a.max_tokens, specs=a.spec,
                   spec_prompts=a.spec_prompts, spec_new=a.spec_new, sample_new=a.sample_new)
    print(format_report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0

