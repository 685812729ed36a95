"""The one feed/step/emit loop that drives every engine in batchrun: the job's own (job.py), each replica's
(replicas.py) and the Python API's (llm.py). They differ only in where items come from (an input file, a queue
from the job, a list of prompts), what a worker makes of them, and where results go.

A worker takes items while it wants more (`wants_rows`: its engine's queue is short), answers an item it cannot
serve at once (`feed` returns its results: error rows), and steps its engine while it has work (`step` returns the
results that finished). `drive` keeps it fed and stepping until the input runs out and every item finished, or
until `stopped()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

NOT_YET = object()  # `next_item`'s answer when no item is at hand now but more may come (an empty queue)


class Worker(Protocol):
    @property
    def wants_rows(self) -> bool: ...

    @property
    def has_work(self) -> bool: ...

    def feed(self, item: Any) -> Any | None: ...

    def step(self) -> list: ...


def drive(
    worker: Worker,
    next_item: Callable[[bool], Any],
    emit: Callable[[Any], None],
    after_step: Callable[[], None] = lambda: None,
    stopped: Callable[[], bool] = lambda: False,
) -> bool:
    """Feed `worker` from `next_item(block)` (an item, None at the end of the input, or NOT_YET; `block`: the
    worker is idle, so waiting for an item holds nothing up), step it, and `emit` every result: an item's
    immediate answer from `feed`, each finished result of `step`. `after_step` runs after every step. Returns
    True when the input ran out and every item finished, False when stopped first."""
    exhausted = False
    while not stopped():
        while not exhausted and worker.wants_rows and not stopped():
            item = next_item(not worker.has_work)
            if item is NOT_YET:
                break
            if item is None:
                exhausted = True
                break
            answer = worker.feed(item)
            if answer is not None:
                emit(answer)
        if not worker.has_work:
            if exhausted:
                return True
            continue
        for result in worker.step():
            emit(result)
        after_step()
    return False
