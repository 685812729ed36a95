"""Promises at the edges: no row depends on its batch-mates through static RoPE scaling (LongRoPE and dynamic
NTK: tests/test_long_rope.py), load failures that are not the model's fault keep their own error, sharded
statistics never overwrite each other, a dead run's temporary files go, the prefix chain cannot collide."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest
import torch
from helpers import paged_model_from_config, run_engine
from model_families import perturb, tiny_config
from test_families import NEW_TOKENS, hf_tokens, prompts

from batchrun.engine import Engine, EngineConfig, LoadedModel, SamplingParams
from batchrun.engine.attention import UnsupportedModel

ROPE = {
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0),
    "llama3": dict(
        rope_type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=32,
        rope_theta=10000.0,
    ),
}


def rope_models(family: str, rope: str):
    from transformers import AutoModelForCausalLM

    overrides = dict(rope_parameters=ROPE[rope], max_position_embeddings=128)
    torch.manual_seed(0)
    ours = paged_model_from_config(tiny_config(family, overrides)).eval()
    perturb(ours, seed=1)
    ref = AutoModelForCausalLM.from_config(tiny_config(family, overrides), attn_implementation="eager").eval()
    ref.load_state_dict(ours.state_dict())
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return ours, ref


@pytest.mark.parametrize("rope", ["yarn", "llama3"])
def test_static_rope_scaling_is_exact_and_batch_invariant(rope):
    """YaRN and Llama 3 scale every position alike: each row equals HF `generate` on it alone, beside short and
    long batch-mates (the prompts run past the original 32 positions)."""
    ours, ref = rope_models("llama", rope)
    token_lists = prompts(256)
    expected = hf_tokens(ref, token_lists)
    engine = Engine(LoadedModel(ours), EngineConfig(device="cpu", num_pages=128), torch.device("cpu"))
    seqs, _ = run_engine(engine, token_lists, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [s[0].output_token_ids for s in seqs] == expected
    alone = Engine(LoadedModel(ours), EngineConfig(device="cpu", num_pages=128), torch.device("cpu"))
    seqs, _ = run_engine(alone, token_lists[:1], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert seqs[0][0].output_token_ids == expected[0]


def test_out_of_memory_at_the_probe_is_not_a_bad_model(monkeypatch):
    """Only "this model cannot run" is exit 2 (final for Slurm and Ray); an out-of-memory or I/O error during the
    load probe keeps its own error."""
    from test_families import models

    from batchrun.engine.model.architecture import inspect_model

    model, _ = models("llama")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(model, "forward", oom)
    with pytest.raises(torch.OutOfMemoryError):
        inspect_model(model)
    monkeypatch.setattr(model, "forward", lambda *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError):
        inspect_model(model)
    monkeypatch.setattr(model, "forward", lambda *a, **k: (_ for _ in ()).throw(AttributeError("no .weight")))
    with pytest.raises(UnsupportedModel, match="forward fails"):
        inspect_model(model)


def test_an_explicit_stats_file_is_one_file_per_shard(tmp_path):
    """`output.stats` with shards: each shard writes NAME-IofN beside the given name, and `batchrun stats` on the
    given name combines them (it used to be one file every shard overwrote)."""
    from batchrun.config import parse_job
    from batchrun.report import stats_files

    (tmp_path / "in.parquet").touch()
    spec = parse_job(
        {
            "name": "s",
            "input": {"parquet": str(tmp_path / "in.parquet")},
            "output": {"path": str(tmp_path / "out"), "stats": str(tmp_path / "st" / "stats.parquet")},
        }
    )
    paths = [spec.stats_path(i, 3) for i in range(3)]
    assert len(set(paths)) == 3 and all(p.parent == tmp_path / "st" for p in paths)
    assert spec.stats_path() == tmp_path / "st" / "stats.parquet"
    for p in paths:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"")
    assert stats_files(spec.stats_source()) == sorted(paths)


def test_dead_processes_temporaries_are_removed_live_ones_kept(tmp_path):
    from batchrun import storage

    dead = subprocess.Popen(["true"])
    dead.wait()
    storage.write_text_whole(tmp_path / "part-0.jsonl", "{}\n")  # writes under a temporary name, then renames
    tag = storage._temporary_tag()
    gone = tmp_path / f".part-1.parquet{tag}{dead.pid}"
    kept = tmp_path / f".part-2.parquet{tag}{os.getpid()}"
    other_host = tmp_path / f".part-3.parquet.tmp-elsewhere-{dead.pid}"
    for f in (gone, kept, other_host):
        f.write_bytes(b"torn")
    assert storage.remove_dead_temporaries(tmp_path) == 1
    assert not gone.exists() and kept.exists() and other_host.exists()
    assert (tmp_path / "part-0.jsonl").read_text() == "{}\n"


def test_the_prefix_chain_is_sha256_of_the_whole_prefix():
    """A page's key covers every token before it, collision-safe: the chain equals SHA-256 recomputed over the
    whole prefix page by page (Python's `hash()` of a tuple, which the chain used to be, collides: hash(-1) ==
    hash(-2))."""
    import array

    from batchrun.engine.core.page_pool import chain_hash

    pages = [list(range(i * 16, i * 16 + 16)) for i in range(4)]
    h = None
    for k, page in enumerate(pages):
        h = chain_hash(h, page)
        expected = b""
        for p in pages[: k + 1]:
            expected = hashlib.sha256(expected + array.array("q", p).tobytes()).digest()
        assert h == expected
    assert chain_hash(None, [1, 2]) != chain_hash(None, [2, 1])


def test_a_wait_for_a_shards_lock_can_be_stopped_and_ends(tmp_path):
    """A replaced Ray shard waits for its dead holder's lock: `stop()` ends the wait (exit 3's JobStopped), and
    so does a time limit (a live run holds the shard). It used to wait forever, deaf to stop()."""
    import threading
    import time

    from batchrun.errors import BadInput, JobStopped
    from batchrun.lock import ShardLock

    holder = ShardLock(tmp_path, 0, 1)
    holder.acquire(False, tmp_path, "job.yaml")
    stopping = threading.Event()
    threading.Timer(0.3, stopping.set).start()
    t0 = time.monotonic()
    with pytest.raises(JobStopped, match="stopped while waiting"):
        ShardLock(tmp_path, 0, 1).acquire(True, tmp_path, "job.yaml", stop=stopping.is_set)
    with pytest.raises(BadInput, match="still held by another run"):
        ShardLock(tmp_path, 0, 1).acquire(True, tmp_path, "job.yaml", limit_s=0.5)
    assert time.monotonic() - t0 < 10
    holder.release()
    ShardLock(tmp_path, 0, 1).acquire(True, tmp_path, "job.yaml", stop=stopping.is_set)  # free: taken at once


def test_status_counts_rows_in_written_parts(tmp_path):
    """A finished row waits in the part writer's buffer until its part is written; `batchrun status` counted it
    done already, though a run killed then would do it again. The writer counts input rows in written parts."""
    import pyarrow as pa

    from batchrun.rows import InputRow, OutputRow, Shard
    from batchrun.sinks import ParquetParts, PartWriter, output_schema

    fmt = ParquetParts(output_schema(pa.string(), []), "fp", "t", lambda row: None)
    writer = PartWriter(tmp_path, fmt, Shard(), rows_per_part=4, max_wait_s=3600)
    row = lambda i, s: OutputRow(f"r{i}", s, "x", "length", None, 1, 1, 0, row=InputRow(i, f"r{i}", "p"))  # noqa: E731
    for i in range(3):  # three input rows of two samples: 6 output rows, one part of 4+ written at the second
        writer.add([row(i, 0), row(i, 1)])
        assert writer.inputs_written == (2 if i >= 1 else 0), i
    writer.flush()
    assert writer.inputs_written == 3 and writer.rows_written == 6


def test_out_of_memory_while_loading_is_not_a_bad_model_path(tmp_path, monkeypatch):
    """The load turned every exception into exit 2 ("cannot load the model"): an out-of-memory keeps its own
    error (exit 1: Slurm and Ray may retry it), a broken model directory stays a bad job."""
    import transformers

    from batchrun.engine.model import loading
    from batchrun.errors import BadInput

    (tmp_path / "model").mkdir()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(loading, "load_paged_model", oom)
    with pytest.raises(torch.OutOfMemoryError):
        loading.load_model(tmp_path / "model", torch.float32, torch.device("cpu"))
    monkeypatch.setattr(loading, "load_paged_model", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(BadInput, match="cannot load the model"):
        loading.load_model(tmp_path / "model", torch.float32, torch.device("cpu"))
