"""One job: stream rows in, keep the engines fed, write every row out, record statistics, stop cleanly.

Two halves. `RowWorker` (worker.py) is the engine side. `Job` is the row side: the input, the lock on the shard,
the output directory, the statistics file, the heartbeat, progress and signals. With one engine the worker runs
in this process; with `--replicas N` each replica process runs one (`replicas.py`) and the job hands rows to
whichever is ready. Only a bounded window of rows is in memory. `run_job` is the Python API's way in.

On SIGTERM or SIGINT the job stops admitting rows, abandons the rows still in flight (a rerun redoes them),
writes every finished row and the statistics, and exits with code 3 ("stopped, resumable").
"""

from __future__ import annotations

import itertools
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from . import storage
from .config import JobSpec
from .errors import BadInput, JobStopped
from .heartbeat import Heartbeat
from .host import place
from .lock import LeaseLock, shard_lock
from .loop import drive
from .model_loader import fingerprint_dtype, load_config
from .pooling_worker import PoolingCheckpoint, open_checkpoint, task_columns
from .progress import BAR_FORMAT, RemainingTime
from .rows import InputRow, OutputRow, Shard, row_samples
from .sinks import OutputSink, check_writable, move_legacy_state
from .sources import InputSource, OpenAIBatchSource, open_source
from .stats import StatsCollector, StatsFile
from .weights import JobWeights

if TYPE_CHECKING:
    from .worker import RowWorker

# The engine's modules (worker, replicas, sizing, structured outputs) are imported where a job first needs them:
# they import torch and transformers (seconds), and a job whose input or outputs are refused never does


class ShardRows:
    """This shard's input rows against its output, counted once before any model loads: `before`, the rows
    (up to the limit) whose output earlier runs wrote and that stays; `stale`, those whose output was made from
    another input or other weights and is redone (`input.on_change`, `model.on_change`; the sink removes their
    outputs once the job's checks have passed); and the pending ones, in input order."""

    def __init__(self, spec: JobSpec, source, sink: OutputSink, shard: Shard, limit: int | None):
        self.spec, self.source, self.sink, self.shard, self.limit = spec, source, sink, shard, limit
        self._pending: Iterator[InputRow] | None = None  # pending(), made once
        self.before = self._recheck() if sink.done else 0
        self.changed = 0  # the outputs removed to be redone, once the sink began (Job.loaded)

    def _recheck(self) -> int:
        """One pass over this shard's rows, before any model loads: an output made from another input than the
        row's (its content hash differs) or with other weights than the row's now (weights.py) is forgotten, so
        the row runs again, or refuses the run, as `input.on_change` and `model.on_change` say. Returns the rows
        whose output stays."""
        done, weights = self.sink.done, self.sink.weights
        keep_weights = self.spec.model.on_change == "keep"
        kept, inputs, reweighed = 0, [], {}  # reweighed: what changed -> the ids of the rows it made
        for row in self.source.rows(self.shard, self.limit):
            if row.id not in done.hashes:
                continue
            old = done.hashes[row.id]
            what = weights.what_changed(done.weights.get(row.id), row)
            if old is not None and old != row.input_hash:
                inputs.append(row.id)
            elif what is not None and not keep_weights:
                reweighed.setdefault(what, []).append(row.id)
            elif self.sink.is_done(row.id, row_samples(row, self.spec.sampling)):
                kept += 1
                if what is not None:
                    reweighed.setdefault(what, []).append(row.id)
        if inputs:
            changed = f"of {self.source.describe()} changed"
            self._redo(inputs, changed, "input.on_change", self.spec.input.on_change, "")
        for what, ids in reweighed.items():
            why = f"were made with other weights: {what} changed"
            self._redo(ids, why, "model.on_change", self.spec.model.on_change, ", or keep to keep them")
        return kept

    def _redo(self, ids: list, why: str, key: str, action: str, other: str) -> None:
        """Rows whose output is stale (`why`): refused, recomputed or kept, as the job's `key` says (`action`;
        `other`: the key's other answer, named in a refusal)."""
        spec = self.spec
        some = ", ".join(repr(i) for i in ids[:5]) + (", ..." if len(ids) > 5 else "")
        what = f"{len(ids)} row{'s' if len(ids) > 1 else ''} {why} since their output in {spec.output_dir} was written"
        if action == "refuse":
            raise BadInput(
                f"{spec.source_file}: {what} (ids {some}), and key `{key}` is refuse; set it to recompute to "
                f"redo them{other}, or use --overwrite to start over."
            )
        done = "recomputing them" if action == "recompute" else "keeping their outputs"
        print(f"batchrun: {what} (ids {some}): {done} ({key}: {action}).", file=sys.stderr, flush=True)
        if action == "recompute":
            self.sink.forget(set(ids))

    def pending(self) -> Iterator[InputRow]:
        """This shard's rows that do not have all their output rows yet, in input order: one pass over the
        input, whoever asks (the job's check for nothing to do, then the run itself)."""
        if self._pending is None:
            self._pending = (
                r
                for r in self.source.rows(self.shard, self.limit)
                if not self.sink.is_done(r.id, row_samples(r, self.spec.sampling))
            )
        return self._pending

    def put_back(self, row: InputRow) -> None:
        """Return a row taken from pending() to its head (the job peeks at the first to see if there is work)."""
        self._pending = itertools.chain([row], self.pending())

    def input_rows(self) -> int | None:
        """The whole input's rows (every shard's, up to the limit), from metadata when the input can say."""
        n = self.source.num_rows()
        if n is None:
            return None
        return min(n, self.limit) if self.limit is not None else n

    def shard_rows(self) -> int | None:
        """This shard's input rows (done ones included)."""
        n = self.input_rows()
        return None if n is None else len(range(self.shard.index, n, self.shard.count))


class Job:
    """One shard of one job. Constructing it checks everything that needs no model (the input, its ids, the
    output directory and statistics path) and takes the shard's lock; `run()` loads the model (or starts the
    replicas) and streams the rows through."""

    def __init__(
        self,
        spec: JobSpec,
        shard: Shard | None = None,
        resume: bool = True,
        overwrite: bool = False,
        limit: int | None = None,
        progress: bool = True,
        wait: bool = False,
        replicas: int | str | None = None,
        lock: bool = True,
        worker: RowWorker | None = None,
        waiting: dict | None = None,
    ):
        """`lock`: False is --no-lock. `worker`: an engine already loaded for this job (a Ray actor running
        another shard of it), used instead of loading one. `waiting`: how `wait` gives up (lock.Waiting's
        `stop` and `limit_s`)."""
        src = spec.source_file
        self.spec = spec
        self.shard = shard or Shard()
        self.limit = limit if limit is not None else spec.input.limit
        self.progress = progress
        self.replicas = replicas if replicas is not None else spec.engine.replicas
        self.source, self.checkpoint = check_job(spec, self.limit)
        self.placement = place(spec.engine.device, spec.model.dtype)  # once: the fingerprint, then the load
        check_writable(spec.output_dir, "output.path", src)
        self.lock = shard_lock(spec.state_dir, self.shard.index, self.shard.count, enabled=lock)
        self.lock.acquire(wait, spec.output_dir, src, **(waiting or {}))
        try:
            dtype = fingerprint_dtype(spec.model.dtype, self.placement)
            # a pooling job's own columns (an embedding's length), from the checkpoint check_job read
            task_types = task_columns(spec, self.checkpoint) if self.checkpoint is not None else None
            self.sink = OutputSink(
                spec,
                self.shard,
                self.source.id_type,
                self.source.passthrough_fields(),
                JobWeights.read(spec),
                resume,
                overwrite,
                dtype,
                guard=self.lock.check,
                task_types=task_types,
            )
            self.stats_path = spec.stats_path(self.shard.index, self.shard.count)
            check_writable(self.stats_path.parent, "output.stats", src)
            self.rows = ShardRows(spec, self.source, self.sink, self.shard, self.limit)
        except BaseException:
            self.lock.release()
            raise
        self.overwrite = overwrite
        self.worker = worker
        self.heartbeat = Heartbeat(spec.state_dir, self.shard)
        self.stop_requested = False
        self.bar = None  # the progress bar, while run() goes
        self.remaining: RemainingTime | None = None  # its remaining time, from the work done
        self.rows_done = 0  # input rows written by this run
        self.write_s = 0.0  # seconds handing them to the sink

    def pending_rows(self) -> Iterator[InputRow]:
        return self.rows.pending()

    @property
    def job_counts(self) -> dict[str, int]:
        """The summary's counts of the whole job (this shard): input rows its parts hold, earlier runs' (of any
        limit) and this run's, and those of them that are error rows."""
        rows = self.sink.done.rows_per_shard.get(str(self.shard), 0) + self.rows_done
        return {"rows": rows, "error_rows": self.sink.job_error_rows}

    @property
    def run_counts(self) -> dict[str, int]:
        """The same counts of this run alone."""
        return {"rows": self.rows_done, "error_rows": self.sink.error_rows}

    # ---- the run ------------------------------------------------------------------------------------------------
    def run(self) -> dict | None:
        """Runs the job; returns the whole job's summary, or None when every row was already done (no model
        loaded)."""
        try:
            rows = self.pending_rows()
            first = next(rows, None)
            if first is None:  # nothing to do (or an input without rows) loads no model
                self.tidy()
                self.sink.write_empty()
                total = self.rows.shard_rows()  # `batchrun status`: finished, not pending 0/?
                self.heartbeat.start(self.rows.input_rows(), total, total or 0, 0)
                self.heartbeat.finish("finished", 0)
                return None
            self.rows.put_back(first)  # the run goes on from there
            return self._run()
        finally:
            self.lock.release()

    def _run(self) -> dict:
        from .replicas import replica_count, run_replicas

        count = replica_count(self.replicas, self.spec.engine.device)
        self.tidy()  # before the statistics file is opened: an earlier layout's statistics are read from here
        # each replica checks before its load too, where a refusal is a failed replica: exit 2 here
        if count > 1:
            check_model(self.spec)
        total = self.rows.shard_rows()
        self.heartbeat.start(self.rows.input_rows(), total, self.rows.before, count)
        stats_file = StatsFile(self.stats_path, self.sink.fingerprint, fresh=self.overwrite)
        # the bar comes once the model is loaded (loaded()): a refusal at the load draws none
        if self.progress:
            model = self.spec.model.path or "the embedded default model"
            print(f"batchrun: {self.spec.name}: loading {model}", file=sys.stderr, flush=True)
        handlers = self._install_signal_handlers()
        failure = None
        try:
            if count == 1:
                run_summary = self._run_here(stats_file)
            else:
                run_summary, failure = run_replicas(self, count, stats_file)
        except BaseException:
            self.heartbeat.finish("failed", self.rows_done)
            raise
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.bar is not None:
                self.bar.close()
            self.sink.flush()
        run_summary.update(
            {
                **self.run_counts,
                "shard": str(self.shard),
                "replicas": count,
                "rows_changed": self.rows.changed,
                "time_write_s": self.write_s,
            }
        )
        whole = stats_file.write(run_summary, self.job_counts)
        if failure:
            self.heartbeat.finish("failed", self.rows_done)
            raise RuntimeError(failure)
        if self.stop_requested:
            self.heartbeat.finish("stopped", self.rows_done)
            raise JobStopped(
                f"{self.sink.rows_written} output rows written this run; the rows in flight were not."
            )
        self.heartbeat.finish("finished", self.rows_done)
        return whole

    def _run_here(self, stats_file: StatsFile) -> dict:
        """One engine, in this process."""
        from .worker import load_worker

        worker = self.worker or load_worker(self.spec, placement=self.placement, checkpoint=self.checkpoint)
        self.worker = worker  # kept: whoever made this job may run another shard on it
        self.loaded()
        stats_file.start()
        stats = worker.stats
        rows = self.pending_rows()

        def after_step() -> None:
            stats_file.add(stats.take_rows())
            self.tick(worker.status_line(), stats_file, stats, worker.rows_in_flight_done)

        try:
            drive(worker, lambda block: next(rows, None), self.emit, after_step, lambda: self.stop_requested)
        finally:
            stats_file.add(stats.take_rows(final=True))
        if not self.stop_requested:
            worker.check_integrity()
        return stats.summary() | self.run_counts

    def loaded(self) -> None:
        """Every engine has its model, so every check that can refuse the job has passed: only now is anything
        in the output removed (--overwrite's earlier parts, the outputs of rows to redo: OutputSink.begin). The
        heartbeat goes from loading to running, and the progress bar starts (its rate and ETA are of the rows,
        not of the model's load)."""
        self.rows.changed = self.sink.begin()
        self.heartbeat.running()
        from tqdm.auto import tqdm

        total = self.rows.shard_rows()
        self.bar = tqdm(
            total=None if total is None else max(0, total - self.rows.before),
            unit="row",
            desc=self.spec.name,
            disable=not self.progress,
            mininterval=0.5 if sys.stderr.isatty() else 10.0,
            dynamic_ncols=True,
            bar_format=BAR_FORMAT,
        )
        self.remaining = RemainingTime(self.bar)

    def tidy(self) -> None:
        """Under the shard's lock, once the run is going ahead: output directories of earlier versions' layout
        moved to this one's (statistics, plots and Slurm files, never a part), and a dead run's half-written
        temporary files (kill -9 during a write) gone."""
        move_legacy_state(self.spec)
        for folder in (self.spec.output_dir, self.spec.state_dir):
            storage.remove_dead_temporaries(folder)

    def emit(self, rows: list[OutputRow]) -> None:
        """All output rows of one input row, to the sink."""
        t0 = time.perf_counter()
        self.sink.add(rows)
        self.write_s += time.perf_counter() - t0
        self.rows_done += 1
        self.bar.update(1)

    def tick(
        self,
        postfix: str,
        stats_file: StatsFile,
        stats: StatsCollector | None = None,
        in_flight: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """Every loop turn: progress, heartbeat, the statistics file now and then (`stats`: this process's
        engine; replicas write theirs from their reports). `in_flight`: the rows' worth of work done by the rows
        running (progress.rows_in_flight_done; replicas do not report it: their remaining time is by rows)."""
        # `batchrun status` counts rows in written parts: what a run killed now would not redo
        self.heartbeat.beat(self.sink.input_rows_written)
        if stats is not None and stats_file.due():
            stats_file.write(stats.summary() | self.run_counts, self.job_counts)
        if self.remaining is not None:  # replicas still loading: no bar yet
            self.remaining.show(in_flight, f"{postfix}, written {self.sink.input_rows_written}")

    # ---- signals ------------------------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> dict:
        """SIGTERM and SIGINT stop the job cleanly; only the main thread may install handlers (a job run from
        a worker thread of a pipeline keeps the process's own)."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum, frame) -> None:
        if self.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_requested = True
        print(
            f"\nbatchrun: {signal.Signals(signum).name} received: writing finished rows and stopping "
            f"(rerun the same command to resume).",
            file=sys.stderr,
            flush=True,
        )


class CheckedJob(NamedTuple):
    """What checking a job opened and read, handed on rather than read again: its input, and a pooling job's
    checkpoint (None for generation), which gives the job its output columns and its runner."""

    source: InputSource | OpenAIBatchSource
    checkpoint: PoolingCheckpoint | None


def check_job(spec: JobSpec, limit: int | None) -> CheckedJob:
    """Everything about a job that needs no model weights, checked before any loads (`batchrun validate` too):
    the input opens and its columns hold what they should, ids are unique, a job-wide response format
    compiles into an enforced grammar, a pooling job's pooler keys fit its checkpoint (read here, once)."""
    source = open_source(spec)
    source.check_unique_ids(limit)
    # a pooling job's pooler keys against the checkpoint's files (an impossible combination)
    checkpoint = open_checkpoint(spec) if spec.task != "generate" else None
    if spec.sampling.structured:
        from batchrun.engine.structured import check_format

        try:
            check_format(spec.sampling.response_format)
        except ValueError as e:
            raise BadInput(f"{spec.source_file}: key `sampling.response_format`: {e}.") from None
    return CheckedJob(source, checkpoint)


def check_outputs(spec: JobSpec) -> None:
    """What `submit` checks of the outputs before any model loads, for `batchrun validate`: output.path and the
    statistics' folder can be written, and on an object store the shard lease's conditional writes work there
    (else submit needs --no-lock)."""
    src = spec.source_file
    check_writable(spec.output_dir, "output.path", src)
    check_writable(spec.stats_path().parent, "output.stats", src)
    if storage.is_remote(spec.state_dir):
        LeaseLock(spec.state_dir, 0, 1).probe(spec.output_dir, src)


def check_model(spec: JobSpec) -> str:
    """What `submit` checks of the model before its weights load, for `batchrun validate`: its path, each
    adapter's folder and config, and what the model's config decides (llm.check_before_load: the KV budget and
    swap space against this machine's memory, model.max_model_len against its positions, the adapters against
    its layers) where that config is at hand unconverted (a local folder; else the byte sizes alone, and the
    load checks the rest). Returns the model in words."""
    from .adapters import read_adapters
    from .llm import check_before_load
    from .model_loader import check_model_path
    from .report import counted

    src = spec.source_file
    model = check_model_path(spec.model.path, src)
    adapters = read_adapters(spec.model.adapters, spec.engine.max_lora_rank, src)
    if adapters:
        model += f" with {counted(len(adapters), 'LoRA adapter')}"
    path = Path(spec.model.path) if spec.model.path else None
    try:
        config = load_config(path) if path is not None and path.is_dir() else None
    except Exception:  # noqa: BLE001 - an unreadable config is the load's to report
        config = None
    check_before_load(
        spec.model, spec.engine, config, adapters, place(spec.engine.device, spec.model.dtype), src
    )
    return model


def run_job(job, overrides=None, **options: Any) -> dict | None:
    """Run a job (a job-file path, or the job as a dict) to the end, as `batchrun submit` does; returns its
    summary, or None when every row already had its output. `overrides`: {"sampling.temperature": 0.7} or
    ["sampling.temperature=0.7"]. `options`: shard ("I/N"), resume, overwrite, limit, progress, wait,
    replicas, lock (False: --no-lock).
    Raises BadInput (a ValueError) for a bad job, JobStopped when a signal stopped it."""
    shard = options.pop("shard", None)
    if isinstance(shard, str):
        shard = Shard.parse(shard)
    return Job(job_spec(job, overrides), shard, **options).run()


def job_spec(job, overrides=None) -> JobSpec:
    """A job-file path, or the job as a dict (its sections), with overrides applied, as a checked JobSpec."""
    import copy

    from .config import apply_overrides, load_job, parse_job

    if isinstance(job, dict):
        raw = copy.deepcopy(job)
        apply_overrides(raw, overrides)
        return parse_job(raw, "<job dict>")
    return load_job(job, overrides)
