"""`batchinfer segment`: plan (first run) or resume an image segmentation job, then work through its shards.

A command of its own rather than flags on `run`: its inputs (image folders and globs besides Parquet),
its parameters (prompts, score threshold) and its default engine differ, and none of run's sampling
flags apply. The plan it writes has task `image`; everything after planning is the shared job layer,
so `batchinfer run --output DIR` (cron, Slurm array tasks, `--gpus` workers), status, query, export and
retry-errors work on image jobs unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from batchinfer.errors import InputError, PlanMismatchError

DEFAULT_IMAGE_ENGINE = "batchinfer.images.sam3_engine:load_engine"


@click.command("segment")
@click.option(
    "-i",
    "--input",
    "inputs",
    multiple=True,
    help="Image folder, image glob, image file, or image_input Parquet file/folder/glob (repeatable).",
)
@click.option("-o", "--output", required=True, help="Job directory: plan, results, markers, logs.")
@click.option(
    "-m",
    "--model",
    help="Checkpoint file (sam3.pt or .safetensors) of the default SAM 3 engine, or what --engine takes.",
)
@click.option(
    "-p",
    "--prompt",
    "prompts",
    multiple=True,
    help="Text prompt to segment (repeatable); for folder/glob inputs, and Parquet rows whose prompts "
    "are null or empty (the column itself is required).",
)
@click.option("--score-threshold", type=float, help="Keep instances with score above this [0.5].")
@click.option(
    "--shards", type=click.IntRange(min=1), help="Number of shards (row ranges) [one per 100,000 images]."
)
@click.option("--shard", "shard_ids", type=int, multiple=True, help="Work only on this shard (repeatable).")
@click.option("--chunk-rows", type=click.IntRange(min=1), help="Images per committed chunk file [256].")
@click.option("--keep-columns", help="Comma-separated Parquet input columns to copy to every output row.")
@click.option("--engine", help=f"Engine factory MODULE:FUNCTION [{DEFAULT_IMAGE_ENGINE}].")
@click.option("--engine-arg", "engine_args", multiple=True, help="KEY=VALUE passed to the engine factory.")
@click.option("--progress", type=click.Choice(["bar", "json", "none"]), help="bar (tty default), json, none.")
@click.option("--force-new-plan", is_flag=True, help="Set the existing plan and results aside; start over.")
@click.option("--gpus", help="One worker process per GPU, sharing the shards: all, a count (4) or ids (0,2).")
@click.option("--plan-only", is_flag=True, help="Validate inputs, write plan.json and stop.")
def segment_command(
    output: str,
    shard_ids: tuple[int, ...],
    force_new_plan: bool,
    plan_only: bool,
    gpus: str | None,
    progress: str | None,
    **flags: Any,
) -> None:  # fmt: skip
    """Segment every image for every prompt: masks, boxes and scores to Parquet, one row per instance.

    The first run lists the images (folders and globs become DIR/inputs/images-*.parquet) and writes
    DIR/plan.json; rerunning the same command, or `batchinfer run --output DIR`, resumes after the last
    committed chunk. Unreadable images become error rows; an (image, prompt) pair without detections
    gets one row with instance null. SIGUSR2/SIGTERM: commit the chunk in flight, exit 75.
    """
    from batchinfer.cli.run import default_progress, execute, execute_on_gpus
    from batchinfer.images import sources
    from batchinfer.jobs import plan as plans
    from batchinfer.jobs.commit import PLAN_FILE

    job_dir = Path(output).resolve()
    plans.check_job_dir(job_dir)  # before the image listing is written there
    here = not plan_only and gpus is None  # the engine starts in this process: its arguments fit this machine
    given = {k: v for k, v in flags.items() if v not in (None, ())}
    if (job_dir / PLAN_FILE).exists() and not force_new_plan:
        plan = plans.Plan.load(job_dir)
        if plan.doc["task"] != "image":
            raise InputError(
                f"{job_dir / PLAN_FILE}: a {plan.doc['task']!r} job, not an image job; resume it with "
                f"`batchinfer run --output {job_dir}`"
            )
        if given:
            candidate = _build(job_dir, given, plan.doc, check_rows=False, here=here)
            try:
                plan = plans.open_or_create(candidate, explain=sources.listing_changes)
            except PlanMismatchError:
                sources.remove_new_manifests(candidate, plan)
                raise
        plans.verify_inputs(plan)
    else:
        if not given.get("inputs"):
            raise InputError(f"{job_dir}: a new image job needs --input")
        from batchinfer.jobs.engines import check_model

        # else a plan that cannot run, and --model later changes it
        check_model(given.get("engine") or DEFAULT_IMAGE_ENGINE, given.get("model", ""))
        candidate = _build(job_dir, given, None, check_rows=True, here=here)
        if force_new_plan:
            plans.set_aside(job_dir)
        plan = plans.open_or_create(candidate)
    for s in shard_ids:
        plan.shard_range(s)
    if plan_only:
        click.echo(f"plan {plan.plan_id}: {plan.doc['total_rows']} images in {plan.num_shards} shards "
                   f"-> {plan.job_dir}", err=True)  # fmt: skip
        return
    if gpus is not None:
        sys.exit(execute_on_gpus(plan, gpus, list(shard_ids), progress))
    sys.exit(execute(plan, list(shard_ids) or list(range(plan.num_shards)), progress or default_progress()))


def _build(
    job_dir: Path, args: dict[str, Any], old: dict[str, Any] | None, check_rows: bool, here: bool
) -> Any:
    """The image plan `args` describe; unspecified fields come from the existing plan `old` (or defaults)."""
    from batchinfer.images import sources
    from batchinfer.images.task import DEFAULT_CHUNK_ROWS, DEFAULT_SCORE_THRESHOLD, clean_prompts
    from batchinfer.jobs import plan as plans
    from batchinfer.jobs.engines import check_args, check_args_here, parse_args

    params = dict(old["sampling"]) if old else {"score_threshold": DEFAULT_SCORE_THRESHOLD, "prompts": []}
    if "prompts" in args:
        params["prompts"] = clean_prompts(args["prompts"])
    if "score_threshold" in args:
        params["score_threshold"] = args["score_threshold"]
    engine = args.get("engine") or (old["engine"]["factory"] if old else DEFAULT_IMAGE_ENGINE)
    engine_args = (
        parse_args(args["engine_args"]) if "engine_args" in args else (old["engine"]["args"] if old else {})
    )
    (check_args_here if here else check_args)(engine, engine_args)  # here: this run starts now
    keep = args.get("keep_columns")
    if "inputs" in args:
        patterns, images = sources.split_inputs(args["inputs"])
        if images and keep:
            raise InputError(
                f"--keep-columns {keep!r}: applies to Parquet inputs only; image files, folders and globs "
                f"(here {images[0][1]}) have no columns to keep"
            )
        if images:
            patterns.append(str(sources.write_manifest(job_dir, images, params["prompts"])))
    else:
        patterns = [f["path"] for f in plans.absolute_inputs(old, job_dir)["inputs"]]
    return plans.build_plan(
        job_dir,
        patterns,
        args["model"] if "model" in args else (old["model"]["path"] if old else ""),
        params,
        num_shards=args.get("shards", len(old["shards"]) if old else None),
        chunk_rows=args.get("chunk_rows", old["chunk_rows"] if old else DEFAULT_CHUNK_ROWS),
        keep_columns=_columns(keep) if keep else (old["keep_columns"] if old else []),
        engine=engine,
        engine_args=engine_args,
        check_rows=check_rows,
        task="image",
    )  # fmt: skip


def _columns(text: str) -> list[str]:
    return [c.strip() for c in text.split(",") if c.strip()]
