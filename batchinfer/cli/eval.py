"""`batchinfer eval`: exact-match accuracy on the held-out synthetic tasks, through the job path."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("eval")
@click.option("-m", "--model", required=True, help="Checkpoint folder to evaluate.")
@click.option("-o", "--output", required=True, help="Job directory for the evaluation run (rerun to resume).")
@click.option("--tasks", help="Comma-separated task names [all: add,reverse,sort,count,convert].")
@click.option("--n-per-task", type=int, default=200, show_default=True, help="Held-out prompts per task.")
@click.option("--seed", type=int, default=1, show_default=True, help="Seed of the held-out set.")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Most tokens per answer.")
@click.option("--engine-arg", multiple=True, help="KEY=VALUE passed to the engine (e.g. device=cpu).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the figures as JSON.")
@click.option("--progress", type=click.Choice(["bar", "json", "none"]), help="Progress display.")
def eval_command(
    model: str,
    output: str,
    tasks: str | None,
    n_per_task: int,
    seed: int,
    max_tokens: int,
    engine_arg: tuple[str, ...],
    json_out: str | None,
    progress: str | None,
) -> None:
    """Run held-out task prompts through MODEL as a normal job and report exact match per task.

    The prompts (chat messages, greedy decoding) go to OUTPUT/heldout.parquet, the job runs in
    OUTPUT like `batchinfer run` (resumable), and the accuracy comes from a DuckDB query over the
    results joined with the expected answers. Prints a table; --json writes the same figures.
    """
    from batchinfer.cli.run import default_progress, execute
    from batchinfer.demo.evaluate import accuracy, write_heldout
    from batchinfer.demo.tasks import get_task
    from batchinfer.jobs import plan as plans
    from batchinfer.jobs.engines import check_args, parse_args

    try:
        names = [get_task(t.strip()).name for t in tasks.split(",")] if tasks else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tasks") from None
    engine_args = parse_args(engine_arg)
    check_args(plans.DEFAULT_ENGINE, engine_args)  # a mistyped --engine-arg stops before the plan
    job_dir = Path(output).resolve()
    prompts = write_heldout(job_dir / "heldout.parquet", n_per_task, seed, names)
    plan = plans.open_or_create(
        plans.build_plan(
            job_dir,
            [str(prompts)],
            model,
            {
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": 0,
                "stop": [],
                "ignore_eos": False,
            },
            keep_columns=["task", "answer"],
            engine_args=engine_args,
        )
    )
    code = execute(plan, list(range(plan.num_shards)), progress or default_progress())
    if code:
        raise SystemExit(code)
    figures = {"model": model, "n_per_task": n_per_task, "seed": seed, **accuracy(job_dir)}
    click.echo(f"{'task':<10} {'rows':>6} {'correct':>8} {'exact match':>12}")
    for task, t in figures["tasks"].items():
        click.echo(f"{task:<10} {t['rows']:>6} {t['correct']:>8} {t['exact_match']:>12.3f}")
    click.echo(f"{'mean':<10} {'':>6} {'':>8} {figures['mean_exact_match']:>12.3f}")
    if json_out:
        Path(json_out).write_text(json.dumps(figures, indent=2) + "\n")
