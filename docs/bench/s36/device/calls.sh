#!/usr/bin/env bash
# Session 36's device calls, for an H100 (80 GB: the full-depth FP8 80B does not fit, so the
# full-depth steps of docs/bench/s35/device/calls.sh wait for an H200):
#   k  the MoE kernels' GPU tests (the big wide launches of session 34 among them, never run on
#      a GPU before: their reference now gathers in slices of rows), big_time.py (256 / 512 rows
#      in launches of 128 / 256 / 512, one layer), the GPU identity test (~360 s at most)
#   t  the tiny model solo at spec 4 / 3 / 2 (docs/bench/s35/device/calls.sh t), then the
#      cyext kernels' GPU tests
#   i  the GPU tests of the engine (every mode's identity, overlap on and off), the cyext
#      kernels and the expert cache, with room for a cold compile (~500 s at most)
#   n  (an H200) full-depth batch_mtp W16 N=8 at the default wide_rows (512) on a cold compile
#      cache (its warm-up: the goal's figure after the graph cuts), then at 128 (warm: the
#      baseline on the same machine): docs/bench/s35/device/calls.sh a and b without the tests
#      that passed on the H100 (~440 s)
#   c  (an H100 will do) the expert cache's GPU tests, with the routed experts loaded into host
#      memory (new), then the full-depth FP8 80B on the H100 through the cache: 77.5 GiB of
#      weights do not fit its 80 GB without it; eager (no compile, no warm-up) to fit the call
#      (~380 s at most)
#   h  (an H100) the expert cache's GPU tests again (the padded chunks' capture, compile off,
#      is new), then the full-depth FP8 80B through the cache compiled: batching's gain at a
#      75% budget on an 80 GB card (bench_expert_cache.py --no-baseline loads the experts into
#      host memory; ~560 s at most)
#   s  (an H100: a machine the simulator has never seen) the transfer check, measurements only:
#      engine cohorts of the tiny model, the acceptance run and a quick calibration; predict
#      here afterwards (python scripts/sim_transfer_check.py --predict-from OUT), against the
#      shipped H200 preset and the calibrated one (~480 s at most)
# Carry .whl and .dev/s34 (the tree's CUDA extension for Python 3.12, stripped, xz).
set -u
. docs/bench/device_common.sh .dev/s34/new_cuda.so.xz
case ${1:-k} in
k)
  TAIL=8 st gpu_moe 200 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_moe_kernels.py tests/test_sampler_compile.py
  TAIL=8 st big_time 100 python3 docs/bench/s34/device/big_time.py
  TAIL=4 st gpu_identity 80 python3 -m pytest -q -p no:warnings -rf -x -m gpu tests/test_engine_backends.py ;;
t)
  TAIL=20 st tiny_spec 200 python3 scripts/bench_engine.py --configs solo,solo_spec3,solo_spec2 --n 1 --prompt-tokens 64 --max-tokens 256 --overlap on --repeats 3 --json $R/tiny_spec.json
  TAIL=4 st gpu_kernels 150 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_kernels_gpu.py ;;
i)
  TAIL=4 st gpu_identity 240 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_engine_backends.py
  TAIL=4 st gpu_kernels 60 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_kernels_gpu.py
  TAIL=4 st gpu_expert_cache 200 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_expert_cache_gpu.py ;;
n)
  TAIL=6 st n8_w512 290 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --json $R/n8_w512.json
  grep -h "warm-up" $R/n8_w512.log | head -3
  TAIL=6 st n8_w128 150 python3 scripts/bench_engine.py $F --configs batch_mtp_w16 --n 8 --max-tokens 64 --repeats 2 --kernel-options wide_rows=128 --json $R/n8_w128.json ;;
c)
  TAIL=6 st gpu_expert_cache 200 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_expert_cache_gpu.py
  TAIL=12 st full_cache_h100 180 python3 -m strata model=qwen3_next_80b_a3b_fp8 model.load_format=dummy model.moe_dense_experts=0 engine.expert_cache_mib=60000 engine.synthetic_acceptance=0.8 engine.compile=off engine.warmup=off workload.kind=synthetic workload.requests=2 workload.max_tokens=16 hydra.run.dir=$R/full_cache_run
  free -g | head -2 ;;
h)
  TAIL=6 st gpu_expert_cache 260 python3 -m pytest -q -p no:warnings -rf -m gpu tests/test_expert_cache_gpu.py
  TAIL=12 st study_h100_75 290 python3 scripts/bench_expert_cache.py --part study --layers 48 --budgets 75 --no-baseline --configs solo,batch_mtp --n 1,4 --repeats 1 --max-tokens 32 --json $R/study_h100_75.json ;;
s)
  TAIL=12 st transfer_h100 540 python3 scripts/sim_transfer_check.py --device cuda --no-predict --out $R/transfer_h100 ;;
esac
