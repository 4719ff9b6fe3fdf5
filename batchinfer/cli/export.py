"""`batchinfer export DIR OUT.parquet`: one row per id, its latest attempt, in input order."""

from __future__ import annotations

import click


@click.command("export")
@click.argument("job_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--partial", is_flag=True, help="Export an unfinished job's rows so far instead of refusing.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists (never the job's own files).")
def export_command(job_dir: str, out: str, partial: bool, force: bool) -> None:
    """Write one file (.parquet or .csv) with the latest attempt of every input id, in input order: one
    row per id for text jobs, one per image, prompt and instance for image jobs."""
    from batchinfer.jobs import query

    query.check_out(job_dir, out, force)
    rows = query.export(job_dir, out, partial=partial)
    click.echo(f"wrote {rows} rows to {out}", err=True)
