#!/usr/bin/env bash
# Session 35's device calls, with session 34's (docs/bench/s34/device/calls.sh: the big wide
# launches' tests and timing, then N=8 at wide_rows 128 against 512):
#   a  the big launches' GPU tests (session 34's w, its first step), then full depth batch_mtp
#      W16 N=8 at wide_rows 512 on a cold compile cache (its warm-up: the goal's figure after
#      the graph cuts), about 450 s
#   b  the same at wide_rows 128 (warm cache: the baseline in the same machine), big_time.py
#      (256 / 512 rows in launches of 128 / 256 / 512) and t, about 450 s
#   t  the tiny model solo at spec 4 (the default), 3 and 2, one process, 3 repeats, 256 tokens:
#      on the CPU its drafts' acceptance is 0.70 at spec 2 against 0.47 at spec 4 (1.70 against
#      2.37 tokens a window), and the H200's 1 x 2 window replays in 211 us against 360 for
#      1 x 4, so spec 2 may be ~20% faster there (about 150 s)
#   x  full depth: batch_mtp W16 N=8 at wide_rows 512 with model.fp8_dense=fp8 (the DeltaNet
#      input projection on the streamed FP8 kernel: 13.8 against cuBLAS's 15.6 us at 16 rows
#      alone, KERNELS.md, but only ever measured in the engine at 1 x 2), then solo spec 2 with
#      engine.compile_specialize_one off and on (on N=8 off warmed up 15 s faster at the same
#      tok/s; its 1-row windows run generic kernels then), about 550 s on a warm compile cache
# Carry .whl and .dev/s34 (the tree's CUDA extension for Python 3.12, stripped, xz).
set -u
. docs/bench/device_common.sh .dev/s34/new_cuda.so.xz
W=${WIDE:-512}
tiny_spec() {
  TAIL=20 st tiny_spec 200 python3 scripts/bench_engine.py --configs solo,solo_spec3,solo_spec2 --n 1 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --json $R/tiny_spec.json
}
case ${1:-x} in
a)
  TAIL=6 st wide_tests 150 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py -k "wide or big"
  TAIL=6 st n8_w512 290 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options wide_rows=512 --json $R/n8_w512.json
  grep -h "warm-up" $R/n8_w512.log | head -3 ;;
b)
  TAIL=6 st n8_w128 150 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options wide_rows=128 --json $R/n8_w128.json
  TAIL=8 st big_time 100 python3 docs/bench/s34/device/big_time.py
  tiny_spec ;;
t)
  tiny_spec ;;
x)
  TAIL=6 st n8_w${W}_fp8dense 230 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options wide_rows=$W --fp8-dense fp8 --json $R/n8_w${W}_fp8dense.json
  TAIL=6 st solo2_one_off 170 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --specialize-one off --json $R/solo2_one_off.json
  TAIL=6 st solo2_one_on 140 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --json $R/solo2_one_on.json ;;
esac
