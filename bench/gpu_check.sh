#!/usr/bin/env bash
# The GPU check, for the accelerator machine: kernel tests on CUDA, decode timings against the bandwidth floor
# and gather + SDPA, and a whole demo job with triton vs torch attention. One table at the end.
# Usage: bash bench/gpu_check.sh [OUT_DIR]      (a GPU user installs with: make install TORCH_SPEC=)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu-check}
mkdir -p "$out"
py=.venv/bin/python
[ -x "$py" ] || py=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
BATCHRUN_TRITON_GPU=1 "$py" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_kernels.py \
  2>&1 | tee "$out/kernel-tests.txt" | tail -5
"$py" bench/gpu_bench.py --out "$out/table.md"
