"""`batchinfer bench`: benchmarks. `bench kernels` times our Triton kernels on this GPU."""

from __future__ import annotations

import json

import click


@click.group()
def bench() -> None:
    """Benchmarks (kernel microbenchmarks; needs a CUDA GPU)."""


@bench.command("kernels")
@click.option(
    "--model",
    type=click.Choice(["qwen3.6", "qwen3-30b", "all"]),
    default="all",
    show_default=True,
    help="Which model's shapes to time.",
)
@click.option("--op", "ops", multiple=True, help="Only these kernels (repeatable), e.g. --op nvfp4_gemm.")
@click.option(
    "--m", "ms", multiple=True, type=int, help="Token counts (repeatable) [default: 1 8 32 128 512 4096]."
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, writable=True),
    help="Also write the environment and every result row to this JSON file.",
)
def kernels(model: str, ops: tuple[str, ...], ms: tuple[int, ...], json_out: str | None) -> None:
    """Time every kernel at the real shapes of the model(s) against PyTorch baselines and measured
    ceilings (copy bandwidth, cuBLAS bf16 GEMM); prints a markdown table."""
    import torch

    from batchinfer.bench.kernels import M_VALUES, collect_cases, environment, format_table, run_cases

    if not torch.cuda.is_available():
        raise click.ClickException("bench kernels needs a CUDA GPU; none is visible to PyTorch")
    models = ["qwen3.6", "qwen3-30b"] if model == "all" else [model]
    cases = [c for c in collect_cases(models, ms or M_VALUES) if not ops or c.op in ops]
    if not cases:
        raise click.ClickException(f"no benchmark case matches --op {' '.join(ops)}")
    env = environment()
    click.echo(" ".join(f"{k}={v}" for k, v in env.items()), err=True)
    rows = []
    for row in run_cases(cases, torch.device("cuda")):
        rows.append(row)
        if row["op"] != "ceilings":
            click.echo(format_table([row]).splitlines()[-1], err=True)
        if json_out:  # rewritten after every case, so an interrupted run keeps what it measured
            with open(json_out, "w") as f:
                json.dump({"environment": env, "rows": rows}, f, indent=1)
    click.echo(format_table(rows))
