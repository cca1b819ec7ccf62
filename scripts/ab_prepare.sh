#!/usr/bin/env bash
# Prepare an A/B of two trees for one device call (scripts/device_ab.sh runs it there): the
# working tree ("new") against BASE (a commit), each with its own GPU extension, both under the
# device tool's 64 MiB carry. Run here, from the repository root:
#
#   bash scripts/ab_prepare.sh BASE [NAME]        # NAME: the base's directory name, default base
#
# Leaves, git-ignored (add `/.dev/` to .git/info/exclude once):
#   .dev/NAME/               BASE's strata, conf, scripts and tests (no strata/assets: the device
#                            copies the working tree's), with the CPU extension copied in
#   .dev/NAME_cuda.so.xz     BASE's CUDA extension for Python 3.12, built in a worktree
#   .dev/new_cuda.so.xz      the working tree's, built in place for Python 3.12
# xz takes each 19 MB extension to about 6.5 MB: the working tree and two plain extensions went
# over the carry. Then carry [".whl", ".dev", the CPU extension's .so for 3.12] and run
# `bash scripts/device_ab.sh STEPS` there (its header lists the steps).
#
# Env: PY312 (the Python 3.12 command, default `python3.12` with PYENV_VERSION=3.12.1).
set -euo pipefail
base=${1:?usage: scripts/ab_prepare.sh BASE [NAME]}
name=${2:-base}
root=$(git rev-parse --show-toplevel)
cd "$root"
export PYENV_VERSION=${PYENV_VERSION:-3.12.1}
py312=${PY312:-python3.12}
so=strata_cuda.cpython-312-x86_64-linux-gnu.so
cpu_so=strata/kernels/strata_cpu.cpython-312-x86_64-linux-gnu.so
git rev-parse --verify -q "$base^{commit}" >/dev/null || { echo "ab_prepare: $base is not a commit"; exit 2; }
mkdir -p .dev
echo "ab_prepare: the working tree's extension (Python 3.12)"
STRATA_CUDA=1 "$py312" setup.py build_ext --inplace --build-temp build/py312 -q >/dev/null
[ -f "$cpu_so" ] || { echo "ab_prepare: $cpu_so missing after the build"; exit 1; }
xz -T2 -c "strata/kernels/$so" > .dev/new_cuda.so.xz
wt=$(mktemp -d)/base
trap 'git worktree remove --force "$wt" 2>/dev/null || true' EXIT
git worktree add -q --detach "$wt" "$base"
echo "ab_prepare: $base's extension (Python 3.12) in a worktree"
(cd "$wt" && STRATA_CUDA=1 "$py312" setup.py build_ext --inplace --build-temp build/py312 -q >/dev/null)
xz -T2 -c "$wt/strata/kernels/$so" > ".dev/${name}_cuda.so.xz"
rm -rf ".dev/$name" && mkdir -p ".dev/$name"
git archive "$base" strata conf scripts tests pyproject.toml | tar -x -C ".dev/$name"
rm -rf ".dev/$name/strata/assets"
cp "$wt/$cpu_so" ".dev/$name/$cpu_so"
echo "$(git rev-parse --short "$base")" > ".dev/$name/REV"
du -sh .dev ".dev/${name}_cuda.so.xz" .dev/new_cuda.so.xz | sed 's/^/ab_prepare: /'
