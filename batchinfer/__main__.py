"""`python -m batchinfer`: the command line without its console script."""

from batchinfer.cli import main

if __name__ == "__main__":
    main(prog_name="batchinfer")
