#!/usr/bin/env bash
# session 27, call 4a: the router's best three + down runs of 2 ("new") against main ("base"): GPU tests, full depth N=8 and solo
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s27/new_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
for t in base; do T=/tmp/t_$t; mkdir -p $T; cp -r strata conf scripts tests pyproject.toml $T/
  unxz -c .dev/s27/${t}_cuda.so.xz > $T/strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=3 st tests 80 python3 -m pytest -q -p no:warnings -m gpu tests/test_router.py tests/test_moe_kernels.py -k "route or down_split or same_bits or launches_of_16"
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse"
B="env PYTHONPATH=/tmp/site:/tmp/t_base python3 /tmp/t_base/scripts/bench_engine.py"
TAIL=9 st n8_new 180 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --json $R/n8_new.json
TAIL=9 st n8_base 120 $B $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --json $R/n8_base.json
TAIL=5 st solo_new 90 python3 scripts/bench_engine.py $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --json $R/solo_new.json
TAIL=5 st solo_base 90 $B $F --configs solo_spec2 --n 1 --max-tokens 256 --repeats 2 --json $R/solo_base.json
