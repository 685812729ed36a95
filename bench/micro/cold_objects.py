"""What a pass over 256 sequences costs once the processor's caches hold something else, as they do after a decode
step's forward (which streams the KV cache through them): a token appended to each of 256 objects and its computed
count set (the output processor's per-token loop, on objects of two plain attributes as Sequence's were), and the
same into 256 `Sequence`s through their properties (what the engine's general path pays now), and the
same as three numpy operations over 256-entry columns (what the steady decode columns do instead), each timed warm
and right after 64 MB were written, in thread CPU time, medians over 300 runs.

  OMP_NUM_THREADS=1 python -m bench.micro.cold_objects

Why a decode step's bookkeeping in the engine costs several times the sum of its parts timed alone: after the
flush, the interpreter's and numpy's own state is out of the caches too, so even the column pass pays for it;
what the engine can cut is the number of distinct places a step touches.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

N = 256


class Row:
    """A running sequence's two per-step fields as plain attributes (what Sequence held before its properties)."""

    __slots__ = ("output_token_ids", "num_computed_tokens")

    def __init__(self) -> None:
        self.output_token_ids = [5] * 10
        self.num_computed_tokens = 0


def main() -> None:
    from batchrun.engine.config import SamplingParams
    from batchrun.engine.core.sequence import Sequence

    rows = [Row() for _ in range(N)]
    seqs = [Sequence(i, [1] * 512, SamplingParams(max_new_tokens=128)) for i in range(N)]
    for seq in seqs:
        seq.output_token_ids.extend([5] * 10)
    tokens, ends = list(range(1000, 1000 + N)), list(range(N))
    positions, limits = np.arange(N, dtype=np.int64), np.full(N, 10**6, dtype=np.int64)
    pending = np.zeros((64, N), dtype=np.int64)
    sampled = np.array(tokens, dtype=np.int64)
    flush = np.ones(64 * 2**20 // 8)  # 64 MB

    def per_object(objects) -> None:
        for seq, token, end in zip(objects, tokens, ends):
            seq.output_token_ids.append(token)
            seq.num_computed_tokens = end

    def undo(objects) -> None:
        for seq in objects:
            seq.output_token_ids.pop()

    def columns() -> None:
        pending[0] = sampled
        done = positions + 2 >= limits
        np.flatnonzero(done).tolist()

    print("pass | warm us | after a 64 MB write us   (thread CPU, medians of 300)")
    passes = [
        ("a token into each of 256 objects", lambda: per_object(rows), lambda: undo(rows)),
        ("the same into 256 Sequences (their properties)", lambda: per_object(seqs), lambda: undo(seqs)),
        ("the same as columns", columns, None),
    ]
    for name, fn, after in passes:
        figures = []
        for cold in (False, True):
            times = []
            for _ in range(300):
                if cold:
                    flush += 1
                t = time.thread_time()
                fn()
                times.append(time.thread_time() - t)
                if after is not None:
                    after()
            figures.append(1e6 * statistics.median(times))
        print(f"{name} | {figures[0]:.1f} | {figures[1]:.1f}")


if __name__ == "__main__":
    main()
