"""`batchrun submit job.yaml --ray ADDRESS`: one job across a Ray cluster.

The job's rows are split into shards (row i to shard i mod N, as for Slurm arrays), one per Ray actor: an actor
per GPU of the cluster, or on CPUs `--replicas N` actors sharing its cores. Each actor runs its shard as
`batchrun submit --shard I/N` would: the shard's lock, resume from the parts already written, its statistics and
heartbeat in the output's state folder. So the output must be where every node reaches it: a shared file system
or an object store (s3://). batchrun must be installed on the nodes (the same version as here).

The driver (this process) checks the job before any model loads, starts the actors, shows one progress bar
(read from the shards' heartbeats) and prints one summary (the shards' statistics combined). An actor that dies
(its process killed, its node lost) has its shard run again by a new actor, which resumes from the parts
written and waits for the lock the dead one held (an OS lock goes with its process; a lease goes stale): every
row is written once. SIGTERM or SIGINT to the driver stops every actor cleanly (each writes what finished) and
exits 3; the same command resumes. `batchrun status` reads such a job's output as any other.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from .config import JobSpec
from .errors import BadInput, JobStopped
from .heartbeat import read_heartbeats
from .job import Job, check_job
from .lock import lock_wait_limit_s
from .report import load_summary
from .rows import Shard
from .sinks import check_writable
from .storage import is_url

MAX_RESTARTS = 8  # actors that may die in one job before the driver gives up
STOP_GRACE_S = 60.0  # after a stop, how long the driver waits for the actors to write what they finished
FORWARDED_ENV = ("BATCHRUN_", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


class ShardRunner:
    """A Ray actor's work: shards of one job, on one engine loaded once (for its first shard). Made a Ray actor
    class by `RayRun` (with two threads: `stop` is answered while `run` runs)."""

    def __init__(self, spec: JobSpec, num_cpus: int | None):
        if num_cpus and spec.engine.device == "cpu":
            import torch

            torch.set_num_threads(num_cpus)
        self.spec = spec
        self.worker = None  # the engine, kept across shards
        self.job: Job | None = None
        self.stopping = False

    def run(
        self, index: int, count: int, limit: int | None, lock: bool, wait: bool, overwrite: bool = False
    ) -> dict | None:
        """Shard I/N of the job, resumed from its written parts (`overwrite`: its earlier parts removed once its
        engine has loaded). `wait`: for the shard's lock (a dead actor's lease goes stale), else BadInput when
        another run holds it."""
        job = Job(
            self.spec,
            Shard(index, count),
            overwrite=overwrite,
            limit=limit,
            progress=False,
            wait=wait,
            replicas=1,
            lock=lock,
            worker=self.worker,
            # a dead actor's OS lock goes with its process, its lease once stale: waiting longer means a live
            # run holds the shard; `stop` ends the wait too
            waiting={"stop": lambda: self.stopping, "limit_s": lock_wait_limit_s()},
        )
        job.stop_requested, self.job = self.stopping, job
        try:
            return job.run()
        finally:
            self.worker, self.job = job.worker, None

    def stop(self) -> None:
        self.stopping = True
        if self.job is not None:
            self.job.stop_requested = True


def plan_actors(resources: dict, device: str, replicas: int | str | None) -> tuple[int, dict]:
    """(actors, each one's Ray resources): one per GPU (unless the job runs on the CPU), else `replicas` actors
    (default 1) with an equal share of the cluster's CPUs."""
    gpus = int(resources.get("GPU", 0))
    if device != "cpu" and gpus:
        return gpus, {"num_gpus": 1, "num_cpus": 1}
    count = 1 if replicas in (None, "auto") else int(replicas)
    if count < 1:
        raise BadInput(f"--replicas {replicas}: give at least 1 actor.")
    cpus = int(resources.get("CPU", 1))
    if count > cpus:  # the actors past the cluster's CPUs would wait for CPUs that never come free in time
        raise BadInput(
            f"--replicas {replicas}: {count} actors need a CPU each, and the Ray cluster has {cpus}; give at "
            f"most {cpus} (or add nodes)."
        )
    return count, {"num_cpus": max(1, cpus // count)}


def absolute(spec: JobSpec) -> JobSpec:
    """The job with its local relative paths made absolute: the actors do not share the driver's folder."""

    def local(value: str | None) -> str | None:
        return value if value is None or is_url(value) else str(Path(value).expanduser().resolve())

    model = spec.model.path
    if model and not is_url(model) and Path(model).expanduser().exists():
        model = local(model)
    inp = spec.input
    dataset = inp.dataset
    if dataset is not None and Path(dataset.path).expanduser().exists():
        dataset = dataclasses.replace(dataset, path=local(dataset.path))
    return dataclasses.replace(
        spec,
        model=dataclasses.replace(spec.model, path=model),
        input=dataclasses.replace(
            inp, parquet=local(inp.parquet), openai_batch=local(inp.openai_batch), dataset=dataset
        ),
        output=dataclasses.replace(
            spec.output, path=local(spec.output.path or f"out/{spec.name}"), stats=local(spec.output.stats)
        ),
    )


class RayRun:
    """The driver of one job on a Ray cluster (the module docstring says what it does)."""

    def __init__(
        self,
        spec: JobSpec,
        address: str,
        replicas=None,
        overwrite=False,
        limit=None,
        progress=True,
        lock=True,
    ):
        self.spec = absolute(spec)
        self.address = address
        self.replicas = replicas if replicas is not None else spec.engine.replicas
        self.limit = limit if limit is not None else spec.input.limit
        self.progress, self.lock = progress, lock
        source = check_job(self.spec, self.limit).source  # before any actor starts: a bad job is exit 2 here
        total = source.num_rows()
        self.total_rows = (
            None if total is None else (min(total, self.limit) if self.limit is not None else total)
        )
        check_writable(self.spec.output_dir, "output.path", self.spec.source_file)
        self.overwrite = (
            overwrite  # each shard's first actor removes its shard's parts once its engine loaded
        )
        self.stopping = False
        self.stopped_at = 0.0  # time.monotonic() of the stop
        self.actors: dict[int, object] = {}

    def run(self) -> dict | None:
        import ray

        # and the variables BATCHRUN_FORWARD_ENV names (a cluster whose nodes have no credentials of their own)
        chosen = {n.strip() for n in os.environ.get("BATCHRUN_FORWARD_ENV", "").split(",") if n.strip()}
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV) or k in chosen}
        address = None if self.address == "local" else self.address
        # HOST:PORT or ray://HOST:PORT (Ray Client, from the `ray` extra): Ray would wait for it without end
        host, _, port = (address or "").rpartition("://")[2].rpartition(":")
        if host and port.isdigit() and (address or "").split("://")[0] in (address, "ray"):
            try:
                socket.create_connection((host, int(port)), timeout=10).close()
            except OSError as e:
                raise BadInput(f"--ray {address}: cannot reach a Ray cluster there ({e}).") from None
        try:
            ray.init(address=address, runtime_env={"env_vars": env}, logging_level="WARNING")
        except ConnectionError as e:
            raise BadInput(
                f"--ray {self.address}: no Ray cluster there ({e}); start one (`ray start --head`), give its "
                f"address, or use --ray local for a cluster of this machine. A cluster with token "
                f"authentication needs RAY_AUTH_MODE=token and its token here (`ray get-auth-token`)."
            ) from None
        try:
            return self._run(ray)
        finally:
            ray.shutdown()

    def _run(self, ray) -> dict | None:
        from tqdm.auto import tqdm

        count, resources = plan_actors(ray.cluster_resources(), self.spec.engine.device, self.replicas)
        runner = ray.remote(max_concurrency=2, **resources)(ShardRunner)
        start = lambda: runner.remote(self.spec, resources.get("num_cpus"))  # noqa: E731
        refs = {}
        for i in range(count):
            self.actors[i] = start()
            refs[self.actors[i].run.remote(i, count, self.limit, self.lock, False, self.overwrite)] = i
        print(
            f"batchrun: {count} Ray actors ({resources}), shard i of {count} each",
            file=sys.stderr,
            flush=True,
        )
        handlers = self._install_signal_handlers()
        bar = tqdm(
            total=self.total_rows,
            unit="row",
            desc=self.spec.name,
            disable=not self.progress,
            mininterval=0.5 if sys.stderr.isatty() else 10.0,
        )
        summaries, deaths, failure = {}, 0, None
        try:
            while refs:
                ready, _ = ray.wait(list(refs), timeout=1.0)
                bar.update(self._rows_done(count) - bar.n)
                if self.stopping and time.monotonic() - self.stopped_at > STOP_GRACE_S:
                    for i in refs.values():  # an actor that does not answer stop() (never started, stuck)
                        ray.kill(self.actors[i])
                    refs.clear()
                    break
                for ref in ready:
                    i = refs.pop(ref)
                    try:
                        summaries[i] = ray.get(ref)
                        ray.kill(
                            self.actors[i]
                        )  # its shard is done: its CPUs (or GPU) go back to the cluster
                    except ray.exceptions.RayActorError as e:
                        if self.stopping:
                            continue
                        deaths += 1
                        if deaths > MAX_RESTARTS:
                            raise RuntimeError(f"{deaths} Ray actors died; the last: {e}") from None
                        print(
                            f"batchrun: the actor running shard {i}/{count} died ({type(e).__name__}); a new one "
                            f"resumes the shard from its written parts.",
                            file=sys.stderr,
                            flush=True,
                        )
                        self.actors[i] = start()
                        # --overwrite again: the dead one may have died before it removed the shard's parts
                        # (at worst the new one redoes the rows the dead one wrote)
                        run = self.actors[i].run
                        refs[run.remote(i, count, self.limit, self.lock, True, self.overwrite)] = i
                    except ray.exceptions.RayTaskError as e:
                        cause = e.cause if isinstance(e.cause, BaseException) else e
                        if isinstance(cause, JobStopped):
                            self._mark_stopping()
                        elif failure is None:
                            failure = cause
                            self._stop_all()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            bar.update(self._rows_done(count) - bar.n)
            bar.close()
        if failure is not None:
            raise failure
        if self.stopping:
            raise JobStopped("the actors wrote the rows they finished; the same command resumes.")
        if all(s is None for s in summaries.values()):
            return None
        return load_summary(self.spec.stats_source())

    def _rows_done(self, count: int) -> int:
        beats = read_heartbeats(self.spec.state_dir)
        return sum(b.get("rows_done") or 0 for b in beats if b.get("shard_count") == count)

    def _mark_stopping(self) -> None:
        if not self.stopping:
            self.stopping, self.stopped_at = True, time.monotonic()

    def _stop_all(self) -> None:
        self._mark_stopping()
        for actor in self.actors.values():
            actor.stop.remote()

    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum, frame) -> None:
            print(
                f"\nbatchrun: {signal.Signals(signum).name} received: stopping the actors (each writes the rows it "
                f"finished; rerun the same command to resume).",
                file=sys.stderr,
                flush=True,
            )
            self._stop_all()

        return {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
