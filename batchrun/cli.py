"""The `batchrun` command line (docs/cli.md).

Exit codes: 0 done; 1 the job failed at run time; 2 bad job file, input or arguments; 3 stopped by a signal
after writing every finished row (rerun the same command to resume).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from functools import wraps
from pathlib import Path

import click

from .errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_STOPPED, BadInput, JobStopped


def _fail(message: str, code: int) -> None:
    click.echo(f"batchrun: {message}", err=True)
    sys.exit(code)


def handle_errors(fn):
    """Turn the project's errors into messages and exit codes; never a bare traceback for a user mistake."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BadInput as e:
            _fail(f"error: {e}", EXIT_BAD_INPUT)
        except JobStopped as e:
            _fail(f"stopped: {e} Exit code {EXIT_STOPPED}: rerun the same command to resume.", EXIT_STOPPED)
        except KeyboardInterrupt:
            _fail("interrupted.", EXIT_STOPPED)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as e:  # a run-time failure: say what, keep the traceback for whoever debugs it
            if os.environ.get("BATCHRUN_DEBUG"):
                traceback.print_exc()
            _fail(
                f"job failed: {type(e).__name__}: {e} (set BATCHRUN_DEBUG=1 for the traceback)", EXIT_FAILED
            )

    return wrapper


def default_shard(text: str | None):
    """--shard I/N; by default a Slurm array task's own, else 0/1."""
    from .rows import Shard

    if text is None:
        task, count = os.environ.get("SLURM_ARRAY_TASK_ID"), os.environ.get("SLURM_ARRAY_TASK_COUNT")
        if task is None or count is None:
            return Shard()
        text = f"{task}/{count}"
    return Shard.parse(text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchrun")
def main() -> None:
    """batchrun: offline batch inference for LLMs on a paged KV cache."""


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a job-file key.")
@click.option(
    "--shard", default=None, metavar="I/N", help="Run shard I of N (default: the Slurm array task's)."
)
@click.option(
    "--resume/--no-resume",
    default=True,
    show_default=True,
    help="Skip the rows already written by this same job.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Start the shard over: its earlier part files are deleted once the model has loaded (a refused job "
    "deletes nothing).",
)
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Only the first N input rows.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--replicas",
    default=None,
    metavar="N|auto",
    help="Engine processes on this machine sharing the rows (default: engine.replicas; auto: one per GPU).",
)
@click.option(
    "--wait", is_flag=True, help="If another run holds this shard, wait for it instead of exiting 2."
)
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="auto",
    default=None,
    metavar="[ADDRESS]",
    help="Run the shards on Ray actors: auto (a running cluster; the default), HOST:PORT, ray://HOST:PORT, "
    "or local (start one here).",
)
@click.option(
    "--no-lock",
    is_flag=True,
    help="Take no lock on the shard (for a store without conditional writes): you keep its runs apart.",
)
@handle_errors
def submit(
    job_file: Path, overrides, shard, resume, overwrite, limit, quiet, replicas, wait, ray_address, no_lock
) -> None:
    """Run a job in the foreground, resuming what earlier runs did.

    Runs JOB_FILE; exit 0 once every row has its output rows, 2 for a bad job, 3 when stopped by a signal."""
    from .config import load_job

    if replicas is not None:
        overrides = (*overrides, f"engine.replicas={replicas}")
    # the job file first: its mistakes are refused before .job imports torch and transformers (seconds)
    spec = load_job(job_file, overrides)
    from .job import Job
    from .report import format_summary

    if ray_address is not None:
        return submit_on_ray(spec, ray_address, shard, resume, overwrite, limit, quiet, no_lock)
    job = Job(
        spec,
        default_shard(shard),
        resume=resume,
        overwrite=overwrite,
        limit=limit,
        progress=not quiet,
        wait=wait,
        lock=not no_lock,
    )
    summary = job.run()
    if summary is None:
        if job.rows.before:
            failed = job.sink.job_error_rows
            click.echo(
                f"nothing to do: every row of shard {job.shard} already has its output in {spec.output_dir}/"
                + (f" ({failed} of them error rows)" if failed else "")
            )
        else:
            click.echo(f"nothing to do: shard {job.shard} of the input has no rows ({spec.output_dir}/)")
        return
    click.echo(format_summary(summary))
    click.echo(f"completions: {spec.output_dir}/  statistics: {job.stats_path}")


def submit_on_ray(spec, address: str, shard, resume, overwrite, limit, quiet, no_lock) -> None:
    """`submit --ray`: the shards on Ray actors (ray_cluster.py)."""
    from .errors import BadInput
    from .ray_cluster import RayRun
    from .report import format_summary

    if shard is not None or not resume:
        raise BadInput(
            "--ray runs every shard of the job, resuming each: --shard and --no-resume do not apply."
        )
    run = RayRun(spec, address, overwrite=overwrite, limit=limit, progress=not quiet, lock=not no_lock)
    summary = run.run()
    if summary is None:
        click.echo(f"nothing to do: every row already has its output in {spec.output_dir}/")
        return
    click.echo(format_summary(summary))
    click.echo(f"completions: {spec.output_dir}/  statistics: {spec.state_dir}/")


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a job-file key.")
@handle_errors
def validate(job_file: Path, overrides) -> None:
    """Check a job without loading its model.

    Checks everything about JOB_FILE that needs no model weights: the job file, the input (columns and their
    types, unique ids, its rows), the model path, a job-wide response format (it compiles and is enforced), the
    outputs (writable; an object store's conditional writes), the KV budget and swap space against this
    machine's memory, and from the model's config (a local folder's) model.max_model_len against its positions
    and the LoRA adapters against its layers."""
    from .config import load_job

    spec = load_job(job_file, overrides)  # before the imports below (torch, transformers: seconds)
    from .job import check_job, check_model, check_outputs

    source = check_job(spec, spec.input.limit).source
    model = check_model(spec)
    check_outputs(spec)
    rows = source.num_rows()
    if rows is not None and spec.input.limit is not None:
        rows = min(rows, spec.input.limit)
    empty = " (nothing to do: submit loads no model)" if rows == 0 else ""
    click.echo(
        f"{job_file}: ok — input {rows if rows is not None else 'unknown'} rows{empty}, model {model}, "
        f"output {spec.output_dir}/"
    )


@main.command()
@click.argument("path")
@click.option(
    "--plot",
    "plot_path",
    default=None,
    help="Draw memory and sequences over time into this PNG (a local path or a URL, as PATH).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@handle_errors
def stats(path: str, plot_path, as_json) -> None:
    """Summarise a job's memory and throughput statistics.

    PATH: a stats file, or a directory (an output directory or its .batchrun/) whose shards are combined; a
    local path or a URL (s3://...)."""
    from .report import format_summary, load_summary, plot
    from .storage import location

    path = location(path)
    summary = load_summary(path)
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))
    if plot_path:
        plot(path, location(plot_path, "--plot"))
        click.echo(f"plot: {plot_path}")


@main.command()
@click.argument("out_dir")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@handle_errors
def status(out_dir: str, as_json) -> None:
    """How far a job is: rows, rate, ETA and each shard's state.

    Reads OUT_DIR alone, during a run or after: rows done and total per shard and overall, rate, ETA, and which
    shards are pending, loading, running, finished, stopped, failed, stale or partial."""
    from .status import format_status, job_status
    from .storage import location

    st = job_status(location(out_dir))
    click.echo(json.dumps(st, indent=2) if as_json else format_status(st))


@main.command()
@click.option(
    "--from",
    "from_path",
    default=None,
    help="Replay a real job: its completions directory, a part file, or a Parquet of lengths "
    "(columns prompt_tokens, completion_tokens).",
)
@click.option(
    "--prompt-len",
    default="20-400",
    show_default=True,
    metavar="LO-HI",
    help="Uniform prompt length range, when no --from.",
)
@click.option(
    "--output-len",
    default="1-64",
    show_default=True,
    metavar="LO-HI",
    help="Uniform output length range, when no --from.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="What a contiguous allocator reserves for outputs (default: the longest output).",
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Requests, when no --from.",
)
@click.option(
    "--budget", type=click.IntRange(min=1), default=32768, show_default=True, help="KV memory in token slots."
)
@click.option(
    "--shared-prefix",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Tokens of a prefix common to every request (a system prompt), put before each prompt.",
)
@click.option(
    "--state-slots",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="A hybrid model: the fixed state each running request holds, in token slots of the budget (a run's "
    "bytes_per_state_slot over bytes_per_page / page_size).",
)
@click.option(
    "--page-sizes",
    default="1,8,16,32,64,128",
    show_default=True,
    help="Page sizes to compare (powers of two).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random lengths.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@handle_errors
def simulate(
    from_path,
    prompt_len,
    output_len,
    max_new_tokens,
    requests,
    budget,
    shared_prefix,
    state_slots,
    page_sizes,
    seed,
    as_json,
) -> None:
    """Replay a workload through contiguous and paged allocators.

    Prints the waste table: memory utilization and fragmentation per allocator and page size."""
    from .simulate import format_table, load_workload, random_workload, run_all

    if from_path is not None:
        from .storage import location

        workload = load_workload(location(from_path, "--from"))
    else:
        workload = random_workload(
            requests, _range(prompt_len, "--prompt-len"), _range(output_len, "--output-len"), seed
        )
    try:
        sizes = [int(x) for x in page_sizes.split(",")]
    except ValueError:
        raise BadInput(f"--page-sizes {page_sizes!r}: expected integers separated by commas.") from None
    bad = [p for p in sizes if p < 1 or p & (p - 1)]
    if bad:
        raise BadInput(
            f"--page-sizes {page_sizes!r}: {bad[0]} is not a page size; pages hold a power of two tokens "
            "(1, 2, 4, ...)."
        )
    results = run_all(workload, budget, max_new_tokens, sizes, shared_prefix, state_slots)
    if as_json:
        click.echo(json.dumps([r._asdict() for r in results], indent=2))
    else:
        click.echo(format_table(results, workload, budget, shared_prefix, state_slots))


def _range(text: str, option: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise BadInput(f"{option} {text!r}: expected LO-HI, e.g. 20-400.") from None
    if not 1 <= lo <= hi:
        raise BadInput(f"{option} {text!r}: expected 1 <= LO <= HI.")
    return lo, hi


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--array", "array", type=click.IntRange(min=1), required=True, help="Number of array tasks.")
@click.option("--partition", default=None, help="Slurm partition.")
@click.option("--gpus-per-task", type=click.IntRange(min=0), default=None, help="GPUs per array task.")
@click.option("--cpus-per-task", type=click.IntRange(min=1), default=None, help="CPU cores per array task.")
@click.option("--time", "time_limit", default=None, metavar="T", help="e.g. 04:00:00")
@click.option("--mem", default=None, metavar="M", help="e.g. 32G")
@click.option(
    "--grace",
    type=click.IntRange(min=10),
    default=120,
    show_default=True,
    help="Seconds between SIGTERM and the kill at the time limit.",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override a job-file key (every task).",
)
@click.option(
    "--script",
    "script_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the sbatch script (default: <output>/.batchrun/slurm/<name>.sbatch).",
)
@click.option("--submit", "do_submit", is_flag=True, help="Submit it with sbatch and print the job id.")
@handle_errors
def slurm(
    job_file,
    array,
    partition,
    gpus_per_task,
    cpus_per_task,
    time_limit,
    mem,
    grace,
    overrides,
    script_path,
    do_submit,
) -> None:
    """Write (and submit) an sbatch array script, a shard per task.

    Task i of the array runs shard i/N of JOB_FILE; with --submit the script is submitted and its job id
    printed."""
    from .config import load_job

    spec = load_job(job_file, overrides)  # before the imports below (torch, transformers: seconds)
    from .job import check_job
    from .slurm import SlurmOptions, submit_script, write_script

    check_job(spec, spec.input.limit)  # a mistake found here, not in every array task
    opts = SlurmOptions(
        array=array,
        partition=partition,
        gpus_per_task=gpus_per_task,
        cpus_per_task=cpus_per_task,
        time=time_limit,
        mem=mem,
        grace_s=grace,
        overrides=tuple(overrides),
    )
    path = write_script(spec, Path(job_file), opts, script_path)
    click.echo(f"sbatch script: {path}")
    if do_submit:
        job_id = submit_script(path)
        click.echo(f"submitted array job {job_id}")


if __name__ == "__main__":
    main()
