"""`DIR/plan.json`: the fixed description of a job that every worker, resume and retry reads.

A plan is made once, from validated inputs, and published exclusively (two runners racing to create it
cannot both win). A later run builds the plan its arguments describe and compares: any difference in
inputs, shards, model, engine, sampling or schema versions is refused with a list of what changed.
Plain JSON, checked against `schemas/plan.v1.json` on load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from batchinfer.jobs import commit, inputs, tasks
from batchinfer.jobs.lock import lock_holder, lock_path
from batchinfer.schemas import loader

from batchinfer import __version__
from batchinfer.errors import InputError, PlanMismatchError

log = logging.getLogger(__name__)

DEFAULT_SHARD_ROWS = 100_000  # default shard size: a few GPU-hours at most, so requeues lose little
DEFAULT_CHUNK_ROWS = 1000  # rows per committed file: a kill loses at most this much work
DEFAULT_ENGINE = "batchinfer.engine.loader:load_engine"
# what a checkpoint folder's model is made of: config and quantization JSON, weights, tokenizer files,
# chat template
MODEL_FILE_SUFFIXES = (
    ".json", ".jinja", ".safetensors", ".pt", ".pth", ".bin", ".model", ".tiktoken", ".txt"
)  # fmt: skip
_NOT_HASHED = ("plan_id", "created_at", "batchinfer_version")


@dataclass(slots=True)
class Plan:
    job_dir: Path
    doc: dict[str, Any]

    @property
    def plan_id(self) -> str:
        return self.doc["plan_id"]

    @property
    def inputs(self) -> list[inputs.InputFile]:
        """The input files, a path inside the job directory resolved against where it is now."""
        return [inputs.InputFile(**f) for f in absolute_inputs(self.doc, self.job_dir)["inputs"]]

    @property
    def num_shards(self) -> int:
        return len(self.doc["shards"])

    @property
    def chunk_rows(self) -> int:
        return self.doc["chunk_rows"]

    @property
    def seed(self) -> int:
        return self.doc["seed"]

    @property
    def sampling(self) -> dict[str, Any]:
        return self.doc["sampling"]

    @property
    def keep_columns(self) -> list[str]:
        return self.doc["keep_columns"]

    @property
    def task(self) -> tasks.Task:
        return tasks.get(self.doc["task"])

    @property
    def id_arrow_type(self) -> pa.DataType:
        return pa.int64() if self.doc["id_type"] == "int64" else pa.string()

    def shard_range(self, shard: int) -> tuple[int, int]:
        if not 0 <= shard < self.num_shards:
            raise InputError(f"shard {shard} does not exist; the plan has shards 0..{self.num_shards - 1}")
        s = self.doc["shards"][shard]
        return s["start"], s["end"]

    def save(self) -> bool:
        """Publish plan.json; False if a plan already exists there (then load and compare)."""
        return commit.write_json_atomic(self.job_dir / commit.PLAN_FILE, self.doc, exclusive=True)

    @classmethod
    def load(cls, job_dir: str | Path) -> Plan:
        job_dir = Path(job_dir).resolve()
        path = job_dir / commit.PLAN_FILE
        if not path.exists():
            raise InputError(
                f"{path}: no plan here; start the job with `batchinfer run --input ... --output "
                f"{job_dir} --model ...`"
            )
        try:
            doc = commit.read_json(path)
            loader.check_json(
                loader.load("plan", doc.get("schema_version") if isinstance(doc, dict) else None), doc
            )
        except (json.JSONDecodeError, KeyError, loader.SchemaMismatch) as e:
            raise InputError(f"{path}: not a valid plan ({e})") from None
        return cls(job_dir, doc)


def check_job_dir(job_dir: Path) -> None:
    """Refuse a job directory that cannot hold a job: a file, a path under a file, a folder this user
    cannot write (before anything is validated or written, so the error is one line)."""
    if job_dir.exists() and not job_dir.is_dir():
        raise InputError(f"--output {job_dir}: a file; expected a job directory (new or existing)")
    nearest = next(p for p in (job_dir, *job_dir.parents) if p.exists())
    if not nearest.is_dir():
        raise InputError(f"--output {job_dir}: {nearest} is a file, not a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        what = "write in it" if nearest == job_dir else f"create it in {nearest}"
        raise InputError(f"--output {job_dir}: permission denied; cannot {what}")


def absolute_inputs(doc: dict[str, Any], job_dir: Path) -> dict[str, Any]:
    """`doc` with its input paths absolute: a plan keeps the files it made inside its job directory
    (`eval`'s held-out set, `segment`'s image listings) relative to it, so that a job folder moved or
    copied elsewhere still finds them and still hashes to the same plan."""
    files = [{**f, "path": str(job_dir / f["path"])} for f in doc["inputs"]]
    return {**doc, "inputs": files}


def _job_relative(path: str, job_dir: Path) -> str:
    p = Path(path)
    return p.relative_to(job_dir).as_posix() if job_dir in p.parents else path


def split_rows(total: int, num_shards: int) -> list[tuple[int, int]]:
    """`num_shards` contiguous row ranges covering [0, total), sizes differing by at most one."""
    base, extra = divmod(total, num_shards)
    ranges, start = [], 0
    for i in range(num_shards):
        end = start + base + (i < extra)
        ranges.append((start, end))
        start = end
    return ranges


def build_plan(
    job_dir: str | Path,
    input_patterns: Sequence[str],
    model_path: str | Path,
    sampling: dict[str, Any],
    seed: int = 0,
    num_shards: int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    keep_columns: Sequence[str] = (),
    engine: str = DEFAULT_ENGINE,
    engine_args: dict[str, str] | None = None,
    check_rows: bool = True,
    task: str = "llm",
) -> Plan:
    """Validate the inputs and describe the job. `check_rows=False` skips the row scan (ids, prompt /
    messages; used when only comparing against an existing plan, whose fingerprints already vouch for
    the rows). `task` picks the task (jobs.tasks); for `image`, `sampling` holds the thresholds."""
    job_dir = Path(job_dir).resolve()
    check_job_dir(job_dir)
    if chunk_rows < 1:
        raise InputError(f"chunk_rows must be >= 1, got {chunk_rows}")
    kind = tasks.get(task)
    kind.check_params(sampling)
    input_schema = loader.load(kind.input_schema)
    files = inputs.describe_files(inputs.resolve(input_patterns), input_schema)
    id_type = inputs.id_type(files)
    reserved = set(loader.load(kind.output_schema).names())
    for i, c in enumerate(keep_columns):
        if c in keep_columns[:i]:
            raise InputError(f"--keep-columns names column {c!r} twice; expected each column once")
        if c in reserved:
            raise InputError(
                f"--keep-columns {c!r} collides with the output column of that name; "
                f"output columns are {sorted(reserved)}"
            )
        inputs.column_type(files, c)
    if check_rows:
        kind.check_rows(files, id_type)
    total = sum(f.rows for f in files)
    num_shards = num_shards or math.ceil(total / DEFAULT_SHARD_ROWS)
    if num_shards < 1:
        raise InputError(f"--shards must be >= 1, got {num_shards}")
    if num_shards > total:
        log.warning("asked for %d shards but the inputs have %d rows; using %d", num_shards, total, total)
        num_shards = total
    doc: dict[str, Any] = {
        "schema": "plan",
        "schema_version": loader.load("plan").version,
        "plan_id": "",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "batchinfer_version": __version__,
        "task": task,
        "inputs": [{**f.to_dict(), "path": _job_relative(f.path, job_dir)} for f in files],
        "id_type": "int64" if id_type == pa.int64() else "string",
        "keep_columns": list(keep_columns),
        "total_rows": total,
        "chunk_rows": chunk_rows,
        "shards": [
            {"shard": i, "start": s, "end": e} for i, (s, e) in enumerate(split_rows(total, num_shards))
        ],
        "model": {**kind.describe_model(str(model_path)), "files": model_files(str(model_path))},
        "engine": {"factory": engine, "args": dict(engine_args or {})},
        "sampling": dict(sampling),
        "seed": int(seed),
        "schemas": {
            n: loader.load(n).version for n in (kind.input_schema, kind.output_schema, "plan", "shard_marker")
        },
    }
    doc["plan_id"] = hash_plan(doc)
    return Plan(job_dir, doc)


def hash_plan(doc: dict[str, Any]) -> str:
    blob = json.dumps({k: v for k, v in doc.items() if k not in _NOT_HASHED}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences that make `new` a different job from `old` (empty if the same)."""
    changes: list[str] = []
    old_in = {f["path"]: f for f in old["inputs"]}
    new_in = {f["path"]: f for f in new["inputs"]}
    changes += [f"input file removed: {p}" for p in old_in if p not in new_in]
    changes += [f"input file added: {p}" for p in new_in if p not in old_in]
    for p in old_in.keys() & new_in.keys():
        for key in ("size", "rows", "fingerprint"):
            if old_in[p][key] != new_in[p][key]:
                changes.append(f"input file changed: {p}: {key} {old_in[p][key]} -> {new_in[p][key]}")
    if not changes and [f["path"] for f in old["inputs"]] != [f["path"] for f in new["inputs"]]:
        changes.append("input files are in a different order")
    old_model, new_model = dict(old["model"]), dict(new["model"])
    old_files, new_files = old_model.pop("files", None), new_model.pop("files", None)
    if old_model != new_model:
        changes.append(
            f"model: {json.dumps(old_model, sort_keys=True)} -> {json.dumps(new_model, sort_keys=True)}"
        )
    elif None not in (old_files, new_files):
        changes += _model_changes(old_files, new_files)
    for key in (
        "task",
        "id_type",
        "keep_columns",
        "total_rows",
        "chunk_rows",
        "engine",
        "sampling",
        "seed",
        "schemas",
    ):
        if old.get(key) != new.get(key):
            changes.append(
                f"{key}: {json.dumps(old.get(key), sort_keys=True)} -> "
                f"{json.dumps(new.get(key), sort_keys=True)}"
            )
    if len(old["shards"]) != len(new["shards"]):
        changes.append(f"shards: {len(old['shards'])} -> {len(new['shards'])}")
    return changes


def model_files(model_path: str) -> dict[str, str]:
    """Fingerprints (size and tail, as for input files) of the files a checkpoint is made of: the file
    itself, or a folder's top-level config, weight and tokenizer files; {} without a model. A resume
    checks them, so that a model replaced in place (other weights, another quantization) cannot mix
    into one job's results: config.json alone hashes the same for every quantization of a model."""
    p = Path(model_path).expanduser().resolve() if model_path else None
    if p is None or not p.exists():
        return {}
    found = [p] if p.is_file() else [
        f for f in sorted(p.iterdir()) if f.is_file() and f.suffix in MODEL_FILE_SUFFIXES and f.name[0] != "."
    ]  # fmt: skip
    try:
        return {f.name: inputs.fingerprint(f, f.stat().st_size) for f in found}
    except OSError as e:
        raise InputError(f"--model {model_path}: cannot read {e.filename} ({e.strerror})") from None


def _model_changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    return [f"model file {n}: " + ("removed" if n not in new else "added" if n not in old else "changed")
            for n in sorted(old.keys() | new.keys()) if old.get(n) != new.get(n)]  # fmt: skip


def verify_inputs(plan: Plan) -> None:
    """Refuse to work on inputs, or a model, that changed since the plan was made."""
    problems = [p for f in plan.inputs if (p := inputs.check_unchanged(f))]
    model = plan.doc["model"]
    if "files" in model:  # plans written before the model's files were recorded are not checked
        now = model_files(model["path"])
        problems += [f"{model['path']}: {c}" for c in _model_changes(model["files"], now)]
    if problems:
        raise PlanMismatchError(
            f"{plan.job_dir / commit.PLAN_FILE}: the inputs or the model changed since the plan was made: "
            + "; ".join(problems)
            + ". Restore them, or start over with --force-new-plan (or a new --output directory)"
        )


RESUME_HINT = (
    "Rerun with the original arguments to resume, use a new --output directory, "
    "or pass --force-new-plan to set the old results aside and start over"
)


def open_or_create(
    candidate: Plan,
    hint: str = RESUME_HINT,
    explain: Callable[[dict[str, Any], dict[str, Any]], list[str]] | None = None,
) -> Plan:
    """The job's plan: `candidate` if none exists yet, else the existing one if it describes the same job.
    `hint` ends the error for a different job (`eval` has no --force-new-plan to offer); `explain(old,
    new)` leads its list of changes with what the task knows of them (an image listing's files)."""
    if candidate.job_dir.is_dir():
        commit.remove_dead_tmp(candidate.job_dir, commit.PLAN_FILE)  # a plan writer killed here earlier
    if candidate.save():
        log.info(
            "wrote %s (plan %s, %d rows, %d shards)",
            candidate.job_dir / commit.PLAN_FILE,
            candidate.plan_id,
            candidate.doc["total_rows"],
            candidate.num_shards,
        )
        return candidate
    existing = Plan.load(candidate.job_dir)
    # compared with absolute paths: a plan written before they were kept relative names them so
    old, new = (absolute_inputs(d, existing.job_dir) for d in (existing.doc, candidate.doc))
    changes = diff(old, new)
    if changes and explain is not None:
        changes = explain(old, new) + changes
    if changes:
        raise PlanMismatchError(
            f"{existing.job_dir / commit.PLAN_FILE} describes a different job (plan {existing.plan_id}); "
            "changed: " + "; ".join(changes) + f". {hint}"
        )
    if existing.doc["batchinfer_version"] != __version__:
        log.warning(
            "plan written by batchinfer %s, resuming with %s", existing.doc["batchinfer_version"], __version__
        )
    return existing


def set_aside(job_dir: str | Path) -> Path | None:
    """Move an existing plan and everything derived from it to `DIR/superseded/<plan_id>/`, so a new
    plan can start in the same directory without losing or mixing committed results. Refused while a
    runner holds a shard's lock: it would go on writing the old plan's chunks into the new job."""
    job_dir = Path(job_dir).resolve()
    if not (job_dir / commit.PLAN_FILE).exists():
        return None
    old = Plan.load(job_dir)
    for shard in range(old.num_shards):
        holder = lock_holder(job_dir, shard)
        if holder:
            raise InputError(
                f"{lock_path(job_dir, shard)}: shard {shard:05d} of plan {old.plan_id} is being run by "
                f"{holder} (host, pid, start); --force-new-plan sets a job aside only while no runner works "
                "on it: stop that runner or let it finish, then rerun"
            )
    dest = job_dir / "superseded" / f"{old.plan_id}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    dest.mkdir(parents=True)
    for name in (
        commit.SHARDS_DIR,
        commit.MARKERS_DIR,
        commit.ATTEMPTS_DIR,
        commit.LOGS_DIR,
        commit.PLAN_FILE,
    ):
        if (job_dir / name).exists():
            (job_dir / name).rename(dest / name)
    log.warning("set the previous plan %s and its results aside in %s", old.plan_id, dest)
    return dest
