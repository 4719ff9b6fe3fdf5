"""`python -m batchinfer`: the command line without its console script (workers started by `--gpus` and
Slurm fall back to this where the `batchinfer` script is not installed, e.g. a source checkout on
PYTHONPATH)."""

from batchinfer.cli import main

main(prog_name="batchinfer")
