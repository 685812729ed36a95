"""What a checkpoint's sentence-transformers files say about turning token states into one vector: the pooling,
the dense layers and normalisation after it, the named prompts, and the longest text.

Both folder layouts found on the Hub are read: the older one (module types `sentence_transformers.models.*`,
`pooling_mode_lasttoken: true`-style flags in `1_Pooling/config.json`, `max_seq_length` in
`sentence_bert_config.json`; Qwen3-Embedding's has no Normalize folder) and sentence-transformers 6's
(`sentence_transformers.base.modules...`, `"pooling_mode": "mean"`, the longest text as the tokenizer's
`model_max_length`). A module or setting batchrun does not reproduce is refused here (`SentenceConfigError`),
naming it: the worst outcome is a vector that silently differs from the model card's.

A cross-encoder's folder is read here too, from the same files and in the same order as sentence-transformers'
CrossEncoder reads them: its activation (`cross_encoder_activation`, what CrossEncoder applies to the head's
logits), and its prompts, longest pair and modules (`read_cross_encoder_config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from batchrun.errors import BadInput

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# the older layout's flags, in sentence-transformers' order (a folder with several concatenates them so)
_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Tanh": "tanh"}


class SentenceConfigError(BadInput):
    """The checkpoint's sentence-transformers files ask for something batchrun does not reproduce."""


@dataclass(frozen=True)
class DenseLayer:
    """A `Dense` module: a linear layer and its activation (None: identity), weights in `folder`."""

    folder: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str | None


@dataclass(frozen=True)
class SentenceConfig:
    """The pooling chain of a checkpoint: `modes` (concatenated in this order), whether the prompt's tokens are
    pooled, then `after` (DenseLayer or "normalize", in the folder's module order)."""

    modes: tuple[str, ...] = ("mean",)
    include_prompt: bool = True
    after: tuple = ()
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # from the older layout's sentence_bert_config.json
    transformer_path: str = ""  # the folder of the transformers model inside the checkpoint
    from_files: bool = True  # False: the checkpoint has no sentence-transformers files (defaults)

    def output_dim(self, hidden_size: int) -> int:
        """The vector's length before any Matryoshka truncation."""
        dim = hidden_size * len(self.modes)
        for module in self.after:
            if isinstance(module, DenseLayer):
                dim = module.out_features
        return dim


@dataclass(frozen=True)
class CrossEncoderActivation:
    """The activation sentence-transformers' CrossEncoder applies to a head's logits: its torch class path, and
    where it was read (a file and key, or CrossEncoder's default), for an error that names it."""

    name: str
    source: str


SIGMOID, IDENTITY = "torch.nn.modules.activation.Sigmoid", "torch.nn.modules.linear.Identity"


def cross_encoder_activation(model_dir: Path, num_labels: int) -> CrossEncoderActivation:
    """What CrossEncoder(model_dir).predict applies, in its order (sentence-transformers 6.3,
    cross_encoder/model.py): a folder sentence-transformers saved as a CrossEncoder (modules.json, and
    config_sentence_transformers.json of model_type CrossEncoder) names it as that file's `activation_fn`; else
    config.json's `sentence_transformers.activation_fn` (its presence decides, as theirs); else config.json's
    older `sbert_ce_default_activation_function`; else a sigmoid for a head of one label, the identity for more."""
    saved = _cross_encoder_files(model_dir)
    if saved is not None and saved[1].get("activation_fn") is not None:
        return CrossEncoderActivation(saved[1]["activation_fn"], f"{saved[0]}: activation_fn")
    config_file = model_dir / "config.json"
    config = _json(config_file) if config_file.is_file() else {}
    block = config.get("sentence_transformers")
    if isinstance(block, dict) and "activation_fn" in block:
        named, key = block["activation_fn"], "sentence_transformers.activation_fn"
    else:
        named, key = (
            config.get("sbert_ce_default_activation_function"),
            "sbert_ce_default_activation_function",
        )
    if named is not None:
        return CrossEncoderActivation(named, f"{config_file}: {key}")
    default = SIGMOID if num_labels == 1 else IDENTITY
    return CrossEncoderActivation(default, f"CrossEncoder's default for a head of {num_labels} label(s)")


def _cross_encoder_files(model_dir: Path) -> tuple[Path, dict] | None:
    """config_sentence_transformers.json (its path and contents) of a folder CrossEncoder loads through its
    modules (modules.json, and that file of model_type CrossEncoder); None for one it loads from config.json
    alone (no modules.json, or another model type, whose prompts and modules CrossEncoder does not read)."""
    st_file = model_dir / "config_sentence_transformers.json"
    if not ((model_dir / "modules.json").is_file() and st_file.is_file()):
        return None
    st = _json(st_file)
    saved_as = st.get("model_type", "SentenceTransformer")  # sentence-transformers' class, not a model family
    return (st_file, st) if saved_as == "CrossEncoder" else None


def read_cross_encoder_config(model_dir: Path) -> SentenceConfig:
    """What else of a cross-encoder's folder CrossEncoder.predict applies (sentence-transformers 6.3): its
    named prompts and default prompt (the prompt goes before a pair's first text), and the longest pair (its
    Transformer module's max_seq_length, where sentence_bert_config.json sets one; else the tokenizer's
    model_max_length, which CrossEncoder.save writes). Its modules must be a Transformer alone, at the folder's
    root, as CrossEncoder.save writes a sequence classifier: a module after it (a Dense over the scores, ...)
    is refused, as is a Transformer setting batchrun does not reproduce. Defaults (from_files False) for a folder
    CrossEncoder reads through config.json alone."""
    saved = _cross_encoder_files(model_dir)
    if saved is None:
        return SentenceConfig(modes=(), from_files=False)
    modules_file = model_dir / "modules.json"
    modules = _json(modules_file)
    if not modules or _module_kind(modules[0].get("type", "")) != "Transformer" or modules[0].get("path"):
        raise SentenceConfigError(
            f"{modules_file}: batchrun runs a cross-encoder whose first module is a Transformer at the folder's root"
        )
    if len(modules) > 1:
        extra = modules[1]
        raise SentenceConfigError(
            f"{modules_file}: module {extra.get('path') or extra.get('name')} is a {extra.get('type')}, which "
            "batchrun does not apply to a cross-encoder's scores (it runs the Transformer module alone)"
        )
    prompts, default = _prompts(*saved)
    max_seq_length = _transformer_options(model_dir, _CROSS_ENCODER_TRANSFORMER)
    return SentenceConfig((), True, (), prompts, default, max_seq_length)


def _module_kind(type_name: str) -> str:
    """`sentence_transformers.models.Pooling`, `...sentence_transformer.modules.pooling.Pooling`: Pooling."""
    return type_name.rsplit(".", 1)[-1]


def read_sentence_config(model_dir: Path) -> SentenceConfig:
    """The checkpoint's pooling chain; defaults (from_files False) when it has no modules.json."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return SentenceConfig(from_files=False)
    modules = _json(modules_file)
    kinds = [_module_kind(m.get("type", "")) for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"]:
        raise SentenceConfigError(
            f"{modules_file}: batchrun runs a Transformer then a Pooling module first, not {', '.join(kinds)}"
        )
    options = _transformer_options(model_dir / modules[0].get("path", ""))
    modes, include_prompt = _pooling(model_dir / modules[1]["path"] / "config.json")
    after = []
    for module, kind in zip(modules[2:], kinds[2:]):
        folder = model_dir / module["path"]
        if kind == "Normalize":
            after.append("normalize")
        elif kind == "Dense":
            after.append(_dense(folder))
        else:
            raise SentenceConfigError(
                f"{modules_file}: module {module.get('path') or kind} is a {module.get('type')}, which batchrun "
                "does not reproduce (it runs Pooling, Dense and Normalize)"
            )
    prompts, default = {}, None
    st_file = model_dir / "config_sentence_transformers.json"
    if st_file.is_file():
        prompts, default = _prompts(st_file, _json(st_file))
    return SentenceConfig(
        tuple(modes), include_prompt, tuple(after), prompts, default, options, modules[0].get("path", "")
    )


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SentenceConfigError(f"{path}: cannot read it ({e})") from None


def _prompts(st_file: Path, st: dict) -> tuple[dict[str, str], str | None]:
    """config_sentence_transformers.json's named prompts and its default prompt's name (None: no prompt)."""
    prompts = dict(st.get("prompts") or {})
    default = st.get("default_prompt_name") or None
    if default is not None and default not in prompts:
        raise SentenceConfigError(f"{st_file}: default_prompt_name {default!r} is not among its prompts")
    return prompts, default


# the Transformer module's settings batchrun reproduces: an embedder's token states, a cross-encoder's logits
_EMBEDDING_TRANSFORMER = {
    "transformer_task": "feature-extraction",
    "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
    "module_output_name": "token_embeddings",
}
_CROSS_ENCODER_TRANSFORMER = {
    "transformer_task": "sequence-classification",
    "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
    "module_output_name": "scores",
}


def _transformer_options(folder: Path, expected: dict = _EMBEDDING_TRANSFORMER) -> int | None:
    """The Transformer module's settings; returns its max_seq_length (older layout; sentence-transformers passes
    it to the tokenizer as model_max_length, over the tokenizer's own). A setting that changes the tokens or the
    forward in a way batchrun does not follow is refused."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return None
    config = _json(path)
    for key, value in config.items():
        if key in expected and value != expected[key]:
            raise SentenceConfigError(f"{path}: {key} {value!r}; batchrun reproduces only {expected[key]!r}")
        if key == "do_lower_case" and value:
            raise SentenceConfigError(f"{path}: do_lower_case true is not reproduced by batchrun")
        empty_ok = ("processing_kwargs", "model_args", "tokenizer_args", "config_args", "query_length",
                    "document_length", "query_expansion")  # fmt: skip
        if key in empty_ok and value:
            raise SentenceConfigError(f"{path}: {key} {value!r} is not reproduced by batchrun")
        if key not in expected and key not in empty_ok and key not in ("max_seq_length", "do_lower_case"):
            if key != "unpad_inputs":  # a flash-attention switch: the same numbers either way
                raise SentenceConfigError(f"{path}: unknown setting {key!r}")
    return config.get("max_seq_length")


def _pooling(path: Path) -> tuple[list[str], bool]:
    config = _json(path)
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [m for flag, m in _LEGACY_FLAGS.items() if config.get(flag)] or ["mean"]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise SentenceConfigError(f"{path}: pooling mode {bad[0]!r} is not one of {', '.join(POOLING_MODES)}")
    return modes, bool(config.get("include_prompt", True))


def _dense(folder: Path) -> DenseLayer:
    path = folder / "config.json"
    config = _json(path)
    # sentence-transformers' Dense defaults to tanh where the file names no activation
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if activation not in _DENSE_ACTIVATIONS:
        raise SentenceConfigError(f"{path}: activation {activation!r} is not reproduced by batchrun")
    if (
        config.get("use_residual")
        or config.get("module_input_name", "sentence_embedding") != "sentence_embedding"
    ):
        raise SentenceConfigError(
            f"{path}: a residual or token-level Dense module is not reproduced by batchrun"
        )
    return DenseLayer(
        folder,
        config["in_features"],
        config["out_features"],
        config.get("bias", True),
        _DENSE_ACTIVATIONS[activation],
    )
