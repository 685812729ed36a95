"""Whole jobs: inputs (Parquet, save_to_disk), outputs, bad rows, validation errors, memory flatness."""

import json
import re
import resource
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ROOT, read_outputs, run_cli, write_job, write_prompts

from batchrun.config import load_job
from batchrun.errors import BadInput
from batchrun.job import Job
from batchrun.rows import Shard
from batchrun.sources import InputSource

PROMPTS = [
    "Name a color.",
    "What is 2 + 2?",
    "Say hello in French.",
    "Name a fruit.",
    "What is a cat?",
    "Write one word about rain.",
]

JOB = """
name: t
input:
  {input}
  prompt_column: prompt
  id_column: id
  passthrough: [category]
sampling:
  max_new_tokens: 6
engine:
  num_pages: 128
output:
  path: {out}
"""


def run_job(tmp_path, input_yaml, name="out", **kw):
    job_file = write_job(tmp_path / f"{name}.yaml", JOB.format(input=input_yaml, out=tmp_path / name))
    spec = load_job(job_file)
    Job(spec, progress=False, **kw).run()
    return read_outputs(tmp_path / name)


def test_parquet_and_save_to_disk_give_identical_outputs(tmp_path):
    import datasets

    cats = [f"c{i % 2}" for i in range(len(PROMPTS))]
    write_prompts(tmp_path / "in.parquet", PROMPTS, extra={"category": cats})
    datasets.Dataset.from_dict(
        {"id": [f"r{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS, "category": cats}
    ).save_to_disk(str(tmp_path / "ds"))
    a = run_job(tmp_path, f"parquet: {tmp_path / 'in.parquet'}", "a")
    b = run_job(tmp_path, f"dataset: {{path: {tmp_path / 'ds'}}}", "b")
    assert a == b and len(a) == len(PROMPTS)
    assert {r["category"] for r in a.values()} == {"c0", "c1"}
    assert all(r["finish_reason"] in ("eos", "length") and r["completion"] for r in a.values())


def test_local_data_files_through_load_dataset(tmp_path):
    (tmp_path / "data").mkdir()
    write_prompts(tmp_path / "data" / "train.parquet", PROMPTS[:3], extra={"category": ["x"] * 3})
    rows = run_job(tmp_path, f"dataset: {{path: parquet, data_dir: {tmp_path / 'data'}, split: train}}")
    assert len(rows) == 3


def test_bad_rows_become_error_rows_and_the_job_goes_on(tmp_path):
    prompts = ["Name a color.", None, "", "   ", "x " * 9000, "What is 2 + 2?"]
    table = pa.table({"id": [f"r{i}" for i in range(6)], "prompt": prompts, "category": ["a"] * 6})
    pq.write_table(table, tmp_path / "in.parquet")
    rows = run_job(tmp_path, f"parquet: {tmp_path / 'in.parquet'}")
    assert len(rows) == 6
    reasons = {k[0]: (r["finish_reason"], r["error"]) for k, r in rows.items()}
    assert reasons["r0"][0] != "error" and reasons["r5"][0] != "error"
    for bad in ("r1", "r2", "r3", "r4"):
        assert reasons[bad][0] == "error" and reasons[bad][1], bad
        assert rows[(bad, 0)]["completion"] is None
    assert "null" in reasons["r1"][1] and "empty" in reasons["r2"][1]
    assert "context" in reasons["r4"][1] or "KV" in reasons["r4"][1]


def test_a_prompt_column_of_numbers_is_exit_2_before_the_load_and_a_null_prompt_an_error_row(tmp_path):
    """Issue 24, item 4: a column that cannot hold prompts is the job's mistake, found by `validate` and before
    any model loads (it used to load the model and make every row an error row, exit 0)."""
    pq.write_table(
        pa.table({"id": [1, 2], "prompt": [3, 4], "category": ["a", "b"]}), tmp_path / "in.parquet"
    )
    with pytest.raises(BadInput, match=r"`input.prompt_column`: column 'prompt' .* holds int64"):
        run_job(tmp_path, f"parquet: {tmp_path / 'in.parquet'}")
    job_file = write_job(
        tmp_path / "v.yaml", JOB.format(input=f"parquet: {tmp_path / 'in.parquet'}", out="x")
    )
    r = run_cli("validate", str(job_file))
    assert r.returncode == 2 and "input.prompt_column" in r.stderr and "int64" in r.stderr, r.stderr
    pq.write_table(
        pa.table({"id": [1, 2], "prompt": [None, "Hi."], "category": ["a", "b"]}), tmp_path / "in.parquet"
    )
    rows = run_job(tmp_path, f"parquet: {tmp_path / 'in.parquet'}")
    assert rows[(1, 0)]["finish_reason"] == "error" and rows[(1, 0)]["error"] == "prompt is null"
    assert rows[(2, 0)]["finish_reason"] in ("eos", "length")
    assert pq.read_schema(next((tmp_path / "out").glob("part-*.parquet"))).field("id").type == pa.int64()


def test_output_columns_follow_the_contract(tmp_path):
    write_prompts(tmp_path / "in.parquet", PROMPTS[:2], extra={"category": ["a", "b"]})
    run_job(tmp_path, f"parquet: {tmp_path / 'in.parquet'}")
    schema = pq.read_schema(next((tmp_path / "out").glob("part-*.parquet")))
    expected = {
        "id": pa.string(),
        "sample": pa.int32(),
        "completion": pa.string(),
        "finish_reason": pa.string(),
        "error": pa.string(),
        "prompt_tokens": pa.int32(),
        "completion_tokens": pa.int32(),
        "num_preemptions": pa.int32(),
        "category": pa.string(),
    }
    assert {f.name: f.type for f in schema} == expected


def test_stop_strings_are_cut_from_the_completion(tmp_path):
    write_prompts(
        tmp_path / "in.parquet",
        ["Count from one to ten in words, separated by commas."],
        extra={"category": ["a"]},
    )
    job_file = write_job(
        tmp_path / "j.yaml",
        JOB.format(input=f"parquet: {tmp_path / 'in.parquet'}", out=tmp_path / "out").replace(
            "max_new_tokens: 6", "max_new_tokens: 40"
        ),
    )
    free = read_outputs_after(job_file, tmp_path / "free")
    text = free[("r0", 0)]["completion"]
    assert len(text) > 20, text
    stop = text[12:15]  # whatever the model writes, stop at a piece of it
    # as JSON, a YAML double-quoted string: a newline in the piece stays one (Python's repr would be single-quoted,
    # where YAML reads "\n" as a backslash and an n)
    quoted = json.dumps(stop)
    stopped = read_outputs_after(job_file, tmp_path / "stopped", [f"sampling.stop=[{quoted}]"])[("r0", 0)]
    assert stopped["finish_reason"] == "stop"
    assert stopped["completion"] == text[: text.find(stop)]


def read_outputs_after(job_file, out, overrides=()):
    spec = load_job(job_file, [f"output.path={out}", *overrides])
    Job(spec, progress=False).run()
    return read_outputs(out)


def test_streaming_a_million_rows_keeps_memory_flat(tmp_path):
    path = tmp_path / "big.parquet"
    writer = None
    for chunk in range(20):  # 1,000,000 rows in row groups of 50,000
        ids = list(range(chunk * 50_000, (chunk + 1) * 50_000))
        t = pa.table({"id": ids, "prompt": [f"Prompt number {i}: say something." for i in ids]})
        writer = writer or pq.ParquetWriter(path, t.schema)
        writer.write_table(t)
    writer.close()
    from batchrun.config import InputSpec

    source = InputSource(InputSpec(parquet=str(path), id_column="id"))
    assert source.num_rows() == 1_000_000
    rows = source.rows(Shard(1, 4))
    for _ in range(1000):  # warm up: first batches and allocator pools
        next(rows)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    count = 1000
    for row in rows:
        count += 1
        assert row.index % 4 == 1
    growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert count == 250_000
    # the whole prompt column is ~35 MiB of text; streaming holds one row group at a time
    assert growth_mib < 40, f"peak RSS grew {growth_mib:.0f} MiB while streaming"


@pytest.mark.parametrize(
    "mutation, key",
    [
        ("sampling:\n  temperature: hot", "sampling.temperature"),
        ("sampling:\n  max_new_tokens: 0", "sampling.max_new_tokens"),
        ("engine:\n  page_size: 12", "engine.page_size"),
        ("engine:\n  preemption: drop", "engine.preemption"),
        ("bogus: 1", "bogus"),
        ("sampling:\n  tempreature: 0.5", "sampling.tempreature"),
    ],
)
def test_validation_errors_exit_2_and_name_the_key(tmp_path, mutation, key):
    write_prompts(tmp_path / "in.parquet", PROMPTS[:2], extra={"category": ["a", "b"]})
    text = f"name: t\ninput:\n  parquet: {tmp_path / 'in.parquet'}\n{mutation}\n"
    job = write_job(tmp_path / "job.yaml", text)
    r = run_cli("validate", str(job))
    assert r.returncode == 2, r.stderr
    assert key in r.stderr and str(job) in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "text, words",
    [
        ("name: t\ninput:\n  parquet: {dir}/nope.parquet\n", ["input.parquet", "nope.parquet"]),
        (
            "name: t\ninput:\n  parquet: {dir}/in.parquet\n  prompt_column: question\n",
            ["input.prompt_column", "question"],
        ),
        ("name: t\ninput:\n  parquet: {dir}/in.parquet\n  dataset: {{path: x}}\n", ["exactly one", "both"]),
        ("name: t\ninput: {{}}\n", ["exactly one", "neither"]),
        ("name: t\ninput:\n  parquet: ''\n", ["input.parquet", "empty"]),  # found by the fuzz test
        ("name: t\nmodel:\n  path: {dir}/no-model\ninput:\n  parquet: {dir}/in.parquet\n", ["model.path"]),
        (
            "name: t\ninput:\n  parquet: {dir}/in.parquet\n  passthrough: [nope]\n",
            ["input.passthrough[0]", "nope"],
        ),
        ("name: [t\n", ["not valid YAML"]),
        ("input:\n  parquet: {dir}/in.parquet\n", ["`name`"]),
    ],
)
def test_bad_job_files_exit_2_with_a_clear_message(tmp_path, text, words):
    write_prompts(tmp_path / "in.parquet", PROMPTS[:2], ids=["a", "a"] if "dup" in text else None)
    job = write_job(tmp_path / "job.yaml", text.format(dir=tmp_path))
    r = run_cli("validate", str(job))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


@pytest.mark.parametrize(
    "extra, words",
    [
        ("output: {{path: {dir}/a-file/out}}\n", ["output.path", "a-file"]),
        ("output: {{path: /proc/batchrun-out}}\n", ["output.path", "/proc"]),
        ("output: {{path: 'memory://bucket/out'}}\n", ["conditional writes", "--no-lock"]),
        ("engine: {{kv_cache_memory: 500TiB}}\n", ["engine.kv_cache_memory", "512000.0 GiB"]),
    ],
)
def test_validate_refuses_what_submit_refuses(tmp_path, extra, words):
    """`validate` said ok for outputs and budgets that `submit` then refused: it checks them now."""
    write_prompts(tmp_path / "in.parquet", PROMPTS[:2])
    (tmp_path / "a-file").write_text("not a folder")
    job = write_job(
        tmp_path / "job.yaml",
        f"name: t\ninput: {{parquet: {tmp_path / 'in.parquet'}}}\n" + extra.format(dir=tmp_path),
    )
    r = run_cli("validate", str(job))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def test_a_bad_job_file_is_refused_before_torch_is_imported(tmp_path):
    """submit, validate and slurm read the job file before they import the engine: a mistake in it is refused in
    a fraction of a second, not after the seconds torch and transformers take to import (a fresh interpreter,
    so nothing here has imported them first)."""
    job = write_job(
        tmp_path / "job.yaml",
        f"name: t\ninput:\n  parquet: {tmp_path / 'in.parquet'}\nsampling:\n  max_new_tokens: -3\n"
        f"output:\n  path: {tmp_path / 'out'}\n",
    )
    probe = f"""
import sys
from click.testing import CliRunner
from batchrun.cli import main
import batchrun.job  # the module alone imports no engine either
for cmd in (["submit", "--quiet"], ["validate"], ["slurm", "--array", "2"]):
    r = CliRunner().invoke(main, [*cmd, {str(job)!r}])
    assert r.exit_code == 2 and "sampling.max_new_tokens" in r.output, (cmd, r.exit_code, r.output)
assert "torch" not in sys.modules and "transformers" not in sys.modules
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_duplicate_ids_are_rejected_before_any_work(tmp_path):
    write_prompts(tmp_path / "in.parquet", PROMPTS[:3], ids=["a", "b", "a"])
    job = write_job(
        tmp_path / "job.yaml",
        f"name: t\ninput:\n  parquet: {tmp_path / 'in.parquet'}\n"
        f"  id_column: id\noutput:\n  path: {tmp_path / 'out'}\n",
    )
    for cmd in (["validate", str(job)], ["submit", str(job), "--quiet"]):
        r = run_cli(*cmd)
        assert r.returncode == 2 and "appears more than once" in r.stderr, r.stderr
    assert not list((tmp_path / "out").glob("part-*")) if (tmp_path / "out").exists() else True


def test_set_overrides_any_key_and_is_validated(tmp_path):
    spec = load_job(
        ROOT / "jobs" / "demo.yaml",
        ["sampling.temperature=0.7", "engine.num_pages=64", "model.system_prompt=Be brief."],
    )
    assert spec.sampling.temperature == 0.7 and spec.engine.num_pages == 64
    assert spec.model.system_prompt == "Be brief."
    r = run_cli("validate", str(ROOT / "jobs" / "demo.yaml"), "--set", "sampling.top_p=2")
    assert r.returncode == 2 and "sampling.top_p" in r.stderr


def test_set_with_malformed_yaml_is_exit_2_not_a_string():
    """issue 24, item 14: `[a, b` used to become the string '[a, b'."""
    r = run_cli("validate", str(ROOT / "jobs" / "demo.yaml"), "--set", "sampling.stop=[a, b")
    assert r.returncode == 2 and "sampling.stop" in r.stderr and "not valid YAML" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    spec = load_job(ROOT / "jobs" / "demo.yaml", ["sampling.stop=[a, b]", "model.system_prompt='[x'"])
    assert list(spec.sampling.stop) == ["a", "b"] and spec.model.system_prompt == "[x"


def test_kv_cache_too_small_for_one_page_is_exit_2(tmp_path):
    write_prompts(tmp_path / "in.parquet", PROMPTS[:1], extra={"category": ["a"]})
    job = write_job(
        tmp_path / "job.yaml",
        f"name: t\ninput:\n  parquet: {tmp_path / 'in.parquet'}\nengine:\n  kv_cache_memory: 1KiB\n"
        f"output:\n  path: {tmp_path / 'out'}\n",
    )
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 2 and "engine.kv_cache_memory" in r.stderr, r.stderr
    assert not list((tmp_path / "out").glob("part-*")) if (tmp_path / "out").exists() else True


def test_unwritable_output_path_is_exit_2(tmp_path):
    write_prompts(tmp_path / "in.parquet", PROMPTS[:1], extra={"category": ["a"]})
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    job = write_job(
        tmp_path / "job.yaml",
        f"name: t\ninput:\n  parquet: {tmp_path / 'in.parquet'}\noutput:\n  path: {blocker / 'out'}\n",
    )
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 2 and "output.path" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- issue 24, items 3, 4 and 8 -------------------------------------------------------------------------------
def _bogus_model(tmp_path):
    """A model directory a load would fail on: a job that gets past its checks without loading says so."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path / "model"


def test_an_input_without_rows_loads_no_model_and_leaves_an_empty_table_of_the_job_columns(tmp_path):
    write_prompts(tmp_path / "in.parquet", [], extra={"category": []})
    job = write_job(
        tmp_path / "job.yaml",
        JOB.format(input=f"parquet: {tmp_path / 'in.parquet'}", out=tmp_path / "out")
        + f"model: {{path: {_bogus_model(tmp_path)}}}\n",
    )
    r = run_cli("validate", str(job))
    assert r.returncode == 0 and "input 0 rows (nothing to do" in r.stdout, r.stdout + r.stderr
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0 and "nothing to do" in r.stdout and "has no rows" in r.stdout, (
        r.stdout + r.stderr
    )
    table = pq.read_table(tmp_path / "out")
    assert table.num_rows == 0 and table.column_names[:3] == ["id", "sample", "completion"], table.schema
    assert "category" in table.column_names
    r = run_cli("submit", str(job), "--quiet")  # again: still one (empty) part, still nothing to do
    assert r.returncode == 0 and len(list((tmp_path / "out").glob("part-*"))) == 1
    st = json.loads(run_cli("status", str(tmp_path / "out"), "--json").stdout)  # it said `pending 0/?`
    assert st["shards"][0]["state"] == "finished" and st["rows_done"] == 0 and st["rows_total"] == 0, st


def test_slurm_with_an_unwritable_output_is_exit_2(tmp_path):
    write_prompts(tmp_path / "in.parquet", PROMPTS[:1], extra={"category": ["a"]})
    (tmp_path / "a-file").write_text("")  # no directory can be made under a file (root included)
    job = write_job(
        tmp_path / "job.yaml",
        JOB.format(input=f"parquet: {tmp_path / 'in.parquet'}", out=tmp_path / "a-file" / "out"),
    )
    r = run_cli("slurm", str(job), "--array", "2")
    assert r.returncode == 2 and "output.path" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_heartbeat_beats_while_the_model_loads():
    """`status` called a loading run stale: the heartbeat only beat inside the step loop. It now refreshes on a
    thread of its own from the start, in state loading."""
    import tempfile
    import time
    from pathlib import Path

    from batchrun.heartbeat import Heartbeat, read_heartbeats

    with tempfile.TemporaryDirectory() as d:
        beat = Heartbeat(Path(d), Shard(), interval_s=0.05)
        beat.start(10, 10, 0, 1)
        first = read_heartbeats(Path(d))[0]
        time.sleep(0.3)  # no beat() call: the load blocks the run's thread
        later = read_heartbeats(Path(d))[0]
        assert first["state"] == later["state"] == "loading" and later["updated"] > first["updated"]
        beat.running()
        beat.beat(4)
        time.sleep(0.2)
        assert read_heartbeats(Path(d))[0]["state"] == "running"
        assert read_heartbeats(Path(d))[0]["rows_done"] == 4
        beat.finish("finished", 10)
        done = read_heartbeats(Path(d))[0]
        time.sleep(0.2)
        assert done["state"] == "finished" and read_heartbeats(Path(d))[0]["updated"] == done["updated"]


def test_status_gives_a_stopped_shard_its_rows_over_its_running_time(tmp_path):
    import time

    from batchrun.config import STATE_DIR
    from batchrun.heartbeat import Heartbeat
    from batchrun.status import format_status, job_status

    beat = Heartbeat(tmp_path / STATE_DIR, Shard(), interval_s=60)
    beat.start(100, 100, 0, 1)
    beat.running()
    t0 = time.monotonic()
    time.sleep(0.2)
    beat.finish("stopped", 6)
    ran = time.monotonic() - t0
    st = job_status(tmp_path)
    shard = st["shards"][0]
    assert shard["state"] == "stopped" and 6 / (ran + 0.1) < shard["rows_per_s"] <= 6 / 0.2, st  # it said 0.0
    assert st["rows_per_s"] == shard["rows_per_s"] and st["eta_s"] is None  # stopped: no time left to guess
    assert f"{shard['rows_per_s']:.1f} rows/s" in format_status(st)


def test_status_counts_the_rows_of_the_limit_and_a_finished_rate_and_the_summary_the_load(tmp_path):
    from batchrun.report import format_summary
    from batchrun.status import format_status, job_status

    write_prompts(tmp_path / "in.parquet", PROMPTS[:4], extra={"category": ["a"] * 4})
    job_file = write_job(
        tmp_path / "job.yaml", JOB.format(input=f"parquet: {tmp_path / 'in.parquet'}", out=tmp_path / "out")
    )
    summary = Job(load_job(job_file), progress=False).run()
    st = job_status(tmp_path / "out")
    assert st["rows_done"] == st["rows_total"] == 4 and st["shards"][0]["state"] == "finished"
    assert st["rows_per_s"] > 0 and st["shards"][0]["rows_per_s"] > 0, st  # it used to say 0.0 rows/s
    printed = format_summary(summary)
    assert summary["load_s"] > 0 and "loading the model" in printed, printed
    assert f"{summary['wall_s'] + summary['load_s']:.1f} s" in printed
    # the first row changes; a rerun of the first 2 rows recomputes it: 2 of 2, though the parts hold 4
    write_prompts(tmp_path / "in.parquet", ["Name a bird.", *PROMPTS[1:4]], extra={"category": ["a"] * 4})
    assert Job(load_job(job_file), progress=False, limit=2).run()["rows_changed"] == 1
    st = job_status(tmp_path / "out")
    assert st["rows_done"] == st["rows_total"] == 2, format_status(st)
    assert "2 of 2 rows done (100.0%)" in format_status(st)


@pytest.mark.parametrize("task", ["embed", "score", "classify", "reward"])
def test_a_sampling_key_set_on_a_pooling_job_is_exit_2_naming_the_key(tmp_path, task):
    pair = "pair_column: passage, " if task == "score" else ""
    job = write_job(
        tmp_path / "job.yaml",
        f"name: p\ntask: {task}\ninput: {{{pair}parquet: {tmp_path / 'in.parquet'}}}\n",
    )
    load_job(job)  # without it, the job is fine
    with pytest.raises(
        BadInput, match=rf"key `sampling.temperature` applies to task generate, and task is {task}"
    ):
        load_job(job, ["sampling.temperature=0.5"])


def test_max_model_len_above_the_models_positions_is_exit_2_at_validate_and_before_the_load(
    tmp_path, model_dir, monkeypatch
):
    """It was silently lowered to the model's limit (rows then said "max_model_len is 8192"); vLLM refuses it."""
    from transformers import AutoConfig

    import batchrun.engine.model.loading

    limit = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    write_prompts(tmp_path / "in.parquet", PROMPTS[:2], extra={"category": ["a"] * 2})
    job = write_job(
        tmp_path / "job.yaml", JOB.format(input=f"parquet: {tmp_path / 'in.parquet'}", out=tmp_path / "out")
    )
    at = ["--set", f"model.path={model_dir}", "--set"]
    assert run_cli("validate", str(job), *at, f"model.max_model_len={limit}").returncode == 0
    r = run_cli("validate", str(job), *at, f"model.max_model_len={limit + 1}")
    said = (
        f"key `model.max_model_len` is {limit + 1}, above the model's {limit} positions (its config's "
        "max_position_embeddings)"
    )
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(batchrun.engine.model.loading, "load_model", no_load)
    spec = load_job(job, [f"model.path={model_dir}", f"model.max_model_len={limit + 1}"])
    with pytest.raises(BadInput, match=re.escape(said)):
        Job(spec, progress=False).run()


def test_an_unset_swap_space_fits_the_ram_at_start_and_a_set_one_too_large_is_exit_2(tmp_path, monkeypatch):
    """The old default (4 GiB) refused whole jobs where less RAM was available; unset now, it is sized to fit
    and the summary says what it became. Set beyond the RAM, it is still refused, in plain words."""
    import torch

    from batchrun.engine import EngineConfig
    from batchrun.engine.model import sizing
    from batchrun.report import format_summary

    monkeypatch.setattr(sizing, "available_ram", lambda: int(2.6 * 2**30))
    cpu = torch.device("cpu")
    sizing.check_memory_budget(EngineConfig(num_pages=8), None, torch.float32, cpu)  # it refused this
    assert sizing.swap_bytes(EngineConfig()) == int(2.6 * 2**30) // 4
    monkeypatch.setattr(sizing, "available_ram", lambda: 64 << 30)
    assert (
        sizing.swap_bytes(EngineConfig()) == 4 << 30
        and sizing.swap_bytes(EngineConfig(swap_space="1GiB")) == 1 << 30
    )
    monkeypatch.setattr(sizing, "available_ram", lambda: int(2.6 * 2**30))
    with pytest.raises(
        BadInput,
        match=r"key `engine.swap_space`: asks for 4.0 GiB, and only 2.6 GiB of RAM is available; "
        "lower it or leave it unset",
    ):
        sizing.check_memory_budget(EngineConfig(num_pages=8, swap_space="4GiB"), None, torch.float32, cpu)
    write_prompts(tmp_path / "in.parquet", PROMPTS[:2], extra={"category": ["a"] * 2})
    job = write_job(
        tmp_path / "job.yaml", JOB.format(input=f"parquet: {tmp_path / 'in.parquet'}", out=tmp_path / "out")
    )
    summary = Job(load_job(job), progress=False).run()  # unset, with 2.6 GiB available: a quarter of it
    assert summary["swap_space_bytes"] == int(2.6 * 2**30) // 4
    printed = format_summary(summary)
    rule = "the smaller of 4 GiB and 25% of the RAM available at start"
    assert re.search(rf"swap space +665\.6 MiB \(engine.swap_space unset: {rule}\)", printed), printed


def test_an_explicit_bfloat16_on_a_cpu_without_bf16_hardware_is_said_at_load_and_in_the_summary(
    tmp_path, monkeypatch, capsys
):
    import torch

    import batchrun.host
    from batchrun.report import format_summary

    monkeypatch.setattr(batchrun.host, "cpu_has_fast_bf16", lambda: False)
    write_prompts(tmp_path / "in.parquet", PROMPTS[:2], extra={"category": ["a"] * 2})
    job = write_job(
        tmp_path / "job.yaml", JOB.format(input=f"parquet: {tmp_path / 'in.parquet'}", out=tmp_path / "out")
    )
    summary = Job(load_job(job, ["model.dtype=bfloat16", "sampling.max_new_tokens=2"]), progress=False).run()
    said = "model.dtype bfloat16 on a CPU without bf16 hardware (AMX or AVX512-BF16)"
    assert f"batchrun: warning: {said}" in capsys.readouterr().err
    assert said in format_summary(summary)
    assert batchrun.host.pick_dtype("auto", torch.device("cpu")) == torch.float32  # auto: no warning to give
