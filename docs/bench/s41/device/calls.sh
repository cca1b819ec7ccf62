#!/usr/bin/env bash
# Session 41's device calls. Each fits one call's 600 s.
# H200 (the full-depth FP8 80B does not fit an H100's 80 GB without the expert cache):
#   a  full depth on a bare machine, the defaults (512-row prompt launches, compile workers
#      off): solo spec 4 with and without engine.draft_vocab=32768 in one process (the solo
#      goal's figure; the first engine's warm-up is a bare machine's), then batch_mtp W16 N=8
#      with and without it (the N=8 goal's figure)
#   a1 the first half of a alone (a call that has to fit less device time)
#   p  where a full-depth window's time goes now: compiled window profiles at 1 x 4 and 8 x 2,
#      without and with engine.draft_vocab=32768
# Any GPU (an H100 holds 24 layers):
#   p24 p at 24 layers: the 1 x 4 and 8 x 2 window profiles without and with the draft vocabulary
#   wf the compile workers' text at the FP8 80B shapes: 4 layers, batch_mtp W16 N=8, cold, no
#      workers and four side by side on caches of their own (digests compared); then the GPU
#      test of the samplers over a draft vocabulary
#   b  the draft vocabulary at 24 layers: solo spec 4 and batch_mtp W16 N=8, each with and
#      without engine.draft_vocab=32768 in one process
# Carry .whl and .dev/s37 (the tree's CUDA extension for Python 3.12, stripped, xz).
set -u
. docs/bench/device_common.sh .dev/s37/new_cuda.so.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
case ${1:-a} in
a)
  TAIL=10 st solo4 290 python3 scripts/bench_engine.py $F --configs solo,solo_draft32k --n 1 --max-tokens 256 --repeats 2 --json $R/solo4.json
  grep -h "warm-up: \|compile workers" $R/solo4.log
  TAIL=10 st n8 250 python3 scripts/bench_engine.py $F --configs batch_mtp_w16,batch_mtp_w16_draft32k --n 8 --max-tokens 64 --repeats 2 --json $R/n8.json
  grep -h "warm-up: \|compile workers" $R/n8.log ;;
wf)
  W="$F --layers 4 --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 1"
  for RUN in w0:0 w4:4; do
    IFS=: read NAME N <<< "$RUN"
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$NAME TRITON_CACHE_DIR=/tmp/ind_$NAME/triton timeout 200 python3 scripts/bench_engine.py $W --compile-workers $N --json $R/fp8_$NAME.json > $R/fp8_$NAME.log 2>&1 &
  done
  wait
  for N in w0 w4; do grep -h "warm-up: 60\|compile workers: [0-9]* graphs compiled in\|rep 0" $R/fp8_$N.log | sed "s/^/$N: /"; done
  python3 - $R/fp8_w0.json $R/fp8_w4.json <<'PY'
import json, sys
a, b = (json.load(open(p))["summary"] for p in sys.argv[1:3])
for k in a:
    if k in b and "text_digest" in a[k]:
        print(k, "identical" if a[k]["text_digest"] == b[k]["text_digest"] else "DIFFERENT",
              a[k]["text_digest"], b[k]["text_digest"])
PY
  TAIL=3 st gpu_tests 40 python3 -m pytest -q -o addopts="" -m gpu tests/test_sampler_compile.py ;;
a1)
  TAIL=10 st solo4 290 python3 scripts/bench_engine.py $F --configs solo,solo_draft32k --n 1 --max-tokens 256 --repeats 2 --json $R/solo4.json
  grep -h "warm-up: \|compile workers" $R/solo4.log ;;
p24)
  P="scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 24 --backend auto --compile --iters 50 --top 12 --shapes 1x4,8x2"
  TAIL=4 st prof24 200 python3 $P --json $R/prof24.json
  TAIL=4 st prof24_dv 200 python3 $P --draft-vocab 32768 --json $R/prof24_dv.json
  grep -h "graph replay" $R/prof24*.log ;;
p)
  P="scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --backend auto --compile --iters 50 --top 12 --shapes 1x4,8x2"
  TAIL=4 st prof48 280 python3 $P --json $R/prof48.json
  TAIL=4 st prof48_dv 280 python3 $P --draft-vocab 32768 --json $R/prof48_dv.json
  grep -h "graph replay\|draft lm_head  \|^region" $R/prof48*.log ;;
b)
  TAIL=10 st solo4_24 250 python3 scripts/bench_engine.py $F --layers 24 --configs solo,solo_draft32k --n 1 --max-tokens 256 --repeats 2 --json $R/solo4_24.json
  TAIL=10 st n8_24 300 python3 scripts/bench_engine.py $F --layers 24 --configs batch_mtp_w16,batch_mtp_w16_draft32k --n 8 --max-tokens 64 --repeats 2 --json $R/n8_24.json ;;
esac
