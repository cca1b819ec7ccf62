#!/usr/bin/env bash
# Kernel work on a lent H200 in one device call: install the carried wheels, use carried
# extensions when they import (else build them, ~70 s), then the named parts, each with a time
# limit, logs and JSON under $OUT.
#
#   bash scripts/device_kernels.sh profile   # compiled 8-layer FP8 windows: replay + attribution
#   bash scripts/device_kernels.sh profile_full   # the same at full depth (48 layers)
#   bash scripts/device_kernels.sh prefill_full   # a 64-token prompt chunk at full depth
#   bash scripts/device_kernels.sh moe       # the MoE / linear micro-benchmark
#   bash scripts/device_kernels.sh moev      # moe_experts only, every launch variant
#   bash scripts/device_kernels.sh moevl     # every moe_experts variant, then the linears
#   bash scripts/device_kernels.sh moes      # GPU tests of the MoE kernels, then the streamed
#                                            # kernels (gate/up on tensor and on CUDA cores)
#                                            # against the per-block ones (MOE_VARIANTS)
#   bash scripts/device_kernels.sh conv      # causal_conv_window: conv_kernel vs the serial one
#   bash scripts/device_kernels.sh tests     # GPU tests of the MoE kernels and the samplers
#   bash scripts/device_kernels.sh cachetests  # GPU tests: cache kernel paths, conv and MoE bits
#   bash scripts/device_kernels.sh cache100  # engine tok/s: no cache vs a cache holding 100%
#                                            # (both overlapped, solo and batch_mtp, N=1,4)
#   bash scripts/device_kernels.sh router    # router GPU tests, then bench_router.py
#   bash scripts/device_kernels.sh profile,tests   # several, in order
#
# Env: LAYERS (8), SHAPES (1x2,4x2), PROFILE_S (240), FULL_S (150), MOE_S (120), CONV_S (60),
# TESTS_S (100), CACHETESTS_S (120), CACHE100_S (300), ROUTER_S (120).
set -u
OUT=${OUT:?set OUT to the results directory}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
t0=$SECONDS
if ! python3 -c "import strata.kernels.strata_cuda" 2>/dev/null; then
  timeout 150 python3 setup.py build_ext --inplace -q > "$OUT/build.log" 2>&1
  echo "== build: rc=$? ($((SECONDS - t0)) s)"
else
  echo "== carried extensions import"
fi
for part in ${1//,/ }; do
  t0=$SECONDS
  case $part in
  profile)
    timeout "${PROFILE_S:-240}" python3 scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 \
      --load-format dummy --layers "${LAYERS:-8}" --backend auto --compile \
      --shapes "${SHAPES:-1x2,4x2}" --iters 100 --top 22 --json "$OUT/profile.json" \
      > "$OUT/profile.log" 2>&1
    rc=$?
    grep -v -i -E "warn|^$" "$OUT/profile.log" | tail -n 120 ;;
  profile_full)
    timeout "${FULL_S:-150}" python3 scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 \
      --load-format dummy --backend auto --compile --shapes "${SHAPES:-1x2,4x2}" --iters 50 \
      --top 12 --json "$OUT/profile_full.json" > "$OUT/profile_full.log" 2>&1
    rc=$?
    grep -E "^===|graph replay|^region|^[a-z(:+)]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$" \
      "$OUT/profile_full.log" ;;
  prefill_full)
    timeout "${FULL_S:-150}" python3 scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 \
      --load-format dummy --backend auto --compile --shapes 1x2 --prefill 64 --iters 20 \
      --top 15 --json "$OUT/prefill_full.json" > "$OUT/prefill_full.log" 2>&1
    rc=$?
    grep -v -i -E "warn|^$" "$OUT/prefill_full.log" | tail -n 70 ;;
  moe)
    timeout "${MOE_S:-120}" python3 scripts/bench_kernels.py --moe --out "$OUT/bench_moe.json" \
      > "$OUT/moe.log" 2>&1
    rc=$?
    tail -n 30 "$OUT/moe.log"; grep -E "moe_experts" "$OUT/bench_moe.md" ;;
  moev)
    timeout "${MOE_S:-120}" python3 scripts/bench_kernels.py --moe --moe-variants --no-linear \
      --out "$OUT/bench_moe_variants.json" > "$OUT/moev.log" 2>&1
    rc=$?
    grep -E "moe_experts|ceiling|wrote" "$OUT/moev.log" ;;
  moevl)
    timeout "${MOE_S:-120}" python3 scripts/bench_kernels.py --moe --moe-variants \
      --out "$OUT/bench_moe_variants.json" > "$OUT/moevl.log" 2>&1
    rc=$?
    grep -E "moe_experts|linear|ceiling|wrote" "$OUT/moevl.log" ;;
  moes)
    timeout "${TESTS_S:-150}" python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py \
      > "$OUT/moes_tests.log" 2>&1
    rc=$?
    tail -n 12 "$OUT/moes_tests.log"
    timeout "${MOE_S:-150}" python3 scripts/bench_kernels.py --moe --no-linear \
      --moe-variants "${MOE_VARIANTS:-stream-mma,stream,stream-nopdl,+db+xsmem}" \
      --out "$OUT/bench_moe_stream.json" > "$OUT/moes.log" 2>&1
    rc=$((rc | $?))
    grep -E "moe_experts|ceiling|wrote|Error|error" "$OUT/moes.log" ;;
  conv)
    timeout "${CONV_S:-60}" python3 scripts/bench_kernels.py --conv \
      --out "$OUT/bench_conv.json" > "$OUT/conv.log" 2>&1
    rc=$?
    grep -E "^conv|wrote|Error" "$OUT/conv.log" ;;
  tests)
    timeout "${TESTS_S:-100}" python3 -m pytest -q -x -m gpu tests/test_sampler_compile.py \
      tests/test_moe_kernels.py tests/test_engine_backends.py > "$OUT/tests.log" 2>&1
    rc=$?
    tail -n 15 "$OUT/tests.log" ;;
  cachetests)
    # the expert-cache file last: its last test reads host memory by bulk copies
    timeout "${CACHETESTS_S:-120}" python3 -m pytest -q -x -m gpu tests/test_kernels_gpu.py \
      tests/test_moe_kernels.py tests/test_expert_cache_gpu.py \
      -k "miss_path or counts or streamed or host_store or conv or launch_variants" > "$OUT/cachetests.log" 2>&1
    rc=$?
    tail -n 15 "$OUT/cachetests.log" ;;
  cache100)
    timeout "${CACHE100_S:-300}" python3 scripts/bench_expert_cache.py --part study \
      --layers "${LAYERS:-8}" --skew 1.0 --budgets 100 --overlap on --configs solo,batch_mtp \
      --n 1,4 --repeats 2 --json "$OUT/cache100.json" > "$OUT/cache100.log" 2>&1
    rc=$?
    grep -v -i -E "warn|^$" "$OUT/cache100.log" | tail -n 25 ;;
  router)
    timeout "${ROUTER_S:-120}" python3 -m pytest -q -x -m gpu tests/test_router.py \
      > "$OUT/router_tests.log" 2>&1
    rc=$?
    tail -n 5 "$OUT/router_tests.log"
    timeout "${ROUTER_S:-120}" python3 scripts/bench_router.py --json "$OUT/router.json" \
      > "$OUT/router.log" 2>&1
    rc=$((rc + $?))
    tail -n 6 "$OUT/router.log" ;;
  *) echo "unknown part $part"; rc=2 ;;
  esac
  echo "== $part: rc=$rc ($((SECONDS - t0)) s)"
done
