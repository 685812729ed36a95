"""The rows a job moves: an input row as read (`InputRow`), the shard that owns it, an output row
(`OutputRow`, whose typed fields are the output columns: the one list of them), and what every layer asks of a
row alike: a conversation's checked turns and a sample's generator seed. Sources read rows into these, sinks
write them out, the worker and the Python API turn them into engine requests."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .errors import BadInput

if TYPE_CHECKING:
    from .config import JobSpec

# the Parquet metadata key of the job's fingerprint (sinks.fingerprint) in part files and statistics files
FINGERPRINT_KEY = b"batchrun.fingerprint"


@dataclass
class InputRow:
    index: int  # position in the whole input
    id: Any
    prompt: Any  # a string or a conversation, not yet checked: a bad prompt becomes an error row, not a crash
    passthrough: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)  # this row's own sampling values (not yet checked)
    request: dict | None = None  # an OpenAI batch request: custom_id, endpoint (chat | completion), model
    error: str | None = None  # why the row cannot be served, known from reading it
    input_hash: str | None = None  # what its output is made from (content_hash); its output records it
    pair: Any = None  # task score: the pair's second text (input.pair_column), not yet checked
    adapter: Any = None  # its LoRA adapter's name (input.adapter_column), not yet checked; None: the job's


def row_adapter(row: InputRow, job: JobSpec) -> str | None:
    """The LoRA adapter a row runs with (None: the base model), from the name it asks by: an OpenAI request's
    body `model`, else its adapter column's cell (config.ModelSpec.adapter_named). ValueError naming the request's
    line or the column for a name that is neither an adapter nor the base model."""
    if row.request is not None:
        name, where = row.request.get("model"), f"{row.request.get('line', 'request')}: body.model"
    else:
        name, where = row.adapter, f"column {job.input.adapter_column!r}"
    return job.model.adapter_named(name, where)


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'I/N' -> Shard(I, N); BadInput unless 0 <= I < N."""
        try:
            i, n = (int(x) for x in text.split("/"))
        except ValueError:
            i, n = 0, 0
        if not 0 <= i < n:
            raise BadInput(f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. --shard 0/4.")
        return cls(i, n)

    def owns(self, row_index: int) -> bool:
        return row_index % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def _column(arrow_type: pa.DataType | None, task: str | None = None):
    """An output column of every job (`task` None), or of jobs of one task only."""
    return field(metadata={"arrow": arrow_type, "tasks": (task,) if task else None})


def _optional_column(arrow_type: pa.DataType):
    return field(default=None, metadata={"arrow": arrow_type, "optional": True, "tasks": ("generate",)})


def _task_column(*tasks: str):
    """A pooling task's result column; its Arrow type is the job's (an embedding's length is the model's)."""
    return field(default=None, metadata={"arrow": None, "tasks": tasks})


_TOP = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())])
LOGPROBS_TYPE = pa.list_(
    pa.struct(
        [("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32()), ("top", pa.list_(_TOP))]
    )
)


@dataclass
class OutputRow:
    """One output row (a sample of an input row): its fields with an Arrow type are the output columns, in
    order (the one list of them); the optional ones are columns only when the job asks for them, and those of a
    task (metadata `tasks`) only in that task's jobs (a pooling job writes id, sample 0, error, prompt_tokens
    and its result)."""

    id: Any = _column(None)  # the input's id type
    sample: int = _column(pa.int32())
    completion: str | None = _column(pa.string(), "generate")
    finish_reason: str = _column(pa.string(), "generate")
    error: str | None = _column(pa.string())
    prompt_tokens: int = _column(pa.int32())
    completion_tokens: int = _column(pa.int32(), "generate")
    num_preemptions: int = _column(pa.int32(), "generate")
    logprobs: list[dict] | None = _optional_column(LOGPROBS_TYPE)
    prompt_logprobs: list[float | None] | None = _optional_column(pa.list_(pa.float32()))
    prompt_token_ids: list[int] | None = _optional_column(pa.list_(pa.int32()))
    completion_token_ids: list[int] | None = _optional_column(pa.list_(pa.int32()))
    embedding: list[float] | None = _task_column("embed")  # fixed_size_list<float32>[the vector's length]
    label: str | None = _task_column("classify")  # id2label of the most likely class
    probs: list[float] | None = _task_column("classify")  # fixed_size_list<float32>[the classes]
    score: float | None = _task_column("score", "reward")  # a pair's relevance, a reward model's reward
    row: InputRow | None = None  # the input row: passthrough columns, the OpenAI request


OUTPUT_COLUMNS = [f.name for f in fields(OutputRow) if "arrow" in f.metadata]
OPTIONAL_COLUMNS = [f.name for f in fields(OutputRow) if f.metadata.get("optional")]


def clashing_columns(columns, id_column: str | None) -> list[str]:
    """Input columns that would come out beside an output column of the same name (the id column is the
    output's `id`): refused by `submit` (passthrough) and by the Ray Data processor alike."""
    return [c for c in columns if c in OUTPUT_COLUMNS and c != id_column]


ROLES = ("system", "user", "assistant")


IMAGE_PART_TYPES = ("image_url", "image", "input_image", "image_pil")  # image_pil: vLLM's, a PIL image


def _parts(parts, turn: int, role: str, images: bool) -> str | list[dict]:
    """OpenAI's content parts of a turn. For a text model, one string: the text parts joined by newlines (as
    vLLM does), and an image part is this row's error. For a model that takes images (`images`), the parts in
    the chat template's form: {type: text, text} and {type: image, image: its source (images.load_image)}.
    Fields a Parquet struct gives every part (`image_url: null` beside a text part) are ignored when null."""
    texts, normalized = [], []
    for j, part in enumerate(parts, 1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            normalized.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PART_TYPES:
            if not images:
                raise ValueError(
                    f"conversation turn {turn} ({role}), content part {j}: an image, and this model takes "
                    "no images (a text model)"
                )
            source = part.get(kind)
            if isinstance(source, dict) and "url" in source:  # {"image_url": {"url": ...}}
                source = source["url"]
            if source is None:
                raise ValueError(
                    f"conversation turn {turn} ({role}), content part {j}: an image part without one"
                )
            normalized.append({"type": "image", "image": source})
        else:
            raise ValueError(
                f"conversation turn {turn} ({role}), content part {j}: expected {{type: text, text: ...}}"
                + (" or {type: image_url, image_url: {url: ...}}" if images else "")
            )
    if images and any(p["type"] == "image" for p in normalized):
        return normalized
    return "\n".join(texts)


def check_conversation(messages: Any, images: bool = False, reply: bool = False) -> list[dict[str, Any]]:
    """A conversation as the chat template takes it; ValueError saying what is wrong with a malformed one.
    `images`: the model takes images, so a turn with image parts keeps them (as a list of parts). `reply`: the
    conversation may end with the assistant's reply (a reward model judges it) rather than wait for one."""
    if not isinstance(messages, list | tuple):
        raise ValueError(f"conversation is not a list of turns (got {type(messages).__name__})")
    turns = []
    for i, turn in enumerate(messages, 1):
        if not isinstance(turn, dict):
            raise ValueError(f"conversation turn {i} is not a {{role, content}} mapping")
        role, content = turn.get("role"), turn.get("content")
        if role is None:
            raise ValueError(f"conversation turn {i} has no role")
        if role not in ROLES:
            raise ValueError(f"conversation turn {i} has unknown role {role!r} (expected {', '.join(ROLES)})")
        if isinstance(content, list | tuple):  # OpenAI's content parts
            content = _parts(content, i, role, images)
        if content is None:
            raise ValueError(
                f"conversation turn {i} ({role}) has no content (a string, or a list of content parts)"
            )
        if not isinstance(content, str | list):
            raise ValueError(
                f"conversation turn {i} ({role}) has content of type {type(content).__name__} (expected a "
                "string, or a list of content parts)"
            )
        turns.append({"role": role, "content": content})
    if reply:  # a reward model judges the conversation as it is, its last reply included
        if not any(t["role"] == "user" for t in turns):
            raise ValueError(
                "conversation has no user turn (a reward model judges a conversation of one, with or without "
                "the assistant's reply)"
            )
    elif not any(t["role"] == "user" for t in turns) or turns[-1]["role"] == "assistant":
        raise ValueError(
            "conversation has nothing to answer (no user turn, or it ends with an assistant turn)"
        )
    return turns


def is_token_ids(value: Any) -> bool:
    """A prompt given as token ids: a non-empty list of integers (pre-tokenized). An empty list is no prompt
    of either kind: a job's row reads it as a conversation with nothing to answer."""
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def content_hash(*cells: Any) -> str:
    """16 hex digits identifying an input row's content (its prompt, sampling cells, passthrough values; an
    OpenAI request's whole line): a rerun compares it with the one its output recorded."""
    text = json.dumps(cells, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def row_seed(seed: int, row_id: Any, sample: int) -> int:
    """The generator seed of one sample of one row: its output depends on nothing else."""
    digest = hashlib.sha256(f"{seed}:{row_id!r}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def row_samples(row: InputRow, params) -> int:
    """How many output rows an input row has: its own n when it sets a valid one (an error row too); `params`:
    the job's SamplingParams (their n otherwise)."""
    n = row.sampling.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else params.n
