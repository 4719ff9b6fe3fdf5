"""Input rows -> engine requests, engine results -> output rows.

Row-level problems become error rows here instead of exceptions: a malformed message list, invalid
per-row sampling values. Empty and over-long prompts are the engine's to judge (it owns the tokenizer
and the context length) and come back `skipped`. A row with neither or both of prompt / messages is
refused while planning (`jobs.inputs.check_rows`); it becomes an error row here only in jobs planned
before that check existed, rather than reaching the engine as a request with nothing to generate from.
Seeds: a row's own `seed`, else `derive_seed(job seed, id)`, so a resumed or re-sharded job samples
the same row the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from batchinfer.jobs import inputs
from batchinfer.jobs.tasks import Chunk, Task
from batchinfer.schemas import loader

from batchinfer.engine.api import FINISH_REASONS, SamplingParams, TextRequest, TextResult
from batchinfer.errors import InputError
from batchinfer.tokenizer import CHAT_ROLES, unknown_role

if TYPE_CHECKING:
    from batchinfer.jobs.plan import Plan

SAMPLING_COLUMNS = ("max_tokens", "temperature", "top_p", "top_k", "stop")
INPUT_COLUMNS = ("id", "prompt", "messages", *SAMPLING_COLUMNS, "seed")
SEED_MASK = (1 << 63) - 1


def derive_seed(job_seed: int, row_id: int | str) -> int:
    """Stable 63-bit seed from (job seed, row id); ids 7 and "7" get different seeds."""
    kind = "i" if isinstance(row_id, int) else "s"
    digest = hashlib.sha256(f"{job_seed}\x00{kind}\x00{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & SEED_MASK


def read_columns(keep_columns: Sequence[str]) -> list[str]:
    return list(dict.fromkeys([*INPUT_COLUMNS, *keep_columns]))


def _check_messages(messages: Any) -> str | None:
    """Why a message list is malformed, or None if it is well formed."""
    if len(messages) == 0:
        return "messages is an empty list"
    for i, m in enumerate(messages):
        if m is None:
            return f"messages[{i}] is null"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                return f"messages[{i}].{key} is null; expected a string"
        if m["role"] not in CHAT_ROLES:
            return unknown_role(i, m["role"])
    return None


def build_requests(
    columns: dict[str, list[Any]], job_sampling: dict[str, Any], job_seed: int
) -> tuple[list[TextRequest], list[TextResult], list[int]]:
    """Requests for the valid rows, error results for the invalid ones, and every row's seed.

    `columns` holds the chunk's INPUT_COLUMNS as Python lists; request/result `index` is the row's
    position in the chunk.
    """
    n = len(columns["id"])
    requests: list[TextRequest] = []
    errors: list[TextResult] = []
    seeds: list[int] = []
    for i in range(n):
        row_id = columns["id"][i]
        seed = columns["seed"][i]
        seed = derive_seed(job_seed, row_id) if seed is None else int(seed) & SEED_MASK
        seeds.append(seed)
        prompt, messages = columns["prompt"][i], columns["messages"][i]
        problem = None
        if prompt is None and messages is None:
            problem = "prompt is null; each row needs a non-null prompt or messages"
        elif prompt is not None and messages is not None:
            problem = "prompt and messages are both set; give exactly one per row"
        elif messages is not None:
            problem = _check_messages(messages)
            messages = (
                [{k: v for k, v in m.items() if v is not None} for m in messages] if not problem else None
            )
        params = {**job_sampling, "seed": seed}
        for key in SAMPLING_COLUMNS:
            if columns[key][i] is not None:
                value = columns[key][i]
                params[key] = (
                    [x for x in value if x] if key == "stop" else value
                )  # null/"" stops mean nothing
        if problem is None:
            try:
                sampling = SamplingParams(**params)
            except (TypeError, ValueError) as e:
                problem = f"invalid sampling parameters: {e}"
        if problem is not None:
            errors.append(
                TextResult(
                    index=i, text="", finish_reason="error", prompt_tokens=0, output_tokens=0, error=problem
                )
            )
            continue
        requests.append(TextRequest(index=i, prompt=prompt, messages=messages, sampling=sampling))
    return requests, errors, seeds


def collect(results: Iterable[TextResult], expected: set[int]) -> dict[int, TextResult]:
    """Gather an engine's results, insisting on exactly one valid result per request (else it is a bug)."""
    got: dict[int, TextResult] = {}
    for r in results:
        if r.index not in expected:
            raise RuntimeError(f"engine returned a result for unknown request index {r.index}")
        if r.index in got:
            raise RuntimeError(f"engine returned two results for request index {r.index}")
        if r.finish_reason not in FINISH_REASONS:
            raise RuntimeError(
                f"engine returned finish_reason {r.finish_reason!r}; expected one of {FINISH_REASONS}"
            )
        got[r.index] = r
    missing = expected - got.keys()
    if missing:
        raise RuntimeError(
            f"engine returned no result for {len(missing)} request(s), e.g. index {min(missing)}"
        )
    return got


def output_schema(id_type: pa.DataType, keep: Sequence[pa.Field]) -> pa.Schema:
    base = loader.load("llm_output").to_arrow({"id": id_type})
    for f in keep:
        base = base.append(f)
    return base


def output_table(
    schema: pa.Schema,
    ids: list[Any],
    rows: Sequence[int],
    results: dict[int, TextResult],
    seeds: list[int],
    attempt: int,
    shard: int,
    keep: pa.Table,
) -> pa.Table:
    """The chunk's output rows, in input order, with the carried columns appended."""
    order = range(len(ids))
    res = [results[i] for i in order]
    failed = [r.finish_reason in ("error", "skipped") for r in res]
    data = {
        "id": ids,
        "row": list(rows),
        "text": [None if bad and not r.text else r.text for r, bad in zip(res, failed, strict=True)],
        "finish_reason": [r.finish_reason for r in res],
        "prompt_tokens": [r.prompt_tokens for r in res],
        "output_tokens": [r.output_tokens for r in res],
        "error": [
            r.error if r.error or not bad else r.finish_reason for r, bad in zip(res, failed, strict=True)
        ],
        "attempt": [attempt] * len(ids),
        "shard": [shard] * len(ids),
        "seed": seeds,
    }
    arrays = [pa.array(data[f.name], type=f.type) for f in schema if f.name in data]
    arrays += [keep.column(f.name).cast(f.type) for f in schema if f.name not in data]
    return pa.Table.from_arrays(arrays, schema=schema)


def process_chunk(chunk: Chunk) -> tuple[pa.Table, dict[str, int]]:
    """The text task's chunk: build requests, one `generate` call, output rows in input order."""
    cols = {c: chunk.table.column(c).to_pylist() for c in INPUT_COLUMNS}
    ids = cols["id"]
    reqs, results_err, seeds = build_requests(cols, chunk.plan.sampling, chunk.plan.seed)
    results = {r.index: r for r in results_err}
    if reqs:
        on_tokens = chunk.progress.tokens if chunk.progress else None
        results.update(collect(chunk.engine.generate(reqs, on_tokens), {r.index for r in reqs}))
    keep = chunk.table.select(chunk.plan.keep_columns)
    out = output_table(
        chunk.schema, ids, chunk.rows.tolist(), results, seeds, chunk.attempt, chunk.shard, keep
    )
    reasons = out.column("finish_reason").to_pylist()
    return out, {
        "errors": reasons.count("error"),
        "skipped": reasons.count("skipped"),
        "prompt_tokens": sum(r.prompt_tokens for r in results.values()),
        "output_tokens": sum(r.output_tokens for r in results.values()),
    }


def _check_sampling(sampling: dict[str, Any]) -> None:
    try:
        SamplingParams(**sampling)
    except (TypeError, ValueError) as e:
        raise InputError(f"sampling parameters: {e}") from None


def _describe_model(model_path: str) -> dict[str, str]:
    from batchinfer.models.config import ModelConfig

    if Path(model_path).is_file():  # the engines load a folder: config.json beside the weights
        raise InputError(
            f"--model {model_path}: expected a checkpoint folder (config.json and the weights), got a file; "
            f"pass its folder {Path(model_path).resolve().parent}"
        )
    config = ModelConfig.from_pretrained(model_path)
    return {
        "path": str(Path(model_path).resolve()),
        "config_hash": config.config_hash(),
        "model_type": config.model_type,
    }


def _metadata(plan: Plan) -> dict[str, str]:
    return {"batchinfer.sampling": json.dumps({**plan.sampling, "job_seed": plan.seed}, sort_keys=True)}


LLM_TASK = Task(
    name="llm",
    input_schema="llm_input",
    output_schema="llm_output",
    check_params=_check_sampling,
    describe_model=_describe_model,
    check_rows=inputs.check_rows,
    read_columns=read_columns,
    process=process_chunk,
    metadata=_metadata,
    outcome_sql="finish_reason",
    rows_sql="count(*)",
    order_sql="row",
)
