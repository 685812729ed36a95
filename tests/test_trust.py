"""Trust in reruns: nothing in the output is touched before every check that can refuse the job has passed; a
row's output always comes from the weights the job names today (a retrained model or adapter recomputes the rows
it made, or is refused, or kept when asked); an OpenAI request's `model` is the base model, an adapter, or that
line's error; a row may ask for the base model under a job-wide adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import read_outputs, run_cli, write_job
from test_lora import ADAPTERS, adapter_job, job_model, peft, peft_generate  # noqa: F401 - job_model: a fixture


def _parts(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("part-*"))}


def _save_adapter(base: Path, target: Path, name: str, seed: int) -> None:
    """A PEFT adapter of `name`'s shape (ADAPTERS) trained anew: random weights of another seed, saved in place."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **ADAPTERS[name])).save_pretrained(
        target
    )


@pytest.fixture
def own_copies(tmp_path, job_model):  # noqa: F811 - the fixture imported above
    """The tiny model and its two adapters copied where a test may retrain them in place."""
    path, folders = job_model
    model = shutil.copytree(path, tmp_path / "model", copy_function=shutil.copy2)
    return model, {name: shutil.copytree(f, tmp_path / f"adapter-{name}") for name, f in folders.items()}


def test_overwrite_removes_nothing_before_the_load_has_refused_or_passed(tmp_path, own_copies, model_dir):
    """Issue 65, item 1: `--overwrite` emptied a folder of finished rows, then the load refused the job (a swap
    space too large, an adapter of another base). Each refusal now leaves every part as it was, with one
    engine and with two replicas (one refusing is no go-ahead for the others), and draws no progress bar."""
    from test_families import saved_model
    from transformers import AutoModelForCausalLM

    path, folders = own_copies
    job = adapter_job(tmp_path, own_copies, [None, "a", "b", "a"])
    assert run_cli("submit", str(job), "--quiet").returncode == 0
    out = tmp_path / "out"
    parts = _parts(out)
    assert parts
    wider = saved_model(tmp_path, "llama", {"hidden_size": 96, "head_dim": 24}, model_dir)
    other = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(wider), peft.LoraConfig(r=4, target_modules=["q_proj"])
    )
    other.save_pretrained(tmp_path / "other")
    refusals = [
        ["--set", "engine.swap_space=1TiB"],
        ["--set", "engine.swap_space=1TiB", "--set", "engine.replicas=2"],
        ["--set", f"model.adapters.b={tmp_path / 'other'}"],
    ]
    for args in refusals:
        r = run_cli("submit", str(job), "--overwrite", *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert _parts(out) == parts, f"{args}: the refused run touched the output"
        assert "|" not in r.stderr, f"{args}: a progress bar was drawn before the refusal: {r.stderr}"
    r = run_cli("submit", str(job), "--quiet", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert not set(parts) & set(_parts(out)), "--overwrite replaced the earlier parts once it could run"
    assert len(read_outputs(out)) == 4  # each row once (read_outputs fails on a row written twice)


def test_retrained_weights_recompute_the_rows_they_made_or_are_refused_or_kept(tmp_path, own_copies):
    """Issue 65, item 3: weights retrained at the same path were "nothing to do" with every row stale; adding an
    adapter no row used made the whole output another job. Each row records the weights it ran with."""
    from batchrun.config import load_job
    from batchrun.model_loader import fingerprint_dtype
    from batchrun.rows import FINGERPRINT_KEY, Shard
    from batchrun.sinks import fingerprint

    path, folders = own_copies
    cells = [None, "a", "b", "a", "b"]
    job = adapter_job(tmp_path, own_copies, cells)
    out = tmp_path / "out"
    assert run_cli("submit", str(job), "--quiet").returncode == 0
    before = read_outputs(out)

    _save_adapter(path, folders["b"], "b", seed=7)  # adapter b retrained in place
    parts = _parts(out)
    r = run_cli("submit", str(job), "--quiet", "--set", "model.on_change=refuse")
    assert r.returncode == 2 and "adapter 'b'" in r.stderr and "model.on_change" in r.stderr, r.stderr
    assert _parts(out) == parts, "refusing touches nothing"
    r = run_cli("submit", str(job), "--quiet", "--set", "model.on_change=keep")
    assert r.returncode == 0 and "nothing to do" in r.stdout and "keeping" in r.stderr, r.stdout + r.stderr
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0 and "2 rows" in r.stderr and "adapter 'b'" in r.stderr, r.stderr
    after = read_outputs(out)
    for i, cell in enumerate(cells):
        row = after[(i, 0)]
        assert row["completion_token_ids"] == peft_generate(
            path, folders.get(cell), row["prompt_token_ids"], 8
        )
        if cell != "b":  # the other rows were kept, not recomputed
            assert row["completion"] == before[(i, 0)]["completion"]
    assert any(after[(i, 0)]["completion"] != before[(i, 0)]["completion"] for i in (2, 4))

    # an adapter that no finished row used is no new job
    r = run_cli("submit", str(job), "--quiet", "--set", f"model.adapters.c={folders['a']}")
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr
    # parts written before adapters left the fingerprint (it hashed them) still resume
    spec = load_job(job)
    legacy = fingerprint(spec, Shard(), fingerprint_dtype("float32", None), adapters=True)
    assert legacy != fingerprint(spec, Shard(), "float32")
    import pyarrow.parquet as pq

    for part in out.glob("part-*.parquet"):
        table = pq.read_table(part)
        pq.write_table(
            table.replace_schema_metadata({**table.schema.metadata, FINGERPRINT_KEY: legacy.encode()}), part
        )
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr

    # the model itself retrained (its weight file written anew): every row recomputes, each once
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0 and "5 rows" in r.stderr and "the model's weights" in r.stderr, r.stderr
    assert read_outputs(out).keys() == after.keys()
    summary = json.loads(run_cli("stats", str(out), "--json").stdout)
    assert summary["rows_changed"] == 2 + 5, summary  # the whole job's: adapter b's rows, then every row


def test_a_row_asks_for_the_base_model_under_a_job_wide_adapter(tmp_path, job_model):  # noqa: F811
    """Issue 65, item 7: with model.adapter set, no row could ask for the base model. The reserved name `base`
    does, in an adapter column as in an OpenAI request; a null cell still takes the job's adapter."""
    path, folders = job_model
    cells = ["base", None, "a"]
    job = adapter_job(tmp_path, job_model, cells, extra=", adapter: b")
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = read_outputs(tmp_path / "out")
    for i, want in enumerate([None, "b", "a"]):
        row = rows[(i, 0)]
        assert row["error"] is None
        assert row["completion_token_ids"] == peft_generate(
            path, folders.get(want), row["prompt_token_ids"], 8
        )


def test_an_openai_requests_model_is_the_base_an_adapter_or_its_error(tmp_path, job_model):  # noqa: F811
    """Issue 65, item 2: an unknown `model` was answered by the base model, and the reply echoed the unknown
    name. The base model answers to `base`, model.name and model.path (or its last part); an adapter to its
    name; any other name is that line's error naming the known ones. The reply names what answered."""
    from transformers import AutoTokenizer

    path, folders = job_model
    models = {
        "r-a": "a",
        "r-b": "b",
        "r-base": "base",
        "r-named": "tiny-llama",
        "r-folder": path.name,
        "r-none": None,
        "r-unknown": "gpt-4o-mini",
    }
    with open(tmp_path / "in.jsonl", "w") as f:
        for custom_id, model in models.items():
            body = {"prompt": f"request {custom_id} asks for a story", "max_tokens": 6}
            if model is not None:
                body["model"] = model
            line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
            f.write(json.dumps(line) + "\n")
    adapters = ", ".join(f"{name}: {folder}" for name, folder in folders.items())
    job = write_job(
        tmp_path / "job.yaml",
        f"name: lora\nmodel: {{path: {path}, name: tiny-llama, dtype: float32, adapters: {{{adapters}}}}}\n"
        f"input: {{openai_batch: {tmp_path / 'in.jsonl'}}}\noutput: {{path: {tmp_path / 'out'}}}\n"
        "sampling: {ignore_eos: true}\nengine: {num_pages: 64}\n",
    )
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0, r.stderr
    lines = {
        x["custom_id"]: x
        for f in sorted((tmp_path / "out").glob("part-*.jsonl"))
        for x in map(json.loads, open(f))
    }
    unknown = lines.pop("r-unknown")
    assert unknown["response"] is None
    message = unknown["error"]["message"]
    assert (
        "in.jsonl line 7: body.model: 'gpt-4o-mini' is neither" in message
        and "a, b, base, tiny-llama" in message
    )
    tok = AutoTokenizer.from_pretrained(path)
    for custom_id, line in lines.items():
        adapter = models[custom_id] if models[custom_id] in folders else None
        prompt = tok(f"request {custom_id} asks for a story")["input_ids"]
        body = line["response"]["body"]
        assert body["choices"][0]["text"] == tok.decode(
            peft_generate(path, folders.get(adapter), prompt, 6)
        ), custom_id
        assert body["model"] == (adapter or "tiny-llama"), custom_id


def test_request_ids_carry_the_weights_and_read_as_before_without_them():
    from batchrun import openai_batch

    new = openai_batch.request_id("f" * 32, 7, "abc", "0123456789ab.ba9876543210")
    assert openai_batch.parse_request_id(new) == ("abc", "0123456789ab.ba9876543210", 7)
    assert openai_batch.parse_request_id("batch_req_ffffffffffff_abc_7") == (
        "abc",
        None,
        7,
    )  # before the tags
    assert openai_batch.parse_request_id(openai_batch.request_id("f" * 32, 3, None)) == (None, None, 3)


def _job_of(tmp_path, adapters: dict):
    from batchrun.config import parse_job

    return parse_job(
        {
            "name": "t",
            "model": {"path": str(tmp_path), "adapters": adapters},
            "input": {"parquet": "x.parquet", "adapter_column": "adapter"},
            "output": {"path": str(tmp_path / "out")},
        }
    )


def test_a_rows_name_that_comes_to_name_a_model_or_stops_naming_one_redoes_it(tmp_path):
    """Review of issue 65: an error row (its adapter cell named nothing) was tagged as a base row, so naming that
    adapter later kept the error; a row whose adapter left model.adapters made the rerun's check raise (exit 1)."""
    from batchrun.rows import InputRow
    from batchrun.weights import JobWeights

    row = InputRow(0, 0, "p", adapter="a")
    without_a = JobWeights(_job_of(tmp_path, {"b": "/b"}), "m" * 12, {"b": "b" * 12})
    with_a = JobWeights(_job_of(tmp_path, {"a": "/a", "b": "/b"}), "m" * 12, {"a": "a" * 12, "b": "b" * 12})
    error_tag, served_tag = without_a.tag(row), with_a.tag(row)
    assert error_tag != served_tag != "m" * 12 and error_tag != "m" * 12  # an error row is no base row
    assert "names" in with_a.what_changed(error_tag, row)  # the adapter was added: redone
    assert "names" in without_a.what_changed(served_tag, row)  # the adapter left: redone (as an error row)
    assert with_a.what_changed(served_tag, row) is None and without_a.what_changed(error_tag, row) is None
    retrained = JobWeights(with_a.job, "m" * 12, {"a": "c" * 12, "b": "b" * 12})
    assert retrained.what_changed(served_tag, row) == "adapter 'a''s weights (model.adapters.a)"


def test_overwrite_removes_another_tools_part_files_as_it_did(tmp_path):
    """Review of issue 65: a part-*.parquet whose name batchrun does not write (Spark's part-00000-<uuid>) made
    --overwrite fail after the load; it is removed with the shard's own parts, and `batchrun status` skips it."""
    import pyarrow as pa

    from batchrun.rows import Shard
    from batchrun.sinks import OutputSink, existing_parts
    from batchrun.status import rows_done_per_shard
    from batchrun.weights import JobWeights

    job = _job_of(tmp_path, {"b": "/b"})
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-00000-1234abcd.snappy.parquet").write_bytes(b"not batchrun's")
    assert rows_done_per_shard(out) == {}
    sink = OutputSink(job, Shard(), pa.int64(), [], JobWeights(job, None), overwrite=True)
    assert existing_parts(out), "opening the sink removes nothing"
    sink.begin()
    assert existing_parts(out) == []
