#!/usr/bin/env bash
# Session 51's device calls: the tree with its CUDA extension (SO, default .dev/s51/new_cuda.so.xz:
# the skinny linear as a programmatic dependent launch, weights loaded before its wait):
#   ku   the skinny linear's and the FP8 linear's GPU tests
#   pt   compiled window profiles of the embedded model, 8 x 2 and 1 x 4, skinny_bf16 off then on
#   tg   the embedded model, the N=8 goal command, skinny_bf16 off then on
#   td   the embedded model, solo and batch_mtp W16 at N=1 and 8, 256 tokens, off then on
#   sb   step_breakdown of batch_mtp W16 at N=8 (overlapped), skinny_bf16 off then on: the common
#        window replayed alone against its time in the engine, and the host's share
#   tr   batch_mtp W16 at N=8 (32 tokens, one timed cohort), skinny_bf16 off then on, one more
#        cohort under torch.profiler: where the device idles in that engine (trace_gaps.py)
#   n8   full-depth FP8 80B shapes (LAYERS, 48 on an H200), batch_mtp W16 N=8 with and without
#        engine.draft_vocab=32768, 64-token prompts and outputs
#   fw   full-depth (LAYERS) solo spec 4, 256 tokens, 2 repeats
set -u
export SO=${SO:-.dev/s51/new_cuda.so.xz}
. docs/bench/device_common.sh $SO
L="--layers ${LAYERS:-24}"; [ "${LAYERS:-24}" = 48 ] && L=
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt
for s in "$@"; do case $s in
ku) TAIL=4 st ku 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernels.py -k "skinny or linear_fp8_streamed_in_a_graph or test_gpu_linear_fp8" ;;
pt) for k in 0 1; do
  TAIL=3 st pt_$k 150 python3 scripts/profile_window.py --backend auto --compile --iters 30 --shapes 8x2,1x4 --top 40 --kernel-options skinny_bf16=$k --json $R/pt_$k.json
  grep -h "graph replay" $R/pt_$k.log | cut -c1-140; done ;;
tg) for k in 0 1; do
  TAIL=4 st tg_$k 150 python3 scripts/bench_engine.py --configs batch_mtp_w16 --n 8 --max-tokens 128 --repeats 3 --overlap on --no-reverse --prefill-slots 8 --kernel-options skinny_bf16=$k --json $R/tg_$k.json; done ;;
td) for k in 0 1; do
  TAIL=7 st td_$k 200 python3 scripts/bench_engine.py --configs solo,batch_mtp_w16 --n 1,8 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --no-reverse --kernel-options skinny_bf16=$k --json $R/td_$k.json
  grep -h "window 1x4@256\|window 8x2@256" $R/td_$k.log | cut -c1-140; done ;;
sb) for k in 0 1; do
  TAIL=3 st sb_$k 200 python3 scripts/step_breakdown.py --n 8 --configs batch_mtp_w16 --overlap on --max-tokens 128 --kernel-options skinny_bf16=$k --json $R/sb_$k.json; done ;;
tr) for k in ${TR_K:-0 1}; do
  TAIL=3 st tr_$k 200 python3 scripts/bench_engine.py --configs batch_mtp_w16 --n 8 --max-tokens 32 --repeats 1 --overlap on --no-reverse --kernel-options skinny_bf16=$k --trace-dir /tmp/tr_$k
  python3 docs/bench/s51/device/trace_gaps.py /tmp/tr_$k/batch_mtp_w16+overlap@8.json 20 > $R/tr_gaps_$k.txt 2>&1; head -30 $R/tr_gaps_$k.txt; done ;;
n8) TAIL=10 st n8 280 python3 scripts/bench_engine.py $F $L --configs batch_mtp_w16,batch_mtp_w16_draft32k --n 8 --max-tokens 64 --repeats 2 --json $R/n8.json
  grep -h "warm-up: \|window 8x2@256\|prompt chunk" $R/n8.log | cut -c1-160 ;;
fw) TAIL=4 st fw 200 python3 scripts/bench_engine.py $F $L --configs solo --n 1 --max-tokens 256 --repeats 2 --json $R/fw.json
  grep -h "window 1x4@256\|prompt chunk" $R/fw.log | cut -c1-140 ;;
esac; done
true
