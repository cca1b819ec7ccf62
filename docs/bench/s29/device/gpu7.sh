#!/usr/bin/env bash
# session 29, call 7: this tree's defaults (down_mma on): the routed experts' and router's GPU
# tests and the many-expert mode identity
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s29/final_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=6 st tests 110 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py -k "down_mma or wide or gate_up_mma or launches_of_16 or same_bits" tests/test_many_experts_identity.py
