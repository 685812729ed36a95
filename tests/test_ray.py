"""batchrun on a Ray cluster that the tests start on this machine (2 CPUs): `submit --ray` on two actors equal to
one process row for row; SIGTERM to the driver (exit 3, resumable); an actor killed with kill -9 mid-run and
every row still written once; the Ray Data processor inside read_parquet -> map_batches -> write_parquet
(jobs/ray_data_pipeline.py) equal to `batchrun submit` row for row, a bad row as an error row."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import BATCHRUN, ROOT, read_outputs, run_cli, wait_for_parts, write_job, write_prompts

pytestmark = pytest.mark.ray
RAY = str(Path(sys.executable).parent / "ray")
N_ROWS = 12
BAD = 5  # an empty prompt: an error row


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node Ray cluster (2 CPUs) of its own, its address, stopped at the end: `ray start --block`, whose
    process stops the cluster it started when it ends (`ray stop` would stop every cluster of the machine).
    Without token authentication, for it and its clients (this process's children): Ray turns it on for a
    cluster when ~/.ray/auth_token exists (a local `ray.init()` writes one), and clients then need
    RAY_AUTH_MODE=token. Without a drain on SIGTERM (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0): by default the head
    first waits for its node to go idle, up to 30 seconds, and a Ray Data pipeline's actors leave it busy until
    then; the tests have nothing to drain, and the cluster ends with the module either way."""
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    start = [RAY, "start", "--head", "--block", "--num-cpus", "2", "--port", str(port), "--temp-dir", temp]
    start += ["--include-dashboard=false", "--disable-usage-stats"]
    log = open(tmp_path_factory.mktemp("ray-log") / "ray-start.log", "w")  # noqa: SIM115 - closed at the end
    env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    head = subprocess.Popen(start, stdout=log, stderr=subprocess.STDOUT, env=env)
    t0 = time.time()
    while subprocess.run([RAY, "status", "--address", f"127.0.0.1:{port}"], capture_output=True).returncode:
        assert head.poll() is None and time.time() - t0 < 120, "ray start --head failed"
        time.sleep(1)
    yield f"127.0.0.1:{port}"
    head.send_signal(signal.SIGTERM)
    head.wait(60)
    log.close()
    if saved is None:
        os.environ.pop("RAY_AUTH_MODE")
    else:
        os.environ["RAY_AUTH_MODE"] = saved


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A job of N_ROWS rows (one bad) and its rows as one process writes them: the reference."""
    d = tmp_path_factory.mktemp("ray")
    prompts = [f"Tell me one thing about the number {i}." for i in range(N_ROWS)]
    prompts[BAD] = ""
    write_prompts(d / "in.parquet", prompts)
    # fp32: a row's tokens do not depend on which rows share its batch; one sequence at a time and a part per
    # row: a shard takes long enough to be killed midway
    text = f"""
name: ray
model: {{dtype: float32}}
input: {{parquet: {d / "in.parquet"}, id_column: id}}
sampling: {{max_new_tokens: 12}}
engine: {{num_pages: 256, max_num_seqs: 1}}
output: {{path: {d / "ref"}, rows_per_part: 1, flush_seconds: 0}}
"""
    job_file = write_job(d / "job.yaml", text)
    r = run_cli("submit", str(job_file), "--quiet")
    assert r.returncode == 0, r.stderr
    return job_file, d, cells(read_outputs(d / "ref"))


def cells(rows: dict) -> dict:
    return {k[0]: (r["completion"], r["finish_reason"], r["error"]) for k, r in rows.items()}


def test_two_actors_equal_one_process(cluster, job):
    job_file, d, expected = job
    out = d / "two"
    r = run_cli(
        "submit", str(job_file), "--quiet", "--ray", cluster, "--replicas", "2", "--set", f"output.path={out}"
    )
    assert r.returncode == 0, r.stderr
    assert "2 Ray actors" in r.stderr and "rows                       12" in r.stdout, r.stdout + r.stderr
    assert cells(read_outputs(out)) == expected
    assert expected[f"r{BAD}"] == (None, "error", "prompt is empty")
    st = json.loads(run_cli("status", str(out), "--json").stdout)
    assert [s["state"] for s in st["shards"]] == ["finished", "finished"] and st["rows_done"] == N_ROWS, st


def test_more_actors_than_the_clusters_cpus_is_refused_up_front(cluster, job):
    """--replicas 5 on a 2-CPU cluster: three shards would wait for CPUs the finished actors kept (the driver
    hung, deaf to SIGTERM); refused before any actor starts, naming the CPUs."""
    job_file, d, _ = job
    r = run_cli(
        "submit",
        str(job_file),
        "--quiet",
        "--ray",
        cluster,
        "--replicas",
        "5",
        "--set",
        f"output.path={d / 'five'}",
    )
    assert r.returncode == 2, r.stderr
    assert "5 actors" in r.stderr and "has 2" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_unreachable_ray_client_address_is_exit_2(job):
    """--ray ray://HOST:PORT needs Ray Client (the `ray` extra brings it) and a server there: nothing listening is
    exit 2 naming the address (it was exit 1, "Ray Client requires pip package 'ray[client]'")."""
    job_file, d, _ = job
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    r = run_cli("submit", str(job_file), "--quiet", "--ray", f"ray://127.0.0.1:{port}")
    assert r.returncode == 2, r.stderr
    assert f"ray://127.0.0.1:{port}" in r.stderr and "ray[client]" not in r.stderr, r.stderr


def test_ray_with_the_output_on_s3(cluster, job, tmp_path):
    """--ray and an object store together (each was tested alone): two actors write their shards' parts, leases
    and statistics to s3://, every row once, equal to one local process; status and stats read it there."""
    from helpers import moto_server

    job_file, d, expected = job
    with moto_server(tmp_path) as (env, fs):
        env = {**env, "BATCHRUN_FORWARD_ENV": ",".join(env)}  # the test cluster's node has no credentials
        r = run_cli(
            "submit", str(job_file), "--quiet", "--ray", cluster, "--replicas", "2",
            "--set", "output.path=s3://bkt/ray-out", env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        rows = {}
        for key in sorted(fs.find("bkt/ray-out")):
            if key.rsplit("/", 1)[1].startswith("part-"):
                with fs.open(key, "rb") as f:
                    for row in pq.read_table(f).to_pylist():
                        assert (row["id"], row["sample"]) not in rows, f"{row['id']} written twice"
                        rows[(row["id"], row["sample"])] = row
        assert cells(rows) == expected
        st = json.loads(run_cli("status", "s3://bkt/ray-out", "--json", env=env).stdout)
        assert [s["state"] for s in st["shards"]] == ["finished", "finished"] and st["rows_done"] == N_ROWS, (
            st
        )
        stats = run_cli("stats", "s3://bkt/ray-out", "--json", env=env)
        assert stats.returncode == 0 and json.loads(stats.stdout)["rows"] == N_ROWS, stats.stderr


def start_driver(job_file, cluster: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [BATCHRUN, "submit", str(job_file), "--quiet", "--ray", cluster, "--replicas", "2"]
        + ["--set", f"output.path={out}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_stops_the_actors_and_a_killed_actor_loses_no_row(cluster, job):
    """SIGTERM to the driver: every actor writes what it finished, exit 3. The rerun resumes; an actor killed
    with kill -9 midway has its shard resumed by a new one: every row written once, equal to one process."""
    job_file, d, expected = job
    out = d / "killed"
    driver = start_driver(job_file, cluster, out)
    shard_0 = "part-00000of00002-*.parquet"  # its parts hold a row each
    assert wait_for_parts(out, 1, driver, timeout=240, pattern=shard_0), driver.communicate()
    driver.send_signal(signal.SIGTERM)
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 3, stderr
    written = len(read_outputs(out))
    assert 0 < written < N_ROWS, written
    before = len(list(out.glob(shard_0)))
    driver = start_driver(job_file, cluster, out)
    assert wait_for_parts(out, before + 1, driver, timeout=240, pattern=shard_0), driver.communicate()
    pid = json.loads((out / ".batchrun" / "heartbeat-00000of00002.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 0, stderr
    assert "the actor running shard 0/2 died" in stderr, stderr
    assert cells(read_outputs(out)) == expected  # read_outputs asserts no (id, sample) twice


def test_the_ray_data_processor_equals_submit(cluster, job, tmp_path):
    job_file, d, expected = job
    out = tmp_path / "pipeline"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "jobs" / "ray_data_pipeline.py"),
            str(job_file),
            str(d / "in.parquet"),
            str(out),
        ]
        + ["--address", cluster, "--batch-size", "4"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == N_ROWS and {r["sample"] for r in rows} == {0}
    assert {r["id"]: (r["completion"], r["finish_reason"], r["error"]) for r in rows} == expected
    assert {r["prompt"] for r in rows if r["id"] == f"r{BAD}"} == {""}  # the batch's own columns come along
    assert re.search(r"\d+ batches, 12 rows; .* idle between batches", r.stdout), r.stdout


class FakeWorker:
    """A worker without a model (loop.Worker): each row takes `steps` engine steps; records which input rows ran
    in each step; raises at step `die_at`."""

    def __init__(self, steps: int = 5, die_at: int | None = None, at_step=None):
        self.steps, self.die_at, self.at_step = steps, die_at, at_step  # at_step(n): called before step n
        self.running: dict = {}  # row -> steps left
        self.log: list[set] = []

    @property
    def wants_rows(self) -> bool:
        return len(self.running) < 8

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def feed(self, row):
        self.running[row.index] = [row, self.steps]
        return None

    def step(self):
        from batchrun.rows import OutputRow

        if self.at_step:
            self.at_step(len(self.log))
        if self.die_at is not None and len(self.log) == self.die_at:
            raise RuntimeError("out of memory")
        self.log.append({r.id for r, _ in self.running.values()})
        done = []
        for index, entry in list(self.running.items()):
            entry[1] -= 1
            if entry[1] == 0:
                del self.running[index]
                row = entry[0]
                done.append([OutputRow(row.id, 0, f"done {row.id}", "length", None, 1, 1, 0, row=row)])
        return done


def rows_of(batch: str, n: int):
    from batchrun.rows import InputRow

    return lambda counter: [InputRow(next(counter), f"{batch}{j}", "p") for j in range(n)]


def test_the_engine_thread_runs_a_new_batch_beside_the_one_still_decoding():
    """Rows of a second batch are admitted while the first decodes (the engine is not drained between
    batches), and each batch's future gets its own rows, in order."""
    from batchrun.ray import EngineThread

    futures = []
    submit_b = lambda n: n == 2 and futures.append(engine.submit(rows_of("b", 3)))  # noqa: E731 - mid-decode
    worker = FakeWorker(steps=6, at_step=submit_b)
    engine = EngineThread(worker)
    first = engine.submit(rows_of("a", 3))
    got_a = first.result(timeout=10)
    got_b = futures[0].result(timeout=10)
    engine.close()
    assert [[r.completion for r in samples] for samples in got_a] == [["done a0"], ["done a1"], ["done a2"]]
    assert [samples[0].id for samples in got_b] == ["b0", "b1", "b2"]
    assert any({"a0", "b0"} <= ran for ran in worker.log), worker.log


def test_a_dead_engine_fails_every_waiting_batch():
    from batchrun.ray import EngineThread

    engine = EngineThread(FakeWorker(steps=6, die_at=2))
    first, second = engine.submit(rows_of("a", 2)), engine.submit(rows_of("b", 2))
    for future in (first, second):
        with pytest.raises(RuntimeError, match="the engine died: RuntimeError\\('out of memory'\\)"):
            future.result(timeout=10)
    assert isinstance(engine.dead, RuntimeError)
    with pytest.raises(RuntimeError, match="the engine died"):
        engine.submit(rows_of("c", 1)).result(timeout=10)


def test_a_batch_submitted_as_the_engine_dies_is_failed_not_forgotten():
    """The engine dies between a submitter's look at `dead` and its registering the batch: the batch must still
    hear of it (it used to wait forever: the death was declared outside the lock the batch registers under)."""
    import threading
    import time

    from batchrun.ray import EngineThread

    trigger, died = threading.Event(), threading.Event()

    def hook(step):
        if trigger.is_set():
            raise RuntimeError("out of memory")
        time.sleep(0.002)

    class LateLock:
        """The submitter, once armed, kills the engine and waits for the engine thread to declare the death
        (and let go of the lock) before it takes the lock itself."""

        def __init__(self):
            self.lock, self.armed = threading.Lock(), False

        def __enter__(self):
            if self.armed and threading.current_thread() is threading.main_thread():
                trigger.set()
                died.wait(10)
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()
            if threading.current_thread() is not threading.main_thread() and trigger.is_set():
                died.set()

    engine = EngineThread(FakeWorker(steps=10**6, at_step=hook))
    lock = engine._mutex = LateLock()
    first = engine.submit(rows_of("a", 1))  # keeps the engine stepping
    lock.armed = True
    late = engine.submit(rows_of("b", 1))
    for future in (first, late):
        with pytest.raises(RuntimeError, match="the engine died"):
            future.result(timeout=10)


def test_the_processor_refuses_a_column_an_output_column_would_replace(job):
    """A batch with its own `error` or `completion` column: an error naming it, as `submit` refuses such a
    passthrough column (the processor used to replace the column silently)."""
    import asyncio

    import pyarrow as pa

    from batchrun.ray import Processor

    job_file, _, _ = job
    processor = Processor(str(job_file))
    for column in ("error", "completion"):
        batch = pa.table({"id": ["a"], "prompt": ["Say hi."], column: ["mine"]})
        with pytest.raises(ValueError, match=f"column '{column}' clashes with an output column"):
            asyncio.run(processor(batch))
    ok = asyncio.run(processor(pa.table({"id": ["a"], "prompt": ["Say hi."], "topic": ["greeting"]})))
    assert ok.column("topic").to_pylist() == ["greeting"] and ok.column("error").to_pylist() == [None]
