"""`batchinfer slurm --submit` on a real single-node Slurm (installed and started by the fixture).

The cluster comes from tests/slurm/start_cluster.sh (Debian's slurm-wlm + munge, private slurm.conf,
MaxArraySize=4 so a 6-shard job needs two array submissions with offsets) and is stopped after the
module. The jobs run the model-free echo engine through the real `batchinfer run`.

Its daemons listen on fixed ports, so one cluster runs on a machine at a time: the fixture holds a lock
(`CLUSTER_LOCK`) from start to stop. pytest-xdist may run this module's tests on different workers (its
`loadgroup` grouping does not take on pytest 9, whose nodes keep their id elsewhere than xdist 3.8
writes it); each worker's cluster then waits for the other's to stop. Before the lock, two clusters
started at once: the second's daemons could not bind, its tests reached the first cluster, and that
cluster's shutdown cancelled their jobs.
"""

import fcntl
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from batchinfer.jobs import attempts, commit, slurm
from click.testing import CliRunner
from test_slurm import make_job

from batchinfer.cli import cli

pytestmark = pytest.mark.slurm

SCRIPTS = Path(__file__).parent / "slurm"
MAX_ARRAY_SIZE = 4
CLUSTER_LOCK = Path(tempfile.gettempdir()) / "batchinfer-test-slurm-cluster.lock"  # machine-wide: fixed ports


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with open(CLUSTER_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield from _running_cluster(tmp_path_factory.mktemp("slurm-cluster"))


def _running_cluster(state: Path):
    started = subprocess.run([SCRIPTS / "start_cluster.sh", state, str(MAX_ARRAY_SIZE)], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)  # fmt: skip
    if started.returncode == 77:
        pytest.skip(f"Slurm cannot be installed here: {started.stdout.strip().splitlines()[-1]}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    try:
        assert started.returncode == 0, f"start_cluster.sh failed:\n{started.stdout}"
        yield state
    finally:
        subprocess.run([SCRIPTS / "stop_cluster.sh", state], timeout=120)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def _squeue(job_ids: list[str]) -> list[str]:
    argv = ["squeue", "--noheader", "--array", f"--jobs={','.join(job_ids)}", "--format=%i %T %r"]
    out = subprocess.run(argv, capture_output=True, text=True)
    return out.stdout.split("\n")[:-1] if out.returncode == 0 else []


def _wait_until_gone(job_ids: list[str], timeout: float, on_poll=None) -> None:
    deadline = time.monotonic() + timeout
    while (listed := _squeue(job_ids)) and time.monotonic() < deadline:
        if on_poll:
            on_poll(listed)
        time.sleep(0.5)
    assert not listed, f"jobs still queued after {timeout} s: {listed}"


def _output_ids(job_dir: Path) -> list[int]:
    ids: list[int] = []
    for path in sorted((job_dir / commit.SHARDS_DIR).glob("*/*.parquet")):
        ids += pq.read_table(path, columns=["id"]).column("id").to_pylist()
    return ids


def _slurm_logs(job_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((job_dir / "slurm" / "logs").glob("*.out")))


def test_array_job_with_offsets_processes_every_row_once(tmp_path, cluster):
    plan = make_job(tmp_path, rows=30, shards=6, chunk_rows=2)
    result = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--submit", "--gpus-per-task", "0",
                                      "--time", "10:00"])  # fmt: skip
    assert result.exit_code == 0, result.output
    job_ids = [s["job_id"] for s in slurm.submissions(plan.job_dir)]
    assert [s["offset"] for s in slurm.submissions(plan.job_dir)] == [0, 4]  # MaxArraySize=4
    _wait_until_gone(job_ids, timeout=180)
    logs = _slurm_logs(plan.job_dir)
    assert attempts.incomplete_shards(plan) == [], logs
    assert sorted(_output_ids(plan.job_dir)) == list(range(30)), logs
    for shard in range(6):
        assert f"batchinfer: shard {shard}, array task" in logs
    retry = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--retry"])
    assert "are done; nothing to submit" in retry.output


def test_usr2_before_time_limit_requeues_and_finishes_exactly_once(tmp_path, cluster):
    # 40 rows in 20 chunks at 0.3 s per row: about 12 s of work, stopped after the first chunks.
    plan = make_job(tmp_path, rows=40, shards=1, chunk_rows=2, engine_args={"delay": "0.3"})
    result = CliRunner().invoke(cli, ["slurm", str(plan.job_dir), "--submit", "--gpus-per-task", "0"])
    assert result.exit_code == 0, result.output
    (job_id,) = [s["job_id"] for s in slurm.submissions(plan.job_dir)]
    task = f"{job_id}_0"
    chunks = plan.job_dir / commit.SHARDS_DIR / "00000"
    deadline = time.monotonic() + 120
    while len(list(chunks.glob("*.parquet"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(chunks.glob("*.parquet"))) >= 2, _slurm_logs(plan.job_dir)
    # what Slurm does at --signal=B:USR2@N: signal the batch shell only
    subprocess.run(["scancel", "--signal=USR2", "--batch", task], check=True)
    requeued = []

    def release(listed: list[str]) -> None:
        # a requeued job waits ~2 minutes (BeginTime) before it may start again; let it start now
        if any("BeginTime" in line for line in listed):
            requeued.append(listed)
            subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now"], check=True)

    _wait_until_gone([job_id], timeout=240, on_poll=release)
    logs = _slurm_logs(plan.job_dir)
    assert requeued, logs
    assert "USR2 received; shard 0 stops after the chunk in flight" in logs
    assert "requeueing shard 0" in logs
    assert "restart 1" in logs  # the same array task ran again
    assert "worker exited with 75" in logs  # stopped at a chunk boundary
    assert "worker exited with 0" in logs
    assert attempts.incomplete_shards(plan) == [], logs
    ids = _output_ids(plan.job_dir)
    assert sorted(ids) == list(range(40)), logs  # every row exactly once


@pytest.mark.slow
@pytest.mark.timing  # Slurm sends the time-limit signal on its own schedule; under load it came too late
def test_time_limit_signal_from_slurm_itself_requeues_until_done(tmp_path, cluster):
    # --time=1 with USR2 55 s before the limit: Slurm itself signals the batch shell (it checks limits
    # every ~30 s, so the signal comes 5..35 s after the start) while 100 rows x 0.5 s are in flight.
    plan = make_job(tmp_path, rows=100, shards=1, chunk_rows=4, engine_args={"delay": "0.5"})
    args = [
        "slurm",
        str(plan.job_dir),
        "--submit",
        "--gpus-per-task",
        "0",
        "--time",
        "1",
        "--signal-seconds",
        "55",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    (job_id,) = [s["job_id"] for s in slurm.submissions(plan.job_dir)]

    def release(listed: list[str]) -> None:
        if any("BeginTime" in line for line in listed):
            subprocess.run(["scontrol", "update", f"JobId={job_id}_0", "StartTime=now"], check=True)

    _wait_until_gone([job_id], timeout=300, on_poll=release)
    logs = _slurm_logs(plan.job_dir)
    assert "USR2 received" in logs and "requeueing shard 0" in logs, logs
    assert "DUE TO TIME LIMIT" not in logs, logs  # stopped and requeued before Slurm had to kill it
    assert attempts.incomplete_shards(plan) == [], logs
    assert sorted(_output_ids(plan.job_dir)) == list(range(100)), logs
