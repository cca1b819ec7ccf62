#!/usr/bin/env bash
# Session 47's device calls. Each fits one call's 600 s. Carry .whl and .dev/s47 (the tree's CUDA
# extension for Python 3.12, stripped, xz).
#   r   moe_launch_options(gate_up_runs=): the wide-launch GPU tests (the same bits as 16-row
#       launches with the gate/up in member runs, the kernel taken), then runs_time.py (one
#       layer's routed experts at 64 / 256 / 512 prompt rows, runs off and on)
#   r1  step r in less device time (the tests of 128-600 rows, the timing at 512 rows)
#   rn  the engine at FP8 80B shapes, LAYERS (24; 48 on an H200), batch_mtp W16 N=8 (64-token
#       prompts and outputs, 8-slot chunks in one 512-row launch) with gate_up_runs 0 and 1
#   dh  engine.draft_head=fp8: the streamed FP8 linear at the LM head's 151,936 rows (GPU test),
#       then solo spec 4 with the bf16 / FP8 draft head, with and without draft_vocab=32768
#   dh1 step dh's GPU test and its first two configurations, for a call with little time left
#   dn  the same at batch_mtp W16 N=8 (64-token prompts and outputs)
#   ts  the embedded model's solo window depth: spec 4, 5 and 6 (256 tokens, 3 repeats)
#   t   the wide-launch and streamed MoE bit tests (runs on and off; a launch on a NaN workspace)
# SO= names another extension (docs/bench/s48/device/calls.sh: .dev/s48's).
set -u
. docs/bench/device_common.sh ${SO:-.dev/s47/new_cuda.so.xz}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
L="--layers ${LAYERS:-24}"; [ "${LAYERS:-24}" = 48 ] && L=
for step in ${@:-r}; do
case $step in
r)
  TAIL=4 st runs_test 200 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_moe_kernels.py -k "wide_launch"
  TAIL=8 st runs_time 120 python3 docs/bench/s47/device/runs_time.py ;;
t)
  TAIL=4 st moe_tests 150 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_moe_kernels.py -k "wide_launch or more_members or stream_same_bits" ;;
r1)  # step r in less device time: the 128-600-row tests and the 512-row timing
  TAIL=4 st runs_test1 150 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_moe_kernels.py -k "wide_launches_of_128 or more_members"
  TAIL=8 st runs_time1 90 python3 docs/bench/s47/device/runs_time.py 512 ;;
rn)
  for o in 0 1; do
    TAIL=4 st rn_$o 280 python3 scripts/bench_engine.py $F $L --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options gate_up_runs=$o --json $R/rn_$o.json
    grep -h "rep [0-9]\|prompt chunk\|window 8x2@256" $R/rn_$o.log | cut -c1-130
  done ;;
dh)
  TAIL=4 st head_test 150 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_moe_kernels.py -k "linear_fp8_streamed and 151936"
  TAIL=4 st dh_solo 300 python3 scripts/bench_engine.py $F $L --configs solo,solo_draft_fp8,solo_draft32k,solo_draft32k_fp8 --n 1 --max-tokens 256 --repeats 2 --json $R/dh_solo.json
  grep -h "rep [0-9]\|window 1x4@256" $R/dh_solo.log | cut -c1-130 ;;
dh1)
  TAIL=4 st head_test 90 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_moe_kernels.py -k "linear_fp8_streamed and 151936"
  TAIL=4 st dh1_solo ${DH1_S:-230} python3 scripts/bench_engine.py $F $L --configs solo,solo_draft_fp8 --n 1 --max-tokens 256 --repeats 2 --json $R/dh1_solo.json
  grep -h "rep [0-9]\|window 1x4@256" $R/dh1_solo.log | cut -c1-130 ;;
dn)
  TAIL=4 st dh_n8 300 python3 scripts/bench_engine.py $F $L --configs batch_mtp_w16,batch_mtp_w16_draft_fp8 --n 8 --max-tokens 64 --repeats 2 --json $R/dh_n8.json
  grep -h "rep [0-9]\|window 8x2@256" $R/dh_n8.log | cut -c1-130 ;;
ts)
  TAIL=4 st tiny_solo 200 python3 scripts/bench_engine.py --configs solo_spec4,solo_spec5,solo --spec 6 --n 1 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --no-reverse --json $R/tiny_solo.json
  grep -h "rep [0-9]\|window 1x" $R/tiny_solo.log | cut -c1-130 ;;
esac
done
