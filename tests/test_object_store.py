"""Input and output on an object store: a real S3 server (moto in server mode, its own process on 127.0.0.1)
that batchrun reaches over HTTP with s3fs, as it would AWS. Credentials and the endpoint come from the
environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID), as for any user."""

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import BATCHRUN, moto_server, read_outputs, run_cli, write_job, write_prompts

N_ROWS = 16


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on a free port, the environment that points boto at it, and an s3fs file system."""
    with moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


def put_parquet(fs, key: str, table: pa.Table) -> None:
    with fs.open(key, "wb") as f:
        pq.write_table(table, f)


def s3_outputs(fs, prefix: str) -> dict:
    """(id, sample) -> row of every Parquet part under the prefix, asserting no pair appears twice."""
    rows = {}
    for key in sorted(fs.find(prefix)):
        if key.rsplit("/", 1)[1].startswith("part-") and key.endswith(".parquet"):
            with fs.open(key, "rb") as f:
                for r in pq.read_table(f).to_pylist():
                    assert (r["id"], r["sample"]) not in rows, f"{(r['id'], r['sample'])} written twice"
                    rows[(r["id"], r["sample"])] = r
    return rows


def job_text(name: str, input_key: str, input_path: str, out: str, rows_per_part: int = 1000) -> str:
    return f"""
name: {name}
model: {{dtype: float32}}
input: {{{input_key}: "{input_path}"}}
sampling: {{max_new_tokens: 8}}
engine: {{num_pages: 256, max_num_seqs: 4}}
output: {{path: "{out}", rows_per_part: {rows_per_part}, flush_seconds: 0}}
"""


def test_parquet_glob_in_and_out_equal_a_local_run(s3, tmp_path):
    env, fs = s3
    prompts = [f"Name a fruit whose name starts with the letter {c}." for c in "ABCDEFGH"]
    ids = [f"r{i}" for i in range(len(prompts))]
    for half, key in ((slice(0, 5), "bkt/in/a.parquet"), (slice(5, 8), "bkt/in/b.parquet")):
        put_parquet(fs, key, pa.table({"id": ids[half], "prompt": prompts[half]}))
    fs.pipe_file("bkt/in/notes.txt", b"not a part of the input")
    write_prompts(tmp_path / "in.parquet", prompts, ids)
    local = write_job(
        tmp_path / "local.yaml", job_text("t", "parquet", tmp_path / "in.parquet", tmp_path / "out")
    )
    remote = write_job(
        tmp_path / "s3.yaml", job_text("t", "parquet", "s3://bkt/in/*.parquet", "s3://bkt/out")
    )
    r = run_cli("submit", str(local), "--quiet", "--set", "input.id_column=id", env=env)
    assert r.returncode == 0, r.stderr
    r = run_cli("submit", str(remote), "--quiet", "--set", "input.id_column=id", env=env)
    assert r.returncode == 0, r.stderr
    expected = {k: v["completion"] for k, v in read_outputs(tmp_path / "out").items()}
    got = {k: v["completion"] for k, v in s3_outputs(fs, "bkt/out").items()}
    assert got == expected and len(got) == len(prompts)
    locks = fs.find("bkt/out/.batchrun/locks")  # the lease, given back; no probe object left behind
    assert [k.rsplit("/", 1)[1] for k in locks] == ["shard-00000of00001.lease"], locks
    assert json.loads(fs.cat_file(locks[0]))["released"] is True, "the lease was not given back"
    # a rerun finds every row in the store's listing: nothing to do, no model loaded
    r = run_cli("submit", str(remote), "--quiet", "--set", "input.id_column=id", env=env)
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr
    status = run_cli("status", "s3://bkt/out", "--json", env=env)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert st["rows_done"] == len(prompts) and st["shards"][0]["state"] == "finished", st
    stats = run_cli("stats", "s3://bkt/out", "--json", env=env)
    assert stats.returncode == 0 and json.loads(stats.stdout)["rows"] == len(prompts), stats.stderr
    # every path option takes a URL as job keys do (--plot wrote ./s3:/..., --from read s3:/...)
    png = "s3://bkt/out/.batchrun/memory.png"
    plotted = run_cli("stats", "s3://bkt/out", "--plot", png, env=env, cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr
    fs.invalidate_cache()
    assert fs.cat_file(png[5:])[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "s3:").exists()
    replay = run_cli("simulate", "--from", "s3://bkt/out", "--budget", "4096", env=env, cwd=tmp_path)
    assert replay.returncode == 0 and f"{len(prompts)} requests" in replay.stdout, (
        replay.stdout + replay.stderr
    )


def test_openai_batch_in_and_out(s3, tmp_path):
    env, fs = s3
    lines = [
        {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "base", "messages": [{"role": "user", "content": f"Say the number {i}."}], "max_tokens": 6}}
        for i in range(4)
    ]  # fmt: skip
    text = "\n".join(json.dumps(x) for x in lines) + "\n{not json\n"
    fs.pipe_file("bkt/batch/requests.jsonl", text.encode())
    (tmp_path / "requests.jsonl").write_text(text)
    for where, out in (
        (tmp_path / "requests.jsonl", tmp_path / "out"),
        ("s3://bkt/batch", "s3://bkt/batch-out"),
    ):
        job = write_job(tmp_path / "job.yaml", job_text("oa", "openai_batch", where, out))
        r = run_cli("submit", str(job), "--quiet", env=env)
        assert r.returncode == 0, r.stderr

    def answers(texts: list[str]) -> dict:
        got = [json.loads(t) for text in texts for t in text.splitlines() if t.strip()]
        ids = Counter(x["custom_id"] for x in got)
        assert all(n == 1 for n in ids.values()), ids
        return {x["custom_id"]: (x["response"] or {}).get("body", {}).get("choices", x["error"]) for x in got}

    local = answers([p.read_text() for p in (tmp_path / "out").glob("part-*.jsonl")])
    remote = answers([fs.cat_file(k).decode() for k in fs.find("bkt/batch-out") if k.endswith(".jsonl")])
    assert remote.keys() == local.keys() == {"q0", "q1", "q2", "q3", None}
    for key in local:  # the same completions; the bad line an error line naming its line
        if key is None:
            assert "requests.jsonl line 5" in json.dumps(remote[None]), remote[None]
        else:
            assert [c["message"]["content"] for c in remote[key]] == [
                c["message"]["content"] for c in local[key]
            ]


def test_a_second_run_is_refused_and_kill_9_resumes_every_row_once(s3, tmp_path):
    """While a run holds the shard's lease, a second one exits 2 naming it; the first killed with kill -9
    leaves its lease behind, which the next run takes over once stale and finishes: every row once."""
    env, fs = s3
    prompts = [f"Write one sentence about the number {i}." for i in range(N_ROWS)]
    put_parquet(fs, "bkt/kin/in.parquet", pa.table({"id": list(range(N_ROWS)), "prompt": prompts}))
    job = write_job(
        tmp_path / "job.yaml", job_text("k", "parquet", "s3://bkt/kin/in.parquet", "s3://bkt/kout", 2)
    )
    # one row at a time, so that rows keep finishing after the second part is seen and the kill lands mid-run
    # (four at a time, the last rows finished in one burst before the kill: 16 of 16 written, seen in CI)
    text = job.read_text().replace("max_new_tokens: 8", "max_new_tokens: 16")
    job.write_text(text.replace("max_num_seqs: 4", "max_num_seqs: 1"))
    env = {**env, "BATCHRUN_LEASE_S": "4"}
    first = subprocess.Popen(
        [BATCHRUN, "submit", str(job), "--quiet", "--set", "input.id_column=id"],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lease = "bkt/kout/.batchrun/locks/shard-00000of00001.lease"
    t0 = time.time()
    while not fs.exists(lease):
        assert first.poll() is None and time.time() - t0 < 120, first.communicate()
        time.sleep(0.1)
    second = run_cli("submit", str(job), "--quiet", "--set", "input.id_column=id", env=env)
    assert second.returncode == 2, second.stderr
    assert "being written by another run" in second.stderr and f"pid {first.pid}" in second.stderr, (
        second.stderr
    )
    while len([k for k in fs.find("bkt/kout") if "/part-" in k]) < 2:
        assert first.poll() is None and time.time() - t0 < 180, first.communicate()
        time.sleep(0.1)
        fs.invalidate_cache()
    first.send_signal(signal.SIGKILL)
    first.wait()
    fs.invalidate_cache()
    written = len(s3_outputs(fs, "bkt/kout"))
    assert 0 < written < N_ROWS, written
    again = run_cli("submit", str(job), "--quiet", "--set", "input.id_column=id", "--wait", env=env)
    assert again.returncode == 0, again.stderr
    assert "took over shard 0/1's lease" in again.stdout, again.stdout
    fs.invalidate_cache()
    rows = s3_outputs(fs, "bkt/kout")
    assert sorted(k[0] for k in rows) == list(range(N_ROWS))


def test_a_store_without_conditional_writes_is_refused_unless_no_lock(tmp_path):
    """memory:// cannot create an object only if absent, atomically: exit 2 saying so; --no-lock runs."""
    import fsspec

    from batchrun import run_job
    from batchrun.errors import BadInput

    write_prompts(tmp_path / "in.parquet", ["Say yes.", "Say no."])
    job = {
        "name": "m",
        "input": {"parquet": str(tmp_path / "in.parquet")},
        "sampling": {"max_new_tokens": 4},
        "engine": {"num_pages": 64},
        "output": {"path": "memory://batchrun-test/out"},
    }
    with pytest.raises(BadInput, match="--no-lock") as err:
        run_job(job, progress=False)
    assert "memory://" in str(err.value) and "conditional" in str(err.value)
    summary = run_job(job, progress=False, lock=False)
    assert summary["rows"] == 2
    fs = fsspec.filesystem("memory")
    parts = [k for k in fs.find("/batchrun-test/out") if "/part-" in k]
    assert sum(pq.read_table(fs.open(k, "rb")).num_rows for k in parts) == 2


def test_lease_is_exclusive_renewed_taken_over_when_stale_and_lost_when_taken(s3):
    """The lease alone, without a model: a second holder is refused while the first renews; a lease left by a
    dead run is taken over once stale; a run whose lease was taken over finds out before it writes."""
    from upath import UPath

    from batchrun.errors import BadInput, JobStopped
    from batchrun.lock import LeaseLock

    state = UPath("s3://bkt/lease-test/.batchrun")
    os.environ["BATCHRUN_LEASE_S"] = "1.2"
    try:
        a = LeaseLock(state, 0, 1)
        a.acquire(False, "s3://bkt/lease-test", "job.yaml")
        time.sleep(2.0)  # longer than the lease: only a's renewals keep it
        with pytest.raises(BadInput, match="being written by another run"):
            LeaseLock(state, 0, 1).acquire(False, "s3://bkt/lease-test", "job.yaml")
        a._ended.set()  # a stops renewing, as a run killed with kill -9 does
        time.sleep(1.5)
        b = LeaseLock(state, 0, 1)
        b.acquire(False, "s3://bkt/lease-test", "job.yaml")  # stale: taken over
        time.sleep(1.0)
        a._ended.clear()
        a._renew_once()
        with pytest.raises(JobStopped, match="taken over"):
            a.check()
        b.check()
        b.release()
        assert json.loads((state / "locks" / "shard-00000of00001.lease").read_bytes())["released"] is True
        c = LeaseLock(state, 0, 1)
        c.acquire(False, "s3://bkt/lease-test", "job.yaml")  # free again at once
        c.release()
    finally:
        os.environ.pop("BATCHRUN_LEASE_S")


class CuttableProxy:
    """A TCP proxy on 127.0.0.1 to the moto server whose connections can be cut (and later let through again):
    a run reaching the store through it loses the store, as on a network partition."""

    def __init__(self, target: str):
        host, port = target.rsplit("//", 1)[1].split(":")
        self.target = (host, int(port))
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.cut = threading.Event()
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut.is_set():
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.close()
            except OSError:
                pass

    def sever(self) -> None:
        self.cut.set()
        for sock in self.open:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.open = []

    def restore(self) -> None:
        self.cut.clear()

    def close(self) -> None:
        self.sever()
        self.listener.close()


def test_a_run_cut_off_from_the_store_stops_writing_and_gives_back_nothing_it_lost(s3):
    """Run a reaches the store through a proxy that is then cut: after half a lease without a renewal it writes
    nothing more (it used to go on: its renewals' errors were swallowed); run b, watching the lease unchanged for
    a whole lease on its own clock, takes it over; when a reaches the store again, its release leaves b's lease
    alone (a plain delete used to remove it)."""
    from upath import UPath

    from batchrun import storage
    from batchrun.errors import JobStopped
    from batchrun.lock import LeaseLock

    env, fs = s3
    proxy = CuttableProxy(env["AWS_ENDPOINT_URL"])
    os.environ["BATCHRUN_LEASE_S"] = "2"
    cut_off = dict(
        client_kwargs={"endpoint_url": proxy.url},
        config_kwargs={"connect_timeout": 0.5, "read_timeout": 0.5, "retries": {"max_attempts": 1}},
        skip_instance_cache=True,
    )
    try:
        a = LeaseLock(UPath("s3://bkt/cut/.batchrun", **cut_off), 0, 1)
        a.acquire(False, "s3://bkt/cut", "job.yaml")
        a.check()
        proxy.sever()
        time.sleep(1.3)  # more than half the lease without a renewal
        with pytest.raises(JobStopped, match="could not be renewed"):
            a.check()
        t0 = time.monotonic()
        b = LeaseLock(UPath("s3://bkt/cut/.batchrun"), 0, 1)
        b.acquire(True, "s3://bkt/cut", "job.yaml")
        assert time.monotonic() - t0 >= 1.0, "taken over before the lease could be stale on b's clock"
        proxy.restore()
        a.release()  # a never learnt it lost the lease: its give-back must not remove b's
        # b's renewals rewrite the lease every half second: a plain open-and-read can meet a new version
        # between its two requests (s3fs's FileExpired), so read it as the lock does.
        data, _ = storage.read_versioned(UPath("s3://bkt/cut/.batchrun/locks/shard-00000of00001.lease"))
        lease = json.loads(data)
        assert lease["owner"] == b.record["owner"] and lease["released"] is False
        b.check()
        b.release()
    finally:
        os.environ.pop("BATCHRUN_LEASE_S")
        proxy.close()


def test_staleness_is_judged_on_the_takers_clock(s3, monkeypatch):
    """A holder whose clock is far behind writes old time stamps, but renews: no other run takes the lease over
    (one used to, at once, comparing the holder's stamp with its own clock)."""
    from upath import UPath

    from batchrun import lock
    from batchrun.errors import BadInput
    from batchrun.lock import LeaseLock

    os.environ["BATCHRUN_LEASE_S"] = "1.2"
    state = UPath("s3://bkt/skew/.batchrun")
    try:
        a = LeaseLock(state, 0, 1)
        real = lock.time.time
        monkeypatch.setattr(
            a,
            "_data",
            lambda released=False: json.dumps(
                {**a.record, "renewed": real() - 3600, "released": released}
            ).encode(),
        )
        a.acquire(False, "s3://bkt/skew", "job.yaml")
        with pytest.raises(BadInput, match="being written by another run"):
            LeaseLock(state, 0, 1).acquire(False, "s3://bkt/skew", "job.yaml")
        a.check()
        a.release()
    finally:
        os.environ.pop("BATCHRUN_LEASE_S")


def test_a_store_that_ignores_conditional_writes_is_found_by_the_probe(s3, monkeypatch):
    """Some S3-compatible servers accept If-None-Match / If-Match and ignore them: the probe finds out, on s3://
    too, and the run is a bad job naming --no-lock (it used to be trusted from the scheme)."""
    import s3fs
    from upath import UPath

    from batchrun.errors import BadInput
    from batchrun.lock import LeaseLock

    real = s3fs.S3FileSystem._pipe_file

    async def ignoring(self, path, data, **kwargs):  # what such a server does with the conditions
        kwargs.pop("mode", None)
        kwargs.pop("IfMatch", None)
        return await real(self, path, data, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", ignoring)
    with pytest.raises(BadInput, match="--no-lock"):
        LeaseLock(UPath("s3://bkt/ignoring/.batchrun", skip_instance_cache=True), 0, 1).acquire(
            False, "s3://bkt/ignoring", "job.yaml"
        )


def test_no_lock_beside_a_live_holder_is_refused(s3, tmp_path):
    """--no-lock while another run holds the shard (a live lease on the store, an OS lock on disk): exit 2 naming
    the holder, not every row written twice (it used to go ahead without a word)."""
    from upath import UPath

    from batchrun.errors import BadInput
    from batchrun.lock import LeaseLock, NoLock, ShardLock

    for state, held in (
        (UPath("s3://bkt/nolock/.batchrun"), LeaseLock(UPath("s3://bkt/nolock/.batchrun"), 0, 1)),
        (tmp_path / ".batchrun", ShardLock(tmp_path / ".batchrun", 0, 1)),
    ):
        held.acquire(False, "out", "job.yaml")
        with pytest.raises(BadInput, match="--no-lock does not let"):
            NoLock(state, 0, 1).acquire(False, "out", "job.yaml")
        held.release()
        NoLock(state, 0, 1).acquire(False, "out", "job.yaml")  # nobody holds it: goes ahead


def test_an_unknown_bucket_is_named_as_such(s3, tmp_path):
    """An input in a bucket that does not exist said "no Parquet files match"; it says the bucket is missing
    (an existing bucket without the files keeps the old message)."""
    env, fs = s3
    for url, words in (
        ("s3://no-such-bucket/in/*.parquet", "the bucket 'no-such-bucket' does not exist"),
        ("s3://bkt/nothing-here/*.parquet", "no Parquet files match"),
    ):
        job = write_job(tmp_path / "job.yaml", job_text("u", "parquet", url, str(tmp_path / "out")))
        r = run_cli("validate", str(job), env=env)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    put_parquet(fs, "bkt/uin/in.parquet", pa.table({"id": [0], "prompt": ["Hi"]}))
    job = write_job(
        tmp_path / "job.yaml", job_text("u", "parquet", "s3://bkt/uin/in.parquet", "s3://no-such-bucket/out")
    )
    r = run_cli("validate", str(job), env=env)  # validate said ok; submit refused it
    assert r.returncode == 2 and "output.path" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_missing_credentials_are_a_bad_job_naming_the_key(s3, tmp_path):
    """No credentials for the store: exit 2 naming the key and what to check (it was exit 1 and botocore's
    raw NoCredentialsError)."""
    env, _ = s3
    job = write_job(tmp_path / "job.yaml", job_text("c", "parquet", "s3://bkt/in/*.parquet", "s3://bkt/cout"))
    bare = {
        **env,
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    }
    bare["AWS_CONFIG_FILE"] = "/dev/null"
    r = run_cli("validate", str(job), env=bare)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "input.parquet" in r.stderr and "credentials" in r.stderr, r.stderr
