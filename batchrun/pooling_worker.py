"""The engine side of a pooling job (task: embed): rows in, one output row each out, on one pooling runner
(engine/pooling.py). It is worker.py's `RowWorker` for generation, in the same loop (loop.drive), job, replicas,
part files and resume: a row's text is tokenized as sentence-transformers does (a bad row becomes its error row
at once), queued, and comes back with its vector when its step is done."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pyarrow as pa

from .config import JobSpec, ModelSpec
from .engine.config import EngineConfig
from .engine.pooler import PoolerConfig, PoolingPlan, resolve
from .engine.sentence_config import SentenceConfigError, read_sentence_config
from .errors import BadInput
from .host import Placement, place
from .model_loader import load_config, resolve_model_dir
from .rows import InputRow, OutputRow
from .stats import PoolingStats


def checkpoint_task(model_dir: Path) -> str:
    """What a pooling checkpoint does: classify (a `*ForSequenceClassification` architecture) or embed."""
    architectures = getattr(load_config(model_dir), "architectures", None) or []
    return "classify" if any(a.endswith("ForSequenceClassification") for a in architectures) else "embed"


def plan_for(model_dir: Path, options: PoolerConfig, where: str, task: str = "embed") -> PoolingPlan:
    """The plan of a checkpoint folder for `task`, from its config files alone."""
    if task == "classify":
        config = load_config(model_dir)
        if checkpoint_task(model_dir) != "classify":
            names = ", ".join(getattr(config, "architectures", None) or ["none named"])
            raise BadInput(
                f"{where}: key `task`: classify needs a sequence-classification checkpoint (its config's "
                f"architectures: {names})"
            )
        for f in dataclasses.fields(PoolerConfig):  # the checkpoint's head decides all but the longest text
            if f.name != "truncate_prompt_tokens" and getattr(options, f.name) is not None:
                raise BadInput(f"{where}: key `pooler.{f.name}` does not apply to task classify")
        labels = len(config.id2label)
        return PoolingPlan((), True, (), False, None, "", options.truncate_prompt_tokens, labels, "")
    try:
        sentence = read_sentence_config(model_dir)
    except SentenceConfigError as e:
        raise SentenceConfigError(f"{where}: key `model.path`: {e}") from None
    config = load_config(model_dir / sentence.transformer_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return resolve(sentence, text.hidden_size, options, where)


def task_columns(spec: JobSpec) -> dict[str, pa.DataType]:
    """The Arrow types of a pooling job's own output columns (sinks.output_schema)."""
    model_dir = resolve_model_dir(spec.model.path, spec.source_file)
    plan = plan_for(model_dir, spec.pooler, spec.source_file, spec.task)
    if spec.task == "classify":
        return {"label": pa.string(), "probs": pa.list_(pa.float32(), plan.output_dim)}
    return {"embedding": pa.list_(pa.float32(), plan.output_dim)}


def load_runner(
    model: ModelSpec,
    engine: EngineConfig,
    pooler: PoolerConfig,
    source: str,
    placement: Placement | None = None,
    task: str | None = None,
):
    """The pooling runner of a job's (or LLM(runner="pooling")'s) model, engine and pooler settings; `task`
    None: as the checkpoint is (checkpoint_task)."""
    from .engine.classifier import ClassifierRunner
    from .engine.pooling import PoolingRunner

    placement = placement or place(engine.device, model.dtype)
    model_dir = resolve_model_dir(model.path, source)
    task = task or checkpoint_task(model_dir)
    runner = ClassifierRunner if task == "classify" else PoolingRunner
    return runner(
        model_dir,
        plan_for(model_dir, pooler, source, task),
        placement.dtype,
        placement.device,
        engine.max_num_batched_tokens,
        engine.max_num_seqs,
        engine.pack_weights,
    )


def text_of(prompt) -> str:
    """A row's text to pool; ValueError for one that is not a non-empty string."""
    if prompt is None:
        raise ValueError("text is null")
    if not isinstance(prompt, str):
        raise ValueError(f"text is not a string (got {type(prompt).__name__}); an embedding job takes texts")
    if not prompt.strip():
        raise ValueError("text is empty")
    return prompt


class PoolingWorker:
    """Rows in, output rows out, on one pooling runner (loop.Worker): a job's (worker.load_worker) and
    LLM.embed's."""

    def __init__(self, runner, stats: PoolingStats, window: int):
        """`window`: how many texts to keep queued (worker.row_window)."""
        self.runner = runner
        self.stats = stats
        self.window = window

    @property
    def wants_rows(self) -> bool:
        return self.runner.num_waiting < self.window

    @property
    def has_work(self) -> bool:
        return self.runner.has_unfinished()

    def feed(self, row: InputRow) -> list[OutputRow] | None:
        """Queue a row's text; returns its error row at once when it cannot be pooled."""
        try:
            if row.error:
                raise ValueError(row.error)
            ids, truncated = self.runner.encode(text_of(row.prompt))
        except ValueError as e:
            return [OutputRow(row.id, 0, None, None, str(e), 0, 0, 0, row=row)]
        self.runner.add(ids, row, truncated)
        return None

    def step(self) -> list[list[OutputRow]]:
        result = self.runner.step()
        self.stats.record(result)
        return [[self._row(text, vector)] for text, vector in result.finished]

    def _row(self, text, vector) -> OutputRow:
        """A finished text's output row: id, sample 0, no error, its tokens, its task's columns."""
        row = text.request
        return OutputRow(
            row.id, 0, None, None, None, len(text.token_ids), 0, 0,
            prompt_token_ids=text.token_ids, row=row, **self.runner.result(vector),
        )  # fmt: skip

    def status_line(self) -> str:
        rate = self.stats.rows / max(time.perf_counter() - self.stats.start, 1e-9)
        return f"{rate:.1f} texts/s, waiting {self.runner.num_waiting}"

    def rows_in_flight_done(self) -> float:
        """A text is pooled in the step that computes it: no row is part done between steps."""
        return 0.0

    def check_integrity(self) -> None:
        """Nothing to check: a pooling runner keeps nothing of a text after its step."""
