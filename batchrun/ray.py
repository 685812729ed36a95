"""batchrun inside a Ray Data pipeline: `Processor`, a callable class for `Dataset.map_batches`.

    import ray
    from batchrun.ray import Processor

    ds = ray.data.read_parquet("s3://bucket/prompts/")
    done = ds.map_batches(
        Processor, fn_constructor_kwargs={"job": "job.yaml"}, concurrency=2, batch_size=64, batch_format="pyarrow"
    )
    done.write_parquet("s3://bucket/completions/")

The job file (or the same sections as a dict) says what runs: `model:`, `engine:` and `sampling:`, and in `input:`
the prompt column, the id column and the sampling columns; its input and output paths are not used (Ray Data
reads and writes). Each actor loads its engine once. A batch comes back as its own columns followed by batchrun's
output columns (sample, completion, finish_reason, error, token counts), one row per sample, with the same
values `batchrun submit` writes for those rows. A row that cannot be served comes back with `error` set and the
others go on; a dead engine ends the actor, and Ray Data starts another and retries its batches.

The engine stays fed across batches: `__call__` is a coroutine, so Ray Data gives an actor its next batches
while earlier ones decode, and one engine thread admits their rows as soon as there is room, as the job's own
loop does. How long the engine sat idle between batches is measured (`report()`, and a JSON file per actor in
`report_dir` when given).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from .job import job_spec
from .loop import NOT_YET, drive
from .rows import InputRow, OutputRow, clashing_columns
from .sinks import optional_columns, output_schema
from .sources import input_row
from .storage import location, write_text_whole
from .worker import load_worker


@dataclass
class _Batch:
    """One batch in flight: its rows' output rows as they finish, and the future its caller awaits."""

    results: list[list[OutputRow] | None]
    future: concurrent.futures.Future
    left: int = field(init=False)

    def __post_init__(self) -> None:
        self.left = len(self.results)


class EngineThread:
    """One engine, driven by a thread of its own: batches of rows in (`submit`), their output rows out through
    futures. Rows of every submitted batch share the engine, so a new batch's rows run beside an older one's."""

    def __init__(self, worker, after_step=lambda: None):
        self.worker = worker
        self.after_step = after_step
        self.inbox: queue.Queue = queue.Queue()  # InputRow, or None to stop
        self.owner: dict[int, tuple[_Batch, int]] = {}  # input row index -> its batch and place there
        self.index = itertools.count()
        self.dead: BaseException | None = None
        self.idle_s = 0.0  # time the engine waited for rows between batches (after the first one came)
        self.batches = self.rows = 0
        self.first_row_at: float | None = None
        self.last_done_at: float | None = None
        self._mutex = threading.Lock()  # owner and counters, between submitters and the engine thread
        self.thread = threading.Thread(target=self._serve, name="batchrun-engine", daemon=True)
        self.thread.start()

    def submit(self, make_rows) -> concurrent.futures.Future:
        """`make_rows(indexes)` builds the batch's InputRows from the row indexes given; returns the future of
        their output rows (a list per input row, in order)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._mutex:  # the same lock the engine's death is declared under: no batch slips in between
            if self.dead is not None:
                future.set_exception(RuntimeError(f"the engine died: {self.dead!r}"))
                return future
            rows: list[InputRow] = make_rows(self.index)
            batch = _Batch([None] * len(rows), future)
            for place, row in enumerate(rows):
                self.owner[row.index] = (batch, place)
            self.batches += 1
            self.rows += len(rows)
            if self.first_row_at is None:
                self.first_row_at = time.monotonic()
        if not rows:
            future.set_result([])
        for row in rows:
            self.inbox.put(row)
        return future

    def close(self) -> None:
        self.inbox.put(None)

    def _next(self, block: bool) -> Any:
        if not block:
            try:
                return self.inbox.get_nowait()
            except queue.Empty:
                return NOT_YET
        t0 = time.monotonic()
        item = self.inbox.get()
        if self.first_row_at is not None and t0 > self.first_row_at:
            self.idle_s += time.monotonic() - t0
        return item

    def _emit(self, out: list[OutputRow]) -> None:
        with self._mutex:
            batch, place = self.owner.pop(out[0].row.index)
            batch.results[place] = out
            batch.left -= 1
            if batch.left == 0:
                self.last_done_at = time.monotonic()
                batch.future.set_result(batch.results)

    def _serve(self) -> None:
        try:
            drive(self.worker, self._next, self._emit, self.after_step)
        except BaseException as e:  # noqa: BLE001 - every waiting batch hears of it
            with self._mutex:
                self.dead = e
                for batch, _ in self.owner.values():
                    if not batch.future.done():
                        batch.future.set_exception(RuntimeError(f"the engine died: {e!r}"))


class Processor:
    """For `ds.map_batches(Processor, fn_constructor_kwargs={"job": ...}, concurrency=N)` (module docstring)."""

    def __init__(self, job: str | dict, overrides=None, report_dir: str | None = None, overlap: bool = True):
        """`job`: a job file or its sections as a dict; `overrides`: as run_job's; `report_dir`: where each actor
        writes its report() after every batch; `overlap`: False serves one batch at a time (the engine empties
        between batches, as with a synchronous map function: for comparison)."""
        self.spec = job_spec(job, overrides)
        self.worker = load_worker(self.spec)
        # the per-step statistics rows are not kept: a processor's life has no end to write them at
        self.engine = EngineThread(self.worker, after_step=self.worker.stats.take_rows)
        self.optional = optional_columns(self.spec)
        self.overlap = overlap
        self._one_at_a_time: asyncio.Lock | None = None  # made in the event loop that calls us
        self.report_path = None
        if report_dir:
            self.report_path = location(report_dir) / f"processor-{socket.gethostname()}-{os.getpid()}.json"

    async def __call__(self, batch) -> pa.Table:
        table = batch if isinstance(batch, pa.Table) else _as_table(batch)
        data = table.to_pydict()
        spec = self.spec.input
        missing = [
            c
            for c in [
                spec.prompt_column,
                spec.id_column,
                spec.image_column,
                spec.adapter_column,
                *spec.sampling_columns.values(),
            ]
            if c and c not in data
        ]
        if missing:
            raise ValueError(
                f"the batch has no column {missing[0]!r} (input: of the job); its columns: {table.column_names}"
            )
        clash = clashing_columns([c for c in table.column_names if c != "id"], spec.id_column)  # no id added
        if clash:  # the batch's own columns come out too: one would be replaced by an output column
            raise ValueError(
                f"the batch's column {clash[0]!r} clashes with an output column of the same name; rename it "
                f"(batchrun submit refuses it as a passthrough column alike)"
            )
        rows = range(table.num_rows)
        make = lambda counter: [input_row(spec, data, j, next(counter)) for j in rows]  # noqa: E731
        try:
            if self.overlap:
                outputs = await asyncio.wrap_future(self.engine.submit(make))
            else:
                self._one_at_a_time = self._one_at_a_time or asyncio.Lock()
                async with self._one_at_a_time:
                    outputs = await asyncio.wrap_future(self.engine.submit(make))
        except RuntimeError as e:
            if self.engine.dead is None:
                raise
            print(f"batchrun: {e}; ending this actor so that Ray starts another", file=sys.stderr, flush=True)
            os._exit(1)  # Ray Data restarts the actor and retries its batches
        if self.report_path is not None:
            write_text_whole(self.report_path, json.dumps(self.report()))
        return self._table(table, outputs)

    def _table(self, table: pa.Table, outputs: list[list[OutputRow]]) -> pa.Table:
        """The batch's rows, each repeated once per sample, then the output columns."""
        order = [j for j, samples in enumerate(outputs) for _ in samples]
        flat = [r for samples in outputs for r in samples]
        own = output_schema(pa.string(), [], self.optional)  # a generation job's columns
        out = table.take(pa.array(order, pa.int64())) if order else table.slice(0, 0)
        for column in own:  # no input column has an output column's name (checked in __call__)
            if column.name != "id":
                values = pa.array([getattr(r, column.name) for r in flat], column.type)
                out = out.append_column(column, values)
        return out

    def report(self) -> dict:
        """The engine's time from this actor's first row to its last finished batch (`span_s`), how much of it the
        engine waited for rows (`idle_s`: idle between batches), and how full it ran (`mean_running` sequences a
        step: a batch that drains before the next one's rows come in runs ever fewer)."""
        e, agg = self.engine, self.worker.stats.agg
        span = (e.last_done_at - e.first_row_at) if e.first_row_at and e.last_done_at else 0.0
        mean_running = agg.running_sum / agg.steps if agg.steps else 0.0
        return dict(batches=e.batches, rows=e.rows, span_s=span, idle_s=e.idle_s, steps=agg.steps) | dict(
            mean_running=mean_running
        )

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def _as_table(batch) -> pa.Table:
    """A pandas DataFrame or a dict of columns (numpy arrays or lists) as an Arrow table."""
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):
        return pa.Table.from_pandas(batch, preserve_index=False)
    return pa.table({k: list(v) for k, v in batch.items()})
