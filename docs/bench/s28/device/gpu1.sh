#!/usr/bin/env bash
# session 28, call 1: main's full-depth FP8 windows of every shape (the simulator preset's refit), then the tiny model on the shipped prompts
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
unxz -c .dev/s28/main_cuda.so.xz > strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse"
TAIL=14 st n8 300 python3 scripts/bench_engine.py $F --configs batch_mtp_w16,batch --n 8 --max-tokens 64 --repeats 2 --json $R/n8.json
TAIL=10 st solo 200 python3 scripts/bench_engine.py $F --configs solo_spec2,solo_spec4 --n 1 --max-tokens 256 --repeats 2 --json $R/solo.json
TAIL=8 st tiny 200 python3 scripts/bench_engine.py --configs solo,batch_mtp_w16 --n 1,8 --max-tokens 256 --overlap on --repeats 3 --json $R/tiny.json
