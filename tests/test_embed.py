"""task: embed against sentence-transformers' own `encode` (fp32, the same checkpoint folder): every component
within 1e-5, for a BERT, an XLM-R, a ModernBERT (a sliding-window layer) and a Qwen3-Embedding-shaped decoder,
each pooling mode, prompts, Dense, Normalize and Matryoshka dimensions; a text's vector independent of its
batch-mates; the job file's Parquet output, error rows, resume; and what is refused, naming the key."""

from __future__ import annotations

import functools
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from embedding_models import (
    save_base_model,
    save_bases,
    save_legacy_layout,
    save_sentence_model,
    save_sequence_classifier,
    wordpiece_tokenizer,
)
from helpers import run_cli

from batchrun.engine.pooling.pooler import PoolerConfig
from batchrun.errors import BadInput
from batchrun.job import run_job
from batchrun.model_loader import open_model
from batchrun.pooling_worker import read_checkpoint

TEXTS = [
    "the cats and dogs",
    "rain on the sea is water",
    "a",
    "how many people call their dogs first",
    "what do you know about the long day when the water came down " * 4,  # past ModernBERT's local window
]
ENCODERS = ["bert", "xlm-roberta", "modernbert"]
MODES = ["cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]
QUERY = {"query": "query: search the passage "}


@pytest.fixture(scope="module")
def bases(tmp_path_factory, model_dir):
    """Base models: the three encoders on a WordPiece vocabulary, the decoder on the default model's tokenizer
    appending an end-of-text."""
    return save_bases(tmp_path_factory.mktemp("bases"), model_dir, ENCODERS)


def ours(folder, texts=TEXTS, **pooler) -> torch.Tensor:
    from batchrun import LLM

    llm = LLM(str(folder), dtype="float32", device="cpu", runner="pooling", pooler=pooler or None)
    assert (
        llm.pooling.rewrites["fused_encoder"] == 0
    )  # its post-ops are not bit-equal to HF's operations in fp32
    outs = llm.embed(texts, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return torch.tensor([o.outputs.embedding for o in outs])


def theirs(folder, texts=TEXTS, **options) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True, **options)


def assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ENCODERS)
@pytest.mark.parametrize("mode", MODES)
def test_encoder_pooling_modes_equal_sentence_transformers(bases, tmp_path, family, mode):
    folder = save_sentence_model(bases[family], tmp_path / "st", pooling=mode, normalize=mode != "max")
    assert_equal(ours(folder), theirs(folder))


@pytest.mark.parametrize("family", ENCODERS)
def test_prompt_dense_and_matryoshka_equal_sentence_transformers(bases, tmp_path, family):
    """A named prompt left out of the mean, a Dense layer (tanh), then the first 8 dimensions, normalised."""
    folder = save_sentence_model(
        bases[family], tmp_path / "st", pooling="mean", include_prompt=False, dense=16, prompts=QUERY
    )
    assert_equal(ours(folder, prompt_name="query"), theirs(folder, prompt_name="query"))
    assert_equal(
        ours(folder, prompt_name="query", dimensions=8, normalize=True),
        theirs(folder, prompt_name="query", truncate_dim=8, normalize_embeddings=True),
    )


def test_default_prompt_name_and_concatenated_modes(bases, tmp_path):
    folder = save_sentence_model(
        bases["bert"], tmp_path / "st", pooling=("cls", "mean"), prompts=QUERY, default_prompt_name="query"
    )
    assert_equal(ours(folder), theirs(folder))  # the folder's default prompt, in both
    assert_equal(ours(folder, prompt_name=""), theirs(folder, prompt=""))


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_qwen3_embedding_layout_equals_sentence_transformers(bases, tmp_path, mode):
    """Qwen3-Embedding's older layout: last-token pooling of the appended end-of-text, normalised, with and
    without its instruction prompt; causal attention within each text."""
    prompts = {"query": "Instruct: find the passage\nQuery: "}
    folder = save_legacy_layout(
        bases["qwen3"], tmp_path / "st", mode, normalize=True, max_seq_length=48, prompts=prompts
    )
    plan = read_checkpoint(open_model(str(folder)), PoolerConfig(), "test", "embed").plan
    assert plan.modes == (mode,) and plan.after == ("normalize",) and plan.max_length == 48
    assert_equal(ours(folder), theirs(folder))  # the long text is cut at 48 tokens in both
    assert_equal(ours(folder, prompt_name="query"), theirs(folder, prompt_name="query"))


def family_folder(bases, tmp_path, family):
    """A sentence-transformers folder of `family`: Qwen3 in the older layout with last-token pooling, the
    encoders in sentence-transformers 6's with mean pooling."""
    if family == "qwen3":
        return save_legacy_layout(
            bases[family], tmp_path / "st", "lasttoken", normalize=False, max_seq_length=64
        )
    return save_sentence_model(bases[family], tmp_path / "st", pooling="mean")


@pytest.mark.parametrize("family", ["bert", "modernbert", "qwen3"])
def test_a_vector_does_not_depend_on_its_batch_mates(bases, tmp_path, family):
    folder = family_folder(bases, tmp_path, family)
    alone = ours(folder, ["the cats and dogs"])
    beside = ours(folder, [TEXTS[4], "the cats and dogs", TEXTS[1]])
    assert (alone[0] - beside[1]).abs().max().item() < 1e-6


# texts of equal lengths (1 and 4, 2 and 5) in no length order: the runner packs them longest first, each
# length's texts attending in one call on a view of the row, and must hand each vector back to its own row
MIXED = [
    "a",
    TEXTS[4],
    "the cats and dogs",
    "rain on the sea is water",
    TEXTS[4].replace("water", "rain"),
    "the dogs and cats",
]


@pytest.mark.parametrize("family", ["bert", "modernbert", "qwen3"])
def test_texts_packed_out_of_order_land_on_their_own_rows(bases, tmp_path, family):
    """Equal to sentence-transformers and to each text alone, whatever order the packed row holds them in."""
    from batchrun import LLM

    folder = family_folder(bases, tmp_path, family)
    llm = LLM(str(folder), dtype="float32", device="cpu", runner="pooling")
    outs = llm.embed(MIXED, use_tqdm=False)
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert lengths[1] == lengths[4] > lengths[2] == lengths[5] > lengths[0]  # two runs of two texts
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert_equal(got, theirs(folder, MIXED))
    alone = torch.tensor([llm.embed([t], use_tqdm=False)[0].outputs.embedding for t in MIXED])
    assert (got - alone).abs().max().item() < 1e-6


def test_the_packed_layout_puts_texts_of_one_length_side_by_side():
    from batchrun.engine.attention import PackedLayout

    lengths = [3, 5, 3, 7, 5, 1]
    layout = PackedLayout.of_lengths(lengths)
    spans = list(layout.spans())
    assert [b - a for a, b in spans] == lengths
    assert sorted(a for a, _ in spans) == [0, 7, 12, 17, 20, 23]  # the row, longest first, no gap or overlap
    assert [(r.count, r.length) for r in layout.runs] == [(1, 7), (2, 5), (2, 3), (1, 1)]
    for run in layout.runs:  # each run holds exactly the texts of its length, side by side
        inside = sorted(a for a, b in spans if run.start <= a and b <= run.end)
        assert inside == list(range(run.start, run.end, run.length))
        assert all(lengths[i] == run.length for i, (a, _) in enumerate(spans) if a in inside)
    tokens = [[(i, p) for p in range(n)] for i, n in enumerate(lengths)]
    row = layout.packed(tokens)
    assert all(row[a:b] == tokens[i] for i, (a, b) in enumerate(spans))


def test_overriding_pooling_on_a_plain_checkpoint(bases):
    """No sentence-transformers files: pooler.pooling says how (sentence-transformers' default chain for a
    plain checkpoint is a mean over the transformer's states)."""
    with pytest.raises(BadInput, match=r"pooler\.pooling"):
        read_checkpoint(open_model(str(bases["bert"])), PoolerConfig(), "job.yaml", "embed")
    assert_equal(ours(bases["bert"], pooling="mean"), theirs(bases["bert"]))


def write_texts(path, texts):
    ids = [f"r{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"id": ids, "prompt": texts, "topic": list(range(len(texts)))}), path)
    return path


def embed_job(folder, data, out, **extra) -> dict:
    return {
        "name": "emb",
        "task": "embed",
        "model": {"path": str(folder), "dtype": "float32"},
        "input": {"parquet": str(data), "id_column": "id", "passthrough": ["topic"]},
        "engine": {"device": "cpu", "max_num_batched_tokens": 40},  # several steps
        "output": {"path": str(out), "rows_per_part": 2},
        **extra,
    }


def test_job_writes_fixed_size_vectors_error_rows_and_resumes(bases, tmp_path):
    folder = save_sentence_model(bases["xlm-roberta"], tmp_path / "st", pooling="cls", normalize=True)
    texts = [*TEXTS, "   "]
    data, out = write_texts(tmp_path / "in.parquet", texts), tmp_path / "out"
    summary = run_job(embed_job(folder, data, out, pooler={"dimensions": 16}), progress=False)
    table = pq.read_table(out)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 16)
    assert table.column_names == ["id", "sample", "error", "prompt_tokens", "embedding", "topic"]
    rows = {r["id"]: r for r in table.to_pylist()}
    assert len(rows) == len(texts) and all(r["error"] is None for r in rows.values())
    got = torch.tensor([rows[f"r{i}"]["embedding"] for i in range(6)])
    assert_equal(got, theirs(folder, texts, truncate_dim=16))  # the blank text too: <s></s>, as encode
    assert [rows[f"r{i}"]["topic"] for i in range(6)] == list(range(6))
    assert summary["steps"] > 1 and summary["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows.values())
    assert summary["padding_tokens_avoided"] > 0  # texts of different lengths shared a step
    parts = sorted(out.glob("part-*.parquet"))
    assert (
        run_job(embed_job(folder, data, out, pooler={"dimensions": 16}), progress=False) is None
    )  # all done
    assert sorted(out.glob("part-*.parquet")) == parts
    with pytest.raises(BadInput, match="different job"):  # other dimensions are another job's rows
        run_job(embed_job(folder, data, out, pooler={"dimensions": 8}), progress=False)


def test_both_padding_counterfactuals_are_recounted(bases, tmp_path):
    """The summary's second padding counterfactual (beside `padding_tokens_avoided`, per packed step in input
    order): texts sorted by length in batches of 32 as sentence-transformers batches (`padding_tokens_sorted`),
    recounted here from the texts' token counts as sentence-transformers' tokenizer makes them."""
    from sentence_transformers import SentenceTransformer

    folder = save_sentence_model(bases["bert"], tmp_path / "st", pooling="mean")
    words = "the sea rain on a dog and".split()
    texts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(1 + (i * 7) % 11)) for i in range(70)]
    data, out = write_texts(tmp_path / "in.parquet", texts), tmp_path / "out"
    summary = run_job(embed_job(folder, data, out), progress=False)
    lengths = SentenceTransformer(str(folder), device="cpu").tokenize(texts)["attention_mask"].sum(1).tolist()
    rows = {r["id"]: r["prompt_tokens"] for r in pq.read_table(out).to_pylist()}
    assert [rows[f"r{i}"] for i in range(len(texts))] == lengths
    ordered = sorted(lengths, reverse=True)
    batches = [ordered[i : i + 32] for i in range(0, len(ordered), 32)]
    assert summary["padding_tokens_sorted"] == sum(max(b) * len(b) - sum(b) for b in batches) > 0


def test_an_openai_batch_of_embeddings_requests_is_answered_in_openais_shape(bases, tmp_path):
    from batchrun import openai_batch

    folder = save_sentence_model(bases["bert"], tmp_path / "st", pooling="mean", normalize=True)
    request = lambda cid, body, url="/v1/embeddings": json.dumps(  # noqa: E731
        {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}
    )
    lines = [
        request("a", {"input": TEXTS[0]}),
        request("b", {"input": [TEXTS[1]], "encoding_format": "float"}),
        request("c", {"messages": [{"role": "user", "content": "hi"}]}, url="/v1/chat/completions"),
        request("d", {"input": TEXTS[2], "encoding_format": "base64"}),
        request("e", {"input": ""}),
        request("f", {"input": ["two", "texts"]}),
    ]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    job = {
        "name": "emb",
        "task": "embed",
        "model": {"path": str(folder), "dtype": "float32", "name": "m"},
        "input": {"openai_batch": str(tmp_path / "batch.jsonl")},
        "engine": {"device": "cpu"},
        "output": {"path": str(out)},
    }
    run_job(job, progress=False)
    answers = {}
    for part in out.glob("part-*.jsonl"):
        answers |= {a["custom_id"]: a for a in map(json.loads, part.read_text().splitlines())}
    assert sorted(answers) == list("abcdef")
    for cid, text in (("a", TEXTS[0]), ("b", TEXTS[1])):
        body = answers[cid]["response"]["body"]
        assert answers[cid]["error"] is None and body["object"] == "list" and body["model"] == "m"
        (item,) = body["data"]
        assert item["object"] == "embedding" and item["index"] == 0
        assert_equal(torch.tensor([item["embedding"]]), theirs(folder, [text]))
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    errors = {cid: answers[cid]["error"]["message"] for cid in "cdef"}
    assert "is not served by a task embed job" in errors["c"] and "encoding_format" in errors["d"]
    assert "empty string" in errors["e"] and "one text per request" in errors["f"]  # OpenAI refuses ""
    _, wrong = openai_batch.parse_line(lines[0], 0, "generate")  # embeddings asked of a generation job
    assert "is not served by a task generate job" in wrong["error"]


def test_float16_embeddings_are_sentence_transformers_vectors_rounded_to_float16(bases, tmp_path):
    folder = save_sentence_model(bases["bert"], tmp_path / "st", pooling="mean", normalize=True)
    data, out = write_texts(tmp_path / "in.parquet", TEXTS), tmp_path / "out"
    job = embed_job(folder, data, out, output={"path": str(out), "embedding_dtype": "float16"})
    run_job(job, progress=False)
    table = pq.read_table(out)
    assert table.schema.field("embedding").type == pa.list_(pa.float16(), 32)
    rows = {r["id"]: r for r in table.to_pylist()}
    got = torch.tensor([rows[f"r{i}"]["embedding"] for i in range(len(TEXTS))], dtype=torch.float16)
    want = theirs(folder).half()
    assert ((got.float() - want.float()).abs() <= (want.float().abs() * 2**-10)).all()  # within a half's ulp
    job["task"] = "classify"
    with pytest.raises(BadInput, match=r"`output\.embedding_dtype` applies to task embed"):
        run_job(job, progress=False, overwrite=True)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"task": "classify"}, "task"),  # an embedding checkpoint has no classification head
        ({"task": "score"}, "input.pair_column"),  # pairs need their second text
        ({"task": "score", "input": {"pair_column": "topic"}}, "task"),  # an embedder has no head
        ({"pooler": {"dimensions": 999}}, "pooler.dimensions"),
        ({"pooler": {"prompt_name": "nope"}}, "pooler.prompt_name"),
        ({"pooler": {"pooling": "median"}}, "pooler.pooling"),
        ({"input": {"parquet": "x.parquet", "image_column": "img"}}, "input.image_column"),
    ],
)
def test_impossible_jobs_name_the_key(bases, tmp_path, extra, key):
    folder = save_sentence_model(bases["bert"], tmp_path / "st", pooling="mean")
    job = embed_job(folder, write_texts(tmp_path / "in.parquet", TEXTS), tmp_path / "out")
    for section, value in extra.items():  # a section's keys beside the job's own
        job[section] = {**job.get(section, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(BadInput, match=f"`{key}"):
        run_job(job, progress=False)


def test_pooler_keys_on_a_generation_job_are_a_bad_job(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: g\ninput:\n  parquet: x.parquet\npooler:\n  normalize: true\n")
    result = run_cli("validate", str(job))
    assert result.returncode == 2 and "pooler.normalize" in result.stderr


def test_models_and_modules_batchrun_cannot_reproduce_are_refused(bases, tmp_path):
    from transformers import MPNetConfig

    from batchrun import LLM
    from batchrun.engine.attention import UnsupportedModel

    mpnet = save_base_model(
        MPNetConfig(
            vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
        ),
        wordpiece_tokenizer(tmp_path / "wp"),
        tmp_path / "mpnet",
    )
    with pytest.raises(UnsupportedModel, match="attention interface"):
        LLM(str(mpnet), dtype="float32", device="cpu", runner="pooling", pooler={"pooling": "mean"})
    folder = save_sentence_model(bases["bert"], tmp_path / "st", pooling="mean", normalize=True)
    modules = json.loads((folder / "modules.json").read_text())
    modules[2]["type"] = "sentence_transformers.sentence_transformer.modules.layer_norm.LayerNorm"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(BadInput, match="LayerNorm"):
        read_checkpoint(open_model(str(folder)), PoolerConfig(), "job.yaml", "embed")
    # sentence-transformers 6 saves a decoder with a chat template as taking messages, which it renders through
    # the template: batchrun does not, so it refuses the folder rather than embed other tokens
    chat = save_sentence_model(bases["qwen3"], tmp_path / "chat", pooling="lasttoken")
    with pytest.raises(BadInput, match="modality_config"):
        read_checkpoint(open_model(str(chat)), PoolerConfig(), "job.yaml", "embed")


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "longrope"}])
def test_a_decoder_whose_rope_factors_follow_the_longest_text_is_refused(bases, tmp_path, rope):
    """Dynamic NTK and LongRoPE pick their factors from the forward's longest position: packed beside a long
    text, a short text's vector would change. Refused at load, naming the scaling."""
    from transformers import AutoConfig, AutoTokenizer

    from batchrun import LLM
    from batchrun.engine.attention import UnsupportedModel

    config = AutoConfig.from_pretrained(bases["qwen3"])
    config.rope_parameters = {**config.rope_parameters, **rope}
    if rope["rope_type"] == "longrope":
        half = config.head_dim // 2
        config.rope_parameters.update(short_factor=[1.0] * half, long_factor=[2.0] * half)
        config.original_max_position_embeddings = 64
    folder = save_base_model(config, AutoTokenizer.from_pretrained(bases["qwen3"]), tmp_path / "m")
    with pytest.raises(UnsupportedModel, match=rope["rope_type"]):
        LLM(str(folder), dtype="float32", device="cpu", runner="pooling", pooler={"pooling": "mean"})


@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_empty_and_blank_texts_are_embedded_and_classified_as_the_references_do(bases, tmp_path, family):
    """An empty or blank text is the tokenizer's special tokens alone ([CLS][SEP]; Qwen3-Embedding's end-of-text),
    which sentence-transformers' encode embeds and transformers classifies: so does batchrun. A null or non-text
    prompt is the row's error."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from batchrun import LLM

    texts = ["", "   ", "the sea"]
    folder = family_folder(bases, tmp_path, family)
    assert_equal(ours(folder, texts), theirs(folder, texts))
    classifier = save_classifier(family, bases, tmp_path)
    outs = LLM(str(classifier), dtype="float32", device="cpu", runner="pooling").classify(
        texts, use_tqdm=False
    )
    reference = AutoModelForSequenceClassification.from_pretrained(classifier, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(classifier)
    with torch.inference_mode():
        logits = torch.stack([reference(**tok(t, return_tensors="pt")).logits[0] for t in texts])
    assert_equal(torch.tensor([o.outputs.probs for o in outs]), logits.softmax(dim=-1))
    outs = LLM(str(folder), dtype="float32", device="cpu", runner="pooling").embed([None, 3], use_tqdm=False)
    assert [o.error for o in outs] == ["text is null", "text is not a string (got int)"]


def test_shards_and_replicas_write_every_row_once(bases, tmp_path):
    """Two shards, then two replica processes: every row once, each vector the one a single run writes."""
    folder = save_sentence_model(bases["bert"], tmp_path / "st", pooling="mean")
    texts = [f"{t} {i}" for i in range(4) for t in TEXTS]
    data = write_texts(tmp_path / "in.parquet", texts)
    expected = theirs(folder, texts)
    for i in range(2):
        run_job(embed_job(folder, data, tmp_path / "sharded"), shard=f"{i}/2", progress=False)
    summary = run_job(embed_job(folder, data, tmp_path / "replicas"), replicas=2, progress=False)
    assert summary["replicas"] == 2
    for out in ("sharded", "replicas"):
        rows = pq.read_table(tmp_path / out).to_pylist()
        assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(len(texts)))
        got = torch.tensor([r["embedding"] for r in sorted(rows, key=lambda r: int(r["id"][1:]))])
        assert_equal(got, expected)


def test_truncate_prompt_tokens_cuts_as_max_seq_length_and_is_counted(bases, tmp_path):
    from sentence_transformers import SentenceTransformer

    folder = save_sentence_model(bases["bert"], tmp_path / "st", pooling="mean")
    data, out = write_texts(tmp_path / "in.parquet", TEXTS), tmp_path / "out"
    summary = run_job(embed_job(folder, data, out, pooler={"truncate_prompt_tokens": 6}), progress=False)
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["id"])
    st = SentenceTransformer(str(folder), device="cpu")
    st.max_seq_length = 6
    assert_equal(torch.tensor([r["embedding"] for r in rows]), st.encode(TEXTS, convert_to_tensor=True))
    lengths = [len(st.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert [r["prompt_tokens"] for r in rows] == [min(n, 6) for n in lengths]
    assert summary["truncated_rows"] == sum(n > 6 for n in lengths) > 0


@pytest.mark.parametrize(
    "family, asks",
    [
        ("llama4_text", r"chunked attention \(32 tokens\)"),
        ("phimoe", "a window of 32 tokens in its mask alone"),
    ],
)
def test_a_decoder_with_a_chunk_or_window_its_calls_do_not_pass_is_refused_as_a_pooling_model(
    bases, tmp_path, family, asks
):
    """Llama 4 marks its chunked layers only in the config's `layer_types`, Phi-MoE its window only in its mask
    (the generation probe reads both, architecture.ModelLayers); the packed attention reads neither, so it would
    attend over the whole text: refused at load, naming the layer and the chunk or window, never computed as full
    attention."""
    from model_families import SUPPORTED, TINY
    from transformers import AutoConfig, AutoTokenizer

    from batchrun import LLM
    from batchrun.engine.attention import UnsupportedModel

    tok = AutoTokenizer.from_pretrained(bases["qwen3"])
    overrides = {**TINY, **SUPPORTED[family][1], "vocab_size": len(tok)}
    config = AutoConfig.for_model(family, **overrides)
    folder = save_base_model(config, tok, tmp_path / family)
    with pytest.raises(UnsupportedModel, match=rf"layer 0 asks for {asks}"):
        LLM(str(folder), dtype="float32", device="cpu", runner="pooling", pooler={"pooling": "mean"})


def test_the_load_probe_refuses_a_model_that_reaches_across_texts(bases, tmp_path, monkeypatch):
    """Were the texts of a packed row to see each other (here: the layout made one text of them all), the load
    probe refuses the model rather than embed each text with its batch-mates."""
    from batchrun import LLM
    from batchrun.engine.attention import UnsupportedModel, packed

    made = packed.PackedLayout.of_lengths

    def seen_by_all(lengths, specs=None, kernel=None):
        layout = made(lengths, specs, kernel)
        layout.runs = [packed.AttentionRun(0, 1, sum(lengths))]
        return layout

    monkeypatch.setattr(packed.PackedLayout, "of_lengths", staticmethod(seen_by_all))
    folder = save_sentence_model(bases["bert"], tmp_path / "st", pooling="mean")
    with pytest.raises(UnsupportedModel, match="beside another text"):
        LLM(str(folder), dtype="float32", device="cpu", runner="pooling")


def test_a_layer_whose_call_changes_after_the_load_probe_is_refused(bases, tmp_path, monkeypatch):
    """The pooling load freezes each layer's call (its LayerSpec, as the paged path's); a later call that passes
    other keywords is read again: one that asks for what packed attention does not compute, or for another mask
    than at load, is refused, never run on the frozen spec; one whose extra keyword changes nothing runs as
    before."""
    from batchrun import LLM
    from batchrun.engine.attention import UnsupportedModel

    folder = save_sentence_model(bases["bert"], tmp_path / "st", pooling="mean")
    llm = LLM(str(folder), dtype="float32", device="cpu", runner="pooling")
    before = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    attention = llm.pooling.model.encoder.layer[1].attention.self
    forward = attention.forward
    for asks, reason in [({"softcap": 30.0}, "soft-capping"), ({"sliding_window": 2}, "other attention")]:
        monkeypatch.setattr(attention, "forward", functools.partial(forward, **asks))
        with pytest.raises(UnsupportedModel, match=rf"layer 1\) asks for {reason}"):
            llm.embed(TEXTS, use_tqdm=False)
    monkeypatch.setattr(attention, "forward", functools.partial(forward, deterministic=True))
    after = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert torch.equal(after, before)


def test_validate_checks_the_pooler_keys_against_the_checkpoint(bases, tmp_path):
    folder = save_sentence_model(bases["bert"], tmp_path / "st", pooling="mean")
    data = write_texts(tmp_path / "in.parquet", TEXTS)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: e\ntask: embed\nmodel: {{path: {folder}}}\ninput: {{parquet: {data}}}\n"
        f"output: {{path: {tmp_path / 'out'}}}\npooler: {{dimensions: 64}}\n"
    )
    result = run_cli("validate", str(job))
    assert result.returncode == 2 and "pooler.dimensions" in result.stderr and "32" in result.stderr
    assert run_cli("validate", str(job), "--set", "pooler.dimensions=16").returncode == 0


def save_classifier(family: str, bases, tmp_path):
    """A random-weight sequence classifier of the family (3 labels)."""
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    return save_sequence_classifier(bases[family], tmp_path / f"{family}-classifier", labels)


@pytest.mark.parametrize("family", [*ENCODERS, "qwen3"])
def test_classify_equals_the_model_run_one_text_at_a_time(bases, tmp_path, family):
    """The checkpoint's own head (BERT's pooler, RoBERTa's first token, ModernBERT's, a decoder's last token)
    on each text's states from the packed row, against AutoModelForSequenceClassification on the text alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from batchrun import LLM

    folder = save_classifier(family, bases, tmp_path)
    outs = LLM(str(folder), dtype="float32", device="cpu", runner="pooling").classify(TEXTS, use_tqdm=False)
    reference = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        logits = torch.stack([reference(**tok(t, return_tensors="pt")).logits[0] for t in TEXTS])
    probs = logits.softmax(dim=-1)
    assert_equal(torch.tensor([o.outputs.probs for o in outs]), probs)
    assert [o.outputs.label for o in outs] == [
        reference.config.id2label[int(i)] for i in probs.argmax(dim=-1)
    ]


def test_classify_job_writes_label_and_probs(bases, tmp_path):
    folder = save_classifier("qwen3", bases, tmp_path)
    data, out = write_texts(tmp_path / "in.parquet", [*TEXTS, ""]), tmp_path / "out"
    job = embed_job(folder, data, out, task="classify")
    run_job(job, progress=False)
    table = pq.read_table(out)
    assert table.column_names == ["id", "sample", "error", "prompt_tokens", "label", "probs", "topic"]
    assert table.schema.field("probs").type == pa.list_(pa.float32(), 3)
    rows = {r["id"]: r for r in table.to_pylist()}
    assert rows["r5"]["error"] is None  # an empty text: the tokenizer's end-of-text alone, classified
    from batchrun import LLM

    outs = LLM(str(folder), dtype="float32", device="cpu", runner="pooling").classify(
        [*TEXTS, ""], use_tqdm=False
    )
    for i, o in enumerate(outs):
        assert rows[f"r{i}"]["label"] == o.outputs.label
        assert max(abs(a - b) for a, b in zip(rows[f"r{i}"]["probs"], o.outputs.probs)) < 1e-6
    job["pooler"] = {"normalize": True}
    with pytest.raises(BadInput, match=r"pooler\.normalize"):
        run_job(job, progress=False, overwrite=True)
    with pytest.raises(BadInput, match="LLM.embed"):
        LLM(str(folder), dtype="float32", device="cpu", runner="pooling").embed(TEXTS)


@pytest.mark.parametrize("causal, window", [(False, None), (False, 3), (True, None), (True, 3)])
def test_a_packed_call_is_each_text_alone_under_its_layers_mask(causal, window):
    """One layer's call through batchrun's attention function with a pooling step's layout: each text of the
    packed row attends to itself alone, under the layer's mask (an encoder's both ways, a decoder's causal, a
    sliding window), as plain softmax attention over that text alone computes it (GQA: 4 query heads, 2 KV)."""
    from batchrun.engine.attention import METADATA_KEYWORD, PackedLayout
    from batchrun.engine.attention.interface import attention_forward

    torch.manual_seed(0)
    layout = PackedLayout.of_lengths([4, 7, 4, 1, 7])
    T, D = sum(layout.lengths), 8
    q, k, v = torch.randn(1, 4, T, D), torch.randn(1, 2, T, D), torch.randn(1, 2, T, D)
    module = torch.nn.Module()
    module.is_causal = causal
    out, _ = attention_forward(
        module, q, k, v, None, scaling=0.3, sliding_window=window, **{METADATA_KEYWORD: layout}
    )
    assert out.shape == (1, T, 4, D) and layout.calls == 1
    for a, b in layout.spans():
        keys, values = (x[0, :, a:b].repeat_interleave(2, dim=0) for x in (k, v))
        back = torch.arange(b - a)[:, None] - torch.arange(b - a)[None, :]  # query position - key position
        seen = (back >= 0) if causal else torch.ones_like(back, dtype=torch.bool)
        if window is not None:
            seen &= back.abs() < window
        scores = (q[0, :, a:b] @ keys.transpose(1, 2) * 0.3).masked_fill(~seen, float("-inf"))
        expected = (scores.softmax(dim=-1) @ values).transpose(0, 1)  # [L, Hq, D]
        assert (out[0, a:b] - expected).abs().max().item() < 1e-5


def test_a_packed_call_that_asks_what_batchrun_does_not_compute_is_refused():
    """The one argument check of both paths: soft-capping, sinks, dropout, a mask of the model's own or an
    argument batchrun does not know are refused on a pooling step's call, never ignored."""
    from batchrun.engine.attention import METADATA_KEYWORD, PackedLayout, UnsupportedModel
    from batchrun.engine.attention.interface import attention_forward

    q = k = v = torch.randn(1, 2, 5, 8)
    for asks, reason in [
        (dict(softcap=30.0), "soft-capping"),
        (dict(s_aux=torch.zeros(2)), "sinks"),
        (dict(dropout=0.1), "dropout"),
        (dict(attention_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool)), "mask of its own"),
        (dict(alibi_slopes=torch.ones(2)), "ALiBi"),
        (dict(position_bias_of_its_own=torch.ones(2)), "position_bias_of_its_own"),
    ]:
        layout = PackedLayout.of_lengths([2, 3])
        call = {"attention_mask": None, **asks, METADATA_KEYWORD: layout}
        with pytest.raises(UnsupportedModel, match=reason):
            attention_forward(torch.nn.Module(), q, k, v, **call)


def test_the_generation_engine_refuses_a_model_whose_layers_attend_both_ways():
    """The load probe reads an encoder's layers as a pooling runner's load asks it to; the generation engine's
    plan refuses them, as its pages hold only earlier keys."""
    from helpers import paged_model_from_config
    from transformers import LlamaConfig

    from batchrun.engine.attention import UnsupportedModel
    from batchrun.engine.model.model_plan import ModelPlan

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=64
    )
    model = paged_model_from_config(config).eval()
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    with pytest.raises(UnsupportedModel, match="layers 0, 1 attend to later tokens too"):
        ModelPlan.of(model, page_size=16)
