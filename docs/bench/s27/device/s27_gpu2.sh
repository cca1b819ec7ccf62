#!/usr/bin/env bash
# session 27, call 2: phase 2 of the router in registers (1: taken mask + tree, 2: sorted lists) against shared-memory rescans (0): stamps, bits, GPU tests, bench_router
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s27/regs_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
TB=/tmp/t_base; mkdir -p $TB; cp -r strata conf scripts tests pyproject.toml $TB/
unxz -c .dev/s27/main_cuda.so.xz > $TB/strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
for v in 0 1 2; do TAIL=16 st probe$v 60 bash -c "nvcc -O3 -std=c++17 -arch=sm_90 -DSTRATA_ROUTER_PHASE2=$v -Icyext/src scripts/probe_router_stamps.cu -o /tmp/probe_router$v && /tmp/probe_router$v 1 2 4 8 16"; done
TAIL=4 st tests 200 python3 -m pytest -q -p no:warnings -m gpu tests/test_router.py
TAIL=8 st bench_regs 60 python3 scripts/bench_router.py --json $R/bench_regs.json
TAIL=8 st bench_base 60 env PYTHONPATH=/tmp/site:$TB python3 $TB/scripts/bench_router.py --json $R/bench_base.json
TAIL=8 st bench_regs2 60 python3 scripts/bench_router.py --json $R/bench_regs2.json
