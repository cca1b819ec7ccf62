#!/usr/bin/env bash
# Session 45's device calls. Each fits one call's 600 s.
# H200 (the full-depth FP8 80B does not fit an H100's 80 GB):
#   w  deeper windows at full depth, which the simulator prices above W16 (SIMULATED N=8: W16
#      1,089, W24 deep 1,163, W32 deep 1,173, W40 deep at spec 5 1,334 tok/s; solo spec 5 489
#      against spec 4's 471): batch_mtp N=8 at W16 / W24 / W32 / W40 deep (64-token prompts
#      and outputs), then solo spec 4 against spec 5 (256 tokens), each set in one process
# Carry .whl and .dev/s45 (the tree's CUDA extension for Python 3.12, stripped, xz).
set -u
. docs/bench/device_common.sh .dev/s45/new_cuda.so.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
case ${1:-w} in
w)
  TAIL=12 st n8w 390 python3 scripts/bench_engine.py $F --configs batch_mtp_w16,batch_mtp_w24_deep,batch_mtp_w32_deep,batch_mtp_w40_deep --n 8 --max-tokens 64 --repeats 2 --json $R/n8w.json
  grep -h "warm-up: [0-9]* window\|rep [0-9]" $R/n8w.log
  TAIL=8 st solo5 190 python3 scripts/bench_engine.py $F --configs solo_spec4,solo_spec5 --n 1 --max-tokens 256 --repeats 2 --json $R/solo5.json
  grep -h "rep [0-9]" $R/solo5.log ;;
esac
