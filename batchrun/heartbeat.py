"""Heartbeats: `.batchrun/heartbeat-IofN.json` says what the run of one shard is doing, refreshed every few
seconds while it runs and once more when it ends. `batchrun status` reads them next to the part files; a
heartbeat of a running shard that stopped being refreshed is stale (the run was killed, or its node died)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

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
        self._started = 0.0
        self._last = 0.0
        self._done_before = 0

    def start(
        self, input_rows: int | None, rows_total: int | None, rows_done_before: int, replicas: int
    ) -> None:
        """`input_rows`: the whole input's (every shard's); `rows_total`: this shard's."""
        self._started = time.monotonic()
        self._done_before = rows_done_before
        self.state.update(
            {
                "state": "running",
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

    def beat(self, rows_done_this_run: int, force: bool = False) -> None:
        if not self._started or (not force and time.monotonic() - self._last < self.interval_s):
            return
        elapsed = time.monotonic() - self._started
        self.state.update(
            {
                "rows_done": self._done_before + rows_done_this_run,
                "rows_done_this_run": rows_done_this_run,
                "rows_per_s": rows_done_this_run / elapsed if elapsed > 0 else 0.0,
            }
        )
        self._write()

    def finish(self, state: str, rows_done_this_run: int) -> None:
        """running -> finished | stopped | failed."""
        if not self._started:
            return
        self.state["state"] = state
        self.beat(rows_done_this_run, force=True)

    def _write(self) -> None:
        self._last = time.monotonic()
        self.state["updated"] = time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)


def read_heartbeats(state_dir: Path) -> list[dict]:
    beats = []
    for path in sorted(state_dir.glob("heartbeat-*.json")):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if beat.get("state") == "running" and time.time() - beat.get("updated", 0) > STALE_AFTER_S:
            beat["state"] = "stale"
        beats.append(beat)
    return beats
