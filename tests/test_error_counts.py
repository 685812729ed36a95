"""Rows that fail are counted (issue 53, item 3): the printed summary, the statistics file's summary and
`batchrun stats --json` carry `error_rows`, for every task, across resumes, shards and replicas, and it always
equals a recount of the output's rows whose `error` is not null."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from embedding_models import save_bases, save_sentence_model, save_sequence_classifier
from helpers import run_cli, write_job

from batchrun.config import load_job
from batchrun.job import Job, run_job
from batchrun.report import load_summary
from batchrun.rows import Shard
from batchrun.sinks import part_shard

# four bad rows of six: null, empty, blank, longer than the model's context
PROMPTS = ["Name a color.", None, "", "   ", "x " * 9000, "What is 2 + 2?"]

JOB = """
name: errs
input: {{parquet: {data}, prompt_column: prompt, id_column: id}}
sampling: {{max_new_tokens: 2}}
engine: {{num_pages: 64, device: cpu}}
output: {{path: {out}}}
"""


def write_rows(path, prompts) -> None:
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts}), path)


def recount(out) -> int:
    """Output rows whose `error` is set, read back from the part files."""
    errors = pq.read_table(out, columns=["error"]).column("error")
    return len(errors) - errors.null_count


def recount_by_shard(out) -> dict[str, int]:
    counts: dict[str, int] = {}
    for part in sorted(out.glob("part-*.parquet")):
        errors = pq.read_table(part, columns=["error"]).column("error")
        counts[part_shard(part)] = counts.get(part_shard(part), 0) + len(errors) - errors.null_count
    return counts


def generation_job(tmp_path, prompts=PROMPTS):
    data, out = tmp_path / "in.parquet", tmp_path / "out"
    write_rows(data, prompts)
    return write_job(tmp_path / "job.yaml", JOB.format(data=data, out=out)), out


def test_submit_prints_the_failed_rows_and_stats_json_carries_them(tmp_path):
    job_file, out = generation_job(tmp_path)
    r = run_cli("submit", str(job_file), "--quiet")
    assert r.returncode == 0, r.stderr  # error rows are outputs: the job did its work
    errors = recount(out)
    assert errors == 4
    assert re.search(rf"^rows\s+6, {errors} failed", r.stdout, re.M), r.stdout
    j = run_cli("stats", str(out), "--json")
    assert j.returncode == 0, j.stderr
    assert json.loads(j.stdout)["error_rows"] == errors
    table = run_cli("stats", str(out))
    assert re.search(rf"^rows\s+6, {errors} failed", table.stdout, re.M), table.stdout
    again = run_cli("submit", str(job_file), "--quiet")  # loads no model
    assert (
        again.returncode == 0
        and f"already has its output in {out}/ ({errors} of them error rows)" in again.stdout
    )


def test_the_count_is_the_jobs_across_resumes_and_changed_inputs(tmp_path):
    """A resume reports the whole job's error rows (as its `rows`), not this run's; a changed row's old error
    row leaves the count with its output."""
    job_file, out = generation_job(tmp_path)
    first = Job(load_job(job_file), limit=3, progress=False)
    summary = first.run()
    assert summary["rows"] == 3 and summary["error_rows"] == recount(out) == 2
    rest = Job(load_job(job_file), progress=False, worker=first.worker)
    summary = rest.run()
    assert summary["rows"] == 6 and summary["error_rows"] == recount(out) == 4
    stored = load_summary(out)
    assert stored["runs"] == 2 and stored["error_rows"] == 4
    fixed = [*PROMPTS[:2], "Name a fruit.", *PROMPTS[3:]]  # r2 was empty: its error row is recomputed
    write_rows(tmp_path / "in.parquet", fixed)
    summary = Job(load_job(job_file), progress=False, worker=first.worker).run()
    assert summary["rows"] == 6 and summary["error_rows"] == recount(out) == 3


def test_shards_each_count_their_own_and_stats_adds_them(tmp_path):
    job_file, out = generation_job(tmp_path)
    worker = None
    for i in range(2):
        job = Job(load_job(job_file), Shard(i, 2), progress=False, worker=worker)
        summary = job.run()
        worker = job.worker
        assert summary["error_rows"] == recount_by_shard(out)[f"{i}/2"]
    combined = load_summary(out)
    assert combined["error_rows"] == recount(out) == 4
    assert combined["error_rows_by_shard"] == recount_by_shard(out)


def test_openai_batch_error_lines_are_counted_across_a_resume(tmp_path):
    good = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "Hi", "max_tokens": 2},
    }
    refused = {**good, "custom_id": "b", "body": {"prompt": "Hi", "frequency_penalty": 1}}
    lines = [json.dumps(good), json.dumps(refused), "not json", json.dumps({**good, "custom_id": "c"})]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    job = {
        "name": "oa",
        "input": {"openai_batch": str(tmp_path / "b.jsonl")},
        "engine": {"num_pages": 64, "device": "cpu"},
        "output": {"path": str(tmp_path / "out")},
    }

    def error_lines() -> int:
        parts = (tmp_path / "out").glob("part-*.jsonl")
        return sum(
            json.loads(line)["error"] is not None for p in parts for line in p.read_text().splitlines()
        )

    assert run_job(job, limit=2, progress=False)["error_rows"] == error_lines() == 1
    assert run_job(job, progress=False)["error_rows"] == error_lines() == 2


@pytest.fixture(scope="module")
def pooling_models(tmp_path_factory, model_dir):
    """An embedder, a classifier of three labels, and a one-label head (a cross-encoder, a reward model)."""
    root = tmp_path_factory.mktemp("pooling")
    bert = save_bases(root / "bases", model_dir, ["bert"])["bert"]
    return {
        "embed": save_sentence_model(bert, root / "embedder", pooling="mean"),
        "classify": save_sequence_classifier(bert, root / "classifier", {0: "a", 1: "b", 2: "c"}),
        "score": save_sequence_classifier(bert, root / "head", {0: "relevance"}),
        "reward": root / "head",
    }


def pooling_job(task, folder, tmp_path, **extra) -> dict:
    texts = ["the sea", None, "rain on the sea", None, "   ", None]  # a blank text is embedded, not an error
    columns = {"id": [f"r{i}" for i in range(len(texts))], "prompt": texts}
    if task == "score":
        columns["pair"] = ["water", "water", None, "water", "water", "the dogs"]
    pq.write_table(pa.table(columns), tmp_path / "in.parquet")
    return {
        "name": task,
        "task": task,
        "model": {"path": str(folder), "dtype": "float32"},
        "input": {
            "parquet": str(tmp_path / "in.parquet"),
            "id_column": "id",
            **({"pair_column": "pair"} if task == "score" else {}),
        },
        "engine": {"device": "cpu"},
        "output": {"path": str(tmp_path / "out"), "rows_per_part": 2},
        **extra,
    }


@pytest.mark.parametrize("task", ["embed", "classify", "score", "reward"])
def test_every_pooling_task_counts_its_error_rows(pooling_models, tmp_path, task):
    job = pooling_job(task, pooling_models[task], tmp_path)
    first = run_job(job, limit=3, progress=False)
    assert first["error_rows"] == recount(tmp_path / "out") > 0
    summary = run_job(job, progress=False)
    assert summary["rows"] == 6 and summary["error_rows"] == recount(tmp_path / "out") >= 3
    assert load_summary(tmp_path / "out")["error_rows"] == summary["error_rows"]


def test_replicas_count_the_rows_they_send_back(pooling_models, tmp_path):
    job = pooling_job("embed", pooling_models["embed"], tmp_path)
    summary = run_job(job, replicas=2, progress=False)
    assert summary["replicas"] == 2 and summary["error_rows"] == recount(tmp_path / "out") == 3
