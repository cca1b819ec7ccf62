#!/usr/bin/env bash
# Session 48's device calls: session 47's steps (docs/bench/s47/device/calls.sh: t, r, rn, dh,
# dn, ts) with this tree's CUDA extension for Python 3.12 (carry .whl and .dev/s48; rebuild it
# whenever cyext/src changes). Next: `t rn` (LAYERS=48 on an H200).
SO=.dev/s48/new_cuda.so.xz exec bash docs/bench/s47/device/calls.sh "$@"
