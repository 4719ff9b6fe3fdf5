"""Attempts: attempt 1 is every row of the plan; each `retry-errors` adds an attempt that reruns only
the rows whose latest result is an error (or skipped), listed per shard in `DIR/attempts/AA.json`.

Earlier attempts are never rewritten, so every attempt stays queryable (`results` view); the `latest`
view picks the highest attempt per id. A shard is done when every attempt that has rows in it has a
marker of this plan and every chunk file that marker counts.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
from batchinfer.jobs import commit
from batchinfer.jobs.plan import Plan
from batchinfer.schemas import loader

from batchinfer.errors import InputError

log = logging.getLogger(__name__)


def list_attempts(plan: Plan) -> list[int]:
    """All attempt numbers of the job, ascending (1 is always there)."""
    found = sorted(int(p.stem) for p in (plan.job_dir / commit.ATTEMPTS_DIR).glob("[0-9][0-9]*.json"))
    return [1, *found]


def _load(plan: Plan, attempt: int) -> dict:
    path = commit.attempt_path(plan.job_dir, attempt)
    doc = commit.read_json(path)
    try:
        loader.check_json(loader.load("attempt"), doc)
    except loader.SchemaMismatch as e:
        raise InputError(f"{path}: not a valid attempt file ({e})") from None
    if doc["plan_id"] != plan.plan_id:
        raise InputError(f"{path}: belongs to plan {doc['plan_id']}, not this job's plan {plan.plan_id}")
    return doc


def attempt_rows(plan: Plan, shard: int, attempt: int) -> np.ndarray:
    """Global input row indices that `attempt` processes in `shard`, ascending."""
    if attempt == 1:
        start, end = plan.shard_range(shard)
        return np.arange(start, end, dtype=np.int64)
    rows = _load(plan, attempt)["rows"].get(str(shard), [])
    return np.asarray(rows, dtype=np.int64)


def attempt_reasons(plan: Plan, attempt: int) -> list[str]:
    """The finish reasons a retry attempt reruns (attempt 1 reruns nothing: [])."""
    return [] if attempt == 1 else list(_load(plan, attempt)["reasons"])


def shard_attempts(plan: Plan, shard: int) -> list[int]:
    """The attempts with rows in `shard`."""
    return [a for a in list_attempts(plan) if a == 1 or str(shard) in _load(plan, a)["rows"]]


def _marked(plan: Plan, shard: int | None = None) -> dict[tuple[int, int], list[Path]]:
    """(shard, attempt) of each marker of this plan (of `shard` only, when given) -> the chunk files it
    counts that are gone. Lists the markers and chunk folders once instead of stat-ing every file (cheap
    on shared file systems). A marker of another plan (written by a runner of a plan that
    `--force-new-plan` set aside) or one that cannot be read is left out: its shard is not done."""
    name = "*" if shard is None else f"{shard:05d}"
    present = set(plan.job_dir.glob(f"{commit.SHARDS_DIR}/{name}/attempt-*-chunk-*.parquet"))
    marked = {}
    for path in (plan.job_dir / commit.MARKERS_DIR).glob(f"{name}-attempt-*.json"):
        try:
            marker = commit.read_json(path)
        except (OSError, ValueError):  # removed meanwhile (`reopen_damaged`), or damaged
            continue
        if marker.get("plan_id") != plan.plan_id:
            continue
        s, a = marker["shard"], marker["attempt"]
        chunks = (commit.chunk_path(plan.job_dir, s, a, c) for c in range(marker["chunks"]))
        marked[(s, a)] = [p for p in chunks if p not in present]
    return marked


def finished(plan: Plan, shard: int | None = None) -> set[tuple[int, int]]:
    """(shard, attempt) pairs that are done: a marker of this plan and every chunk it counts on disk (an
    incomplete copy of the job folder can lack one). Only `shard`'s when given."""
    return {place for place, missing in _marked(plan, shard).items() if not missing}


def missing_chunks(plan: Plan) -> list[Path]:
    """Chunk files that a marker of this plan counts but that are gone; their rows are computed again."""
    return sorted(p for missing in _marked(plan).values() for p in missing)


def incomplete_shards(plan: Plan) -> list[int]:
    """Shards with work left in any attempt; what a rerun, `slurm --retry` or a cron run still has to do."""
    retries = {a: set(_load(plan, a)["rows"]) for a in list_attempts(plan)[1:]}
    done = finished(plan)
    left = []
    for s in range(plan.num_shards):
        needed = [1, *(a for a, shards in retries.items() if str(s) in shards)]
        if any((s, a) not in done for a in needed):
            left.append(s)
    return left


def reopen_damaged(plan: Plan) -> list[Path]:
    """Set every damaged chunk file aside (`commit.set_aside`) and remove its attempt's shard marker, so
    that the runner computes that chunk again (its shard's whole chunks are kept); returns the chunks. A
    chunk is published whole, so damage came from outside: an interrupted copy of the folder, a disk."""
    reopened = []
    for path in commit.damaged_chunks(commit.chunk_files(plan.job_dir)):
        shard, attempt = commit.chunk_place(path)
        try:
            aside = commit.set_aside(path)
        except FileNotFoundError:  # another runner set it aside first
            continue
        commit.marker_path(plan.job_dir, shard, attempt).unlink(missing_ok=True)
        log.warning("%s: damaged (not a whole Parquet file); set aside as %s, its rows computed again",
                    path, aside.name)  # fmt: skip
        reopened.append(path)
    for path in missing_chunks(plan):  # `finished` does not count their shards: only say so
        log.warning("%s: missing, though its shard's marker counts it; its rows computed again", path)
    return reopened


def create_retry(plan: Plan, rows_by_shard: dict[int, list[int]], reasons: list[str]) -> int:
    """Write the next attempt file listing `rows_by_shard`; returns its attempt number."""
    attempt = list_attempts(plan)[-1] + 1
    doc = {
        "plan_id": plan.plan_id,
        "attempt": attempt,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "reasons": list(reasons),
        "rows": {str(s): sorted(int(r) for r in rows) for s, rows in sorted(rows_by_shard.items())},
    }
    if not commit.write_json_atomic(commit.attempt_path(plan.job_dir, attempt), doc, exclusive=True):
        raise InputError(
            f"{commit.attempt_path(plan.job_dir, attempt)}: another retry-errors created this "
            "attempt at the same moment; rerun retry-errors to resume it"
        )
    total = sum(len(r) for r in rows_by_shard.values())
    log.info("attempt %d: %d rows to retry in %d shards", attempt, total, len(rows_by_shard))
    return attempt


def pending_rows(plan: Plan, shard: int) -> int:
    """Rows of `shard` not yet in a committed chunk (for progress totals)."""
    left = 0
    done = finished(plan, shard)
    for attempt in shard_attempts(plan, shard):
        if (shard, attempt) in done:
            continue
        n = len(attempt_rows(plan, shard, attempt))
        for c, lo in enumerate(range(0, n, plan.chunk_rows)):
            if not commit.chunk_path(plan.job_dir, shard, attempt, c).exists():
                left += min(plan.chunk_rows, n - lo)
    return left
