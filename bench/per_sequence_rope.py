"""The host time of per-sequence RoPE factors (engine/model/ops/per_sequence_rope.py): `step_embeddings` for a step of
decodes past the original context, on the test matrix's tiny LongRoPE Phi-3 and dynamic NTK Llama.

  OMP_NUM_THREADS=1 python -m bench.per_sequence_rope

The figure to read is the thread's CPU time (`time.thread_time`): the machine is shared, so wall time also
counts other processes' turns.

LongRoPE has two choices of factors, so a step makes at most two rotary calls; dynamic NTK has frequencies of
each sequence's own length past the original context, so one call per such sequence.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    from test_families import models

    from batchrun.engine.model.architecture import inspect_model

    for family in ("phi3:longrope", "llama:dynamic_ntk"):
        rope = inspect_model(models(family)[0]).rope
        for n in (1, 64):
            # each decode's (tokens, prompt tokens, start, tokens this step): prompts of 40.. tokens (past the
            # original 32), 8 generated
            step = [(48 + i, 40 + i, 47 + i, 1) for i in range(n)]
            positions = torch.tensor([start for _, _, start, _ in step])
            repeats = 50
            with torch.inference_mode():
                rope.step_embeddings(step, positions)
                start, cpu_start = time.perf_counter(), time.thread_time()
                for _ in range(repeats):
                    rope.step_embeddings(step, positions)
            ms = 1e3 * (time.perf_counter() - start) / repeats
            cpu_ms = 1e3 * (time.thread_time() - cpu_start) / repeats
            print(
                f"{family}: {n} decodes past the original context: {cpu_ms:.2f} ms thread CPU time per step "
                f"({ms:.2f} ms wall)"
            )


if __name__ == "__main__":
    main()
