"""Where a pooling step's time goes, in one thread's CPU time (issue 50, item 5): the MiniLM-L6-shaped BERT of
jobs/make_embed_data.py (random weights, the embedded model's tokenizer), one step of `--texts` passages of 5 to
400 words (packed, as bench.embed's run packs them: up to 4,096 tokens), under `torch.profiler`, self CPU time by
operation, after a warm-up step; then the same step's parts by `time.thread_time`: tokenizing its texts, the
forward, the pooling (pooler and Normalize), the vectors written out as lists (the job's output columns).

With `--compare`, the step's forward is also timed with the pooling runner's own rewrites undone (the GELU and
residual-add post-ops of engine/model/ops/fused_encoder.py; the bf16 prompt kernel of attention/packed.py, leaving SDPA),
the two alternated: best and median of `--repeat` each.

Usage: OMP_NUM_THREADS=1 python -m bench.micro.embed_profile --dtype bfloat16 [--texts 24] [--top 20] [--compare]
On a machine shared with other jobs a thread's CPU time is the work it did, whoever else runs.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--texts", type=int, default=24, help="texts in the profiled step")
    parser.add_argument("--top", type=int, default=20, help="operations listed")
    parser.add_argument("--repeat", type=int, default=3, help="timed steps (best of)")
    parser.add_argument("--compare", action="store_true", help="also without the runner's rewrites")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from batchrun import LLM
    from batchrun.engine.model.ops import fused_encoder
    from jobs.make_embed_data import make_model, passages

    folder = make_model(Path(tempfile.mkdtemp()) / "minilm")
    llm = LLM(str(folder), dtype=args.dtype, device="cpu", runner="pooling", max_num_batched_tokens=4096)
    runner = llm.pooling
    texts = passages(args.texts, 400)

    def step() -> dict[str, float]:
        parts = {}
        t = time.thread_time()
        for text in texts:
            runner.add(runner.encode(text), None)
        parts["tokenize"] = time.thread_time() - t
        queued = list(runner.queue)
        runner.queue.clear()
        t = time.thread_time()
        with torch.inference_mode():
            hidden, layout = runner._forward(
                [q.token_ids for q in queued], [q.token_type_ids for q in queued]
            )
        parts["forward"] = time.thread_time() - t
        t = time.thread_time()
        with torch.inference_mode():
            vectors = runner._heads(hidden, queued, layout)
        parts["pooling"] = time.thread_time() - t
        t = time.thread_time()
        [runner.result(v, "embed") for v in vectors]
        parts["output lists"] = time.thread_time() - t
        parts["tokens"] = sum(layout.lengths)
        return parts

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        parts = step()
    print(f"{args.dtype}, {args.texts} texts, {parts['tokens']} tokens, one thread; torch.profiler self CPU:")
    print(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=40)
    )
    runs = [step() for _ in range(args.repeat)]
    best = {k: min(r[k] for r in runs) for k in runs[0] if k != "tokens"}
    each = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.items())
    print(f"thread CPU time, best of {args.repeat}: {each}")
    if not args.compare:
        return
    model, kernel, fused = runner.model, runner.attention_kernel, {}

    def as_loaded() -> None:
        if fused:  # undone before: fused again
            fused_encoder.fuse(model)
        runner.attention_kernel = kernel

    def undone() -> None:
        fused["n"] = fused_encoder.restore(model)
        runner.attention_kernel = None

    times: dict[str, list[float]] = {"as loaded": [], "rewrites undone": []}
    for _ in range(args.repeat):
        for name, setup in (("as loaded", as_loaded), ("rewrites undone", undone)):
            setup()
            times[name].append(step()["forward"])
    for name, ts in times.items():
        ts.sort()
        print(f"forward, {name}: best {ts[0] * 1e3:.1f} ms, median {ts[len(ts) // 2] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
