#!/usr/bin/env bash
# Session 40's device calls. Each fits one call's 600 s.
#   first  on an H200: s39's `a` (full-depth batch_mtp W16 N=8 at 512-row launches on a bare
#          machine with four compile workers, then 128-row launches warm); on any other GPU: s39's
#          `m` (the draft chain's fewer kernels: the embedded model's 1 x 4 and 1 x 2 window
#          profiles, then its solo tok/s), then the FP8 shapes' cold warm-up at 4 layers under
#          cProfile
#   p24    what the captures' emptied caches cost a deep warm-up: the FP8 shapes at 24 layers, a
#          cold warm-up to fill the compile cache, then two warm-cache warm-ups, with the
#          captures emptying the allocator's caches (capture_empty.py: torch.cuda.graph's way,
#          the engine's before) and without (the engine's now)
#   spy    where a warm-up's time goes, sampled by py-spy (its wheel in .dev/s40, every thread,
#          idle time included, 50 Hz, raw collapsed stacks): the FP8 shapes' cold warm-up at 4
#          and at 24 layers, then the 24-layer one again on its warm compile cache
#   wk     the compile workers' text: the embedded model (batch_mtp W16 N=4, 128 tokens) cold
#          with no worker and with four, side by side on caches of their own, the texts
#          compared, then each cache's inductor output modules (named by their source's hash)
#          and FX-graph entries listed, to find the graphs whose code differs
# Carry .whl and .dev/s37 (the tree's CUDA extension for Python 3.12, stripped, xz), and .dev/s40
# (py-spy's wheel) for spy.
set -u
. docs/bench/device_common.sh .dev/s37/new_cuda.so.xz
W8="--configs batch_mtp_w16 --n 8 --max-tokens 16 --repeats 1 --compile-workers 0"
prof() {  # NAME: the 30 largest cumulative entries of $R/NAME.pstats into $R/NAME.txt
  python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(30)" $R/$1.pstats > $R/$1.txt 2>&1
}
case ${1:-first} in
first)
  nvidia-smi --query-gpu=name --format=csv,noheader
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    bash docs/bench/s39/device/calls.sh a
  else
    bash docs/bench/s39/device/calls.sh m
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_p4 TRITON_CACHE_DIR=/tmp/ind_p4/triton TAIL=3 st warm_prof4 200 python3 -m cProfile -o $R/warm_prof4.pstats scripts/bench_engine.py $F --layers 4 $W8
    grep -h "INFO warm-up" $R/warm_prof4.log; prof warm_prof4
  fi ;;
p24)
  export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_p24 TRITON_CACHE_DIR=/tmp/ind_p24/triton
  TAIL=3 st warm24_fill 270 python3 scripts/bench_engine.py $F --layers 24 $W8
  TAIL=3 st warm24_empty 130 python3 docs/bench/s40/device/capture_empty.py scripts/bench_engine.py $F --layers 24 $W8
  TAIL=3 st warm24_keep 130 python3 scripts/bench_engine.py $F --layers 24 $W8
  grep -h "INFO warm-up: 60" $R/warm24_fill.log $R/warm24_empty.log $R/warm24_keep.log ;;
wk)
  TINY="--configs batch_mtp_w16 --n 4 --prompt-tokens 64 --max-tokens 128 --overlap on --no-reverse --repeats 1"
  for W in 0 4; do
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_w$W TRITON_CACHE_DIR=/tmp/ind_w$W/triton timeout 250 python3 scripts/bench_engine.py $TINY --compile-workers $W --json $R/tiny_w$W.json > $R/tiny_w$W.log 2>&1 &
  done
  wait
  for W in 0 4; do grep -h "warm-up: [0-9]* window\|rep 0" $R/tiny_w$W.log | sed "s/^/w$W: /"; done
  python3 - $R/tiny_w0.json $R/tiny_w4.json <<'PY'
import json, sys
a, b = (json.load(open(p))["summary"] for p in sys.argv[1:3])
for k in a:
    print(k, "identical" if a[k]["text_digest"] == b.get(k, {}).get("text_digest") else "DIFFERENT")
PY
  for W in 0 4; do
    (cd /tmp/ind_w$W && find . -path ./triton -prune -o -type f -printf '%P %s\n' | sort > $R/cache_w$W.txt
     find . -path ./triton -prune -o -name '*.py' -print | tar czf $R/code_w$W.tgz -T -)
  done
  ls -la $R; tar czf $OUT/r.tgz -C $OUT r ;;
spy)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pyspy .dev/s40/py_spy-*.whl || exit 1
  for RUN in s4:4:150 s24:24:230 s24:24:110; do
    IFS=: read NAME L LIM <<< "$RUN"
    OUTN=$NAME; [ -e $R/$NAME.txt.gz ] && OUTN=${NAME}_warm
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$NAME TRITON_CACHE_DIR=/tmp/ind_$NAME/triton TAIL=2 st $OUTN $((LIM + 15)) timeout -s INT $LIM /tmp/pyspy/bin/py-spy record --nonblocking --idle --threads --rate 50 --format raw -o $R/$OUTN.txt -- python3 scripts/bench_engine.py $F --layers $L $W8
    grep -h "INFO warm-up" $R/$OUTN.log; gzip -f $R/$OUTN.txt
  done ;;
esac
