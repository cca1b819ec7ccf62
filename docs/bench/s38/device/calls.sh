#!/usr/bin/env bash
# Session 38's device calls. Each fits one call's 600 s. H200 (the full-depth FP8 80B does not
# fit an H100's 80 GB without the expert cache): docs/bench/s37/device/calls.sh a and c.
# Any GPU:
#   h  an 8-layer profile of the current kernels at 1 x 2 and 8 x 2 (where a window's time goes
#      now), then the warm-up's compile time by phase (torch's compile-time table) at 4 layers
#      on cold caches, pointwise autotuning on (torch's default) and off, then the tiny model's
#      deeper batch_mtp groups at N=2 and 4
#   d  the deeper batch_mtp groups at the FP8 shapes, LAYERS (24 on an H100), N=2 and 4, then
#      the expert-cache study on the H100 (SIM_STUDIES.md's SIMULATED prediction) as time allows
# Carry .whl and .dev/s37 (the tree's CUDA extension for Python 3.12, stripped, xz).
set -u
. docs/bench/device_common.sh .dev/s37/new_cuda.so.xz
case ${1:-h} in
h)
  TAIL=80 st prof8 170 python3 scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 --backend auto --compile --shapes 1x2,8x2 --iters 20 --top 24 --json $R/prof8.json
  for AT in 1 0; do
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_w$AT TRITON_CACHE_DIR=/tmp/ind_w$AT/triton TAIL=40 st warm4_at$AT 150 python3 docs/bench/s38/device/inductor_run.py triton.autotune_pointwise=$AT -- $F --layers 4 --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 1 --json $R/warm4_at$AT.json
    grep -h "warm-up: 60" $R/warm4_at$AT.log
  done
  TAIL=8 st tiny_deep 120 python3 scripts/bench_engine.py --configs batch_mtp_w16,batch_mtp_w16_deep --n 2,4 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --json $R/tiny_deep.json ;;
d)
  TAIL=10 st fp8_deep 330 python3 scripts/bench_engine.py $F --layers ${LAYERS:-24} --configs batch_mtp_w16,batch_mtp_w16_deep --n 2,4 --max-tokens 64 --repeats 2 --json $R/fp8_deep.json
  TAIL=12 st study_h100_75 220 python3 scripts/bench_expert_cache.py --part study --layers 48 --budgets 75 --no-baseline --configs solo,batch_mtp --n 1,4 --repeats 1 --max-tokens 32 --json $R/study_h100_75.json ;;
esac
