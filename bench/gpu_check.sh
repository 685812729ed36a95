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
# batchrun and batchrun_kernels (kernels/) from the working tree, the wheels beside them: nothing installed
site=$(mktemp -d)
"$py" -m pip install -q --no-index --no-deps --target "$site" "$assets"/wheels/*.whl 2>/dev/null \
  || "$py" -c "import zipfile,glob,sys; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob('$assets/wheels/*.whl')]" "$site"
export PYTHONPATH="$PWD:$PWD/kernels:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
# a kernel test that fails (or hangs) is reported in the table; the timings still run
BATCHRUN_TRITON_GPU=1 timeout 360 "$py" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_kernels.py \
  >"$out/kernel-tests.txt" 2>&1 || echo "kernel tests: exit $?" >>"$out/kernel-tests.txt"
tail -3 "$out/kernel-tests.txt"
status=0
"$py" -m bench.gpu_bench --out "$out/table.md" || status=$?
echo "Kernel tests on CUDA (pytest tests/test_kernels.py): $(tail -1 "$out/kernel-tests.txt")" | tee -a "$out/table.md"
exit $status
