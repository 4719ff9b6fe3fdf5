"""`run_shard`: the only code that does work. Executors (the local loop in `batchinfer run`, several
GPUs, Slurm array tasks) only decide where and when it runs.

Contract of `run_shard(plan, shard_id, engine, *, stop=None, progress=None) -> ShardResult`:
- It takes the shard's lock itself (`jobs.lock.shard_lock`, non-blocking). If another process holds it,
  it returns at once with status "locked" and touches nothing. Under the lock it raises
  PlanMismatchError if `plan` is no longer the job's plan (`--force-new-plan` set it aside meanwhile).
- It processes every attempt with rows in the shard (1 = the plan's row range, 2.. = retry-errors
  attempts) in order, in chunks of `plan.chunk_rows` rows. A chunk whose file exists is committed and
  skipped; stray temporary files of killed writers are removed. Each chunk is read, handed to the
  plan's task (`jobs.tasks`: one `engine.generate` call for text, batched `engine.segment` calls for
  images) and published atomically as one Parquet file. After the last chunk of an attempt it writes
  the attempt's shard marker. Returns status "done".
- Before each chunk it checks `stop` (a StopFlag, set by SIGUSR2/SIGTERM once `install()`ed): when set,
  it returns status "stopped" with the chunk in flight committed; the process should exit EXIT_STOPPED
  so Slurm requeues it. The handler only sets the flag; nothing exits from inside it.
- Bad rows are output rows. An exception from the engine (a dead engine) or an unreadable input
  propagates after logging; everything committed before it stays, and a rerun resumes there.
- It logs to `DIR/logs/shard-NNNNN.log` as well as to the normal handlers.
- Pass a `jobs.engines.LazyEngine` to load the model only once a chunk needs it (a runner that finds
  every shard done or locked never loads it).
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from batchinfer.jobs import attempts, commit, inputs, tasks
from batchinfer.jobs.lock import shard_lock
from batchinfer.jobs.plan import Plan
from batchinfer.jobs.progress import Progress

from batchinfer import __version__
from batchinfer.engine.api import ImageEngine, TextEngine
from batchinfer.errors import BatchinferError, PlanMismatchError

log = logging.getLogger(__name__)

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request at a chunk boundary; rerun (requeue) to continue
CHUNK_META = "batchinfer.chunk"


class StopFlag:
    """Asks workers to stop at the next chunk boundary. `install()` makes USR2 and TERM set it
    (USR2, not USR1: NCCL uses USR1)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._set = False

    def install(self, signals: tuple[int, ...] = (signal.SIGUSR2, signal.SIGTERM)) -> None:
        for s in signals:
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self._set = True

    def set(self) -> None:
        self._set = True

    def __bool__(self) -> bool:
        return self._set


@dataclass(slots=True)
class ShardResult:
    shard: int
    status: str  # "done", "stopped" or "locked"
    chunks: int = 0  # committed by this call
    rows: int = 0
    errors: int = 0
    skipped: int = 0

    def add(self, stats: dict[str, Any]) -> None:
        self.chunks += 1
        for key in ("rows", "errors", "skipped"):
            setattr(self, key, getattr(self, key) + stats[key])


@dataclass(slots=True)
class _Job:
    """What every chunk of a run needs, computed once per shard."""

    plan: Plan
    task: tasks.Task
    engine: TextEngine | ImageEngine
    files: list[inputs.InputFile]
    columns: list[str]
    schema: pa.Schema
    progress: Progress | None
    base_meta: dict[str, str] = field(default_factory=dict)
    row_groups: inputs.RowGroupCache = field(default_factory=inputs.RowGroupCache)


def run_shard(
    plan: Plan,
    shard_id: int,
    engine: TextEngine | ImageEngine,
    *,
    stop: StopFlag | None = None,
    progress: Progress | None = None,
) -> ShardResult:
    """Process whatever is left of one shard; see the module docstring for the contract."""
    plan.shard_range(shard_id)  # validates the id
    with shard_lock(plan.job_dir, shard_id) as held:
        if not held:
            log.info("shard %05d is locked by another runner; skipping it", shard_id)
            return ShardResult(shard_id, "locked")
        handler = _attach_log(plan.job_dir, shard_id)
        try:
            return _run_locked(plan, shard_id, engine, stop, progress)
        except BatchinferError as e:  # a user error (unreadable input, unloadable model): one line
            log.error("shard %05d stopped: %s", shard_id, e)
            raise
        except Exception:
            log.exception(
                "shard %05d failed; committed chunks are kept and a rerun resumes after them", shard_id
            )
            raise
        finally:
            logging.getLogger("batchinfer").removeHandler(handler)
            handler.close()


def _run_locked(
    plan: Plan,
    shard: int,
    engine: TextEngine | ImageEngine,
    stop: StopFlag | None,
    progress: Progress | None,
) -> ShardResult:
    _check_current(plan)
    result = ShardResult(shard, "done")
    done = attempts.finished(plan, shard)
    pending = [a for a in attempts.shard_attempts(plan, shard) if (shard, a) not in done]
    if not pending:  # another runner finished it between our listing and our lock
        log.debug("shard %05d is already done", shard)
        return result
    files = plan.inputs
    first = pq.read_schema(files[0].path)  # the plan checked that every file has these types
    keep = [pa.field(c, first.field(c).type) for c in plan.keep_columns]
    task = plan.task
    job = _Job(
        plan,
        task,
        engine,
        files,
        task.read_columns(plan.keep_columns),
        task.output_arrow(plan.id_arrow_type, keep),
        progress,
    )
    commit.remove_stale_tmp(plan.job_dir / commit.SHARDS_DIR / f"{shard:05d}")
    commit.remove_stale_tmp(plan.job_dir / commit.MARKERS_DIR, f"{shard:05d}-attempt-*.json")
    for attempt in pending:
        rows = attempts.attempt_rows(plan, shard, attempt)
        log.info(
            "shard %05d attempt %d: %d rows in %d chunks",
            shard,
            attempt,
            len(rows),
            -(-len(rows) // plan.chunk_rows),
        )
        done: list[dict[str, Any]] = []
        for c, lo in enumerate(range(0, len(rows), plan.chunk_rows)):
            path = commit.chunk_path(plan.job_dir, shard, attempt, c)
            if path.exists():
                done.append(chunk_stats(path))
                continue
            if stop:
                log.info("shard %05d: stop requested; stopping before chunk %d", shard, c)
                result.status = "stopped"
                return result
            stats = _process_chunk(job, shard, attempt, c, rows[lo : lo + plan.chunk_rows], path)
            result.add(stats)
            done.append(stats)
        _write_marker(plan, shard, attempt, done)
    log.info(
        "shard %05d done: %d rows processed now, %d errors, %d skipped",
        shard,
        result.rows,
        result.errors,
        result.skipped,
    )
    return result


def _check_current(plan: Plan) -> None:
    """Refuse to work for a plan that `--force-new-plan` set aside after this runner loaded it: its chunks
    would land among the new plan's results. Checked once the shard is locked (`plan.set_aside` refuses
    while any shard is)."""
    path = plan.job_dir / commit.PLAN_FILE
    try:
        current = commit.read_json(path)["plan_id"]
    except FileNotFoundError:
        current = None
    if current != plan.plan_id:
        raise PlanMismatchError(
            f"{path}: the job's plan is now {current or 'missing'}, not this runner's {plan.plan_id} (set "
            f"aside by --force-new-plan); rerun `batchinfer run --output {plan.job_dir}` to work on it"
        )


def _process_chunk(
    job: _Job, shard: int, attempt: int, chunk: int, rows: np.ndarray, path: Path
) -> dict[str, Any]:
    t0 = time.monotonic()
    table = inputs.read_rows(job.files, rows, job.columns, job.row_groups)
    work = tasks.Chunk(job.plan, job.engine, table, rows, attempt, shard, job.schema, job.progress)
    out, counts = job.task.process(work)
    stats = {
        "shard": shard,
        "attempt": attempt,
        "chunk": chunk,
        "rows": len(rows),
        **counts,
        "seconds": round(time.monotonic() - t0, 4),
        "committed_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
    }
    if not job.base_meta:
        job.base_meta = file_metadata(job.plan, job.engine)
    commit.write_parquet_atomic(path, out, {**job.base_meta, CHUNK_META: json.dumps(stats)})
    log.info(
        "shard %05d attempt %d chunk %d committed: %d rows (%d errors, %d skipped), %d %s in %.2f s%s",
        shard,
        attempt,
        chunk,
        stats["rows"],
        stats["errors"],
        stats["skipped"],
        stats.get("instances", stats["output_tokens"]),
        "instances" if "instances" in stats else "tokens",
        stats["seconds"],
        _pipeline_note(stats),
    )
    if job.progress:
        job.progress.chunk(stats)
    return stats


def _pipeline_note(stats: dict[str, Any]) -> str:
    """The image task's split of a chunk's time: a long decode wait means the CPU cannot feed the GPU."""
    if "engine_seconds" not in stats:
        return ""
    return (
        f" (engine {stats['engine_seconds']:.2f} s, waiting on decoding {stats['decode_wait_seconds']:.2f} s)"
    )


def plan_metadata(plan: Plan) -> dict[str, str]:
    """Key-value metadata of the plan behind an output file (chunks and exports): its model, the job's
    parameters (thresholds, sampling) and the output schema."""
    task = plan.task
    return {
        "batchinfer.version": __version__,
        "batchinfer.plan_id": plan.plan_id,
        "batchinfer.model": plan.doc["model"]["path"],
        "batchinfer.model_config_hash": plan.doc["model"]["config_hash"],
        **task.metadata(plan),
        "batchinfer.schema": f"{task.output_schema}/{plan.doc['schemas'][task.output_schema]}",
    }


def file_metadata(plan: Plan, engine: TextEngine | ImageEngine) -> dict[str, str]:
    """Key-value metadata on every output file: who made it, with what, under which plan."""
    facts = engine.describe()
    return {
        **plan_metadata(plan),
        "batchinfer.quantization": str(facts.get("quantization", "unknown")),
        "batchinfer.engine": json.dumps(facts, sort_keys=True),
    }


def chunk_stats(path: Path) -> dict[str, Any]:
    """The stats a committed chunk carries in its footer."""
    return json.loads(pq.read_metadata(path).metadata[CHUNK_META.encode()])


def _write_marker(plan: Plan, shard: int, attempt: int, chunks: list[dict[str, Any]]) -> None:
    doc = {"plan_id": plan.plan_id, "shard": shard, "attempt": attempt, "chunks": len(chunks)}
    for key in ("rows", "errors", "skipped", "prompt_tokens", "output_tokens"):
        doc[key] = sum(c[key] for c in chunks)
    doc["seconds"] = round(sum(c["seconds"] for c in chunks), 3)
    doc["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    commit.write_json_atomic(commit.marker_path(plan.job_dir, shard, attempt), doc)


def _attach_log(job_dir: Path, shard: int) -> logging.Handler:
    path = commit.log_path(job_dir, shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("batchinfer").addHandler(handler)
    return handler


def run_shards(
    plan: Plan,
    shard_ids: list[int],
    engine: TextEngine | ImageEngine,
    *,
    stop: StopFlag | None = None,
    progress: Progress | None = None,
) -> list[ShardResult]:
    """The single-process executor: `run_shard` over `shard_ids` in order until done or stopped."""
    results = []
    for shard in shard_ids:
        if stop:
            break
        result = run_shard(plan, shard, engine, stop=stop, progress=progress)
        if progress:
            progress.shard(shard, result.status)
        results.append(result)
        if result.status == "stopped":
            break
    return results
