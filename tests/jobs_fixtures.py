"""Shared helpers of the tests/test_jobs_*: a model folder with a config.json, input Parquet files with
known good and bad rows, and the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ECHO = "batchinfer.jobs.echo:EchoEngine"
BATCHINFER = str(Path(sys.executable).with_name("batchinfer"))

TINY_CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


def model_dir(tmp: Path) -> Path:
    d = tmp / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return d


def write_inputs(tmp: Path, files: int = 3, rows: int = 20, bad: bool = True) -> list[Path]:
    """`files` Parquet files of `rows` rows each, ids 0.. in order. With `bad`, each file has an invalid
    per-row max_tokens (row 1), an empty prompt (row 2), an over-long prompt (row 3) and an engine failure
    (row 4): rows that become output rows, not job-level errors."""
    paths = []
    d = tmp / "in"
    d.mkdir(exist_ok=True)
    for f in range(files):
        ids = list(range(f * rows, (f + 1) * rows))
        prompts = [f"row {i} says hello to the world {i % 7}" for i in ids]
        max_tokens: list[int | None] = [None] * rows
        if bad and rows >= 5:
            max_tokens[1] = 0
            prompts[2] = ""
            prompts[3] = "word " * 3000
            prompts[4] = "please FAIL here"
        table = pa.table(
            {"id": ids, "prompt": prompts, "topic": [f"t{i % 3}" for i in ids], "max_tokens": max_tokens},
            schema=pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("topic", pa.string()),
                              ("max_tokens", pa.int64())]),
        )  # fmt: skip
        path = d / f"part-{f}.parquet"
        pq.write_table(table, path, row_group_size=7)
        paths.append(path)
    return paths


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BATCHINFER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def echo_args(tmp: Path, out: Path, *extra: str) -> list[str]:
    """`run` arguments for a job over tmp/in with the echo engine failing rows that contain FAIL."""
    return [
        "run", "--input", str(tmp / "in"), "--output", str(out), "--model", str(tmp / "model"),
        "--engine", ECHO, "--engine-arg", "fail_marker=FAIL", "--progress", "none", *extra,
    ]  # fmt: skip
