"""Experiment (not shipped): distil the embedded model's MTP layer alone toward the main model.

The trunk, embedding and head stay frozen (so the greedy text cannot change); the MTP layer is
trained on the local standard library's training split to match the main model's distribution
for t[i+2] (forward KL), then scored by strata.tools.eval_acceptance (CPU, float32).
Usage: python3 docs/bench/s40/distill_mtp.py STEPS BATCH SEQ_LEN LR OUT.pt
(`distill_mtp_400.log`: 400 16 256 1e-3; `eval_base.log`: the shipped model, same evaluation.)
"""
import sys, time, math, torch, torch.nn.functional as F
from strata.model.loader import load_checkpoint
from strata.tools import eval_acceptance as ev
torch.manual_seed(0)
torch.set_num_threads(2)
steps, B, L, lr = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
out = sys.argv[5]
lm = load_checkpoint('/work/main/strata/assets/tiny-qwen3-next', dtype='float32', device='cpu', log=lambda s: None)
model, tok = lm.model, lm.tokenizer
root = ev.stdlib_root()
train = [ev.read_text(p) for rel, p in ev.stdlib_files(root) if not ev.is_heldout(rel)]
stream = ev.encode_stream(tok, [t for t in train if t], eos=0)
print("train tokens", stream.numel(), flush=True)
model.requires_grad_(False); model.mtp.requires_grad_(True)
opt = torch.optim.AdamW(model.mtp.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
g = torch.Generator().manual_seed(0)
t0 = time.time()
for step in range(steps):
    starts = torch.randint(0, stream.numel() - L - 2, (B,), generator=g)
    x = stream[starts[:, None] + torch.arange(L + 1)]
    inp = x[:, :-1]
    with torch.no_grad():
        h = model.forward_train(inp)
        teacher = F.log_softmax(model.logits(h[:, 1:]).float(), -1)
    m = model.mtp_train(h, inp)
    student = F.log_softmax(model.logits(m).float(), -1)
    kl = (teacher.exp() * (teacher - student)).sum(-1).mean()
    agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
    cur = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
    for pg in opt.param_groups: pg['lr'] = cur
    opt.zero_grad(); kl.backward(); torch.nn.utils.clip_grad_norm_(model.mtp.parameters(), 1.0); opt.step()
    if step % 20 == 0 or step == steps - 1:
        print(f"step {step} kl {kl.item():.4f} agree {agree.item():.4f} lr {cur:.2e} {time.time()-t0:.0f}s", flush=True)
torch.save({k: v for k, v in model.mtp.state_dict().items()}, out)
model.eval()
res = ev.evaluate(lm, specs=(2, 4), spec_prompts=13, spec_new=96, max_tokens=16384, device='cpu', log=lambda s: None)
print(ev.format_report(res).split('---- prompt')[0])
