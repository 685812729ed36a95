"""The engine side of a job: rows in, output rows out, on one LLM.

A row is checked and tokenized (a bad row becomes its error rows at once), queued in the LLM's engine, and its
n samples come back as output rows. The job drives one `RowWorker` in its own process; with `--replicas N` each
replica process drives one (`replicas.py`)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

from batchrun.engine import SamplingParams
from batchrun.engine.model.sizing import AUTO_SWAP_RULE

from .config import JobSpec, coerce_field
from .errors import BadInput
from .host import Placement, slow_dtype
from .llm import LLM, Prompt
from .progress import rows_in_flight_done
from .rows import (
    InputRow,
    OutputRow,
    check_conversation,
    is_token_ids,
    row_adapter,
    row_samples,
    row_seed,
)
from .stats import StatsCollector


@dataclass
class RowState:
    row: InputRow
    prompt_token_ids: list[int]
    results: list[OutputRow | None]


def row_window(spec: JobSpec) -> int:
    """How many rows to keep queued in an engine: enough to fill max_num_seqs after the running ones."""
    return max(spec.engine.max_num_seqs, 16)


class RowWorker:
    """Rows in, output rows out, on one LLM: the engine side of a job."""

    def __init__(self, llm: LLM, spec: JobSpec, stats: StatsCollector):
        self.llm = llm
        self.stats = stats  # this engine's statistics: every step is recorded
        self.engine = llm.engine
        self.spec = spec
        self.params = spec.sampling
        self.in_flight: dict[int, RowState] = {}  # input row index -> its samples so far
        self.window = row_window(spec)

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
            adapter = self._adapter(row)
            prompt = self._tokenize(row)
        except ValueError as e:
            return self._error_rows(row, str(e), [])
        ids = prompt.token_ids
        reason = self.engine.prompt_error(ids, params, prompt.images)
        if reason:
            return self._error_rows(row, reason, ids)
        state = RowState(row, ids, [None] * params.n)
        self.in_flight[row.index] = state
        seeds = [row_seed(params.seed, row.id, i) for i in range(params.n)]
        self.engine.add(ids, params, request=state, seeds=seeds, images=prompt.images, adapter=adapter)
        return None

    def step(self) -> list[list[OutputRow]]:
        """One engine step; returns the rows whose samples all finished, each as its output rows."""
        result = self.engine.step()
        times = self.engine.times
        with times("stats"):
            self.stats.record(result)
        done = []
        with times("finish"):
            for seq in result.finished:
                rows = self._finish(seq)
                if rows:
                    done.append(rows)
        return done

    def status_line(self) -> str:
        """The progress bar's note on the engine."""
        engine, stats = self.engine, self.stats
        rate = stats.generated_tokens / max(time.perf_counter() - stats.start, 1e-9)
        return f"{rate:.1f} tok/s, running {engine.num_running}, pages {engine.num_used_pages}/{engine.num_pages}"

    def rows_in_flight_done(self) -> float:
        """The rows' worth of work the running sequences have done (the progress bar's remaining time)."""
        return rows_in_flight_done(self.engine.live_sequences())

    def check_integrity(self) -> None:
        """After a whole run: every page back in the pool (engine.check_integrity)."""
        self.engine.check_integrity()

    def _params(self, row: InputRow) -> SamplingParams:
        """The job's sampling with the row's own values (sampling_columns, or an OpenAI request's body);
        ValueError naming the value for one that is not valid."""
        if not row.sampling:
            return self.params
        columns = self.spec.input.sampling_columns
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        values = {}
        for key, value in row.sampling.items():
            if row.request:  # an OpenAI request: its file and line, and the body's own field name
                where, name = row.request["line"], f"body.{row.request['fields'].get(key, key)}"
            else:
                where, name = f"column {columns.get(key)!r}", key
            if key == "response_format" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: `{name}` is not JSON ({e.msg})") from None
            if (
                isinstance(value, float)
                and value.is_integer()
                and key in ("max_new_tokens", "top_k", "seed", "n")
            ):
                value = int(value)  # an integer column with nulls reads as floats
            if key not in fields:
                raise ValueError(f"{where}: `{name}` is not supported")
            try:
                values[key] = coerce_field(SamplingParams, key, value, name, where)
            except BadInput as e:
                raise ValueError(str(e).rstrip(".")) from None
        try:
            return dataclasses.replace(self.params, **values)
        except ValueError as e:
            raise ValueError(f"this row's sampling: {e}") from None

    def _adapter(self, row: InputRow) -> str | None:
        """The row's LoRA adapter (None: the base model), from its adapter column's cell (input.adapter_column)
        or an OpenAI request's `model` (as vLLM's server picks an adapter): config.ModelSpec.adapter_named.
        ValueError naming the column, or the request's line, for a name that is neither an adapter nor the
        base model."""
        return row_adapter(row, self.spec)

    def _tokenize(self, row: InputRow) -> Prompt:
        """The row's prompt as token ids (and images); ValueError with the reason for a row that cannot be served.
        A conversation goes through the chat template (model.system_prompt first when it has no system turn);
        a string too, unless model.chat_template is off or it is an OpenAI /v1/completions prompt. Token ids (a
        pre-tokenized column) are taken as they are, as `LLM.generate` takes them; whatever made them, feed
        checks them against the model's embedding (engine.prompt_error)."""
        if row.error:
            raise ValueError(row.error)
        prompt = row.prompt
        m = self.spec.model
        system = [{"role": "system", "content": m.system_prompt}] if m.system_prompt else []
        if prompt is None:
            raise ValueError("prompt is null")
        if is_token_ids(prompt):
            return Prompt(list(prompt))
        if isinstance(prompt, list | tuple):
            messages = check_conversation(prompt, images=self.llm.takes_images)
            if not any(t["role"] == "system" for t in messages):
                messages = system + messages
            return self.llm.render_chat(messages, self.spec.input.base_dir)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt is neither a string nor a conversation (got {type(prompt).__name__})")
        if not prompt.strip():
            raise ValueError("prompt is empty")
        endpoint = row.request.get("endpoint") if row.request else None
        if endpoint == "completion" or (endpoint is None and not m.chat_template):
            return Prompt(self.llm.encode(prompt))
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


def load_worker(
    spec: JobSpec, replica: int = 0, placement: Placement | None = None, checkpoint=None
) -> RowWorker:
    """The LLM of a job file and its worker, whose statistics carry the facts about them for the summary. A
    job-wide response format that does not compile stops the job here, before any row. `placement`: the device
    and dtype the job resolved (a replica resolves its own device). A pooling task's job gets its own worker
    (pooling_worker.py), from the checkpoint the job read when it was checked (`checkpoint`; None: read here)."""
    if spec.task != "generate":
        return _load_pooling_worker(spec, replica, placement, checkpoint)
    t0 = time.perf_counter()
    llm = LLM.from_spec(spec.model, spec.engine, spec.source_file, placement)
    load_s = time.perf_counter() - t0
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
        "packed_weights": llm.rewrites["packed_linear"] > 0,
        "fused_products": llm.rewrites["fused_products"],
        "weights_format": llm.weights.format,
        "weights_bytes": llm.weights.bytes,
        "slow_dtype": llm.slow_dtype,
        "swap_space_bytes": llm.engine.swap_bytes,
        # unset engine.swap_space: the rule its size came from (engine/sizing.swap_bytes)
        "swap_space_auto": AUTO_SWAP_RULE if spec.engine.swap_space is None else None,
    }
    return RowWorker(llm, spec, StatsCollector(llm.engine, extra=facts, replica=replica, load_s=load_s))


def _load_pooling_worker(spec: JobSpec, replica: int, placement: Placement | None, checkpoint):
    """A pooling job's worker (pooling_worker.py), whose statistics carry the facts about it for the summary."""
    from .pooling_worker import PoolingWorker, fp32_sample_of, load_runner, open_checkpoint
    from .stats import PoolingStats

    t0 = time.perf_counter()
    checkpoint = checkpoint or open_checkpoint(spec)
    runner = load_runner(
        spec.model, spec.engine, spec.pooler, spec.source_file, placement, spec.task, checkpoint
    )
    facts = {
        "job": spec.name,
        "task": spec.task,
        "attention": "packed",
        "device": str(runner.device),
        "dtype": str(runner.dtype).replace("torch.", ""),
        "model": spec.model.path,
        "packed_weights": runner.rewrites["packed_linear"] > 0,
        "fused_products": runner.rewrites["fused_products"],
        "slow_dtype": slow_dtype(Placement(runner.device, runner.dtype)),
    }
    load_s = time.perf_counter() - t0
    stats = PoolingStats(
        extra=facts, replica=replica, load_s=load_s, sample=fp32_sample_of(spec, runner, checkpoint)
    )
    inp = spec.input
    text = "body.input" if inp.openai_batch else f"column {inp.prompt_column!r}"
    pair = f"column {inp.pair_column!r}" if inp.pair_column else None
    return PoolingWorker(runner, stats, row_window(spec), spec.task, (text, pair))
