#!/usr/bin/env bash
# On the device: the working tree ("new") against the tree scripts/ab_prepare.sh packed into
# .dev/NAME ("base"), each with its own extension, the steps named, in order, each with its own
# time limit; logs and JSON under $OUT/ab (packed into $OUT/ab.tgz after every step, so a call
# cut short still returns what ran).
#
#   bash scripts/device_ab.sh tests,prof_tiny,tiny,full_solo
#
# Steps (new first, then base, in the same call: machines differ by a few percent):
#   tests       GPU tests of the new tree (TEST_FILES, default the kernels', the router's and
#               the engine backends' files; TESTS, a pytest -k expression)
#   prof_tiny   profile_window.py --compile on the tiny model, 1x2 and 8x2, both trees
#   tiny        the tiny engine solo (N=1) and batch_mtp W16 (N=8), 256 tokens, overlap on
#   full_solo   full depth FP8 dummy, synthetic acceptance 0.8, solo spec 2, 256 tokens
#   full_n8     full depth batch_mtp W16 at N=8, 64 tokens
#   ident       the tiny engine compiled, solo against batch_mtp at N=2: greedy identity
#   moe         the routed experts alone at 1-32 rows, FP8 and bf16 with the folded shared
#               expert, at each tree's default launch switches (bench_kernels.py --moe), both
#               trees
#   router      the router kernel: both trees' ids and weights on the same random inputs
#               (compared bit for bit), then bench_router.py in each
#   hf          bf16 dummy weights at 12 layers (the depth that fits twice), the new tree's
#               solo and batch at N=1 against transformers generate() (--hf)
#   ncu         Nsight Compute on the new tree's router and FP8 streamed experts at 2 and 16
#               rows (scripts/ncu_moe.py --router): stall reasons, issue slots, bytes
# Env: NAME (base), TESTS, and per-step limits TESTS_S (150), PROF_S (100), TINY_S (110),
# FULL_S (220), N8_S (220), IDENT_S (200), NCU_S (150), HF_S (240),
# ROUTER_S (100), MOE_S (120).
set -u
OUT=${OUT:?set OUT to the results directory}
NAME=${NAME:-base}
steps=${1:?usage: scripts/device_ab.sh STEP[,STEP...]}
R=/tmp/ab
mkdir -p "$R"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
SO=strata_cuda.cpython-312-x86_64-linux-gnu.so
B=.dev/$NAME
[ -d "$B" ] || { echo "device_ab: $B missing (run scripts/ab_prepare.sh here first)"; exit 2; }
unxz -c .dev/new_cuda.so.xz > "strata/kernels/$SO" || exit 1
unxz -c ".dev/${NAME}_cuda.so.xz" > "$B/strata/kernels/$SO" || exit 1
cp -r strata/assets "$B/strata/"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/gpu.txt"
echo "base $(cat "$B/REV" 2>/dev/null)" | tee -a "$R/gpu.txt"

pack() { tar -czf "$OUT/ab.tgz.part" -C /tmp ab && mv -f "$OUT/ab.tgz.part" "$OUT/ab.tgz"; }
# step NAME LIMIT TAIL CMD...: run with a limit, print rc, seconds and the log's last lines
step() {
  local name=$1 lim=$2 tail=$3
  shift 3
  local t0=$SECONDS
  timeout "$lim" "$@" > "$R/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0)) s"
  grep -v -i -E "warn|^$" "$R/$name.log" | tail -n "$tail"
  pack
}
# ab NAME LIMIT TAIL SCRIPT ARGS...: step NAME_new with the working tree's SCRIPT, then NAME_base
# with the base tree's (its own package first on the path; its scripts put their root first
# too); @T@ in ARGS becomes new or base (the JSON each writes)
ab() {
  local name=$1 lim=$2 tail=$3 script=$4 t
  shift 4
  for t in new base; do
    local args=("${@//@T@/$t}")
    if [ "$t" = new ]; then step "${name}_$t" "$lim" "$tail" python3 "$script" "${args[@]}"
    else step "${name}_$t" "$lim" "$tail" env "PYTHONPATH=/tmp/site:$PWD/$B" python3 \
      "$B/$script" "${args[@]}"; fi
  done
}
T="--prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --no-reverse"
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse"
for s in ${steps//,/ }; do
  case $s in
    tests)
      step tests "${TESTS_S:-150}" 4 python3 -m pytest -q -p no:warnings -m gpu \
        ${TEST_FILES:-tests/test_kernels_gpu.py tests/test_router.py tests/test_engine_backends.py} \
        -k "${TESTS:-not programmatic and not traced_serial}" ;;
    prof_tiny)
      ab prof_tiny "${PROF_S:-100}" 2 scripts/profile_window.py --backend auto --compile \
        --shapes 1x2,8x2 --iters 100 --top 12 --json "$R/prof_tiny_@T@.json"
      grep -E "^=== window|graph replay" "$R/prof_tiny_new.log" "$R/prof_tiny_base.log" ;;
    tiny)
      ab tiny_solo "${TINY_S:-110}" 6 scripts/bench_engine.py --configs solo --n 1 $T \
        --json "$R/tiny_solo_@T@.json"
      ab tiny_w16 "${TINY_S:-110}" 6 scripts/bench_engine.py --configs batch_mtp_w16 --n 8 $T \
        --json "$R/tiny_w16_@T@.json" ;;
    full_solo)
      ab full_solo "${FULL_S:-220}" 9 scripts/bench_engine.py $F --configs solo_spec2 --n 1 \
        --max-tokens 256 --repeats 3 --json "$R/full_solo_@T@.json" ;;
    full_n8)
      ab full_n8 "${N8_S:-220}" 12 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 \
        --max-tokens 64 --repeats 2 --json "$R/full_n8_@T@.json" ;;
    ident)
      step ident "${IDENT_S:-200}" 3 python3 scripts/bench_engine.py --configs solo,batch_mtp --n 2 \
        --max-tokens 48 --repeats 1 --overlap on ;;
    moe)
      ab moe "${MOE_S:-120}" 16 scripts/bench_kernels.py --moe --no-linear --moe-shared \
        --out "$R/moe_@T@.json" ;;
    router)
      cat > "$R/route_bits.py" <<'PY'
import sys
import torch
from strata.kernels import cyext_ops as C
g = torch.Generator(device="cuda").manual_seed(0)
out = {}
for m in (1, 2, 5, 16, 32):
    x = torch.randn(m, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(520, 2048, device="cuda", generator=g) / 45).to(torch.bfloat16)
    b = torch.randn(512, device="cuda", generator=g)
    out[m] = [C.gpu_moe_route(x, w, 512, 10, True, None, 512),
              C.gpu_moe_route(x, w, 512, 10, True, b, 512),
              C.gpu_moe_route(x, w, 512, 10, False, None, -1)]
torch.save(out, sys.argv[1])
PY
      step route_bits_new 60 2 env PYTHONPATH=/tmp/site:$PWD python3 "$R/route_bits.py" "$R/route_new.pt"
      step route_bits_base 60 2 env PYTHONPATH=/tmp/site:$PWD/$B python3 "$R/route_bits.py" "$R/route_base.pt"
      python3 -c "
import torch
a, b = torch.load('$R/route_new.pt'), torch.load('$R/route_base.pt')
same = all(torch.equal(u, v) for m in a for pa, pb in zip(a[m], b[m]) for u, v in zip(pa, pb))
print('route bits: new and base', 'identical' if same else 'DIFFER')" | tee "$R/route_bits.txt"
      ab router "${ROUTER_S:-100}" 8 scripts/bench_router.py --rows 1,2,4,8,16 \
        --json "$R/router_@T@.json" ;;
    hf)
      step hf "${HF_S:-240}" 8 python3 scripts/bench_engine.py --preset qwen3_next_80b_a3b \
        --load-format dummy --layers 12 --hf --configs solo,batch --n 1 --max-tokens 64 \
        --repeats 2 --no-reverse --overlap on --json "$R/hf12.json" ;;
    ncu)
      step ncu "${NCU_S:-150}" 3 ncu --clock-control none --kernel-name regex:moe_ \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
        python3 scripts/ncu_moe.py --rows 2,16 --variants stream --weights fp8 --router ;;
    *) echo "device_ab: unknown step $s (tests, prof_tiny, tiny, full_solo, full_n8, ident, moe, router, hf, ncu)"; exit 2 ;;
  esac
done
