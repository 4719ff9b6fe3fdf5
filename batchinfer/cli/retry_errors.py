"""`batchinfer retry-errors DIR`: rerun only the rows whose latest result is an error, as a new attempt."""

from __future__ import annotations

import sys

import click

from batchinfer.errors import InputError


@click.command("retry-errors")
@click.argument("job_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--finish-reason",
    "reasons",
    multiple=True,
    type=click.Choice(["error", "skipped"]),
    help="Which latest results to retry (repeatable) [error, skipped].",
)
@click.option("--progress", type=click.Choice(["bar", "json", "none"]), help="bar (tty default), json, none.")
def retry_errors_command(job_dir: str, reasons: tuple[str, ...], progress: str | None) -> None:
    """Rerun the rows whose latest result has finish_reason error (or skipped) as a new attempt; for
    image jobs, the images whose latest rows carry an error (all their prompts).

    Earlier attempts stay on disk and in the `results` view; `latest` and `export` show the newest
    attempt per id. The job must be finished first. If an earlier retry was interrupted, this resumes it
    (as does `batchinfer run --output DIR`). Same engine, model and sampling as the plan.
    """
    from batchinfer.cli.run import default_progress, execute
    from batchinfer.jobs import attempts, query
    from batchinfer.jobs.plan import Plan, verify_inputs

    plan = Plan.load(job_dir)
    verify_inputs(plan)
    left = attempts.incomplete_shards(plan)
    last = attempts.list_attempts(plan)[-1]
    if left and last == 1:
        raise InputError(
            f"{plan.job_dir}: {len(left)} shard(s) are not finished (first: {left[0]:05d}); finish the job "
            f"with `batchinfer run --output {plan.job_dir}` before retrying errors"
        )
    if left:
        click.echo(f"resuming attempt {last} ({len(left)} shard(s) left)", err=True)
        earlier = attempts.attempt_reasons(plan, last)
        if reasons and set(reasons) != set(earlier):
            click.echo(
                f"attempt {last} retries finish_reason {', '.join(earlier)}, not {', '.join(reasons)}: it "
                "finishes first; rerun retry-errors with your --finish-reason after it",
                err=True,
            )
    else:
        chosen = list(reasons) or ["error", "skipped"]
        rows = query.rows_to_retry(plan.job_dir, chosen)
        if not rows:
            what = "an error" if plan.doc["task"] == "image" else f"finish_reason in {chosen}"
            click.echo(f"nothing to retry: no latest result has {what}", err=True)
            return
        attempt = attempts.create_retry(plan, rows, chosen)
        n = sum(len(r) for r in rows.values())
        click.echo(f"attempt {attempt}: retrying {n} row(s) in {len(rows)} shard(s)", err=True)
        left = attempts.incomplete_shards(plan)
    sys.exit(execute(plan, left, progress or default_progress()))
