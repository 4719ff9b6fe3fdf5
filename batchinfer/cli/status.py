"""`batchinfer status DIR`: shards, rows, errors and throughput of a job, from what is on disk."""

from __future__ import annotations

import json

import click


@click.command("status")
@click.argument("job_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def status_command(job_dir: str, as_json: bool) -> None:
    """Summarise a job: shards done/running/pending, rows done, finish reasons (image jobs: images ok or
    error), tokens/s (image jobs: images/s).

    Safe to run at any time, also while workers run; it reads markers, locks and committed files only.
    """
    from batchinfer.jobs import status

    summary = status.summarize(job_dir)
    click.echo(json.dumps(summary, indent=2) if as_json else status.render(summary))
