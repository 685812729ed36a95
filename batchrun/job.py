"""One job: stream rows in, keep the engine fed, write every row out, record statistics, stop cleanly.

Row lifecycle: read -> checked and tokenized (a bad row becomes an error row at once) -> queued in the engine
-> its n samples finish -> written together in a part file. Only a bounded window of rows is in memory.

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
from .llm import LLM, check_conversation, row_seed
from .sinks import OutputRow, OutputSink, check_writable, move_legacy_state
from .sources import InputRow, Shard, open_source
from .stats import StatsCollector


@dataclass
class RowState:
    row: InputRow
    prompt_token_ids: list[int]
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
        self.source = open_source(spec.input, src)
        self.source.check_unique_ids(self.limit)
        self.sink = OutputSink(
            spec, self.shard, self.source.id_type, self.source.passthrough_fields(), resume, overwrite
        )
        move_legacy_state(spec)
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
        while engine.num_waiting < target and not self.stop_requested:
            row = next(rows, None)
            if row is None:
                return False
            try:
                params = self._params(row)
                ids = self._tokenize(row)
            except ValueError as e:
                self._emit(self._error_rows(row, str(e), []))
                continue
            reason = engine.admission_error(len(ids), params)
            if reason:
                self._emit(self._error_rows(row, reason, ids))
                continue
            state = RowState(row, ids, [None] * params.n)
            self.in_flight[row.index] = state
            seeds = [row_seed(params.seed, row.id, i) for i in range(params.n)]
            engine.add(ids, params, request=state, seeds=seeds)
        return True

    def _samples(self, row: InputRow) -> int:
        """How many output rows this input row has: its own n when it sets a valid one (an error row too)."""
        n = row.sampling.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else self.params.n

    def _params(self, row: InputRow) -> SamplingParams:
        """The job's sampling with the row's own values (sampling_columns, or an OpenAI request's body);
        ValueError naming the value for one that is not valid."""
        if not row.sampling:
            return self.params
        columns = self.spec.input.sampling_columns
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
            if key not in {f.name for f in dataclasses.fields(SamplingParams)}:
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
            return self.llm.encode_chat(messages)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt is neither a string nor a conversation (got {type(prompt).__name__})")
        if not prompt.strip():
            raise ValueError("prompt is empty")
        endpoint = row.request.get("endpoint") if row.request else None
        if endpoint == "completion" or (endpoint is None and not m.chat_template):
            return self.llm.encode(prompt)
        return self.llm.encode_chat([*system, {"role": "user", "content": prompt}])

    def _error_rows(self, row: InputRow, reason: str, prompt_ids: list[int]) -> list[OutputRow]:
        return [
            OutputRow(row.id, i, None, "error", reason, len(prompt_ids), 0, 0, row=row)
            for i in range(self._samples(row))
        ]

    def _finish(self, seq) -> None:
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
