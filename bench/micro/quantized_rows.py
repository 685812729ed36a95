"""Why a layer that quantizes its input per token makes its product once per sequence (engine/model/quantization.py,
bench/RESULTS.md, issue 42), shown on this machine:

1. a float32 `F.linear`'s row, alone or among a few rows, against the same row among 72: the largest difference
   (nonzero where the matrix library sums a small batch in another order than a large one);
2. on the tests' tiny model in compressed-tensors W8A8 (tests/quantized_models.py, its own tooling; needs the
   compressed-tensors package), greedy, 16 new tokens: whether HF `generate` gives each test prompt the same tokens
   beside copies of itself and beside other prompts as alone, and whether batchrun's tokens equal HF `generate`'s
   one prompt at a time, each prompt alone and all four together.

Usage: python -m bench.micro.quantized_rows
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from ..common import ROOT, environment

SHAPES = [(64, 256), (256, 64), (128, 128)]  # in, out
PROMPTS = [[1, 5, 9, 33, 70], [1, *range(10, 60)], [1, 200, 3], [1, *range(100, 140, 3)]]  # test_quantized's
NEW_TOKENS = 16


def linear_rows() -> None:
    torch.manual_seed(0)
    for k, n in SHAPES:
        w, x = torch.randn(n, k), torch.randn(72, k)
        full = F.linear(x, w)
        diffs = {m: (F.linear(x[:m], w) - full[:m]).abs().max().item() for m in (1, 2, 3, 4, 8, 14, 50)}
        print(
            f"  F.linear {k} -> {n}: rows among m, largest difference from among 72: "
            + ", ".join(f"m={m} {d:.1e}" for m, d in diffs.items())
        )


def w8a8_tokens() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import hf_greedy
    from quantized_models import FORMATS, save_float
    from transformers import AutoModelForCausalLM

    from batchrun import LLM, SamplingParams
    from batchrun.model_loader import resolve_model_dir

    with tempfile.TemporaryDirectory() as work:
        target = Path(work) / "w8a8"
        target.mkdir()
        FORMATS["ct-w8a8"][1](save_float(Path(work) / "float", resolve_model_dir(None)), target)
        alone = hf_greedy(target, PROMPTS, NEW_TOKENS)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        others = [[1, 7, 8], [1, 9, 10], [1, 11, 12]]
        with torch.inference_mode():
            for i, p in enumerate(PROMPTS):
                same = []
                for batch in ([p] * 2, [p] * 4, [p] + others if len(p) == 3 else None):
                    if batch is None:
                        continue
                    out = model.generate(torch.tensor(batch), max_new_tokens=NEW_TOKENS, do_sample=False)
                    same.append(out[0, len(p) :].tolist() == alone[i])
                print(
                    f"  HF generate, prompt {i} ({len(p)} tokens) equal to itself alone in a batch of 2 copies, "
                    f"4 copies{', beside 3 others' if len(same) == 3 else ''}: {same}"
                )
        llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=64, prefix_sharing=False)
        sp = SamplingParams(max_new_tokens=NEW_TOKENS)
        each = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
        together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        print(
            f"  batchrun, each prompt alone, equal to HF generate alone: {[a == b for a, b in zip(each, alone)]}"
        )
        print(
            f"  batchrun, the four together, equal to HF generate alone: {[a == b for a, b in zip(together, alone)]}"
        )


def main() -> None:
    env = environment()
    print(f"bench/micro/quantized_rows.py, {env['date']}, {env['cpu']}, {env['cpus']} cores")
    linear_rows()
    w8a8_tokens()


if __name__ == "__main__":
    main()
