#!/usr/bin/env python3
"""Train strata's embedded tiny Qwen3-Next + MTP model on the Python standard library's source.

    python3 scripts/train_tiny.py [--out DIR] [--minutes 6] [--seed 0]   # one GPU, ~7 min
    python3 scripts/train_tiny.py --tiny --minutes 0.2 --out /tmp/tiny    # CPU smoke test

Steps: list the running interpreter's stdlib *.py files (sorted, test suite included), hold out
~3% of files by a hash of their relative path, train a byte-level BPE tokenizer on the rest
(`<|endoftext|>` is id 0 and separates documents), train a qwen3_next model with strata's own
model code (`Qwen3Next.forward_train` + `mtp_train`; loss = main CE + 0.3 * MTP CE, the MTP row
i predicting t[i+2]), save it with `save_checkpoint` in bfloat16 together with tokenizer.json,
generation_config.json and a model card README.md holding the command, the data and the
held-out results of scripts/eval_acceptance.py.

Deterministic for a given seed as long as the step count, not the --minutes cap, ends training
(the model card says which one did). Runs from the repo root without installing strata.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "scripts")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from strata.tools import eval_acceptance as ev  # noqa: E402
from strata.kernels import ops  # noqa: E402
from strata.model.config import ModelArgs  # noqa: E402
from strata.model.loader import save_checkpoint  # noqa: E402
from strata.model.qwen3_next import Qwen3Next  # noqa: E402
from strata.model.tiny import init_random, train_bpe  # noqa: E402

DEFAULT_OUT = ROOT / "strata" / "assets" / "tiny-qwen3-next"
MTP_WEIGHT = 0.3
AUX_WEIGHT = 0.01  # router load balancing (Switch-style), keeps all experts in use

# The shipped model: ~7.5 M parameters, 14.4 MiB in bfloat16.
FULL = dict(
    model=dict(vocab_size=4096, hidden_size=256, num_hidden_layers=6,
               layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
               linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128,
               norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0,
               partial_rotary_factor=0.25, max_position_embeddings=4096),
    seq_len=512, batch=64, epochs=10, max_steps=2000, warmup=150, lr=3e-3, min_lr_ratio=0.1,
    weight_decay=0.1, data_per_mille=1000, eval_tokens=None, log_every=25, eval_every=250,
)
# The CPU smoke test: same architecture kinds (3 DeltaNet + 1 attention, 8 experts top-2).
TINY = dict(
    model=dict(FULL["model"], vocab_size=2048, hidden_size=64, num_hidden_layers=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"],
               num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
               linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=32,
               linear_value_head_dim=32, moe_intermediate_size=32,
               shared_expert_intermediate_size=64),
    seq_len=128, batch=8, epochs=10, max_steps=300, warmup=20, lr=3e-3, min_lr_ratio=0.1,
    weight_decay=0.1,
    data_per_mille=50, eval_tokens=8192, log_every=5, eval_every=50,
)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- data ----------------------------------------------------------------------------------------
def load_corpus(per_mille: int, root=None) -> dict:
    """Train and held-out documents of the stdlib; `per_mille` < 1000 keeps a hash-chosen subset."""
    import hashlib

    root = Path(root).resolve() if root else ev.stdlib_root()
    files = ev.stdlib_files(root)
    train, held, skipped = [], [], []
    for rel, p in files:
        if per_mille < 1000 and int(hashlib.sha1(b"subset:" + rel.encode()).hexdigest()[:8], 16) % 1000 >= per_mille:
            continue
        text = ev.read_text(p)
        if not text:
            skipped.append(rel)
            continue
        (held if ev.is_heldout(rel) else train).append((rel, text))
    tests = sum(1 for rel, _ in files if rel.startswith("test/"))
    return {"root": root, "all_files": len(files), "train": train, "heldout": held,
            "skipped": skipped, "test_files": tests}


def lr_at(step: int, cfg: dict) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr over the planned steps."""
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    prog = min(1.0, (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"]))
    lo = cfg["lr"] * cfg["min_lr_ratio"]
    return lo + 0.5 * (cfg["lr"] - lo) * (1 + math.cos(math.pi * prog))


class Batches:
    """Deterministic batches of (batch, seq_len + 1) windows of the training stream: each epoch
    cuts the stream at a seeded random offset into windows and visits them in seeded order."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch: int, seed: int, device):
        self.stream, self.seq_len, self.batch, self.device = stream.to(device), seq_len, batch, device
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.order = torch.empty(0, dtype=torch.long)
        self.pos = 0
        self.offset = 0

    def _new_epoch(self) -> None:
        n = self.stream.numel()
        self.offset = int(torch.randint(0, self.seq_len, (1,), generator=self.gen))
        count = (n - 1 - self.offset) // self.seq_len
        if count < self.batch:
            raise SystemExit(f"training stream of {n} tokens is too short for batch {self.batch} "
                             f"x seq_len {self.seq_len}")
        self.order = torch.randperm(count, generator=self.gen)
        self.pos = 0
        self.epoch += 1

    def next(self) -> torch.Tensor:
        if self.pos + self.batch > self.order.numel():
            self._new_epoch()
        starts = self.order[self.pos:self.pos + self.batch] * self.seq_len + self.offset
        self.pos += self.batch
        idx = starts.to(self.device)[:, None] + torch.arange(self.seq_len + 1, device=self.device)
        return self.stream[idx]


# ---- model helpers -----------------------------------------------------------------------------------
class RouterTap:
    """Collects router logits (forward hooks on each MoE gate) for the load-balancing loss."""

    def __init__(self, model: Qwen3Next):
        self.logits: list[torch.Tensor] = []
        self.top_k = model.args.num_experts_per_tok
        mods = [layer.mlp for layer in model.layers]
        if model.mtp is not None:
            mods += [layer.mlp for layer in model.mtp.layers]
        for m in mods:
            if hasattr(m, "gate") and hasattr(m, "experts"):
                m.gate.register_forward_hook(lambda _m, _i, out: self.logits.append(out))

    def loss(self) -> torch.Tensor:
        total = 0.0
        for lg in self.logits:
            probs = torch.softmax(lg.float().reshape(-1, lg.shape[-1]), -1)
            e = probs.shape[-1]
            top = probs.topk(self.top_k, dim=-1).indices
            frac = torch.zeros(e, device=lg.device).scatter_add_(
                0, top.flatten(), torch.ones(top.numel(), device=lg.device)) / top.numel()
            total = total + e * (frac * probs.mean(0)).sum()
        self.logits.clear()
        return total


def fp32_delta_rule(device_type: str):
    """The chunked delta rule runs in float32 even under autocast (as inference runs it)."""
    inner = ops.chunk_gated_delta

    def wrapped(*a, **k):
        with torch.autocast(device_type, enabled=False):
            return inner(*a, **k)
    return inner, wrapped


def losses(model: Qwen3Next, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, L+1): main CE over t[1..L] and MTP CE over t[2..L] (row i predicts t[i+2])."""
    inp = x[:, :-1]
    h = model.forward_train(inp)
    v = model.args.vocab_size
    main = F.cross_entropy(model.logits(h).float().reshape(-1, v), x[:, 1:].reshape(-1))
    m = model.mtp_train(h, inp)
    mtp = F.cross_entropy(model.logits(m).float().reshape(-1, v), x[:, 2:].reshape(-1))
    return main, mtp


@torch.no_grad()
def heldout_loss(model: Qwen3Next, data: torch.Tensor, batch: int, autocast,
                 tap=None) -> tuple[float, float]:
    model.eval()
    tot_m = tot_t = 0.0
    for s in range(0, data.shape[0], batch):
        with autocast():
            a, b = losses(model, data[s:s + batch])
        tot_m += a.item() * min(batch, data.shape[0] - s)
        tot_t += b.item() * min(batch, data.shape[0] - s)
    if tap is not None:
        tap.logits.clear()
    model.train()
    return tot_m / data.shape[0], tot_t / data.shape[0]


# ---- model card ------------------------------------------------------------------------------------
def model_card(info: dict, res: dict) -> str:
    h = res["heldout"]
    a = info["args"]
    spec_lines = []
    for s, r in res.get("speculative", {}).items():
        depth = ", ".join(f"{x:.3f}" for x in r["depth_acceptance"])
        spec_lines.append(f"| {s} | {r['tokens_per_window']:.3f} | {r['mean_accepted_drafts']:.3f} | "
                          f"{depth} | {r['same_as_greedy']:.0%} |")
    samples = "\n\n".join(f"```python\n{s['prompt']}{s['continuation']}\n```" for s in res["samples"][:3])
    n_lin = a["layer_types"].count("linear_attention")
    return f"""---
license: apache-2.0
library_name: strata
pipeline_tag: text-generation
tags: [qwen3_next, mtp, tiny, code, python]
---

# tiny-qwen3-next

A tiny `qwen3_next` model (Gated DeltaNet + gated attention, MoE with a shared expert) with its
multi-token-prediction (MTP) module, trained from scratch on the Python standard library's source.
It is strata's embedded default model: small enough to ship inside the package, real enough that
its MTP drafts are accepted often. Standard Hugging Face layout: `Qwen3NextForCausalLM` loads it
(it ignores the `mtp.*` tensors); strata loads all of it.

## Architecture

| | |
| --- | --- |
| parameters | {info['params'] / 1e6:.2f} M in all, {info['mtp_params'] / 1e6:.2f} M of them in the MTP module |
| layers | {a['num_hidden_layers']} ({n_lin} Gated DeltaNet, {a['num_hidden_layers'] - n_lin} full attention): {', '.join(a['layer_types'])} |
| hidden / head_dim | {a['hidden_size']} / {a['head_dim']} ({a['num_attention_heads']} query heads, {a['num_key_value_heads']} KV heads, partial rotary {a['partial_rotary_factor']}) |
| DeltaNet heads | {a['linear_num_key_heads']} key x {a['linear_key_head_dim']}, {a['linear_num_value_heads']} value x {a['linear_value_head_dim']}, conv kernel {a['linear_conv_kernel_dim']} |
| MoE | {a['num_experts']} experts, top-{a['num_experts_per_tok']} (moe_intermediate {a['moe_intermediate_size']}), shared expert {a['shared_expert_intermediate_size']} |
| MTP | 1 layer: fc(cat[norm(embed(t[i+1])), norm(h[i])]) -> full-attention MoE decoder layer -> norm -> lm_head |
| vocabulary | {a['vocab_size']} (byte-level BPE, `<|endoftext|>` = 0) |
| weights | bfloat16 safetensors |

## Training

Command (run from the repository root):

```
{info['command']}
```

- Data: every `*.py` file of {info['data_desc']} ({info['stdlib']}), site-packages excluded, in
  sorted order{info['subset_note']}; {info['tests_note']}. {info['files_total']} files found,
  {info['files_skipped']} skipped as not valid UTF-8; {info['files_train']} training files
  ({info['tokens_train']:,} tokens), {info['files_heldout']} held-out files ({info['tokens_heldout']:,} tokens).
- Held-out split: {ev.SPLIT_RULE}.
- Documents are separated by `<|endoftext|>`; training windows of {info['seq_len']} tokens are cut
  from the concatenated stream at a random offset per epoch and visited in a seeded order.
- Tokenizer: byte-level BPE trained with `tokenizers` on the training files only.
- Loss: main next-token CE + {MTP_WEIGHT} x MTP CE (MTP row i predicts t[i+2] from h[i] and t[i+1], gradients
  flowing into the main model as in DeepSeek-V3) + {AUX_WEIGHT} x router load-balancing loss.
- Optimiser: AdamW (betas 0.9, 0.95, weight decay {info['weight_decay']} on matrices), peak lr {info['lr']},
  {info['warmup']} warmup steps then cosine decay to {info['min_lr_ratio']} x peak over {info['steps_planned']} steps,
  gradient clipping 1.0, batch {info['batch']} x {info['seq_len']} tokens, {info['autocast']}.
- Ran {info['steps_done']} steps ({info['stop_reason']}), {info['tokens_seen']:,} tokens
  ({info['epochs']:.1f} epochs) in {info['train_seconds']:.0f} s at {info['tokens_per_s']:,.0f} tokens/s on
  {info['device_name']} (torch {info['torch']}), seed {info['seed']}.
- Final training losses (mean of the last {info['last_n']} steps): main {info['final_main']:.4f},
  MTP {info['final_mtp']:.4f}.

## Evaluation (held-out files, `scripts/eval_acceptance.py`)

| metric | value |
| --- | --- |
| held-out tokens scored | {h['tokens']:,} (windows of {h['seq_len']}) |
| perplexity | {h['perplexity']:.3f} (loss {h['loss']:.4f}) |
| next-token accuracy | {h['accuracy']:.4f} |
| MTP perplexity for t[i+2] | {h.get('mtp_perplexity', float('nan')):.3f} |
| MTP accuracy for t[i+2] | {h.get('mtp_accuracy', float('nan')):.4f} |
| teacher-forced MTP agreement (draft = target on the true text) | {h.get('mtp_greedy_acceptance', float('nan')):.4f} |

Teacher-forced MTP agreement is the fraction of held-out positions i where the MTP's greedy
draft for t[i+2] (from h[i] and the true t[i+1]) equals the main model's greedy prediction for
t[i+2] from the true prefix. It scores drafts on human-written text. **Acceptance while
decoding** is the figure speculative decoding sees: the model continues held-out code prompts
with its own greedy tokens, and a draft is accepted when it equals the target's next token. At
spec 2 (exactly the batch_mtp draft) that is the "acceptance by depth" of the first row below.

Speculative greedy decoding through strata's cached window path ({res['speculative'].get('2', {}).get('lanes', 0)} prompts from
held-out files, {res['speculative'].get('2', {}).get('max_new', 0)} new tokens each; spec = verify rows per window, drafts chained):

| spec | tokens per window | mean accepted drafts | acceptance by depth | output = plain greedy |
| --- | --- | --- | --- | --- |
{chr(10).join(spec_lines)}

Evaluated in {res['dtype']} on {res['device']}.

## Samples (greedy)

{samples}
"""


# ---- main ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output checkpoint directory")
    ap.add_argument("--minutes", type=float, default=6.0,
                    help="wall-clock cap on the training loop; training stops then and still saves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a small model and data subset (CPU smoke test)")
    ap.add_argument("--steps", type=int, help="planned optimiser steps (the schedule's length); "
                    "default: --epochs over the training tokens, at most the preset's max_steps")
    ap.add_argument("--epochs", type=float, help="passes over the training tokens (default 10)")
    ap.add_argument("--eval-every", type=int, help="steps between held-out loss checks")
    ap.add_argument("--stdlib", help="source tree to train on instead of this interpreter's stdlib")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the loss (falls back to eager if compiling fails)")
    ap.add_argument("--eval-tokens", type=int, help="cap on held-out tokens the final evaluation scores")
    ap.add_argument("--no-eval", action="store_true", help="skip the final evaluation (model card without it)")
    a = ap.parse_args(argv)

    t_start = time.time()
    cfg = dict(TINY if a.tiny else FULL)
    for k in ("batch", "seq_len", "lr", "epochs", "eval_every"):
        if getattr(a, k) is not None:
            cfg[k] = getattr(a, k)
    if a.eval_tokens is not None:
        cfg["eval_tokens"] = a.eval_tokens
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    cuda = device.type == "cuda"
    if a.tiny and not cuda:
        # The smoke model gains nothing from more threads, and on a busy small machine OpenMP
        # spin-waiting makes two threads many times slower than one.
        torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    # warn_only=False also switches cuDNN attention's backward to its deterministic algorithm.
    torch.use_deterministic_algorithms(True, warn_only=not cuda)
    if cuda:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(a.out)
    command = " ".join(["python3 scripts/train_tiny.py"] + [shlex.quote(x) for x in (argv or sys.argv[1:])])

    # Data and tokenizer.
    corpus = load_corpus(cfg["data_per_mille"], a.stdlib)
    log(f"data: {corpus['root']} (Python {platform.python_version()}): {corpus['all_files']} files "
        f"({corpus['test_files']} under test/), "
        f"{len(corpus['train'])} train, {len(corpus['heldout'])} held out, "
        f"{len(corpus['skipped'])} not UTF-8 ({time.time() - t_start:.1f} s)")
    tok = train_bpe(cfg["model"]["vocab_size"], [t for _, t in corpus["train"]])
    assert tok.token_to_id("<|endoftext|>") == 0
    train_stream = ev.encode_stream(tok, [t for _, t in corpus["train"]], eos=0)
    held_stream = ev.encode_stream(tok, [t for _, t in corpus["heldout"]], eos=0)
    log(f"tokenizer: vocab {tok.get_vocab_size()}; {train_stream.numel():,} train tokens, "
        f"{held_stream.numel():,} held-out tokens ({time.time() - t_start:.1f} s)")

    tok_per_step = cfg["batch"] * cfg["seq_len"]
    cfg["steps"] = a.steps or min(cfg["max_steps"],
                                  math.ceil(cfg["epochs"] * train_stream.numel() / tok_per_step))
    cfg["warmup"] = min(cfg["warmup"], max(1, cfg["steps"] // 10))

    # Model.
    margs = ModelArgs(**cfg["model"], eos_token_id=[0], torch_dtype="bfloat16")
    margs.vocab_size = max(margs.vocab_size, tok.get_vocab_size())
    model = init_random(Qwen3Next(margs, with_mtp=True), seed=a.seed, std=0.02, head_std=0.02)
    with torch.no_grad():  # GPT-2 style: residual-branch output projections scaled by depth
        scale = (2 * margs.num_hidden_layers) ** -0.5
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "w_down")):
                p.mul_(scale)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in model.mtp.parameters())
    log(f"model: {n_params / 1e6:.2f} M parameters ({n_mtp / 1e6:.2f} M MTP), device {device}")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=(0.9, 0.95), eps=1e-8, fused=cuda)
    tap = RouterTap(model)
    inner, wrapped = fp32_delta_rule(device.type)
    ops.chunk_gated_delta = wrapped

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def step_loss(x):
        with autocast():
            main_l, mtp_l = losses(model, x)
            aux = tap.loss()
            return main_l + MTP_WEIGHT * mtp_l + AUX_WEIGHT * aux, main_l, mtp_l, aux

    loss_fn = step_loss
    if a.compile:
        try:
            loss_fn = torch.compile(step_loss)
        except Exception as e:  # pragma: no cover - depends on the toolchain
            log(f"torch.compile unavailable ({e}); running eager")

    batches = Batches(train_stream, cfg["seq_len"], cfg["batch"], a.seed, device)
    held_data = ev.chunks(held_stream, cfg["seq_len"], 64 * cfg["seq_len"]).to(device)
    budget = a.minutes * 60.0
    t_train = time.time()
    hist: list[tuple[float, float]] = []
    pending: list[torch.Tensor] = []
    stop_reason = f"the planned {cfg['steps']} steps"
    step = 0
    t_log, s_log = time.time(), 0
    while step < cfg["steps"]:
        if time.time() - t_train > budget:
            stop_reason = f"the --minutes {a.minutes:g} cap, before the planned {cfg['steps']} steps"
            break
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batches.next()
        try:
            loss, main_l, mtp_l, aux = loss_fn(x)
            loss.backward()
        except RuntimeError as e:
            if "deterministic" not in str(e) or not torch.are_deterministic_algorithms_enabled():
                raise
            log(f"an op has no deterministic implementation here ({str(e)[:200]}); "
                "continuing without the guarantee")
            torch.use_deterministic_algorithms(True, warn_only=True)
            tap.logits.clear()
            opt.zero_grad(set_to_none=True)
            loss, main_l, mtp_l, aux = loss_fn(x)
            loss.backward()
        except Exception as e:
            if loss_fn is step_loss:
                raise
            log(f"compiled step failed ({type(e).__name__}: {str(e)[:300]}); running eager")
            loss_fn = step_loss
            tap.logits.clear()
            opt.zero_grad(set_to_none=True)
            loss, main_l, mtp_l, aux = loss_fn(x)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append(torch.stack([main_l.detach(), mtp_l.detach(), aux.detach()]))
        step += 1
        if step % cfg["log_every"] == 0 or step == cfg["steps"]:
            vals = torch.stack(pending).float().cpu()
            pending.clear()
            hist.extend((float(r[0]), float(r[1])) for r in vals)
            now = time.time()
            tps = (step - s_log) * tok_per_step / (now - t_log)
            t_log, s_log = now, step
            m = vals.mean(0)
            log(f"step {step:5d}/{cfg['steps']}  lr {lr:.2e}  main {m[0]:.4f}  mtp {m[1]:.4f}  "
                f"aux {m[2]:.3f}  {tps:,.0f} tok/s  epoch {batches.epoch}  "
                f"{now - t_train:.0f} s")
        if step % cfg["eval_every"] == 0:
            hm, ht = heldout_loss(model, held_data, cfg["batch"], autocast, tap)
            log(f"  held-out: main {hm:.4f} (ppl {math.exp(hm):.2f})  mtp {ht:.4f}")
    if pending:
        hist.extend((float(r[0]), float(r[1])) for r in torch.stack(pending).float().cpu())
    if cuda:
        torch.cuda.synchronize()
    train_s = time.time() - t_train
    ops.chunk_gated_delta = inner
    last_n = min(len(hist), max(1, cfg["log_every"] * 2))
    final_main = sum(m for m, _ in hist[-last_n:]) / max(last_n, 1)
    final_mtp = sum(t for _, t in hist[-last_n:]) / max(last_n, 1)
    log(f"trained {step} steps in {train_s:.1f} s ({stop_reason}); final main {final_main:.4f} "
        f"mtp {final_mtp:.4f}")

    # Save: bfloat16 weights, tokenizer, generation config.
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors.index.json",):
        (out / stale).unlink(missing_ok=True)
    save_checkpoint(model, out, dtype=torch.bfloat16)
    tok.save(str(out / "tokenizer.json"))
    os.chmod(out / "model.safetensors", 0o644)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 0, "bos_token_id": None, "do_sample": False}, indent=2) + "\n")

    info = dict(
        args=asdict(margs), params=n_params, mtp_params=n_mtp, command=command,
        python=platform.python_version(), stdlib=str(corpus["root"]),
        data_desc=(f"the standard library of Python {platform.python_version()}" if not a.stdlib
                   else "the source tree given with --stdlib"),
        tests_note=(f"test suite as installed here: {corpus['test_files']} files under test/ "
                    "(Debian/Ubuntu ship most of it as a separate package)"
                    if corpus["test_files"] else "this installation has no test/ package"),
        subset_note="" if cfg["data_per_mille"] >= 1000 else
        f" (--tiny: a hash-chosen {cfg['data_per_mille'] / 10:g}% subset of the files)",
        files_total=corpus["all_files"], files_skipped=len(corpus["skipped"]),
        files_train=len(corpus["train"]), files_heldout=len(corpus["heldout"]),
        tokens_train=int(train_stream.numel()), tokens_heldout=int(held_stream.numel()),
        seq_len=cfg["seq_len"], batch=cfg["batch"], lr=cfg["lr"], warmup=cfg["warmup"],
        min_lr_ratio=cfg["min_lr_ratio"], weight_decay=cfg["weight_decay"],
        steps_planned=cfg["steps"], steps_done=step, stop_reason=stop_reason,
        tokens_seen=step * tok_per_step, epochs=step * tok_per_step / max(1, train_stream.numel()),
        train_seconds=train_s, tokens_per_s=step * tok_per_step / max(train_s, 1e-9),
        device_name=torch.cuda.get_device_name(device) if cuda else platform.processor() or "CPU",
        torch=torch.__version__, seed=a.seed, last_n=last_n, final_main=final_main,
        final_mtp=final_mtp, autocast="bf16 autocast" if cuda else "float32",
    )
    res = {"heldout": {"tokens": 0, "seq_len": cfg["seq_len"], "loss": float("nan"),
                       "perplexity": float("nan"), "accuracy": float("nan")},
           "speculative": {}, "samples": [], "dtype": "-", "device": "-"}
    if not a.no_eval:
        res = ev.evaluate(out, files=None, root=corpus["root"], device=str(device), seq_len=cfg["seq_len"],
                          batch=cfg["batch"] // 2 or 1, max_tokens=cfg["eval_tokens"],
                          spec_prompts=16 if not a.tiny else 4, spec_new=96 if not a.tiny else 24,
                          sample_new=64 if not a.tiny else 24, log=log)
        log(ev.format_report(res))
    (out / "README.md").write_text(model_card(info, res))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(f"wrote {out} ({size / 2**20:.2f} MiB) in {time.time() - t_start:.0f} s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
