"""One run per (output directory, shard): a lock held for the run's whole life. `shard_lock` picks the kind
once: an OS lock on a local or shared file system, a lease on an object store, or none (`--no-lock`).

The lock is `flock` on `.batchrun/locks/shard-IofN.lock` through `filelock` (a well-kept library; its lock dies
with the process, so a run killed with kill -9 leaves nothing to clean up). Who holds it (host, pid, start time)
is written beside it, in `shard-IofN.holder.json`, for the message a second run prints.

On a shared filesystem, flock works where the filesystem supports it (NFSv4, Lustre with `flock` mounts, local
disks); on one that does not (NFSv3 without lockd, some FUSE mounts) the lock cannot protect anything, and a
run says so rather than pretend.

On an object store there are no file locks. The lock is a lease object, `.batchrun/locks/shard-IofN.lease`,
created with a conditional write (only if absent), renewed every few seconds by a thread of its own with a
compare-and-swap on its version, given back at the end, and taken over (again by compare-and-swap) from a run
that stopped renewing it for `BATCHRUN_LEASE_S` seconds (default 60): a run killed with kill -9, a lost node.
A run whose renewal finds the lease taken has lost it, and writes no further part (`check`). A store that cannot
do conditional writes atomically (storage.CONDITIONAL_WRITES) is a bad job, unless `--no-lock` accepts the risk.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from filelock import FileLock, Timeout

from . import storage
from .errors import BadInput, JobStopped


def lock_name(shard_index: int, shard_count: int) -> str:
    return f"shard-{shard_index:05d}of{shard_count:05d}"


def holder_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def describe_holder(h: dict) -> str:
    try:
        return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
    except (KeyError, TypeError):
        return "holder unknown"


def busy(source: str, shard: str, output_dir, holder: str) -> BadInput:
    return BadInput(
        f"{source}: shard {shard} of output.path {output_dir} is being written by another run ({holder}); wait "
        f"for it (--wait), or stop it. Two runs of one shard would write its rows twice."
    )


def shard_lock(state_dir: Path, shard_index: int, shard_count: int, enabled: bool = True):
    """The lock this output's shard gets: a ShardLock (flock) on a file system, a LeaseLock on an object store,
    a NoLock when `enabled` is False (--no-lock)."""
    if not enabled:
        return NoLock()
    if storage.is_remote(state_dir):
        return LeaseLock(state_dir, shard_index, shard_count)
    return ShardLock(state_dir, shard_index, shard_count)


class NoLock:
    """--no-lock: the user keeps runs of one shard apart."""

    def acquire(self, wait: bool, output_dir, source: str) -> None:
        pass

    def check(self) -> None:
        pass

    def release(self) -> None:
        pass


class ShardLock:
    def __init__(self, state_dir: Path, shard_index: int, shard_count: int):
        self.dir = state_dir / "locks"
        name = lock_name(shard_index, shard_count)
        self.path = self.dir / f"{name}.lock"
        self.holder_path = self.dir / f"{name}.holder.json"
        self.shard = f"{shard_index}/{shard_count}"
        self._lock: FileLock | None = None

    def acquire(self, wait: bool, output_dir: Path, source: str) -> None:
        """Take the lock; with `wait`, block until the holder ends, else BadInput naming the holder at once."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.path, thread_local=False)
        announced = False
        while True:
            try:
                lock.acquire(timeout=0)
                break
            except Timeout:
                holder = self.holder()
                if not wait:
                    raise busy(source, self.shard, output_dir, holder) from None
                if not announced:
                    print(f"batchrun: waiting for the run holding shard {self.shard} ({holder})", flush=True)
                    announced = True
                time.sleep(1.0)
            except OSError as e:  # a filesystem without flock
                raise BadInput(
                    f"{source}: cannot lock {self.path} ({e.strerror or e}): this filesystem does not support "
                    f"flock, so batchrun cannot keep two runs of one shard apart. Put output.path on a local "
                    f"disk or a filesystem with locks, or make sure only one run of each shard is started."
                ) from None
        self._lock = lock
        self.holder_path.write_text(json.dumps(holder_record()))

    def holder(self) -> str:
        try:
            return describe_holder(json.loads(self.holder_path.read_text()))
        except (OSError, ValueError):
            return "holder unknown"

    def check(self) -> None:
        """An OS lock cannot be lost while the process lives."""

    def release(self) -> None:
        if self._lock is not None:
            self.holder_path.unlink(missing_ok=True)
            self._lock.release()
            self._lock = None


class LeaseLock:
    """The shard's lease on an object store (the module's docstring says how it works)."""

    def __init__(self, state_dir: Path, shard_index: int, shard_count: int):
        self.path = state_dir / "locks" / f"{lock_name(shard_index, shard_count)}.lease"
        self.shard = f"{shard_index}/{shard_count}"
        self.lease_s = float(os.environ.get("BATCHRUN_LEASE_S", "60"))
        self.record = {**holder_record(), "owner": uuid.uuid4().hex}
        self.version: str | None = None  # the lease's version while this run holds it
        self.lost = False
        self._ended = threading.Event()
        self._mutex = threading.Lock()  # the version, between the renewing thread and release

    def _data(self) -> bytes:
        return json.dumps({**self.record, "renewed": time.time()}).encode()

    def acquire(self, wait: bool, output_dir, source: str) -> None:
        announced = False
        while True:
            holder = self._try_take(output_dir, source)
            if holder is None:
                break
            if not wait:
                raise busy(source, self.shard, output_dir, holder)
            if not announced:
                print(f"batchrun: waiting for the run holding shard {self.shard} ({holder})", flush=True)
                announced = True
            time.sleep(min(5.0, self.lease_s / 4))
        threading.Thread(target=self._renew, name="batchrun-lease", daemon=True).start()

    def _try_take(self, output_dir, source: str) -> str | None:
        """Take the lease if it is free or stale; None if taken, else who holds it."""
        try:
            self.version = storage.create_exclusive(self.path, self._data())
        except storage.NoConditionalWrites as e:
            raise BadInput(
                f"{source}: output.path {output_dir}: this store ({e}://) has no atomic conditional writes "
                f"(create an object only if it is absent), so batchrun cannot keep two runs of one shard apart "
                f"there. Use s3:// (or a shared file system), or pass --no-lock and make sure only one run of "
                f"each shard is started."
            ) from None
        if self.version is not None:
            return None
        current = storage.read_versioned(self.path)
        if current is None:
            return self._try_take(output_dir, source)  # given back meanwhile
        data, version = current
        try:
            theirs = json.loads(data)
            age = time.time() - float(theirs["renewed"])
        except (ValueError, KeyError, TypeError):
            theirs, age = {}, float("inf")  # not a lease batchrun wrote whole: nobody renews it
        if age <= self.lease_s:
            return describe_holder(theirs)
        self.version = storage.replace_if(self.path, self._data(), version)
        if self.version is None:  # another run took it over first
            return "a run that took over a stale lease just now"
        print(
            f"batchrun: took over shard {self.shard}'s lease from a run that stopped renewing it {age:.0f} s ago "
            f"({describe_holder(theirs)}).",
            flush=True,
        )
        return None

    def _renew(self) -> None:
        while not self._ended.wait(self.lease_s / 4) and self._renew_once():
            pass

    def _renew_once(self) -> bool:
        """Renew the lease if still ours; False once it is over (given back, or lost to another run)."""
        with self._mutex:
            if self._ended.is_set() or self.version is None:
                return False
            try:
                version = storage.replace_if(self.path, self._data(), self.version)
            except OSError:
                return True  # the store did not answer: try again; the lease lasts lease_s
            if version is None:
                self.lost = True
            self.version = version
            return version is not None

    def check(self) -> None:
        """Before each part is written: a run that lost its lease (another took it over) must write no more."""
        if self.lost:
            raise JobStopped(
                f"shard {self.shard}'s lease ({self.path}) was taken over by another run after this one failed "
                f"to renew it for {self.lease_s:.0f} s; this run writes nothing more (the other run finishes "
                f"the shard)."
            )

    def release(self) -> None:
        self._ended.set()
        with self._mutex:
            if self.version is not None and not self.lost:
                # still ours (renewed within lease_s, so no run can have taken it over): given back
                self.path.fs.rm_file(self.path.path)
            self.version = None
