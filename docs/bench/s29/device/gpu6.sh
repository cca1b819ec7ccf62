#!/usr/bin/env bash
# session 29, call 6: down_mma for launches of more than 32 rows with one ring stage per down warp
# there: GPU tests, kernel times by rows, full depth batch_mtp W16 N=8: main's extension, this
# tree's (down_mma off, the ring rule on), this tree's with down_mma
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/strata_inductor
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
SO=strata/kernels/strata_cuda.cpython-312-x86_64-linux-gnu.so
unxz -c .dev/s29/mma4_cuda.so.xz > $SO || exit 1
st() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout $l "$@" > $R/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0)) s"; grep -v -i -E "warn|^$" $R/$n.log | tail -n ${TAIL:-6}; tar czf $OUT/r.tgz -C $OUT r; }
export PYTHONPATH=/tmp/site:$PWD
TAIL=8 st tests 150 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py
TAIL=12 st rows 60 python3 docs/bench/s29/device/down_mma_rows.py 1,16,32,33,40,48,64
F="--preset qwen3_next_80b_a3b_fp8 --load-format dummy --synthetic-acceptance 0.8 --overlap on --no-reverse --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2"
TAIL=3 st n8_mma 200 python3 scripts/bench_engine.py $F --kernel-options down_mma=1 --json $R/n8_mma.json
TAIL=3 st n8_ring 100 python3 scripts/bench_engine.py $F --json $R/n8_ring.json
unxz -c .dev/s29/main_cuda.so.xz > $SO || exit 1
TAIL=3 st n8_main 100 python3 scripts/bench_engine.py $F --json $R/n8_main.json
grep -h "prompt chunk\|rep " $R/n8_*.log
