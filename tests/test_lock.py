"""Per-shard flock locks: exclusive, non-blocking, released on exit and on kill -9."""

import os
import signal
import socket
import subprocess
import sys
import time

from batchinfer.jobs.lock import lock_holder, lock_path, shard_lock

HOLD = """
import sys, time
from batchinfer.jobs.lock import shard_lock
with shard_lock(sys.argv[1], int(sys.argv[2])) as got:
    print("got" if got else "busy", flush=True)
    time.sleep(60)
"""


def _holder_process(job_dir, shard_id):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(job_dir), str(shard_id)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "got"
    return proc


def test_lock_file_name_is_zero_padded(tmp_path):
    assert lock_path(tmp_path, 42) == tmp_path / "locks" / "00042.lock"


def test_second_taker_is_refused_then_admitted_after_release(tmp_path):
    with shard_lock(tmp_path, 3) as first:
        assert first is True
        with shard_lock(tmp_path, 3) as second:
            assert second is False
        with shard_lock(tmp_path, 4) as other_shard:
            assert other_shard is True
    with shard_lock(tmp_path, 3) as again:
        assert again is True


def test_lock_held_by_other_process_and_freed_by_kill_9(tmp_path):
    proc = _holder_process(tmp_path, 7)
    try:
        start = time.monotonic()
        with shard_lock(tmp_path, 7) as got:
            assert got is False
        assert time.monotonic() - start < 1.0  # never waits on a holder
        host, pid, _ = lock_holder(tmp_path, 7).split(" ")
        assert host == socket.gethostname()
        assert int(pid) == proc.pid
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert lock_holder(tmp_path, 7) is None
    with shard_lock(tmp_path, 7) as got:
        assert got is True
        assert int(lock_holder(tmp_path, 7).split(" ")[1]) == os.getpid()


def test_lock_holder_of_never_locked_shard_is_none(tmp_path):
    assert lock_holder(tmp_path, 0) is None


def test_probing_never_makes_a_runner_skip_a_free_shard(tmp_path):
    probe = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom batchinfer.jobs.lock import lock_holder\n"
            "while True: lock_holder(sys.argv[1], 1)",
            str(tmp_path),
        ]
    )
    try:
        time.sleep(0.3)
        for _ in range(2000):
            with shard_lock(tmp_path, 1) as got:
                assert got is True
    finally:
        probe.kill()
        probe.wait()


SPAWN = """
import subprocess, sys, time
from batchinfer.jobs.lock import shard_lock
with shard_lock(sys.argv[1], 5) as got:
    child = subprocess.Popen(["sleep", "30"], close_fds=False)
    print(child.pid, flush=True)
    time.sleep(60)
"""


def test_lock_is_not_inherited_by_exec_children(tmp_path):
    # A runner that started a helper process and was then killed must not leave its shard locked.
    proc = subprocess.Popen([sys.executable, "-c", SPAWN, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child_pid = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    try:
        os.kill(child_pid, 0)  # the helper still runs
        with shard_lock(tmp_path, 5) as got:
            assert got is True
    finally:
        os.kill(child_pid, signal.SIGKILL)
