#!/usr/bin/env bash
# Session 45's device calls. Each fits one call's 600 s.
# H200 (the full-depth FP8 80B does not fit an H100's 80 GB):
#   w  deeper windows at full depth, which the simulator prices above W16 (SIMULATED N=8: W16
#      1,089, W24 deep 1,163, W32 deep 1,173, W40 deep at spec 5 1,334 tok/s; solo spec 5 489
#      against spec 4's 471): batch_mtp N=8 at W16 / W24 / W32 / W40 deep (64-token prompts
#      and outputs), then solo spec 4 against spec 5 (256 tokens), each set in one process
# Any GPU:
#   w24 step w at 24 layers (what an H100's 80 GB holds)
#   f  the fused routed-expert grid (moe_launch_options(fused=), SO=.dev/s45/fused_cuda.so.xz):
#      its GPU tests and the MoE launch tests beside it, then the kernels alone at 1-32 rows
#      (the folded shared expert) with and without it
#   f1 step f's fused test and the layer's experts alone at 1-16 rows (fused_time.py), for a
#      call with little device time left
#   fe the fused grid in the engine: FP8 80B shapes at LAYERS (24; 48 on an H200), solo spec 4
#      and batch_mtp W16 N=8, --kernel-options fused=0 and fused=1 in one process each
# Carry .whl and .dev/s45 (the tree's CUDA extension for Python 3.12, stripped, xz).
set -u
. docs/bench/device_common.sh .dev/s45/new_cuda.so.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
case ${1:-w} in
f)
  TAIL=8 st fused_tests 240 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_moe_kernels.py -k "fused or down_split or launch_variants or stream_same_bits"
  TAIL=40 st fused_bench 200 python3 scripts/bench_kernels.py --moe --no-linear --moe-shared --moe-variants stream-mma,stream-mma-fused --skip-parity --out $R/fused_bench.json
  ;;
f1)
  TAIL=6 st fused_test 150 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_moe_kernels.py -k "fused"
  TAIL=8 st fused_time 120 python3 docs/bench/s45/device/fused_time.py ;;
fe)
  L="--layers ${LAYERS:-24}"; [ "${LAYERS:-24}" = 48 ] && L=
  for FU in 0 1; do
    TAIL=6 st fe_solo_$FU 200 python3 scripts/bench_engine.py $F $L --configs solo --n 1 --max-tokens 256 --repeats 2 --kernel-options fused=$FU --json $R/fe_solo_$FU.json
  done
  for FU in 0 1; do
    TAIL=6 st fe_n8_$FU 200 python3 scripts/bench_engine.py $F $L --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options fused=$FU --json $R/fe_n8_$FU.json
  done
  grep -h "rep [0-9]\|window 1x4@256\|window 8x2@256" $R/fe_*.log ;;
w24)
  F="$F --layers 24"
  TAIL=12 st n8w24 390 python3 scripts/bench_engine.py $F --configs batch_mtp_w16,batch_mtp_w24_deep,batch_mtp_w32_deep,batch_mtp_w40_deep --n 8 --max-tokens 64 --repeats 2 --json $R/n8w24.json
  grep -h "warm-up: [0-9]* window\|rep [0-9]" $R/n8w24.log
  TAIL=8 st solo5_24 190 python3 scripts/bench_engine.py $F --configs solo_spec4,solo_spec5 --n 1 --max-tokens 256 --repeats 2 --json $R/solo5_24.json
  grep -h "rep [0-9]" $R/solo5_24.log ;;
w)
  TAIL=12 st n8w 390 python3 scripts/bench_engine.py $F --configs batch_mtp_w16,batch_mtp_w24_deep,batch_mtp_w32_deep,batch_mtp_w40_deep --n 8 --max-tokens 64 --repeats 2 --json $R/n8w.json
  grep -h "warm-up: [0-9]* window\|rep [0-9]" $R/n8w.log
  TAIL=8 st solo5 190 python3 scripts/bench_engine.py $F --configs solo_spec4,solo_spec5 --n 1 --max-tokens 256 --repeats 2 --json $R/solo5.json
  grep -h "rep [0-9]" $R/solo5.log ;;
esac
