"""DuckDB over a job directory: views `results` (every committed row of every attempt), `latest` (the
rows of each id's highest attempt: one row per id for text jobs, one per (image, prompt, instance) for
image jobs) and `inputs` (the input files, while they are readable and unchanged since the plan).

Safe while workers run: only complete, renamed Parquet files match the glob, and committed files are
never rewritten or deleted, so a query sees some prefix of the work, never a torn file.
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from batchinfer.jobs import commit, inputs
from batchinfer.jobs.plan import Plan
from batchinfer.jobs.worker import plan_metadata

from batchinfer.errors import BatchinferError, InputError

LATEST_SQL = "SELECT * FROM results QUALIFY attempt = max(attempt) OVER (PARTITION BY id)"


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _empty_results(plan: Plan) -> pa.Table:
    """A zero-row table with the output schema, so the views work before the first commit."""
    try:
        keep = [pa.field(c, inputs.column_type(plan.inputs, c)) for c in plan.keep_columns]
    except BatchinferError:
        keep = [pa.field(c, pa.null()) for c in plan.keep_columns]
    return plan.task.output_arrow(plan.id_arrow_type, keep).empty_table()


def connect(job_dir: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the job's views defined."""
    plan = Plan.load(job_dir)
    chunks = commit.chunk_files(plan.job_dir)
    damaged = commit.damaged_chunks(chunks)
    if damaged:
        raise InputError(
            f"{damaged[0]}: a damaged result chunk ({damaged[0].stat().st_size} bytes, not a whole Parquet "
            f"file){f' and {len(damaged) - 1} more' if len(damaged) > 1 else ''}; rerun `batchinfer run "
            f"--output {plan.job_dir}` to set damaged chunks aside and compute their rows again"
        )
    con = duckdb.connect()
    con.execute("SET python_enable_replacements = false")  # else a missing view reads a Python variable
    glob = str(plan.job_dir / commit.RESULTS_GLOB)
    if chunks:
        con.execute(f"CREATE VIEW results AS SELECT * FROM read_parquet({_sql_str(glob)})")
    else:
        con.register("_no_results", _empty_results(plan))
        con.execute("CREATE VIEW results AS SELECT * FROM _no_results")
    con.execute(f"CREATE VIEW latest AS {LATEST_SQL}")
    try:
        unchanged = all(inputs.check_unchanged(f) is None for f in plan.inputs)
    except OSError:  # an input that cannot be read now
        unchanged = False
    if unchanged:  # else no view: a query on it says the files need to be readable and unchanged
        listing = ", ".join(_sql_str(f.path) for f in plan.inputs)
        try:
            con.execute(
                f"CREATE VIEW inputs AS SELECT * FROM read_parquet([{listing}], union_by_name = true)"
            )
        except duckdb.Error:  # unreadable now; the results views do not need the inputs
            pass
    return con


def _failed(e: duckdb.Error) -> InputError:
    hint = (
        " (the view inputs exists while the job's input files are readable and unchanged)"
        if "name inputs does not" in str(e)
        else ""
    )
    return InputError(f"query failed: {e}{hint}")


def run_sql(con: duckdb.DuckDBPyConnection, sql: str) -> duckdb.DuckDBPyRelation | None:
    try:
        return con.sql(sql)
    except duckdb.Error as e:
        raise _failed(e) from None


def check_out(job_dir: str | Path, out: str | Path, force: bool) -> None:
    """Refuse an output file that is one of the job's own (an input file, anything in the job directory:
    overwriting a committed chunk corrupts the job, an input stops its resume), an existing file unless
    `force`, and a path under a file (a folder OUT is click's `dir_okay=False` to refuse)."""
    if not str(out).strip():  # Path("") is the current folder
        raise InputError(f"output file name {str(out)!r} is empty; expected a file name")
    plan = Plan.load(job_dir)
    path = Path(out).expanduser().resolve()
    if path == plan.job_dir or plan.job_dir in path.parents:
        raise InputError(f"{out}: inside the job directory {plan.job_dir}; write the file elsewhere")
    if any(path == Path(f.path).resolve() for f in plan.inputs):
        raise InputError(f"{out}: an input file of the job in {plan.job_dir}; write the file elsewhere")
    if path.exists() and not force:
        raise InputError(f"{out}: exists; pass --force to overwrite it")
    blocked = next((d for d in path.parents if d.exists() and not d.is_dir()), None)
    if blocked is not None:
        raise InputError(f"{out}: {blocked} is a file, not a folder")


def write_relation(
    con: duckdb.DuckDBPyConnection, query: str, out: str | Path, metadata: dict[str, str]
) -> int:
    """Write a query's rows to `.parquet` or `.csv` atomically (tmp + rename); returns the row count."""
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".parquet", ".csv"):
        raise InputError(f"{out}: expected a .parquet or .csv file name")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if suffix == ".parquet":
        kv = ", ".join(f"{_sql_str(k)}: {_sql_str(v)}" for k, v in metadata.items())
        options = f"FORMAT parquet, COMPRESSION zstd, KV_METADATA {{{kv}}}" if kv else "FORMAT parquet"
    else:
        options = "FORMAT csv, HEADER true"
    try:  # through a view, whose statement ends with the query's: a trailing ; or -- comment is fine there
        con.execute(f"CREATE OR REPLACE TEMP VIEW _written AS\n{query}")
        con.execute(f"COPY _written TO {_sql_str(str(tmp))} ({options})")
        rows = con.execute("SELECT count(*) FROM _written").fetchone()[0]
    except duckdb.Error as e:
        tmp.unlink(missing_ok=True)
        raise _failed(e) from None
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return rows


def export(job_dir: str | Path, out: str | Path, partial: bool = False) -> int:
    """The latest attempt of every id (one row per id for text jobs, per (image, prompt, instance) for
    image jobs), in input order. Refuses an unfinished job unless `partial`."""
    plan = Plan.load(job_dir)
    task = plan.task
    con = connect(plan.job_dir)
    done = con.execute(f"SELECT {task.rows_sql} FROM latest").fetchone()[0]
    total = plan.doc["total_rows"]
    if done < total and not partial:
        raise InputError(
            f"{plan.job_dir}: only {done} of {total} rows are done; finish the job (`batchinfer run --output "
            f"{plan.job_dir}`) or pass --partial to export what is there"
        )
    metadata = {**plan_metadata(plan), **_engine_metadata(plan)}
    return write_relation(con, f"SELECT * FROM latest ORDER BY {task.order_sql}", out, metadata)


def _engine_metadata(plan: Plan) -> dict[str, str]:
    """The chunks' engine keys for an exported file: each chunk records the engine that wrote it (its
    quantization and description); runners on other machines can differ, so several are all listed."""
    keys = ("batchinfer.quantization", "batchinfer.engine")
    seen: dict[str, list[str]] = {k: [] for k in keys}
    for path in commit.chunk_files(plan.job_dir):
        meta = pq.read_metadata(path).metadata or {}
        for k in keys:
            v = meta.get(k.encode(), b"").decode()
            if v and v not in seen[k]:
                seen[k].append(v)
    out = {}
    if seen["batchinfer.quantization"]:
        out["batchinfer.quantization"] = ",".join(seen["batchinfer.quantization"])
    if seen["batchinfer.engine"]:
        engines = seen["batchinfer.engine"]
        out["batchinfer.engine"] = engines[0] if len(engines) == 1 else "[" + ", ".join(engines) + "]"
    return out


def rows_to_retry(job_dir: str | Path, reasons: list[str]) -> dict[int, list[int]]:
    """Global row indices, per shard, whose latest result has one of `reasons` as its outcome
    (finish_reason for text jobs; `error` for images that failed)."""
    plan = Plan.load(job_dir)
    con = connect(plan.job_dir)
    listing = ", ".join(_sql_str(r) for r in reasons)
    rows = con.sql(
        f"SELECT DISTINCT shard, row FROM latest WHERE {plan.task.outcome_sql} IN ({listing}) ORDER BY row"
    ).fetchall()
    out: dict[int, list[int]] = {}
    for shard, row in rows:
        out.setdefault(int(shard), []).append(int(row))
    return out
