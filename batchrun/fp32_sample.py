"""A bf16 (or fp16) pooling job's distance from fp32, in its summary (`fp32_sample`): the first `SAMPLE_TEXTS`
texts each engine process pools are pooled again by the checkpoint loaded in fp32, and the summary reports which
rows they were (their ids), the min and mean cosine of each text's output to its fp32 output (embeddings; a
classifier's logits where it has more than one label), and for task classify, score and reward the largest
absolute difference of the written scores (probabilities, score).

The reference is a second load of the checkpoint in fp32, not the job's own weights upcast: a bf16 runner's
weights are already rounded to bf16 (and packed for oneDNN), so an upcast copy would leave the weights' rounding
out of the distance, and the fp32 checkpoint is what sentence-transformers or transformers would have run. It is
loaded when the first texts are pooled and dropped as soon as the sample is full, so the job holds it (the
checkpoint's fp32 bytes beside its own) only for its first step or two; what loading and pooling the sample took
is `seconds`. A reference that does not fit in memory leaves the job running: the summary says why there is no
sample (`error`). Whether it fits is asked before the load (`room`): on the CPU an allocation past the free memory
is no error Python sees (the kernel's OOM killer ends the whole job), so the fp32 bytes are weighed against the
free memory first, and an out-of-memory error during the load (a GPU's) is the second guard.

The sample only reads what a step finished: output rows come from the job's runner alone, so no row is written
twice or lost. A resumed run samples the first texts it pools itself (rows the earlier runs had not written),
and the summaries of runs, replicas and shards are merged row for row (stats.merge_fp32_samples): every sampled row
is counted once, in the run that pooled it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SAMPLE_TEXTS = 8  # the texts each engine process (a job's run, each replica) pools again in fp32


def json_id(value):
    """A row's id as the summary's JSON keeps it (an id of another type as its text)."""
    return value if isinstance(value, int | str | float) else str(value)


class Fp32Sample:
    """The first `size` texts a runner pools, pooled again by `load_reference()` (the same checkpoint and pooling
    in fp32), compared as the module docstring says."""

    def __init__(
        self,
        load_reference: Callable,
        task: str,
        size: int = SAMPLE_TEXTS,
        room: Callable[[], str | None] = lambda: None,
    ):
        self.load_reference = load_reference
        self.room = room  # why the reference would not fit (None: it fits)
        self.task = task
        self.size = size
        self.reference = None
        self.ids: list = []
        self.cosines: list[float] = []
        self.score_diff: float | None = None
        self.seconds = 0.0
        self.error: str | None = None

    @property
    def full(self) -> bool:
        return len(self.ids) >= self.size or self.error is not None

    @torch.inference_mode()
    def take(self, finished: list) -> None:
        """A step's finished texts with their outputs (PoolingStep.finished): the first ones, while the sample is
        not full, pooled again in fp32 and compared."""
        if self.full or not finished:
            return
        wanted = finished[: self.size - len(self.ids)]
        t0 = time.perf_counter()
        if self.reference is None and (reason := self.room()) is not None:
            self.error = reason
            return
        try:
            if self.reference is None:
                self.reference = self.load_reference()
            references = self.reference.embed_packed([text for text, _ in wanted])
        except (torch.OutOfMemoryError, MemoryError) as e:
            self.reference, self.error = (
                None,
                f"the checkpoint in fp32 did not fit in memory beside the job's: {e}",
            )
            return
        for (text, output), reference in zip(wanted, references):
            self._compare(output.float(), reference.float())
            self.ids.append(json_id(text.request.id))
        if self.full:
            self.reference = None  # the fp32 copy's memory given back at once
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.seconds += time.perf_counter() - t0

    def _compare(self, output: torch.Tensor, reference: torch.Tensor) -> None:
        if output.numel() > 1:  # a cosine of one number says only whether its sign agrees
            self.cosines.append(F.cosine_similarity(output, reference, dim=0).item())
        if self.task != "embed":
            written = scores(self.reference.result(output, self.task))
            expected = scores(self.reference.result(reference, self.task))
            diff = max(abs(a - b) for a, b in zip(written, expected))
            self.score_diff = diff if self.score_diff is None else max(self.score_diff, diff)

    def summary(self) -> dict:
        """The summary's `fp32_sample` (stats.merge_fp32_samples merges runs, replicas and shards)."""
        return {
            "rows": list(self.ids),
            "cosine_min": min(self.cosines) if self.cosines else None,
            "cosine_mean": sum(self.cosines) / len(self.cosines) if self.cosines else None,
            "score_max_abs_diff": self.score_diff,
            "seconds": self.seconds,
            "error": self.error,
        }


def scores(result: dict) -> list[float]:
    """The numbers of a head's output columns (classify: probs; score and reward: score)."""
    out: list[float] = []
    for value in result.values():
        if isinstance(value, float):
            out.append(value)
        elif isinstance(value, list):
            out.extend(value)
    return out
