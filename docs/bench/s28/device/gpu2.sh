#!/usr/bin/env bash
# session 28, call 2: the wide FP8 MoE launches and the ba-in-conv branch: GPU tests, kernel times, full depth A/B
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s28/new_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=12 st tests 200 python3 -m pytest -q -p no:warnings -m gpu tests/test_moe_kernels.py tests/test_kernels_gpu.py tests/test_many_experts_identity.py -k "wide or launches_of_16 or more_than_32 or qkvz_ba or every_mode_fp8"
TAIL=5 st wide_time 60 python3 docs/bench/s28/device/wide_time.py
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse"
TAIL=12 st n8_wide 200 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options fp8_wide=1 --json $R/n8_wide.json
TAIL=12 st n8_base 130 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --json $R/n8_base.json
TAIL=6 st solo_fp8 100 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --fp8-dense fp8 --json $R/solo_fp8.json
TAIL=6 st solo_auto 90 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --json $R/solo_auto.json
