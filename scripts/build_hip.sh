#!/usr/bin/env bash
# Compile-only check of the HIP path of the cyext kernels (cyext/src/strata_kernels.cu,
# strata_moe.cu, strata_moe_stream.cu, strata_linear_stream.cu, strata_router.cu and
# strata_prefetch.cu, through
# cyext/src/hip_compat.h) for AMD gfx90a (MI200). Exit 0 with a message when hipcc is absent.
#   scripts/build_hip.sh [--ext]     --ext: also build the Cython extension against it
#                                    (STRATA_BACKEND=hip python setup.py build_ext in a temp dir)
# Environment: STRATA_HIP_ARCH (default gfx90a), HIPCC (default: hipcc on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
HIPCC="${HIPCC:-$(command -v hipcc || true)}"
if [[ -z "$HIPCC" ]]; then
  echo "build_hip.sh: hipcc not found; skipping the HIP compile check"
  exit 0
fi
ARCH="${STRATA_HIP_ARCH:-gfx90a}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
export HIP_PLATFORM=amd
start=$(date +%s)
for src in strata_kernels strata_moe strata_moe_stream strata_linear_stream strata_router strata_prefetch; do
  echo "build_hip.sh: $HIPCC -x hip --offload-arch=$ARCH cyext/src/$src.cu"
  "$HIPCC" -x hip -O3 -std=c++17 -fPIC --offload-arch="$ARCH" -Icyext/src \
    -c "cyext/src/$src.cu" -o "$OUT/${src}_hip.o"
  echo "build_hip.sh: compiled $src in $(( $(date +%s) - start )) s ($(stat -c %s "$OUT/${src}_hip.o") bytes)"
done
if [[ "${1:-}" == "--ext" ]]; then
  STRATA_BACKEND=hip STRATA_CUDA=1 python setup.py build_ext --build-temp "$OUT/tmp" \
    --build-lib "$OUT/lib"
  python - "$OUT/lib" <<'PY'
import glob, sys
import importlib.util
so = glob.glob(sys.argv[1] + "/strata/kernels/strata_cuda*.so")
print("build_hip.sh: extension built:", so)
try:  # loading needs libamdhip64 (no GPU)
    spec = importlib.util.spec_from_file_location("strata_cuda", so[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    print("build_hip.sh: imports; gpu_platform() =", mod.gpu_platform(), "has_mma() =", mod.has_mma())
except ImportError as exc:
    print("build_hip.sh: built, but cannot be imported here:", exc)
PY
fi
