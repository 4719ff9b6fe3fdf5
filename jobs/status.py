"""`batchinfer status DIR`: a job's progress computed from what is on disk, with no daemon to ask.

Shards come from markers and locks, rows and finish reasons from the `latest` view, and throughput from
the stats each chunk carries in its Parquet footer (`batchinfer.chunk`): engine tokens/s (summed over
chunks, per worker) and overall tokens/s (first to last commit, all workers together).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
from batchinfer.jobs import attempts, commit, query
from batchinfer.jobs.lock import lock_holder
from batchinfer.jobs.plan import Plan
from batchinfer.jobs.worker import CHUNK_META


def _chunk_stats(plan: Plan) -> list[dict[str, Any]]:
    if not commit.chunk_files(plan.job_dir):
        return []
    con = duckdb.connect()
    glob = str(plan.job_dir / commit.RESULTS_GLOB).replace("'", "''")
    rows = con.execute(
        f"SELECT value FROM parquet_kv_metadata('{glob}') WHERE decode(key) = ?", [CHUNK_META]
    ).fetchall()
    return [json.loads(v.decode() if isinstance(v, bytes) else v) for (v,) in rows]


def summarize(job_dir: str | Path) -> dict[str, Any]:
    plan = Plan.load(job_dir)
    left = set(attempts.incomplete_shards(plan))
    running = {s: h for s in sorted(left) if (h := lock_holder(plan.job_dir, s))}
    started = {int(p.name) for p in (plan.job_dir / commit.SHARDS_DIR).glob("[0-9]*") if any(p.iterdir())}
    con = query.connect(plan.job_dir)
    task = plan.task
    reasons = dict(con.sql(f"SELECT {task.outcome_sql}, {task.rows_sql} FROM latest GROUP BY 1").fetchall())
    chunks = _chunk_stats(plan)
    out_tokens = sum(c["output_tokens"] for c in chunks)
    engine_s = sum(c["seconds"] for c in chunks)
    times = sorted(datetime.fromisoformat(c["committed_at"]) for c in chunks)
    # wall time from the start of the first chunk to the last commit, over all workers together
    first = min(chunks, key=lambda c: c["committed_at"]) if chunks else None
    span = (times[-1] - times[0]).total_seconds() + first["seconds"] if first else 0.0
    all_attempts = attempts.list_attempts(plan)
    rows_s = sum(c["rows"] for c in chunks)
    return {
        "job_dir": str(plan.job_dir),
        "task": task.name,
        "plan_id": plan.plan_id,
        "model": plan.doc["model"]["path"],
        "rows_total": plan.doc["total_rows"],
        "rows_done": sum(reasons.values()),
        "finish_reasons": reasons,
        "shards_total": plan.num_shards,
        "shards_done": plan.num_shards - len(left),
        "shards_running": len(running),
        "shards_partial": len((left & started) - running.keys()),
        "shards_pending": len(left - started - running.keys()),
        "running": {f"{s:05d}": h for s, h in running.items()},
        "missing_chunks": [str(p) for p in attempts.missing_chunks(plan)],
        "attempts": len(all_attempts),
        "chunks": len(chunks),
        "prompt_tokens": sum(c["prompt_tokens"] for c in chunks),
        "output_tokens": out_tokens,
        "engine_tokens_per_s": round(out_tokens / engine_s, 1) if engine_s else None,
        "overall_tokens_per_s": round(out_tokens / span, 1) if span else None,
        "engine_rows_per_s": round(rows_s / engine_s, 2) if engine_s else None,
        "overall_rows_per_s": round(rows_s / span, 2) if span else None,
        "wall_s": round(span, 1),  # what the overall rates divide by
        "first_commit": times[0].isoformat() if times else None,
        "last_commit": times[-1].isoformat() if times else None,
    }


def render(s: dict[str, Any]) -> str:
    """The summary as a few human-readable lines."""
    pct = 100.0 * s["rows_done"] / s["rows_total"] if s["rows_total"] else 100.0
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["finish_reasons"].items())) or "none yet"
    model = f"model {s['model']}" if s["model"] else "no model"
    lines = [
        f"job      {s['job_dir']} (plan {s['plan_id']}, {model})",
        f"shards   {s['shards_done']}/{s['shards_total']} done, {s['shards_running']} running, "
        f"{s['shards_partial']} partial, {s['shards_pending']} pending",
        f"rows     {s['rows_done']}/{s['rows_total']} done ({pct:.1f}%); latest results: {reasons}",
    ]
    if s.get("task") == "image":
        lines.append(f"chunks   {s['chunks']} committed")
        if s["engine_rows_per_s"] is not None:
            overall = s["overall_rows_per_s"]
            lines.append(
                f"speed    {s['engine_rows_per_s']} images/s per worker (engine time)"
                + (f", {overall} images/s overall" if overall else "")
            )
    else:
        lines.append(
            f"tokens   {s['output_tokens']} generated, {s['prompt_tokens']} prompt, in {s['chunks']} chunks"
        )
    if s.get("task") != "image" and s["engine_tokens_per_s"] is not None:
        overall = s["overall_tokens_per_s"]
        span = f"{s['wall_s']} s from the first chunk's start to the last commit at {s['last_commit']}"
        lines.append(
            f"speed    {s['engine_tokens_per_s']} tokens/s per worker (engine time)"
            + (f", {overall} tokens/s overall ({span})" if overall else "")
        )
    if s["attempts"] > 1:
        lines.append(f"attempts {s['attempts']} (retry-errors ran {s['attempts'] - 1} time(s))")
    for shard, holder in s["running"].items():
        lines.append(f"running  shard {shard}: {holder}")
    if s["missing_chunks"]:
        lines.append(
            f"missing  {len(s['missing_chunks'])} chunk file(s) their shard's marker counts (first: "
            f"{s['missing_chunks'][0]}); `batchinfer run --output {s['job_dir']}` computes them again"
        )
    return "\n".join(lines)
