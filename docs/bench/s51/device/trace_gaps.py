"""Where the device idles in an engine's traced cohort (bench_engine.py --trace-dir): the union
of its kernels' spans against the timeline, the idle gaps by size (with the host call that was
running at each of the longest), the host's CUDA runtime calls by total time (a graph's launch
among them: its cost grows with what the graph holds), and the kernels by total time.

    python3 docs/bench/s51/device/trace_gaps.py TRACE.json [TOP=15]
"""
import bisect
import collections
import json
import sys

d = json.load(open(sys.argv[1]))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 15
evs = d["traceEvents"]
gpu = sorted((e for e in evs if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
             key=lambda e: e["ts"])
host = sorted((e for e in evs if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "cuda_runtime")),
              key=lambda e: e["ts"])
if not gpu:
    sys.exit("no device activity in the trace")
t0, t1 = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
busy = 0.0
gaps = []
end = None
for e in gpu:
    s, t = e["ts"], e["ts"] + e["dur"]
    if end is None or s > end:
        if end is not None:
            gaps.append((s - end, end))
        busy += t - s
        end = t
    elif t > end:
        busy += t - end
        end = t
span = t1 - t0
print(f"timeline {span / 1e3:.2f} ms, device busy {busy / 1e3:.2f} ms ({busy / span:.1%}), "
      f"{len(gpu)} device events, {len(gaps)} gaps")
for lo, hi in ((0, 2), (2, 5), (5, 20), (20, 100), (100, 1e12)):
    g = [x for x, _ in gaps if lo <= x < hi]
    print(f"  gaps {lo}-{hi if hi < 1e12 else 'inf'} us: {len(g)}, {sum(g) / 1e3:.2f} ms")
starts = [e["ts"] for e in host]


def host_at(ts):
    """The innermost host call running at ts (the last started that has not ended)."""
    i = bisect.bisect_right(starts, ts) - 1
    best = None
    while i >= 0 and ts - host[i]["ts"] < 50_000:
        e = host[i]
        if e["ts"] + e["dur"] >= ts and (best is None or e["dur"] < best["dur"]):
            best = e
        i -= 1
    return best["name"][:90] if best else "-"


print("longest gaps (us, what the host ran then):")
for g, at in sorted(gaps, reverse=True)[:top]:
    print(f"  {g:9.1f}  {host_at(at + g / 2)}")
rt = collections.defaultdict(list)
for e in host:
    if e.get("cat") == "cuda_runtime":
        rt[e["name"]].append(e["dur"])
print("host CUDA runtime calls by total time (ms, count, mean us, max us):")
for name, ds in sorted(rt.items(), key=lambda kv: -sum(kv[1]))[:top]:
    print(f"  {sum(ds) / 1e3:8.2f} {len(ds):6d} {sum(ds) / len(ds):8.1f} {max(ds):8.1f}  {name[:60]}")
tot = collections.Counter()
cnt = collections.Counter()
for e in gpu:
    name = e["name"]
    for pre in ("void ", "strata::moe::(anonymous namespace)::", "(anonymous namespace)::"):
        name = name.replace(pre, "")
    name = name.split("(")[0][:80]
    tot[name] += e["dur"]
    cnt[name] += 1
print("kernels by total time (ms, count):")
for name, t in tot.most_common(top):
    print(f"  {t / 1e3:8.2f} {cnt[name]:6d}  {name}")
