#!/usr/bin/env bash
# Big wide launches (wide_rows 256 / 512: a prompt chunk of eight slots' chunks in one or two
# launches instead of four), written in session 34, which was lent no device:
#   w  the MoE GPU tests of the wide launches (the big ones among them) and big_time.py (256
#      and 512 rows in launches of 128, 256 and 512: time, % of the copy ceiling, the bits);
#      about 300 s
#   n  full depth batch_mtp W16 N=8 at wide_rows 128 (the default) and 512, one process each,
#      about 550 s (the simulator says 972 -> 1,089 tok/s: scripts/sim_expert_cache_study.py
#      --bench-check docs/bench/s32/call1_n8_ps8_w128.json --set experts.prefill_launch_rows=512)
#   p  where the eight-slot prompt chunk's time goes (8 layers, compiled, graph replay): the
#      simulator's three-term fit puts about 54 of its 139 ms in work that grows with its rows
#      or slots, not in expert bytes; profile_window.py --prefill 64 --prefill-slots 8 at
#      wide_rows 128 and 512, and one slot's chunk beside them (about 550 s)
# Carry .whl and .dev/s34 (this tree's CUDA extension for Python 3.12, stripped, xz).
set -u
. docs/bench/device_common.sh .dev/s34/new_cuda.so.xz
case ${1:-w} in
w)
  TAIL=6 st wide_tests 150 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py -k "wide or big"
  TAIL=8 st big_time 120 python3 docs/bench/s34/device/big_time.py ;;
n)
  TAIL=6 st n8_w128 300 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --json $R/n8_w128.json
  TAIL=6 st n8_w512 240 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options wide_rows=512 --json $R/n8_w512.json ;;
p)
  PP="scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 --backend auto --compile --shapes 1x1 --iters 20 --top 30"
  TAIL=45 st prefill1 150 python3 $PP --prefill 64 --json $R/prefill1.json
  TAIL=45 st prefill8_w128 200 python3 $PP --prefill 64 --prefill-slots 8 --json $R/prefill8_w128.json
  TAIL=45 st prefill8_w512 200 python3 $PP --prefill 64 --prefill-slots 8 --kernel-options wide_rows=512 --json $R/prefill8_w512.json ;;
esac
