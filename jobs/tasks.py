"""The task seam: what differs between a text-generation job (`llm`) and a segmentation job (`image`).

Plans, shards, chunk commits, resume, locks, Slurm, status, query and export are shared; a `Task`
supplies the rest: the input and output schemas, the plan-time checks of parameters, model and rows,
the chunk's work (input rows -> engine -> output rows), the output metadata, and the SQL that tells
status, export and retry-errors what one input row's outcome is (an image job writes several output
rows per input row). `plan.json` names its task; `get(name)` imports the task's module lazily, so the
text path never imports Pillow and the image path never imports the tokenizer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from batchinfer.errors import InputError

if TYPE_CHECKING:
    from batchinfer.jobs.inputs import InputFile
    from batchinfer.jobs.plan import Plan
    from batchinfer.jobs.progress import Progress

REGISTRY = {
    "llm": "batchinfer.jobs.requests:LLM_TASK",
    "image": "batchinfer.images.task:IMAGE_TASK",
}


@dataclass(slots=True)
class Chunk:
    """One chunk's work order: its input rows (`table`, the task's `read_columns`) and where it goes."""

    plan: Plan
    engine: Any
    table: pa.Table
    rows: np.ndarray  # global input row indices, ascending
    attempt: int
    shard: int
    schema: pa.Schema  # the output schema (task output + kept columns)
    progress: Progress | None


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    input_schema: str  # schema names in schemas/
    output_schema: str
    # job parameters (plan "sampling"): raise InputError when invalid
    check_params: Callable[[dict[str, Any]], None]
    # plan "model": {path, config_hash, model_type} of a checkpoint path (may be "" where the task allows)
    describe_model: Callable[[str], dict[str, str]]
    # job-level row checks before any work (ids, required values); raise InputError
    check_rows: Callable[[Sequence[InputFile], pa.DataType], None]
    read_columns: Callable[[Sequence[str]], list[str]]
    # the chunk's output table and its counts: errors, skipped, prompt_tokens, output_tokens (+ extras,
    # such as the image task's instances and seconds inside the engine)
    process: Callable[[Chunk], tuple[pa.Table, dict[str, float]]]
    # key-value metadata on every output file, besides the shared keys
    metadata: Callable[[Plan], dict[str, str]]
    outcome_sql: str  # SQL expression: an output row's outcome (error and skipped are retried)
    rows_sql: str  # SQL aggregate counting input rows among output rows
    order_sql: str  # ORDER BY of export

    def output_arrow(self, id_type: pa.DataType, keep: Sequence[pa.Field]) -> pa.Schema:
        from batchinfer.schemas import loader

        base = loader.load(self.output_schema).to_arrow({"id": id_type})
        for f in keep:
            base = base.append(f)
        return base


def get(name: str) -> Task:
    """The task called `name` (`llm`, `image`)."""
    if name not in REGISTRY:
        raise InputError(f"unknown task {name!r}; known tasks: {', '.join(REGISTRY)}")
    module, attr = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), attr)
