"""Several GPUs on one node: `--gpus` parsing and one `batchinfer run` worker per device sharing shards.

On this CPU machine the workers get made-up device ids; the echo engine ignores them, which is enough
to check that the workers split the shards between them through the shard locks, every row is done
exactly once, and USR2 to the parent stops every worker at a chunk boundary.
"""

import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch
from batchinfer.jobs import attempts, commit, local
from batchinfer.jobs.lock import lock_path
from test_slurm import make_job

from batchinfer.errors import InputError


def test_parse_gpus_forms():
    visible = ["3", "5", "7"]
    assert local.parse_gpus("all", visible) == ["3", "5", "7"]
    assert local.parse_gpus("2", visible) == ["3", "5"]
    assert local.parse_gpus("0,2", visible) == ["3", "7"]  # indices count within the visible devices
    assert local.parse_gpus(" 1 ", visible) == ["3"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("4", "--gpus 4: expected 1..3 (this machine sees 3 GPUs)"),
        ("0", "--gpus 0: expected 1..3"),
        ("0,3", "--gpus 0,3: no device 3; this machine sees devices 0..2"),
        ("0,0", "--gpus 0,0: a device is listed twice"),
        ("gpu0", "--gpus 'gpu0': expected 'all', a count such as 4, or device ids such as 0,1"),
    ],
)
def test_parse_gpus_errors(spec, message):
    with pytest.raises(InputError) as e:
        local.parse_gpus(spec, ["0", "1", "2"])
    assert message in str(e.value)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert local.visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1a2b,GPU-3c4d")  # UUIDs pass through
    assert local.parse_gpus("1") == ["GPU-1a2b"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local.visible_gpus() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
def test_gpus_on_a_cpu_machine_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(InputError) as e:
        local.parse_gpus("all")
    assert "--gpus all: this machine has no CUDA GPU visible" in str(e.value)
    assert "run without --gpus to use the CPU" in str(e.value)


def test_workers_without_a_console_script_import_what_the_parent_runs(tmp_path, monkeypatch):
    """No `batchinfer` script (a checkout on PYTHONPATH): the worker is this Python importing batchinfer
    from the parent's import root, wherever it starts (here: from an empty folder with no PYTHONPATH)."""
    monkeypatch.setattr(local.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))
    argv = local.worker_argv(tmp_path / "job")
    assert argv[0] == str(tmp_path / "python3") and argv[1] == "-c"
    assert argv[3:] == ["run", "--output", str(tmp_path / "job")]
    monkeypatch.undo()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", argv[2], "--help"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Usage: batchinfer [OPTIONS] COMMAND")


def test_python_m_batchinfer_is_the_command_line():
    out = subprocess.run([sys.executable, "-m", "batchinfer", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Usage: batchinfer [OPTIONS] COMMAND")


def _output_ids(job_dir):
    ids = []
    for path in (job_dir / commit.SHARDS_DIR).glob("*/*.parquet"):
        ids += pq.read_table(path, columns=["id"]).column("id").to_pylist()
    return sorted(ids)


def test_workers_share_the_shards_and_do_every_row_once(tmp_path, capfd):
    plan = make_job(tmp_path, rows=48, shards=6, chunk_rows=4, engine_args={"delay": "0.1"})
    assert local.run_on_gpus(plan.job_dir, ["0", "1"]) == 0
    err = capfd.readouterr().err
    assert attempts.incomplete_shards(plan) == []
    assert _output_ids(plan.job_dir) == list(range(48))
    # each shard was worked on by exactly one worker, and both workers got some
    by_gpu = {
        gpu: {int(line.split("shard ")[1][:5]) for line in err.splitlines() if line.startswith(f"[gpu {gpu}]")
              and " done: " in line}
        for gpu in ("0", "1")
    }  # fmt: skip
    assert by_gpu["0"] and by_gpu["1"], err
    assert by_gpu["0"].isdisjoint(by_gpu["1"]), err
    assert by_gpu["0"] | by_gpu["1"] == set(range(6)), err


RUN = """
import sys
from batchinfer.jobs import local
sys.exit(local.run_on_gpus(sys.argv[1], ["0", "1"]))
"""


def test_usr2_stops_every_worker_at_a_chunk_boundary_and_a_rerun_finishes(tmp_path):
    plan = make_job(tmp_path, rows=64, shards=4, chunk_rows=2, engine_args={"delay": "0.1"})
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(plan.job_dir)], stderr=subprocess.PIPE, text=True)
    shards = plan.job_dir / commit.SHARDS_DIR
    deadline = time.monotonic() + 60
    while len(list(shards.glob("*/*.parquet"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err  # EXIT_STOPPED: rerun to continue
    assert err.count("stopped by SIGUSR2") == 2, err
    left = attempts.incomplete_shards(plan)
    assert left, err
    assert f"{len(left)} shards are not done yet" in err
    assert local.run_on_gpus(plan.job_dir, ["0", "1"]) == 0
    assert attempts.incomplete_shards(plan) == []
    assert _output_ids(plan.job_dir) == list(range(64))  # no row lost or duplicated by the stop


def test_a_stop_during_the_last_chunks_of_every_worker_exits_0(tmp_path):
    """Each worker finishes its last chunk after the stop; one may still see the other's shard unfinished
    and exit 75, but the parent finds every shard done: nothing to requeue, exit 0."""
    plan = make_job(tmp_path, rows=40, shards=2, chunk_rows=20, engine_args={"delay": "0.2"})  # ~4 s a chunk
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(plan.job_dir)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not all(lock_path(plan.job_dir, s).exists() for s in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.monotonic() < deadline, "the workers never took their shards"
    time.sleep(1.0)  # both inside their only chunk
    proc.send_signal(signal.SIGUSR2)
    _, err = proc.communicate(timeout=60)
    assert attempts.incomplete_shards(plan) == [], err
    assert proc.returncode == 0, err
    assert _output_ids(plan.job_dir) == list(range(40))
