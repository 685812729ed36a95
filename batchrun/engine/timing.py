"""Where a step's time goes: host seconds per phase of the step loop, summed over a run.

schedule (the scheduler's plan and the page copies it orders), prepare (the step's tensors and attention
metadata), encode (a vision-language model's image encoder, for the images a step's prompts need), forward (the model; `attention` is the part of it inside the attention layers), sample (logits to
tokens: grammar masks, sampling, logprobs), finish (appending tokens, stop checks, detokenizing finished
rows), stats (the statistics row), write (handing output rows to the part files).

Host clocks: on the CPU they are the work itself; on a GPU the forward only launches kernels, and the time
the device takes shows up where the host first waits for it (sampling reads the tokens back).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

PHASES = ("schedule", "prepare", "encode", "forward", "attention", "sample", "finish", "stats", "write")


class PhaseTimes:
    """Seconds per phase (the summary's `time_<phase>_s`), and finer `parts` that the code times where it does
    the work (the attention backend's K/V writes, decode kernel, prompts), for bench/micro/profile_step.py; `counts`
    beside them (the bytes the decode kernel read)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        # the parts and counts are kept only when asked (bench/micro/profile_step.py): timing them is work in every
        # attention call (bench/RESULTS.md, the step's host work on an Intel Xeon)
        self.detailed = False
        self.parts: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def part(self, name: str):
        """A context timing part `name` of a phase, where `detailed`; one that does nothing otherwise."""
        return self._timed_part(name) if self.detailed else _UNTIMED

    @contextmanager
    def _timed_part(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0

    def count(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def summary(self) -> dict[str, float]:
        """`time_<phase>_s` for every phase (the summary's keys)."""
        return {summary_key(p): s for p, s in self.seconds.items()}


_UNTIMED = nullcontext()  # `PhaseTimes.part` when parts are not kept


def summary_key(phase: str) -> str:
    return f"time_{phase}_s"
