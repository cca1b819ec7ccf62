#!/usr/bin/env bash
# Session 52's device calls: the tree with its CUDA extension (SO, default .dev/s51/new_cuda.so.xz,
# cyext/src as at 4e716e6):
#   gl   graph_launch.py: a graph of 60 small linears, cuBLAS against the skinny kernel under its
#        launch switches: the host's launch time and the device's replay time
#   tr   batch_mtp W16 at N=8 (32 tokens, one timed cohort), skinny_bf16 off then on, one more
#        cohort under torch.profiler, read by docs/bench/s51/device/trace_gaps.py
#   nd   batch_mtp W16 at N=8, 64-token prompts, 256 tokens, 2 repeats, under each of ND's
#        --kernel-options (default: skinny_bf16=0, skinny_bf16=1, skinny_bf16=1,linear_pdl=0)
set -u
export SO=${SO:-.dev/s51/new_cuda.so.xz}
. docs/bench/device_common.sh $SO
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt
for s in "$@"; do case $s in
gl) TAIL=12 st gl 120 python3 docs/bench/s52/device/graph_launch.py 60 16 ;;
tr) for k in ${TR_K:-0 1}; do
  TAIL=3 st tr_$k 200 python3 scripts/bench_engine.py --configs batch_mtp_w16 --n 8 --max-tokens 32 --repeats 1 --overlap on --no-reverse --kernel-options skinny_bf16=$k --trace-dir /tmp/tr_$k
  python3 docs/bench/s51/device/trace_gaps.py /tmp/tr_$k/batch_mtp_w16+overlap@8.json 20 > $R/tr_gaps_$k.txt 2>&1; head -40 $R/tr_gaps_$k.txt; done ;;
nd) i=0; for k in ${ND:-skinny_bf16=0 skinny_bf16=1 skinny_bf16=1,linear_pdl=0}; do i=$((i+1))
  TAIL=3 st nd_$i 200 python3 scripts/bench_engine.py --configs batch_mtp_w16 --n 8 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 2 --no-reverse --kernel-options $k --json $R/nd_$i.json
  echo "   ($k)"; grep -h "window 8x2@256\|prompt chunk" $R/nd_$i.log | cut -c1-140; done ;;
esac; done
true
