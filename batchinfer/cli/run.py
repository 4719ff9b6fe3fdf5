"""`batchinfer run`: plan a job (first run) or resume it (every later run), then work through its shards."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import click

from batchinfer.errors import InputError

PLAN_KEYS = (
    "input",
    "model",
    "shards",
    "chunk_rows",
    "seed",
    "keep_columns",
    "engine",
    "engine_args",
    "sampling",
)


def default_progress() -> str:
    return "bar" if sys.stderr.isatty() else "none"


def execute_on_gpus(plan: Any, gpus: str, shard_ids: list[int], progress_mode: str | None) -> int:
    """`--gpus`: one `batchinfer run` worker a GPU, each given this command's -q / -v and its --shard
    choice; progress as JSON lines when asked, else none (the workers' bars would interleave)."""
    from batchinfer.jobs import local

    devices = local.parse_gpus(gpus)
    extra = ["--progress", "json" if progress_mode == "json" else "none"]
    extra += [a for s in shard_ids for a in ("--shard", str(s))]
    top = click.get_current_context().find_root().params  # batchinfer's own -q / -v
    log_flags = ["-q"] if top.get("quiet") else ["-v"] * top.get("verbose", 0)
    return local.run_on_gpus(plan.job_dir, devices, extra, log_flags)


def execute(plan: Any, shard_ids: list[int], progress_mode: str) -> int:
    """Run `shard_ids` of `plan` in this process; returns the exit code (0 done, 75 stopped by signal)."""
    from batchinfer.jobs import attempts, worker
    from batchinfer.jobs.engines import LazyEngine
    from batchinfer.jobs.progress import Progress

    attempts.reopen_damaged(plan)
    left = set(attempts.incomplete_shards(plan))
    todo = [s for s in shard_ids if s in left]
    if not todo:
        click.echo(
            f"nothing to do: all {len(shard_ids)} selected shard(s) of {plan.job_dir} are done", err=True
        )
        if progress_mode == "json":  # schedulers still get their start and end events
            Progress(progress_mode).close("done")
        return 0
    engine = LazyEngine(plan.doc["engine"]["factory"], plan.doc["model"]["path"], plan.doc["engine"]["args"])
    stop = worker.StopFlag()
    stop.install()
    rows = sum(attempts.pending_rows(plan, s) for s in todo)
    unit = "image" if plan.doc["task"] == "image" else "row"
    progress = Progress(progress_mode, rows_total=rows, shards=len(todo), row_unit=unit)
    status = "error"
    try:
        results = worker.run_shards(plan, todo, engine, stop=stop, progress=progress)
        left = set(attempts.incomplete_shards(plan))
        remaining = [s for s in todo if s in left]
        # a stop after the last chunk committed leaves nothing to requeue: done, exit 0
        status = "stopped" if stop and remaining else "done"
    finally:
        progress.close(status)
    locked = [r.shard for r in results if r.status == "locked"]
    done_rows = sum(r.rows for r in results)
    click.echo(
        f"{done_rows} rows processed in {sum(r.chunks for r in results)} chunks "
        f"({sum(r.errors for r in results)} errors, {sum(r.skipped for r in results)} skipped)",
        err=True,
    )
    if locked:
        click.echo(
            f"{len(locked)} shard(s) are being worked on by other runners (first: {locked[0]:05d})", err=True
        )
    if status == "stopped":
        by = f"by {signal.Signals(stop.signum).name}" if stop.signum else "on request"
        click.echo(f"stopped {by}; rerun to continue (exit {worker.EXIT_STOPPED})", err=True)
        return worker.EXIT_STOPPED
    if not remaining:
        click.echo(f"all selected shards of {plan.job_dir} are done", err=True)
    return 0


def _merge(spec_file: str | None, flags: dict[str, Any]) -> dict[str, Any]:
    from batchinfer.jobs.spec import load_spec

    merged = load_spec(spec_file) if spec_file else {}
    sampling = dict(merged.get("sampling", {}))
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stop", "ignore_eos"):
        value = flags.pop(key)
        if value not in (None, ()):
            sampling[key] = list(value) if key == "stop" else value
    if sampling:
        merged["sampling"] = sampling
    for key, value in flags.items():
        if value not in (None, ()):
            # --engine-arg KEY=VALUE overrides that key of the spec's [engine_args], as flags do [sampling]'s
            merged[key] = {**merged.get(key, {}), **value} if key == "engine_args" else value
    return merged


@click.command("run")
@click.argument("spec_file", required=False, type=click.Path(dir_okay=False))
@click.option(
    "-i", "--input", "input", multiple=True, help="Input Parquet file, folder or glob (repeatable)."
)
@click.option("-o", "--output", help="Job directory: plan, results, markers, logs.")
@click.option("-m", "--model", help="Checkpoint folder (with config.json).")
@click.option("--max-tokens", type=int, help="Most tokens to generate per row [256].")
@click.option("--temperature", type=float, help="Sampling temperature; 0 = greedy [0].")
@click.option("--top-p", type=float, help="Nucleus sampling cut [1.0].")
@click.option("--top-k", type=int, help="Top-k cut; 0 = none [0].")
@click.option("--stop", multiple=True, help="Stop string (repeatable), besides the model's EOS.")
@click.option("--ignore-eos/--no-ignore-eos", default=None, help="Always generate max_tokens (benchmarks).")
@click.option("--seed", type=int, help="Job seed; each row's seed derives from (seed, id) [0].")
@click.option(
    "--shards", type=click.IntRange(min=1), help="Number of shards (row ranges) [one per 100,000 rows]."
)
@click.option("--shard", "shard_ids", type=int, multiple=True, help="Work only on this shard (repeatable).")
@click.option("--chunk-rows", type=click.IntRange(min=1), help="Rows per committed chunk file [1000].")
@click.option("--keep-columns", help="Comma-separated input columns to copy to the output.")
@click.option("--engine", help="Engine factory MODULE:FUNCTION [batchinfer.engine.loader:load_engine].")
@click.option("--engine-arg", "engine_arg", multiple=True, help="KEY=VALUE passed to the engine factory.")
@click.option("--progress", type=click.Choice(["bar", "json", "none"]), help="bar (tty default), json, none.")
@click.option("--force-new-plan", is_flag=True, help="Set the existing plan and results aside; start over.")
@click.option("--gpus", help="One worker process per GPU, sharing the shards: all, a count (4) or ids (0,2).")
@click.option(
    "--plan-only", is_flag=True, help="Validate inputs, write plan.json and stop (e.g. before Slurm)."
)
def run_command(
    spec_file: str | None,
    shard_ids: tuple[int, ...],
    force_new_plan: bool,
    plan_only: bool,
    gpus: str | None,
    **flags: Any,
) -> None:
    """Run a job: Parquet in, resumable sharded results out.

    The first run validates the inputs and writes DIR/plan.json; rerunning the same command (or just
    `batchinfer run --output DIR`) resumes after the last committed chunk. SPEC_FILE is an optional TOML
    or JSON job spec with the same fields (flags override it). SIGUSR2/SIGTERM: finish and commit the
    chunk in flight, then exit 75 so a scheduler can requeue.
    """
    from batchinfer.jobs import plan as plans
    from batchinfer.jobs.commit import PLAN_FILE
    from batchinfer.jobs.engines import parse_args

    flags["engine_args"] = parse_args(flags.pop("engine_arg")) or None
    keep = flags.pop("keep_columns")
    flags["keep_columns"] = [c.strip() for c in keep.split(",") if c.strip()] if keep else None
    args = _merge(spec_file, flags)
    progress_mode = args.pop("progress", None)
    if not args.get("output"):
        raise click.UsageError("--output DIR is required (or `output` in the job spec)")
    job_dir = Path(args["output"]).resolve()
    here = not plan_only and gpus is None  # the engine starts in this process: its arguments fit this machine
    if (job_dir / PLAN_FILE).exists() and not force_new_plan:
        plan = plans.Plan.load(job_dir)
        given = [k for k in PLAN_KEYS if k in args]
        if given and plan.doc["task"] == "image":  # run's flags describe a text job
            raise InputError(
                f"{job_dir / PLAN_FILE}: an image job; resume it with `batchinfer run --output {job_dir}` "
                f"alone, or change it with `batchinfer segment --output {job_dir} ...` (got "
                f"{', '.join(given)})"
            )
        if given:
            plan = plans.open_or_create(_build(job_dir, args, plan.doc, check_rows=False, here=here))
        plans.verify_inputs(plan)
    else:
        missing = [k for k in ("input", "model") if not args.get(k)]
        if missing:
            why = (
                "--force-new-plan starts a new job, which"
                if force_new_plan
                else "no plan.json yet, so a new job"
            )
            raise InputError(f"{job_dir}: {why} needs " + " and ".join(f"--{m}" for m in missing))
        candidate = _build(job_dir, args, None, check_rows=True, here=here)  # bad inputs stop here
        if force_new_plan:
            plans.set_aside(job_dir)
        plan = plans.open_or_create(candidate)
    for s in shard_ids:
        plan.shard_range(s)
    if plan_only:
        click.echo(
            f"plan {plan.plan_id}: {plan.doc['total_rows']} rows in {plan.num_shards} shards, "
            f"{len(plan.inputs)} input files -> {plan.job_dir}",
            err=True,
        )
        return
    if gpus is not None:
        sys.exit(execute_on_gpus(plan, gpus, list(shard_ids), progress_mode))
    code = execute(plan, list(shard_ids) or list(range(plan.num_shards)), progress_mode or default_progress())
    sys.exit(code)


def _build(
    job_dir: Path, args: dict[str, Any], old: dict[str, Any] | None, check_rows: bool, here: bool
) -> Any:
    """The plan `args` describe; unspecified fields come from the existing plan `old` (or defaults)."""
    from batchinfer.engine.api import SamplingParams
    from batchinfer.jobs import plan as plans
    from batchinfer.jobs.engines import check_args, check_args_here, check_model

    def pick(key: str, default: Any) -> Any:
        return args[key] if key in args else (default if old is None else old[key])

    base_sampling = _sampling_dict(SamplingParams()) if old is None else old["sampling"]
    engine = args.get("engine") or (old["engine"]["factory"] if old else plans.DEFAULT_ENGINE)
    engine_args = args["engine_args"] if "engine_args" in args else (old["engine"]["args"] if old else {})
    (check_args_here if here else check_args)(engine, engine_args)  # here: this run starts now
    plan = plans.build_plan(
        job_dir,
        args.get("input") or [f["path"] for f in plans.absolute_inputs(old, job_dir)["inputs"]],
        args.get("model") or old["model"]["path"],
        {**base_sampling, **args.get("sampling", {})},
        seed=pick("seed", 0),
        num_shards=args.get("shards") or (len(old["shards"]) if old else None),
        chunk_rows=pick("chunk_rows", plans.DEFAULT_CHUNK_ROWS),
        keep_columns=pick("keep_columns", []),
        engine=engine,
        engine_args=engine_args,
        check_rows=check_rows,
    )
    check_model(engine, plan.doc["model"]["path"])  # after the plan's own model checks, before it is saved
    return plan


def _sampling_dict(p: Any) -> dict[str, Any]:
    return {k: getattr(p, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "stop", "ignore_eos")}
