"""`batchinfer query DIR "SQL"`: DuckDB over a job's results."""

from __future__ import annotations

import click


def _not_empty(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Callback of the SQL argument: an empty one (a quoted unset shell variable) would run nothing."""
    if not value.strip():
        raise click.BadParameter("empty; expected a query such as 'SELECT count(*) FROM latest'", ctx, param)
    return value


@click.command("query")
@click.argument("job_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("sql", callback=_not_empty)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the rows to FILE.parquet or FILE.csv.")
@click.option(
    "--force", is_flag=True, help="Overwrite the --out file if it exists (never the job's own files)."
)
@click.option(
    "--max-rows",
    type=click.IntRange(min=1),
    default=40,
    show_default=True,
    help="Rows to print (table output).",
)
def query_command(job_dir: str, sql: str, out: str | None, force: bool, max_rows: int) -> None:
    """Run SQL over the views `results` (every committed row, every attempt), `latest` (the rows of each
    id's latest attempt: one per id for text jobs, one per image, prompt and instance for image jobs) and
    `inputs` (the input files, while readable and unchanged since the plan). Safe while workers run.

    Example: batchinfer query DIR "SELECT finish_reason, count(*) FROM latest GROUP BY 1"
    """
    from batchinfer.jobs import query

    if out:
        query.check_out(job_dir, out, force)
    con = query.connect(job_dir)
    if out:
        rows = query.write_relation(con, sql, out, {})
        click.echo(f"wrote {rows} rows to {out}", err=True)
        return
    rel = query.run_sql(con, sql)
    if rel is not None:
        click.echo(rel.show(max_rows=max_rows) or "", nl=False)
