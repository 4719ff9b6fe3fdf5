"""The `batchinfer` command line. Subcommands are imported lazily so `--help` stays fast."""

from __future__ import annotations

import importlib
import logging
import sys

import click

from batchinfer import __version__
from batchinfer.errors import BatchinferError

# command name -> "module:function"; the module is imported only when the command runs.
COMMANDS: dict[str, str] = {
    "eval": "batchinfer.cli.eval:eval_command",
    "slurm": "batchinfer.cli.slurm:slurm_command",
    "run": "batchinfer.cli.run:run_command",
    "segment": "batchinfer.cli.segment:segment_command",
    "status": "batchinfer.cli.status:status_command",
    "query": "batchinfer.cli.query:query_command",
    "export": "batchinfer.cli.export:export_command",
    "bench": "batchinfer.cli.bench:bench",
    "retry-errors": "batchinfer.cli.retry_errors:retry_errors_command",
    "make-checkpoint": "batchinfer.cli.make_checkpoint:make_checkpoint_command",
    "quantize": "batchinfer.cli.quantize:quantize_command",
    "generate": "batchinfer.cli.generate:generate",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchinfer")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors on stderr.")
def cli(verbose: int, quiet: bool) -> None:
    """Offline batch inference for Qwen MoE models: Parquet in, resumable sharded jobs, Parquet out."""
    level = logging.WARNING if quiet else (logging.DEBUG if verbose > 1 else logging.INFO)
    root = logging.getLogger()
    if root.handlers:  # configured already (as logging.basicConfig, the first call decides)
        return
    # -q and -v set what stderr shows; batchinfer's own loggers still pass INFO on, so the per-shard
    # log files (DIR/logs/shard-NNNNN.log, jobs.worker) keep their lines under -q too.
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(level)
    stderr.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(stderr)
    root.setLevel(level)
    logging.getLogger("batchinfer").setLevel(min(level, logging.INFO))


def main(prog_name: str | None = None) -> None:
    """The console script's entry; `python -m batchinfer` passes its own name for click's usage lines."""
    try:
        cli(standalone_mode=False, prog_name=prog_name)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except BatchinferError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
