"""task: score (a cross-encoder over pairs) and task: reward (a reward model's score head) against transformers'
AutoModelForSequenceClassification run one input at a time (fp32, within 1e-5) and sentence-transformers'
CrossEncoder.predict; the job file's `score` column, error rows for a bad pair or conversation, and what is
refused, naming the key."""

from __future__ import annotations

import json
import shutil
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


def saved_cross_encoder(bases, folder, **settings) -> Path:
    """A cross-encoder saved by sentence-transformers 6's CrossEncoder.save with these CrossEncoder settings
    (activation_fn, prompts, default_prompt_name, max_length; `modules`: a function of the plain folder giving
    its modules): its settings in its own files (the activation in config_sentence_transformers.json), none in
    config.json."""
    from sentence_transformers import CrossEncoder

    plain = save_sequence_classifier(
        bases["bert"], folder.with_name(folder.name + "-plain"), {0: "relevance"}
    )
    if "modules" in settings:
        CrossEncoder(modules=settings.pop("modules")(plain), device="cpu", **settings).save(str(folder))
    else:
        CrossEncoder(str(plain), device="cpu", **settings).save(str(folder))
    assert "sentence_transformers" not in json.loads((folder / "config.json").read_text())
    return folder


def test_the_activation_a_sentence_transformers_6_save_names_is_applied(bases, tmp_path):
    """CrossEncoder.save writes the activation into config_sentence_transformers.json, which CrossEncoder reads
    before config.json's keys: scored through LLM.score and a job as CrossEncoder.predict scores them, and an
    unknown one there refused, naming it and the file."""
    from sentence_transformers import CrossEncoder

    folder = saved_cross_encoder(bases, tmp_path / "identity", activation_fn=torch.nn.Identity())
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


def test_empty_texts_are_scored_as_the_cross_encoder_scores_them_and_bad_inputs_are_errors(
    bases, reward_model, tmp_path
):
    """An empty or blank text on either side is a pair CrossEncoder.predict scores (the special tokens around
    the other text), and so does batchrun; a null text, a malformed conversation, and a text or conversation with
    no tokens (transformers cannot run one either) are their rows' errors, each saying what it has."""
    from sentence_transformers import CrossEncoder

    folder = cross_encoder(bases, "bert", tmp_path)
    llm = pooling_llm(folder)
    firsts, seconds = ["the sea", "", "  ", "a"], ["water", "water", "", None]
    outs = llm.score(firsts, seconds, use_tqdm=False)
    assert [o.error for o in outs] == [None, None, None, "pair is null"] and outs[3].outputs is None
    expected = CrossEncoder(str(folder), device="cpu").predict(list(zip(firsts[:3], seconds[:3])))
    assert_close([o.outputs.score for o in outs[:3]], expected)
    with pytest.raises(BadInput, match="text_1 has 2 texts and text_2 3"):
        llm.score(["a", "b"], ["a", "b", "c"])
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(reward_model)("")["input_ids"] == []  # nothing for a model to read
    bad = [
        [{"role": "assistant", "content": "hi"}],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        [],
        "",
        CONVERSATIONS[0],
    ]
    outs = pooling_llm(reward_model).reward(bad, use_tqdm=False)
    errors = [o.error for o in outs]
    assert "no user turn" in errors[0] and "turn 1 (user) has no content" in errors[1]
    assert "turn 1 (user) has content of type int" in errors[2]
    assert "no user turn" in errors[3] and "nothing to answer" not in errors[3]  # ending on a reply is normal
    assert errors[4] == "the text has no tokens" and errors[5] is None


def test_heads_of_several_labels_and_embedders_are_refused(bases, tmp_path):
    three = save_sequence_classifier(bases["bert"], tmp_path / "three", {0: "a", 1: "b", 2: "c"})
    # the Python API's words, not the job file's (it said "key `task`: ... use task classify")
    with pytest.raises(
        BadInput, match=r"^LLM.score reads a head of one label.*has 3.*LLM.classify gives"
    ) as e:
        pooling_llm(three).score("a", "b")
    assert "key `task`" not in str(e.value)
    with pytest.raises(BadInput, match=r"^LLM.reward reads a head of one label \(a reward model's\)"):
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


def reward_job(folder, conversations, tmp_path) -> dict:
    """A reward job over `conversations` (ids 0..), written to tmp_path / "out"."""
    data = tmp_path / "convs.parquet"
    pq.write_table(pa.table({"id": list(range(len(conversations))), "prompt": conversations}), data)
    return {
        "name": "rewards",
        "task": "reward",
        "model": {"path": str(folder), "dtype": "float32"},
        "input": {"parquet": str(data), "id_column": "id"},
        "engine": {"device": "cpu"},
        "output": {"path": str(tmp_path / "out")},
    }


def test_score_job_writes_a_score_column_and_error_rows(bases, tmp_path):
    """Scores equal CrossEncoder.predict's, an empty query's and an over-long pair's (cut as CrossEncoder cuts
    it, and counted) included; a null passage is its row's error, naming the job's column."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    folder = cross_encoder(bases, "bert", tmp_path)
    queries, passages = [*QUERIES, "the sea", "", "the sea"], [*PASSAGES, None, "water", PASSAGES[2] * 4]
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
    assert (
        rows["q4"]["error"] == "column 'passage' is null" and rows["q4"]["score"] is None
    )  # the job's names
    scored = [i for i in range(len(ids)) if i != 4]  # an empty query scored; a pair over the positions cut
    expected = CrossEncoder(str(folder), device="cpu").predict([(queries[i], passages[i]) for i in scored])
    assert_close([rows[f"q{i}"]["score"] for i in scored], expected)
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok("the sea", PASSAGES[2] * 4)["input_ids"]) > 128 == rows["q6"]["prompt_tokens"]
    assert summary["steps"] > 1 and summary["padding_tokens_avoided"] > 0 and summary["truncated_rows"] == 1
    assert run_job(job, progress=False) is None  # resumed: all done
    job["input"]["pair_column"] = "nope"  # a column the table lacks: exit 2 naming the key
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    result = run_cli("validate", str(path))
    assert result.returncode == 2 and "input.pair_column" in result.stderr and "'nope'" in result.stderr
    job["task"] = "embed"  # a pair column on another task: exit 2 naming it
    with pytest.raises(BadInput, match="`input.pair_column` applies to tasks score and classify"):
        run_job(job, progress=False)


def test_reward_job_over_conversations(reward_model, tmp_path):
    conversations = [*CONVERSATIONS, [{"role": "assistant", "content": "hi"}]]
    run_job(reward_job(reward_model, conversations, tmp_path), progress=False)
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert "no user turn" in rows[3]["error"] and rows[3]["score"] is None
    expected = pooling_llm(reward_model).reward(CONVERSATIONS, use_tqdm=False)
    assert_close([rows[i]["score"] for i in range(3)], [o.outputs.data[0] for o in expected])


def test_an_over_long_text_or_conversation_is_its_rows_error_unless_a_cut_is_asked_for(
    bases, reward_model, tmp_path
):
    """transformers runs a reward or classify input whole: one over the model's positions is its row's error,
    naming its length (as the chat template tokenizes it) and the limit, and the other rows run; with
    pooler.truncate_prompt_tokens the cut is asked for, and the input is scored as the model scores its first
    tokens."""
    from transformers import AutoTokenizer

    from batchrun import LLM

    long = [{"role": "user", "content": "the sea " * 300}, {"role": "assistant", "content": "water"}]
    tok = AutoTokenizer.from_pretrained(reward_model)
    length = len(tok.apply_chat_template(long, tokenize=True, return_dict=True)["input_ids"])
    assert length > 512  # the reward model's positions
    run_job(reward_job(reward_model, [long, CONVERSATIONS[0]], tmp_path), progress=False)
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert (
        rows[0]["error"]
        == f"the conversation has {length} tokens, more than the model's 512 positions (set "
        "pooler.truncate_prompt_tokens to cut it)"
        and rows[0]["score"] is None
    )
    assert rows[1]["error"] is None
    cut = LLM(
        str(reward_model),
        dtype="float32",
        device="cpu",
        runner="pooling",
        pooler={"truncate_prompt_tokens": 64},
    )
    (out,) = cut.reward(long, use_tqdm=False)
    first = tok.apply_chat_template(long, tokenize=True, return_dict=True, return_tensors="pt")["input_ids"][
        :, :64
    ]
    assert out.prompt_token_ids == first[0].tolist()
    assert_close(out.outputs.data, reference_logits(reward_model, [{"input_ids": first}]))
    classifier = save_sequence_classifier(bases["bert"], tmp_path / "three", {0: "a", 1: "b", 2: "c"})
    words = AutoTokenizer.from_pretrained(classifier)
    outs = pooling_llm(classifier).classify([PASSAGES[2] * 4, "the sea"], use_tqdm=False)
    length = len(words(PASSAGES[2] * 4)["input_ids"])
    assert outs[0].error.startswith(f"the text has {length} tokens, more than the model's 128 positions")
    assert outs[1].error is None


def test_classify_takes_pairs_of_a_cross_encoder_of_several_labels(bases, tmp_path):
    """An NLI-style cross-encoder (three labels) over input.pair_column: each pair's probabilities equal the
    softmax of AutoModelForSequenceClassification's logits on the pair tokenized as CrossEncoder tokenizes it,
    and CrossEncoder.predict(apply_softmax=True); an empty side is scored, a null one is the row's error naming
    the job's column."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    labels = {0: "contradiction", 1: "entailment", 2: "neutral"}
    folder = save_sequence_classifier(bases["bert"], tmp_path / "nli", labels)
    queries, passages = [*QUERIES, "", "the sea"], [*PASSAGES, "water", None]
    data = tmp_path / "pairs.parquet"
    ids = [f"q{i}" for i in range(len(queries))]
    pq.write_table(pa.table({"id": ids, "premise": queries, "hypothesis": passages, "topic": [0] * 6}), data)
    job = score_job(folder, data, tmp_path / "out", task="classify")
    job["input"] |= {"prompt_column": "premise", "pair_column": "hypothesis"}
    run_job(job, progress=False)
    table = pq.read_table(tmp_path / "out")
    assert table.column_names == ["id", "sample", "error", "prompt_tokens", "label", "probs", "topic"]
    rows = {r["id"]: r for r in table.to_pylist()}
    assert rows["q5"]["error"] == "column 'hypothesis' is null" and rows["q5"]["probs"] is None
    pairs = list(zip(queries[:5], passages[:5]))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = torch.cat([model(**tok([q], [p], return_tensors="pt")).logits for q, p in pairs])
    got = torch.tensor([rows[f"q{i}"]["probs"] for i in range(5)])
    assert_close(got, logits.softmax(dim=-1))
    assert_close(got, CrossEncoder(str(folder), device="cpu").predict(pairs, apply_softmax=True))
    assert [rows[f"q{i}"]["label"] for i in range(5)] == [labels[int(i)] for i in logits.argmax(dim=-1)]
    assert [rows[f"q{i}"]["prompt_tokens"] for i in range(5)] == [
        len(tok([q], [p])["input_ids"][0]) for q, p in pairs
    ]


def test_a_system_prompt_on_a_pooling_job_is_a_bad_job(reward_model, tmp_path):
    """A pooling row is scored as given: model.system_prompt is refused, naming the key, not left unused."""
    data = tmp_path / "convs.parquet"
    pq.write_table(pa.table({"id": [0], "prompt": [CONVERSATIONS[0]]}), data)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: r\ntask: reward\nmodel: {{path: {reward_model}}}\n"
        f"input: {{parquet: {data}}}\noutput: {{path: {tmp_path / 'out'}}}\n"
    )
    assert run_cli("validate", str(job)).returncode == 0
    result = run_cli("validate", str(job), "--set", "model.system_prompt=be brief")
    assert (
        result.returncode == 2
        and "model.system_prompt" in result.stderr
        and "task is reward" in result.stderr
    )


PROMPTS = {"query": "query: ", "doc": "passage about: "}


def test_a_saved_cross_encoders_prompt_is_put_before_the_query_as_predict_puts_it(bases, tmp_path):
    """CrossEncoder.predict puts the folder's default prompt (config_sentence_transformers.json) before each
    pair's first text; pooler.prompt_name picks another of its prompts ("" none), as predict's prompt_name does,
    through LLM.score and a job; a name the folder lacks is exit 2 naming the key."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    from batchrun import LLM

    folder = saved_cross_encoder(bases, tmp_path / "prompted", prompts=PROMPTS, default_prompt_name="query")
    pairs = list(zip(QUERIES, PASSAGES))
    theirs = CrossEncoder(str(folder), device="cpu")
    expected = theirs.predict(pairs)
    assert (
        abs(expected - theirs.predict(pairs, prompt="")) > 1e-5
    ).any()  # past assert_close: the prompt matters
    outs = pooling_llm(folder).score(QUERIES, PASSAGES, use_tqdm=False)
    assert_close([o.outputs.score for o in outs], expected)
    tok = AutoTokenizer.from_pretrained(folder)
    assert outs[0].prompt_token_ids == tok(["query: " + QUERIES[0]], [PASSAGES[0]])["input_ids"][0]
    assert outs[0].prompt == pairs[0]  # the row as given
    for name, reference in (
        ("doc", theirs.predict(pairs, prompt_name="doc")),
        ("", theirs.predict(pairs, prompt="")),
    ):
        llm = LLM(str(folder), dtype="float32", device="cpu", runner="pooling", pooler={"prompt_name": name})
        assert_close([o.outputs.score for o in llm.score(QUERIES, PASSAGES, use_tqdm=False)], reference)
    data = tmp_path / "pairs.parquet"
    pq.write_table(
        pa.table({"id": list(range(4)), "prompt": QUERIES, "passage": PASSAGES, "topic": [0] * 4}), data
    )
    run_job(score_job(folder, data, tmp_path / "out", pooler={"prompt_name": "doc"}), progress=False)
    rows = sorted(pq.read_table(tmp_path / "out").to_pylist(), key=lambda r: r["id"])
    assert_close([r["score"] for r in rows], theirs.predict(pairs, prompt_name="doc"))
    (tmp_path / "job.yaml").write_text(
        json.dumps(score_job(folder, data, tmp_path / "o2", pooler={"prompt_name": "x"}))
    )
    result = run_cli("validate", str(tmp_path / "job.yaml"))
    assert result.returncode == 2 and "pooler.prompt_name" in result.stderr and "'x'" in result.stderr
    classify = score_job(folder, data, tmp_path / "o3", task="classify", pooler={"prompt_name": "doc"})
    del classify["input"]["pair_column"]  # texts, which transformers classifies with no prompt: refused
    (tmp_path / "job.yaml").write_text(json.dumps(classify))
    result = run_cli("validate", str(tmp_path / "job.yaml"))
    assert result.returncode == 2 and "pooler.prompt_name" in result.stderr
    with pytest.raises(BadInput, match="LLM.classify: pooler.prompt_name"):
        llm.classify(QUERIES)


def test_a_saved_cross_encoders_longest_pair_is_the_one_predict_cuts_at(bases, tmp_path):
    """predict cuts a pair at its Transformer module's max_seq_length: the tokenizer's model_max_length that
    CrossEncoder(max_length=...).save writes, or an older sentence_bert_config.json's max_seq_length (which
    outranks it, not capped at the model's positions); batchrun cuts at the same length and counts the cut."""
    from sentence_transformers import CrossEncoder

    long_pairs = [("the sea " * 5, PASSAGES[2]), ("a", "b"), (PASSAGES[2], "the sea")]
    saved = saved_cross_encoder(bases, tmp_path / "sixteen", max_length=16)
    older = tmp_path / "twelve"
    shutil.copytree(saved, older)
    bert_config = older / "sentence_bert_config.json"
    bert_config.write_text(json.dumps(json.loads(bert_config.read_text()) | {"max_seq_length": 12}))
    for folder, length in ((saved, 16), (older, 12)):
        theirs = CrossEncoder(str(folder), device="cpu")
        assert theirs.max_seq_length == length
        outs = pooling_llm(folder).score(*map(list, zip(*long_pairs)), use_tqdm=False)
        assert_close([o.outputs.score for o in outs], theirs.predict(long_pairs))
        assert [len(o.prompt_token_ids) for o in outs] == [
            len(theirs.preprocess([p])["input_ids"][0]) for p in long_pairs
        ]
    data = tmp_path / "pairs.parquet"
    queries, passages = map(list, zip(*long_pairs))
    pq.write_table(
        pa.table({"id": [0, 1, 2], "prompt": queries, "passage": passages, "topic": [0] * 3}), data
    )
    summary = run_job(score_job(older, data, tmp_path / "out"), progress=False)
    rows = sorted(pq.read_table(tmp_path / "out").to_pylist(), key=lambda r: r["id"])
    assert [r["prompt_tokens"] for r in rows] == [12, 5, 12] and summary["truncated_rows"] == 2


def test_a_cross_encoder_module_or_setting_batchrun_does_not_apply_is_refused(bases, tmp_path):
    """A module after the Transformer in modules.json (a Dense over the scores, which predict applies) and a
    Transformer setting batchrun does not reproduce are refused by LLM.score and by a job (exit 2), naming the
    module or key and the file, never scored without them."""
    from sentence_transformers.base.modules import Dense, Transformer

    def with_dense(plain):
        torch.manual_seed(0)
        head = Dense(1, 1, activation_function=None, module_input_name="scores")
        return [Transformer(str(plain), transformer_task="sequence-classification"), head]

    dense = saved_cross_encoder(bases, tmp_path / "dense", modules=with_dense)
    modules_file = dense / "modules.json"
    with pytest.raises(BadInput, match=f"{modules_file}.*1_Dense.*Dense"):
        pooling_llm(dense).score(QUERIES, PASSAGES, use_tqdm=False)
    data = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"id": [0], "prompt": ["a"], "passage": ["b"], "topic": [0]}), data)
    (tmp_path / "job.yaml").write_text(json.dumps(score_job(dense, data, tmp_path / "out")))
    result = run_cli("validate", str(tmp_path / "job.yaml"))
    assert result.returncode == 2 and str(modules_file) in result.stderr and "1_Dense" in result.stderr
    lower = saved_cross_encoder(bases, tmp_path / "lower")
    bert_config = lower / "sentence_bert_config.json"
    settings = json.loads(bert_config.read_text())
    for key, value in (("processing_kwargs", {"text": {"max_length": 8}}), ("do_lower_case", True)):
        bert_config.write_text(json.dumps(settings | {key: value}))
        with pytest.raises(BadInput, match=f"{bert_config}: {key}"):
            pooling_llm(lower).score(QUERIES, PASSAGES, use_tqdm=False)
