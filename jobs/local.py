"""Several GPUs on one node: one worker process per GPU, each pinned with `CUDA_VISIBLE_DEVICES`.

Each worker is this installation's `batchinfer run --output DIR`, the same resumable runner cron uses:
it walks the plan's shards and takes whole shards whose per-shard lock (`jobs.lock`) it can get, so the
workers share the work without talking to each other and a worker that dies frees its shard. The parent
only starts them, prefixes their output with `[gpu N]`, forwards INT/TERM/USR2 (USR2: finish the chunk in
flight and stop), and reports shards left undone when they are all gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from batchinfer.jobs import attempts
from batchinfer.jobs.plan import Plan
from batchinfer.jobs.worker import EXIT_STOPPED

import batchinfer
from batchinfer.errors import InputError

log = logging.getLogger(__name__)

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


def worker_argv(job_dir: Path, log_flags: Sequence[str] = ()) -> list[str]:
    """This installation's `batchinfer [LOG_FLAGS] run --output DIR`: the resumable runner every executor
    starts (`log_flags`: the parent's -q or -v, which go before the command). The
    console script next to this Python, else the one on PATH, else this Python importing the batchinfer
    this process runs (an install without scripts, or a checkout on PYTHONPATH whose `batchinfer/` links
    `kernels`, `jobs` and `schemas` in): its folder goes first on the worker's path only where the worker
    would find none or another one (its working directory, or a Slurm task's environment, can differ)."""
    exe = Path(sys.executable).with_name("batchinfer")
    if not exe.exists():
        found = shutil.which("batchinfer")
        if found is None:
            init = Path(batchinfer.__file__).resolve()
            boot = (
                "import importlib.util, os, sys; s = importlib.util.find_spec('batchinfer'); "
                f"s is not None and os.path.realpath(s.origin) == {str(init)!r} "
                f"or sys.path.insert(0, {str(init.parents[1])!r}); "
                "from batchinfer.cli import main; main('batchinfer')"
            )
            command = [str(Path(sys.executable).absolute()), "-c", boot]
            return [*command, *log_flags, "run", "--output", str(job_dir)]
        exe = Path(found)
    return [str(exe.absolute()), *log_flags, "run", "--output", str(job_dir)]


def visible_gpus() -> list[str]:
    """Device ids this process may use, as CUDA_VISIBLE_DEVICES entries for the workers."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    import torch  # only here: the job layer stays importable without initialising CUDA

    return [str(i) for i in range(torch.cuda.device_count())]


def parse_gpus(spec: str, visible: Sequence[str] | None = None) -> list[str]:
    """`--gpus all|N|0,1` -> the CUDA_VISIBLE_DEVICES value of each worker (one GPU per worker).

    Indices in a list count within the GPUs this process sees (as CUDA numbers them).
    """
    visible = list(visible_gpus() if visible is None else visible)
    spec = spec.strip()
    if not visible:
        raise InputError(
            f"--gpus {spec}: this machine has no CUDA GPU visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run without --gpus to use "
            "the CPU, or run on a GPU node"
        )
    if spec == "all":
        return visible
    if spec.isdigit():
        n = int(spec)
        if not 1 <= n <= len(visible):
            raise InputError(
                f"--gpus {spec}: expected 1..{len(visible)} (this machine sees {len(visible)} GPUs)"
            )
        return visible[:n]
    try:
        ids = [int(part) for part in spec.split(",")]
    except ValueError:
        raise InputError(
            f"--gpus {spec!r}: expected 'all', a count such as 4, or device ids such as 0,1"
        ) from None
    bad = [i for i in ids if not 0 <= i < len(visible)]
    if bad:
        raise InputError(
            f"--gpus {spec}: no device {bad[0]}; this machine sees devices 0..{len(visible) - 1}"
        )
    if len(set(ids)) != len(ids):
        raise InputError(f"--gpus {spec}: a device is listed twice")
    return [visible[i] for i in ids]


def _relay(stream: IO[str], prefix: str) -> None:
    for line in stream:
        sys.stderr.write(f"{prefix} {line}")
        sys.stderr.flush()


def run_on_gpus(
    job_dir: str | os.PathLike[str],
    gpus: Sequence[str],
    extra_args: Sequence[str] = (),
    log_flags: Sequence[str] = (),
) -> int:
    """Run one `batchinfer run --output DIR` worker per GPU until all exit; 0 if every one succeeded.

    `extra_args` are passed to every worker's `run` (e.g. `["--progress", "json"]`), `log_flags` (-q, -v)
    to its `batchinfer`, so a quiet parent's workers are quiet too.
    """
    job_dir = Path(job_dir).resolve()
    argv = [*worker_argv(job_dir, log_flags), *extra_args]
    procs: list[tuple[str, subprocess.Popen[str]]] = []
    relays: list[threading.Thread] = []

    def forward(signum: int, _frame: object) -> None:
        log.warning("received %s; passing it to %d workers", signal.Signals(signum).name, len(procs))
        for _, p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        for gpu in gpus:
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
            p = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )  # signals reach workers only through `forward`
            procs.append((gpu, p))
            t = threading.Thread(target=_relay, args=(p.stdout, f"[gpu {gpu}]"), daemon=True)
            t.start()
            relays.append(t)
        log.info("started %d workers on GPUs %s for %s", len(procs), ",".join(gpus), job_dir)
        codes = {gpu: p.wait() for gpu, p in procs}
        for t in relays:
            t.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    failed = {gpu: rc for gpu, rc in codes.items() if rc != 0}
    for gpu, rc in failed.items():
        log.error("worker on GPU %s exited with %d; see %s/logs/ for its shards", gpu, rc, job_dir)
    left = attempts.incomplete_shards(Plan.load(job_dir))
    if left:
        log.warning(
            "%d shards are not done yet (first: %05d); rerun the same command to continue", len(left), left[0]
        )
    elif set(failed.values()) == {EXIT_STOPPED}:  # stopped while others finished the last shards: done
        log.info("every shard of %s is done", job_dir)
        return 0
    return max(failed.values(), key=abs) if failed else 0
