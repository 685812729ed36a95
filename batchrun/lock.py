"""One run per (output directory, shard): an OS lock held for the run's whole life.

The lock is `flock` on `.batchrun/locks/shard-IofN.lock` through `filelock` (a well-kept library; its lock dies
with the process, so a run killed with kill -9 leaves nothing to clean up). Who holds it (host, pid, start time)
is written beside it, in `shard-IofN.holder.json`, for the message a second run prints.

On a shared filesystem, flock works where the filesystem supports it (NFSv4, Lustre with `flock` mounts, local
disks); on one that does not (NFSv3 without lockd, some FUSE mounts) the lock cannot protect anything, and a
run says so rather than pretend.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from filelock import FileLock, Timeout

from .errors import BadInput


class ShardLock:
    def __init__(self, state_dir: Path, shard_index: int, shard_count: int):
        self.dir = state_dir / "locks"
        name = f"shard-{shard_index:05d}of{shard_count:05d}"
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
                    raise BadInput(
                        f"{source}: shard {self.shard} of output.path {output_dir} is being written by another "
                        f"run ({holder}); wait for it (--wait), or stop it. Two runs of one shard would write "
                        f"its rows twice."
                    ) from None
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
        self.holder_path.write_text(
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                }
            )
        )

    def holder(self) -> str:
        try:
            h = json.loads(self.holder_path.read_text())
            return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
        except (OSError, ValueError, KeyError):
            return "holder unknown"

    def release(self) -> None:
        if self._lock is not None:
            self.holder_path.unlink(missing_ok=True)
            self._lock.release()
            self._lock = None
