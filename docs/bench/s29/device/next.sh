#!/usr/bin/env bash
# For the session after the twenty-ninth (GPU_RUNBOOK step 1): the tensor-core down kernel's
# default (on since 4aabd54) and the wide tables' fix (e540e30), neither tested on a GPU at
# main's head. Build this tree's extension for Python 3.12, carry it xz-compressed as
# .dev/s30/main_cuda.so.xz with .whl, then: STRATA_COMMIT=<hash> bash docs/bench/s29/device/next.sh
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s30/main_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=6 st tests 150 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py tests/test_many_experts_identity.py
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse"
TAIL=8 st solo2_mma 200 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --json $R/solo2_mma.json
TAIL=8 st solo2_cuda 100 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --kernel-options down_mma=0 --json $R/solo2_cuda.json
TAIL=8 st batch8 150 python3 scripts/bench_engine.py $F --configs batch --n 8 --max-tokens 64 --repeats 2 --json $R/batch8.json
