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
    run_counts: dict[str, int]  # rows and error_rows: this run's (job.Job.run_counts)
    job_counts: dict[str, int]  # the whole job's

    def pending_rows(self) -> Iterator[InputRow]: ...

    def loaded(self) -> None: ...

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


class ReplicaRun:
    """One run of a job's pending rows on `count` replica processes. The job's side of it: keep the shared row
    queue fed (once every replica has loaded), take what the replicas send back (finished rows to the job,
    statistics to the stats file), and watch the processes (a replica that dies stops the others)."""

    def __init__(self, job: RowSide, count: int, stats_file: StatsFile):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.job, self.count, self.stats_file = job, count, stats_file
        self.devices = replica_devices(count, job.spec.engine.device)
        threads = max(1, (os.cpu_count() or 1) // count)
        self.rows_q = ctx.Queue(maxsize=row_window(job.spec) * count)
        self.out_q = ctx.Queue()
        self.stop = ctx.Event()
        self.procs = [
            ctx.Process(
                target=_replica_main,
                args=(r, job.spec, self.devices[r], threads, self.rows_q, self.out_q, self.stop, os.getpid()),
                name=f"batchrun-replica-{r}",
                daemon=True,
            )
            for r in range(count)
        ]
        self.summaries: dict[int, dict] = {}  # each replica's latest summary
        self.ready: set[int] = set()  # loaded (or failed)
        self.ended: set[int] = set()  # done, failed or gone
        self.failure: str | None = None
        self.rows = job.pending_rows()
        self.held: InputRow | None = None  # a row taken from the input that did not fit in the queue yet
        self.sentinels = 0  # end-of-input markers still to queue, one per replica
        self.more = True  # the input may hold more rows

    def run(self) -> tuple[dict, str | None]:
        """Start the replicas and run until each ended; returns the replicas' combined summary and the failure,
        if one failed."""
        for p in self.procs:
            p.start()
        t0 = time.monotonic()
        try:
            while len(self.ended) < self.count:
                self._feed()
                self._receive()
                self._watch()
                if self.failure or self.job.stop_requested:
                    self.stop.set()
                generated = sum(s["generated_tokens"] for s in self.summaries.values())
                rate = generated / max(time.monotonic() - t0, 1e-9)
                running = self.count - len(self.ended)
                self.job.tick(
                    f"{rate:.1f} tok/s, {running} of {self.count} replicas running", self.stats_file
                )
                if self.summaries and self.stats_file.due():
                    self.stats_file.write(self._summary() | self.job.run_counts, self.job.job_counts)
        finally:
            self.stop.set()
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
        if not self.summaries:
            raise RuntimeError(self.failure or "no replica started")
        return self._summary(), self.failure

    def _summary(self) -> dict:
        return combine([self.summaries[r] for r in sorted(self.summaries)])

    def _feed(self) -> None:
        """Fill the shared queue, once every replica is ready (the first to load would take every row)."""
        while (self.more or self.held is not None or self.sentinels) and len(self.ready) == self.count:
            if self.stop.is_set():
                return
            if self.held is None and self.more:
                self.held = next(self.rows, None)
                if self.held is None:
                    self.more, self.sentinels = False, self.count
            try:
                self.rows_q.put_nowait(self.held)
            except queue.Full:
                return
            if self.held is None:
                self.sentinels -= 1
            self.held = None

    def _receive(self) -> None:
        """Take one message from the replicas, if one comes within 0.1 s."""
        try:
            kind, r, payload = self.out_q.get(timeout=0.1)
        except queue.Empty:
            return
        if kind == "ready":
            self.ready.add(r)
            if len(self.ready) == self.count and not self.failure:  # a replica refused: nothing is touched
                self.job.loaded()
                self.stats_file.start()  # every model loaded: this run counts from here
        elif kind == "rows":
            for group in payload:
                self.job.emit(group)
        elif kind in ("stats", "done"):
            step_rows, self.summaries[r] = payload
            self.stats_file.add(step_rows)
            if kind == "done":
                self.ended.add(r)
        elif kind == "failed":
            self.ended.add(r)
            self.ready.add(r)
            self.failure = self.failure or f"replica {r} ({self.devices[r]}) failed: {payload}"

    def _watch(self) -> None:
        """A replica gone without a word (killed, crashed) ends; one that did not exit cleanly is the failure."""
        for r, p in enumerate(self.procs):
            if r not in self.ended and not p.is_alive() and self.out_q.empty():
                self.ended.add(r)
                if p.exitcode != 0:
                    how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                    self.failure = (
                        self.failure or f"replica {r} (pid {p.pid}, {self.devices[r]}) died ({how})"
                    )


def run_replicas(job: RowSide, count: int, stats_file: StatsFile) -> tuple[dict, str | None]:
    """Run the job's pending rows on `count` replica processes; returns this run's summary (the replicas'
    combined) and the failure, if a replica failed."""
    return ReplicaRun(job, count, stats_file).run()
