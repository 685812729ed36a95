"""task: score (a cross-encoder over pairs) and task: reward (a reward model's score head) against transformers'
AutoModelForSequenceClassification run one input at a time (fp32, within 1e-5) and sentence-transformers'
CrossEncoder.predict; the job file's `score` column, error rows for a bad pair or conversation, and what is
refused, naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from embedding_models import save_bases, save_sequence_classifier
from helpers import run_cli

from batchrun.errors import BadInput
from batchrun.job import run_job

TANH = "torch.nn.modules.activation.Tanh"
QUERIES = ["how many dogs", "the sea", "what is the water like when it rain", "a"]
PASSAGES = [
    "the dogs are two and the cats are one",
    "rain on the sea is water",
    "what do you know about the long day when the water came down " * 3,
    "a",
]
CONVERSATIONS = [
    [{"role": "user", "content": "how many dogs"}, {"role": "assistant", "content": "two dogs"}],
    [
        {"role": "system", "content": "you answer in one word"},
        {"role": "user", "content": "the sea?"},
        {"role": "assistant", "content": "water, and a long day of rain on it " * 3},
    ],
    [{"role": "user", "content": "what is it"}],  # no reply yet: the prompt alone is rewarded
]


@pytest.fixture(scope="module")
def bases(tmp_path_factory, model_dir):
    return save_bases(tmp_path_factory.mktemp("bases"), model_dir, ["bert", "xlm-roberta"])


@pytest.fixture(scope="module")
def reward_model(bases, tmp_path_factory, model_dir):
    """A Qwen3 reward model (one label) on the default model's tokenizer, which has a chat template."""
    return save_sequence_classifier(
        bases["qwen3"], tmp_path_factory.mktemp("reward") / "rm", {0: "reward"}, tokenizer_dir=model_dir
    )


def cross_encoder(bases, family, tmp_path, activation: str | None = None):
    folder = save_sequence_classifier(bases[family], tmp_path / f"{family}-ce", {0: "relevance"})
    if activation:
        config = json.loads((folder / "config.json").read_text())
        config["sentence_transformers"] = {"activation_fn": activation}
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def pooling_llm(folder):
    from batchrun import LLM

    return LLM(str(folder), dtype="float32", device="cpu", runner="pooling")


def reference_logits(folder, inputs: list[dict]) -> torch.Tensor:
    """The checkpoint's own AutoModelForSequenceClassification, one input at a time (its first logit)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.stack([model(**encoded).logits[0, 0] for encoded in inputs])


def assert_close(a, b) -> None:
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    assert a.shape == b.shape and (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_score_equals_the_cross_encoder_run_one_pair_at_a_time(bases, tmp_path, family):
    """Pairs packed into one row (BERT's segment ids 0 then 1), each pair's score against the model on the pair
    alone through a sigmoid, and against sentence-transformers' CrossEncoder.predict; one query against many
    passages gives the same scores as the query repeated."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    folder = cross_encoder(bases, family, tmp_path)
    outs = pooling_llm(folder).score(QUERIES, PASSAGES, use_tqdm=False)
    assert all(o.error is None for o in outs)
    got = [o.outputs.score for o in outs]
    tok = AutoTokenizer.from_pretrained(folder)
    logits = reference_logits(folder, [tok(q, p, return_tensors="pt") for q, p in zip(QUERIES, PASSAGES)])
    assert_close(got, logits.sigmoid())
    assert_close(got, CrossEncoder(str(folder), device="cpu").predict(list(zip(QUERIES, PASSAGES))))
    assert [o.prompt for o in outs] == list(zip(QUERIES, PASSAGES))
    assert outs[0].prompt_token_ids == tok(QUERIES[0], PASSAGES[0])["input_ids"]
    one_query = pooling_llm(folder).score(QUERIES[1], PASSAGES, use_tqdm=False)
    many = pooling_llm(folder).score([QUERIES[1]] * len(PASSAGES), PASSAGES, use_tqdm=False)
    assert_close([o.outputs.score for o in one_query], [o.outputs.score for o in many])


def test_the_activation_the_checkpoint_names_is_applied_and_an_unknown_one_refused(bases, tmp_path):
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    folder = cross_encoder(bases, "bert", tmp_path, activation="torch.nn.modules.linear.Identity")
    got = [o.outputs.score for o in pooling_llm(folder).score(QUERIES, PASSAGES, use_tqdm=False)]
    tok = AutoTokenizer.from_pretrained(folder)
    logits = reference_logits(folder, [tok(q, p, return_tensors="pt") for q, p in zip(QUERIES, PASSAGES)])
    assert_close(got, logits)  # no sigmoid
    assert_close(got, CrossEncoder(str(folder), device="cpu").predict(list(zip(QUERIES, PASSAGES))))
    odd = cross_encoder(bases, "bert", tmp_path / "odd", activation="torch.nn.modules.activation.GELU")
    with pytest.raises(BadInput, match="key `task`.*GELU"):
        pooling_llm(odd).score(QUERIES, PASSAGES, use_tqdm=False)


def saved_cross_encoder(bases, folder, activation_fn) -> Path:
    """A cross-encoder saved by sentence-transformers 6's CrossEncoder.save: its activation in
    config_sentence_transformers.json (`activation_fn`), none in config.json."""
    from sentence_transformers import CrossEncoder

    plain = save_sequence_classifier(
        bases["bert"], folder.with_name(folder.name + "-plain"), {0: "relevance"}
    )
    CrossEncoder(str(plain), device="cpu", activation_fn=activation_fn).save(str(folder))
    assert "sentence_transformers" not in json.loads((folder / "config.json").read_text())
    return folder


def test_the_activation_a_sentence_transformers_6_save_names_is_applied(bases, tmp_path):
    """CrossEncoder.save writes the activation into config_sentence_transformers.json, which CrossEncoder reads
    before config.json's keys: scored through LLM.score and a job as CrossEncoder.predict scores them, and an
    unknown one there refused, naming it and the file."""
    from sentence_transformers import CrossEncoder

    folder = saved_cross_encoder(bases, tmp_path / "identity", torch.nn.Identity())
    config = json.loads((folder / "config.json").read_text())  # the older key, which the file's outranks
    (folder / "config.json").write_text(
        json.dumps(config | {"sentence_transformers": {"activation_fn": TANH}})
    )
    expected = CrossEncoder(str(folder), device="cpu").predict(list(zip(QUERIES, PASSAGES)))
    got = [o.outputs.score for o in pooling_llm(folder).score(QUERIES, PASSAGES, use_tqdm=False)]
    assert_close(got, expected)
    data = tmp_path / "pairs.parquet"
    pq.write_table(
        pa.table({"id": list(range(4)), "prompt": QUERIES, "passage": PASSAGES, "topic": [0] * 4}), data
    )
    run_job(score_job(folder, data, tmp_path / "out"), progress=False)
    rows = sorted(pq.read_table(tmp_path / "out").to_pylist(), key=lambda r: r["id"])
    assert_close([r["score"] for r in rows], expected)
    st_file = folder / "config_sentence_transformers.json"
    st = json.loads(st_file.read_text())
    st_file.write_text(json.dumps(st | {"activation_fn": "torch.nn.modules.activation.GELU"}))
    with pytest.raises(BadInput, match=f"GELU.*{st_file}: activation_fn"):
        pooling_llm(folder).score(QUERIES, PASSAGES, use_tqdm=False)
    job = score_job(folder, data, tmp_path / "out2")
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    result = run_cli("validate", str(tmp_path / "job.yaml"))
    assert result.returncode == 2 and "GELU" in result.stderr and str(st_file) in result.stderr


def test_reward_equals_the_model_on_each_conversation_alone(reward_model):
    """Conversations (the last reply included) through the chat template, and a plain text, packed together:
    each reward equals the model's logit on the input alone, as transformers' apply_chat_template tokenizes it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reward_model)
    inputs = [*CONVERSATIONS, "a plain text to reward"]
    outs = pooling_llm(reward_model).reward(inputs, use_tqdm=False)
    assert all(o.error is None for o in outs)
    encoded = [
        tok.apply_chat_template(c, tokenize=True, return_dict=True, return_tensors="pt")
        for c in CONVERSATIONS
    ]
    encoded.append(tok(inputs[-1], return_tensors="pt"))
    assert_close([o.outputs.data[0] for o in outs], reference_logits(reward_model, encoded))
    assert [o.prompt_token_ids for o in outs] == [e["input_ids"][0].tolist() for e in encoded]
    (alone,) = pooling_llm(reward_model).reward(CONVERSATIONS[0], use_tqdm=False)
    assert_close(alone.outputs.data, outs[0].outputs.data)  # alone as beside the others


def test_bad_pairs_and_conversations_are_their_rows_errors(bases, reward_model, tmp_path):
    llm = pooling_llm(cross_encoder(bases, "bert", tmp_path))
    outs = llm.score(["the sea", "", "a"], ["water", "water", None], use_tqdm=False)
    assert outs[0].error is None and outs[0].outputs.score is not None
    assert (outs[1].error, outs[2].error) == ("text is empty", "pair is null")
    assert outs[1].outputs is None and outs[2].outputs is None
    with pytest.raises(BadInput, match="text_1 has 2 texts and text_2 3"):
        llm.score(["a", "b"], ["a", "b", "c"])
    outs = pooling_llm(reward_model).reward(
        [[{"role": "assistant", "content": "hi"}], [{"role": "user"}], CONVERSATIONS[0]], use_tqdm=False
    )
    assert "no user turn" in outs[0].error and "has no content" in outs[1].error
    assert outs[2].error is None


def test_heads_of_several_labels_and_embedders_are_refused(bases, tmp_path):
    three = save_sequence_classifier(bases["bert"], tmp_path / "three", {0: "a", 1: "b", 2: "c"})
    with pytest.raises(BadInput, match=r"key `task`: score reads a head of one label.*has 3"):
        pooling_llm(three).score("a", "b")
    with pytest.raises(BadInput, match="key `task`: reward"):
        pooling_llm(three).reward("a")
    from batchrun import LLM

    embedder = LLM(str(bases["bert"]), device="cpu", runner="pooling", pooler={"pooling": "mean"})
    with pytest.raises(BadInput, match="LLM.score: this LLM runs embed"):  # an embedder has no head
        embedder.score("a", "b")


def score_job(folder, data, out, **extra) -> dict:
    return {
        "name": "rerank",
        "task": "score",
        "model": {"path": str(folder), "dtype": "float32"},
        "input": {
            "parquet": str(data),
            "id_column": "id",
            "pair_column": "passage",
            "passthrough": ["topic"],
        },
        "engine": {"device": "cpu", "max_num_batched_tokens": 48},  # several steps
        "output": {"path": str(out), "rows_per_part": 2},
        **extra,
    }


def test_score_job_writes_a_score_column_and_error_rows(bases, tmp_path):
    folder = cross_encoder(bases, "bert", tmp_path)
    queries, passages = [*QUERIES, "the sea", ""], [*PASSAGES, None, "water"]
    data = tmp_path / "pairs.parquet"
    ids = [f"q{i}" for i in range(len(queries))]
    pq.write_table(
        pa.table({"id": ids, "query": queries, "passage": passages, "topic": list(range(len(ids)))}), data
    )
    out = tmp_path / "out"
    job = score_job(folder, data, out)
    job["input"]["prompt_column"] = "query"
    summary = run_job(job, progress=False)
    table = pq.read_table(out)
    assert table.column_names == ["id", "sample", "error", "prompt_tokens", "score", "topic"]
    assert table.schema.field("score").type == pa.float32()
    rows = {r["id"]: r for r in table.to_pylist()}
    assert (rows["q4"]["error"], rows["q5"]["error"]) == ("pair is null", "text is empty")
    assert rows["q4"]["score"] is None
    expected = pooling_llm(folder).score(QUERIES, PASSAGES, use_tqdm=False)
    assert_close([rows[f"q{i}"]["score"] for i in range(4)], [o.outputs.score for o in expected])
    assert summary["steps"] > 1 and summary["padding_tokens_avoided"] > 0
    assert run_job(job, progress=False) is None  # resumed: all done
    job["input"]["pair_column"] = "nope"  # a column the table lacks: exit 2 naming the key
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    result = run_cli("validate", str(path))
    assert result.returncode == 2 and "input.pair_column" in result.stderr and "'nope'" in result.stderr
    job["task"] = "embed"  # a pair column on another task: exit 2 naming it
    with pytest.raises(BadInput, match="`input.pair_column` applies to task score"):
        run_job(job, progress=False)


def test_reward_job_over_conversations(reward_model, tmp_path):
    conversations = [*CONVERSATIONS, [{"role": "assistant", "content": "hi"}]]
    data = tmp_path / "convs.parquet"
    pq.write_table(pa.table({"id": list(range(4)), "prompt": conversations}), data)
    out = tmp_path / "out"
    job = {
        "name": "rewards",
        "task": "reward",
        "model": {"path": str(reward_model), "dtype": "float32"},
        "input": {"parquet": str(data), "id_column": "id"},
        "engine": {"device": "cpu"},
        "output": {"path": str(out)},
    }
    run_job(job, progress=False)
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert "no user turn" in rows[3]["error"] and rows[3]["score"] is None
    expected = pooling_llm(reward_model).reward(CONVERSATIONS, use_tqdm=False)
    assert_close([rows[i]["score"] for i in range(3)], [o.outputs.data[0] for o in expected])
