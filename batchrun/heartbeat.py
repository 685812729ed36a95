"""Heartbeats: `.batchrun/heartbeat-IofN.json` says what the run of one shard is doing (loading, running, then
finished, stopped or failed), refreshed every few seconds by a thread of its own from the run's start (so a
model that takes minutes to load is `loading`, not silent) and once more when it ends. `batchrun status` reads
them next to the part files; a heartbeat of a loading or running shard that stopped being refreshed is stale
(the run was killed, or its node died)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import storage

if TYPE_CHECKING:
    from .rows import Shard

STALE_AFTER_S = 30.0


def heartbeat_path(state_dir: Path, shard_index: int, shard_count: int) -> Path:
    return state_dir / f"heartbeat-{shard_index:05d}of{shard_count:05d}.json"


class Heartbeat:
    def __init__(self, state_dir: Path, shard: Shard, interval_s: float = 2.0):
        self.path = heartbeat_path(state_dir, shard.index, shard.count)
        self.interval_s = interval_s
        self.state: dict = {"shard": str(shard)}
        self._lock = threading.Lock()  # the state, between the run's thread and the refreshing one
        self._ended = threading.Event()
        self._running_since = 0.0  # when the model had loaded (the rate counts from there)
        self._done_before = 0

    def start(
        self, input_rows: int | None, rows_total: int | None, rows_done_before: int, replicas: int
    ) -> None:
        """Loading starts. `input_rows`: the whole input's (every shard's, up to the limit); `rows_total`: this
        shard's; `rows_done_before`: this shard's rows among them that earlier runs did."""
        self._done_before = rows_done_before
        with self._lock:
            self.state.update(
                {
                    "state": "loading",
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "started": time.time(),
                    "input_rows": input_rows,
                    "shard_count": int(self.state["shard"].split("/")[1]),
                    "rows_total": rows_total,
                    "rows_done": rows_done_before,
                    "rows_done_this_run": 0,
                    "rows_per_s": 0.0,
                    "replicas": replicas,
                }
            )
            self._write()
        threading.Thread(target=self._refresh, name="batchrun-heartbeat", daemon=True).start()

    def running(self) -> None:
        """The model loaded: rows start."""
        with self._lock:
            self._running_since = time.monotonic()
            self.state["state"] = "running"
            self._write()

    def beat(self, rows_done_this_run: int) -> None:
        """The run's counts (written by the next refresh)."""
        elapsed = time.monotonic() - self._running_since if self._running_since else 0.0
        with self._lock:
            self.state.update(
                {
                    "rows_done": self._done_before + rows_done_this_run,
                    "rows_done_this_run": rows_done_this_run,
                    "rows_per_s": rows_done_this_run / elapsed if elapsed > 0 else 0.0,
                }
            )

    def finish(self, state: str, rows_done_this_run: int) -> None:
        """loading | running -> finished | stopped | failed; the refreshing stops."""
        if "state" not in self.state:
            return
        self._ended.set()
        self.beat(rows_done_this_run)
        with self._lock:
            self.state["state"] = state
            self._write()

    def _refresh(self) -> None:
        while not self._ended.wait(self.interval_s):
            with self._lock:
                if not self._ended.is_set():
                    self._write()

    def _write(self) -> None:
        self.state["updated"] = time.time()
        try:
            storage.write_text_whole(self.path, json.dumps(self.state))
        except OSError as e:  # a store that did not answer this time: the next refresh tries again
            print(f"batchrun: could not write the heartbeat {self.path} ({e})", file=sys.stderr, flush=True)


def read_heartbeats(state_dir: Path) -> list[dict]:
    beats = []
    for path in sorted(storage.fresh(state_dir).glob("heartbeat-*.json")):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (
            beat.get("state") in ("loading", "running")
            and time.time() - beat.get("updated", 0) > STALE_AFTER_S
        ):
            beat["state"] = "stale"
        beats.append(beat)
    return beats
