#!/usr/bin/env python3
"""Parity check, then micro-benchmark of the cyext GPU kernels against the torch reference.

    python scripts/bench_kernels.py --out outputs/bench_kernels.json   [--quick]
    python scripts/bench_kernels.py --moe --out outputs/bench_moe.json  [--quick]

Writes the JSON (every measurement) and a markdown table next to it (same name, .md).

What is measured
  * copy ceiling: a 4 GiB device-to-device copy, bytes read + written over its median time.
  * every op, cyext kernel and torch reference, median time per call over CUDA-graph replays
    (eager launches timed with CUDA events if a capture fails). Each captured sequence cycles
    through several disjoint sets of slots / outputs (>= 240 MB touched), so the K/V and state
    reads come from HBM rather than the 60 MB L2, as they would in a decode step.
  * achieved bandwidth = the bytes the op must move (K/V rows each group may see, states,
    snapshots or factors, inputs and outputs; nothing twice) / time, and its fraction of the
    copy ceiling.

Geometry (Qwen3-Next-like): attention Hq=16, Hkv=2, D=256, bf16, groups at the end of the context
so every group reads all `ctx` keys; delta rule H=32, Dk=Dv=128, writing snapshots (every row's
state) and, as decode windows do, factors (every row's [k | delta | decay]); conv C=8192, K=4;
commit L=12 linear-attention layers (the accepted rows' factors replayed onto the state). Window
rows G in {2, 4, 8}, groups NG in {1, 2, 4, 8}, contexts 256, 1K, 4K, 16K, 32K. Takes about a minute on an H200.

--moe: instead, the routed experts (moe_experts) at Qwen3-Next's shapes (E=512, top-10, H=2048,
I=512), bf16 and FP8 (128x128 blocks), 1 to 32 rows with uniform random routing, and linear_fp8
(plus the bf16 skinny kernel against F.linear) at the dense shapes. Per case: the median time
per call over graph replays (routings / weight copies rotate so reads come from HBM), the
distinct experts, the bytes that must be read (distinct experts' weights + scales, or the weight
+ scales), achieved GB/s, % of the copy ceiling and the byte-floor time (bytes / ceiling).
--moe-variants compares launch variants (the streamed kernels against the per-block ones: the
same bits, checked); --moe-shared adds the expert every row routes to, as the engine folds the
shared expert into the call (E=513, top-11).

--conv: instead, causal_conv_window at C=8192, K=4 (bf16 x and state) and 1-16 window rows,
the per-(channel, row) conv_kernel against the earlier serial kernel (STRATA_CONV_SERIAL):
median time per call over graph replays (state slots rotate so they come from HBM) and whether
both give the same bits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from strata.kernels import cyext_ops as C  # noqa: E402
from strata.kernels import reference as R  # noqa: E402

DEV = torch.device("cuda")
ROTATE_BYTES = 240 << 20  # > 4x the H200's L2


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def copy_ceiling(nbytes: int = 4 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def time_calls(calls, budget_s: float = 0.04, min_calls: int = 32) -> tuple[float, str]:
    """Median seconds per call of the sequence `calls` (list of closures), graph-replayed.
    The sequence is repeated to at least `min_calls` launches so the graph launch is amortised."""
    calls = list(calls) * max(1, -(-min_calls // len(calls)))
    for c in calls[: min(2, len(calls))]:
        c()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(20, max(3, budget_s / (est * len(calls)))))
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        graph.replay()
        torch.cuda.synchronize()
        run, mode = graph.replay, "graph"
    except Exception:  # noqa: BLE001 - fall back to eager launches
        torch.cuda.synchronize()

        def run():
            for c in calls:
                c()
        mode = "eager"
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3 / len(calls))
    return statistics.median(times), mode


# ---------------------------------------------------------------------------------------------
# parity


def parity() -> dict:
    res = {}
    torch.manual_seed(0)
    for ng, g, ctx in ((1, 2, 300), (3, 8, 5000), (8, 4, 33000)):
        S = ng + 1
        kc = torch.randn(S + 1, ctx, 2, 256, device=DEV, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(ng, g, 16, 256, device=DEV, dtype=torch.bfloat16)
        gs = torch.arange(ng, device=DEV)
        gp = torch.randint(0, ctx - g + 1, (ng,), device=DEV)
        n_ref = min(ng, 2)
        ref = R.grouped_window_attention(q[:n_ref].float(), kc.float(), vc.float(), gs[:n_ref],
                                         gp[:n_ref], ctx, 1 / 16)
        out = C.gpu_grouped_window_attention(q, kc, vc, gs, gp, ctx, 1 / 16)
        res[f"attention bf16 ng={ng} g={g} ctx={ctx}"] = rel_err(out[:n_ref], ref)
        kc = vc = ref = None
    ng, g, h, dk, dv = 4, 8, 32, 128, 128
    q = F.normalize(torch.randn(ng, g, h, dk, device=DEV), dim=-1).bfloat16()
    k = F.normalize(torch.randn(ng, g, h, dk, device=DEV), dim=-1).bfloat16()
    v = torch.randn(ng, g, h, dv, device=DEV).bfloat16()
    gg = -torch.rand(ng, g, h, device=DEV)
    beta = torch.rand(ng, g, h, device=DEV).bfloat16()
    st = torch.randn(ng + 1, h, dk, dv, device=DEV) * 0.1
    gs = torch.arange(ng, device=DEV)
    ro, rs = R.gated_delta_window(q, k, v, gg, beta, st, gs)
    co, cs = C.gpu_gated_delta_window(q, k, v, gg, beta, st, gs)
    res["gated_delta out"] = rel_err(co, ro)
    res["gated_delta snapshots"] = rel_err(cs, rs)
    # the commit from factors is the kernel's own snapshot, bit for bit: 0 expected
    factors = torch.empty(ng, g, h, dk + dv + 1, device=DEV)
    C.gpu_gated_delta_window(q, k, v, gg, beta, st, gs, factors=factors)
    acc = torch.arange(ng, device=DEV) % g
    rec = st[None].clone()
    C.gpu_commit_accepted(acc, gs, torch.zeros_like(gs), factors[None],
                          torch.zeros(1, ng, g, 1, 1, device=DEV), rec,
                          torch.zeros(1, ng + 1, 1, 1, device=DEV),
                          torch.zeros(ng + 1, dtype=torch.int64, device=DEV))
    res["gated_delta factors commit vs snapshot"] = rel_err(rec[0, gs], cs[gs, acc])
    x = torch.randn(ng, g, 8192, device=DEV, dtype=torch.bfloat16)
    cst = torch.randn(ng + 1, 8192, 3, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(8192, 4, device=DEV, dtype=torch.bfloat16)
    ro, rs = R.causal_conv_window(x, cst, w, gs)
    co, cs = C.gpu_causal_conv_window(x, cst, w, gs)
    res["causal_conv out"] = rel_err(co, ro)
    res["causal_conv snapshots"] = rel_err(cs, rs)
    torch.cuda.synchronize()
    return res


# ---------------------------------------------------------------------------------------------
# benchmarks


def bench_attention(records, ctxs, gs_rows, ngs, ceiling):
    hq, hkv, d = 16, 2, 256
    esize = 2
    for ctx in ctxs:
        slot_bytes = ctx * hkv * d * 2 * esize
        for ng in ngs:
            rot = int(min(256, max(2, math.ceil(ROTATE_BYTES / (ng * slot_bytes)))))
            nslots = ng * rot
            kc = torch.randn(nslots + 1, ctx, hkv, d, device=DEV, dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            for g in gs_rows:
                q = torch.randn(ng, g, hq, d, device=DEV, dtype=torch.bfloat16)
                gp = torch.full((ng,), ctx - g, device=DEV, dtype=torch.int64)
                slot_sets = [torch.arange(i * ng, (i + 1) * ng, device=DEV) for i in range(rot)]
                out = torch.empty_like(q)
                ws = torch.empty(max(1, C.attention_workspace_numel(q, kc, ctx)),
                                 dtype=torch.float32, device=DEV)
                need = ng * ctx * hkv * d * 2 * esize + 2 * q.numel() * esize
                calls = [(lambda s=s: C.gpu_grouped_window_attention(
                    q, kc, vc, s, gp, ctx, d ** -0.5, out=out, workspace=ws)) for s in slot_sets]
                t, mode = time_calls(calls)
                ref_calls = [(lambda s=s: R.grouped_window_attention(q, kc, vc, s, gp, ctx,
                                                                     d ** -0.5))
                             for s in slot_sets[: min(rot, 4)]]
                try:
                    tr, mode_r = time_calls(ref_calls)
                except torch.OutOfMemoryError:
                    tr, mode_r = float("nan"), "oom"
                torch.cuda.empty_cache()
                records.append(dict(op="grouped_window_attention", ng=ng, g=g, ctx=ctx,
                                    rows=g * hq // hkv, bytes=need, t_us=t * 1e6,
                                    t_ref_us=tr * 1e6, mode=mode, ref_mode=mode_r,
                                    gbps=need / t / 1e9, frac=need / t / ceiling,
                                    speedup=tr / t))
                print(f"attention ctx={ctx:6d} ng={ng} g={g}: {t * 1e6:8.1f} us "
                      f"{need / t / 1e9:7.0f} GB/s ({100 * need / t / ceiling:4.1f}% of copy) "
                      f"ref {tr * 1e6:9.1f} us", flush=True)
            kc = vc = None  # free before the next size
            torch.cuda.empty_cache()


def bench_delta(records, gs_rows, ngs, ceiling):
    h, dk, dv = 32, 128, 128
    sbytes = h * dk * dv * 4
    for ng in ngs:
        for g in gs_rows:
            per_call = ng * sbytes * (1 + g)
            rot = int(min(64, max(2, math.ceil(ROTATE_BYTES / per_call))))
            q = F.normalize(torch.randn(ng, g, h, dk, device=DEV), dim=-1).bfloat16()
            k = F.normalize(torch.randn(ng, g, h, dk, device=DEV), dim=-1).bfloat16()
            v = torch.randn(ng, g, h, dv, device=DEV).bfloat16()
            gg = -torch.rand(ng, g, h, device=DEV)
            beta = torch.rand(ng, g, h, device=DEV).bfloat16()
            st = torch.randn(ng * rot + 1, h, dk, dv, device=DEV) * 0.1
            outs = [torch.empty(ng, g, h, dv, device=DEV) for _ in range(rot)]
            snaps = [torch.empty(ng, g, h, dk, dv, device=DEV) for _ in range(rot)]
            slot_sets = [torch.arange(i * ng, (i + 1) * ng, device=DEV) for i in range(rot)]
            need = per_call + (q.numel() + k.numel() + v.numel()) * 2 + outs[0].numel() * 4
            calls = [(lambda i=i: C.gpu_gated_delta_window(q, k, v, gg, beta, st, slot_sets[i],
                                                           out=outs[i], snaps=snaps[i]))
                     for i in range(rot)]
            t, mode = time_calls(calls)
            snaps = None
            # the decode windows' form: each row's factors in place of its snapshot
            facs = [torch.empty(ng, g, h, dk + dv + 1, device=DEV) for _ in range(rot)]
            need_f = (ng * sbytes + facs[0].numel() * 4 + (q.numel() + k.numel() + v.numel()) * 2
                      + outs[0].numel() * 4)
            tf, mode_f = time_calls(
                [(lambda i=i: C.gpu_gated_delta_window(q, k, v, gg, beta, st, slot_sets[i],
                                                       out=outs[i], factors=facs[i]))
                 for i in range(rot)])
            ref_calls = [(lambda i=i: R.gated_delta_window(q, k, v, gg, beta, st, slot_sets[i]))
                         for i in range(min(rot, 4))]
            tr, mode_r = time_calls(ref_calls)
            records.append(dict(op="gated_delta_window", ng=ng, g=g, ctx=None, bytes=need,
                                t_us=t * 1e6, t_ref_us=tr * 1e6, mode=mode, ref_mode=mode_r,
                                gbps=need / t / 1e9, frac=need / t / ceiling, speedup=tr / t))
            records.append(dict(op="gated_delta_window factors", ng=ng, g=g, ctx=None,
                                bytes=need_f, t_us=tf * 1e6, t_ref_us=tr * 1e6, mode=mode_f,
                                ref_mode=mode_r, gbps=need_f / tf / 1e9,
                                frac=need_f / tf / ceiling, speedup=tr / tf))
            print(f"gated_delta ng={ng} g={g}: {t * 1e6:8.1f} us {need / t / 1e9:7.0f} GB/s "
                  f"({100 * need / t / ceiling:4.1f}%) ref {tr * 1e6:9.1f} us; factors "
                  f"{tf * 1e6:8.1f} us", flush=True)
            st = outs = snaps = facs = None
            torch.cuda.empty_cache()


def bench_small_ops(records, gs_rows, ngs, ceiling):
    c, kw = 8192, 4
    L, h, dk, dv = 12, 32, 128, 128
    for ng in ngs:
        for g in gs_rows:
            # causal conv
            x = torch.randn(ng, g, c, device=DEV, dtype=torch.bfloat16)
            cst = torch.randn(ng + 1, c, kw - 1, device=DEV, dtype=torch.bfloat16)
            w = torch.randn(c, kw, device=DEV, dtype=torch.bfloat16)
            gs = torch.arange(ng, device=DEV)
            need = (x.numel() * 2 + ng * c * (kw - 1) * 2 + w.numel() * 2 + x.numel() * 2
                    + x.numel() * (kw - 1) * 2)
            t, mode = time_calls([lambda: C.gpu_causal_conv_window(x, cst, w, gs)])
            tr, mode_r = time_calls([lambda: R.causal_conv_window(x, cst, w, gs)])
            records.append(dict(op="causal_conv_window", ng=ng, g=g, ctx=None, bytes=need,
                                t_us=t * 1e6, t_ref_us=tr * 1e6, mode=mode, ref_mode=mode_r,
                                gbps=need / t / 1e9, frac=need / t / ceiling, speedup=tr / t))
            # commit (L layers of recurrent + conv state): the accepted rows' factors replayed
            # onto the state in place (decay in (0, 1): repeated commits stay finite)
            fw = dk + dv + 1
            rec_factors = torch.randn(L, ng, g, h, fw, device=DEV) * 0.1
            rec_factors[..., -1] = torch.rand(L, ng, g, h, device=DEV)
            conv_snaps = torch.zeros(L, ng, g, c, kw - 1, device=DEV, dtype=torch.bfloat16)
            rec_state = torch.zeros(L, ng + 1, h, dk, dv, device=DEV)
            conv_state = torch.zeros(L, ng + 1, c, kw - 1, device=DEV, dtype=torch.bfloat16)
            slot_pos = torch.zeros(ng + 1, dtype=torch.int64, device=DEV)
            acc = torch.randint(0, g, (ng,), device=DEV)
            gp = torch.zeros(ng, dtype=torch.int64, device=DEV)
            args = (acc, gs, gp, rec_factors, conv_snaps, rec_state, conv_state, slot_pos)
            need_c = (2 * L * ng * (h * dk * dv * 4 + c * (kw - 1) * 2)
                      + L * int((acc + 1).sum()) * h * fw * 4)
            t2, mode2 = time_calls([lambda: C.gpu_commit_accepted(*args)])
            tr2, mode_r2 = time_calls([lambda: R.commit_accepted(*args)])
            records.append(dict(op="commit_accepted", ng=ng, g=g, ctx=None, layers=L,
                                bytes=need_c, t_us=t2 * 1e6, t_ref_us=tr2 * 1e6, mode=mode2,
                                ref_mode=mode_r2, gbps=need_c / t2 / 1e9,
                                frac=need_c / t2 / ceiling, speedup=tr2 / t2))
            # write_kv
            kc = torch.empty(ng + 1, 4096, 2, 256, device=DEV, dtype=torch.bfloat16)
            vc = torch.empty_like(kc)
            k = torch.randn(ng, g, 2, 256, device=DEV, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            gpos = torch.full((ng,), 100, device=DEV, dtype=torch.int64)
            need_w = 4 * k.numel() * 2
            t3, mode3 = time_calls([lambda: C.gpu_write_kv(kc, vc, k, v, gs, gpos)])
            tr3, mode_r3 = time_calls([lambda: R.write_kv(kc, vc, k, v, gs, gpos)])
            records.append(dict(op="write_kv", ng=ng, g=g, ctx=None, bytes=need_w,
                                t_us=t3 * 1e6, t_ref_us=tr3 * 1e6, mode=mode3, ref_mode=mode_r3,
                                gbps=need_w / t3 / 1e9, frac=need_w / t3 / ceiling,
                                speedup=tr3 / t3))
            print(f"conv ng={ng} g={g}: {t * 1e6:6.1f} us (ref {tr * 1e6:7.1f}); commit L={L}: "
                  f"{t2 * 1e6:7.1f} us {need_c / t2 / 1e9:6.0f} GB/s (ref {tr2 * 1e6:7.1f}); "
                  f"write_kv {t3 * 1e6:5.1f} us (ref {tr3 * 1e6:6.1f})", flush=True)
            rec_factors = conv_snaps = rec_state = conv_state = kc = vc = None
            torch.cuda.empty_cache()


#: (groups, rows per group) of the conv comparison: 1 to 16 window rows.
CONV_SHAPES = ((1, 1), (1, 2), (1, 4), (2, 2), (4, 2), (2, 4), (8, 2), (4, 4), (16, 1))


def bench_conv(records) -> bool:
    """conv_kernel vs conv_serial_kernel (same bits?); returns whether every shape matched."""
    c, kw, sets = 8192, 4, 8
    all_same = True
    for ng, g in CONV_SHAPES:
        xs = [torch.randn(ng, g, c, device=DEV, dtype=torch.bfloat16) for _ in range(sets)]
        cst = torch.randn(sets * ng + 1, c, kw - 1, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(c, kw, device=DEV, dtype=torch.bfloat16)
        gss = [torch.arange(i * ng, (i + 1) * ng, device=DEV) for i in range(sets)]
        res = {}
        for serial in (True, False):
            C.conv_launch_options(serial=serial)
            out = C.gpu_causal_conv_window(xs[0], cst, w, gss[0])
            t, mode = time_calls([lambda i=i: C.gpu_causal_conv_window(xs[i], cst, w, gss[i])
                                  for i in range(sets)])
            res[serial] = (t, mode, out)
        C.conv_launch_options(serial=False)
        same = all(torch.equal(a, b) for a, b in zip(res[True][2], res[False][2]))
        all_same &= same
        rec = dict(op="causal_conv_window", ng=ng, g=g, c=c, kw=kw, t_us=res[False][0] * 1e6,
                   t_serial_us=res[True][0] * 1e6, mode=res[False][1], same_bits=same)
        records.append(rec)
        print(f"conv ng={ng:2d} g={g}: {rec['t_us']:6.2f} us  serial {rec['t_serial_us']:6.2f} us"
              f"  ({rec['t_serial_us'] / rec['t_us']:.1f}x)  same bits: {same}", flush=True)
    return all_same


def markdown(meta, parity_res, records) -> str:
    lines = [f"# cyext kernel benchmark ({meta['device']})", "",
             f"copy ceiling (4 GiB D2D, read+write): **{meta['copy_gbps']:.0f} GB/s**; "
             f"kernels: {meta['platform']}, times are medians per call over CUDA-graph replays "
             f"with L2-cold rotating inputs.", "", "## Parity (relative error vs reference)", "",
             "| check | rel err |", "| --- | --- |"]
    lines += [f"| {k} | {v:.2e} |" for k, v in parity_res.items()]
    for op in ("grouped_window_attention", "gated_delta_window", "gated_delta_window factors",
               "commit_accepted", "causal_conv_window", "write_kv"):
        rows = [r for r in records if r["op"] == op]
        if not rows:
            continue
        lines += ["", f"## {op}", "",
                  "| ctx | NG | G | bytes (MB) | cyext (us) | GB/s | % of copy | torch (us) | "
                  "speedup |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            lines.append(f"| {r['ctx'] if r['ctx'] is not None else '-'} | {r['ng']} | {r['g']} | "
                         f"{r['bytes'] / 1e6:.2f} | {r['t_us']:.1f} | {r['gbps']:.0f} | "
                         f"{100 * r['frac']:.1f} | {r['t_ref_us']:.1f} | {r['speedup']:.1f}x |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# routed experts and the FP8 / bf16 skinny linear (--moe)

MOE_SHAPE = dict(E=512, k=10, H=2048, I=512)
MOE_ROWS = (1, 2, 4, 8, 16, 32)
DENSE_SHAPES = ((12288, 2048), (8192, 2048), (2048, 4096), (1024, 2048))
FP8_BLOCK = (128, 128)
#: The streamed FP8 linear's forms by their launch switches (the default: split, in pairs).
LINEAR_FORMS = {
    "linear_fp8_unsplit": dict(linear_split=False, linear_pipe=False),
    "linear_fp8_piped": dict(linear_split=False, linear_pipe=True),
    "linear_fp8_split": dict(linear_split=True, linear_split_pair=False),
    "linear_fp8_split_pair": dict(linear_split=True, linear_split_pair=True),
    "linear_fp8_split_f16": dict(linear_split=True, linear_split_pair=False, linear_f16=True),
    "linear_fp8_split_pair_f16": dict(linear_split=True, linear_split_pair=True,
                                      linear_f16=True),
}


def split_depth_forms(depths) -> dict:
    """The split form in pairs with its ring capped at d tile slots in flight, per d."""
    return {f"linear_fp8_split_pair_d{d}": dict(linear_split=True, linear_split_pair=True,
                                                 linear_split_depth=int(d)) for d in depths}


def _fp8_weight(shape, block, gen_seed=0):
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    w = (torch.randn(*shape, device=DEV, generator=g) * 40).clamp(-440, 440).to(torch.float8_e4m3fn)
    lead, (o, i) = shape[:-2], shape[-2:]
    s = torch.rand(*lead, -(-o // block[0]), -(-i // block[1]), device=DEV, generator=g) * 1e-3
    return w, s


def _moe_weights(fp8: bool, E: int = MOE_SHAPE["E"]):
    H, I = MOE_SHAPE["H"], MOE_SHAPE["I"]
    if fp8:
        wgu, gs = _fp8_weight((E, 2 * I, H), FP8_BLOCK, 1)
        wd, ds = _fp8_weight((E, H, I), FP8_BLOCK, 2)
        # gate/up scales: gate block rows then up block rows (same count here: I % 128 == 0)
        return wgu, wd, gs, ds, FP8_BLOCK
    wgu = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) / 45
    wd = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) / 22
    return wgu, wd, None, None, None


#: moe_experts launch switches compared by --moe-variants (cyext_ops.moe_launch_options):
#: the streamed kernels (sm_90+) with the gate/up on CUDA cores ("stream") and on tensor cores
#: ("stream-mma": FP8's default, other bits; "-nosplit": the down kernel's items whole
#: experts; "-runsG": its member runs G long at every row count from 3), then the per-block
#: kernels' switches.
MOE_VARIANTS = {"stream": dict(pdl=True, stream=True, stream_all=True, gate_up_mma=False),
                "stream-mma": dict(pdl=True, stream=True, stream_all=True, gate_up_mma=True),
                "stream-nopdl": dict(pdl=False, stream=True, stream_all=True, gate_up_mma=False),
                "stream-mma-nopdl": dict(pdl=False, stream=True, stream_all=True, gate_up_mma=True),
                # a window's gate/up and down in one grid (moe_launch_options(fused=))
                "stream-mma-fused": dict(pdl=True, stream=True, stream_all=True, gate_up_mma=True,
                                         fused=True),
                "stream-mma-nosplit": dict(pdl=True, stream=True, stream_all=True, gate_up_mma=True,
                                           down_split=False),
                **{f"stream-mma-runs{g}": dict(pdl=True, stream=True, stream_all=True,
                                               gate_up_mma=True, down_split_runs=g)
                   for g in (1, 2, 4, 8)},
                "plain": dict(pdl=False, early=False, wide=False, db=False, xsmem=False, stream=False,
                              gate_up_mma=False),
                "pdl+early": dict(pdl=True, early=True, wide=False, db=False, xsmem=False, stream=False),
                "+db": dict(pdl=True, early=True, wide=False, db=True, xsmem=False, stream=False),
                "+xsmem": dict(pdl=True, early=True, wide=False, db=False, xsmem=True, stream=False),
                "+db+xsmem": dict(pdl=True, early=True, wide=False, db=True, xsmem=True, stream=False),
                "wide": dict(pdl=False, early=False, wide=True, db=False, xsmem=False, stream=False),
                "all": dict(pdl=True, early=True, wide=True, db=True, xsmem=False, stream=False)}


def moe_ids(n: int, E: int, k: int, shared: bool, generator=None, device=DEV) -> torch.Tensor:
    """(n, k) expert ids: uniform top-k of E, or (shared) top-(k - 1) of the first E - 1 and the
    last id in every row, as the engine folds its shared expert in."""
    routed = E - 1 if shared else E
    idx = torch.stack([torch.randperm(routed, device=device, generator=generator)[:k - (E - routed)]
                       for _ in range(n)])
    if shared:
        idx = torch.cat([idx, torch.full_like(idx[:, :1], E - 1)], 1)
    return idx


def bench_moe(records, rows_list, ceiling, sets: int = 8, variants=("default",), shared=False):
    """shared: E + 1 experts and top-(k + 1) with the last id every row's (the engine's folded
    shared expert), else uniform top-k of E."""
    E, k, H, I = (MOE_SHAPE[n] for n in ("E", "k", "H", "I"))
    if shared:
        E, k = E + 1, k + 1
    defaults = C.moe_launch_options()
    for fp8, variant in ((f, v) for f in (True, False) for v in variants):
        C.moe_launch_options(**defaults)  # (a variant sets only its own switches)
        if variant != "default":
            C.moe_launch_options(**MOE_VARIANTS[variant])
        wgu, wd, gs, ds, block = _moe_weights(fp8, E)
        per_expert = wgu[0].numel() * wgu.element_size() + wd[0].numel() * wd.element_size()
        if fp8:
            per_expert += (gs[0].numel() + ds[0].numel()) * 4
        for n in rows_list:
            xs, ws, ids, outs, distinct = [], [], [], [], []
            for _ in range(sets):
                idx = moe_ids(n, E, k, shared)
                w = torch.rand(n, k, device=DEV)
                ids.append(idx)
                ws.append(w / w.sum(-1, keepdim=True))
                xs.append(torch.randn(n, H, device=DEV, dtype=torch.bfloat16))
                outs.append(torch.empty(n, H, device=DEV, dtype=torch.bfloat16))
                distinct.append(idx.unique().numel())
            work = torch.empty(C.moe_workspace_numel(n, k, I), device=DEV)
            got = C.gpu_moe_experts(xs[0], wgu, wd, ws[0], ids[0], gs, ds, block)
            err = rel_err(got, R.moe_experts(xs[0], wgu, wd, ws[0], ids[0], gs, ds, block))
            # every launch variant gives the same bits, but the tensor-core gate/up (its own)
            if variant != "default" and not MOE_VARIANTS[variant].get("gate_up_mma"):
                saved = C.moe_launch_options()
                C.moe_launch_options(**MOE_VARIANTS["plain"])
                same = torch.equal(got, C.gpu_moe_experts(xs[0], wgu, wd, ws[0], ids[0], gs,
                                                          ds, block))
                C.moe_launch_options(**saved)
                if not same:
                    err = float("nan")  # fails the run
            calls = [(lambda i=i: C.gpu_moe_experts(xs[i], wgu, wd, ws[i], ids[i], gs, ds,
                                                    block, out=outs[i], workspace=work))
                     for i in range(sets)]
            t, mode = time_calls(calls)
            d = statistics.mean(distinct)
            nbytes = d * per_expert
            rec = dict(op="moe_experts", weights="fp8" if fp8 else "bf16", variant=variant, rows=n, k=k,
                       shared=shared,
                       distinct=d, bytes=nbytes, t_us=t * 1e6, gbps=nbytes / t / 1e9,
                       frac=nbytes / t / ceiling, floor_us=nbytes / ceiling * 1e6, mode=mode,
                       rel_err=err)
            records.append(rec)
            print(f"moe_experts {rec['weights']:4s} {variant:9s} rows {n:2d}: {rec['t_us']:8.1f} us  "
                  f"distinct {d:5.1f}  {nbytes / 1e6:7.1f} MB  {rec['gbps']:6.0f} GB/s  "
                  f"{100 * rec['frac']:5.1f}% of copy  floor {rec['floor_us']:7.1f} us  "
                  f"err {err:.1e}", flush=True)
        del wgu, wd, gs, ds
        torch.cuda.empty_cache()
    C.moe_launch_options(**defaults)


def bench_linear(records, rows_list, ceiling, split_depths=(), shapes=DENSE_SHAPES):
    for o, i in shapes:
        w8, s8 = _fp8_weight((o, i), FP8_BLOCK, 3)
        wb = torch.randn(o, i, device=DEV, dtype=torch.bfloat16) / 45
        b8 = w8.numel() + s8.numel() * 4
        copies = max(1, -(-ROTATE_BYTES // b8))
        w8s = [w8] + [w8.clone() for _ in range(copies - 1)]
        copies_b = max(1, -(-ROTATE_BYTES // (wb.numel() * 2)))
        wbs = [wb] + [wb.clone() for _ in range(copies_b - 1)]
        for n in rows_list:
            x = torch.randn(n, i, device=DEV, dtype=torch.bfloat16)
            y = torch.empty(n, o, device=DEV, dtype=torch.bfloat16)
            err = rel_err(C.gpu_linear_fp8(x, w8, s8, FP8_BLOCK),
                          R.linear_fp8(x, w8, s8, FP8_BLOCK))
            def form(switches, w):  # linear_fp8 with these launch switches set
                prev = C.moe_launch_options()
                C.moe_launch_options(**switches)
                try:
                    C.gpu_linear_fp8(x, w, s8, FP8_BLOCK, out=y)
                finally:
                    C.moe_launch_options(**prev)

            # the streamed kernel's forms, its ring capped, and (linear_stream off) the skinny
            # kernel
            forms = {**LINEAR_FORMS, **split_depth_forms(split_depths),
                     "linear_fp8_skinny": dict(linear_stream=False)}
            cases = [("linear_fp8", b8, [(lambda w=w: C.gpu_linear_fp8(x, w, s8, FP8_BLOCK,
                                                                        out=y)) for w in w8s])]
            cases += [(name, b8, [(lambda w=w, sw=sw: form(sw, w)) for w in w8s])
                      for name, sw in forms.items()]
            cases += [
                ("linear_bf16_skinny", wb.numel() * 2,
                 [(lambda w=w: C.gpu_linear_bf16_skinny(x, w, out=y)) for w in wbs]),
                ("F.linear_bf16", wb.numel() * 2,
                 [(lambda w=w: torch.nn.functional.linear(x, w)) for w in wbs]),
            ]
            # bits: the piped form is the unsplit one's; pairs, ring depths and f16 operands
            # (x's rows in range here) are the split form's
            ref = R.linear_fp8(x, w8, s8, FP8_BLOCK)
            outs = {}
            for name, sw in forms.items():
                form(sw, w8)
                outs[name] = y.clone()
            same_as = {"linear_fp8_piped": "linear_fp8_unsplit"}
            same_as.update({name: "linear_fp8_split" for name in forms
                            if name.startswith("linear_fp8_split_")})
            for name, nbytes, calls in cases:
                t, mode = time_calls(calls)
                rec = dict(op=name, o=o, i=i, rows=n, bytes=nbytes, t_us=t * 1e6,
                           gbps=nbytes / t / 1e9, frac=nbytes / t / ceiling,
                           floor_us=nbytes / ceiling * 1e6, mode=mode,
                           rel_err=err if name == "linear_fp8" else
                           rel_err(outs[name], ref) if name in outs else None)
                if name in same_as:
                    rec["same_bits"] = torch.equal(outs[name], outs[same_as[name]])
                records.append(rec)
                print(f"{name:25s} {o:5d}x{i:<5d} rows {n:2d}: {rec['t_us']:7.1f} us  "
                      f"{nbytes / 1e6:6.1f} MB  {rec['gbps']:6.0f} GB/s  "
                      f"{100 * rec['frac']:5.1f}% of copy  floor {rec['floor_us']:6.1f} us"
                      + ("" if "same_bits" not in rec else
                         "  same bits" if rec["same_bits"] else "  BITS DIFFER")
                      + ("" if rec["rel_err"] is None else f"  err {rec['rel_err']:.1e}"),
                      flush=True)
        del w8s, wbs
        torch.cuda.empty_cache()


def markdown_moe(meta, records) -> str:
    lines = [f"# routed experts and skinny linear ({meta['device']})", "",
             f"copy ceiling (4 GiB D2D, read+write): **{meta['copy_gbps']:.0f} GB/s**; median "
             f"time per call over CUDA-graph replays, reads from HBM.", "",
             "| op | weights / shape | rows | distinct experts | MB read | time (us) | GB/s | "
             "% of copy | floor (us) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        what = r.get("weights") or f"{r['o']}x{r['i']}"
        if r.get("variant") not in (None, "default"):
            what += f" ({r['variant']})"
        lines.append(f"| {r['op']} | {what} | {r['rows']} | {r.get('distinct', '-')} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['t_us']:.1f} | {r['gbps']:.0f} | "
                     f"{100 * r['frac']:.1f} | {r['floor_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON path (the .md goes next to it)")
    ap.add_argument("--quick", action="store_true", help="a small grid (smoke test)")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--moe", action="store_true",
                    help="only the routed experts and the FP8 / bf16 skinny linear")
    ap.add_argument("--moe-variants", nargs="?", const="all", default=None,
                    help="with --moe: launch variants of moe_experts: 'all' (the default when "
                         "given alone: the streamed kernels, PDL, early loads, double-buffered "
                         "down, x in shared memory) or a comma list of "
                         + ", ".join(MOE_VARIANTS))
    ap.add_argument("--no-linear", action="store_true", help="with --moe: skip the linear layers")
    ap.add_argument("--no-moe", action="store_true",
                    help="with --moe: only the linear layers (linear_fp8 streamed and skinny, "
                         "the bf16 skinny kernel, F.linear)")
    ap.add_argument("--split-depths", default="",
                    help="with --moe: also the split FP8 linear in pairs with its ring capped at "
                         "each of these tile slots in flight (comma list of 1-15)")
    ap.add_argument("--linear-shapes", default="",
                    help="with --moe: only these linear shapes, OxI comma-separated (default: "
                         + ", ".join(f"{o}x{i}" for o, i in DENSE_SHAPES) + ")")
    ap.add_argument("--moe-shared", action="store_true",
                    help="with --moe: one more expert that every row routes to, as the engine "
                         "folds the shared expert in (E=513, top-11)")
    ap.add_argument("--conv", action="store_true",
                    help="only causal_conv_window: the conv kernel against the earlier serial one")
    args = ap.parse_args()
    if not torch.cuda.is_available() or C.gpu_platform() is None:
        print("bench_kernels: needs a GPU and the built strata_cuda extension", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = dict(device=torch.cuda.get_device_name(), platform=C.gpu_platform(),
                torch=torch.__version__, sm_count=torch.cuda.get_device_properties(0)
                .multi_processor_count)
    meta["copy_gbps"] = copy_ceiling() / 1e9
    print(f"device {meta['device']}: copy ceiling {meta['copy_gbps']:.0f} GB/s", flush=True)
    if args.moe:
        return main_moe(args, meta, t_start)
    if args.conv:
        records: list[dict] = []
        same = bench_conv(records)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)
        print(f"wrote {args.out}", flush=True)
        return 0 if same else 1
    parity_res = {} if args.skip_parity else parity()
    bad = {k: v for k, v in parity_res.items() if not v <= 2e-2}
    for k, v in parity_res.items():
        print(f"parity {k}: {v:.2e}{'  FAIL' if k in bad else ''}", flush=True)
    ceiling = meta["copy_gbps"] * 1e9
    if args.quick:
        ctxs, gs_rows, ngs = [1024, 32768], [2, 8], [1, 8]
    else:
        ctxs, gs_rows, ngs = [256, 1024, 4096, 16384, 32768], [2, 4, 8], [1, 2, 4, 8]
    records: list[dict] = []
    bench_attention(records, ctxs, gs_rows, ngs, ceiling)
    bench_delta(records, gs_rows, ngs, ceiling)
    bench_small_ops(records, gs_rows, [1, 8] if not args.quick else [8], ceiling)
    meta["seconds"] = time.perf_counter() - t_start
    out = args.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(meta=meta, parity=parity_res, records=records), f, indent=1)
    md = os.path.splitext(out)[0] + ".md"
    with open(md, "w") as f:
        f.write(markdown(meta, parity_res, records))
    print(f"wrote {out} and {md} in {meta['seconds']:.0f} s", flush=True)
    return 1 if bad else 0


def main_moe(args, meta, t_start) -> int:
    ceiling = meta["copy_gbps"] * 1e9
    rows = (1, 8, 32) if args.quick else MOE_ROWS
    records: list[dict] = []
    if args.moe_variants is None:
        variants = ("default",)
    elif args.moe_variants == "all":
        variants = tuple(MOE_VARIANTS)
    else:
        variants = tuple(v.strip() for v in args.moe_variants.split(","))
        unknown = [v for v in variants if v not in MOE_VARIANTS]
        if unknown:
            print(f"bench_kernels: unknown --moe-variants {unknown}; known: "
                  f"{', '.join(MOE_VARIANTS)}", file=sys.stderr)
            return 2
    if not args.no_moe:
        bench_moe(records, rows, ceiling, variants=variants, shared=args.moe_shared)
    if not args.no_linear:
        depths = tuple(int(d) for d in args.split_depths.split(",") if d.strip())
        if any(not 1 <= d <= 15 for d in depths):
            print(f"bench_kernels: --split-depths {args.split_depths!r}: each in 1..15",
                  file=sys.stderr)
            return 2
        shapes = DENSE_SHAPES
        if args.linear_shapes:
            try:
                shapes = tuple(tuple(int(v) for v in t.lower().split("x"))
                               for t in args.linear_shapes.split(","))
                assert all(len(t) == 2 for t in shapes)
            except (ValueError, AssertionError):
                print(f"bench_kernels: --linear-shapes {args.linear_shapes!r} is not OxI,...",
                      file=sys.stderr)
                return 2
        bench_linear(records, rows, ceiling, split_depths=depths, shapes=shapes)
    meta["seconds"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(markdown_moe(meta, records))
    print(f"wrote {args.out} and {md} in {meta['seconds']:.0f} s", flush=True)
    bad = [r for r in records if r.get("rel_err") is not None and not r["rel_err"] <= 2e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
