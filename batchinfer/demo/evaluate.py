"""Exact-match evaluation of a model on the held-out synthetic tasks, through the normal job path.

The held-out prompts are written as an ordinary chat-prompt Parquet file (with `task` and `answer`
columns carried through `keep_columns`), run as a `batchinfer run` job, and scored with one DuckDB
query over the job's results, the same query `make demo` prints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.demo.tasks import TASKS, make_mixture

HELDOUT_SEED = 1  # the seed of the published held-out set (examples/ and docs/ACCURACY.md)
HELDOUT_META = "batchinfer.heldout"

# Per-task exact match over the latest attempt of every row (`eval`'s; the Makefile's DEMO_SQL, which
# `make demo` prints, compares the same trimmed strings).
ACCURACY_SQL = """
SELECT task,
       count(*) AS rows,
       sum(CASE WHEN trim(text) = trim(answer) THEN 1 ELSE 0 END) AS correct,
       round(avg(CASE WHEN trim(text) = trim(answer) THEN 1.0 ELSE 0.0 END), 4) AS exact_match,
       sum(CASE WHEN finish_reason IN ('error', 'skipped') THEN 1 ELSE 0 END) AS not_answered
FROM latest GROUP BY task ORDER BY task
""".strip()


def heldout_table(n_per_task: int, seed: int = HELDOUT_SEED, tasks: list[str] | None = None) -> pa.Table:
    """`id`, chat `messages`, `task`, `answer` for `n_per_task` held-out prompts of each task."""
    examples = make_mixture(n_per_task, seed, "heldout", tasks)
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.table(
        {
            "id": pa.array(range(len(examples)), pa.int64()),
            "messages": pa.array(
                [[{"role": "user", "content": e.prompt}] for e in examples], pa.list_(message)
            ),
            "task": pa.array([e.task for e in examples], pa.string()),
            "answer": pa.array([e.answer for e in examples], pa.string()),
        }
    )


def write_heldout(
    path: str | Path, n_per_task: int, seed: int = HELDOUT_SEED, tasks: list[str] | None = None
):
    """Write the held-out prompt file (deterministic for the same arguments), the arguments in its
    metadata (`heldout_args`) so that a rerun of `eval` can leave them out."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    args = json.dumps({"n_per_task": n_per_task, "seed": seed, "tasks": tasks})
    pq.write_table(heldout_table(n_per_task, seed, tasks).replace_schema_metadata({HELDOUT_META: args}), path)
    return path


def heldout_args(path: str | Path) -> dict[str, Any]:
    """The arguments `write_heldout` made `path` with ({} for a file written before they were kept)."""
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[HELDOUT_META.encode()]) if HELDOUT_META.encode() in meta else {}


def accuracy(job_dir: str | Path) -> dict[str, Any]:
    """Per-task and mean exact match of a finished evaluation job."""
    from batchinfer.jobs.query import connect

    rows = connect(job_dir).sql(ACCURACY_SQL).fetchall()
    per_task = {
        task: {"rows": n, "correct": int(c), "exact_match": float(em), "not_answered": int(na)}
        for task, n, c, em, na in rows
    }  # not_answered: error and skipped rows, counted as wrong
    unknown = sorted(set(per_task) - set(TASKS))
    if unknown:
        raise ValueError(f"{job_dir}: results hold rows of unknown tasks {unknown}")
    mean = sum(t["exact_match"] for t in per_task.values()) / max(len(per_task), 1)
    return {"tasks": per_task, "mean_exact_match": round(mean, 4)}
