"""Compare two cold inductor caches of the same run: kernels whose chosen config (.best_config)
differs between them, and generated kernel sources present in only one.
    python cache_diff.py CACHE_A CACHE_B"""
import hashlib
import json
import os
import sys


def scan(root):
    best, srcs = {}, {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if f.endswith(".best_config"):
                try:
                    best[f] = json.load(open(p))
                except Exception:
                    pass
            elif f.endswith(".py") and "triton" not in d.split(os.sep)[-1:]:
                txt = open(p, errors="replace").read()
                if "@triton.jit" in txt or "triton_heuristics" in txt:
                    srcs[hashlib.sha1(txt.encode()).hexdigest()[:12]] = (p, txt)
    return best, srcs


(ba, sa), (bb, sb) = scan(sys.argv[1]), scan(sys.argv[2])
common = sorted(set(ba) & set(bb))
diff = [k for k in common if {x: y for x, y in ba[k].items() if x not in ("found_by_coordesc", "time_taken_ms", "triton_cache_hash")}
        != {x: y for x, y in bb[k].items() if x not in ("found_by_coordesc", "time_taken_ms", "triton_cache_hash")}]
print(f"best_config files: {len(ba)} / {len(bb)}, common {len(common)}, differing {len(diff)}")
for k in diff[:20]:
    print(" ", k, ba[k], "|", bb[k])
only_a, only_b = set(sa) - set(sb), set(sb) - set(sa)
print(f"kernel sources: {len(sa)} / {len(sb)}; only in A {len(only_a)}, only in B {len(only_b)}")
for h in sorted(only_a)[:8]:
    p, txt = sa[h]
    names = [l.split("def ")[1].split("(")[0] for l in txt.splitlines() if l.startswith("def triton_")]
    print("  A only:", os.path.relpath(p, sys.argv[1]), names[:6])
for h in sorted(only_b)[:8]:
    p, txt = sb[h]
    names = [l.split("def ")[1].split("(")[0] for l in txt.splitlines() if l.startswith("def triton_")]
    print("  B only:", os.path.relpath(p, sys.argv[2]), names[:6])
