"""The on-disk layout of a job directory and the atomic writes that make it crash-safe.

Every file a reader may see is published whole: written to a temporary name in the same directory
(`.NAME.tmp-PID`, which no `*.parquet` glob matches), fsynced, renamed over the final name, and the
directory fsynced so the rename survives a power cut. A chunk file *is* the commit of its rows; the
shard marker written after the last chunk only saves readers from listing chunk files.

    DIR/plan.json                                   the plan (jobs.plan)
    DIR/shards/NNNNN/attempt-AA-chunk-CCCCC.parquet  committed output rows
    DIR/markers/NNNNN-attempt-AA.json               shard attempt finished (schemas/shard_marker)
    DIR/attempts/AA.json                            rows of a retry-errors attempt (schemas/attempt)
    DIR/locks/NNNNN.lock                            per-shard flock (jobs.lock)
    DIR/logs/shard-NNNNN.log                        per-shard DEBUG log
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

PLAN_FILE = "plan.json"
SHARDS_DIR = "shards"
MARKERS_DIR = "markers"
ATTEMPTS_DIR = "attempts"
LOGS_DIR = "logs"
RESULTS_GLOB = f"{SHARDS_DIR}/*/*.parquet"


def chunk_path(job_dir: Path, shard: int, attempt: int, chunk: int) -> Path:
    return job_dir / SHARDS_DIR / f"{shard:05d}" / f"attempt-{attempt:02d}-chunk-{chunk:05d}.parquet"


def marker_path(job_dir: Path, shard: int, attempt: int) -> Path:
    return job_dir / MARKERS_DIR / f"{shard:05d}-attempt-{attempt:02d}.json"


def attempt_path(job_dir: Path, attempt: int) -> Path:
    return job_dir / ATTEMPTS_DIR / f"{attempt:02d}.json"


def log_path(job_dir: Path, shard: int) -> Path:
    return job_dir / LOGS_DIR / f"shard-{shard:05d}.log"


def _tmp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


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


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
