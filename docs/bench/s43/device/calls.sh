#!/usr/bin/env bash
# Session 43's device calls. Each fits one call's 600 s.
# H200 (the full-depth FP8 80B does not fit an H100's 80 GB without the expert cache):
#   a  the goal figures at full depth on a bare machine with the factor commit and the compile
#      workers on (auto): solo spec 4 with and without engine.draft_vocab=32768 in one process
#      (the first engine's warm-up is the warm-up goal's figure), then batch_mtp W16 N=8 with
#      and without it (session 41's step a, now on this tree)
# Any GPU:
#   k  the new kernels against session 42's extension (main's kernels before): the routed
#      experts' prompt launches (wide_moe.py: 64-512 rows, bits and time) and the gated delta
#      rule (gdn_ab.py: windows and prompt chunks, bits and time); then the GPU tests of the
#      kernels they touch and of every backend and mode giving the same text
#   wf cold compiles' text with the prompt regions untiled (compiling.PROMPT_REGION_OPTIONS):
#      two cold warm-ups side by side on caches of their own, one without compile workers and
#      one with two (batch_mtp W16 N=8), their digests compared; then cache_diff.py over the
#      two cold caches (the timed kernels' configurations that differ)
# Carry .whl, .dev/s43 (the tree's CUDA extension for Python 3.12, stripped, xz) and .dev/s42
# (session 42's, the kernels before; SO=.dev/s42/new_cuda.so.xz runs a step on it).
set -u
. docs/bench/device_common.sh .dev/s43/new_cuda.so.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
digests() {
  python3 - "$@" <<'PY'
import json, sys
a, b = (json.load(open(p))["summary"] for p in sys.argv[1:3])
for k in a:
    if k in b and "text_digest" in a[k]:
        print(k, "identical" if a[k]["text_digest"] == b[k]["text_digest"] else "DIFFERENT",
              a[k]["text_digest"], b[k]["text_digest"])
PY
}
case ${1:-a} in
a)
  TAIL=10 st solo4 290 python3 scripts/bench_engine.py $F --configs solo,solo_draft32k --n 1 --max-tokens 256 --repeats 2 --json $R/solo4.json
  grep -h "warm-up: \|compile workers" $R/solo4.log
  TAIL=10 st n8 250 python3 scripts/bench_engine.py $F --configs batch_mtp_w16,batch_mtp_w16_draft32k --n 8 --max-tokens 64 --repeats 2 --json $R/n8.json
  grep -h "warm-up: \|compile workers" $R/n8.log ;;
k)
  unxz -c .dev/s42/new_cuda.so.xz > /tmp/old_cuda.so
  TAIL=8 st wide_moe 130 python3 docs/bench/s43/device/wide_moe.py /tmp/old_cuda.so
  TAIL=16 st gdn_ab 100 python3 docs/bench/s43/device/gdn_ab.py /tmp/old_cuda.so
  TAIL=8 st gpu_tests 180 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_kernels_gpu.py tests/test_moe_kernels.py -k "gated or commit or factor or conv or wide or fp8"
  TAIL=6 st gpu_text 130 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_engine_backends.py -k "gpu_backends_and_modes" ;;
wf)
  W="$F --layers 4 --configs batch_mtp_w16 --n 8 --max-tokens 64"
  for RUN in c1:0 c2:2; do
    IFS=: read NAME N <<< "$RUN"
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$NAME TRITON_CACHE_DIR=/tmp/ind_$NAME/triton timeout 230 python3 scripts/bench_engine.py $W --repeats 1 --compile-workers $N --json $R/fp8_$NAME.json > $R/fp8_$NAME.log 2>&1 &
  done
  wait
  for N in c1 c2; do grep -h "warm-up: 60\|compile workers: \|rep 0" $R/fp8_$N.log | sed "s/^/$N: /"; done
  digests $R/fp8_c1.json $R/fp8_c2.json
  python3 docs/bench/s42/device/cache_diff.py /tmp/ind_c1 /tmp/ind_c2 > $R/cache_diff.txt 2>&1
  head -3 $R/cache_diff.txt; grep -c "R0_BLOCK" $R/cache_diff.txt
  tar czf $OUT/r.tgz -C $OUT r ;;
esac
