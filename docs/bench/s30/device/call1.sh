#!/usr/bin/env bash
# session 30, call 1: the GPU tests at main's head (down_mma default, the wide tables' fix, the
# prompt buffer fix, the mode identity), whether a row's bits depend on its launch's rows, and
# full depth batch_mtp W16 N=8 with engine.prefill_slots 8 against 1.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s30/main_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=8 st tests 170 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py tests/test_many_experts_identity.py "tests/test_engine_backends.py::test_gpu_prompt_chunks_past_the_last_bucket_leave_the_captured_chunks_their_buffer"
TAIL=4 st row_bits 40 python3 docs/bench/s30/device/row_bits.py
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2"
TAIL=4 st n8_ps8 200 python3 scripts/bench_engine.py $F --prefill-slots 8 --json $R/n8_ps8.json
TAIL=4 st n8_ps1 110 python3 scripts/bench_engine.py $F --json $R/n8_ps1.json
grep -h "prompt chunk\|rep \|tok/s" $R/n8_*.log | head -20
