"""One job: stream rows in, keep the engine fed, write every row out, record statistics, stop cleanly.

Row lifecycle: read -> checked and tokenized (a bad row becomes an error row at once) -> queued in the engine
-> its n samples finish -> written together in a part file. Only a bounded window of rows is in memory.

On SIGTERM or SIGINT the job stops admitting rows, abandons the rows still in flight (a rerun redoes them),
writes every finished row and the statistics, and exits with code 3 ("stopped, resumable").
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass

from .config import JobSpec
from .errors import JobStopped
from .llm import LLM, row_seed
from .sinks import OutputRow, OutputSink, check_writable
from .sources import InputRow, InputSource, Shard
from .stats import StatsCollector


@dataclass
class RowState:
    row: InputRow
    prompt_tokens: int
    results: list[OutputRow | None]


class Job:
    """One shard of one job. Constructing it checks everything that needs no model (the input, its ids, the
    output directory and statistics path); `run()` loads the model and streams the rows through it."""

    def __init__(
        self,
        spec: JobSpec,
        shard: Shard | None = None,
        resume: bool = True,
        overwrite: bool = False,
        limit: int | None = None,
        progress: bool = True,
    ):
        src = spec.source_file
        self.spec = spec
        self.params = spec.sampling
        self.shard = shard or Shard()
        self.limit = limit if limit is not None else spec.input.limit
        self.progress = progress
        self.source = InputSource(spec.input, src)
        self.source.check_unique_ids(self.limit)
        self.sink = OutputSink(
            spec, self.shard, self.source.id_type, self.source.passthrough_fields(), resume, overwrite
        )
        self.stats_path = spec.stats_path(self.shard.index, self.shard.count)
        check_writable(self.stats_path.parent, "output.stats", src)
        # the run: set by run() once the model is loaded
        self.llm: LLM | None = None
        self.stats: StatsCollector | None = None
        self.bar = None
        self.in_flight: dict[int, RowState] = {}  # input row index -> its samples so far
        self.stop_requested = False
        self._last_postfix = 0.0

    def _pending_rows(self):
        """This shard's rows that do not have all their output rows yet, in input order."""
        return (
            r for r in self.source.rows(self.shard, self.limit) if not self.sink.is_done(r.id, self.params.n)
        )

    def _total_rows(self) -> int | None:
        n = self.source.num_rows()
        if n is None:
            return None
        if self.limit is not None:
            n = min(n, self.limit)
        mine = len(range(self.shard.index, n, self.shard.count))
        return max(0, mine - len(self.sink.done) // self.params.n)

    # ---- the run ------------------------------------------------------------------------------------------------
    def run(self) -> dict | None:
        """Runs the job; returns its summary, or None when every row was already done (no model loaded)."""
        if self.sink.done and next(self._pending_rows(), None) is None:
            return None
        from tqdm.auto import tqdm

        spec = self.spec
        self.llm = LLM.from_spec(spec.model, spec.engine, spec.source_file)
        self.stats = StatsCollector(
            self.stats_path,
            self.llm.engine,
            extra={
                "job": spec.name,
                "shard": str(self.shard),
                "attention": self.llm.engine.attention.name,
                "device": str(self.llm.device),
                "dtype": str(self.llm.dtype).replace("torch.", ""),
                "model": str(self.llm.model_dir),
                "max_num_seqs": spec.engine.max_num_seqs,
            },
        )
        self.bar = tqdm(
            total=self._total_rows(),
            unit="row",
            desc=spec.name,
            disable=not self.progress,
            mininterval=0.5 if sys.stderr.isatty() else 10.0,
            dynamic_ncols=True,
        )
        handlers = self._install_signal_handlers()
        try:
            self._loop()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            self.bar.close()
            self.sink.flush()
            self.stats.write()
        if self.stop_requested:
            raise JobStopped(
                f"stopped with {len(self.in_flight)} rows in flight (not written); "
                f"{self.sink.rows_written} rows written this run."
            )
        self.llm.engine.check_integrity()
        return self.stats.summary()

    def _loop(self) -> None:
        engine = self.llm.engine
        rows = self._pending_rows()
        more = True
        while not self.stop_requested:
            if more:
                more = self._feed(rows)
            if not engine.has_unfinished():
                if not more:
                    break
                continue
            result = engine.step()
            self.stats.record(result)
            for seq in result.finished:
                self._finish(seq)
            self._progress()

    def _feed(self, rows) -> bool:
        """Queue rows until the engine has a full window waiting; returns False once the input is exhausted."""
        engine = self.llm.engine
        target = max(self.spec.engine.max_num_seqs, 16)
        n = self.params.n
        while engine.num_waiting < target and not self.stop_requested:
            row = next(rows, None)
            if row is None:
                return False
            try:
                ids = self._tokenize(row)
            except ValueError as e:
                self._emit(self._error_rows(row, str(e), 0))
                continue
            reason = engine.admission_error(len(ids), self.params)
            if reason:
                self._emit(self._error_rows(row, reason, len(ids)))
                continue
            state = RowState(row, len(ids), [None] * n)
            self.in_flight[row.index] = state
            seeds = [row_seed(self.params.seed, row.id, i) for i in range(n)]
            engine.add(ids, self.params, request=state, seeds=seeds)
        return True

    def _tokenize(self, row: InputRow) -> list[int]:
        """Token ids of the row's prompt; ValueError with the reason for a row that cannot be served."""
        prompt = row.prompt
        if prompt is None:
            raise ValueError("prompt is null")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt is not a string (got {type(prompt).__name__})")
        if not prompt.strip():
            raise ValueError("prompt is empty")
        m = self.spec.model
        if not m.chat_template:
            return self.llm.encode(prompt)
        messages = [{"role": "system", "content": m.system_prompt}] if m.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return self.llm.encode_chat(messages)

    def _error_rows(self, row: InputRow, reason: str, prompt_tokens: int) -> list[OutputRow]:
        return [
            OutputRow(row.id, i, None, "error", reason, prompt_tokens, 0, 0, row.passthrough)
            for i in range(self.params.n)
        ]

    def _finish(self, seq) -> None:
        state: RowState = seq.request
        out = self.llm.completion(seq)
        state.results[seq.sample_index] = OutputRow(
            state.row.id,
            seq.sample_index,
            out.text,
            out.finish_reason,
            None,
            state.prompt_tokens,
            len(out.token_ids),
            out.num_preemptions,
            state.row.passthrough,
        )
        if all(r is not None for r in state.results):
            del self.in_flight[state.row.index]
            self._emit(state.results)

    def _emit(self, rows: list[OutputRow]) -> None:
        self.sink.add(rows)
        self.stats.rows_done += 1
        self.bar.update(1)

    def _progress(self) -> None:
        if self.bar.disable:
            return
        now = time.perf_counter()
        if now - self._last_postfix < 0.5:
            return
        self._last_postfix = now
        engine = self.llm.engine
        elapsed = now - self.stats.start
        self.bar.set_postfix_str(
            f"{self.stats.generated_tokens / elapsed:.1f} tok/s, running {engine.num_running}, "
            f"pages {engine.num_used_pages}/{engine.num_pages}",
            refresh=False,
        )

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
