"""Quantized checkpoints: batchrun against HF `generate` on the same checkpoint, one SmolLM2-135M-shaped random
model in each format that runs here (tests/quantized_models.py makes them with each format's own tooling; a
format whose package is not installed is skipped), fp32, greedy: generated tokens per second and the weights'
bytes in memory (engine/quantization.weight_bytes).

HF `generate` runs the prompts one at a time (what batchrun's tokens are checked against); batchrun runs them
all at once. One process runs every format in turn (the figures are throughput, not peak memory).

MXFP4 exists for gpt-oss's experts alone: its row is a gpt-oss of SmolLM2-135M's shape with 4 experts, 2 a token
(tests/quantized_models.mxfp4), so its figures compare with HF on that model, not with the float32 row.

Making the checkpoints is part of the run: at this shape gptqmodel's AWQ quantizer (its scale search) took about
14 minutes and its GPTQ one about 1 on this 2-CPU machine shared with other work (Dec 3, `--formats gptq,awq`).

Usage: python -m bench.quant [--prompts 8] [--new 32] [--formats fp8,mxfp4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from .common import OUT, SMOLLM2_135M, environment, save, table

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ["float32", "ct-w8a8", "torchao-int8", "bnb-8bit", "bnb-4bit", "fp8", "mxfp4", "gptq", "awq"]


def hf_tokens_per_s(target: Path, prompts: list[list[int]], new: int) -> tuple[float, int]:
    """HF `generate`, one prompt at a time: generated tokens per second, and the weights' bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    from batchrun.engine.model.quantization import weight_bytes

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    generated, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
            generated += out.shape[1] - len(p)
    return generated / (time.perf_counter() - t0), weight_bytes(model)


def batchrun_tokens_per_s(target: Path, prompts: list[list[int]], new: int) -> tuple[float, int, str]:
    from batchrun import LLM, SamplingParams

    llm = LLM(model=str(target), dtype="float32", device="cpu", num_pages=256)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, llm.weights.bytes, llm.weights.format


def main() -> None:
    import importlib.util

    import torch

    from batchrun.model_loader import resolve_model_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--formats", default=",".join(FORMATS), help="a comma-separated subset of FORMATS")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from quantized_models import FORMATS as MAKERS
    from quantized_models import save_float

    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 49152, (int(n),), generator=g).tolist()
        for n in torch.randint(20, 80, (args.prompts,), generator=g)
    ]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        float_dir = save_float(Path(work) / "float32", resolve_model_dir(None), **SMOLLM2_135M)
        for name in args.formats.split(","):
            package, make = MAKERS.get(name, (None, None))
            if package and importlib.util.find_spec(package) is None:
                print(f"{name}: skipped ({package} is not installed)")
                continue
            target = float_dir
            if make:
                target = Path(work) / name
                make(float_dir, target)
            hf, hf_bytes = hf_tokens_per_s(target, prompts, args.new)
            ours, our_bytes, fmt = batchrun_tokens_per_s(target, prompts, args.new)
            rows.append(
                dict(
                    format=name,
                    loaded_as=fmt,
                    hf_tok_s=hf,
                    batchrun_tok_s=ours,
                    hf_bytes=hf_bytes,
                    bytes=our_bytes,
                )
            )
            print(rows[-1], flush=True)
    env = environment()
    text = "\n".join(
        [
            f"{args.prompts} prompts of 20-79 tokens, {args.new} new tokens each, fp32, greedy; "
            f"{env['cpu']} ({env['cpus']} CPUs), {env['date']}",
            *table(
                [
                    "format",
                    "batchrun loads it as",
                    "HF tok/s (one at a time)",
                    "batchrun tok/s",
                    "speedup",
                    "weights MiB (HF)",
                    "weights MiB (batchrun)",
                ],
                [
                    [
                        r["format"],
                        r["loaded_as"],
                        r["hf_tok_s"],
                        r["batchrun_tok_s"],
                        f"{r['batchrun_tok_s'] / r['hf_tok_s']:.1f}x",
                        r["hf_bytes"] / 2**20,
                        r["bytes"] / 2**20,
                    ]
                    for r in rows
                ],
            ),
        ]
    )
    save({"rows": rows, "prompts": args.prompts, "new": args.new, **env}, OUT / "quant.json", text)


if __name__ == "__main__":
    main()
