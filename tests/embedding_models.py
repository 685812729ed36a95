"""Tiny random-weight embedding checkpoints in sentence-transformers' folder layouts (tests/test_embed.py): a
BERT, an XLM-R and a ModernBERT on a small WordPiece vocabulary, and a Qwen3-Embedding-shaped decoder on the
embedded default model's tokenizer with an end-of-text appended after every text (as Qwen3-Embedding's
tokenizer does). `save_sentence_model` writes sentence-transformers 6's layout through its own `save()`;
`save_legacy_layout` writes the older one by hand (module types `sentence_transformers.models.*`, pooling
flags, `max_seq_length` in sentence_bert_config.json), as Qwen3-Embedding ships."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two has look "
    "more day could go come did number sound no most people my over know water than call first who may down "
    "side been now find query passage search document cats dogs rain sea"
).split()
HIDDEN = 32


def wordpiece_tokenizer(folder: Path):
    """A BERT WordPiece tokenizer over WORDS, letters and their continuations (any lower-case text tokenizes)."""
    from transformers import BertTokenizerFast

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        *WORDS,
        *letters,
        *".,:!?",
        *(f"##{c}" for c in letters),
    ]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # vocab=, not vocab_file=: transformers 5 builds the fast tokenizer from `vocab` and ignores vocab_file (every
    # word was [UNK], a tokenizer of 5 tokens)
    return BertTokenizerFast(vocab=str(folder / "vocab.txt"))


def eos_appending_tokenizer(default_model_dir: Path):
    """The default model's tokenizer, appending its end-of-text after every text (Qwen3-Embedding's
    post-processor does; sentence-transformers' last-token pooling then pools that token)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    eos = tok.eos_token
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, tok.eos_token_id)]
    )
    tok.pad_token = eos
    return tok


def encoder_config(family: str, vocab_size: int):
    from transformers import BertConfig, ModernBertConfig, XLMRobertaConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    if family == "bert":
        return BertConfig(**common, max_position_embeddings=128)
    if family == "xlm-roberta":  # positions from padding_idx + 1, as the real ones
        return XLMRobertaConfig(**common, max_position_embeddings=130, pad_token_id=0)
    if family == "modernbert":  # one local layer of window 8 (4 each side), one global
        return ModernBertConfig(
            **common | dict(num_hidden_layers=3), max_position_embeddings=128, local_attention=8,
            global_attn_every_n_layers=2, pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2,
            eos_token_id=3,
        )  # fmt: skip
    raise ValueError(family)


def decoder_config(vocab_size: int, eos_token_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
        eos_token_id=eos_token_id, pad_token_id=eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip


def perturb_norms_and_biases(model) -> None:
    """Norms and biases moved off their initial 1s and 0s (randomly, after the caller's seed)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)


def save_base_model(config, tokenizer, folder: Path) -> Path:
    """A random-weight base model (seed 0, biases and norms perturbed so no weight is a plain 0 or 1)."""
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_config(config)
    perturb_norms_and_biases(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_bases(root: Path, default_model_dir: Path, encoders: list[str]) -> dict[str, Path]:
    """Base models: the encoders on a WordPiece vocabulary, and `qwen3` (a Qwen3-Embedding-shaped decoder) on the
    default model's tokenizer appending an end-of-text."""
    tok = wordpiece_tokenizer(root / "wordpiece")
    out = {f: save_base_model(encoder_config(f, len(tok)), tok, root / f) for f in encoders}
    dtok = eos_appending_tokenizer(default_model_dir)
    out["qwen3"] = save_base_model(decoder_config(len(dtok), dtok.eos_token_id), dtok, root / "qwen3")
    return out


def save_sequence_classifier(
    base: Path, folder: Path, id2label: dict, tokenizer_dir: Path | None = None
) -> Path:
    """A random-weight `*ForSequenceClassification` of `base`'s config with these labels (one: a cross-encoder's
    or a reward model's head), its head's weights scaled up so the results are far from the head's bias;
    `tokenizer_dir`: whose tokenizer it ships (default: the base's)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(base)
    config.id2label = id2label
    config.label2id = {v: k for k, v in id2label.items()}
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    perturb_norms_and_biases(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("classifier", "score")):
                p.mul_(30)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir or base).save_pretrained(folder)
    return folder


def save_sentence_model(
    base: Path,
    folder: Path,
    pooling="mean",
    include_prompt: bool = True,
    normalize: bool = False,
    dense: int | None = None,
    prompts: dict | None = None,
    default_prompt_name: str | None = None,
    max_seq_length: int | None = None,
) -> Path:
    """sentence-transformers 6's folder of `base` with these modules, through its own save()."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    modules = [Transformer(str(base), max_seq_length=max_seq_length)]
    modules.append(Pooling(HIDDEN, pooling_mode=pooling, include_prompt=include_prompt))
    if dense:
        torch.manual_seed(1)
        width = HIDDEN * (len(pooling) if isinstance(pooling, tuple) else 1)
        modules.append(Dense(width, dense, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default_prompt_name)
    model.save(str(folder))
    return folder


def save_legacy_layout(
    base: Path, folder: Path, pooling: str, normalize: bool, max_seq_length: int, prompts: dict | None = None
) -> Path:
    """The older layout, written by hand as Qwen3-Embedding's is: the model at the root, module types
    `sentence_transformers.models.*`, `pooling_mode_<mode>` flags, no Normalize folder (its config is empty)."""
    import shutil

    shutil.copytree(base, folder)
    flags = {
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken",
        "include_prompt": True,
    }
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": HIDDEN, **flags})
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    config = {"max_seq_length": max_seq_length, "do_lower_case": False}
    (folder / "sentence_bert_config.json").write_text(json.dumps(config))
    st = {"prompts": prompts or {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st))
    return folder
