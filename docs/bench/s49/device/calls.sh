#!/usr/bin/env bash
# Session 49's device calls: session 47's steps (docs/bench/s47/device/calls.sh: t, r, rn, dh,
# dn, ts, ...) with this tree's extension (SO=, default .dev/s49: gate_up_runs on by default;
# .dev/s48 is the tree before, runs off), plus
#   rt   runs_time.py alone (RT_ROWS, default 64,256,512: one layer's routed experts, runs off/on)
#   pc   where the window's small kernels go: the FP8 80B shapes at 4 layers and the embedded
#        model, 8 x 2 and 1 x 4 windows compiled, with inductor's generated code (output_code,
#        compressed) to read which ops each Triton kernel fuses, and a chrome trace of the 1 x 4
#        shape's replays (kernel spans, programmatic overlaps)
#   ro   the router's warming warp and the int32 noise hash: their GPU tests with SO (the tree's
#        extension), hash_time.py (the plain sampler with either hash), then
#        bench_router.py (1-16 rows) and, with RO_PROF=1, a compiled 4-layer FP8 window profile
#        with SO, SO_BEFORE (.dev/s49: the router without it) and SO again
#   a    the goal figures at LAYERS (48 on an H200): solo spec 4 and batch_mtp W16 N=8, with and
#        without engine.draft_vocab=32768 (docs/bench/s43/device/calls.sh a)
set -u
export SO=${SO:-.dev/s49/new_cuda.so.xz}
. docs/bench/device_common.sh $SO
L="--layers ${LAYERS:-24}"; [ "${LAYERS:-24}" = 48 ] && L=
steps=(); for s in "$@"; do case $s in
rt) TAIL=12 st runs_time 120 python3 docs/bench/s47/device/runs_time.py ${RT_ROWS:-64,256,512} ;;
a)
  TAIL=10 st solo4 290 python3 scripts/bench_engine.py $F $L --configs solo,solo_draft32k --n 1 --max-tokens 256 --repeats 2 --json $R/solo4.json
  grep -h "warm-up: \|window 1x4@256\|prompt chunk" $R/solo4.log | cut -c1-160
  TAIL=10 st n8 250 python3 scripts/bench_engine.py $F $L --configs batch_mtp_w16,batch_mtp_w16_draft32k --n 8 --max-tokens 64 --repeats 2 --json $R/n8.json
  grep -h "warm-up: \|window 8x2@256\|prompt chunk" $R/n8.log | cut -c1-160 ;;
pc)
  for m in pc80 pctiny; do
    args="--backend auto --compile --iters 30 --shapes 8x2,1x4 --top 40 --json $R/$m.json --trace $R/$m.trace.json"
    [ $m = pc80 ] && args="--model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 4 $args"
    t0=$SECONDS; TORCH_LOGS=output_code timeout 200 python3 scripts/profile_window.py $args > $R/$m.txt 2> $R/$m.code.log
    echo "== $m rc=$? $((SECONDS-t0)) s"; xz -T4 $R/$m.code.log; [ -f $R/$m.trace.json ] && xz -T4 $R/$m.trace.json; tar czf $OUT/r.tgz -C $OUT r
  done
  grep -A12 "graph replay kernels" $R/pc80.txt | cut -c1-140 ;;
ro)
  TAIL=4 st router_tests 150 python3 -m pytest -q -p no:warnings -rf -o addopts="" -m gpu tests/test_router.py tests/test_moe_kernels.py tests/test_sampling.py tests/test_sampler_compile.py -k "route or router or hash or sampl"
  TAIL=6 st hash_time 150 python3 docs/bench/s49/device/hash_time.py
  for v in new old new2; do
    so=$SO; [ $v = old ] && so=${SO_BEFORE:-.dev/s49/new_cuda.so.xz}
    unxz -c $so > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so
    TAIL=8 st router_$v 60 python3 scripts/bench_router.py --json $R/router_$v.json
    [ $v = new2 ] || [ "${RO_PROF:-0}" = 0 ] || { TAIL=2 st prof_$v 100 python3 scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 4 --backend auto --compile --iters 50 --shapes 8x2,1x4 --top 12 --json $R/prof_$v.json; grep -h "graph replay:\|moe_route" $R/prof_$v.log | cut -c1-120; }
  done ;;
*) steps+=("$s") ;;
esac; done
[ ${#steps[@]} -gt 0 ] && exec bash docs/bench/s47/device/calls.sh "${steps[@]}"
true
