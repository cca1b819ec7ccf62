#!/usr/bin/env bash
# Session 42's device calls. Each fits one call's 600 s.
# Any GPU (an H100 holds 8 and 24 layers of the FP8 80B shapes):
#   pf where a prompt chunk's time goes at the FP8 80B shapes (8 layers, compiled, graph
#      replay): one slot's 64-token chunk and eight slots' (512 rows, the N=8 cohort's one
#      chunk, routed experts in one 512-row launch by default); the simulator puts about 54 of
#      the eight-slot chunk's 139 ms (full depth, 128-row launches) in work that grows with its
#      rows or slots rather than its expert bytes. Runs the base tree (below).
#   t  the DeltaNet commit from per-row factors: gdn_kernel's outputs, snapshots and final
#      states bit for bit against main's extension (old_new.py), the GPU tests of the factor
#      commit (the committed state's bits against the snapshot's) and the kernels around it,
#      and the GPU test of every backend and mode giving the same text
#   ab the window profiles at 24 layers (1 x 4, 8 x 2) with the factor commit, then the base
#      tree's (snapshots) on the same machine
#   b  24-layer solo spec 4 and batch_mtp W16 N=8 with the factor commit (text digests against
#      the base tree's, run after it in the same call)
#   wf0 the compile workers' open question at the FP8 80B shapes (4 layers, batch_mtp W16 N=8):
#      two lone cold warm-ups, no workers, side by side on caches of their own (session 41 found
#      digests that differ with four workers and without); base tree
#   wf0w after wf0 on the same machine: c1's cache warm in two new processes (2 repeats each:
#      whether the run itself repeats its text), then cache_diff.py over the two cold caches
#      (the timed kernels' configurations that differ; the kernel sources in only one)
# H200 only (the full-depth FP8 80B does not fit an H100): docs/bench/s41/device/calls.sh a, p.
# Carry .whl, .dev/s37 (main's CUDA extension for Python 3.12, stripped, xz), .dev/s42 (this
# tree's) and .dev/s42tree (the base tree: main's strata/ conf/ scripts/ tests/ cyext/ as of
# the session's start, tree.tar.xz).
set -u
NEW=.dev/s42/new_cuda.so.xz
[ -f $NEW ] || NEW=.dev/s37/new_cuda.so.xz
. docs/bench/device_common.sh $NEW
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
base_tree() {
  [ -d /tmp/base/strata ] && return
  mkdir -p /tmp/base && tar xJf .dev/s42tree/tree.tar.xz -C /tmp/base \
    && unxz -c .dev/s37/new_cuda.so.xz > /tmp/base/strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so
}
# `inbase NAME LIMIT CMD...`: st in the base tree
inbase() { base_tree; (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base st "$@"); }
P24="scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 24 --backend auto --compile --iters 50 --top 12 --shapes 1x4,8x2"
case ${1:-pf} in
pf)
  PP="scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 --backend auto --compile --shapes 1x1 --iters 20 --top 30"
  TAIL=60 inbase prefill1 170 python3 $PP --prefill 64 --json $R/prefill1.json
  TAIL=60 inbase prefill8 220 python3 $PP --prefill 64 --prefill-slots 8 --json $R/prefill8.json ;;
t)
  mkdir -p /tmp/old && unxz -c .dev/s37/new_cuda.so.xz > /tmp/old/strata_cuda.cpython-312-x86_64-linux-gnu.so
  SOF=strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so
  TAIL=2 st bits_old 60 python3 docs/bench/s42/device/old_new.py /tmp/old/strata_cuda.cpython-312-x86_64-linux-gnu.so save /tmp/old.pt
  TAIL=2 st bits_new 60 python3 docs/bench/s42/device/old_new.py $SOF compare /tmp/old.pt
  TAIL=8 st gpu_tests 240 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_kernels_gpu.py -k "gated or commit or factor or write_kv"
  TAIL=6 st gpu_text 200 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_engine_backends.py -k "gpu_backends_and_modes" ;;
ab)
  TAIL=4 st prof24_new 200 python3 $P24 --json $R/prof24_new.json
  TAIL=4 inbase prof24_base 200 python3 $P24 --json $R/prof24_base.json
  grep -h "graph replay\|^commit\|^linear:linear" $R/prof24_*.log ;;
b)
  B="$F --layers 24 --configs solo --n 1 --max-tokens 256 --repeats 2"
  TAIL=6 st solo24_new 200 python3 scripts/bench_engine.py $B --json $R/solo24_new.json
  TAIL=6 inbase solo24_base 200 python3 scripts/bench_engine.py $B --json $R/solo24_base.json
  grep -h "rep [01]\|window 1x4" $R/solo24_*.log ;;
wf0)
  W="$F --layers 4 --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 1 --compile-workers 0"
  base_tree
  for N in c1 c2; do
    (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$N TRITON_CACHE_DIR=/tmp/ind_$N/triton timeout 220 python3 scripts/bench_engine.py $W --json $R/fp8_$N.json > $R/fp8_$N.log 2>&1) &
  done
  wait
  for N in c1 c2; do grep -h "warm-up: \|rep 0" $R/fp8_$N.log | sed "s/^/$N: /"; done
  python3 - $R/fp8_c1.json $R/fp8_c2.json <<'PY'
import json, sys
a, b = (json.load(open(p))["summary"] for p in sys.argv[1:3])
for k in a:
    if k in b and "text_digest" in a[k]:
        print(k, "identical" if a[k]["text_digest"] == b[k]["text_digest"] else "DIFFERENT",
              a[k]["text_digest"], b[k]["text_digest"])
PY
  tar czf $OUT/r.tgz -C $OUT r ;;
wf0w)
  W="$F --layers 4 --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --compile-workers 0"
  base_tree
  for N in a b; do
    (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base TORCHINDUCTOR_CACHE_DIR=/tmp/ind_c1 TRITON_CACHE_DIR=/tmp/ind_c1/triton timeout 120 python3 scripts/bench_engine.py $W --json $R/warm_$N.json > $R/warm_$N.log 2>&1)
    grep -h "warm-up: 60\|rep [01]" $R/warm_$N.log | sed "s/^/$N: /"
  done
  python3 docs/bench/s42/device/cache_diff.py /tmp/ind_c1 /tmp/ind_c2 > $R/cache_diff.txt 2>&1
  head -3 $R/cache_diff.txt ;;
esac
