#!/usr/bin/env bash
# The L2 prefetch's device calls (written in session 33, which was lent no device):
#   a  the probe (scripts/probe_l2_prefetch.py: each kernel cold, prefetched, hot) and the
#      GPU tests of the prefetch, then the 8-layer window profile at level 0 with the groups
#      routed apart (profile_window.py now gives each lane its own inputs)
#   b  the same profile at l2_prefetch levels 1, 2 and 3 (1 x 2 and 8 x 2 windows)
#   c  full depth, batch_mtp W16 N=8 at level 0 on a bare machine (its warm-up is the goal's
#      figure: 184 s at ab12057, before this session's 91 -> 73 graphs), then at the best level
#      of b (LEVEL=n, default 2) warm from the first's compile cache
#   d  full depth, solo spec 2 at level 0 and at LEVEL
# Carry .whl and .dev/s33 (this tree's CUDA extension for Python 3.12, stripped, xz), or a later
# build with SO=<its .so.xz>.
set -u
. docs/bench/device_common.sh .dev/s33/new_cuda.so.xz
P="scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 --backend auto --compile --shapes 1x2,8x2 --iters 50 --top 25"
case ${1:-a} in
a)
  TAIL=40 st l2_probe 150 python3 scripts/probe_l2_prefetch.py --json $R/l2_probe.json
  TAIL=4 st l2_tests 60 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_l2_prefetch.py
  TAIL=50 st profile8_l0 330 python3 $P --json $R/profile8_l0.json ;;
b)
  for L in 1 2 3; do
    TAIL=30 st profile8_l$L 180 python3 $P --kernel-options l2_prefetch=$L --json $R/profile8_l$L.json
  done ;;
c)
  L=${LEVEL:-2}
  # a compile cache of its own: calls a and b on the same machine compiled the same regions
  export TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor_c
  TAIL=4 st n8_l0 300 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --json $R/n8_l0.json
  grep -h "warm-up: 60" $R/n8_l0.log
  TAIL=4 st n8_l$L 240 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options l2_prefetch=$L --json $R/n8_l$L.json ;;
d)
  L=${LEVEL:-2}
  TAIL=4 st solo_l0 250 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --json $R/solo_l0.json
  TAIL=4 st solo_l$L 200 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --kernel-options l2_prefetch=$L --json $R/solo_l$L.json ;;
esac
