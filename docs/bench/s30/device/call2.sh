#!/usr/bin/env bash
# session 30, call 2: the down kernel chosen by the rows' kind (prompt chunk or decode window)
# instead of their count: the MoE GPU tests (a row's bits in any launch, either kind), the mode
# identity, the expert cache's GPU tests; the tiny model's batch_mtp W16 N=8 with
# engine.prefill_slots 8 against 1.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s30/kind_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=8 st tests 200 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py tests/test_many_experts_identity.py tests/test_expert_cache_gpu.py
TAIL=4 st row_bits 40 python3 docs/bench/s30/device/row_bits.py
T="--configs batch_mtp_w16 --n 8 --max-tokens 128 --repeats 3 --overlap on --no-reverse"
TAIL=3 st tiny_ps8 120 python3 scripts/bench_engine.py $T --prefill-slots 8 --json $R/tiny_ps8.json
TAIL=3 st tiny_ps1 120 python3 scripts/bench_engine.py $T --json $R/tiny_ps1.json
grep -h "rep \|prompt chunk" $R/tiny_*.log
