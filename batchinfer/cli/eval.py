"""`batchinfer eval`: exact-match accuracy on the held-out synthetic tasks, through the job path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from batchinfer.cli.options import make_parent, output_folder
from batchinfer.errors import PlanMismatchError

N_PER_TASK = 200
MAX_TOKENS = 32

if TYPE_CHECKING:
    import pyarrow as pa


def _heldout(job_dir: Path, n_per_task: int, seed: int, tasks: list[str] | None) -> Path:
    """OUTPUT/heldout.parquet, the job's input. A job's own file is kept: other --n-per-task, --seed or
    --tasks are refused before they overwrite it (a resume would then find its input changed)."""
    import pyarrow.parquet as pq

    from batchinfer.demo.evaluate import heldout_table, write_heldout
    from batchinfer.jobs.commit import PLAN_FILE

    path = job_dir / "heldout.parquet"
    if not (job_dir / PLAN_FILE).exists():
        return write_heldout(path, n_per_task, seed, tasks)
    if not path.is_file():  # writing it there would leave a stray file in another job's folder
        raise PlanMismatchError(
            f"{job_dir}: holds a job that is not an evaluation (no heldout.parquet); use a new --output "
            "directory"
        )
    old, new = pq.read_table(path), heldout_table(n_per_task, seed, tasks)
    if not old.equals(new):
        flags = f"--n-per-task {n_per_task} --seed {seed}" + (f" --tasks {','.join(tasks)}" if tasks else "")
        given = _prompts(new)
        if given == _prompts(old):
            given += " (the same tasks in another --tasks order draw other prompts)"
        raise PlanMismatchError(
            f"{path}: this evaluation job's held-out set is {_prompts(old)}; {flags} gives {given}. "
            "Rerun with the job's own --n-per-task, --seed and --tasks (or without them) to resume, or use a "
            "new --output directory"
        )
    return path


def _resumed(job_dir: Path, given: dict[str, Any]) -> dict[str, Any]:
    """`given` with the options left out (None) taken from the evaluation job in `job_dir`, if there is one
    (its held-out file's arguments, its plan's max_tokens and engine arguments), else the defaults."""
    from batchinfer.demo.evaluate import HELDOUT_SEED, heldout_args
    from batchinfer.jobs.commit import PLAN_FILE
    from batchinfer.jobs.plan import Plan

    saved: dict[str, Any] = {}
    heldout = job_dir / "heldout.parquet"
    if (job_dir / PLAN_FILE).exists() and heldout.is_file():
        plan = Plan.load(job_dir)
        saved = {**heldout_args(heldout), "max_tokens": plan.sampling["max_tokens"]}
        saved["engine_args"] = plan.doc["engine"]["args"]
    defaults = {"n_per_task": N_PER_TASK, "seed": HELDOUT_SEED, "tasks": None, "max_tokens": MAX_TOKENS,
                "engine_args": {}}  # fmt: skip
    return {k: v if v is not None else saved.get(k, defaults[k]) for k, v in given.items()}


def _prompts(table: pa.Table) -> str:
    return f"{table.num_rows} prompts of {', '.join(sorted(set(table.column('task').to_pylist())))}"


@click.command("eval")
@click.option("-m", "--model", required=True, help="Checkpoint folder to evaluate.")
@click.option(
    "-o",
    "--output",
    required=True,
    callback=output_folder,
    help="Job directory for the evaluation run (rerun to resume).",
)
@click.option("--tasks", help="Comma-separated task names [all: add,reverse,sort,count,convert].")
@click.option("--n-per-task", type=click.IntRange(min=1), help=f"Held-out prompts per task [{N_PER_TASK}].")
@click.option("--seed", type=int, help="Seed of the held-out set [1, the published set's].")
@click.option("--max-tokens", type=click.IntRange(min=1), help=f"Most tokens per answer [{MAX_TOKENS}].")
@click.option("--engine-arg", multiple=True, help="KEY=VALUE passed to the engine (e.g. device=cpu).")
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False),
    callback=make_parent,
    help="Also write the figures as JSON.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --json file.")
@click.option("--progress", type=click.Choice(["bar", "json", "none"]), help="Progress display.")
def eval_command(
    model: str,
    output: Path,
    tasks: str | None,
    n_per_task: int | None,
    seed: int | None,
    max_tokens: int | None,
    engine_arg: tuple[str, ...],
    json_out: str | None,
    force: bool,
    progress: str | None,
) -> None:
    """Run held-out task prompts through MODEL as a normal job and report exact match per task.

    The prompts (chat messages, greedy decoding) go to OUTPUT/heldout.parquet, the job runs in OUTPUT
    like `batchinfer run` (resumable: a rerun names --model again and takes the other options it leaves
    out from the job), and the accuracy comes from a DuckDB query over the results joined with the
    expected answers. Prints a table; --json writes the same figures. Error and skipped rows count as
    wrong and are shown as "not answered"; a job with shards still running elsewhere is not scored.
    """
    from batchinfer.cli.run import default_progress, execute
    from batchinfer.demo.evaluate import accuracy
    from batchinfer.demo.tasks import get_task
    from batchinfer.jobs import attempts
    from batchinfer.jobs import plan as plans
    from batchinfer.jobs import tasks as job_tasks
    from batchinfer.jobs.engines import check_args_here, check_model, parse_args
    from batchinfer.jobs.query import check_out
    from batchinfer.jobs.worker import EXIT_STOPPED

    if tasks is not None and not tasks.strip(", "):
        raise click.BadParameter(
            "empty; expected task names (leave --tasks out for all)", param_hint="--tasks"
        )
    try:
        names = [get_task(t.strip()).name for t in tasks.split(",")] if tasks else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tasks") from None
    engine_args = parse_args(engine_arg) if engine_arg else None
    if engine_args is not None:
        check_args_here(plans.DEFAULT_ENGINE, engine_args)  # a mistyped --engine-arg stops before the plan
    job_dir = output.resolve()
    plans.check_job_dir(job_dir)
    job_tasks.get("llm").describe_model(model)  # a bad --model stops before anything is written
    check_model(plans.DEFAULT_ENGINE, model)
    given = {"n_per_task": n_per_task, "seed": seed, "tasks": names, "max_tokens": max_tokens}
    args = _resumed(job_dir, {**given, "engine_args": engine_args})
    n_per_task, seed, names, max_tokens = args["n_per_task"], args["seed"], args["tasks"], args["max_tokens"]
    engine_args = args["engine_args"]
    prompts = _heldout(job_dir, n_per_task, seed, names)
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
        ),
        hint="Rerun with the original arguments to resume, or use a new --output directory",
    )
    if json_out:
        check_out(job_dir, json_out, force)  # never over the job's own files; an existing one needs --force
    code = execute(plan, list(range(plan.num_shards)), progress or default_progress())
    if code:
        raise SystemExit(code)
    running = attempts.incomplete_shards(plan)
    if running:  # another runner holds them: scoring now would count their rows as missing
        click.echo(
            f"{job_dir}: {len(running)} of {plan.num_shards} shard(s) are still being run by another runner; "
            f"not scored, rerun eval once they finish (exit {EXIT_STOPPED})",
            err=True,
        )
        raise SystemExit(EXIT_STOPPED)
    figures = {"model": model, "n_per_task": n_per_task, "seed": seed, **accuracy(job_dir)}
    click.echo(f"{'task':<10} {'rows':>6} {'correct':>8} {'exact match':>12} {'not answered':>13}")
    for task, t in figures["tasks"].items():
        click.echo(
            f"{task:<10} {t['rows']:>6} {t['correct']:>8} {t['exact_match']:>12.3f} {t['not_answered']:>13}"
        )
    click.echo(f"{'mean':<10} {'':>6} {'':>8} {figures['mean_exact_match']:>12.3f}")
    unanswered = sum(t["not_answered"] for t in figures["tasks"].values())
    if unanswered:
        click.echo(
            f"{unanswered} rows ended in error or were skipped and count as wrong; see "
            f"`batchinfer status {job_dir}`",
            err=True,
        )
    if json_out:
        Path(json_out).write_text(json.dumps(figures, indent=2) + "\n")
