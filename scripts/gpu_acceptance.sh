#!/usr/bin/env bash
# The GPU acceptance runs, in two parts that each fit one device call (10 minutes: each part's
# step limits add up to under 600 s), with a time limit on every step so that one slow step
# cannot starve the rest. Results go to $OUT.
#
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 1    # ~6 min: identity test, engine bench, sim check
#   STRATA_COMMIT=<hash> bash scripts/gpu_acceptance.sh 2    # ~7 min: graph soak, server bench
#
# STRATA_COMMIT names the commit in the results (the device's copy of the tree may carry a
# stale .git). Every step prints one summary line; see docs/GPU_RUNBOOK.md for what each feeds.
set -u
part=${1:?usage: gpu_acceptance.sh 1|2}
OUT=${OUT:?set OUT to the results directory}
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc ($((SECONDS - t0)) s of $limit)"
  grep -v -i -E "warn|Loading weights|^\[transformers\]|softmax|^$" "$OUT/$name.log" | tail -n "${TAIL:-6}"
}
step build 90 python3 setup.py build_ext --inplace -q
case $part in
1)
  step gpu_identity 90 python3 -m pytest -q -x -m gpu tests/test_engine_backends.py
  TAIL=8 step engine 200 python3 scripts/bench_engine.py --n 1,2,4,8 \
      --configs solo,batch,batch_mtp,batch_mtp_w16 --repeats 3 --max-tokens 256 --hf \
      --json "$OUT/engine.json" --md "$OUT/engine.md"
  step solo_eager 50 python3 scripts/bench_engine.py --n 1 --configs solo,solo_eager,solo_spec2,solo_spec3 \
      --repeats 1 --no-reverse --max-tokens 128 --json "$OUT/solo_eager.json" --md "$OUT/solo_eager.md"
  step sim_check 170 python3 scripts/sim_gpu_check.py --out "$OUT/simchk"
  ;;
2)
  step soak_layout 260 python3 scripts/soak_graphs.py --reserves 700,2048,4096 --graph-keys layout \
      --windows 10000 --min-layouts 500 --max-seconds 40 --json "$OUT/soak_layout.json"
  step soak_shape 60 python3 scripts/soak_graphs.py --reserves 2048 --graph-keys shape --windows 5000 \
      --min-layouts 1 --max-seconds 20 --warm-windows 100 --json "$OUT/soak_shape.json"
  TAIL=14 step serve 180 python3 scripts/bench.py --device cuda --dtype bfloat16 \
      --configs solo,batch,batch_mtp --n 1,2,4,8 --repeats 1 --warmup full --no-progress \
      --out "$OUT/serve"
  ;;
esac
