"""One job: stream rows in, keep the engines fed, write every row out, record statistics, stop cleanly.

Two halves. `RowWorker` is the engine side: a row is checked and tokenized (a bad row becomes an error row at
once), queued in its LLM's engine, and its n samples come back as output rows. `Job` is the row side: the input,
the lock on the shard, the output directory, the statistics file, the heartbeat, progress and signals. With one
engine the worker runs in this process; with `--replicas N` each replica process runs one (`replicas.py`) and
the job hands rows to whichever is ready. Only a bounded window of rows is in memory.

On SIGTERM or SIGINT the job stops admitting rows, abandons the rows still in flight (a rerun redoes them),
writes every finished row and the statistics, and exits with code 3 ("stopped, resumable").
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass

from .config import JobSpec, coerce_field
from .engine import SamplingParams
from .errors import BadInput, JobStopped
from .heartbeat import Heartbeat
from .llm import LLM, check_conversation, row_seed
from .lock import ShardLock
from .model_loader import fingerprint_dtype
from .sinks import OutputRow, OutputSink, check_writable, move_legacy_state
from .sources import InputRow, Shard, open_source
from .stats import StatsCollector, StatsFile


@dataclass
class RowState:
    row: InputRow
    prompt_token_ids: list[int]
    results: list[OutputRow | None]


def row_samples(row: InputRow, params: SamplingParams) -> int:
    """How many output rows an input row has: its own n when it sets a valid one (an error row too)."""
    n = row.sampling.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else params.n


class RowWorker:
    """Rows in, output rows out, on one LLM: the engine side of a job."""

    def __init__(self, llm: LLM, spec: JobSpec):
        self.llm = llm
        self.engine = llm.engine
        self.spec = spec
        self.params = spec.sampling
        self.in_flight: dict[int, RowState] = {}  # input row index -> its samples so far
        # how many rows to keep queued: enough to fill max_num_seqs after the running ones
        self.window = max(spec.engine.max_num_seqs, 16)

    @property
    def wants_rows(self) -> bool:
        return self.engine.num_waiting < self.window

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def feed(self, row: InputRow) -> list[OutputRow] | None:
        """Queue a row; returns its error rows at once when it cannot be served."""
        try:
            params = self._params(row)
            ids = self._tokenize(row)
        except ValueError as e:
            return self._error_rows(row, str(e), [])
        reason = self.engine.admission_error(len(ids), params)
        if reason:
            return self._error_rows(row, reason, ids)
        state = RowState(row, ids, [None] * params.n)
        self.in_flight[row.index] = state
        seeds = [row_seed(params.seed, row.id, i) for i in range(params.n)]
        self.engine.add(ids, params, request=state, seeds=seeds)
        return None

    def step(self, stats: StatsCollector) -> list[list[OutputRow]]:
        """One engine step; returns the rows whose samples all finished, each as its output rows."""
        result = self.engine.step()
        times = self.engine.times
        with times("stats"):
            stats.record(result)
        done = []
        with times("finish"):
            for seq in result.finished:
                rows = self._finish(seq)
                if rows:
                    done.append(rows)
        return done

    def _params(self, row: InputRow) -> SamplingParams:
        """The job's sampling with the row's own values (sampling_columns, or an OpenAI request's body);
        ValueError naming the value for one that is not valid."""
        if not row.sampling:
            return self.params
        columns = self.spec.input.sampling_columns
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        values = {}
        for key, value in row.sampling.items():
            where = f"body field for {key}" if row.request else f"column {columns.get(key)!r} ({key})"
            if key == "response_format" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not JSON ({e.msg})") from None
            if (
                isinstance(value, float)
                and value.is_integer()
                and key in ("max_new_tokens", "top_k", "seed", "n")
            ):
                value = int(value)  # an integer column with nulls reads as floats
            if key not in fields:
                raise ValueError(f"{where}: {key} is not supported")
            try:
                values[key] = coerce_field(SamplingParams, key, value, key, where)
            except BadInput as e:
                raise ValueError(str(e).rstrip(".")) from None
        try:
            return dataclasses.replace(self.params, **values)
        except ValueError as e:
            raise ValueError(f"this row's sampling: {e}") from None

    def _tokenize(self, row: InputRow) -> list[int]:
        """Token ids of the row's prompt; ValueError with the reason for a row that cannot be served.
        A conversation goes through the chat template (model.system_prompt first when it has no system turn);
        a string too, unless model.chat_template is off or it is an OpenAI /v1/completions prompt."""
        if row.error:
            raise ValueError(row.error)
        prompt = row.prompt
        m = self.spec.model
        system = [{"role": "system", "content": m.system_prompt}] if m.system_prompt else []
        if prompt is None:
            raise ValueError("prompt is null")
        if isinstance(prompt, list | tuple):
            messages = check_conversation(prompt)
            if not any(t["role"] == "system" for t in messages):
                messages = system + messages
            return self.llm.render_chat(messages)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt is neither a string nor a conversation (got {type(prompt).__name__})")
        if not prompt.strip():
            raise ValueError("prompt is empty")
        endpoint = row.request.get("endpoint") if row.request else None
        if endpoint == "completion" or (endpoint is None and not m.chat_template):
            return self.llm.encode(prompt)
        return self.llm.render_chat([*system, {"role": "user", "content": prompt}])

    def _error_rows(self, row: InputRow, reason: str, prompt_ids: list[int]) -> list[OutputRow]:
        return [
            OutputRow(row.id, i, None, "error", reason, len(prompt_ids), 0, 0, row=row)
            for i in range(row_samples(row, self.params))
        ]

    def _finish(self, seq) -> list[OutputRow] | None:
        state: RowState = seq.request
        out = self.llm.completion(seq)
        with_ids = self.spec.output.token_ids
        state.results[seq.sample_index] = OutputRow(
            state.row.id,
            seq.sample_index,
            out.text,
            out.finish_reason,
            None,
            len(state.prompt_token_ids),
            len(out.token_ids),
            out.num_preemptions,
            logprobs=out.logprobs,
            prompt_logprobs=seq.prompt_logprobs,
            prompt_token_ids=state.prompt_token_ids if with_ids else None,
            completion_token_ids=out.token_ids if with_ids else None,
            row=state.row,
        )
        if any(r is None for r in state.results):
            return None
        del self.in_flight[state.row.index]
        return state.results


def load_worker(spec: JobSpec) -> tuple[RowWorker, dict]:
    """The LLM of a job file and its worker; the facts about them for the summary. A job-wide response format
    that does not compile stops the job here, before any row."""
    llm = LLM.from_spec(spec.model, spec.engine, spec.source_file)
    if spec.sampling.structured:
        try:
            llm.engine.grammars.compile(spec.sampling.response_format)
        except ValueError as e:
            raise BadInput(f"{spec.source_file}: key `sampling.response_format`: {e}.") from None
    facts = {
        "job": spec.name,
        "attention": llm.engine.attention.name,
        "device": str(llm.device),
        "dtype": str(llm.dtype).replace("torch.", ""),
        "model": str(llm.model_dir),
        "max_num_seqs": spec.engine.max_num_seqs,
    }
    return RowWorker(llm, spec), facts


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
    ):
        src = spec.source_file
        self.spec = spec
        self.params = spec.sampling
        self.shard = shard or Shard()
        self.limit = limit if limit is not None else spec.input.limit
        self.progress = progress
        self.replicas = replicas if replicas is not None else spec.engine.replicas
        self.source = open_source(spec.input, src)
        self.source.check_unique_ids(self.limit)
        check_writable(spec.output_dir, "output.path", src)
        self.lock = ShardLock(spec.state_dir, self.shard.index, self.shard.count)
        self.lock.acquire(wait, spec.output_dir, src)
        try:
            dtype = fingerprint_dtype(spec.model.dtype, spec.engine.device)
            self.sink = OutputSink(
                spec,
                self.shard,
                self.source.id_type,
                self.source.passthrough_fields(),
                resume,
                overwrite,
                dtype,
            )
            move_legacy_state(spec)
            self.stats_path = spec.stats_path(self.shard.index, self.shard.count)
            check_writable(self.stats_path.parent, "output.stats", src)
        except BaseException:
            self.lock.release()
            raise
        self.overwrite = overwrite
        self.heartbeat = Heartbeat(spec.state_dir, self.shard)
        self.stop_requested = False
        self.bar = None  # the progress bar, while run() goes
        self.rows_done = 0  # input rows written by this run
        self.write_s = 0.0  # seconds handing them to the sink
        self.rows_before = self.sink.done.rows_per_shard.get(str(self.shard), 0)  # ... and by earlier runs
        self._last_postfix = 0.0

    def pending_rows(self):
        """This shard's rows that do not have all their output rows yet, in input order."""
        return (
            r
            for r in self.source.rows(self.shard, self.limit)
            if not self.sink.is_done(r.id, row_samples(r, self.params))
        )

    def input_rows(self) -> int | None:
        """The whole input's rows (every shard's, up to the limit), from metadata when the input can say."""
        n = self.source.num_rows()
        if n is None:
            return None
        return min(n, self.limit) if self.limit is not None else n

    def total_rows(self) -> int | None:
        """This shard's input rows (done ones included)."""
        n = self.input_rows()
        return None if n is None else len(range(self.shard.index, n, self.shard.count))

    @property
    def job_rows(self) -> int:
        """Input rows the output directory holds: earlier runs' and this run's."""
        return self.rows_before + self.rows_done

    # ---- the run ------------------------------------------------------------------------------------------------
    def run(self) -> dict | None:
        """Runs the job; returns the whole job's summary, or None when every row was already done (no model
        loaded)."""
        try:
            if self.sink.done and next(self.pending_rows(), None) is None:
                return None
            return self._run()
        finally:
            self.lock.release()

    def _run(self) -> dict:
        from tqdm.auto import tqdm

        from .replicas import replica_count

        count = replica_count(self.replicas, self.spec.engine.device)
        total = self.total_rows()
        self.heartbeat.start(self.input_rows(), total, self.rows_before, count)
        stats_file = StatsFile(self.stats_path, self.sink.fingerprint, fresh=self.overwrite)
        self.bar = tqdm(
            total=None if total is None else max(0, total - self.rows_before),
            unit="row",
            desc=self.spec.name,
            disable=not self.progress,
            mininterval=0.5 if sys.stderr.isatty() else 10.0,
            dynamic_ncols=True,
        )
        handlers = self._install_signal_handlers()
        failure = None
        try:
            if count == 1:
                run_summary = self._run_here(stats_file)
            else:
                from .replicas import run_replicas

                run_summary, failure = run_replicas(self, count, stats_file)
        except BaseException:
            self.heartbeat.finish("failed", self.rows_done)
            raise
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            self.bar.close()
            self.sink.flush()
        run_summary.update(
            {
                "rows": self.rows_done,
                "shard": str(self.shard),
                "replicas": count,
                "time_write_s": self.write_s,
            }
        )
        whole = stats_file.write(run_summary, job_rows=self.job_rows)
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
        worker, facts = load_worker(self.spec)
        stats_file.start()
        stats = StatsCollector(worker.engine, extra=facts)
        rows = self.pending_rows()
        more = True
        try:
            while not self.stop_requested:
                while more and worker.wants_rows and not self.stop_requested:
                    row = next(rows, None)
                    if row is None:
                        more = False
                    else:
                        errors = worker.feed(row)
                        if errors:
                            self.emit(errors)
                if not worker.has_work:
                    if not more:
                        break
                    continue
                for done in worker.step(stats):
                    self.emit(done)
                stats_file.add(stats.take_rows())
                engine = worker.engine
                rate = stats.generated_tokens / max(time.perf_counter() - stats.start, 1e-9)
                self.tick(
                    f"{rate:.1f} tok/s, running {engine.num_running}, pages {engine.num_used_pages}/{engine.num_pages}",
                    stats_file,
                    stats,
                )
        finally:
            stats_file.add(stats.take_rows(final=True))
        if not self.stop_requested:
            worker.engine.check_integrity()
        return stats.summary(rows=self.rows_done)

    def emit(self, rows: list[OutputRow]) -> None:
        """All output rows of one input row, to the sink."""
        t0 = time.perf_counter()
        self.sink.add(rows)
        self.write_s += time.perf_counter() - t0
        self.rows_done += 1
        self.bar.update(1)

    def tick(self, postfix: str, stats_file: StatsFile, stats: StatsCollector | None = None) -> None:
        """Every loop turn: progress, heartbeat, the statistics file now and then (`stats`: this process's
        engine; replicas write theirs from their reports)."""
        now = time.monotonic()
        self.heartbeat.beat(self.rows_done)
        if stats is not None and stats_file.due():
            stats_file.write(stats.summary(rows=self.rows_done), job_rows=self.job_rows)
        if not self.bar.disable and now - self._last_postfix >= 0.5:
            self._last_postfix = now
            self.bar.set_postfix_str(postfix, refresh=False)

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
