"""Builds what jobs/embed.yaml runs on, with no download: a Parquet table of passages (deterministic, 5 to N
words each) and a sentence-transformers folder of a MiniLM-L6-shaped BERT (6 layers, 384 wide, random weights)
on the embedded model's tokenizer, in sentence-transformers 6's layout (mean pooling, Normalize, e5-style
`query: ` / `passage: ` prompts, 256 tokens at most). Its vectors mean nothing: point the job's `model.path` at a
real embedding checkpoint for real ones. bench/embed.py builds its inputs with it too.

Run: .venv/bin/python jobs/make_embed_data.py [--out jobs/data/embed] [--texts 500] [--max-words 120]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "the water cycle moves heat and rain across the planet while rivers carve valleys into old stone and "
    "cities grow along their banks where trade and people gather to build markets schools and bridges over "
    "centuries of change in climate language music food and the slow work of farming the land"
).split()
MINILM_L6 = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
# Qwen3-Embedding-0.6B's config.json, less its 151,669-token vocabulary (the embedded model's tokenizer is used)
QWEN3_EMBEDDING_06B = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=3072, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)  # fmt: skip


def passages(n: int, max_words: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, max_words))) for _ in range(n)]


def make_model(folder: Path, max_seq_length: int = 256, shape: str = "minilm") -> Path:
    """The MiniLM-L6-shaped checkpoint, written as sentence-transformers 6 writes one; with shape="qwen3" a
    Qwen3-Embedding-0.6B-shaped one instead (`make_qwen3_embedding`)."""
    if shape == "qwen3":
        return make_qwen3_embedding(folder, max_seq_length)
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from batchrun.model_loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    tokenizer.model_max_length = max_seq_length
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **MINILM_L6)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    files = {
        "modules.json": [
            {
                "idx": 0,
                "name": "0",
                "path": "",
                "type": "sentence_transformers.base.modules.transformer.Transformer",
            },
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.base.modules.normalize.Normalize",
            },
        ],
        "sentence_bert_config.json": {
            "transformer_task": "feature-extraction",
            "modality_config": text,
            "module_output_name": "token_embeddings",
        },
        "config_sentence_transformers.json": {
            "prompts": {"query": "query: ", "document": "passage: "},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
        "1_Pooling/config.json": {"embedding_dimension": 384, "pooling_mode": "mean", "include_prompt": True},
        "2_Normalize/config.json": {},
    }
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(content, indent=2))
    return folder


def make_qwen3_embedding(folder: Path, max_seq_length: int = 512) -> Path:
    """A Qwen3-Embedding-0.6B-shaped decoder (28 layers, 1024 wide, random weights) in the layout its Hub folder
    has: the older one, module types `sentence_transformers.models.*`, last-token pooling of an end-of-text the
    tokenizer appends after every text, Normalize without a folder, its `query` instruction prompt."""
    import torch
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    from batchrun.model_loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    eos = tokenizer.eos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, tokenizer.eos_token_id)]
    )
    tokenizer.pad_token = eos
    tokenizer.model_max_length = max_seq_length
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        **QWEN3_EMBEDDING_06B,
    )  # fmt: skip
    Qwen3Model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    pooling = {"word_embedding_dimension": config.hidden_size, "include_prompt": True}
    for mode in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens"):
        pooling[f"pooling_mode_{mode}"] = False
    pooling["pooling_mode_lasttoken"] = True
    query = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
    files = {
        "modules.json": [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
        "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False},
        "config_sentence_transformers.json": {
            "prompts": {"query": query, "document": ""},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
        "1_Pooling/config.json": pooling,
    }
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(content, indent=2))
    return folder


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="jobs/data/embed")
    parser.add_argument("--texts", type=int, default=500)
    parser.add_argument("--max-words", type=int, default=120)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = passages(args.texts, args.max_words)
    table = pa.table(
        {
            "id": [f"p{i:05d}" for i in range(len(texts))],
            "text": texts,
            "words": [len(t.split()) for t in texts],
        }
    )
    pq.write_table(table, out / "passages.parquet")
    make_model(out / "model")
    print(
        f"{len(texts)} passages in {out / 'passages.parquet'}, and a MiniLM-L6-shaped embedder in {out / 'model'}"
    )


if __name__ == "__main__":
    main()
