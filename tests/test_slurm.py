"""A real single-node Slurm (scripts/slurm_local.sh): a 3-task array job through `batchrun slurm --submit`."""

import os
import re
import shutil
import subprocess
import time

import pyarrow.parquet as pq
import pytest
from helpers import ROOT, read_outputs, run_cli, write_job, write_prompts

SCRIPT = ROOT / "scripts" / "slurm_local.sh"
pytestmark = [
    pytest.mark.slurm,  # `make test-slurm` selects it
    pytest.mark.skipif(
        shutil.which("slurmctld") is None or shutil.which("sbatch") is None or os.geteuid() != 0,
        reason="needs Slurm's Debian packages and root: scripts/slurm_local.sh install (.ci/run does it)",
    ),
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    d = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(SCRIPT), "up", str(d)], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    conf = re.search(r"SLURM_CONF=(\S+)", up.stdout).group(1)
    yield {"SLURM_CONF": conf}
    subprocess.run(["bash", str(SCRIPT), "down", str(d)], timeout=60)


def test_array_job_writes_every_row_exactly_once(slurm, tmp_path):
    n = 9
    write_prompts(tmp_path / "in.parquet", [f"Name a thing that is number {i}." for i in range(n)])
    job = write_job(
        tmp_path / "job.yaml",
        f"""
name: slurmdemo
input:
  parquet: {tmp_path / "in.parquet"}
  id_column: id
sampling:
  max_new_tokens: 6
engine:
  num_pages: 128
output:
  path: {tmp_path / "out"}
""",
    )
    r = run_cli("slurm", str(job), "--array", "3", "--time", "00:10:00", "--submit", env=slurm, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job_id = re.search(r"submitted array job (\d+)", r.stdout).group(1)
    script = (tmp_path / "out" / ".batchrun" / "slurm" / "slurmdemo.sbatch").read_text()
    assert "--array=0-2" in script and "--signal=B:TERM@" in script and "--requeue" in script
    env = {**os.environ, **slurm}
    deadline = time.time() + 300
    while time.time() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=env)
        if q.returncode == 0 and not q.stdout.strip():
            break
        time.sleep(1)
    else:
        pytest.fail("the array job did not finish in 5 minutes")
    rows = read_outputs(tmp_path / "out")  # asserts no (id, sample) twice
    assert sorted(rows) == sorted((f"r{i}", 0) for i in range(n)), sorted(rows)
    assert all(r["finish_reason"] in ("eos", "length") for r in rows.values())
    logs = list((tmp_path / "out" / ".batchrun" / "slurm").glob("*.err"))
    assert len(logs) == 3, logs
    assert len(list((tmp_path / "out" / ".batchrun").glob("stats-*of00003.parquet"))) == 3
    assert pq.read_table(tmp_path / "out").num_rows == n, "the output directory holds completions only"


def test_slurm_script_without_sbatch_is_written_and_submit_explains(tmp_path):
    write_prompts(tmp_path / "in.parquet", ["a"])
    job = write_job(
        tmp_path / "job.yaml",
        f"name: s\ninput:\n  parquet: {tmp_path / 'in.parquet'}\noutput:\n  path: {tmp_path / 'out'}\n",
    )
    r = run_cli(
        "slurm", str(job), "--array", "4", "--partition", "gpu", "--gpus-per-task", "1", "--mem", "32G"
    )
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "out" / ".batchrun" / "slurm" / "s.sbatch").read_text()
    assert "--replicas" not in text  # one GPU per task: one engine
    r = run_cli(
        "slurm", str(job), "--array", "4", "--gpus-per-task", "4", "--script", str(tmp_path / "four.sbatch")
    )
    assert r.returncode == 0 and "--replicas auto" in (tmp_path / "four.sbatch").read_text(), r.stderr
    for line in (
        "#SBATCH --array=0-3",
        "#SBATCH --partition=gpu",
        "#SBATCH --gpus-per-task=1",
        "#SBATCH --mem=32G",
    ):
        assert line in text
