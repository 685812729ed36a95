"""`batchrun status DIR`: how far a job is, read from its output directory alone (the part files and the
per-shard heartbeats in `.batchrun/`), during a run or after it, for one process, replicas or a Slurm array.

A shard is pending (nothing yet), loading, running, finished, stopped, failed, stale (its heartbeat stopped
while loading or running: killed, or its node died) or partial (parts but no heartbeat). Rows done and total
count the same rows: those of the input up to the run's limit."""

from __future__ import annotations

import time
from pathlib import Path

from . import storage
from .config import STATE_DIR
from .errors import BadInput
from .heartbeat import read_heartbeats
from .sinks import existing_parts, part_shard, rows_in_part


def rows_done_per_shard(out_dir: Path) -> dict[tuple[int, int], int]:
    """(shard index, shard count) -> input rows its part files hold."""
    done: dict[tuple[int, int], int] = {}
    for part in existing_parts(out_dir):
        shard = part_shard(part)
        if shard is None:  # not a part batchrun wrote
            continue
        i, n = (int(x) for x in shard.split("/"))
        done[(i, n)] = done.get((i, n), 0) + rows_in_part(part)
    return done


def job_status(out_dir: Path) -> dict:
    if not storage.fresh(out_dir).is_dir():
        raise BadInput(f"{out_dir}: no such output directory.")
    beats = {}
    for b in read_heartbeats(out_dir / STATE_DIR):
        i, n = (int(x) for x in b["shard"].split("/"))
        beats[(i, n)] = b
    done = rows_done_per_shard(out_dir)
    if not beats and not done:
        raise BadInput(f"{out_dir}: no part files and no heartbeats: not a batchrun output directory (yet).")
    counts = {n for _, n in [*beats, *done]}
    count = max(counts)  # the current shard count (parts of another count belong to an earlier job)
    input_rows = next(
        (
            b.get("input_rows")
            for (_, n), b in beats.items()
            if n == count and b.get("input_rows") is not None
        ),
        None,
    )
    shards = []
    for i in range(count):
        b = beats.get((i, count), {})
        total = len(range(i, input_rows, count)) if input_rows is not None else b.get("rows_total")
        state = b.get("state") or ("pending" if not done.get((i, count)) else "partial")
        # the parts, which may hold rows beyond the last run's limit: no more than its total...
        rows_done = done.get((i, count), 0)
        rows_done = min(rows_done, total) if total is not None else rows_done
        if state in ("loading", "running", "finished", "stopped") and b.get("rows_done") is not None:
            # ... and the run's own count of its rows done, refreshed every few seconds (parts may be newer)
            rows_done = max(rows_done, b["rows_done"])
        if state in ("stopped", "failed", "stale") and total is not None and rows_done >= total:
            state = "finished"
        shards.append(
            {
                "shard": f"{i}/{count}",
                "state": state,
                "rows_done": rows_done,
                "rows_total": total,
                # an ended run's rate is its average (rows over the time after its model loaded), whether it
                # finished, stopped or failed
                "rows_per_s": b.get("rows_per_s", 0.0),
                "replicas": b.get("replicas"),
                "host": b.get("host"),
                "pid": b.get("pid"),
                "updated": b.get("updated"),
            }
        )
    rows_done = sum(s["rows_done"] for s in shards)
    totals = [s["rows_total"] for s in shards]
    rows_total = sum(totals) if all(t is not None for t in totals) else None
    running = [s["rows_per_s"] for s in shards if s["state"] == "running"]
    rate = sum(running) if running else sum(s["rows_per_s"] for s in shards)
    left = None if rows_total is None else max(0, rows_total - rows_done)
    if left is None or (left and (rate <= 0 or not running)):
        eta = None
    else:
        eta = left / rate if left else 0.0
    return {
        "output": str(out_dir),
        "rows_done": rows_done,
        "rows_total": rows_total,
        "rows_per_s": rate,
        "eta_s": eta,
        "shards": shards,
        "checked": time.time(),
    }


def format_status(st: dict) -> str:
    total = st["rows_total"]
    pct = f" ({st['rows_done'] / total:.1%})" if total else ""
    eta = st["eta_s"]
    lines = [
        f"{st['output']}: {st['rows_done']} of {total if total is not None else '?'} rows done{pct}, "
        f"{st['rows_per_s']:.1f} rows/s" + (f", about {eta / 60:.1f} min left" if eta else ""),
        f"{'shard':>9}  {'state':<9} {'rows':>15}  {'rows/s':>7}  where",
    ]
    for s in st["shards"]:
        rows = f"{s['rows_done']}/{s['rows_total'] if s['rows_total'] is not None else '?'}"
        where = f"{s['host']} pid {s['pid']}" if s["host"] else ""
        if s["replicas"] and s["replicas"] > 1:
            where += f", {s['replicas']} replicas"
        lines.append(f"{s['shard']:>9}  {s['state']:<9} {rows:>15}  {s['rows_per_s']:>7.1f}  {where}")
    return "\n".join(lines)
