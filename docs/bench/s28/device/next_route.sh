#!/usr/bin/env bash
# For the session after the twenty-eighth (GPU_RUNBOOK step 1): the router's prompt-chunk paths.
# Build this tree's extension for Python 3.12 here, carry it xz-compressed as .dev/sNN/main_cuda.so.xz
# with .whl, then: STRATA_COMMIT=<hash> bash docs/bench/s28/device/next_route.sh
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s29/main_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
# the sort fallback (default) and route_chunks: their GPU tests, then the chunk's profile both ways
TAIL=4 st tests 150 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_router.py tests/test_many_experts_identity.py
TAIL=30 st prefill8 150 python3 scripts/profile_window.py --model qwen3-next-80b-a3b-fp8 --load-format dummy --layers 8 --backend auto --compile --shapes 1x2 --prefill 64 --iters 10 --top 12 --json $R/prefill8.json
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2"
TAIL=8 st n8_sort 200 python3 scripts/bench_engine.py $F --json $R/n8_sort.json
TAIL=8 st n8_route 130 python3 scripts/bench_engine.py $F --kernel-options route_chunks=1 --json $R/n8_route.json
