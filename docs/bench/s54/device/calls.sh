#!/usr/bin/env bash
# Session 54's device calls: the steps of sessions 52 and 53 (docs/bench/s52/device/calls.sh:
# kt, dv, fp, nd, sp, gl, tr; docs/bench/s53/device/calls.sh: topo, ab) on this tree's CUDA
# extension (SO, default .dev/s54/new_cuda.so.xz), run first, then this file's own:
#   pin  the N=8 goal command (batch_mtp W16, 128 tokens, 8-slot prompt chunks, 3 repeats) in
#        AB_ROUNDS (2) rounds of alternating processes, as launched and under taskset on the
#        GPU's NUMA-local CPUs: whether pinning the host moves the figure or its spread (about
#        10% from process to process on an H100 in session 53)
#   cp   the window inputs' copy to the device as one contiguous block (the uncommitted tree it
#        ran on; not kept) against the strided one (.dev/s54/model_runner_base.py: `git show
#        e4c0d77:strata/engine/model_runner.py`) in alternating processes: the N=8 goal command
#        AB_ROUNDS (2) times each, then solo (64-token prompts, 256 tokens, 3 repeats) once each
#   pr   the residual stream handed between a window's layers as a pair (the uncommitted tree it
#        ran on; not kept) against the sum (.dev/s54/base/: `git show e4c0d77:` of
#        strata/model/qwen3_next.py and strata/engine/stage_worker.py), as cp
#   tc   scripts/sim_transfer_check.py --no-predict (the embedded model's cohorts as served and
#        the simulator's quick calibration, about 480 s on an H200; TC_S caps it, default 560;
#        TC_REPEATS=2 shortens the cohorts' repeats, default 3): predicted afterwards here with
#        --predict-from, to recalibrate h200_tiny_bf16
# Build the extension for Python 3.12 and xz it into .dev/s54/new_cuda.so.xz
# (docs/GPU_RUNBOOK.md), then carry .whl, .dev/s54 and the CPU extension for 3.12.
export SO=${SO:-.dev/s54/new_cuda.so.xz}
own=(); other=()
for s in "$@"; do case $s in pin|tc|cp|pr) own+=("$s") ;; *) other+=("$s") ;; esac; done
[ ${#other[@]} -gt 0 ] && bash docs/bench/s53/device/calls.sh "${other[@]}"
[ ${#own[@]} -eq 0 ] && exit 0
. docs/bench/device_common.sh $SO
local_cpus=$(gpu_local_cpus)
echo "GPU local CPUs: $local_cpus"
# ab_files NAME BASE:PATH...: the tree's files at PATH (new) against BASE (base) in alternating
# processes: the N=8 goal command AB_ROUNDS (2) times each, then solo once each; NAME_R_T
# results, the tree's own files back at the end
ab_files() {
  local name=$1 t r pair; shift
  mkdir -p /tmp/ab_new; for pair in "$@"; do cp ${pair#*:} /tmp/ab_new/$(basename ${pair#*:}); done
  tree() { for pair in "$@"; do if [ $t = base ]; then cp ${pair%%:*} ${pair#*:}; else cp /tmp/ab_new/$(basename ${pair#*:}) ${pair#*:}; fi; done; }
  for r in $(seq 1 ${AB_ROUNDS:-2}); do for t in base new; do tree "$@"
    TAIL=1 st ${name}_${r}_$t 150 python3 scripts/bench_engine.py $GOAL_N8 --json $R/${name}_${r}_$t.json
    grep -h "rep \|8x2@256\|garbage" $R/${name}_${r}_$t.log | cut -c1-200; done; done
  for t in base new; do tree "$@"
    TAIL=1 st ${name}s_$t 150 python3 scripts/bench_engine.py --configs solo --n 1 --prompt-tokens 64 --max-tokens 256 --repeats 3 --overlap on --no-reverse --json $R/${name}s_$t.json
    grep -h "rep \|1x4@256" $R/${name}s_$t.log | cut -c1-200; done
  t=new; tree "$@"
}
for s in "${own[@]}"; do case $s in
pin) for r in $(seq 1 ${AB_ROUNDS:-2}); do for p in free pinned; do pre=; [ $p = pinned ] && pre="taskset -c $local_cpus"
    TAIL=1 st pin_${r}_$p 150 $pre python3 scripts/bench_engine.py $GOAL_N8 --json $R/pin_${r}_$p.json
    grep -h "rep \|8x2@256" $R/pin_${r}_$p.log | cut -c1-160; done; done ;;
cp) ab_files cp .dev/s54/model_runner_base.py:strata/engine/model_runner.py ;;
pr) ab_files pr .dev/s54/base/qwen3_next.py:strata/model/qwen3_next.py \
      .dev/s54/base/stage_worker.py:strata/engine/stage_worker.py ;;
tc) TAIL=30 st tc ${TC_S:-560} python3 scripts/sim_transfer_check.py --device cuda --no-predict --repeats ${TC_REPEATS:-3} --out $R/transfer ;;
esac; done
true
