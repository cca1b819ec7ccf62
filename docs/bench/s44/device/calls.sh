#!/usr/bin/env bash
# Session 44's device calls. Each fits one call's 600 s.
# H200: session 43's step a (docs/bench/s43/device/calls.sh a: the full-depth goal figures).
#   a1 the solo half of that step alone (a call that must fit less device time): solo spec 4
#      with and without engine.draft_vocab=32768 in one process on a bare machine (the first
#      engine's warm-up line is the warm-up goal's figure)
# Any GPU:
#   r  which kernels cold compiles still configure differently: torch's reduction heuristics
#      as installed (its persistent-reduction and reduction config lists, and whether it has
#      the determinism filter), then two cold 4-layer warm-ups side by side (no compile workers
#      and two, batch_mtp W16 N=8) and, for every .best_config that differs, the kernel it
#      configures and its source from both caches (kernel_of_config.py)
#   pf where a prompt chunk goes with the contracting FP8 projections dequantised in prompt
#      chunks (this tree) and on the streamed FP8 kernel's 16-row launches (the base tree):
#      8 layers, one slot's 64-token chunk and eight slots' (512 rows), graph replay
#   n  Nsight Compute on the routed experts' wide launches of 64 and 512 rows (stage_x, the
#      wide gate/up, the down kernel; uniform top-10 of 512, FP8; NCU_ARGS="--prompt --shared":
#      as a prompt chunk launches them, with the folded shared expert), before changing them
#   td the embedded model with inductor's deterministic mode in effect and off
#      (TORCHINDUCTOR_DETERMINISTIC=0), one after the other, each on a cold cache of its own:
#      solo (N=1) and batch_mtp W16 (N=8), 64-token code prompts, overlap on, 3 repeats
# Carry .whl, .dev/s43 (the tree's CUDA extension for Python 3.12, stripped, xz; the kernel
# sources are unchanged since) and .dev/s44tree (the base tree: main's strata/ conf/ scripts/ as
# of 1a2b69a, git archive, xz).
set -u
. docs/bench/device_common.sh .dev/s43/new_cuda.so.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
base_tree() {
  [ -d /tmp/base/strata ] && return
  mkdir -p /tmp/base && tar xJf .dev/s44tree/tree.tar.xz -C /tmp/base \
    && cp strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so /tmp/base/strata/kernels/
}
# `inbase NAME LIMIT CMD...`: st in the base tree
inbase() { base_tree; (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base st "$@"); }
case ${1:-r} in
td)
  T="--configs solo,batch_mtp_w16 --n 1,8 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --no-reverse"
  TAIL=6 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_d1 st tiny_det 170 python3 scripts/bench_engine.py $T --json $R/tiny_det.json
  TAIL=6 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_d0 TORCHINDUCTOR_DETERMINISTIC=0 st tiny_nodet 170 python3 scripts/bench_engine.py $T --json $R/tiny_nodet.json
  grep -h "warm-up: \|rep [0-9]" $R/tiny_det.log $R/tiny_nodet.log ;;
a1)
  TAIL=10 st solo4 300 python3 scripts/bench_engine.py $F --configs solo,solo_draft32k --n 1 --max-tokens 256 --repeats 2 --json $R/solo4.json
  grep -h "warm-up: \|compile workers" $R/solo4.log ;;
n)
  TAIL=4 st ncu${NCU_ARGS:+_prompt} 300 ncu --clock-control none --kernel-name regex:moe_ --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section LaunchStats \
    python3 scripts/ncu_moe.py --rows 64,512 --variants stream-mma --weights fp8 ${NCU_ARGS:-}
  grep -h "moe_\|Duration\|DRAM Throughput\|L2 Cache Throughput\|Warp Cycles Per Issued\|Stall\|Eligible Warps\|Registers Per\|Achieved Occupancy" $R/ncu${NCU_ARGS:+_prompt}.log | head -80 ;;
pf)
  PP="scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 --backend auto --compile --shapes 1x1 --iters 20 --top 30"
  TAIL=3 st prefill8 200 python3 $PP --prefill 64 --prefill-slots 8 --json $R/prefill8.json
  TAIL=3 inbase prefill8_base 200 python3 $PP --prefill 64 --prefill-slots 8 --json $R/prefill8_base.json
  TAIL=3 st prefill1 120 python3 $PP --prefill 64 --json $R/prefill1.json
  TAIL=3 inbase prefill1_base 120 python3 $PP --prefill 64 --json $R/prefill1_base.json
  grep -h "=== prompt chunk\|^graph replay:" $R/prefill*.log ;;
r)
  python3 - > $R/heuristics.txt 2>&1 <<'PY'
import inspect, torch
from torch._inductor.runtime import triton_heuristics as th
import torch._inductor.config as c
print(torch.__version__)
print("filter:", hasattr(th, "filter_reduction_configs_for_determinism"))
print("force_filter:", getattr(getattr(c, "test_configs", None), "force_filter_reduction_configs", "absent"))
for name in ("filter_reduction_configs_for_determinism", "persistent_reduction", "reduction", "_persistent_reduction_configs"):
    f = getattr(th, name, None)
    print(f"===== {name}\n" + (inspect.getsource(f) if f else "absent"))
PY
  head -3 $R/heuristics.txt
  W="$F --layers 4 --configs batch_mtp_w16 --n 8 --max-tokens 64"
  for RUN in c1:0 c2:2; do
    IFS=: read NAME N <<< "$RUN"
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$NAME TRITON_CACHE_DIR=/tmp/ind_$NAME/triton timeout 230 python3 scripts/bench_engine.py $W --repeats 1 --compile-workers $N --json $R/fp8_$NAME.json > $R/fp8_$NAME.log 2>&1 &
  done
  wait
  for N in c1 c2; do grep -h "warm-up: 60\|compile workers: \|rep 0" $R/fp8_$N.log | sed "s/^/$N: /"; done
  python3 - $R/fp8_c1.json $R/fp8_c2.json <<'PY'
import json, sys
a, b = (json.load(open(p))["summary"] for p in sys.argv[1:3])
for k in a:
    if k in b and "text_digest" in a[k]:
        print(k, "identical" if a[k]["text_digest"] == b[k]["text_digest"] else "DIFFERENT",
              a[k]["text_digest"], b[k]["text_digest"])
PY
  python3 docs/bench/s44/device/kernel_of_config.py /tmp/ind_c1 /tmp/ind_c2 $R/kernels > $R/kernels.txt 2>&1
  grep -v "triton_poi" $R/kernels.txt | head -20
  echo "inductor_meta of the cold cache's kernels:"; grep -rho "'deterministic': [A-Za-z]*" /tmp/ind_c1 --include=*.py | sort | uniq -c
  tar czf $OUT/r.tgz -C $OUT r ;;
esac
