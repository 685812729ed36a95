"""One run per (output directory, shard): a lock held for the run's whole life. `shard_lock` picks the kind
once: an OS lock on a local or shared file system, a lease on an object store, or none (`--no-lock`).

The lock is `flock` on `.batchrun/locks/shard-IofN.lock` through `filelock` (a well-kept library; its lock dies
with the process, so a run killed with kill -9 leaves nothing to clean up). Who holds it (host, pid, start time)
is written beside it, in `shard-IofN.holder.json`, for the message a second run prints.

On a shared filesystem, flock works where the filesystem supports it (NFSv4, Lustre with `flock` mounts, local
disks); on one that does not (NFSv3 without lockd, some FUSE mounts) the lock cannot protect anything, and a
run says so rather than pretend.

On an object store there are no file locks. The lock is a lease object, `.batchrun/locks/shard-IofN.lease`,
created with a conditional write (only if absent), renewed every quarter of `BATCHRUN_LEASE_S` seconds (default
60) by a thread of its own with a compare-and-swap on its version, and given back at the end by a
compare-and-swap to a `released` record (never a plain delete, which could remove a lease another run took over
meanwhile). Every clock that decides is the deciding run's own:
- a run writes no further part once its last successful renewal is older than half the lease (`check`): cut off
  from the store, it stops before anyone may take its shard over; one whose renewal found the lease taken has
  lost it;
- a run takes over a lease only after watching its version stay unchanged for a whole lease time on its own
  clock (nobody renewed it): the holder's time stamp, written by another machine's clock, decides nothing but
  the message (a fresh-looking stamp makes a run without `--wait` exit 2 at once, as a live holder would).
Conditional writes are probed on the store before the first lease (a create over an existing object and a
replace at a wrong version must both fail): a store that ignores them is a bad job, unless `--no-lock`
accepts the risk.
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


def lock_wait_limit_s() -> float:
    """How long a replaced shard waits for its dead holder's lock: a lease goes stale after BATCHRUN_LEASE_S
    (and is watched that long again), an OS lock with its process; then a minute to spare."""
    return 2 * float(os.environ.get("BATCHRUN_LEASE_S", "60")) + 60


class Waiting:
    """How a run waits for a shard's lock held by another: until `stop()` says to give up (a Ray actor being
    stopped), or `limit_s` passes (a replaced shard whose dead holder's lock should have gone by then)."""

    def __init__(self, shard: str, stop=None, limit_s: float | None = None):
        self.shard, self.stop, self.limit_s = shard, stop, limit_s
        self.started = time.monotonic()

    def check(self, holder: str) -> None:
        if self.stop is not None and self.stop():
            raise JobStopped(f"stopped while waiting for shard {self.shard}'s lock ({holder})")
        if self.limit_s is not None and time.monotonic() - self.started > self.limit_s:
            raise BadInput(
                f"shard {self.shard} is still held by another run after {self.limit_s:.0f} s of waiting "
                f"({holder}): a live run holds it"
            )


def shard_lock(state_dir: Path, shard_index: int, shard_count: int, enabled: bool = True):
    """The lock this output's shard gets: a ShardLock (flock) on a file system, a LeaseLock on an object store,
    a NoLock when `enabled` is False (--no-lock)."""
    if not enabled:
        return NoLock(state_dir, shard_index, shard_count)
    if storage.is_remote(state_dir):
        return LeaseLock(state_dir, shard_index, shard_count)
    return ShardLock(state_dir, shard_index, shard_count)


class NoLock:
    """--no-lock: the user keeps runs of one shard apart. A run it can see holding the shard all the same (a
    lease renewed within its time and not given back, an OS lock held) makes it exit 2: `--no-lock` is for a store
    without conditional writes, not a way to write a shard's rows twice."""

    def __init__(self, state_dir: Path, shard_index: int, shard_count: int):
        self.shard = f"{shard_index}/{shard_count}"
        self.remote = storage.is_remote(state_dir)
        kind = LeaseLock if self.remote else ShardLock
        self.lock = kind(state_dir, shard_index, shard_count)

    def acquire(self, wait: bool, output_dir, source: str, stop=None, limit_s=None) -> None:
        holder = self._live_holder()
        if holder:
            raise BadInput(
                f"{busy(source, self.shard, output_dir, holder)} --no-lock does not let a second run of a held "
                f"shard in."
            )

    def _live_holder(self) -> str | None:
        if self.remote:
            try:
                current = storage.read_versioned(self.lock.path)
                theirs = json.loads(current[0]) if current else None
                fresh = theirs and time.time() - float(theirs["renewed"]) < self.lock.lease_s
            except (ValueError, KeyError, TypeError, OSError):
                return None  # nothing readable: nothing seen
            return describe_holder(theirs) if fresh and not theirs.get("released") else None
        if not self.lock.path.exists():
            return None
        try:
            probe = FileLock(self.lock.path, thread_local=False)
            probe.acquire(timeout=0)
            probe.release()
        except Timeout:
            return self.lock.holder()
        except OSError:
            return None  # no flock here: nothing can be seen
        return None

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

    def acquire(self, wait: bool, output_dir: Path, source: str, stop=None, limit_s=None) -> None:
        """Take the lock; with `wait`, block until the holder ends (or `stop()`, or `limit_s`: Waiting), else
        BadInput naming the holder at once."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.path, thread_local=False)
        waiting = Waiting(self.shard, stop, limit_s)
        announced = False
        while True:
            try:
                lock.acquire(timeout=0)
                break
            except Timeout:
                holder = self.holder()
                if not wait:
                    raise busy(source, self.shard, output_dir, holder) from None
                waiting.check(holder)
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

    SAFE_SHARE = 0.5  # of the lease: no part is written once the last renewal is older than this

    def __init__(self, state_dir: Path, shard_index: int, shard_count: int):
        self.path = state_dir / "locks" / f"{lock_name(shard_index, shard_count)}.lease"
        self.shard = f"{shard_index}/{shard_count}"
        self.lease_s = float(os.environ.get("BATCHRUN_LEASE_S", "60"))
        self.record = {**holder_record(), "owner": uuid.uuid4().hex}
        self.version: str | None = None  # the lease's version while this run holds it
        self.renewed_at = 0.0  # time.monotonic() of the last successful take or renewal
        self.lost = False
        self._watched: tuple[str, float] | None = None  # another run's lease: (version, first seen unchanged)
        self._ended = threading.Event()
        self._mutex = threading.Lock()  # the version, between the renewing thread and release

    def _data(self, released: bool = False) -> bytes:
        return json.dumps({**self.record, "renewed": time.time(), "released": released}).encode()

    def acquire(self, wait: bool, output_dir, source: str, stop=None, limit_s=None) -> None:
        self.probe(output_dir, source)
        waiting = Waiting(self.shard, stop, limit_s)
        announced = False
        while True:
            holder = self._try_take(wait)
            if holder is None:
                break
            if holder and not wait:
                raise busy(source, self.shard, output_dir, holder)
            waiting.check(holder or "its holder stopped renewing it")
            if holder and not announced:
                print(f"batchrun: waiting for the run holding shard {self.shard} ({holder})", flush=True)
                announced = True
            time.sleep(min(1.0, self.lease_s / 8))
        threading.Thread(target=self._renew, name="batchrun-lease", daemon=True).start()

    def probe(self, output_dir, source: str) -> None:
        """BadInput unless the store honours conditional writes (a create over an object, a replace at a wrong
        version: both must fail), probed on a scratch object beside the lease."""
        probe = self.path.with_name(f".probe-{uuid.uuid4().hex}")
        try:
            honoured = storage.honours_conditional_writes(probe)
        except storage.NoConditionalWrites as e:
            honoured, store = False, f"this store ({e}://) has no atomic conditional writes"
        else:
            store = "this store accepted a conditional write it should have refused"
        if not honoured:
            raise BadInput(
                f"{source}: output.path {output_dir}: {store} (create an object only if it is absent, replace it "
                f"only at a version), so batchrun cannot keep two runs of one shard apart there. Use a store "
                f"that honours them (AWS S3, or a shared file system), or pass --no-lock and make sure only one "
                f"run of each shard is started."
            )

    def _try_take(self, wait: bool) -> str | None:
        """Take the lease if it is free, given back, or unchanged for a lease time on this run's clock: None.
        Else who holds it, or "" while this run watches whether anyone renews it."""
        self.version = storage.create_exclusive(self.path, self._data())
        if self.version is not None:
            self.renewed_at = time.monotonic()
            return None
        current = storage.read_versioned(self.path)
        if current is None:
            return self._try_take(wait)  # given back and removed meanwhile
        data, version = current
        try:
            theirs = json.loads(data)
            stamp_age = time.time() - float(theirs["renewed"])
            released = bool(theirs.get("released"))
        except (ValueError, KeyError, TypeError):
            theirs, stamp_age, released = {}, float("inf"), True  # not a lease batchrun wrote whole
        now = time.monotonic()
        if not released:
            if self._watched is None or self._watched[0] != version:
                renewed = self._watched is not None  # it changed while watched: its holder is alive
                self._watched = (version, now)
                if renewed or (stamp_age < self.lease_s and not wait):
                    return describe_holder(theirs)
                return ""
            if now - self._watched[1] < self.lease_s:
                return ""  # unchanged, but not yet for a whole lease time
        self.version = storage.replace_if(self.path, self._data(), version)
        self._watched = None
        if self.version is None:  # another run took it first
            return "a run that took over the lease just now"
        self.renewed_at = time.monotonic()
        if not released:
            print(
                f"batchrun: took over shard {self.shard}'s lease from a run that did not renew it for "
                f"{self.lease_s:.0f} s ({describe_holder(theirs)}).",
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
            except Exception:  # noqa: BLE001 - the store did not answer (botocore's errors are not OSErrors)
                return True  # try again; `check` stops the writes meanwhile
            if version is None:
                self.lost = True
            else:
                self.renewed_at = time.monotonic()
            self.version = version
            return version is not None

    def check(self) -> None:
        """Before each part is written: a run that lost its lease, or could not renew it for half the lease
        time (another run may take it over after a whole one), must write no more."""
        if self.lost:
            raise JobStopped(
                f"shard {self.shard}'s lease ({self.path}) was taken over by another run after this one failed "
                f"to renew it for {self.lease_s:.0f} s; this run writes nothing more (the other run finishes "
                f"the shard)."
            )
        silent = time.monotonic() - self.renewed_at
        if silent > self.SAFE_SHARE * self.lease_s:
            raise JobStopped(
                f"shard {self.shard}'s lease ({self.path}) could not be renewed for {silent:.0f} s (the store "
                f"did not answer); this run writes nothing more, since another run may take the shard over "
                f"after {self.lease_s:.0f} s. Run it again to resume."
            )

    def release(self) -> None:
        """Give the lease back: a compare-and-swap to a released record, so a lease another run took over
        meanwhile stays that run's."""
        self._ended.set()
        with self._mutex:
            if self.version is not None and not self.lost:
                try:
                    storage.replace_if(self.path, self._data(released=True), self.version)
                except Exception:  # noqa: BLE001 - unreachable: the lease goes stale, taken over a lease later
                    pass
            self.version = None
