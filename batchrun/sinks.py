"""Completions output: part files written as rows finish, each whole (storage.write_whole: a temporary name then
a rename on a file system, one PUT on an object store), so a crash never leaves a torn file. Parquet parts (one
row per input row and sample) or OpenAI Batch output JSONL parts (one line per request, its n choices inside).
Every part records the job's fingerprint (Parquet: in its metadata; JSONL: in its name), which is how a rerun
finds the rows already done and refuses parts of a different job. The output directory holds these parts and
nothing else (statistics live in `.batchrun/`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import openai_batch, storage
from .config import JobSpec, to_dict
from .errors import BadInput
from .rows import FINGERPRINT_KEY, OUTPUT_COLUMNS, InputRow, OutputRow, Shard, row_adapter

if TYPE_CHECKING:
    from .weights import JobWeights

JOB_KEY = b"batchrun.job"
INPUT_HASHES_KEY = b"batchrun.input_hashes"  # a Parquet part's rows' input hashes, in row order (JSON list)
WEIGHTS_KEY = b"batchrun.weights"  # its rows' weights tags (weights.py), in row order (JSON list)

# keys added after the first release: left out of the fingerprint while they hold their default, so jobs
# started before them keep resuming
_LATER_KEYS = {
    ("input", "openai_batch"): None,
    ("input", "sampling_columns"): {},
    ("input", "image_column"): None,
    ("input", "pair_column"): None,
    ("input", "adapter_column"): None,
    ("model", "adapter"): None,
    ("sampling", "logprobs"): None,
    ("sampling", "prompt_logprobs"): False,
    ("sampling", "response_format"): None,
    ("output", "format"): "auto",
    ("output", "token_ids"): False,
    ("output", "embedding_dtype"): "float32",
}


def fingerprint(spec: JobSpec, shard: Shard, dtype: str | None = None, adapters: bool = False) -> str:
    """Hash of what changes the outputs: model (with `dtype`, what model.dtype resolves to here:
    model_loader.fingerprint_dtype), input (but its limit), sampling, the output's format and columns — and the
    shard count (a row's shard depends on it). Engine settings (pages, batch sizes) and the shard index do not
    change any row. Nor do `model.adapters`: each row records the weights it ran with (weights.py), so adding an
    adapter no finished row used keeps the job; `adapters=True` gives the fingerprint of the versions that
    hashed them (their parts still resume)."""
    d = to_dict(spec)
    if dtype is not None:
        d["model"]["dtype"] = dtype
    for key in ("name", "on_change") + (() if adapters and spec.model.adapters else ("adapters",)):
        d["model"].pop(key)  # the base model's name in replies, and what a rerun does with changed weights
    d["input"].pop("limit", None)  # a larger limit continues the same job
    d["input"].pop("on_change", None)  # what a rerun does with changed rows, not what a row's output is
    output = {k: d["output"][k] for k in ("format", "token_ids", "embedding_dtype")}
    keep = {"model": d["model"], "input": d["input"], "sampling": d["sampling"], "output": output}
    for (section, key), default in _LATER_KEYS.items():
        if keep[section].get(key, default) == default:
            keep[section].pop(key, None)
    if spec.task != "generate":  # a pooling job: its task and pooler settings make its rows, not sampling
        keep.update(task=spec.task, pooler=d["pooler"])
        del keep["sampling"]
    if not keep["output"]:
        del keep["output"]
    keep["shards"] = shard.count
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:32]


def optional_columns(spec: JobSpec) -> list[str]:
    """The optional columns this job writes."""
    wanted = []
    if spec.sampling.logprobs is not None or "logprobs" in spec.input.sampling_columns:
        wanted.append("logprobs")
    if spec.sampling.prompt_logprobs:
        wanted.append("prompt_logprobs")
    if spec.output.token_ids:
        wanted += ["prompt_token_ids", "completion_token_ids"]
    return wanted


def output_schema(
    id_type: pa.DataType,
    passthrough: list[pa.Field],
    optional: list[str] = (),
    task: str = "generate",
    task_types: dict[str, pa.DataType] | None = None,
) -> pa.Schema:
    """The output columns of a job of `task`; `task_types`: the Arrow types of the task's own columns (an
    embedding's length is the model's)."""
    types = {"id": id_type, **(task_types or {})}
    own = [
        pa.field(f.name, f.metadata["arrow"] or types[f.name])
        for f in fields(OutputRow)
        if "arrow" in f.metadata
        and task in (f.metadata["tasks"] or (task,))
        and (not f.metadata.get("optional") or f.name in optional)
    ]
    return pa.schema([*own, *passthrough])


# ---- part formats ------------------------------------------------------------------------------------------
@dataclass
class Done:
    """What earlier runs wrote: (id, sample) pairs (Parquet) and whole rows (JSONL: a line is a request), and
    the input hash each row's output was made from (None: written before the hashes were kept). The ids of the
    error rows are kept per shard so a resume reports the whole job's count, and a row recomputed because its
    input changed leaves it."""

    pairs: set = field(default_factory=set)
    rows: set = field(default_factory=set)
    hashes: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)  # id -> the tag of the weights its output was made with
    rows_per_shard: dict[str, int] = field(default_factory=dict)  # "I/N" (from the part's name) -> input rows
    error_ids: dict[str, set] = field(default_factory=dict)  # "I/N" -> ids of its input rows that are errors

    def has(self, row_id: Any, num_samples: int) -> bool:
        return row_id in self.rows or all((row_id, i) in self.pairs for i in range(num_samples))

    def __len__(self) -> int:
        return len(self.pairs) + len(self.rows)

    def count(self, part: Path, input_rows: int, error_ids: list) -> None:
        shard = part_shard(part)
        self.rows_per_shard[shard] = self.rows_per_shard.get(shard, 0) + input_rows
        self.error_ids.setdefault(shard, set()).update(error_ids)

    def error_rows(self, shard: str) -> int:
        """Input rows of the shard whose output is an error (every sample of such a row carries it)."""
        return len(self.error_ids.get(shard, ()))

    def forget(self, ids: set, shard: str) -> None:
        """These rows of the shard are pending again (their input or weights changed): their outputs no longer
        count as done. The parts still hold them until OutputSink.begin removes them (`removed`)."""
        self.pairs = {p for p in self.pairs if p[0] not in ids}
        self.rows -= ids
        for row_id in ids:
            self.hashes.pop(row_id, None)
            self.weights.pop(row_id, None)
        self.error_ids.get(shard, set()).difference_update(ids)

    def removed(self, shard: str, input_rows: int) -> None:
        """`input_rows` of the shard's rows were removed from its parts."""
        self.rows_per_shard[shard] = self.rows_per_shard.get(shard, 0) - input_rows


def rows_in_part(part: Path) -> int:
    """Input rows a part holds: Parquet rows of sample 0 (a row's samples are written together), JSONL lines."""
    if part.suffix == ".parquet":
        samples = storage.parquet_file(part).read(columns=["sample"]).column("sample").to_pylist()
        return sum(1 for s in samples if s == 0)
    with part.open("r", encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def part_shard(part: Path) -> str | None:
    """'I/N' of a part file, from its name (part-IIIIIofNNNNN-...); None for a name batchrun does not write
    (another tool's part-*.parquet)."""
    try:
        index, count = part.name.split("-")[1].split("of")
        return f"{int(index)}/{int(count)}"
    except (IndexError, ValueError):
        return None


class ParquetParts:
    suffix = ".parquet"

    def __init__(self, schema: pa.Schema, fp: str, job_name: str, weights: Callable[[InputRow], str | None]):
        """`weights`: a row's weights tag (weights.JobWeights.tag)."""
        self.schema = schema.with_metadata({FINGERPRINT_KEY: fp.encode(), JOB_KEY: job_name.encode()})
        self.weights = weights
        self.columns = [c for c in OUTPUT_COLUMNS if c in schema.names]
        self.passthrough = [n for n in schema.names if n not in OUTPUT_COLUMNS]

    def name_tag(self) -> str:
        return ""  # the fingerprint is in the metadata

    def write(self, f, rows: list[OutputRow]) -> None:
        cols = {name: [getattr(r, name) for r in rows] for name in self.columns}
        for name in self.passthrough:
            cols[name] = [r.row.passthrough[name] for r in rows]
        hashes = json.dumps([r.row.input_hash for r in rows]).encode()
        tags = json.dumps([self.weights(r.row) for r in rows]).encode()
        schema = self.schema.with_metadata(
            {**self.schema.metadata, INPUT_HASHES_KEY: hashes, WEIGHTS_KEY: tags}
        )
        pq.write_table(pa.table(cols, schema=schema), f)

    @staticmethod
    def read_done(part: Path, fps: tuple[str, ...], done: Done) -> str | None:
        """Adds the part's rows to `done` where it is this job's (its fingerprint one of `fps`); returns the
        part's fingerprint."""
        parquet = storage.parquet_file(part)
        meta = parquet.schema_arrow.metadata or {}
        theirs = meta.get(FINGERPRINT_KEY, b"").decode()
        if theirs in fps:
            table = parquet.read(columns=["id", "sample", "error"])
            ids, samples = table.column("id").to_pylist(), table.column("sample").to_pylist()
            hashes = json.loads(meta.get(INPUT_HASHES_KEY, b"null")) or [None] * len(ids)
            tags = json.loads(meta.get(WEIGHTS_KEY, b"null")) or [None] * len(ids)
            done.pairs.update(zip(ids, samples))
            done.hashes.update(zip(ids, hashes))
            done.weights.update(zip(ids, tags))
            errors = [i for i, e in zip(ids, table.column("error").to_pylist()) if e is not None]
            done.count(
                part, sum(1 for s in samples if s == 0), errors
            )  # a row's samples are written together
        return theirs

    @staticmethod
    def drop(part: Path, ids: set) -> int:
        """Rewrite the part without the rows of these ids (whole: storage.write_whole; removed when nothing is
        left); returns the input rows dropped."""
        pf = storage.parquet_file(part)
        meta = pf.schema_arrow.metadata or {}
        table = pf.read()
        ids_column = table.column("id").to_pylist()
        keep = [i for i, row_id in enumerate(ids_column) if row_id not in ids]
        if len(keep) == len(ids_column):
            return 0
        samples = table.column("sample").to_pylist()
        dropped = sum(1 for i, row_id in enumerate(ids_column) if row_id in ids and samples[i] == 0)
        if not keep:
            part.unlink()
            return dropped
        for key in (INPUT_HASHES_KEY, WEIGHTS_KEY):
            values = json.loads(meta.get(key, b"null"))
            if values is not None:
                meta = {**meta, key: json.dumps([values[i] for i in keep]).encode()}
        storage.write_whole(part, lambda f: pq.write_table(table.take(keep).replace_schema_metadata(meta), f))
        return dropped


class JsonlParts:
    """OpenAI Batch output lines. The fingerprint is in the part's name (a JSONL file has no metadata)."""

    suffix = ".jsonl"

    def __init__(self, fp: str, job: JobSpec, weights: Callable[[InputRow], str | None]):
        """`job`: what names the model that answered (config.ModelSpec.name_of); `weights`: a row's weights tag."""
        self.fp = fp
        self.job = job
        self.weights = weights

    def name_tag(self) -> str:
        return f"-fp{self.fp[:16]}"

    def write(self, f, rows: list[OutputRow]) -> None:
        for samples in _by_input_row(rows):
            f.write((json.dumps(self.line(samples), ensure_ascii=False) + "\n").encode())

    def line(self, samples: list[OutputRow]) -> dict:
        first = samples[0]
        row = first.row
        req_id = openai_batch.request_id(self.fp, row.index, row.input_hash, self.weights(row))
        request = row.request or {
            "custom_id": str(row.id),
            "endpoint": "chat" if isinstance(row.prompt, list) else "completion",
        }
        if first.finish_reason == "error" or first.error is not None:  # a pooling row's error has no finish
            return openai_batch.error_line(req_id, request.get("custom_id"), first.error)
        # what answered: a served row's adapter is known (its source refused an unknown `model`)
        ran = self.job.model.name_of(row_adapter(row, self.job))
        return openai_batch.response_line(req_id, request, samples, first.prompt_tokens, ran)

    @staticmethod
    def read_done(part: Path, fps: tuple[str, ...], done: Done) -> str | None:
        tag = part.stem.split("-fp", 1)[1][:16] if "-fp" in part.stem else ""
        fp = next((fp for fp in fps if fp[:16] == tag), None)
        if fp is None:
            return tag
        lines, errors = 0, []
        with part.open("r", encoding="utf-8") as f:
            for text in f:
                line = json.loads(text)
                key, input_hash, weights = JsonlParts._key(line)
                done.rows.add(key)
                done.hashes[key] = input_hash
                done.weights[key] = weights
                lines += 1
                if line.get("error") is not None:
                    errors.append(key)
        done.count(part, lines, errors)
        return fp

    @staticmethod
    def _key(line: dict) -> tuple[Any, str | None, str | None]:
        """(row id, input hash, weights tag) of an output line: its custom_id, or the input line's key when it had
        none."""
        input_hash, weights, index = openai_batch.parse_request_id(line["id"])
        key = line.get("custom_id")
        return (openai_batch.line_key(index) if key is None else key), input_hash, weights

    @staticmethod
    def drop(part: Path, ids: set) -> int:
        """Rewrite the part without the lines of these ids (as ParquetParts.drop); returns the lines dropped."""
        with part.open("r", encoding="utf-8") as f:
            lines = [text for text in f if text.strip()]
        keep = [text for text in lines if JsonlParts._key(json.loads(text))[0] not in ids]
        if len(keep) == len(lines):
            return 0
        if not keep:
            part.unlink()
            return len(lines)
        storage.write_text_whole(part, "".join(keep))
        return len(lines) - len(keep)


def _by_input_row(rows: list[OutputRow]) -> list[list[OutputRow]]:
    groups: dict[int, list[OutputRow]] = {}
    for r in rows:
        groups.setdefault(r.row.index, []).append(r)
    return [sorted(g, key=lambda r: r.sample) for g in groups.values()]


FORMATS = {"parquet": ParquetParts, "jsonl": JsonlParts}


def existing_parts(out_dir: Path) -> list[Path]:
    if not storage.fresh(out_dir).is_dir():
        return []
    return sorted(p for fmt in FORMATS.values() for p in out_dir.glob(f"part-*{fmt.suffix}"))


def read_done(out_dir: Path, fps: tuple[str, ...], source: str) -> Done:
    """What this job wrote already (parts whose fingerprint is one of `fps`, the job's first); BadInput if the
    directory holds another job's parts."""
    done, fp = Done(), fps[0]
    for part in existing_parts(out_dir):
        reader = ParquetParts if part.suffix == ".parquet" else JsonlParts
        try:
            theirs = reader.read_done(part, fps, done)
        except Exception as e:
            raise BadInput(
                f"{source}: output.path {out_dir}: {part.name} is not a readable part file ({e}); "
                f"remove it or use --overwrite."
            ) from None
        if theirs not in fps:
            raise BadInput(
                f"{source}: output.path {out_dir} holds parts of a different job ({part.name}: "
                f"fingerprint {theirs or 'none'}, this job {fp}); the model, input, sampling, output format "
                f"or shard count changed. Use another output.path, or --overwrite to start over."
            )
    return done


def move_legacy_state(spec: JobSpec) -> None:
    """Output directories of earlier versions held stats*.parquet, memory.png and slurm/ next to the parts: move
    them into the state folder, so the directory holds completions only (and the job keeps resuming)."""
    out = spec.output_dir
    if storage.is_remote(out) or not out.is_dir():
        return
    legacy = (
        [*out.glob("stats*.parquet"), out / "memory.png", out / "slurm"] if spec.output.stats is None else []
    )
    for path in legacy:
        target = spec.state_dir / path.name
        if path.exists() and not target.exists():
            spec.state_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)


def check_writable(out_dir: Path, key: str, source: str) -> None:
    """Create the directory if needed and prove a file can be written there (an object store: an object); BadInput
    naming the key if not."""
    try:
        storage.make_dir(out_dir)
        probe = out_dir / f".batchrun-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        storage.write_whole(probe, lambda f: None)
        probe.unlink()
    except OSError as e:
        raise BadInput(f"{source}: key `{key}`: cannot write into {out_dir} ({e.strerror or e}).") from None
    except Exception as e:  # noqa: BLE001 - a store's client: no credentials, no endpoint, no bucket
        if not storage.is_remote(out_dir):
            raise
        raise BadInput(
            f"{source}: key `{key}`: cannot write into {out_dir} ({type(e).__name__}: {e}); check the store's "
            f"credentials and endpoint (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...) and that the bucket exists."
        ) from None


class PartWriter:
    """Buffers finished rows; writes a part every `rows_per_part` rows or `max_wait_s` seconds."""

    def __init__(
        self,
        out_dir: Path,
        fmt: ParquetParts | JsonlParts,
        shard: Shard,
        rows_per_part: int = 1000,
        max_wait_s: float = 30.0,
        guard: Callable[[], None] = lambda: None,
    ):
        self.out_dir = out_dir
        self.guard = guard  # raises when this run may no longer write (its lease was taken over)
        self.fmt = fmt
        self.prefix = (
            f"part-{shard.index:05d}of{shard.count:05d}-{time.strftime('%Y%m%dT%H%M%S')}-"
            f"{uuid.uuid4().hex[:6]}{fmt.name_tag()}"
        )
        self.rows_per_part = rows_per_part
        self.max_wait_s = max_wait_s
        self.buffer: list[OutputRow] = []
        self.num_parts = 0
        self.rows_written = 0  # output rows (samples) in written parts
        self.inputs_written = 0  # input rows whose every sample is in a written part: what a resume skips
        self._buffered_inputs = 0
        self._last_flush = time.monotonic()

    def add(self, rows: list[OutputRow]) -> None:
        """All samples of one input row, together (a JSONL line holds them all)."""
        self.buffer.extend(rows)
        self._buffered_inputs += 1
        if len(self.buffer) >= self.rows_per_part or time.monotonic() - self._last_flush >= self.max_wait_s:
            self.flush()

    def flush(self, empty_ok: bool = False) -> None:
        self._last_flush = time.monotonic()
        if not self.buffer and not empty_ok:
            return
        self.guard()
        name = f"{self.prefix}-{self.num_parts:05d}{self.fmt.suffix}"
        buffer = self.buffer
        storage.write_whole(self.out_dir / name, lambda f: self.fmt.write(f, buffer))
        self.num_parts += 1
        self.rows_written += len(self.buffer)
        self.inputs_written += self._buffered_inputs
        self.buffer, self._buffered_inputs = [], 0


class OutputSink:
    """The completions directory of one shard of a job: which rows are done already, and the part writer for
    the rows that finish. Opening it checks what a run needs of the directory's parts (none of another job,
    --no-resume without --overwrite on a used directory) before any model loads, and changes nothing there: what
    a run removes (--overwrite's earlier parts, the outputs of rows whose input or weights changed) goes in
    `begin`, once every check that can refuse the job has passed. The job has checked that the directory is
    writable (check_writable) before it took its lock there."""

    def __init__(
        self,
        spec: JobSpec,
        shard: Shard,
        id_type: pa.DataType,
        passthrough: list[pa.Field],
        weights: JobWeights,
        resume: bool = True,
        overwrite: bool = False,
        dtype: str | None = None,
        guard: Callable[[], None] = lambda: None,
        task_types: dict[str, pa.DataType] | None = None,
    ):
        """`weights`: what the job's weights are, whose tag each row's output records. `guard`: called before each
        part is written; raises when this run may no longer write (lock.py). `task_types`: the Arrow types of a
        pooling task's columns (output_schema)."""
        src = spec.source_file
        self.dir = spec.output_dir
        self.shard = shard
        self.weights = weights
        self.fingerprint = fingerprint(spec, shard, dtype)
        self.optional = optional_columns(spec)
        if not resume and not overwrite and existing_parts(self.dir):
            raise BadInput(
                f"{src}: output.path {self.dir} already holds part files and --no-resume was given; use "
                f"--overwrite to start over, or --resume to finish the job."
            )
        self.overwrite = overwrite  # this shard's earlier parts go in begin(), not now
        self.stale: set = set()  # ids whose outputs begin() removes (their input or weights changed)
        self._begun = False
        fps = (self.fingerprint, fingerprint(spec, shard, dtype, adapters=True))
        self.done = read_done(self.dir, fps, src) if resume and not overwrite else Done()
        self.error_rows = 0  # input rows of this run whose output is an error
        if spec.output_format == "jsonl":
            self.format = JsonlParts(self.fingerprint, spec, weights.tag)
        else:
            self.format = ParquetParts(
                output_schema(id_type, passthrough, self.optional, spec.task, task_types),
                self.fingerprint,
                spec.name,
                weights.tag,
            )
        self.writer = PartWriter(
            self.dir,
            self.format,
            shard,
            rows_per_part=spec.output.rows_per_part,
            max_wait_s=spec.output.flush_seconds,
            guard=guard,
        )

    def is_done(self, row_id: Any, num_samples: int) -> bool:
        return self.done.has(row_id, num_samples)

    def forget(self, ids: set) -> None:
        """These input rows are pending again (their input or weights changed); begin() removes their outputs."""
        self.stale |= ids
        self.done.forget(ids, str(self.shard))

    def begin(self) -> int:
        """Every check that can refuse the job has passed (its engines loaded, or it has no rows to load one for):
        now --overwrite removes this shard's earlier parts and those of another shard count (no shard of this job
        reads them; the job's other shards keep theirs), and the outputs of the rows forgotten go, each part
        rewritten whole (a crash leaves a row done or pending, never twice). Once per run; returns the input rows
        whose outputs were removed that way."""
        if self._begun:
            return 0
        self._begun = True
        mine = str(self.shard)
        if self.overwrite:
            for part in existing_parts(self.dir):
                theirs = part_shard(part)  # None: not batchrun's, read by no shard
                if theirs is None or theirs == mine or theirs.split("/")[1] != str(self.shard.count):
                    with contextlib.suppress(FileNotFoundError):  # another shard's run removed it first
                        part.unlink()
            return 0
        if not self.stale:
            return 0
        removed = sum(
            type(self.format).drop(part, self.stale)
            for part in existing_parts(self.dir)
            if part_shard(part) == mine and part.suffix == self.format.suffix
        )
        self.done.removed(mine, removed)
        return removed

    def write_empty(self) -> None:
        """For an input with no rows: an empty part (Parquet: the output schema, no rows), unless the directory
        holds parts already, so the directory reads as a table with the job's columns."""
        self.begin()
        if not existing_parts(self.dir) and isinstance(self.format, ParquetParts):
            self.writer.flush(empty_ok=True)

    def add(self, rows: list[OutputRow]) -> None:
        """All output rows of one input row; an error row (each of its samples carries the error) is counted."""
        self.writer.add(rows)
        self.error_rows += any(r.error is not None for r in rows)

    @property
    def job_error_rows(self) -> int:
        """This shard's error rows in the output: earlier runs' (still there) and this run's."""
        return self.done.error_rows(str(self.shard)) + self.error_rows

    def flush(self) -> None:
        self.writer.flush()

    @property
    def rows_written(self) -> int:
        return self.writer.rows_written

    @property
    def input_rows_written(self) -> int:
        """Input rows of this run in written parts (finished rows still buffered are not, until written)."""
        return self.writer.inputs_written
