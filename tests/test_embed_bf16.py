"""Pooling jobs in bf16 (tasks embed and classify) against sentence-transformers and transformers in fp32, and
the summary's `fp32_sample` recounted here: the sampled rows' cosines to the fp32 vectors, and a classifier's
largest probability difference.

The bounds. bf16 keeps 8 significant bits: each rounding moves a value by at most 2^-9 of it. A token state goes
through a few dozen roundings in each of the tiny models' two or three layers (products, norms, residual adds,
attention), and such errors, of either sign from component to component, add up roughly as the square root of
their number: a few percent of the vector at most, and a cosine of 1 - e^2/2 for a relative error e, so 0.999
(e about 4.5%) holds with room (the runs give about 0.9999); two texts' vectors of these models are much further
apart (`test_bf16_embeddings_are_within_bf16_tolerance_of_fp32` checks that too, so the bound tells a text's
vector from another's). A probability p = softmax(logits) moves by at most p(1-p) times twice a logit's error;
the logits are the classifier head's products of a state with a few percent's error, so 0.02 (a quarter of the
largest p(1-p) times 0.16) is met with room.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from embedding_models import save_bases, save_legacy_layout, save_sentence_model, save_sequence_classifier

from batchrun import pooling_worker
from batchrun.engine import cpu_kernels
from batchrun.engine.pooling.sentence_modules import pool
from batchrun.fp32_sample import SAMPLE_TEXTS, Fp32Sample
from batchrun.job import run_job
from batchrun.model_loader import open_model
from batchrun.pooling_worker import fp32_room
from batchrun.report import format_summary
from batchrun.stats import SUMMARY_KEYS, merge_fp32_samples

TEXTS = [
    "the cats and dogs",
    "rain on the sea is water",
    "a",
    "how many people call their dogs first",
    "what do you know about the long day when the water came down " * 4,
    "the sea and the rain",
    "one word",
    "he was there when the dogs came",
    "find the passage about the sea",
    "what is the time",
    "they call it water",
    "two dogs",
]
COSINE = 0.999  # per vector, the module docstring's bound
PROBS = 0.02


@pytest.fixture(scope="module")
def bases(tmp_path_factory, model_dir):
    return save_bases(tmp_path_factory.mktemp("bases"), model_dir, ["bert"])


def folder_of(bases, tmp_path, family):
    if family == "qwen3":
        return save_legacy_layout(
            bases[family], tmp_path / "st", "lasttoken", normalize=True, max_seq_length=64
        )
    return save_sentence_model(bases[family], tmp_path / "st", pooling="mean", normalize=True)


def fp32(folder, texts) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)


def test_pooling_sums_a_bf16_texts_states_in_fp32():
    """A mean over 500 bf16 states is the fp32 mean of those states (a bf16 result would keep 8 bits)."""
    torch.manual_seed(0)
    states = (torch.randn(500, 32) + 3).bfloat16()
    want = states.double().mean(dim=0)
    for mode in ("mean", "mean_sqrt_len_tokens", "weightedmean", "cls", "max", "lasttoken"):
        assert pool(states, (mode,), 0).dtype == torch.float32
    got = pool(states, ("mean",), 0)
    assert ((got.double() - want).abs() <= want.abs() * 1e-6).all()
    assert (pool(states, ("cls",), 0) == states[0].float()).all()


@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_bf16_embeddings_are_within_bf16_tolerance_of_fp32(bases, tmp_path, family):
    from batchrun import LLM

    folder = folder_of(bases, tmp_path, family)
    llm = LLM(str(folder), dtype="bfloat16", device="cpu", runner="pooling")
    runner = llm.pooling
    assert runner.dtype == torch.bfloat16 and next(runner.model.parameters()).dtype == torch.bfloat16
    if family == "qwen3" and cpu_kernels.load() is not None:
        # RMSNorms, SiLU-and-mul and rotary fused, as generation's (fp32 is held bit-equal by test_embed.py)
        rewrites = runner.rewrites
        assert (
            rewrites["fused_elementwise"] > 0
            and rewrites["fused_rotary"] == runner.model.config.num_hidden_layers
        )
    if (
        family == "bert" and runner.rewrites["packed_linear"]
    ):  # its GELU and residual adds as the products' post-ops
        assert runner.rewrites["fused_encoder"] == 3 * runner.model.config.num_hidden_layers
    outs = llm.embed(TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    want = fp32(folder, TEXTS)
    cosines = F.cosine_similarity(got, want)
    assert (cosines >= COSINE).all(), cosines
    others = F.cosine_similarity(got, want.roll(1, dims=0))  # each against another text's fp32 vector
    assert (others < COSINE).all(), others


def embed_job(folder, data, out, task="embed") -> dict:
    return {
        "name": "bf16",
        "task": task,
        "model": {"path": str(folder), "dtype": "bfloat16"},
        "input": {"parquet": str(data), "id_column": "id"},
        "engine": {"device": "cpu", "max_num_batched_tokens": 64},  # several steps
        "output": {"path": str(out), "rows_per_part": 2},
    }


def write_texts(path, texts):
    import pyarrow as pa

    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(texts))], "prompt": texts}), path)
    return path


def recount(sample: dict, rows: dict, want: dict) -> None:
    """The summary's cosines against the written vectors and their fp32 vectors, computed here."""
    cosines = [
        F.cosine_similarity(torch.tensor(rows[i]["embedding"]), want[i], dim=0).item() for i in sample["rows"]
    ]
    assert abs(sample["cosine_min"] - min(cosines)) < 1e-5
    assert abs(sample["cosine_mean"] - sum(cosines) / len(cosines)) < 1e-5
    assert min(cosines) >= COSINE


def test_a_bf16_job_reports_its_distance_from_fp32_on_its_first_rows_and_resumes(
    bases, tmp_path, monkeypatch
):
    folder = folder_of(bases, tmp_path, "bert")
    data, out = write_texts(tmp_path / "in.parquet", TEXTS), tmp_path / "out"
    opened = []  # the checkpoint's folder found and its config read: once, by check_job, for the whole job
    monkeypatch.setattr(pooling_worker, "open_model", lambda *a: opened.append(a) or open_model(*a))
    summary = run_job(embed_job(folder, data, out), progress=False)
    assert len(opened) == 1  # not again for the output columns, the runner or the fp32 sample's runner
    assert summary["dtype"] == "bfloat16" and summary["steps"] > 1
    sample = summary["fp32_sample"]
    assert sample["rows"] == [f"r{i}" for i in range(SAMPLE_TEXTS)] and sample["error"] is None
    assert sample["score_max_abs_diff"] is None  # an embedder writes no scores
    want = dict(zip((f"r{i}" for i in range(len(TEXTS))), fp32(folder, TEXTS)))
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert len(rows) == len(TEXTS) == summary["rows"]  # the sample wrote no row of its own
    recount(sample, rows, want)
    printed = format_summary(summary)
    assert f"against fp32     {SAMPLE_TEXTS} texts pooled again in fp32 (r0, r1, r2, r3, ...;" in printed
    assert f"cosine min {sample['cosine_min']:.6f}" in printed
    # a run that lost the parts holding only rows after the sampled ones: the next one pools them, samples them,
    # and the summary holds both runs' samples, each row once. (Which rows share a part follows the order rows
    # finish in, which the reader thread's timing can change: the lost rows are read from the parts.)
    later = [
        p
        for p in out.glob("part-*.parquet")
        if set(pq.read_table(p).column("id").to_pylist()) <= set(list(want)[SAMPLE_TEXTS:])
    ]
    lost = {i for p in later for i in pq.read_table(p).column("id").to_pylist()}
    assert lost
    for p in later:
        p.unlink()
    summary = run_job(embed_job(folder, data, out), progress=False)
    assert summary["runs"] == 2
    first, sample = sample, summary["fp32_sample"]
    assert (
        len(sample["rows"]) == len(set(sample["rows"])) and set(sample["rows"]) == set(first["rows"]) | lost
    )
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert sorted(rows) == sorted(want) and pq.read_table(out).num_rows == len(TEXTS)
    recount(sample, rows, want)


def test_a_bf16_classify_job_is_within_its_bound_of_fp32_logits(bases, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    labels = {0: "negative", 1: "neutral", 2: "positive"}
    folder = save_sequence_classifier(bases["bert"], tmp_path / "classifier", labels)
    data, out = write_texts(tmp_path / "in.parquet", TEXTS), tmp_path / "out"
    summary = run_job(embed_job(folder, data, out, task="classify"), progress=False)
    reference = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        logits = torch.stack([reference(**tok(t, return_tensors="pt")).logits[0] for t in TEXTS])
    want = logits.softmax(dim=-1)
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    got = torch.tensor([rows[f"r{i}"]["probs"] for i in range(len(TEXTS))])
    assert (got - want).abs().max().item() <= PROBS
    sample = summary["fp32_sample"]
    assert sample["rows"] == [f"r{i}" for i in range(SAMPLE_TEXTS)]
    recounted = (got - want)[:SAMPLE_TEXTS].abs().max().item()
    assert abs(sample["score_max_abs_diff"] - recounted) < 1e-5
    assert sample["cosine_min"] >= COSINE  # of the logits


def test_samples_merge_row_for_row_and_a_reference_that_does_not_fit_leaves_the_job_running():
    a = {"rows": ["r0", "r1"], "cosine_min": 0.9991, "cosine_mean": 0.9995, "score_max_abs_diff": None}
    b = {"rows": [5, 6, 7, 8], "cosine_min": 0.9993, "cosine_mean": 0.9999, "score_max_abs_diff": None}
    merged = merge_fp32_samples(
        [None, a | {"seconds": 1.0, "error": None}, 0, b | {"seconds": 2.0, "error": None}]
    )
    assert merged["rows"] == ["r0", "r1", 5, 6, 7, 8] and merged["cosine_min"] == 0.9991
    assert merged["cosine_mean"] == pytest.approx((2 * 0.9995 + 4 * 0.9999) / 6) and merged["seconds"] == 3.0
    assert merge_fp32_samples([None, 0]) is None

    def too_big():
        raise torch.OutOfMemoryError("CUDA out of memory")

    sample = Fp32Sample(too_big, "embed")
    sample.take([(object(), torch.ones(4))])
    assert (
        sample.full
        and sample.summary()["rows"] == []
        and "did not fit in memory" in sample.summary()["error"]
    )
    loads = []
    weighed = Fp32Sample(
        lambda: loads.append(1), "embed", room=lambda: fp32_room(8 << 30, torch.device("cpu"))
    )
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pooling_worker, "available_ram", lambda: 4 << 30)
        weighed.take([(object(), torch.ones(4))])  # 8 GiB against 4 free: refused before any load
    assert loads == [] and weighed.full and "needs about 8.00 GiB and 4.00 GiB are free" in weighed.error
    assert fp32_room(1 << 20, torch.device("cpu")) is None  # a MiB fits this machine
    summary = dict.fromkeys(SUMMARY_KEYS, 0) | {
        "task": "embed",
        "wall_s": 1.0,
        "fp32_sample": sample.summary(),
    }
    assert "against fp32     no sample: the checkpoint in fp32 did not fit in memory" in format_summary(
        summary
    )


def test_a_bf16_score_job_reports_its_largest_score_difference_from_fp32(bases, tmp_path):
    """A cross-encoder's sigmoid scores (one logit: no cosine), against the model run on each pair in fp32."""
    import pyarrow as pa
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = save_sequence_classifier(bases["bert"], tmp_path / "ce", {0: "relevance"})
    queries, passages = TEXTS[:10], TEXTS[2:12]
    data, out = tmp_path / "pairs.parquet", tmp_path / "out"
    ids = [f"r{i}" for i in range(len(queries))]
    pq.write_table(pa.table({"id": ids, "prompt": queries, "passage": passages}), data)
    job = embed_job(folder, data, out, task="score")
    job["input"]["pair_column"] = "passage"
    summary = run_job(job, progress=False)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        want = torch.stack(
            [model(**tok(q, p, return_tensors="pt")).logits[0, 0] for q, p in zip(queries, passages)]
        )
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    got = torch.tensor([rows[i]["score"] for i in ids])
    assert (got - want.sigmoid()).abs().max().item() <= PROBS  # a sigmoid's slope is at most 1/4
    sample = summary["fp32_sample"]
    assert sample["rows"] == ids[:SAMPLE_TEXTS] and sample["cosine_min"] is None
    recounted = (got - want.sigmoid())[:SAMPLE_TEXTS].abs().max().item()
    assert abs(sample["score_max_abs_diff"] - recounted) < 1e-5
