"""For each .best_config that differs between two cold inductor caches of the same run, name
the Triton kernel it configures (through its triton_cache_hash in each cache's Triton cache)
and copy that kernel's Triton source from both caches into OUT/, so the region it comes from
can be found.
    python kernel_of_config.py CACHE_A CACHE_B OUT"""
import glob
import json
import os
import shutil
import sys

KEYS_IGNORED = ("found_by_coordesc", "time_taken_ms", "triton_cache_hash")


def configs(root):
    out = {}
    for p in glob.glob(os.path.join(root, "**", "*.best_config"), recursive=True):
        try:
            out[os.path.basename(p)] = json.load(open(p))
        except Exception:
            pass
    return out


def kernel(root, triton_hash):
    """(name, source path) of the compiled Triton kernel under root's Triton cache."""
    for d in glob.glob(os.path.join(root, "**", triton_hash), recursive=True):
        for j in glob.glob(os.path.join(d, "*.json")):
            meta = json.load(open(j))
            name = meta.get("name")
            if name:
                src = [p for p in glob.glob(os.path.join(d, "*")) if p.endswith((".source", ".ttir"))]
                return name, (src[0] if src else None)
    return None, None


a_root, b_root, out = sys.argv[1:4]
os.makedirs(out, exist_ok=True)
a, b = configs(a_root), configs(b_root)
for key in sorted(set(a) & set(b)):
    ca = {k: v for k, v in a[key].items() if k not in KEYS_IGNORED}
    cb = {k: v for k, v in b[key].items() if k not in KEYS_IGNORED}
    if ca == cb:
        continue
    na, sa = kernel(a_root, a[key].get("triton_cache_hash", "?"))
    nb, sb = kernel(b_root, b[key].get("triton_cache_hash", "?"))
    print(key[:16], na, ca, "|", nb, cb)
    for tag, src in (("a", sa), ("b", sb)):
        if src:
            shutil.copy(src, os.path.join(out, f"{key[:16]}_{tag}_{os.path.basename(src)}"))
# the inductor source modules that define the kernels named above, for their region
names = set()
for key in sorted(set(a) & set(b)):
    for root, cfg in ((a_root, a[key]), (b_root, b[key])):
        n, _ = kernel(root, cfg.get("triton_cache_hash", "?"))
        if n:
            names.add(n)
for p in glob.glob(os.path.join(a_root, "**", "*.py"), recursive=True):
    txt = open(p, errors="replace").read()
    hit = [n for n in names if f"def {n}(" in txt]
    if hit and "R0_BLOCK" in txt:
        shutil.copy(p, os.path.join(out, "src_a_" + os.path.basename(p)))
        print("source", os.path.relpath(p, a_root), hit)
