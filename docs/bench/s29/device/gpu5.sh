#!/usr/bin/env bash
# session 29, call 5: the tensor-core down kernel with its act loads a chunk ahead; both down
# kernels with one ring stage per warp (experiment-only STRATA_EXP_DN=1)
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s29/mma3_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=8 st tests 100 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py -k "down_mma"
TAIL=8 st rows 60 python3 docs/bench/s29/device/down_mma_rows.py
TAIL=8 st rows_dn1 60 env STRATA_EXP_DN=1 python3 docs/bench/s29/device/down_mma_rows.py
