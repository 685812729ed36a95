"""`batchrun slurm`: an sbatch array script whose task i runs shard i/N of a job, and its submission.

Each task runs `batchrun submit` on its shard (the shard comes from SLURM_ARRAY_TASK_ID/COUNT). Slurm sends
SIGTERM `grace` seconds before the time limit (`--signal=B:TERM@grace`); batchrun then writes what it finished
and exits 3, and `--requeue` lets Slurm run the task again, which resumes where it stopped.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .config import JobSpec
from .errors import EXIT_STOPPED, BadInput
from .sinks import check_writable


@dataclass(frozen=True)
class SlurmOptions:
    array: int
    partition: str | None = None
    gpus_per_task: int | None = None
    cpus_per_task: int | None = None
    time: str | None = None
    mem: str | None = None
    grace_s: int = 120
    overrides: tuple[str, ...] = ()


def render_script(spec: JobSpec, job_file: Path, opts: SlurmOptions, batchrun: str) -> str:
    logs = (spec.state_dir / "slurm").resolve()
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=batchrun-{spec.name}",
        f"#SBATCH --array=0-{opts.array - 1}",
        f"#SBATCH --output={logs}/%x-%A_%a.out",
        f"#SBATCH --error={logs}/%x-%A_%a.err",
        f"#SBATCH --signal=B:TERM@{opts.grace_s}",
        "#SBATCH --requeue",
        "#SBATCH --ntasks=1",
    ]
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    if opts.gpus_per_task is not None:
        lines.append(f"#SBATCH --gpus-per-task={opts.gpus_per_task}")
    if opts.cpus_per_task is not None:
        lines.append(f"#SBATCH --cpus-per-task={opts.cpus_per_task}")
    if opts.time:
        lines.append(f"#SBATCH --time={opts.time}")
    if opts.mem:
        lines.append(f"#SBATCH --mem={opts.mem}")
    sets = " ".join(f"--set {shlex.quote(o)}" for o in opts.overrides)
    # several GPUs per task: one replica on each (the task sees exactly its own GPUs)
    replicas = "--replicas auto " if (opts.gpus_per_task or 0) > 1 else ""
    cmd = (
        f"{shlex.quote(batchrun)} submit {shlex.quote(str(job_file.resolve()))} "
        f'--shard "$SLURM_ARRAY_TASK_ID/{opts.array}" --quiet {replicas}{sets}'
    ).rstrip()
    lines += [
        "",
        "# Every task runs one shard; all shards write into the same output directory.",
        f"cd {shlex.quote(os.getcwd())}",
        "# Run in the background and wait, so this shell can pass Slurm's SIGTERM on to batchrun.",
        f"{cmd} &",
        "child=$!",
        "trap 'kill -TERM $child 2>/dev/null' TERM",
        "wait $child; rc=$?",
        "# a signal interrupts the first wait; wait again for batchrun to flush and exit",
        "if kill -0 $child 2>/dev/null; then wait $child; rc=$?; fi",
        f'if [ $rc -eq {EXIT_STOPPED} ] && [ -n "$SLURM_JOB_ID" ]; then',
        '  echo "batchrun stopped (resumable); requeueing" >&2',
        '  scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" 2>/dev/null || true',
        "fi",
        "exit $rc",
        "",
    ]
    return "\n".join(lines)


def _batchrun_executable() -> str:
    here = Path(sys.executable).parent / "batchrun"
    return str(here) if here.exists() else (shutil.which("batchrun") or "batchrun")


def write_script(spec: JobSpec, job_file: Path, opts: SlurmOptions, path: Path | None = None) -> Path:
    check_writable(spec.output_dir, "output.path", spec.source_file)
    check_writable(spec.state_dir / "slurm", "output.path", spec.source_file)  # the tasks' logs go there
    if path is not None:
        check_writable(path.parent, "--script", spec.source_file)
    path = path or spec.state_dir / "slurm" / f"{spec.name}.sbatch"
    path.write_text(render_script(spec, job_file, opts, _batchrun_executable()))
    path.chmod(0o755)
    return path


def submit_script(path: Path) -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise BadInput(
            "--submit: `sbatch` is not on PATH; is this a Slurm login node? The script is written; "
            f"submit it later with `sbatch {path}`."
        )
    proc = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BadInput(f"--submit: sbatch refused {path}: {proc.stderr.strip() or proc.stdout.strip()}")
    m = re.match(r"(\d+)", proc.stdout.strip())
    if not m:
        raise BadInput(f"--submit: unexpected sbatch answer {proc.stdout!r}")
    return m.group(1)
