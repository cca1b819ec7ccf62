"""Each kernel's exclusive time in a chrome trace of graph replays (profile_window.py --trace):
a kernel's span less what overlaps the kernels that started before it (a programmatic
dependent's wait for its primary is the primary's time), summed by name, per window.

    python3 docs/bench/s49/device/trace_exclusive.py TRACE.json [REPLAYS=5] [ROWS=30]
"""
import json, sys, collections
d = json.load(open(sys.argv[1]))
ev = [e for e in d["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
ev.sort(key=lambda e: e["ts"])
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
end_max = None
excl = collections.defaultdict(float); span = collections.defaultdict(float); cnt = collections.Counter()
gaps = 0.0
t0 = ev[0]["ts"]; tend = max(e["ts"] + e["dur"] for e in ev)
for e in ev:
    s, t = e["ts"], e["ts"] + e["dur"]
    name = e["name"]
    for pre in ("void ", "strata::moe::(anonymous namespace)::", "(anonymous namespace)::"):
        name = name.replace(pre, "")
    name = name.split("(")[0][:70]
    if end_max is None:
        ex = t - s
    else:
        if s > end_max: gaps += s - end_max
        ex = max(0.0, t - max(s, end_max))
    end_max = t if end_max is None else max(end_max, t)
    excl[name] += ex; span[name] += e["dur"]; cnt[name] += 1
tot = tend - t0
print(f"timeline {tot/reps:.1f} us/window, gaps {gaps/reps:.1f}, exclusive sum {sum(excl.values())/reps:.1f}")
for n, v in sorted(excl.items(), key=lambda kv: -kv[1])[:int(sys.argv[3]) if len(sys.argv)>3 else 30]:
    print(f"{v/reps:8.1f} excl {span[n]/reps:8.1f} span {cnt[n]/reps:5.1f}x  {n}")
