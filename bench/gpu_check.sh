#!/usr/bin/env bash
# The GPU check, for a bare accelerator machine (python3 with torch, triton, transformers, pyarrow; no network,
# no batchrun install, no embedded model): kernel tests on CUDA, decode timings against the bandwidth floor and
# gather + SDPA, batchrun vs HF generate on random-weight models. One table at the end.
# Needs out/gpu-assets from bench/gpu_assets.sh (run where the package index is reachable).
# Usage: bash bench/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu-check}
mkdir -p "$out"
py=.venv/bin/python
[ -x "$py" ] || py=python3
assets=out/gpu-assets
[ -d "$assets/tokenizer" ] || { echo "gpu-check: no $assets; run bash bench/gpu_assets.sh first" >&2; exit 2; }
# batchrun from the working tree, batchrun_kernels from kernels/, the wheels beside them: nothing installed
site=$(mktemp -d)
ln -s "$PWD/kernels" "$site/batchrun_kernels"
"$py" -m pip install -q --no-index --no-deps --target "$site" "$assets"/wheels/*.whl 2>/dev/null \
  || "$py" -c "import zipfile,glob,sys; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob('$assets/wheels/*.whl')]" "$site"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
BATCHRUN_TRITON_GPU=1 "$py" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_kernels.py \
  2>&1 | tee "$out/kernel-tests.txt" | tail -5
"$py" bench/gpu_bench.py --out "$out/table.md"
