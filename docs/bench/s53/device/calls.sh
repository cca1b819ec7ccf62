#!/usr/bin/env bash
# Session 53's device calls: session 52's steps (docs/bench/s52/device/calls.sh lists them: kt,
# fp, dv, gl, sp, nd, ...) on this tree's CUDA extension, which applies the skinny linear's
# dependents' row limit itself (strata_gpu_linear_pdl_rows), plus:
#   topo  the machine's CPU and GPU topology (lscpu, nvidia-smi topo -m, the GPU's NUMA-local
#         CPUs) into $R/topo.txt
#   ab    the embedded model's batch_mtp W16 at N=8 (the goal's command: 128 tokens, 8-slot
#         prompt chunks, 3 repeats) in AB_ROUNDS (2) rounds of alternating processes, the
#         default (skinny_pdl_rows=4) against every window's linears as dependents (=16): the
#         same setting measured 39,034 and 45,236-class figures in two processes on one H100
#         (BENCHMARKS "On an H100 (session 53)"), so one process a setting decides nothing; with
#         PIN=1 each process runs under taskset on the GPU's NUMA-local CPUs
# Build the extension for Python 3.12 and xz it into .dev/s53/new_cuda.so.xz
# (docs/GPU_RUNBOOK.md), then carry .whl, .dev/s53 and the CPU extension for 3.12.
export SO=${SO:-.dev/s53/new_cuda.so.xz}
steps=(); for s in "$@"; do case $s in topo|ab) ;; *) steps+=("$s") ;; esac; done
[ ${#steps[@]} -gt 0 ] && bash docs/bench/s52/device/calls.sh "${steps[@]}"
[ ${#steps[@]} -eq $# ] && exit 0  # (no step of this file's: set nothing up twice)
. docs/bench/device_common.sh $SO
local_cpus=$(gpu_local_cpus)
for s in "$@"; do case $s in
topo) { lscpu; echo; nvidia-smi topo -m; echo; echo "GPU $(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1) local CPUs: $local_cpus"; } > $R/topo.txt 2>&1
  tail -4 $R/topo.txt ;;
ab) pin=; [ "${PIN:-0}" = 1 ] && pin="taskset -c $local_cpus"
  for r in $(seq 1 ${AB_ROUNDS:-2}); do for k in 4 16; do
    TAIL=1 st ab_${r}_$k 120 $pin python3 scripts/bench_engine.py $GOAL_N8 --kernel-options skinny_pdl_rows=$k --json $R/ab_${r}_$k.json
    grep -h "rep \|8x2@256" $R/ab_${r}_$k.log | cut -c1-160; done; done ;;
esac; done
true
