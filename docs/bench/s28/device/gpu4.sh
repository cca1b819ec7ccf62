#!/usr/bin/env bash
# session 28, call 4: wide FP8 launches on by default: GPU tests of the MoE kernels and the expert cache; held-out cohorts for the simulator's FP8 preset
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s28/final_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=4 st tests 200 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py tests/test_kernels_gpu.py tests/test_expert_cache_gpu.py -k "not engine"
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse"
TAIL=8 st batch8 160 python3 scripts/bench_engine.py $F --configs batch --n 8 --max-tokens 64 --repeats 2 --json $R/batch8.json
TAIL=6 st solo4 90 python3 scripts/bench_engine.py $F --configs solo_spec4 --n 1 --max-tokens 256 --repeats 2 --json $R/solo4.json
