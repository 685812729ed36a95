"""The engine side of a pooling job (task: embed, classify, score, reward): rows in, one output row each out, on
one pooling runner (engine/pooling/runner.py, engine/pooling/classifier.py). It is worker.py's `RowWorker` for generation, in the
same loop (loop.drive), job, replicas, part files and resume: a row's input is tokenized as its task takes it
(`PoolingWorker.tokens_of`: a text as sentence-transformers or transformers do, a pair as the tokenizer makes a
pair, a conversation through the chat template; a bad row becomes its error row at once), queued, and comes back
with its result when its step is done."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchrun.engine.config import EngineConfig
from batchrun.engine.pooling.pooler import PoolerConfig, PoolingPlan, prompt_of, resolve
from batchrun.engine.pooling.sentence_config import (
    SentenceConfigError,
    read_cross_encoder_config,
    read_sentence_config,
)

from .config import JobSpec, ModelSpec
from .errors import BadInput
from .host import Placement, available_ram, place, warn_slow_dtype
from .model_loader import ModelFolder, load_config, open_model
from .rows import InputRow, OutputRow, check_conversation
from .stats import PoolingStats
from .vocabulary import embedding_rows, token_id_error


@dataclasses.dataclass(frozen=True)
class PoolingCheckpoint:
    """A pooling checkpoint as a job reads it, once, in one direction (read_checkpoint): its folder, its task,
    the plan of that task, and the transformers config of its model's folder, which the runner loads the model
    from. A job reads it when it checks the job (job.check_job) and hands it on to its output columns, its
    runner and its fp32 sample's runner."""

    model_dir: Path
    task: str
    plan: PoolingPlan
    config: Any


def task_of(config) -> str:
    """What a pooling checkpoint does, by its config: classify (a `*ForSequenceClassification` architecture) or
    embed."""
    architectures = getattr(config, "architectures", None) or []
    return "classify" if any(a.endswith("ForSequenceClassification") for a in architectures) else "embed"


def check_head(model_dir: Path, config, task: str, where: str, api: bool = False) -> None:
    """What a sequence-classification checkpoint (its transformers folder `model_dir`) can do: score and reward
    read one logit (BadInput naming `task` for a head of several labels: classify gives their probabilities, of
    pairs too), and score's activation, read as sentence-transformers' CrossEncoder reads it, must be one batchrun
    applies. `api`: the Python API asks (`where` is its method), and the refusal speaks its words."""
    from batchrun.engine.attention import UnsupportedModel
    from batchrun.engine.pooling.classifier import score_activation
    from batchrun.engine.pooling.sentence_config import cross_encoder_activation

    if task in ("score", "reward") and config.num_labels != 1:
        labels = (
            f"this checkpoint's has {config.num_labels} ({', '.join(map(str, config.id2label.values()))})"
        )
        what = "a cross-encoder's" if task == "score" else "a reward model's"
        if api:
            raise BadInput(
                f"{where} reads a head of one label ({what}), and {labels}; LLM.classify gives its labels' "
                "probabilities per text (per pair: a job's task classify with input.pair_column)"
            )
        if task == "score":
            raise BadInput(
                f"{where}: key `task`: score reads a head of one label ({what}), and {labels}; for its "
                "label and probabilities per pair, use task classify with input.pair_column"
            )
        raise BadInput(
            f"{where}: key `task`: reward reads a head of one label ({what}), and {labels}; task "
            "classify gives its probabilities"
        )
    if task == "score":
        try:
            score_activation(cross_encoder_activation(model_dir, config.num_labels))
        except (UnsupportedModel, SentenceConfigError) as e:
            raise UnsupportedModel(f"{where}: key `task`: {e}") from None


PAIR_TASKS = ("classify", "score")  # the tasks that take pairs (input.pair_column), as CrossEncoder.predict


def read_checkpoint(
    model: ModelFolder, options: PoolerConfig, where: str, task: str | None = None
) -> PoolingCheckpoint:
    """A checkpoint folder's task (None: as its config says, task_of), plan and config, from the folder and
    config read once (model_loader.open_model) and its other files, each read once: a classifier's head files;
    an embedder's sentence-transformers files (and the config of its transformers model's own folder, where
    they place it in a subfolder)."""
    model_dir, config = model.path, model.config
    task = task or task_of(config)
    if task != "embed":
        return PoolingCheckpoint(model_dir, task, _head_plan(model_dir, config, options, where, task), config)
    try:
        sentence = read_sentence_config(model_dir)
    except SentenceConfigError as e:
        raise SentenceConfigError(f"{where}: key `model.path`: {e}") from None
    if sentence.transformer_path:  # the transformers model in a subfolder: its config is that folder's
        config = load_config(model_dir / sentence.transformer_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return PoolingCheckpoint(model_dir, task, resolve(sentence, text.hidden_size, options, where), config)


def _head_plan(model_dir: Path, config, options: PoolerConfig, where: str, task: str) -> PoolingPlan:
    """The plan of a sequence-classification checkpoint (`config`, read) for `task`: its own head decides."""
    if task_of(config) != "classify":
        names = ", ".join(getattr(config, "architectures", None) or ["none named"])
        raise BadInput(
            f"{where}: key `task`: {task} needs a sequence-classification checkpoint (its config's "
            f"architectures: {names})"
        )
    check_head(model_dir, config, task, where)
    # the checkpoint's head decides all but the longest text, and (classify and score) a pair's prompt
    keys = ("truncate_prompt_tokens",) + (("prompt_name",) if task in PAIR_TASKS else ())
    for f in dataclasses.fields(PoolerConfig):
        if f.name not in keys and getattr(options, f.name) is not None:
            raise BadInput(f"{where}: key `pooler.{f.name}` does not apply to task {task}")
    labels = len(config.id2label)
    plan = PoolingPlan((), True, (), False, None, "", options.truncate_prompt_tokens, labels, "")
    if task not in PAIR_TASKS:
        return plan
    try:  # a pair is scored as CrossEncoder.predict scores it, from the rest of a folder CrossEncoder saved
        saved = read_cross_encoder_config(model_dir)
    except SentenceConfigError as e:
        raise SentenceConfigError(f"{where}: key `model.path`: {e}") from None
    return dataclasses.replace(
        plan,
        pair_prompt=prompt_of(saved, options.prompt_name, where),
        pair_max_length=options.truncate_prompt_tokens or saved.max_seq_length,
    )


def open_checkpoint(spec: JobSpec) -> PoolingCheckpoint:
    """A pooling job's checkpoint: its folder found and config read (open_model), then its other files."""
    return read_checkpoint(
        open_model(spec.model.path, spec.source_file), spec.pooler, spec.source_file, spec.task
    )


def task_columns(spec: JobSpec, checkpoint: PoolingCheckpoint) -> dict[str, pa.DataType]:
    """The Arrow types of a pooling job's own output columns (sinks.output_schema)."""
    plan = checkpoint.plan
    if spec.task == "classify":
        return {"label": pa.string(), "probs": pa.list_(pa.float32(), plan.output_dim)}
    if spec.task in ("score", "reward"):
        return {"score": pa.float32()}
    element = pa.float16() if spec.output.embedding_dtype == "float16" else pa.float32()
    return {"embedding": pa.list_(element, plan.output_dim)}


def load_runner(
    model: ModelSpec,
    engine: EngineConfig,
    pooler: PoolerConfig,
    source: str,
    placement: Placement | None = None,
    task: str | None = None,
    checkpoint: PoolingCheckpoint | None = None,
):
    """The pooling runner of a job's (or LLM(runner="pooling")'s) model, engine and pooler settings; `task`
    None: as the checkpoint is (task_of). `checkpoint`: the one the job read when it was checked; None (the
    Python API, a replica's process): the folder and its config are found and read here, once (open_model), the
    checkpoint's other files once (read_checkpoint). The runner loads the model from what was read."""
    from batchrun.engine.pooling.classifier import ClassifierRunner
    from batchrun.engine.pooling.runner import PoolingRunner

    placement = placement or place(engine.device, model.dtype)
    warn_slow_dtype(placement)
    if checkpoint is None:
        checkpoint = read_checkpoint(open_model(model.path, source), pooler, source, task)
    runner = PoolingRunner if checkpoint.task == "embed" else ClassifierRunner
    return runner(
        checkpoint.model_dir,
        checkpoint.plan,
        checkpoint.config,
        placement.dtype,
        placement.device,
        engine.max_num_batched_tokens,
        engine.max_num_seqs,
        engine.pack_weights,
    )


def fp32_sample_of(spec: JobSpec, runner, checkpoint: PoolingCheckpoint):
    """A bf16/fp16 job's fp32_sample.Fp32Sample: its first texts pooled again by the checkpoint (as the job
    read it) loaded in fp32 on the job's device, with the job's pooling (None for an fp32 job)."""
    import torch

    from .fp32_sample import Fp32Sample

    if runner.dtype == torch.float32:
        return None
    model = dataclasses.replace(spec.model, dtype="float32")
    placement = Placement(runner.device, torch.float32)
    weights = [*runner.model.parameters(), *runner.model.buffers()]
    return Fp32Sample(
        lambda: load_runner(
            model, spec.engine, spec.pooler, spec.source_file, placement, spec.task, checkpoint
        ),
        spec.task,
        room=lambda: fp32_room(4 * sum(t.numel() for t in weights), runner.device),
    )


def fp32_room(need: int, device) -> str | None:
    """Why `need` bytes of fp32 weights (with a quarter more for the load's own buffers) would not fit beside the
    job on `device` (None: they fit). Asked before the load: on the CPU, memory past MemAvailable is not an error
    Python could catch but the OOM killer ending the job."""
    import torch

    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_ram()
    if need * 5 // 4 <= free:
        return None
    return (
        f"the checkpoint in fp32 did not fit in memory beside the job's: it needs about {need / 2**30:.2f} GiB "
        f"and {free / 2**30:.2f} GiB are free, so it was not loaded"
    )


def text_of(value, what: str = "text") -> str:
    """A row's text to pool; ValueError for one that is not a string (`what`: what the text is called in the
    error, the job's column). An empty or blank text is a text: sentence-transformers and transformers tokenize it
    to the tokenizer's special tokens alone, and so does batchrun (one with no tokens at all is the row's error)."""
    if value is None:
        raise ValueError(f"{what} is null")
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string (got {type(value).__name__})")
    return value


class PoolingWorker:
    """Rows in, output rows out, on one pooling runner (loop.Worker): a job's (worker.load_worker) and
    LLM.embed's, LLM.classify's, LLM.score's and LLM.reward's."""

    def __init__(
        self, runner, stats: PoolingStats, window: int, task: str, names: tuple[str, str | None] | None = None
    ):
        """`window`: how many texts to keep queued (worker.row_window); `task`: one of the runner's tasks;
        `names`: what a row's text and its pair's second text are called in its errors (a job's columns; None:
        "text", and "pair" for task score, as LLM.score takes them). A pair name makes classify take pairs."""
        self.runner = runner
        self.stats = stats
        self.window = window
        self.task = task
        self.text_name, self.pair_name = names or ("text", "pair" if task == "score" else None)
        self.embedding_rows = embedding_rows(runner.model)  # a text's token ids must be below it

    def tokens_of(self, row: InputRow):
        """A row's input as its task takes it (ValueError: the row's error): a reward row's conversation through
        the chat template, its last reply included; a pair as the tokenizer makes a pair (score, and classify of
        pairs); else a text as sentence-transformers (embed) or transformers (classify, reward) tokenize it."""
        if self.task == "reward" and isinstance(row.prompt, list | tuple):
            return self.runner.encode_conversation(check_conversation(row.prompt, reply=True))
        text = text_of(row.prompt, self.text_name)
        if self.pair_name is not None:
            return self.runner.encode_pair(text, text_of(row.pair, self.pair_name))
        return self.runner.encode(text)

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
            text = self.tokens_of(row)
            reason = token_id_error(text.token_ids, self.embedding_rows)  # its tokenizer's ids, checked
            if reason:
                raise ValueError(reason)
        except ValueError as e:
            return [OutputRow(row.id, 0, None, None, str(e), 0, 0, 0, row=row)]
        self.runner.add(text, row)
        return None

    def step(self) -> list[list[OutputRow]]:
        result = self.runner.step()
        self.stats.record(result)
        if self.stats.sample is not None:  # a bf16/fp16 job's first texts pooled again in fp32
            self.stats.sample.take(result.finished)
        return [[self._row(text, vector)] for text, vector in result.finished]

    def _row(self, text, vector) -> OutputRow:
        """A finished text's output row: id, sample 0, no error, its tokens, its task's columns."""
        row = text.request
        return OutputRow(
            row.id, 0, None, None, None, len(text.token_ids), 0, 0,
            prompt_token_ids=text.token_ids, row=row, **self.runner.result(vector, self.task),
        )  # fmt: skip

    def status_line(self) -> str:
        rate = self.stats.rows / max(time.perf_counter() - self.stats.start, 1e-9)
        return f"{rate:.1f} texts/s, waiting {self.runner.num_waiting}"

    def rows_in_flight_done(self) -> float:
        """A text is pooled in the step that computes it: no row is part done between steps."""
        return 0.0

    def check_integrity(self) -> None:
        """Nothing to check: a pooling runner keeps nothing of a text after its step."""
