#!/usr/bin/env bash
# Wheels the GPU machine lacks, into .whl/ (git-excluded): hydra, omegaconf and simpy (built by
# the workplace's ../shared/tools/device-wheels.sh) plus the server's FastAPI stack for Python
# 3.12 (pydantic-core is binary, so it is downloaded for the device's platform, not built).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
../shared/tools/device-wheels.sh
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4 \
  annotated-types==0.7.0 typing-inspection==0.4.2 opentelemetry-api==1.45.2
ls -1 .whl
