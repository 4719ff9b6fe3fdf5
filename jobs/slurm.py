"""Run a job's shards as a Slurm job array: one array task per shard, requeued before its time limit.

`batchinfer slurm DIR` renders `DIR/slurm/batchinfer.sbatch` from `slurm_template.sh.j2` (kept in the
job dir so humans can read and resubmit it) and, with `--submit`, calls sbatch. Array indices must stay
below the cluster's MaxArraySize, so shards are grouped by `shard // MaxArraySize`: each group is one
sbatch call whose tasks are `shard % MaxArraySize`, with `BATCHINFER_SHARD_OFFSET` exported to add the
group's base back. On a cluster with fewer shards than MaxArraySize the array index *is* the shard id.
Every submission is appended to `DIR/slurm/submissions.jsonl`, so `--retry` can leave out shards that
are still queued or running and resubmit only the rest of the incomplete ones.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import jinja2
from batchinfer.jobs.local import worker_argv

from batchinfer.errors import BatchinferError, InputError

log = logging.getLogger(__name__)

SLURM_DIR = "slurm"
SCRIPT_NAME = "batchinfer.sbatch"
OPTIONS_FILE = "options.json"
SUBMISSIONS_FILE = "submissions.jsonl"
DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's own default
OFFSET_VAR = "BATCHINFER_SHARD_OFFSET"


class SlurmError(BatchinferError):
    """sbatch/squeue failed or is missing."""


# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]], or no limit
_SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|infinite|unlimited", re.IGNORECASE)


def _time_seconds(time: str | None) -> int | None:
    """Seconds of a `_SLURM_TIME` --time (None: no limit given)."""
    if time is None or time.lower() in ("infinite", "unlimited"):
        return None
    days, _, clock = time.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        return int(days) * 86400 + sum(p * w for p, w in zip(parts, (3600, 60, 1), strict=False))  # H[:M[:S]]
    weights = {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(parts)]  # M, M:S, H:M:S
    return sum(p * w for p, w in zip(parts, weights, strict=True))


@dataclass(slots=True)
class SlurmOptions:
    """What goes into the #SBATCH header. Saved per job dir so `--retry` reuses it."""

    partition: str | None = None
    time: str | None = None  # sbatch --time, e.g. "4:00:00"
    account: str | None = None
    qos: str | None = None
    gpus_per_task: int = 1
    cpus_per_task: int | None = None
    mem: str | None = None  # sbatch --mem, e.g. "64G"
    max_running: int | None = None  # array throttle: at most this many tasks at once (per sbatch call)
    signal_seconds: int = 300  # USR2 this long before the time limit; must exceed one chunk's time
    job_name: str | None = None
    setup: str | None = None  # shell lines run before the worker (module load, conda activate, ...)
    sbatch_args: list[str] = field(default_factory=list)  # any other sbatch option, e.g. "--constraint=h200"

    def __post_init__(self) -> None:
        if self.gpus_per_task < 0:
            raise InputError(f"--gpus-per-task must be >= 0, got {self.gpus_per_task}")
        if self.max_running is not None and self.max_running < 1:
            raise InputError(f"--max-running must be >= 1, got {self.max_running}")
        if self.signal_seconds < 1:
            raise InputError(f"--signal-seconds must be >= 1, got {self.signal_seconds}")
        for arg in self.sbatch_args:
            if not arg.startswith("-"):
                raise InputError(f"--sbatch-arg {arg!r}: expected an sbatch option such as --constraint=h200")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise InputError(f"--cpus-per-task must be >= 1, got {self.cpus_per_task}")
        if self.time is not None and not _SLURM_TIME.fullmatch(self.time):
            raise InputError(f"--time {self.time!r}: expected a Slurm time such as 90, 4:00:00 or 1-12:00:00")
        if self.mem is not None and not re.fullmatch(r"\d+[KMGT]?", self.mem):
            raise InputError(f"--mem {self.mem!r}: expected a size such as 64G or 512000 (megabytes)")
        for name in ("partition", "account", "qos", "job_name", "sbatch_args"):
            values = getattr(self, name)
            for value in values if isinstance(values, list) else [values]:
                if value is not None and (not value or any(c.isspace() for c in value)):
                    flag = "--sbatch-arg" if name == "sbatch_args" else "--" + name.replace("_", "-")
                    raise InputError(f"{flag} {value!r}: expected a value without spaces or newlines")

    def check_signal(self) -> None:
        """Refuse a USR2 due before the task starts (checked on the options a script is written with, not
        on saved ones, so that the flags can still correct them)."""
        limit = _time_seconds(self.time)
        if limit is not None and self.signal_seconds >= limit:
            raise InputError(
                f"--signal-seconds {self.signal_seconds} is not under --time {self.time} ({limit} s): every "
                "task would be told to stop as it starts, then requeue; use a longer --time or a smaller "
                "--signal-seconds"
            )

    def sbatch_lines(self) -> list[str]:
        lines = [
            f"--{name.replace('_', '-')}={value}"
            for name in ("partition", "time", "account", "qos", "cpus_per_task", "mem")
            if (value := getattr(self, name)) is not None
        ]
        if self.gpus_per_task:
            lines.append(f"--gres=gpu:{self.gpus_per_task}")
        return lines + list(self.sbatch_args)

    def save(self, job_dir: Path) -> None:
        path = job_dir / SLURM_DIR / OPTIONS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, job_dir: Path) -> SlurmOptions:
        """The options saved by the last `batchinfer slurm DIR`, or the defaults."""
        path = job_dir / SLURM_DIR / OPTIONS_FILE
        if not path.exists():
            return cls()
        try:
            doc = json.loads(path.read_text())
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in doc.items() if k in known})
        except (json.JSONDecodeError, AttributeError, TypeError) as e:
            raise InputError(
                f"{path}: not valid saved Slurm options ({e}); delete it and pass the options again"
            ) from None


@dataclass(slots=True)
class ArrayGroup:
    """One sbatch call: array indices `spec` (plus throttle), shard = index + offset."""

    offset: int
    shards: list[int]

    def spec(self, max_running: int | None = None) -> str:
        spec = compress([s - self.offset for s in self.shards])
        return f"{spec}%{max_running}" if max_running else spec


def compress(indices: list[int]) -> str:
    """Sorted indices as a Slurm array spec: [0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    parts: list[str] = []
    ordered = sorted(set(indices))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def array_groups(shards: list[int], max_array_size: int) -> list[ArrayGroup]:
    """Split shard ids into sbatch calls whose array indices all lie in [0, max_array_size)."""
    groups: dict[int, list[int]] = {}
    for s in sorted(set(shards)):
        groups.setdefault(s - s % max_array_size, []).append(s)
    return [ArrayGroup(offset, members) for offset, members in sorted(groups.items())]


def max_array_size() -> int:
    """The cluster's MaxArraySize from `scontrol show config`, or Slurm's default without scontrol."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return DEFAULT_MAX_ARRAY_SIZE
    match = re.search(r"^MaxArraySize\s*=\s*(\d+)", out.stdout, re.MULTILINE)
    if out.returncode != 0 or not match:
        log.warning(
            "could not read MaxArraySize from `scontrol show config` (%s); assuming %d",
            out.stderr.strip() or "not listed",
            DEFAULT_MAX_ARRAY_SIZE,
        )
        return DEFAULT_MAX_ARRAY_SIZE
    return int(match.group(1))


def sbatch_argv(script: Path, group: ArrayGroup, opts: SlurmOptions, after: str | None = None) -> list[str]:
    """The sbatch call for one group, as a human would type it (`submit` adds --parsable)."""
    argv = ["sbatch", f"--array={group.spec(opts.max_running)}", f"--export=ALL,{OFFSET_VAR}={group.offset}"]
    if after:
        argv.append(f"--dependency=afterany:{after}")
    return argv + [str(script)]


def manual_commands(script: Path, groups: list[ArrayGroup], opts: SlurmOptions) -> list[str]:
    """The sbatch calls to submit the script by hand; with a throttle, each after the first waits for the
    one before (`submit` fills in the job id)."""
    after = "JOB_ID_OF_THE_ONE_ABOVE" if opts.max_running else None
    return [shlex.join(sbatch_argv(script, g, opts, after if i else None)) for i, g in enumerate(groups)]


def render(
    job_dir: Path, plan_id: str, num_shards: int, groups: list[ArrayGroup], opts: SlurmOptions, max_array: int
) -> str:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    script = job_dir / SLURM_DIR / SCRIPT_NAME
    return env.get_template("slurm_template.sh.j2").render(
        job_dir=job_dir,
        plan_id=plan_id,
        num_shards=num_shards,
        max_array_size=max_array,
        submit_commands=manual_commands(script, groups, opts),
        signal_seconds=opts.signal_seconds,
        job_name=opts.job_name or f"batchinfer-{job_dir.name}",
        log_dir=job_dir / SLURM_DIR / "logs",
        array=groups[0].spec(opts.max_running) if len(groups) == 1 and groups[0].offset == 0 else None,
        sbatch_lines=opts.sbatch_lines(),
        setup=opts.setup,
        worker_command=shlex.join(worker_argv(job_dir)),
        job_dir_shell=shlex.quote(str(job_dir)),
    )


def write_script(job_dir: Path, text: str) -> Path:
    """Write the script (and the log folder Slurm needs to exist before a task starts)."""
    if re.search(r"\s", str(job_dir)):
        raise InputError(
            f"{job_dir}: Slurm's #SBATCH --output cannot hold a path with whitespace; "
            "use a job directory without spaces"
        )
    (job_dir / SLURM_DIR / "logs").mkdir(parents=True, exist_ok=True)
    path = job_dir / SLURM_DIR / SCRIPT_NAME
    tmp = path.with_name(f".{SCRIPT_NAME}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return path


def submit(job_dir: Path, script: Path, groups: list[ArrayGroup], opts: SlurmOptions) -> list[str]:
    """sbatch each group; returns the array job ids. With a throttle, groups run one after another."""
    ids: list[str] = []
    for group in groups:
        after = ids[-1] if ids and opts.max_running else None
        argv = sbatch_argv(script, group, opts, after)
        argv.insert(1, "--parsable")  # prints just the job id
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        except FileNotFoundError:
            raise SlurmError(
                "sbatch not found: run this on a Slurm login node, or submit the script "
                f"yourself: {shlex.join(argv)}"
            ) from None
        if out.returncode != 0:
            raise SlurmError(f"{shlex.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
        job_id = out.stdout.strip().split(";")[0]
        ids.append(job_id)
        _record(
            job_dir,
            {
                "job_id": job_id,
                "offset": group.offset,
                "shards": compress(group.shards),
                "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
        )
        log.debug("submitted array job %s: shards %s", job_id, compress(group.shards))
    return ids


def _record(job_dir: Path, entry: dict[str, Any]) -> None:
    with open(job_dir / SLURM_DIR / SUBMISSIONS_FILE, "a") as f:
        f.write(json.dumps(entry) + "\n")


def submissions(job_dir: Path) -> list[dict[str, Any]]:
    path = job_dir / SLURM_DIR / SUBMISSIONS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def active_shards(job_dir: Path) -> dict[int, str]:
    """Shards of this job dir's submissions that Slurm still lists (shard -> state such as PENDING)."""
    offsets = {s["job_id"]: s["offset"] for s in submissions(job_dir)}
    if not offsets:
        return {}
    argv = ["squeue", "--noheader", "--array", f"--jobs={','.join(offsets)}", "--format=%F %K %T"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmError("squeue not found: run this on a Slurm login node") from None
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:  # every recorded job has left the queue
            return {}
        raise SlurmError(f"{shlex.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    active: dict[int, str] = {}
    for line in out.stdout.splitlines():
        job_id, task, state = line.split()
        if job_id in offsets and task.isdigit():
            active[int(task) + offsets[job_id]] = state
    return active
