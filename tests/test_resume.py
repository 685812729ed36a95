"""Runs that lose nothing: kill -9 and resume, SIGTERM and resume, shards, refusing another job's parts."""

import json
import signal
import subprocess
import time

import pytest
from helpers import read_outputs, run_cli, start_submit, wait_for_parts, write_job, write_prompts

N_ROWS = 24


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    prompts = [f"Give me one short fact about the number {i}." for i in range(N_ROWS)]
    write_prompts(d / "in.parquet", prompts, extra={"category": ["k"] * N_ROWS})
    # fp32: rows must come out the same whichever rows share their batch (a resumed run batches them
    # differently; bf16 sums round differently with the batch)
    text = f"""
name: resume
model:
  dtype: float32
input:
  parquet: {d / "in.parquet"}
  id_column: id
  passthrough: [category]
sampling:
  max_new_tokens: 12
engine:
  num_pages: 256
  max_num_seqs: 4
output:
  path: {d / "ref"}
  rows_per_part: 2
  flush_seconds: 0
"""
    return write_job(d / "job.yaml", text), d


@pytest.fixture(scope="module")
def reference(job):
    job_file, d = job
    r = run_cli("submit", str(job_file), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = read_outputs(d / "ref")
    assert len(rows) == N_ROWS
    return {k: v["completion"] for k, v in rows.items()}


def test_kill_9_at_several_points_then_resume(job, reference):
    job_file, d = job
    out = d / "killed"
    for parts in (0, 2, 5):  # during start-up, early, later
        proc = start_submit(job_file, out)
        if parts == 0:
            time.sleep(2.0)
        else:
            assert wait_for_parts(out, parts, proc), "the run ended before it was killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # a temporary part a killed run left (a kill during its write): hidden from readers, removed by the resume
    dead = subprocess.Popen(["true"])
    dead.wait()
    from batchrun.storage import _temporary_tag

    leftover = out / f".part-x.parquet{_temporary_tag()}{dead.pid}"
    leftover.write_bytes(b"torn")
    r = run_cli("submit", str(job_file), "--quiet", "--set", f"output.path={out}")
    assert r.returncode == 0, r.stderr
    rows = read_outputs(out)  # asserts no (id, sample) twice
    assert {k: v["completion"] for k, v in rows.items()} == reference
    assert not list(out.glob(".*.tmp-*")), "a dead run's temporary file was left"
    again = run_cli("submit", str(job_file), "--set", f"output.path={out}")
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_sigterm_stops_cleanly_with_code_3_then_resumes(job, reference):
    job_file, d = job
    out = d / "termed"
    proc = start_submit(job_file, out)
    assert wait_for_parts(out, 2, proc), "the run ended before it was stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "resume" in err and "Traceback" not in err
    partial = read_outputs(out)
    assert 0 < len(partial) < N_ROWS
    assert (out / ".batchrun" / "stats.parquet").exists()
    r = run_cli("submit", str(job_file), "--quiet", "--set", f"output.path={out}")
    assert r.returncode == 0, r.stderr
    assert {k: v["completion"] for k, v in read_outputs(out).items()} == reference
    # the statistics cover the whole job: both runs, every row, each step row tagged with its run
    import json

    import pyarrow.parquet as pq

    summary = json.loads(run_cli("stats", str(out), "--json").stdout)
    assert summary["runs"] == 2 and summary["rows"] == N_ROWS
    table = pq.read_table(out / ".batchrun" / "stats.parquet", columns=["run", "generated_tokens"])
    assert set(table.column("run").to_pylist()) == {1, 2}
    assert sum(table.column("generated_tokens").to_pylist()) <= summary["generated_tokens"]
    assert "over 2 runs" in run_cli("stats", str(out)).stdout


def test_shards_together_equal_the_unsharded_run(job, reference):
    job_file, d = job
    out = d / "sharded"
    for i in range(3):
        r = run_cli("submit", str(job_file), "--quiet", "--shard", f"{i}/3", "--set", f"output.path={out}")
        assert r.returncode == 0, r.stderr
    assert {k: v["completion"] for k, v in read_outputs(out).items()} == reference
    assert len(list((out / ".batchrun").glob("stats-*.parquet"))) == 3
    s = run_cli("stats", str(out), "--json")
    assert s.returncode == 0, s.stderr
    import json

    summary = json.loads(s.stdout)
    assert summary["rows"] == N_ROWS and summary["shards"] == 3


def test_shard_from_slurm_environment(job):
    job_file, d = job
    out = d / "slurm-env"
    r = run_cli(
        "submit",
        str(job_file),
        "--quiet",
        "--set",
        f"output.path={out}",
        "--limit",
        "6",
        env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"},
    )
    assert r.returncode == 0, r.stderr
    assert sorted(k[0] for k in read_outputs(out)) == ["r1", "r3", "r5"]


def test_parts_of_another_job_are_refused(job, reference):
    job_file, d = job  # the reference run's parts are in d / "ref"
    r = run_cli(
        "submit",
        str(job_file),
        "--quiet",
        "--set",
        f"output.path={d / 'ref'}",
        "--set",
        "sampling.max_new_tokens=5",
    )
    assert r.returncode == 2 and "different job" in r.stderr and "--overwrite" in r.stderr


def test_jobs_started_before_the_new_keys_keep_their_fingerprint():
    """Parts written by the first release carry a fingerprint over its keys only; a job that uses none of the
    keys added since must hash the same, or it could not resume."""
    import hashlib
    import json

    from helpers import ROOT

    from batchrun.config import load_job
    from batchrun.rows import Shard
    from batchrun.sinks import fingerprint

    first_release = {
        "model": ["path", "dtype", "chat_template", "system_prompt", "max_model_len"],
        "input": ["parquet", "dataset", "prompt_column", "id_column", "passthrough"],
        "sampling": ["max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "ignore_eos"],
    }
    spec = load_job(ROOT / "jobs" / "demo.yaml", ["sampling.stop=[END]", "sampling.n=2"])
    for count in (1, 3):
        old = {
            section: {
                k: json.loads(json.dumps(getattr(getattr(spec, section), k), default=str)) for k in keys
            }
            for section, keys in first_release.items()
        }
        old["input"]["dataset"] = None
        old["shards"] = count
        want = hashlib.sha256(json.dumps(old, sort_keys=True, default=str).encode()).hexdigest()[:32]
        assert fingerprint(spec, Shard(0, count)) == want
    # and a key added since changes it once set
    plain = load_job(ROOT / "jobs" / "demo.yaml")
    with_logprobs = load_job(ROOT / "jobs" / "demo.yaml", ["sampling.logprobs=2"])
    assert fingerprint(with_logprobs, Shard()) != fingerprint(plain, Shard())


def test_dtype_auto_resolves_by_the_cpu_and_enters_the_fingerprint(monkeypatch):
    """auto = bf16 on a CPU with bf16 matrix units, fp32 elsewhere; the fingerprint records the resolved dtype,
    except where it is what auto meant before (fp32 on a CPU), so older jobs keep resuming."""
    import torch
    from helpers import ROOT

    from batchrun import host, model_loader
    from batchrun.config import load_job
    from batchrun.rows import Shard
    from batchrun.sinks import fingerprint

    cpu = torch.device("cpu")
    auto = load_job(ROOT / "jobs" / "demo.yaml", ["model.dtype=auto", "engine.device=cpu"])
    bf16 = load_job(ROOT / "jobs" / "demo.yaml", ["model.dtype=bfloat16", "engine.device=cpu"])
    fp32 = load_job(ROOT / "jobs" / "demo.yaml", ["model.dtype=float32", "engine.device=cpu"])

    def hash_of(spec):
        return fingerprint(
            spec,
            Shard(),
            model_loader.fingerprint_dtype(spec.model.dtype, host.place("cpu", spec.model.dtype)),
        )

    monkeypatch.setattr(host, "cpu_has_fast_bf16", lambda: True)
    assert host.pick_dtype("auto", cpu) == torch.bfloat16
    assert hash_of(auto) == hash_of(bf16) != hash_of(fp32)
    monkeypatch.setattr(host, "cpu_has_fast_bf16", lambda: False)
    assert host.pick_dtype("auto", cpu) == torch.float32
    assert hash_of(auto) == fingerprint(auto, Shard())  # "auto", as the first release hashed it
    assert len({hash_of(auto), hash_of(bf16), hash_of(fp32)}) == 3


def test_a_resume_reads_the_input_twice_and_a_first_run_once(tmp_path, monkeypatch):
    """The check for nothing to do and the run share one pass over the input; a resume makes one more, before
    any model loads, comparing the done rows' input with what their output was made from (issue 24, item 1)."""
    from batchrun.config import load_job
    from batchrun.job import Job
    from batchrun.sources import InputSource

    write_prompts(tmp_path / "in.parquet", [f"Say {i}." for i in range(6)])
    job_file = write_job(
        tmp_path / "job.yaml",
        f"name: once\ninput: {{parquet: {tmp_path / 'in.parquet'}, id_column: id}}\n"
        f"sampling: {{max_new_tokens: 2}}\nengine: {{num_pages: 64}}\noutput: {{path: {tmp_path / 'out'}}}\n",
    )
    passes = []
    rows = InputSource.rows
    monkeypatch.setattr(InputSource, "rows", lambda self, *a, **k: passes.append(1) or rows(self, *a, **k))
    assert Job(load_job(job_file), limit=3, progress=False).run()["rows"] == 3
    assert len(passes) == 1
    passes.clear()
    summary = Job(load_job(job_file), progress=False).run()
    assert summary["rows"] == 6 and len(passes) == 2
    assert len(read_outputs(tmp_path / "out")) == 6


def _parts_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("part-*"))}


def test_a_row_whose_input_changed_is_recomputed_or_refused_never_kept(tmp_path):
    """Issue 24, item 1: the cron pattern (a file regenerated at the same path) used to keep every old
    completion with "nothing to do". Each part records its rows' input hashes; a rerun recomputes the changed
    rows (removing their old outputs first: every row once) or, with input.on_change: refuse, exits 2."""
    prompts = [f"Name a colour number {i}." for i in range(6)]
    write_prompts(tmp_path / "in.parquet", prompts, extra={"category": ["k"] * 6})
    job = write_job(
        tmp_path / "job.yaml",
        f"name: changes\nmodel: {{dtype: float32}}\n"
        f"input: {{parquet: {tmp_path / 'in.parquet'}, id_column: id, passthrough: [category]}}\n"
        f"sampling: {{max_new_tokens: 4}}\nengine: {{num_pages: 128}}\n"
        f"output: {{path: {tmp_path / 'out'}, rows_per_part: 2, flush_seconds: 0}}\n",
    )
    assert run_cli("submit", str(job), "--quiet").returncode == 0
    before = read_outputs(tmp_path / "out")
    # the nightly file is regenerated: two prompts and one passthrough value differ
    prompts[1], prompts[4] = "Name a fruit.", "Name a tree."
    write_prompts(tmp_path / "in.parquet", prompts, extra={"category": ["k"] * 5 + ["z"]})
    parts = _parts_bytes(tmp_path / "out")
    r = run_cli("submit", str(job), "--quiet", "--set", "input.on_change=refuse")
    assert r.returncode == 2, r.stderr
    assert "3 rows of input.parquet" in r.stderr and "input.on_change" in r.stderr and "'r1'" in r.stderr, (
        r.stderr
    )
    assert _parts_bytes(tmp_path / "out") == parts, "refusing touches nothing"
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "3 rows of input.parquet" in r.stderr and "recomputing" in r.stderr, r.stderr
    after = read_outputs(tmp_path / "out")  # (read_outputs fails on a row written twice)
    assert sorted(after) == sorted(before)
    fresh = run_cli("submit", str(job), "--quiet", "--set", f"output.path={tmp_path / 'fresh'}")
    assert fresh.returncode == 0, fresh.stderr
    want = read_outputs(tmp_path / "fresh")
    assert {k: v["completion"] for k, v in after.items()} == {k: v["completion"] for k, v in want.items()}
    assert after[("r5", 0)]["category"] == "z"
    assert [k for k in after if after[k]["completion"] != before[k]["completion"]] != []
    summary = json.loads(run_cli("stats", str(tmp_path / "out"), "--json").stdout)
    assert summary["rows_changed"] == 3 and summary["rows"] == 6, summary
    assert "recomputed" in run_cli("stats", str(tmp_path / "out")).stdout
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout


def test_a_changed_openai_batch_line_is_recomputed(tmp_path):
    def line(custom_id, text):
        body = {"model": "base", "messages": [{"role": "user", "content": text}], "max_tokens": 3}
        return json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
        )

    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join([line("a", "Hi."), line("b", "Say yes."), line("c", "Say no.")]) + "\n")
    job = write_job(
        tmp_path / "job.yaml",
        f"name: oai\nmodel: {{dtype: float32}}\ninput: {{openai_batch: {batch}}}\n"
        f"engine: {{num_pages: 64}}\noutput: {{path: {tmp_path / 'out'}, rows_per_part: 1, flush_seconds: 0}}\n",
    )
    assert run_cli("submit", str(job), "--quiet").returncode == 0
    batch.write_text("\n".join([line("a", "Hi."), line("b", "Name a fish."), line("c", "Say no.")]) + "\n")
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0 and "1 row of input.openai_batch" in r.stderr, r.stderr
    lines = [
        json.loads(t) for p in (tmp_path / "out").glob("part-*.jsonl") for t in p.read_text().splitlines()
    ]
    assert sorted(x["custom_id"] for x in lines) == ["a", "b", "c"]  # once each
    fresh = run_cli("submit", str(job), "--quiet", "--set", f"output.path={tmp_path / 'fresh'}")
    assert fresh.returncode == 0
    want = {
        json.loads(t)["custom_id"]: json.loads(t)
        for p in (tmp_path / "fresh").glob("part-*.jsonl")
        for t in p.read_text().splitlines()
    }
    got = {x["custom_id"]: x for x in lines}
    content = lambda x: x["response"]["body"]["choices"][0]["message"]["content"]  # noqa: E731
    assert content(got["b"]) == content(want["b"]) and got["b"]["id"] == want["b"]["id"]
