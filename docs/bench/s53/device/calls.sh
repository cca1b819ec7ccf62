#!/usr/bin/env bash
# Session 53's device calls: session 52's steps (docs/bench/s52/device/calls.sh lists them: kt,
# fp, dv, gl, sp, ...) on this tree's CUDA extension, which applies the skinny linear's
# dependents' row limit itself (strata_gpu_linear_pdl_rows). Build it for Python 3.12 and xz it
# into .dev/s53/new_cuda.so.xz (docs/GPU_RUNBOOK.md), then carry .whl, .dev/s53 and the CPU
# extension for 3.12.
export SO=${SO:-.dev/s53/new_cuda.so.xz}
exec bash docs/bench/s52/device/calls.sh "$@"
