"""Streaming the input table: Parquet (a file, a directory or a glob) or a Hugging Face dataset; Parquet and
OpenAI batch files on this machine or behind any fsspec URL (s3://, gs://, hf://: storage.py).

Rows are read in record batches and yielded one at a time; nothing holds the whole table. A shard I/N takes
the rows whose index (position in the whole input, counted from 0) is I modulo N: deterministic, disjoint,
and the union over I is every row, without reading anything ahead.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from . import openai_batch, storage
from .config import InputSpec, JobSpec, ModelSpec
from .errors import BadInput
from .rows import InputRow, Shard, clashing_columns, content_hash, is_token_ids

BATCH_ROWS = 1024


class InputSource:
    """Opens the input once to check it; `rows()` streams it."""

    def __init__(self, spec: InputSpec, source: str = "<job>"):
        self.spec = spec
        self.source = source
        if spec.parquet is not None:
            self.files = _parquet_files(spec.parquet, source)
            try:
                self.schema = storage.parquet_file(self.files[0]).schema_arrow
            except Exception as e:
                raise BadInput(
                    f"{source}: key `input.parquet`: cannot read {self.files[0]} as Parquet ({e})."
                ) from None
            self._dataset = None
        else:
            self.files = []
            self._dataset = _open_dataset(spec, source)
            self.schema = _dataset_schema(self._dataset)
        self._check_columns()

    def _check_columns(self) -> None:
        names = set(self.schema.names)
        what = self.describe()
        wanted = [("input.prompt_column", self.spec.prompt_column)]
        if self.spec.id_column:
            wanted.append(("input.id_column", self.spec.id_column))
        if self.spec.image_column:
            wanted.append(("input.image_column", self.spec.image_column))
        if self.spec.pair_column:
            wanted.append(("input.pair_column", self.spec.pair_column))
        if self.spec.adapter_column:
            wanted.append(("input.adapter_column", self.spec.adapter_column))
        wanted += [(f"input.passthrough[{i}]", c) for i, c in enumerate(self.spec.passthrough)]
        wanted += [(f"input.sampling_columns.{k}", c) for k, c in self.spec.sampling_columns.items()]
        for key, col in wanted:
            if col not in names:
                raise BadInput(
                    f"{self.source}: key `{key}`: column {col!r} is not in {what}; "
                    f"its columns are: {', '.join(sorted(names))}."
                )
        kind = self.schema.field(self.spec.prompt_column).type
        if not _holds_prompts(kind):
            raise BadInput(
                f"{self.source}: key `input.prompt_column`: column {self.spec.prompt_column!r} of {what} holds "
                f"{kind}; expected strings, conversations (lists of {{role, content}} strings), or token ids (lists "
                "of integers)."
            )
        for i, col in enumerate(self.spec.passthrough):
            if clashing_columns([col], self.spec.id_column):
                raise BadInput(
                    f"{self.source}: key `input.passthrough[{i}]`: column {col!r} clashes with an output "
                    f"column of the same name; rename it in the input."
                )

    def describe(self) -> str:
        return (
            f"input.parquet {self.spec.parquet}" if self.spec.parquet else f"dataset {self.spec.dataset.path}"
        )

    @property
    def id_type(self) -> pa.DataType:
        return self.schema.field(self.spec.id_column).type if self.spec.id_column else pa.int64()

    def passthrough_fields(self) -> list[pa.Field]:
        return [self.schema.field(c) for c in self.spec.passthrough]

    def num_rows(self) -> int | None:
        """Rows in the whole input (before limit and shard), from metadata only; None when unknown."""
        if self.files:
            return sum(storage.parquet_file(f).metadata.num_rows for f in self.files)
        try:
            return len(self._dataset)
        except TypeError:
            return None

    def rows(self, shard: Shard = Shard(), limit: int | None = None) -> Iterator[InputRow]:
        """Rows of this shard among the first `limit` rows of the input, in input order."""
        spec = self.spec
        columns = [spec.prompt_column] + ([spec.id_column] if spec.id_column else [])
        extra = [*spec.passthrough, *spec.sampling_columns.values()]
        extra += [c for c in (spec.image_column, spec.pair_column, spec.adapter_column) if c]
        columns += [c for c in extra if c not in columns]
        index = 0
        for batch in self._batches(columns):
            data = batch.to_pydict() if isinstance(batch, pa.RecordBatch) else batch
            for j in range(len(data[spec.prompt_column])):
                if limit is not None and index >= limit:
                    return
                if shard.owns(index):
                    yield input_row(spec, data, j, index)
                index += 1

    def check_unique_ids(self, limit: int | None = None) -> None:
        """Ids must be unique: outputs and resume are keyed on (id, sample). Reads the id column only."""
        if not self.spec.id_column:
            return
        dup = first_duplicate(self.ids(limit))
        if dup:
            raise BadInput(
                f"{self.source}: key `input.id_column`: id {dup[1]!r} appears more than once (row "
                f"{dup[0]}); ids must be unique, since outputs and resume are keyed on (id, sample)."
            )

    def ids(self, limit: int | None = None) -> Iterator[Any]:
        """The id column alone, in input order (for the duplicate check)."""
        index = 0
        for batch in self._batches([self.spec.id_column]):
            data = batch.to_pydict() if isinstance(batch, pa.RecordBatch) else batch
            for value in data[self.spec.id_column]:
                if limit is not None and index >= limit:
                    return
                yield value
                index += 1

    def _batches(self, columns: list[str]):
        if self.files:
            for f in self.files:
                try:
                    batches = storage.parquet_file(f).iter_batches(batch_size=BATCH_ROWS, columns=columns)
                    yield from batches
                except (OSError, pa.ArrowException) as e:
                    raise BadInput(f"{self.source}: key `input.parquet`: cannot read {f} ({e}).") from None
        else:
            yield from self._dataset.select_columns(columns).iter(batch_size=BATCH_ROWS)


class OpenAIBatchSource:
    """OpenAI Batch API input files (JSONL), streamed a line at a time; blank lines are skipped and a row's
    index counts the other lines across the files in order. A line that cannot be served is a row whose
    `error` says why (it becomes an error line in the output)."""

    id_type = pa.string()

    def __init__(
        self, spec: InputSpec, source: str = "<job>", task: str = "generate", model: ModelSpec | None = None
    ):
        self.spec = spec
        self.source = source
        self.task = task  # which urls its lines may ask for (openai_batch.SERVED_URLS)
        self.model = model or ModelSpec()  # the base model and adapters a line's body.model may name
        self.files = _matching_files(spec.openai_batch, "input.openai_batch", "JSONL", source, "*.jsonl")

    def passthrough_fields(self) -> list[pa.Field]:
        return []

    def describe(self) -> str:
        return f"input.openai_batch {self.spec.openai_batch}"

    def _lines(self) -> Iterator[tuple[Path, int, str]]:
        """(file, 1-based line number, text) of every non-blank line."""
        for f in self.files:
            try:
                with f.open("r", encoding="utf-8") as fh:
                    for number, text in enumerate(fh, 1):
                        if text.strip():
                            yield f, number, text
            except (OSError, UnicodeDecodeError) as e:
                raise BadInput(f"{self.source}: key `input.openai_batch`: cannot read {f} ({e}).") from None

    def num_rows(self) -> int:
        return sum(1 for _ in self._lines())

    def rows(self, shard: Shard = Shard(), limit: int | None = None) -> Iterator[InputRow]:
        for index, (f, number, text) in enumerate(self._lines()):
            if limit is not None and index >= limit:
                return
            if not shard.owns(index):
                continue
            row_id, request = openai_batch.parse_line(text, index, self.task)
            request["line"] = f"{f.name} line {number}"  # where the request is, for its errors
            error = request.get("error") or self._model_error(request)
            yield InputRow(
                index=index,
                id=row_id,
                prompt=request.get("prompt"),
                sampling=request.get("sampling", {}),
                request=request,  # with its error, when it has one: the output line needs its custom_id
                error=f"{request['line']}: {error}" if error else None,
                input_hash=content_hash(text.strip()),
            )

    def _model_error(self, request: dict) -> str | None:
        """Why a request's body.model cannot be served: it names neither the base model nor an adapter (vLLM's
        server answers such a request 404); never answered by the base model under another name."""
        try:
            self.model.adapter_named(request.get("model"), "body.model")
        except ValueError as e:
            return str(e)
        return None

    def ids(self, limit: int | None = None) -> Iterator[Any]:
        for row in self.rows(Shard(), limit):
            yield row.id

    def check_unique_ids(self, limit: int | None = None) -> None:
        dup = first_duplicate(self.ids(limit))
        if dup:
            raise BadInput(
                f"{self.source}: key `input.openai_batch`: custom_id {dup[1]!r} appears more than once (row "
                f"{dup[0]}); custom ids must be unique, since outputs and resume are keyed on them."
            )


def input_row(spec: InputSpec, data: dict[str, list], j: int, index: int) -> InputRow:
    """Row `j` of a batch of columns (`data`, as pyarrow's to_pydict gives them) as an InputRow: its prompt, id,
    passthrough and sampling cells as the job's input section names them; `index`: its place in the input."""
    prompt, error = data[spec.prompt_column][j], None
    if spec.image_column:
        try:
            prompt = with_image(prompt, data[spec.image_column][j])
        except ValueError as e:
            error = str(e)
    passthrough = {c: data[c][j] for c in spec.passthrough}
    sampling = {k: data[c][j] for k, c in spec.sampling_columns.items() if data[c][j] is not None}
    pair = data[spec.pair_column][j] if spec.pair_column else None
    cells = (prompt, pair, sampling, passthrough) if spec.pair_column else (prompt, sampling, passthrough)
    adapter = data[spec.adapter_column][j] if spec.adapter_column else None
    if spec.adapter_column:  # the adapter makes the row's output (a job without the column hashes as before)
        cells += (adapter,)
    return InputRow(
        index=index,
        id=data[spec.id_column][j] if spec.id_column else index,
        prompt=prompt,
        passthrough=passthrough,
        sampling=sampling,
        error=error,
        input_hash=content_hash(*cells),
        pair=pair,
        adapter=adapter,
    )


def with_image(prompt: Any, image: Any) -> Any:
    """A row's prompt with its image column's cell put before its text (`input.image_column`): a string
    becomes a user turn of an image part and a text part; a conversation gets the image part first in its first
    user turn. A null image leaves the prompt as it is; a prompt of another kind too (its row's error says
    why). ValueError for token ids: the processor places an image's tokens in text, not in ids."""
    if image is None:
        return prompt
    if is_token_ids(prompt):
        raise ValueError(
            "an image (input.image_column) with a prompt of token ids: the model's processor places an image's "
            "tokens in text, so give this row's prompt as text or a conversation"
        )
    part = {"type": "image", "image": image}
    if isinstance(prompt, str):
        return [{"role": "user", "content": [part, {"type": "text", "text": prompt}]}]
    if isinstance(prompt, list) and all(isinstance(t, dict) for t in prompt):
        turns = [dict(t) for t in prompt]
        for turn in turns:
            if turn.get("role") == "user":
                content = turn.get("content")
                text = (
                    [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
                )
                turn["content"] = [part, *text]
                break
        return turns
    return prompt


def _holds_prompts(kind: pa.DataType) -> bool:
    """Whether a column of this Arrow type can hold prompts: text, lists of {role, content} turns, or lists of
    integers (token ids, pre-tokenized: no chat template); a column of nulls too (its rows become error rows)."""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind):
        return True
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        item = kind.value_type
        if pa.types.is_integer(item):
            return True
        return pa.types.is_struct(item) and {"role", "content"} <= {
            item.field(i).name for i in range(item.num_fields)
        }
    return False


def first_duplicate(ids: Iterator[Any]) -> tuple[int, Any] | None:
    """(position, id) of the first id seen twice, or None."""
    seen: set = set()
    for index, row_id in enumerate(ids):
        if row_id in seen:
            return index, row_id
        seen.add(row_id)
    return None


def open_source(job: JobSpec) -> InputSource | OpenAIBatchSource:
    """The job's input, opened and checked (an OpenAI batch line is served as the job's task and model are)."""
    if job.input.openai_batch is not None:
        return OpenAIBatchSource(job.input, job.source_file, job.task, job.model)
    return InputSource(job.input, job.source_file)


def _matching_files(pattern: str, key: str, kind: str, source: str, suffix_glob: str) -> list[Path]:
    """The files a pattern names: a file, every `suffix_glob` file under a directory, or a glob's files."""
    if storage.is_url(pattern):
        where = storage.location(pattern, f"{source}: key `{key}`")
        try:
            files = _matching_objects(where, suffix_glob)
        except Exception as e:  # noqa: BLE001 - refused, unreachable (offline), no credentials: the store's client
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise BadInput(
                f"{source}: key `{key}`: cannot list {pattern} ({type(e).__name__}: {msg}); check the store's "
                f"credentials and endpoint (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...)."
            ) from None
    else:
        p = Path(pattern).expanduser()
        if p.is_dir():
            files = sorted(f for f in p.rglob(suffix_glob) if not f.name.startswith("."))
        elif p.is_file():
            files = [p]
        else:
            matches = glob.glob(os.path.expanduser(pattern), recursive=True)
            files = sorted(Path(f) for f in matches if os.path.isfile(f))
    if not files:
        missing = _missing_bucket(where) if storage.is_url(pattern) else None
        if missing:
            raise BadInput(f"{source}: key `{key}`: {pattern!r}: {missing}.")
        raise BadInput(
            f"{source}: key `{key}`: no {kind} files match {pattern!r} "
            f"(expected a file, a directory of {suffix_glob} files, or a glob)."
        )
    return files


def _missing_bucket(p: Path) -> str | None:
    """Why nothing matched, when it is the bucket (container) itself that is not there."""
    bucket = storage.fresh(p).path.split("/", 1)[0]
    try:
        exists = p.fs.exists(bucket)
    except Exception:  # noqa: BLE001 - the listing already answered; this is only a better message
        return None
    return (
        None
        if exists
        else f"the bucket {bucket!r} does not exist on this store (or these credentials see none)"
    )


def _matching_objects(p: Path, suffix_glob: str) -> list[Path]:
    """`_matching_files` behind a URL: the same three readings, on the store's own listing."""
    fs, where = p.fs, storage.fresh(p).path
    if fs.isdir(where):
        found = [f for f in fs.find(where) if fnmatch.fnmatch(posixpath.basename(f), suffix_glob)]
    elif fs.isfile(where):
        found = [where]
    else:
        found = [f for f in fs.glob(where) if fs.isfile(f)]
    found = sorted(f for f in found if not posixpath.basename(f).startswith("."))
    return [p.with_segments(fs.unstrip_protocol(f)) for f in found]


def _parquet_files(pattern: str, source: str) -> list[Path]:
    return _matching_files(pattern, "input.parquet", "Parquet", source, "*.parquet")


def _open_dataset(spec: InputSpec, source: str):
    """A save_to_disk directory, local data files through load_dataset, or a dataset in the local cache."""
    ds = spec.dataset
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # never reach for the network
    import datasets

    path = Path(ds.path).expanduser()
    try:
        if path.is_dir() and (
            (path / "dataset_info.json").exists()
            or (path / "dataset_dict.json").exists()
            or (path / "state.json").exists()
        ):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if ds.split not in loaded:
                    raise BadInput(
                        f"{source}: key `input.dataset.split`: {ds.split!r} is not a split of "
                        f"{path}; splits: {', '.join(loaded)}."
                    )
                loaded = loaded[ds.split]
            return loaded
        return datasets.load_dataset(
            ds.path, name=ds.name, split=ds.split, data_dir=ds.data_dir, streaming=True
        )
    except BadInput:
        raise
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadInput(
            f"{source}: key `input.dataset`: cannot open dataset {ds.path!r} (split {ds.split!r}) "
            f"locally: {msg}"
        ) from None


def _dataset_schema(dataset) -> pa.Schema:
    features = dataset.features
    if features is None:  # a streaming dataset whose features are only known after a first row
        first = next(iter(dataset), None)
        if first is None:
            return pa.schema([])
        return pa.Table.from_pylist([first]).schema
    return features.arrow_schema
