"""Completions output: Parquet part files written as rows finish, each to a temporary name then renamed, so a
crash never leaves a torn file. Every part records the job's fingerprint, which is how a rerun finds the
(id, sample) pairs already done and refuses parts of a different job."""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from .config import JobSpec, to_dict
from .errors import BadInput

if TYPE_CHECKING:
    from .sources import Shard

FINGERPRINT_KEY = b"batchrun.fingerprint"
JOB_KEY = b"batchrun.job"


def fingerprint(spec: JobSpec, shard: Shard) -> str:
    """Hash of what changes the outputs: model, input (but its limit), sampling — and the shard count (a row's
    shard depends on it). Engine settings (pages, batch sizes) and the shard index do not change any row."""
    d = to_dict(spec)
    d["input"].pop("limit", None)  # a larger limit continues the same job
    keep = {"model": d["model"], "input": d["input"], "sampling": d["sampling"], "shards": shard.count}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _column(arrow_type: pa.DataType | None):
    return field(metadata={"arrow": arrow_type})


@dataclass
class OutputRow:
    """One output row: its fields are the output columns, in order (the one list of them), then passthrough."""

    id: Any = _column(None)  # the input's id type
    sample: int = _column(pa.int32())
    completion: str | None = _column(pa.string())
    finish_reason: str = _column(pa.string())
    error: str | None = _column(pa.string())
    prompt_tokens: int = _column(pa.int32())
    completion_tokens: int = _column(pa.int32())
    num_preemptions: int = _column(pa.int32())
    passthrough: dict = field(default_factory=dict)  # input columns copied as they are


OUTPUT_COLUMNS = [f.name for f in fields(OutputRow) if "arrow" in f.metadata]


def output_schema(id_type: pa.DataType, passthrough: list[pa.Field]) -> pa.Schema:
    own = [
        pa.field(f.name, f.metadata["arrow"] or id_type) for f in fields(OutputRow) if "arrow" in f.metadata
    ]
    return pa.schema([*own, *passthrough])


def existing_parts(out_dir: Path) -> list[Path]:
    return sorted(p for p in out_dir.glob("part-*.parquet")) if out_dir.is_dir() else []


def done_keys(out_dir: Path, fp: str, source: str) -> set[tuple]:
    """(id, sample) pairs already written by this job; BadInput if the directory holds another job's parts."""
    done: set[tuple] = set()
    for part in existing_parts(out_dir):
        try:
            meta = pq.read_schema(part).metadata or {}
        except Exception as e:
            raise BadInput(
                f"{source}: output.path {out_dir}: {part.name} is not a readable Parquet file ({e}); "
                f"remove it or use --overwrite."
            ) from None
        theirs = meta.get(FINGERPRINT_KEY, b"").decode()
        if theirs != fp:
            raise BadInput(
                f"{source}: output.path {out_dir} holds parts of a different job ({part.name}: "
                f"fingerprint {theirs or 'none'}, this job {fp}); the model, input, sampling or "
                f"shard count changed. Use another output.path, or --overwrite to start over."
            )
        table = pq.read_table(part, columns=["id", "sample"])
        done.update(zip(table.column("id").to_pylist(), table.column("sample").to_pylist()))
    return done


def check_writable(out_dir: Path, key: str, source: str) -> None:
    """Create the directory if needed and prove a file can be written there; BadInput naming the key if not."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".batchrun-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise BadInput(f"{source}: key `{key}`: cannot write into {out_dir} ({e.strerror or e}).") from None


def remove_parts(out_dir: Path) -> None:
    for part in existing_parts(out_dir):
        part.unlink()


class PartWriter:
    """Buffers finished rows; writes a part every `rows_per_part` rows or `max_wait_s` seconds."""

    def __init__(
        self,
        out_dir: Path,
        schema: pa.Schema,
        fp: str,
        job_name: str,
        shard: Shard,
        rows_per_part: int = 1000,
        max_wait_s: float = 30.0,
    ):
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.schema = schema.with_metadata({FINGERPRINT_KEY: fp.encode(), JOB_KEY: job_name.encode()})
        self.prefix = (
            f"part-{shard.index:05d}of{shard.count:05d}-{time.strftime('%Y%m%dT%H%M%S')}-"
            f"{uuid.uuid4().hex[:6]}"
        )
        self.rows_per_part = rows_per_part
        self.max_wait_s = max_wait_s
        self.buffer: list[OutputRow] = []
        self.num_parts = 0
        self.rows_written = 0
        self._last_flush = time.monotonic()

    def add(self, rows: list[OutputRow]) -> None:
        self.buffer.extend(rows)
        if len(self.buffer) >= self.rows_per_part or time.monotonic() - self._last_flush >= self.max_wait_s:
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self.buffer:
            return
        cols: dict[str, list] = {f.name: [] for f in self.schema}
        for r in self.buffer:
            for name in OUTPUT_COLUMNS:
                cols[name].append(getattr(r, name))
            for k, v in r.passthrough.items():
                cols[k].append(v)
        table = pa.table(cols, schema=self.schema)
        name = f"{self.prefix}-{self.num_parts:05d}.parquet"
        tmp = self.out_dir / f".{name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, self.out_dir / name)
        self.num_parts += 1
        self.rows_written += len(self.buffer)
        self.buffer = []


class OutputSink:
    """The completions directory of one shard of a job: which (id, sample) pairs are done already, and the
    part writer for the rows that finish. Opening it checks everything a run needs of the directory (writable,
    no parts of another job, --no-resume without --overwrite on a used directory) before any model loads."""

    def __init__(
        self,
        spec: JobSpec,
        shard: Shard,
        id_type: pa.DataType,
        passthrough: list[pa.Field],
        resume: bool = True,
        overwrite: bool = False,
    ):
        src = spec.source_file
        self.dir = spec.output_dir
        self.fingerprint = fingerprint(spec, shard)
        check_writable(self.dir, "output.path", src)
        if overwrite:
            remove_parts(self.dir)
        if not resume and not overwrite and existing_parts(self.dir):
            raise BadInput(
                f"{src}: output.path {self.dir} already holds part files and --no-resume was given; use "
                f"--overwrite to start over, or --resume to finish the job."
            )
        self.done: set[tuple] = done_keys(self.dir, self.fingerprint, src) if resume else set()
        self.writer = PartWriter(
            self.dir,
            output_schema(id_type, passthrough),
            self.fingerprint,
            spec.name,
            shard,
            rows_per_part=spec.output.rows_per_part,
            max_wait_s=spec.output.flush_seconds,
        )

    def is_done(self, row_id: Any, num_samples: int) -> bool:
        return all((row_id, i) in self.done for i in range(num_samples))

    def add(self, rows: list[OutputRow]) -> None:
        self.writer.add(rows)

    def flush(self) -> None:
        self.writer.flush()

    @property
    def rows_written(self) -> int:
        return self.writer.rows_written
