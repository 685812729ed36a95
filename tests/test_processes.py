"""One job, many processes: the shard lock, replicas, `batchrun status`, whole-job statistics, memory budgets."""

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import BATCHRUN, read_outputs, run_cli, write_job, write_prompts

N_ROWS = 24


@pytest.fixture()
def job(tmp_path):
    prompts = [f"Write a short line about the number {i}." for i in range(N_ROWS)]
    write_prompts(tmp_path / "in.parquet", prompts)
    text = f"""
name: procs
model: {{dtype: float32}}
input:
  parquet: {tmp_path / "in.parquet"}
  id_column: id
sampling:
  max_new_tokens: 24
  ignore_eos: true
engine:
  num_pages: 256
  max_num_seqs: 4
output:
  path: {tmp_path / "out"}
  rows_per_part: 2
  flush_seconds: 0
"""
    return write_job(tmp_path / "job.yaml", text), tmp_path / "out"


def start(job_file, *args, own_group: bool = False):
    """`batchrun submit` in the background; `own_group`: in a process group of its own (with its replicas),
    which a test can pause whole."""
    return subprocess.Popen(
        [BATCHRUN, "submit", str(job_file), "--quiet", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )


def wait_for(predicate, timeout=120.0, what="condition"):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def parts(out: Path) -> int:
    return len(list(out.glob("part-*.parquet"))) if out.exists() else 0


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_a_second_run_of_the_same_shard_exits_2_at_once(job):
    """The holder is paused (SIGSTOP keeps its flock) while the second run starts: a tiny model's whole job can
    finish in the seconds a second interpreter takes to start, and then there is nothing to refuse."""
    job_file, out = job
    first = start(job_file)
    wait_for(lambda: parts(out) >= 1, what="the first run's first part")
    first.send_signal(signal.SIGSTOP)
    try:
        t0 = time.time()
        second = run_cli("submit", str(job_file), "--quiet")
        assert second.returncode == 2 and time.time() - t0 < 30, second.stderr
    finally:
        first.send_signal(signal.SIGCONT)
    assert f"pid {first.pid}" in second.stderr and "host" in second.stderr and "started" in second.stderr
    assert first.wait(timeout=300) == 0, first.stderr.read()
    rows = read_outputs(out)  # asserts no (id, sample) twice
    assert len(rows) == N_ROWS
    # --wait waits for the holder instead, then finds nothing left to do
    other = out.parent / "other"
    holder = start(job_file, "--set", f"output.path={other}")
    wait_for(lambda: parts(other) >= 1, what="the holder's first part")
    holder.send_signal(signal.SIGSTOP)
    try:
        waiting = start(job_file, "--wait", "--set", f"output.path={other}")
        announced = waiting.stdout.readline()  # printed (and flushed) once the lock is seen held
    finally:
        holder.send_signal(signal.SIGCONT)
    assert holder.wait(timeout=300) == 0
    assert waiting.wait(timeout=300) == 0, waiting.stderr.read()
    assert "waiting for the run holding shard 0/1" in announced
    assert "nothing to do" in waiting.stdout.read()
    assert len(read_outputs(other)) == N_ROWS


def test_kill_9_frees_the_lock(job):
    job_file, out = job
    proc = start(job_file)
    wait_for(lambda: parts(out) >= 1, what="a part")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t0 = time.time()
    r = run_cli("submit", str(job_file), "--quiet")
    assert r.returncode == 0, r.stderr
    assert len(read_outputs(out)) == N_ROWS
    assert time.time() - t0 < 120


def test_two_replicas_equal_one_process(job, tmp_path):
    job_file, out = job
    r = run_cli(
        "submit", str(job_file), "--quiet", "--replicas", "2", "--set", f"output.path={tmp_path / 'two'}"
    )
    assert r.returncode == 0, r.stderr
    one = run_cli("submit", str(job_file), "--quiet", "--set", f"output.path={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr
    got, want = read_outputs(tmp_path / "two"), read_outputs(tmp_path / "one")
    assert {k: v["completion"] for k, v in got.items()} == {k: v["completion"] for k, v in want.items()}
    assert len(got) == N_ROWS
    st = json.loads(run_cli("status", str(tmp_path / "two"), "--json").stdout)
    assert st["rows_done"] == st["rows_total"] == N_ROWS
    assert st["shards"][0]["state"] == "finished" and st["shards"][0]["replicas"] == 2
    summary = json.loads(run_cli("stats", str(tmp_path / "two"), "--json").stdout)
    assert summary["rows"] == N_ROWS and summary["replicas"] == 2
    assert summary["generated_tokens"] == 24 * N_ROWS


def test_kill_9_of_the_parent_leaves_no_replica_and_resumes_with_one(job):
    job_file, out = job
    proc = start(job_file, "--replicas", "2", own_group=True)
    wait_for(lambda: parts(out) >= 2, what="parts from the replicas")
    os.killpg(proc.pid, signal.SIGSTOP)  # the job and its replicas paused mid-run, so the kill lands mid-run
    kids = children(proc.pid)
    assert len([k for k in kids if alive(k)]) >= 2, kids
    st = json.loads(run_cli("status", str(out), "--json").stdout)  # during the run
    assert (
        st["shards"][0]["state"] == "running" and 0 < st["rows_done"] < N_ROWS and st["rows_total"] == N_ROWS
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with contextlib.suppress(ProcessLookupError):  # what is left of the group runs on: the replicas must die
        os.killpg(proc.pid, signal.SIGCONT)
    wait_for(
        lambda: not any(alive(k) for k in kids), timeout=10, what="the replicas to die with their parent"
    )
    r = run_cli("submit", str(job_file), "--quiet", "--replicas", "1")
    assert r.returncode == 0, r.stderr
    assert len(read_outputs(out)) == N_ROWS  # every row once
    summary = json.loads(run_cli("stats", str(out), "--json").stdout)
    assert summary["runs"] == 2 and summary["rows"] == N_ROWS, summary
    import pyarrow.parquet as pq

    # the killed run wrote no step rows before its first refresh; the resumed one's carry run 2
    runs = set(pq.read_table(out / ".batchrun" / "stats.parquet", columns=["run"]).column("run").to_pylist())
    assert runs == {2}


def test_a_dead_replica_fails_the_run_naming_it(job, tmp_path):
    job_file, out = job
    proc = start(job_file, "--replicas", "2")
    wait_for(lambda: parts(out) >= 1, what="a part")
    kids = [k for k in children(proc.pid) if alive(k)]
    # the replicas are the children running multiprocessing's spawn_main (not its resource tracker)
    replicas = [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    assert replicas, kids
    os.kill(replicas[0], signal.SIGKILL)
    code = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert code == 1 and "replica" in err and "died" in err, err
    rows = read_outputs(out)  # what the others finished is written, once
    st = json.loads(run_cli("status", str(out), "--json").stdout)
    assert st["shards"][0]["state"] == "failed" and st["rows_done"] == len(rows)


def test_a_kv_budget_beyond_memory_is_exit_2_before_loading(job):
    job_file, _ = job
    r = run_cli("submit", str(job_file), "--quiet", "--set", "engine.swap_space=100TiB")
    assert r.returncode == 2 and "engine.swap_space" in r.stderr and "available" in r.stderr, r.stderr
    r = run_cli("submit", str(job_file), "--quiet", "--set", "engine.num_pages=1000000000")
    assert r.returncode == 2 and "engine.num_pages" in r.stderr, r.stderr
    r = run_cli(
        "submit",
        str(job_file),
        "--quiet",
        "--set",
        "engine.num_pages=null",
        "--set",
        "engine.kv_cache_memory=90TiB",
    )
    assert r.returncode == 2 and "engine.kv_cache_memory" in r.stderr, r.stderr
