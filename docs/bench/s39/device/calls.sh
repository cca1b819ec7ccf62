#!/usr/bin/env bash
# Session 39's device calls. Each fits one call's 600 s. Any GPU:
#   t  is the embedded model's greedy text the same on every cold compile cache? Four cold
#      warm-ups side by side (inductor's default mode twice, its deterministic mode twice, each
#      on a cache of its own), then deterministic with four compile workers, then the tok/s of
#      both modes on their warm caches, one after the other
#   f  the FP8 80B shapes at 4 layers (the same graphs as full depth) on cold caches, inductor's
#      deterministic mode against its default: the warm-up and tok/s
#   g  what the attention gate's contiguous copy costs: window profiles (kernel count, replay time)
#      with it (docs/bench/s39/device/gate_copy.py) and with the gate a view, the embedded model
#      at 1 x 4 and 1 x 2, the FP8 80B shapes at 8 layers and 1 x 2
#   p  where a deep warm-up's extra time goes: the FP8 shapes' cold warm-up at 4 and at 24
#      layers under cProfile (the same 73 graphs; a bare H200 took 184 s at 48 layers where an
#      H100 takes 94 s at 4), the 30 largest cumulative entries of each
#   m  the draft chain's fewer kernels (the MTP's embedding lookup inside its fuse region, each
#      chain position added once): the embedded model's 1 x 4 and 1 x 2 window profiles (on an
#      H100 before: 179 kernels in 320.6 us and 128 in 222.6, h100_g/prof_tiny_view.log), then
#      the embedded model solo (6,222 tok/s on that H100 before)
# H200 (the full-depth FP8 80B does not fit an H100's 80 GB without the expert cache):
#   a  full-depth batch_mtp W16 N=8 at the default 512-row launches on a bare machine with four
#      compile workers (its warm-up line is the warm-up goal's figure, its tok/s the N=8 goal's),
#      then at 128-row launches on the warm caches (the baseline for 512)
# Carry .whl and .dev/s37 (the tree's CUDA extension for Python 3.12, stripped, xz).
set -u
. docs/bench/device_common.sh .dev/s37/new_cuda.so.xz
TINY="--configs batch_mtp_w16 --n 4 --prompt-tokens 64 --max-tokens 128 --overlap on --no-reverse"
same() {  # two bench_engine JSONs' greedy text digests (every config@N): identical or not
  python3 - "$@" <<'PY'
import json, sys
a, b = (json.load(open(p))["summary"] for p in sys.argv[1:3])
for key in a:
    if key in b:
        same = a[key]["text_digest"] == b[key]["text_digest"]
        print(f"{sys.argv[1].rsplit('/', 1)[-1]} vs {sys.argv[2].rsplit('/', 1)[-1]} {key}: "
              f"{'identical' if same else 'DIFFERENT'}")
PY
}
case ${1:-t} in
t)
  t0=$SECONDS
  for RUN in d0a:0 d0b:0 d1a:1 d1b:1; do
    IFS=: read NAME DET <<< "$RUN"
    TORCHINDUCTOR_DETERMINISTIC=$DET TORCHINDUCTOR_COMPILE_THREADS=4 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$NAME TRITON_CACHE_DIR=/tmp/ind_$NAME/triton \
      timeout 280 python3 scripts/bench_engine.py $TINY --repeats 1 --compile-workers 0 --json $R/tiny_$NAME.json > $R/tiny_$NAME.log 2>&1 &
  done
  wait; echo "== four cold side by side: $((SECONDS-t0)) s"
  for N in d0a d0b d1a d1b; do grep -h "warm-up: \|rep 0" $R/tiny_$N.log | sed "s/^/$N: /"; done
  same $R/tiny_d0a.json $R/tiny_d0b.json; same $R/tiny_d1a.json $R/tiny_d1b.json; same $R/tiny_d0a.json $R/tiny_d1a.json
  TORCHINDUCTOR_DETERMINISTIC=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_w4 TRITON_CACHE_DIR=/tmp/ind_w4/triton TAIL=3 st tiny_d1_w4 150 python3 scripts/bench_engine.py $TINY --repeats 1 --compile-workers 4 --json $R/tiny_d1_w4.json
  grep -h "warm-up: \|compile workers: [0-9]* graphs compiled in" $R/tiny_d1_w4.log
  same $R/tiny_d1a.json $R/tiny_d1_w4.json
  for N in d0a:0 d1a:1; do
    IFS=: read NAME DET <<< "$N"
    TORCHINDUCTOR_DETERMINISTIC=$DET TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$NAME TRITON_CACHE_DIR=/tmp/ind_$NAME/triton TAIL=4 st tiny_warm_$NAME 90 python3 scripts/bench_engine.py --configs solo,batch_mtp_w16 --n 1,8 --prompt-tokens 64 --max-tokens 256 --overlap on --no-reverse --repeats 3 --json $R/tiny_warm_$NAME.json
  done ;;
a)
  TAIL=8 st n8_w512_cw4 330 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --compile-workers 4 --json $R/n8_w512_cw4.json
  grep -h "warm-up: \|compile workers: [0-9]* graphs compiled in" $R/n8_w512_cw4.log
  TAIL=6 st n8_w128 200 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options wide_rows=128 --json $R/n8_w128.json ;;
f)
  # the FP8 80B shapes at 4 layers (the same graphs as full depth), cold caches: inductor's
  # deterministic mode against its default (warm-up and tok/s), no workers
  W="$F --layers 4 --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --compile-workers 0"
  for RUN in d1:1 d0:0; do
    IFS=: read NAME DET <<< "$RUN"
    TORCHINDUCTOR_DETERMINISTIC=$DET TORCHINDUCTOR_CACHE_DIR=/tmp/ind_f$NAME TRITON_CACHE_DIR=/tmp/ind_f$NAME/triton TAIL=3 st fp8_4l_$NAME 150 python3 scripts/bench_engine.py $W --json $R/fp8_4l_$NAME.json
    grep -h "warm-up: 60\|rep " $R/fp8_4l_$NAME.log
  done ;;
p)
  for L in 4 24; do
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_p$L TRITON_CACHE_DIR=/tmp/ind_p$L/triton TAIL=3 st warm_prof$L 260 python3 -m cProfile -o $R/warm_prof$L.pstats scripts/bench_engine.py $F --layers $L --configs batch_mtp_w16 --n 8 --max-tokens 16 --repeats 1 --compile-workers 0
    grep -h "INFO warm-up" $R/warm_prof$L.log
    python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(30)" $R/warm_prof$L.pstats > $R/warm_prof$L.txt 2>&1
  done ;;
m)
  P="scripts/profile_window.py --backend auto --compile --iters 200 --top 6 --shapes 1x4,1x2"
  TAIL=4 st prof_tiny_now 90 python3 $P --json $R/prof_tiny_now.json
  grep -h "graph replay" $R/prof_tiny_now.log
  TAIL=4 st tiny_solo 120 python3 scripts/bench_engine.py --configs solo --n 1 --prompt-tokens 64 --max-tokens 256 --overlap on --no-reverse --repeats 3 --json $R/tiny_solo.json ;;
g)
  P="scripts/profile_window.py --backend auto --compile --iters 100 --top 6"
  P8="$P --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 --shapes 1x2"
  TAIL=14 st prof_tiny_copy 90 python3 docs/bench/s39/device/gate_copy.py $P --shapes 1x4,1x2 --json $R/prof_tiny_copy.json
  TAIL=14 st prof_tiny_view 90 python3 $P --shapes 1x4,1x2 --json $R/prof_tiny_view.json
  TAIL=10 st prof8_copy 120 python3 docs/bench/s39/device/gate_copy.py $P8 --json $R/prof8_copy.json
  TAIL=10 st prof8_view 120 python3 $P8 --json $R/prof8_view.json
  grep -h "graph replay" $R/prof_*.log $R/prof8_*.log ;;
esac
