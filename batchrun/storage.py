"""Where a job's files live: a local path, or a URL of any file system fsspec knows (s3://, gs://, hf://,
memory://, ...). A URL becomes a `UPath` (universal-pathlib: pathlib's interface over fsspec, kept by fsspec's
maintainers), so the code above joins, globs, reads and writes one kind of path object; a local path stays a
`pathlib.Path`. What differs on an object store is here, in a few functions:

- a file is written whole (`write_whole`): locally under a temporary name, then renamed; on an object store in
  one PUT, which makes the object appear whole or not at all, so no rename is needed;
- create-if-absent and replace-if-unchanged (`create_exclusive`, `replace_if`): the conditional writes that
  the shard lease (lock.py) is made of, on the stores known to do them atomically (`CONDITIONAL_WRITES`);
- listings are read fresh (`fresh`): an fsspec client caches them, and another process may have written since.

Credentials and endpoints come from where each store's library looks (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
~/.aws/config, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN, ...), never from the job file.
"""

from __future__ import annotations

import io
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .errors import BadInput

LOCAL_PROTOCOLS = ("", "file", "local")
# object stores whose create-if-absent and compare-and-swap writes are atomic, through their fsspec library:
# S3 (and S3-compatible servers) with If-None-Match / If-Match on PutObject (s3fs passes them through)
CONDITIONAL_WRITES = ("s3", "s3a")


class NoConditionalWrites(Exception):
    """The store cannot create an object only if it is absent, atomically."""


def is_url(text: str | os.PathLike) -> bool:
    return "://" in str(text)


def location(text: str | os.PathLike, what: str = "path") -> Path:
    """A path object for `text`: a pathlib.Path for a local path (`~` expanded), a UPath for a URL. BadInput
    naming `what` when no installed file system serves the URL's scheme."""
    if not is_url(text):
        return Path(text).expanduser()
    if not isinstance(text, str):
        return text  # a UPath already
    from upath import UPath

    try:
        path = UPath(text)
        path.fs  # noqa: B018 - the file system is made here, so a missing library is said here
    except (ImportError, ValueError) as e:
        raise BadInput(
            f"{what}: {text}: no file system for this URL ({e}). s3:// needs s3fs (installed with batchrun), "
            f"gs:// needs gcsfs, hf:// needs huggingface_hub."
        ) from None
    return path


def is_remote(path: Path) -> bool:
    """Whether `path` is on another file system than this machine's (an object store, the Hub, memory)."""
    return getattr(path, "protocol", "") not in LOCAL_PROTOCOLS


def fresh(path: Path) -> Path:
    """`path`, with its file system's cached listings of it dropped (another process may have written since)."""
    if is_remote(path):
        path.fs.invalidate_cache(path.path)
    return path


def parquet_file(path: Path):
    """A Parquet file to read (pyarrow's ParquetFile: `.schema_arrow`, `.metadata`, `.read(columns)`,
    `.iter_batches`), here or on a store."""
    import pyarrow.parquet as pq

    if is_remote(path):
        return pq.ParquetFile(path.path, filesystem=path.fs)
    return pq.ParquetFile(path)


def write_whole(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write a file so that a reader sees all of it or none: `write(f)` fills it. Locally: a temporary name in the
    same folder, then renamed over `path`. On an object store: one PUT (or one multipart upload, which also
    appears only when complete)."""
    if is_remote(path):
        buf = io.BytesIO()
        write(buf)
        path.fs.pipe_file(path.path, buf.getvalue())
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{_temporary_tag()}{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def _temporary_tag() -> str:
    """What a temporary name carries before the writer's pid: its host, so a cleanup on a shared file system
    judges only its own host's processes."""
    return f".tmp-{socket.gethostname()}-"


def remove_dead_temporaries(folder: Path) -> int:
    """Remove the temporary files (`write_whole`) that processes of this host left when they died (kill -9 in
    the middle of a write); those of live processes and of other hosts stay. Returns how many went."""
    if is_remote(folder) or not folder.is_dir():
        return 0
    pattern = re.compile(rf"^\..+{re.escape(_temporary_tag())}(\d+)$")
    removed = 0
    for f in folder.iterdir():
        found = pattern.match(f.name)
        if found and not _alive(int(found.group(1))):
            f.unlink(missing_ok=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_text_whole(path: Path, text: str) -> None:
    write_whole(path, lambda f: f.write(text.encode()))


def make_dir(path: Path) -> None:
    """A local folder is made (with its parents); an object store has no folders to make."""
    if not is_remote(path):
        path.mkdir(parents=True, exist_ok=True)


def create_exclusive(path: Path, data: bytes) -> str | None:
    """Create `path` holding `data` only if nothing is there, atomically: its version (the object's ETag; ""
    locally), or None when something was there. NoConditionalWrites on a store that cannot."""
    if not is_remote(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return None
        return ""
    if path.protocol not in CONDITIONAL_WRITES:
        raise NoConditionalWrites(path.protocol)
    try:
        return path.fs.pipe_file(path.path, data, mode="create")["ETag"]
    except FileExistsError:
        return None
    except OSError as e:
        if _precondition_failed(e):
            return None
        raise


def honours_conditional_writes(probe: Path) -> bool:
    """Whether the store honours create-if-absent and replace-if-unchanged, tried on a scratch object `probe`
    (removed after): some S3-compatible servers accept the headers and ignore them. NoConditionalWrites on a
    store batchrun has no way to ask."""
    if not is_remote(probe):
        return True
    first = create_exclusive(probe, b"probe")
    try:
        if first is None:
            return False  # a fresh name reads as taken: nothing conditional can be trusted there
        return create_exclusive(probe, b"again") is None and replace_if(probe, b"again", '"0"') is None
    finally:
        probe.fs.rm_file(probe.path)


def replace_if(path: Path, data: bytes, version: str) -> str | None:
    """Overwrite `path` with `data` only if it is still at `version` (compare-and-swap on the ETag): the new
    version, or None when another writer changed it first."""
    if path.protocol not in CONDITIONAL_WRITES:
        raise NoConditionalWrites(path.protocol)
    try:
        return path.fs.pipe_file(path.path, data, IfMatch=version)["ETag"]
    except FileNotFoundError:
        return None
    except OSError as e:
        if _precondition_failed(e):
            return None
        raise


def read_versioned(path: Path) -> tuple[bytes, str] | None:
    """(content, version) of an object read as one (the version before and after the read agree), or None
    when it is absent."""
    fs = path.fs
    for _ in range(5):
        try:
            fs.invalidate_cache(path.path)
            before = fs.info(path.path)["ETag"]
            data = fs.cat_file(path.path)
            fs.invalidate_cache(path.path)
            if fs.info(path.path)["ETag"] == before:
                return data, before
        except FileNotFoundError:
            return None
    raise OSError(f"{path} kept changing while it was read")


def _precondition_failed(e: OSError) -> bool:
    """Whether an fsspec error is the store's 412 (a condition of a conditional write did not hold) or 409 (a
    conflicting conditional write at the same moment)."""
    response = getattr(e.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict")
