"""A text whose tokenizer makes ids past the model's input embedding (tokens added to the tokenizer, no rows added
to the embedding) is that prompt's error, its batch-mates complete (issue 53, item 6): LLM.generate and chat, a
generation job's row, and every pooling task (LLM.embed, classify, score, reward, and a job). It used to raise
a raw `IndexError: index out of range in self` for the whole call. The bound is the embedding's own row count,
read here from the checkpoint's weights, independently of batchrun."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from embedding_models import encoder_config, save_base_model, save_sentence_model, save_sequence_classifier
from helpers import chat_ids, hf_greedy, write_job
from safetensors import safe_open

from batchrun import LLM, SamplingParams
from batchrun.job import run_job

ADDED = ["<unseen_a>", "<unseen_b>"]


def rows_on_disk(folder, suffix: str = "embed_tokens.weight") -> int:
    """The input embedding's rows, from the checkpoint's tensor itself."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        (name,) = [k for k in f.keys() if k.endswith(suffix)]
        return f.get_slice(name).get_shape()[0]


def outside(token_ids: list[int], rows: int) -> str:
    """The error of a prompt whose first id past the embedding is at its position in `token_ids`."""
    position = next(i for i, t in enumerate(token_ids) if t >= rows)
    return (
        f"token id {token_ids[position]} (position {position}) is outside the vocabulary: this model's input "
        f"embedding has {rows} rows (token ids 0 .. {rows - 1})"
    )


@pytest.fixture(scope="module")
def added_tokens_model(tmp_path_factory, model_dir):
    """The default model's weights with a tokenizer that has two tokens more than its embedding has rows."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("added") / "model"
    folder.mkdir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.add_tokens(ADDED) == 2
    tok.save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(model_dir / name, folder / name)
    (folder / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def llm(added_tokens_model):
    return LLM(str(added_tokens_model), device="cpu", dtype="float32", num_pages=256, swap_space="64MiB")


def test_generate_and_chat_make_an_added_token_that_prompts_error(llm, added_tokens_model, model_dir):
    from transformers import AutoTokenizer

    rows = rows_on_disk(model_dir)
    tok = AutoTokenizer.from_pretrained(added_tokens_model)
    good, bad = "Once upon a time", f"A story about {ADDED[0]} and the sea"
    outs = llm.generate(
        [good, bad, {"prompt": ADDED[1]}, [5, 6, 7]], SamplingParams(max_tokens=6), use_tqdm=False
    )
    want = hf_greedy(model_dir, [tok(good)["input_ids"], [5, 6, 7]], 6)
    assert [outs[0].error, outs[3].error] == [None, None]
    assert [outs[0].outputs[0].token_ids, outs[3].outputs[0].token_ids] == want
    for i, text in [(1, bad), (2, ADDED[1])]:
        assert outs[i].error == f"prompt {i}: {outside(tok(text)['input_ids'], rows)}"
        assert [(c.finish_reason, c.token_ids) for c in outs[i].outputs] == [("error", [])]
    conversations = [[{"role": "user", "content": good}], [{"role": "user", "content": bad}]]
    chats = llm.chat(conversations, SamplingParams(max_tokens=6), use_tqdm=False)
    assert chats[0].outputs[0].token_ids == hf_greedy(model_dir, [chat_ids(tok, good)], 6)[0]
    assert chats[1].error == f"prompt 1: {outside(chat_ids(tok, bad), rows)}"
    too_far = llm.generate([[5, rows]], use_tqdm=False)  # a token-id prompt: the same check, the same words
    assert too_far[0].error == f"prompt 0: {outside([5, rows], rows)}"
    assert not llm.engine.has_unfinished() and llm.engine.num_used_pages == 0


def test_a_jobs_row_with_an_added_token_is_an_error_row(added_tokens_model, model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(added_tokens_model)
    prompts = ["Name a color.", f"Name {ADDED[1]}."]
    pq.write_table(pa.table({"id": [0, 1], "prompt": prompts}), tmp_path / "in.parquet")
    job = write_job(
        tmp_path / "job.yaml",
        f"name: v\nmodel: {{path: {added_tokens_model}, dtype: float32}}\n"
        f"input: {{parquet: {tmp_path / 'in.parquet'}, id_column: id}}\nsampling: {{max_new_tokens: 6}}\n"
        f"engine: {{num_pages: 64, device: cpu}}\noutput: {{path: {tmp_path / 'out'}, token_ids: true}}\n",
    )
    summary = run_job(str(job), progress=False)
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert rows[0]["error"] is None
    assert rows[0]["completion_token_ids"] == hf_greedy(model_dir, [chat_ids(tok, prompts[0])], 6)[0]
    assert rows[1]["error"] == outside(chat_ids(tok, prompts[1]), rows_on_disk(model_dir))
    assert rows[1]["finish_reason"] == "error" and summary["error_rows"] == 1


@pytest.fixture(scope="module")
def pooling_models(tmp_path_factory):
    """A BERT whose WordPiece tokenizer has a token added past its embedding: an embedder, a classifier of three
    labels and a one-label head (a cross-encoder, a reward model)."""
    from embedding_models import wordpiece_tokenizer

    root = tmp_path_factory.mktemp("pooling-added")
    tok = wordpiece_tokenizer(root / "wordpiece")
    config = encoder_config("bert", len(tok))
    tok.add_tokens(["zqxunseen"])
    base = save_base_model(config, tok, root / "bert")
    return {
        "base": base,
        "embed": save_sentence_model(base, root / "embedder", pooling="mean"),
        "classify": save_sequence_classifier(base, root / "classifier", {0: "a", 1: "b", 2: "c"}),
        "head": save_sequence_classifier(base, root / "head", {0: "relevance"}),
    }


def head_logits(folder, *texts) -> torch.Tensor:
    """The checkpoint's AutoModelForSequenceClassification on one input alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(**AutoTokenizer.from_pretrained(folder)(*texts, return_tensors="pt")).logits[0]


def test_every_pooling_method_makes_an_added_token_that_inputs_error(pooling_models):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    rows = rows_on_disk(pooling_models["base"], "word_embeddings.weight")
    tok = AutoTokenizer.from_pretrained(pooling_models["base"])
    good, bad = "the sea", "the zqxunseen sea"
    error = outside(tok(bad)["input_ids"], rows)

    def pooling(name):
        return LLM(str(pooling_models[name]), dtype="float32", device="cpu", runner="pooling")

    embedded = pooling("embed").embed([good, bad], use_tqdm=False)
    want = SentenceTransformer(str(pooling_models["embed"]), device="cpu").encode(
        [good], convert_to_tensor=True
    )
    assert (torch.tensor(embedded[0].outputs.embedding) - want[0]).abs().max() < 1e-5
    classified = pooling("classify").classify([bad, good], use_tqdm=False)
    probs = head_logits(pooling_models["classify"], good).softmax(-1)
    assert (torch.tensor(classified[1].outputs.probs) - probs).abs().max() < 1e-5
    head = pooling("head")
    scored = head.score(good, [bad, "water"], use_tqdm=False)
    relevance = head_logits(pooling_models["head"], good, "water")[0].sigmoid()
    assert abs(scored[1].outputs.score - relevance.item()) < 1e-5
    rewarded = head.reward([good, bad], use_tqdm=False)
    assert abs(rewarded[0].outputs.data[0] - head_logits(pooling_models["head"], good)[0].item()) < 1e-5
    assert [embedded[1].error, classified[0].error, rewarded[1].error] == [error] * 3
    assert scored[0].error == outside(tok(good, bad)["input_ids"], rows)
    assert [o.outputs for o in (embedded[1], classified[0], scored[0], rewarded[1])] == [None] * 4


def test_a_pooling_jobs_row_with_an_added_token_is_an_error_row(pooling_models, tmp_path):
    from transformers import AutoTokenizer

    texts = ["the sea", "the zqxunseen sea", "rain"]
    pq.write_table(pa.table({"id": [0, 1, 2], "prompt": texts}), tmp_path / "in.parquet")
    job = {
        "name": "emb",
        "task": "embed",
        "model": {"path": str(pooling_models["embed"]), "dtype": "float32"},
        "input": {"parquet": str(tmp_path / "in.parquet"), "id_column": "id"},
        "engine": {"device": "cpu"},
        "output": {"path": str(tmp_path / "out")},
    }
    summary = run_job(job, progress=False)
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    tok = AutoTokenizer.from_pretrained(pooling_models["base"])
    rows_on_embedding = rows_on_disk(pooling_models["base"], "word_embeddings.weight")
    assert rows[1]["error"] == outside(tok(texts[1])["input_ids"], rows_on_embedding)
    assert rows[1]["embedding"] is None and summary["error_rows"] == 1
    assert rows[0]["error"] is None and rows[2]["error"] is None and len(rows[2]["embedding"]) == 32
