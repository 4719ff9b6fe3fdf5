"""The on-disk layout of a job directory and the atomic writes that make it crash-safe.

Every file a reader may see is published whole: written to a temporary name in the same directory
(`.NAME.tmp-HOST-PID`, which no `*.parquet` glob matches), fsynced, renamed over the final name, and the
directory fsynced so the rename survives a power cut. A chunk file *is* the commit of its rows; the
shard marker written after the last chunk only saves readers from listing chunk files.

    DIR/plan.json                                   the plan (jobs.plan)
    DIR/shards/NNNNN/attempt-AA-chunk-CCCCC.parquet  committed output rows
    DIR/shards/NNNNN/.attempt-AA-chunk-CCCCC.parquet.damaged-T  a damaged chunk set aside (`set_aside`)
    DIR/markers/NNNNN-attempt-AA.json               shard attempt finished (schemas/shard_marker)
    DIR/attempts/AA.json                            rows of a retry-errors attempt (schemas/attempt)
    DIR/locks/NNNNN.lock                            per-shard flock (jobs.lock)
    DIR/logs/shard-NNNNN.log                        per-shard DEBUG log
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

PLAN_FILE = "plan.json"
SHARDS_DIR = "shards"
MARKERS_DIR = "markers"
ATTEMPTS_DIR = "attempts"
LOGS_DIR = "logs"
# only chunk names (DuckDB globs as Python does): a stray file beside them is no result
RESULTS_GLOB = f"{SHARDS_DIR}/[0-9]*/attempt-[0-9]*-chunk-[0-9]*.parquet"
_PARQUET_MAGIC = b"PAR1"


def chunk_path(job_dir: Path, shard: int, attempt: int, chunk: int) -> Path:
    return job_dir / SHARDS_DIR / f"{shard:05d}" / f"attempt-{attempt:02d}-chunk-{chunk:05d}.parquet"


def marker_path(job_dir: Path, shard: int, attempt: int) -> Path:
    return job_dir / MARKERS_DIR / f"{shard:05d}-attempt-{attempt:02d}.json"


def attempt_path(job_dir: Path, attempt: int) -> Path:
    return job_dir / ATTEMPTS_DIR / f"{attempt:02d}.json"


def log_path(job_dir: Path, shard: int) -> Path:
    return job_dir / LOGS_DIR / f"shard-{shard:05d}.log"


def chunk_files(job_dir: Path) -> list[Path]:
    """Every committed chunk file of the job, in name order."""
    return sorted(job_dir.glob(RESULTS_GLOB))


def is_whole_parquet(path: Path) -> bool:
    """Whether `path` starts and ends with Parquet's magic bytes: a truncated or emptied file (an
    interrupted copy of the job folder, a full disk outside our atomic writes) does not."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            if f.seek(0, os.SEEK_END) < 12:
                return False
            f.seek(-4, os.SEEK_END)
            return head == _PARQUET_MAGIC and f.read(4) == _PARQUET_MAGIC
    except OSError:
        return False


def damaged_chunks(chunks: list[Path]) -> list[Path]:
    """Those of `chunks` (`chunk_files`) that are not whole Parquet files."""
    return [p for p in chunks if not is_whole_parquet(p)]


def chunk_place(path: Path) -> tuple[int, int]:
    """(shard, attempt) of a chunk file named as `chunk_path` names it."""
    return int(path.parent.name), int(path.name.split("-")[1])


def set_aside(path: Path) -> Path:
    """Rename a damaged chunk to a hidden name no reader globs, beside it, so that its rows are computed
    again; the bytes stay for whoever wants to look."""
    aside = path.with_name(f".{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    return aside


def _tmp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path, exclusive: bool) -> bool:
    """Move a fully written, fsynced tmp file to `final`; with `exclusive`, never replace an existing file."""
    if exclusive:
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)
    return True


def write_parquet_atomic(final: Path, table: pa.Table, metadata: dict[str, str]) -> None:
    """Publish `table` as a Parquet file at `final` with key-value metadata, all or nothing."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(final)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    with open(tmp, "wb") as f:
        pq.write_table(table, f, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    _publish(tmp, final, exclusive=False)


def write_json_atomic(final: Path, doc: dict[str, Any], exclusive: bool = False) -> bool:
    """Publish a JSON file; with `exclusive`, returns False (and writes nothing) if `final` exists."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(final)
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return _publish(tmp, final, exclusive)


def remove_stale_tmp(directory: Path, pattern: str = "*") -> int:
    """Delete leftovers of killed writers (temporary files whose final name matches `pattern`) in a
    directory whose files this process holds the lock for."""
    removed = 0
    if directory.is_dir():
        for p in directory.glob(f".{pattern}.tmp-*"):
            p.unlink(missing_ok=True)
            removed += 1
    return removed


def remove_dead_tmp(directory: Path, name: str) -> None:
    """Delete leftovers of writers of `directory/name` killed on this host (their process is gone): for
    files no lock covers, such as the plan, which runners on other hosts may be writing at this moment."""
    host = socket.gethostname()
    for p in directory.glob(f".{name}.tmp-{host}-*"):
        pid = p.name.rsplit("-", 1)[1]
        if pid.isdecimal() and not _alive(int(pid)):
            p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
