#!/usr/bin/env bash
# session 29, call 2: the wide launch's down kernel by run length; full-depth solo (spec 2 and 4)
# with the sort fallback of the router (the default since fa04cb2)
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s29/main_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=30 st wide_runs 90 python3 docs/bench/s29/device/wide_runs.py
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse"
TAIL=8 st solo2 200 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --json $R/solo2.json
TAIL=8 st solo4 150 python3 scripts/bench_engine.py $F --configs solo --n 1 --max-tokens 256 --repeats 2 --json $R/solo4.json
