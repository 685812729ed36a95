"""Where a job's LoRA adapters are: `model.adapters` maps a name to a PEFT adapter folder (`adapter_config.json`
and its weights), given as a local path, an fsspec URL (s3://, gs://, hf://, ...) or a Hugging Face repo id
(read from the local Hugging Face cache, or downloaded there unless HF_HUB_OFFLINE=1, as `model.path` is).

A URL's two files are copied once into the cache folder (`$BATCHRUN_CACHE/adapters/`), keyed by the URL; each
adapter's config is read and checked here (engine/model/lora/config.py) when the job is validated, before any model
is loaded, so a DoRA adapter or one over engine.max_lora_rank is exit 2 at once; and its weights' names and shapes
against the model's config (`check_adapters`), so an adapter of another base model is too.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from batchrun.engine.model.lora.config import CONFIG_FILE, WEIGHT_FILES, AdapterConfig, read_adapter_config

from .errors import BadInput
from .host import cache_dir
from .model_loader import from_hub, is_hub_id
from .storage import is_url, location


def adapter_folder(name: str, path: str, source: str) -> Path:
    """A local folder holding adapter `name` (`path` as `model.adapters` gives it); BadInput naming the key."""
    key = f"model.adapters.{name}"
    if is_url(path):
        return _copy_from_url(path, source, key)
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if not p.exists() and is_hub_id(path):
        return from_hub(path, source, key, files=[CONFIG_FILE, *WEIGHT_FILES])
    raise BadInput(
        f"{source}: key `{key}`: {path} is not a folder; expected a PEFT adapter folder, a URL or a hub id"
    )


def _copy_from_url(url: str, source: str, key: str) -> Path:
    remote = location(url, f"{source}: key `{key}`")
    target = cache_dir() / "adapters" / hashlib.sha256(url.encode()).hexdigest()[:16]
    files = [f for f in (CONFIG_FILE, *WEIGHT_FILES) if (remote / f).exists()]
    if CONFIG_FILE not in files:
        raise BadInput(f"{source}: key `{key}`: {url} has no {CONFIG_FILE}; expected a PEFT adapter folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".copying-", dir=target.parent))
    try:
        for f in files:
            (tmp / f).write_bytes((remote / f).read_bytes())
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_adapters(
    adapters: dict[str, str], max_rank: int | None, source: str
) -> dict[str, tuple[Path, AdapterConfig]]:
    """{name: (its local folder, its checked config)} for `model.adapters`, in the job's order; BadInput (exit 2)
    naming the adapter for one batchrun cannot find or does not apply exactly."""
    out = {}
    for name, path in adapters.items():
        folder = adapter_folder(name, path, source)
        config = read_adapter_config(folder, f"{source}: key `model.adapters.{name}`", max_rank)
        if not any((folder / f).is_file() for f in WEIGHT_FILES):
            raise BadInput(
                f"{source}: key `model.adapters.{name}`: {folder} has no adapter weights ({' or '.join(WEIGHT_FILES)})"
            )
        out[name] = (folder, config)
    return out


def check_adapters(adapters: dict[str, tuple[Path, AdapterConfig]], model_config) -> None:
    """Each adapter ({name: (folder, config)}, read_adapters') against the model made on the meta device from its
    config, before any weight loads: the layers it targets exist, are ones batchrun adapts (not the token
    embeddings or the LM head) and fit its weights' shapes. BadInput naming the adapter and the module. A model
    that cannot be made there is the load's to report (the load checks the adapters again, on the model itself)."""
    if not adapters:
        return
    from batchrun.engine.model.loading import meta_paged_model
    from batchrun.engine.model.lora.weights import check_adapter

    try:
        model = meta_paged_model(model_config)
    except BadInput:
        raise
    except Exception:  # noqa: BLE001 - code that cannot run on the meta device: the load's to report
        return
    for name, (folder, config) in adapters.items():
        check_adapter(folder, config, model, f"model.adapters.{name}")
