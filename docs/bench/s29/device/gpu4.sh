#!/usr/bin/env bash
# session 29, call 4: the down kernel on tensor cores (moe_launch_options(down_mma=)): its GPU
# tests, kernel times by rows, then full depth batch_mtp W16 N=8 with and without it
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s29/mma2_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=12 st tests 120 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py -k "down_mma or gate_up_mma or wide_launches"
TAIL=8 st rows 90 python3 docs/bench/s29/device/down_mma_rows.py
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2"
TAIL=9 st n8_mma 200 python3 scripts/bench_engine.py $F --kernel-options down_mma=1 --json $R/n8_mma.json
TAIL=9 st n8_base 120 python3 scripts/bench_engine.py $F --json $R/n8_base.json
