"""`--replicas N`: N engine processes on this machine sharing one run's rows (data parallelism).

Each replica is a spawned process with its own LLM: replica r on GPU r, or on the CPU with its share of the
cores (`torch.set_num_threads`). The job keeps the row side: it puts rows on one shared queue, from which a
replica takes rows only when its engine wants more (so a slow replica takes fewer and holds nobody back), and it
writes every output row the replicas send back: one writer, so no row is written twice; one progress bar; one
summary. Rows in the queue or in a replica's engine when the run stops are not written, and a resume redoes them,
with any replica count (the outputs do not depend on it).

A replica dies with the job: PR_SET_PDEATHSIG asks the kernel to kill it when the job's process goes (kill -9
included), and a watch on its parent's pid covers the moment before that is set. A replica that dies makes the
job stop the others, write what they finished, and exit 1 naming it.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from .config import JobSpec
from .errors import BadInput
from .loop import NOT_YET, drive
from .rows import InputRow, OutputRow
from .stats import StatsFile, combine
from .worker import load_worker, row_window


class RowSide(Protocol):
    """What the replicas need of the job that drives them (job.Job is one): the job file, the rows to do, a
    place for each input row's finished output rows, and a turn of its progress loop."""

    spec: JobSpec
    stop_requested: bool
    rows_done: int
    job_rows: int

    def pending_rows(self) -> Iterator[InputRow]: ...

    def emit(self, rows: list[OutputRow]) -> None: ...

    def tick(self, postfix: str, stats_file: StatsFile) -> None: ...


REPORT_EVERY_S = 1.0
PREFETCH = 16  # rows a replica keeps waiting in its engine


def replica_count(replicas: int | str, device: str) -> int:
    """`engine.replicas`: a count, or auto = one per visible GPU (one on the CPU)."""
    if replicas != "auto":
        return int(replicas)
    if device == "cpu":
        return 1
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def replica_devices(count: int, device: str) -> list[str]:
    """Replica r's device: GPU r (of the visible ones), or the CPU."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return ["cpu"] * count
    visible = torch.cuda.device_count()
    if count > visible:
        raise BadInput(f"--replicas {count}: only {visible} GPUs are visible; give at most {visible}.")
    return [f"cuda:{r}" for r in range(count)]


def _die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _replica_main(r: int, spec, device: str, threads: int, rows_q, out_q, stop, parent_pid: int) -> None:
    """One replica: take rows while its engine wants them, step, send finished rows and statistics back."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the job coordinates the stop; a terminal's ^C reaches all
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import torch

        if device == "cpu":
            torch.set_num_threads(threads)
        spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, device=device))
        worker = load_worker(spec, replica=r)
        # a replica keeps few rows waiting, so rows spread over the replicas as each can take them
        worker.window = min(worker.window, PREFETCH)
        stats = worker.stats
        out_q.put(("ready", r, None))
        finished: list = []  # each input row's output rows, sent back together after a step
        last_report = time.monotonic()

        def next_row(block: bool):
            try:
                return rows_q.get(block=block, timeout=0.2)
            except queue.Empty:
                return NOT_YET

        def send() -> None:
            nonlocal last_report
            if finished:
                out_q.put(("rows", r, list(finished)))
                finished.clear()
            if time.monotonic() - last_report >= REPORT_EVERY_S:
                last_report = time.monotonic()
                out_q.put(("stats", r, (stats.take_rows(), stats.summary())))

        def emit(rows) -> None:
            finished.append(rows)
            if not worker.has_work:  # error rows of an idle engine: no step will send them soon
                send()

        drive(worker, next_row, emit, send, stop.is_set)
        send()
        out_q.put(("done", r, (stats.take_rows(final=True), stats.summary())))
    except BaseException as e:  # noqa: BLE001 - reported to the job, which names the replica
        out_q.put(("failed", r, f"{type(e).__name__}: {e}"))


def run_replicas(job: RowSide, count: int, stats_file: StatsFile) -> tuple[dict, str | None]:
    """Run the job's pending rows on `count` replica processes; returns this run's summary (the replicas'
    combined) and the failure, if a replica failed."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    spec = job.spec
    devices = replica_devices(count, spec.engine.device)
    threads = max(1, (os.cpu_count() or 1) // count)
    window = row_window(spec)
    rows_q = ctx.Queue(maxsize=window * count)
    out_q = ctx.Queue()
    stop = ctx.Event()
    procs = [
        ctx.Process(
            target=_replica_main,
            args=(r, spec, devices[r], threads, rows_q, out_q, stop, os.getpid()),
            name=f"batchrun-replica-{r}",
            daemon=True,
        )
        for r in range(count)
    ]
    for p in procs:
        p.start()
    summaries: dict[int, dict] = {}
    generated: dict[int, int] = {}
    ended: set[int] = set()
    ready: set[int] = set()
    failure = None
    rows = job.pending_rows()
    held = None  # a row taken from the input that did not fit in the queue yet
    sentinels = 0  # end-of-input markers still to queue, one per replica
    more = True
    t0 = time.monotonic()
    try:
        while len(ended) < count:
            # feed the shared queue, once every replica is ready (the first to load would take every row)
            while (more or held is not None or sentinels) and len(ready) == count and not stop.is_set():
                if held is None and more:
                    held = next(rows, None)
                    if held is None:
                        more, sentinels = False, count
                try:
                    rows_q.put_nowait(held)
                except queue.Full:
                    break
                if held is None:
                    sentinels -= 1
                held = None
            # what the replicas send back
            try:
                kind, r, payload = out_q.get(timeout=0.1)
            except queue.Empty:
                kind = None
            if kind == "ready":
                ready.add(r)
                if len(ready) == count:
                    stats_file.start()  # every model loaded: this run counts from here
            elif kind == "rows":
                for group in payload:
                    job.emit(group)
            elif kind in ("stats", "done"):
                step_rows, summary = payload
                stats_file.add(step_rows)
                summaries[r] = summary
                generated[r] = summary["generated_tokens"]
                if kind == "done":
                    ended.add(r)
            elif kind == "failed":
                ended.add(r)
                ready.add(r)
                failure = failure or f"replica {r} ({devices[r]}) failed: {payload}"
            for r, p in enumerate(procs):
                if r not in ended and not p.is_alive() and out_q.empty():
                    ended.add(r)
                    if p.exitcode != 0:
                        how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                        failure = failure or f"replica {r} (pid {p.pid}, {devices[r]}) died ({how})"
            if failure or job.stop_requested:
                stop.set()
            rate = sum(generated.values()) / max(time.monotonic() - t0, 1e-9)
            job.tick(f"{rate:.1f} tok/s, {count - len(ended)} of {count} replicas running", stats_file)
            if summaries and stats_file.due():
                stats_file.write(
                    {**combine(list(summaries.values())), "rows": job.rows_done}, job_rows=job.job_rows
                )
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if not summaries:
        raise RuntimeError(failure or "no replica started")
    run_summary = combine([summaries[r] for r in sorted(summaries)])
    return run_summary, failure
