"""`batchinfer slurm DIR`: write (and submit) the Slurm array script that runs a planned job."""

from __future__ import annotations

from pathlib import Path

import click

from batchinfer.errors import InputError
from batchinfer.jobs import attempts, slurm
from batchinfer.jobs.plan import Plan

# option name -> SlurmOptions field; given flags override the options saved by the last call.
_OPTION_FIELDS = (
    "partition",
    "time",
    "account",
    "qos",
    "gpus_per_task",
    "cpus_per_task",
    "mem",
    "max_running",
    "signal_seconds",
    "job_name",
    "setup",
    "sbatch_args",
)


@click.command(short_help="Write and submit a Slurm array script for a job.")
@click.argument("job_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--submit", is_flag=True, help="Call sbatch (otherwise only write the script and print the commands)."
)
@click.option(
    "--retry",
    is_flag=True,
    help="Submit only the shards that are not done and not queued or running in Slurm (implies --submit).",
)
@click.option("--partition", help="sbatch --partition.")
@click.option("--time", help="sbatch --time, e.g. 4:00:00 (the worker is warned --signal-seconds before).")
@click.option("--account", help="sbatch --account.")
@click.option("--qos", help="sbatch --qos.")
@click.option(
    "--gpus-per-task", type=int, help="GPUs per array task (--gres=gpu:N; 0 for none). [default: 1]"
)
@click.option("--cpus-per-task", type=int, help="sbatch --cpus-per-task.")
@click.option("--mem", help="sbatch --mem, e.g. 64G.")
@click.option("--max-running", type=int, help="At most this many array tasks at once (sbatch --array=...%N).")
@click.option(
    "--signal-seconds",
    type=int,
    help="Send USR2 this many seconds before the time limit; more than one chunk takes. [default: 300]",
)
@click.option("--job-name", help="sbatch --job-name. [default: batchinfer-<DIR name>]")
@click.option(
    "--setup", help="Shell commands run before the worker, e.g. 'module load cuda; source venv/bin/activate'."
)
@click.option(
    "--sbatch-arg",
    "sbatch_args",
    multiple=True,
    help="Any other sbatch option, repeatable, e.g. --sbatch-arg=--constraint=h200.",
)
@click.pass_context
def slurm_command(ctx: click.Context, job_dir: Path, submit: bool, retry: bool, **given: object) -> None:
    """Write DIR/slurm/batchinfer.sbatch: a job array with one task per shard that is not done yet.

    Each task runs `batchinfer run --output DIR --shard N`, resumes after the last committed chunk, and
    before its time limit stops at a chunk boundary and requeues itself. Options are saved in
    DIR/slurm/options.json and reused by later calls (e.g. `--retry`) unless given again.
    """
    plan = Plan.load(job_dir)
    job_dir = plan.job_dir
    saved = slurm.SlurmOptions.load(job_dir)
    for name in _OPTION_FIELDS:
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            value = given[name]
            setattr(saved, name, list(value) if name == "sbatch_args" else value)
    opts = slurm.SlurmOptions(**{name: getattr(saved, name) for name in _OPTION_FIELDS})
    opts.check_signal()

    if submit or retry:  # a damaged chunk's shard is submitted again
        attempts.reopen_damaged(plan)
    todo = attempts.incomplete_shards(plan)
    if not todo:
        click.echo(f"all {plan.num_shards} shards of {job_dir} are done; nothing to submit")
        return
    active = slurm.active_shards(job_dir) if (submit or retry) else {}
    if retry:
        todo = [s for s in todo if s not in active]
        if not todo:
            click.echo(
                f"all {len(active)} unfinished shards are queued or running in Slurm; nothing to resubmit"
            )
            return
    elif submit and active:
        raise InputError(
            f"{job_dir}: {len(active)} shards of earlier submissions are still queued or running "
            f"(e.g. shard {min(active)}: {active[min(active)]}); use --retry to submit only the others"
        )

    max_array = slurm.max_array_size()
    groups = slurm.array_groups(todo, max_array)
    text = slurm.render(job_dir, plan.plan_id, plan.num_shards, groups, opts, max_array)
    script = slurm.write_script(job_dir, text)
    opts.save(job_dir)
    click.echo(f"wrote {script} for {len(todo)} of {plan.num_shards} shards ({slurm.compress(todo)})")
    if not (submit or retry):
        click.echo("submit with:")
        for command in slurm.manual_commands(script, groups, opts):
            click.echo("  " + command)
        return
    for job_id, group in zip(slurm.submit(job_dir, script, groups, opts), groups, strict=True):
        click.echo(f"submitted array job {job_id}: shards {slurm.compress(group.shards)}")
    click.echo(f"logs: {job_dir / slurm.SLURM_DIR / 'logs'}; progress: batchinfer status {job_dir}")
