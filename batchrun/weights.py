"""What a job's weights are, not only where they are: each output row records the weights that made it.

A model retrained into the same folder, or an adapter replaced in place, leaves every path of the job as it was;
its rows must not stay as the old weights wrote them. Before any model loads, a job reads what its weights are:

- the model: the name, size and modification time of each of its weight files (and config.json), hashed. The
  weights of a large model are too big to read at every run; a retrained checkpoint is written anew, so its
  files' times change (copying a folder without keeping times counts as a change too: the rows recompute).
- each adapter: a hash of its config's and weight files' bytes (small files; an adapter at a URL is copied
  afresh at each run, so only its content can say whether it changed).

A row's tag is the model's identity, and its adapter's after a dot where it runs one (`<model>.<adapter>`):
Parquet parts keep the tags in their metadata (`batchrun.weights`, in row order), OpenAI batch output lines in
their `id`. A rerun compares each finished row's tag with its weights now and recomputes, refuses (exit 2) or
keeps the rows whose weights changed, as `model.on_change` says, naming what changed. A row written before tags
were kept, or whose model could not be read before the load (a hub id not yet downloaded), is trusted as it is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from batchrun.engine.model.lora.config import CONFIG_FILE, WEIGHT_FILES

from .adapters import adapter_folder
from .config import JobSpec
from .model_loader import default_model_file, is_hub_id
from .rows import InputRow, row_adapter

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
TAG_CHARS = 12  # hex characters of each identity in a tag
# a tag's adapter part for a row whose name names neither an adapter nor the base model (its error row): once the
# name names one (model.name set, the adapter added), the row's weights changed and it is redone
UNKNOWN_NAME = "-"


def model_files(path: str | None) -> list[Path]:
    """The files whose contents are the model's computation: its weight files and config.json (a folder's, in
    its subfolders too: a sentence-transformers checkpoint keeps modules there), the GGUF file, or the embedded
    default's GGUF. Empty where the model is not on this machine yet (a hub id to download at the load)."""
    if path is None:
        return [default_model_file()]
    p = Path(path).expanduser()
    if not p.exists() and is_hub_id(path):  # the local cache's copy (a lookup of local files alone)
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
        p = Path(cached).parent if isinstance(cached, str) else p
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    return sorted(
        f for f in p.rglob("*") if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name == "config.json")
    )


def model_identity(path: str | None) -> str | None:
    """A hash of the model's files' names, sizes and modification times; None where they cannot be read yet."""
    files = model_files(path)
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:TAG_CHARS]


def adapter_identity(folder: Path) -> str:
    """A hash of an adapter folder's config and weight files' bytes."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, *WEIGHT_FILES):
        if (folder / name).is_file():
            h.update(name.encode() + b"\n" + (folder / name).read_bytes())
    return h.hexdigest()[:TAG_CHARS]


@dataclass(frozen=True)
class JobWeights:
    """The identities of a job's model and adapters, read once before any model loads (`read`), and each row's
    tag made from them."""

    job: JobSpec
    model: str | None
    adapters: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, job: JobSpec) -> JobWeights:
        adapters = {
            name: adapter_identity(adapter_folder(name, path, job.source_file))
            for name, path in job.model.adapters.items()
        }
        return cls(job, model_identity(job.model.path), adapters)

    def tag(self, row: InputRow) -> str | None:
        """What made this row's output: the model's identity, and its adapter's after a dot (UNKNOWN_NAME for a
        row whose name names nothing: its error row). None where the model's identity is unknown."""
        if self.model is None:
            return None
        try:
            adapter = row_adapter(row, self.job)
        except ValueError:
            return f"{self.model}.{UNKNOWN_NAME}"
        return self.model if adapter is None else f"{self.model}.{self.adapters[adapter]}"

    def what_changed(self, old: str | None, row: InputRow) -> str | None:
        """What of a finished row's weights changed since its output was written (`old`: its tag then), in the
        job file's words; None when nothing did (or it cannot be told: no tag then or now)."""
        new = self.tag(row)
        if old is None or new is None or old == new:
            return None
        old_model, _, old_adapter = old.partition(".")
        _, _, new_adapter = new.partition(".")
        if old_model != self.model:
            return f"the model's weights (model.path {self.job.model.path or 'the embedded default'})"
        if UNKNOWN_NAME in (old_adapter, new_adapter):
            return "the model or adapter its row names (model.name, model.adapters)"
        if not (old_adapter and new_adapter):
            return "the adapter it runs with"  # model.adapter changed between the base model and an adapter
        adapter = row_adapter(row, self.job)  # a tag with an adapter part: its name is known
        return f"adapter {adapter!r}'s weights (model.adapters.{adapter})"
