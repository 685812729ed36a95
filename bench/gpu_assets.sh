#!/usr/bin/env bash
# What the GPU check needs that a bare GPU machine lacks, gathered here into out/gpu-assets (ignored by git;
# the device tool carries it): wheels of the pure-Python packages batchrun and its tests import beyond that
# machine's image, and the default model's tokenizer files (its models are made there with random weights).
# Usage: bash bench/gpu_assets.sh        then, on the GPU machine: make gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
dst=out/gpu-assets
rm -rf "$dst" && mkdir -p "$dst/wheels" "$dst/tokenizer"
.venv/bin/python -m pip download -q --no-deps --only-binary :all: -d "$dst/wheels" \
  pytest pluggy iniconfig pygments packaging filelock
.venv/bin/python - "$dst/tokenizer" <<'PY'
import sys
from transformers import AutoTokenizer
from batchrun.model_loader import resolve_model_dir
AutoTokenizer.from_pretrained(resolve_model_dir(None)).save_pretrained(sys.argv[1])
PY
du -sh "$dst"
