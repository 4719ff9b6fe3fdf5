"""Per-shard locks, so overlapping runners (cron, several GPUs, a Slurm requeue racing a rerun) never
work on the same shard.

A lock is an exclusive `flock` on `DIR/locks/NNNNN.lock`, taken without blocking: a runner that finds a
shard locked moves on to the next one. The kernel drops the lock when the holding process dies, even
on kill -9, so a crashed runner never leaves a stale lock behind and lock files are never deleted
(deleting one while another process waits on it would let two holders exist). After taking the lock
the holder writes `host pid time` into the file, only so humans and `status` can say who holds it.
flock works across processes on one machine and, on Linux, on NFSv4 and Lustre/GPFS mounts too.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_DIR = "locks"


def lock_path(job_dir: str | os.PathLike[str], shard_id: int) -> Path:
    return Path(job_dir) / LOCK_DIR / f"{shard_id:05d}.lock"


@contextmanager
def shard_lock(job_dir: str | os.PathLike[str], shard_id: int) -> Iterator[bool]:
    """Try to lock one shard; yield True if this process now holds it, False if another one does.

    Never blocks. The lock is released when the block exits or the process dies.
    """
    path = lock_path(job_dir, shard_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_exclusive(fd):
            yield False
            return
        holder = f"{socket.gethostname()} {os.getpid()} {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _try_exclusive(fd: int) -> bool:
    """Take LOCK_EX without waiting on a holder; only waits out `lock_holder`'s momentary probes.

    A probe holds LOCK_SH for microseconds. If LOCK_SH is free for us too, the conflict was a probe, not
    a runner (runners hold LOCK_EX), so try again shortly instead of skipping a shard nobody works on.
    """
    for _ in range(20):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a runner holds it
        fcntl.flock(fd, fcntl.LOCK_UN)
        time.sleep(0.005)
    return False


def lock_holder(job_dir: str | os.PathLike[str], shard_id: int) -> str | None:
    """`host pid time` of the process holding the shard's lock, or None when nobody holds it.

    Probes with a shared lock, which never conflicts with another prober, only with a holder.
    """
    path = lock_path(job_dir, shard_id)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown holder"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
