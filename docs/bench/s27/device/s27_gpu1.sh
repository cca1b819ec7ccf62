#!/usr/bin/env bash
# session 27, call 1: the router's phase 2 by stamps; the down kernel's member runs; the tiny mode-identity GPU test; the down-split GPU tests
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s27/main_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=30 st probe 90 bash -c "nvcc -O3 -std=c++17 -arch=sm_90 -Icyext/src scripts/probe_router_stamps.cu -o /tmp/probe_router && /tmp/probe_router 1 2 4 8 16"
TAIL=40 st runs 150 python3 scripts/bench_kernels.py --moe --no-linear --moe-shared --moe-variants stream-mma,stream-mma-runs1,stream-mma-runs2,stream-mma-runs4,stream-mma-runs8 --out $R/runs.json
TAIL=4 st split_tests 150 python3 -m pytest -q -p no:warnings -m gpu tests/test_moe_kernels.py -k "down_split"
TAIL=6 st identity 420 python3 -m pytest -q -p no:warnings -m gpu tests/test_engine_backends.py
