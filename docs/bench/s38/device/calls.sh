#!/usr/bin/env bash
# Session 38's device calls. Each fits one call's 600 s. H200 (the full-depth FP8 80B does not
# fit an H100's 80 GB without the expert cache): docs/bench/s37/device/calls.sh a and c.
# Any GPU:
#   h  the warm-up's compile time by phase (torch's compile-time table) at 4 layers (the same
#      graphs as full depth): cold caches, then warm ones, then cold with four compile workers;
#      then an 8-layer profile of the current kernels at 1 x 2 and 8 x 2
#   w  h's cold run with four compile workers again (their device fixed), then the tiny model's
#      deeper batch_mtp groups
#   t  the tiny model's warm-up without and with compile workers, then the FP8 deep groups at
#      24 layers, N=2
#   d  the deeper batch_mtp groups on the tiny model at N=2 and 4, then at the FP8 shapes, LAYERS (24 on an H100), N=2 and 4, then
#      the expert-cache study on the H100 (SIM_STUDIES.md's SIMULATED prediction) as time allows
# Carry .whl and .dev/s37 (the tree's CUDA extension for Python 3.12, stripped, xz).
set -u
. docs/bench/device_common.sh .dev/s37/new_cuda.so.xz
case ${1:-h} in
h)
  # cold caches, then the same again on the caches it left (what a warm-up costs when every
  # graph is in the compile caches), then cold with four compile workers (engine.compile_workers)
  W="$F --layers 4 --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 1"
  for RUN in cold_w0:0:/tmp/ind_a warm_w0:0:/tmp/ind_a cold_w4:4:/tmp/ind_b; do
    IFS=: read NAME CW DIR <<< "$RUN"
    TORCHINDUCTOR_CACHE_DIR=$DIR TRITON_CACHE_DIR=$DIR/triton TAIL=24 st warm4_$NAME 170 python3 docs/bench/s38/device/inductor_run.py -- $W --compile-workers $CW --json $R/warm4_$NAME.json
  done
  TAIL=80 st prof8 150 python3 scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 --backend auto --compile --shapes 1x2,8x2 --iters 20 --top 24 --json $R/prof8.json ;;
w)
  # cold caches with four compile workers (the fix for the workers' device), then the tiny
  # model's deeper batch_mtp groups
  W="$F --layers 4 --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 1"
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_c TRITON_CACHE_DIR=/tmp/ind_c/triton TAIL=22 st warm4_cold_w4 170 python3 docs/bench/s38/device/inductor_run.py -- $W --compile-workers 4 --json $R/warm4_cold_w4.json
  TAIL=8 st tiny_deep 110 python3 scripts/bench_engine.py --configs batch_mtp_w16,batch_mtp_w16_deep --n 2,4 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --json $R/tiny_deep.json ;;
t)
  # the tiny model's warm-up on cold caches without and with four compile workers (acceptance
  # and windows: the same greedy text), then the FP8 shapes' deeper groups at 24 layers, N=2
  for CW in 0 4; do
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_t$CW TRITON_CACHE_DIR=/tmp/ind_t$CW/triton TAIL=3 st tiny_cold_w$CW 100 python3 scripts/bench_engine.py --configs batch_mtp_w16 --n 4 --prompt-tokens 64 --max-tokens 128 --overlap on --repeats 1 --no-reverse --compile-workers $CW --json $R/tiny_cold_w$CW.json
    grep -h "warm-up: \|compile workers: [0-9]* graphs compiled in\|rep 0" $R/tiny_cold_w$CW.log
  done
  TAIL=8 st fp8_deep24 150 python3 scripts/bench_engine.py $F --layers 24 --configs batch_mtp_w16,batch_mtp_w16_deep --n 2 --max-tokens 64 --repeats 2 --json $R/fp8_deep24.json ;;
d)
  TAIL=8 st tiny_deep 120 python3 scripts/bench_engine.py --configs batch_mtp_w16,batch_mtp_w16_deep --n 2,4 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --json $R/tiny_deep.json
  TAIL=10 st fp8_deep 330 python3 scripts/bench_engine.py $F --layers ${LAYERS:-24} --configs batch_mtp_w16,batch_mtp_w16_deep --n 2,4 --max-tokens 64 --repeats 2 --json $R/fp8_deep.json
  TAIL=12 st study_h100_75 120 python3 scripts/bench_expert_cache.py --part study --layers 48 --budgets 75 --no-baseline --configs solo,batch_mtp --n 1,4 --repeats 1 --max-tokens 32 --json $R/study_h100_75.json ;;
esac
