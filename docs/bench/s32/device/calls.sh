#!/usr/bin/env bash
# The thirty-first's next.sh (docs/bench/s30/device/next.sh) split into two device calls, each
# under the 600 s limit: `bash docs/bench/s32/device/calls.sh a` (the GPU tests and full depth
# N=8 W16 with 8-slot chunks at 128-row against 64-row launches, the second warm from the first's
# compile cache, then a 40-token prompt's chunk) and `... b` (row_bits, the tiny model's 8-slot
# chunks against 1, engine.compile_specialize_one=false on a cold cache of its own) and `... c`
# (an 8-layer window profile). Carry .whl and .dev/s31 (this tree's CUDA extension, xz).
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s31/main_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --prefill-slots 8"
T="--configs batch_mtp_w16 --n 8 --max-tokens 128 --repeats 3 --overlap on --no-reverse"
F40="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse --configs solo_spec2 --n 1 --prompt-tokens 40 --max-tokens 32 --repeats 2"
case ${1:-a} in
a)
  TAIL=8 st tests 150 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py tests/test_many_experts_identity.py tests/test_expert_cache_gpu.py
  TAIL=4 st n8_ps8_w128 240 python3 scripts/bench_engine.py $F --kernel-options wide_rows=128 --json $R/n8_ps8_w128.json
  TAIL=4 st n8_ps8_w64 120 python3 scripts/bench_engine.py $F --json $R/n8_ps8_w64.json
  # padding parked in the MoE layers (e5f217b): expect the 40-token chunk near 24 ms, not 29.4
  TAIL=3 st solo_p40 100 python3 scripts/bench_engine.py $F40 --json $R/solo_p40.json
  grep -h "prompt chunk\|rep \|warm-up: 60" $R/n8_*.log $R/solo_p40.log ;;
b)
  TAIL=6 st row_bits 40 python3 docs/bench/s30/device/row_bits.py
  TAIL=3 st tiny_ps8 110 python3 scripts/bench_engine.py $T --prefill-slots 8 --json $R/tiny_ps8.json
  TAIL=3 st tiny_ps1 90 python3 scripts/bench_engine.py $T --json $R/tiny_ps1.json
  # engine.compile_specialize_one=false on a cold compile cache of its own: the warm-up against
  # call a's first (cold) run of the same cohort, and its tok/s
  TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor_one TAIL=4 st n8_ps8_w128_one_off 260 python3 scripts/bench_engine.py $F --kernel-options wide_rows=128 --specialize-one off --json $R/n8_ps8_w128_one_off.json
  grep -h "warm-up: 60\|rep " $R/n8_*.log ;;
c)
  # where the windows' time goes, the groups now routed apart (profile_window.py's lanes hold
  # distinct tokens): 8 layers compiled, graph replay
  TAIL=40 st profile8 300 python3 scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 --backend auto --compile --shapes 1x2,8x2 --iters 50 --top 25 --json $R/profile8.json ;;
esac
