#!/usr/bin/env bash
# Session 52's device calls: the tree with its CUDA extension (SO, default .dev/s51/new_cuda.so.xz,
# cyext/src as at 4e716e6):
#   gl   graph_launch.py: a graph of 60 small linears, cuBLAS against the skinny kernel under its
#        launch switches: the host's launch time and the device's replay time
#   tr   batch_mtp W16 at N=8 (32 tokens, one timed cohort), skinny_bf16 off then on, one more
#        cohort under torch.profiler, read by docs/bench/s51/device/trace_gaps.py
#   nd   batch_mtp W16 at N=8, 64-token prompts, 256 tokens, 2 repeats, under each of ND's
#        --kernel-options (default: skinny_bf16=0, skinny_bf16=1, skinny_bf16=1,linear_pdl=0)
#   dv   the defaults as one run (from ff7f5ac: the skinny linear on, dependents up to 4 rows):
#        solo and batch_mtp W16 at N=1 and 8, 256 tokens, then the N=8 goal command; with
#        DV_OFF=1 each also with skinny_bf16=0 (cuBLAS) in the same call
#   kt   the skinny linear's GPU and CPU tests
#   sp   step_breakdown of batch_mtp W16 at N=8 (overlapped): the skinny linear's dependents at
#        every row count (skinny_pdl_rows=16) against none (0): the host's share of a window
#   fp   the FP8 80B shapes' compiled windows 1 x 4 and 8 x 2 profiled (dummy weights; LAYERS,
#        default 48: an H200), kernels by time and by region (FP_SHAPES: other shapes)
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
dv) for k in default ${DV_OFF:+skinny_bf16=0}; do o=; [ $k = default ] || o="--kernel-options $k"
  TAIL=7 st dv_td_$k 240 python3 scripts/bench_engine.py --configs solo,batch_mtp_w16 --n 1,8 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --no-reverse $o --json $R/dv_td_$k.json
  TAIL=3 st dv_tg_$k 150 python3 scripts/bench_engine.py $GOAL_N8 $o --json $R/dv_tg_$k.json; done ;;
kt) TAIL=4 st kt 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernels.py tests/test_skinny_linear.py -k skinny ;;
sp) for k in skinny_pdl_rows=16 skinny_pdl_rows=0; do
  # (file names without '=': the device tool does not bring such names back)
  TAIL=6 st sp_${k#*=} 200 python3 scripts/step_breakdown.py --n 8 --configs batch_mtp_w16 --overlap on --max-tokens 128 --kernel-options $k --json $R/sp_${k#*=}.json; done ;;
fp) L="--layers ${LAYERS:-48}"; [ "${LAYERS:-48}" = 48 ] && L=
  TAIL=40 st fp 400 python3 scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy $L --backend auto --compile --iters 30 --top 25 --shapes ${FP_SHAPES:-1x4,8x2} --json $R/fp.json ;;
esac; done
true
