#!/usr/bin/env bash
# Session 37's device calls (an H200; the full-depth FP8 80B does not fit an H100's 80 GB
# without the expert cache). Each fits one call's 600 s:
#   a  full-depth batch_mtp W16 N=8 at the default 512-row launches on a bare machine (its
#      warm-up line is the goal's figure), then the L2 prefetch's probe and GPU tests (never
#      run on a GPU before: KERNELS.md "L2 prefetch")
#   b  full-depth solo spec 2 at l2_prefetch 0 and at LEVEL (default 2; the probe's best)
#   c  full-depth batch_mtp W16 N=8 at 128-row launches (the baseline for a's 512, warm), then
#      at 512 with l2_prefetch LEVEL
#   p  (an H100 will do) the L2 prefetch's probe and GPU tests, then solo spec 2 at 24 layers
#      (what fits 80 GB) at l2_prefetch 0 and LEVEL: the prefetch's gain, not a goal figure
#   q  (an H100 will do) the probe and the prefetch's GPU tests, then the expert cache's GPU
#      tests (the padded chunks' capture, compile off, never run)
#   h  (an H100) the probe and the prefetch's tests, then the full-depth FP8 80B through the
#      expert cache at a 75% budget (batching's gain against the simulator's prediction in
#      docs/SIM_STUDIES.md), then the expert cache's GPU tests as time allows
#   d  (any GPU) deeper batch_mtp groups (engine.batch_mtp_drafts=null) against one draft at
#      N=2 and 4, W16: the tiny model, then the FP8 80B shapes at LAYERS (48; 24 on an H100)
#   e  d in under 300 s: the tiny model, then 24 layers at N=2
#   w  (any GPU) the warm-up with inductor's pointwise autotuning on (torch's default) and off,
#      4 layers (the same 60 window shapes and compile work as full depth), cold caches each
# On an H100, also docs/bench/s36/device/calls.sh h and s.
# Carry .whl and .dev/s37 (the tree's CUDA extension for Python 3.12, stripped, xz).
set -u
. docs/bench/device_common.sh .dev/s37/new_cuda.so.xz
L=${LEVEL:-2}
case ${1:-a} in
a)
  TAIL=6 st n8_w512 290 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --json $R/n8_w512.json
  grep -h "warm-up" $R/n8_w512.log | head -3
  TAIL=40 st l2_probe 150 python3 scripts/probe_l2_prefetch.py --json $R/l2_probe.json
  TAIL=4 st l2_tests 60 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_l2_prefetch.py ;;
b)
  TAIL=4 st solo_l0 250 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --json $R/solo_l0.json
  TAIL=4 st solo_l$L 200 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --kernel-options l2_prefetch=$L --json $R/solo_l$L.json ;;
c)
  TAIL=6 st n8_w128 170 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options wide_rows=128 --json $R/n8_w128.json
  TAIL=6 st n8_l$L 240 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options l2_prefetch=$L --json $R/n8_l$L.json ;;
p)
  TAIL=40 st l2_probe 150 python3 scripts/probe_l2_prefetch.py --json $R/l2_probe.json
  TAIL=4 st l2_tests 60 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_l2_prefetch.py
  TAIL=4 st solo24_l0 170 python3 scripts/bench_engine.py $F --layers 24 --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --json $R/solo24_l0.json
  TAIL=4 st solo24_l$L 140 python3 scripts/bench_engine.py $F --layers 24 --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --kernel-options l2_prefetch=$L --json $R/solo24_l$L.json ;;
q)
  TAIL=40 st l2_probe 150 python3 scripts/probe_l2_prefetch.py --json $R/l2_probe.json
  TAIL=4 st l2_tests 60 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_l2_prefetch.py
  TAIL=6 st gpu_expert_cache 260 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_expert_cache_gpu.py ;;
h)
  TAIL=30 st l2_probe 100 python3 scripts/probe_l2_prefetch.py --json $R/l2_probe.json
  TAIL=4 st l2_tests 40 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_l2_prefetch.py
  TAIL=12 st study_h100_75 290 python3 scripts/bench_expert_cache.py --part study --layers 48 --budgets 75 --no-baseline --configs solo,batch_mtp --n 1,4 --repeats 1 --max-tokens 32 --json $R/study_h100_75.json
  TAIL=6 st gpu_expert_cache 130 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_expert_cache_gpu.py ;;
d)
  # engine.batch_mtp_drafts=null against 1: the tiny model, then the FP8 80B shapes (LAYERS:
  # 48 on an H200, 24 on an H100)
  TAIL=8 st tiny_deep 200 python3 scripts/bench_engine.py --configs batch_mtp_w16,batch_mtp_w16_deep --n 2,4 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --json $R/tiny_deep.json
  TAIL=10 st fp8_deep 330 python3 scripts/bench_engine.py $F --layers ${LAYERS:-48} --configs batch_mtp_w16,batch_mtp_w16_deep --n 2,4 --max-tokens 64 --repeats 2 --json $R/fp8_deep.json ;;
e)
  # d, shorter: the tiny model at N=2 and 4, then the FP8 shapes at 24 layers and N=2
  TAIL=8 st tiny_deep 120 python3 scripts/bench_engine.py --configs batch_mtp_w16,batch_mtp_w16_deep --n 2,4 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --json $R/tiny_deep.json
  TAIL=8 st fp8_deep24 150 python3 scripts/bench_engine.py $F --layers 24 --configs batch_mtp_w16,batch_mtp_w16_deep --n 2 --max-tokens 64 --repeats 2 --json $R/fp8_deep24.json ;;
w)
  # the warm-up's compile work does not grow with depth: 4 layers, each run on cold caches
  for AT in 1 0; do
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_w$AT TRITON_CACHE_DIR=/tmp/ind_w$AT/triton TAIL=3 st warm4_at$AT 200 python3 docs/bench/s38/device/inductor_run.py triton.autotune_pointwise=$AT -- $F --layers 4 --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 1 --json $R/warm4_at$AT.json
    grep -h "warm-up: 60" $R/warm4_at$AT.log
  done ;;
esac
