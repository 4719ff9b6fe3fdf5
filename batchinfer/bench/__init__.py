"""Benchmarks: kernel microbenchmarks and end-to-end workloads."""

import os
import subprocess
from pathlib import Path


def commit_id() -> str:
    """The commit a recorded figure ran: BATCHINFER_COMMIT when set (a copy of the tree whose `.git` is
    absent or stale, as on the device machine), else `git rev-parse`, else "unknown"."""
    commit = os.environ.get("BATCHINFER_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
                cwd=Path(__file__).parent,  # the package's tree, wherever the command runs
            ).stdout.strip()
        except OSError:
            commit = ""
    return commit or "unknown"
