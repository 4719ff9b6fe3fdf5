"""The image task (`plan.json` task `image`): a chunk of image rows -> decode on CPU threads, segment in
engine batches, masks to COCO RLE -> one output row per (image, prompt, instance) (`schemas/mask_output`).

Pipeline per chunk: a thread pool decodes (and, when the engine asks, resizes) images a few batches
ahead of the engine, and encodes each batch's masks while the engine works on the next batch, so the
engine never waits on the CPU unless the CPU is the bottleneck. Unreadable or corrupt images, null
images and rows without prompts become one error row each (prompt null, error set); an (image, prompt)
pair without detections becomes one row with instance null, so absence is queryable. Job parameters
(plan "sampling"): `score_threshold` and the job `prompts` (for rows whose own list is null or empty).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.engine.api import ImageEngine, ImageRequest, ImageResult
from batchinfer.errors import InputError
from batchinfer.images import decode, rle
from batchinfer.jobs import inputs
from batchinfer.jobs.tasks import Chunk, Task

DEFAULT_SCORE_THRESHOLD = 0.5  # Meta's Sam3Processor and SA-Co evaluation keep score > 0.5
DEFAULT_CHUNK_ROWS = 256  # images per committed file: a kill loses at most this much work
# CPU decode threads. More is slower: they share the GIL with the thread that launches the GPU's kernels
# (images-1p on the H200, 1,008-px PNGs: 16 threads 52.4 images/s, 4 threads 59.5, 2 threads 59.4, the
# model alone 61.4; docs/PERF_IMAGES.md, session 15). A job that waits on them shows it in its chunks'
# `decode_wait_seconds`.
DECODE_WORKERS = min(4, os.cpu_count() or 1)
_PARAMS = {"score_threshold", "prompts"}
# A worker reads the input's image column a whole row group at a time and keeps two decoded (`inputs.
# RowGroupCache`): Parquet files of image bytes with larger row groups than this get a warning at planning.
ROW_GROUP_WARN_BYTES = 2**30

log = logging.getLogger(__name__)


def clean_prompts(prompts: Sequence[str | None] | None) -> list[str]:
    """Prompts stripped, without empties and duplicates, in first-seen order."""
    return list(dict.fromkeys(p.strip() for p in prompts or [] if p and p.strip()))


def check_params(params: dict[str, Any]) -> None:
    unknown = set(params) - _PARAMS
    if unknown:
        raise InputError(f"image job parameters: unknown {sorted(unknown)}; known {sorted(_PARAMS)}")
    thr = params.get("score_threshold")
    if not isinstance(thr, int | float) or isinstance(thr, bool) or not 0 <= thr < 1:
        raise InputError(f"--score-threshold must be a number in [0, 1), got {thr!r}")
    prompts = params.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise InputError(f"job prompts must be a list of strings, got {prompts!r}")


def describe_model(model_path: str) -> dict[str, str]:
    """The plan's model entry: a checkpoint folder (hash of its config.json) or file (size and tail
    fingerprint, as input files), or none for model-free engines."""
    if not model_path:
        return {"path": "", "config_hash": "", "model_type": "none"}
    p = Path(model_path).expanduser().resolve()
    if p.is_dir():
        config = p / "config.json"
        if not config.is_file():
            return {"path": str(p), "config_hash": "", "model_type": "unknown"}
        try:
            model_type = str(json.loads(config.read_text()).get("model_type", "unknown"))
        except (json.JSONDecodeError, AttributeError) as e:
            raise InputError(f"{config}: not a JSON object ({e})") from None
        return {"path": str(p), "config_hash": inputs.fingerprint(config, config.stat().st_size),
                "model_type": model_type}  # fmt: skip
    if p.is_file():
        return {"path": str(p), "config_hash": inputs.fingerprint(p, p.stat().st_size),
                "model_type": p.suffix.lstrip(".") or "file"}  # fmt: skip
    raise InputError(f"--model {model_path}: no such file or directory")


def check_rows(files: Sequence[inputs.InputFile], id_arrow_type: pa.DataType) -> None:
    """Null or duplicate ids are job-level errors (bad images are rows). Image bytes in row groups of
    gigabytes (pandas and pyarrow write up to 1Mi rows a group) get a warning naming the remedy: every
    worker would hold two such groups in memory."""
    inputs.check_ids(files, id_arrow_type)
    for f in files:
        meta = pq.ParquetFile(f.path).metadata
        sizes = [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]
        if sizes and max(sizes) > ROW_GROUP_WARN_BYTES:
            g = int(np.argmax(sizes))
            log.warning(
                "%s: row group %d holds %.1f GiB; each worker reads whole row groups of the image column and "
                "keeps two, so it may need ~%.0f GiB of memory: write the file with smaller row groups "
                "(pyarrow.parquet.write_table(table, path, row_group_size=256))",
                f.path, g, sizes[g] / 2**30, 2 * sizes[g] / 2**30,
            )  # fmt: skip


def read_columns(keep_columns: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(["id", "image", "prompts", *keep_columns]))


def metadata(plan: Any) -> dict[str, str]:
    params = plan.sampling
    return {
        "batchinfer.thresholds": json.dumps({"score_threshold": params["score_threshold"]}),
        "batchinfer.prompts": json.dumps(params["prompts"]),
    }


def _engine(engine: Any) -> ImageEngine:
    """The real engine behind a jobs.engines.LazyEngine (loaded now: this chunk needs it)."""
    return engine.get() if hasattr(engine, "get") else engine


@dataclass(slots=True)
class PipelineTimes:
    """Where the wall time of the thread that drives the engine went: blocked on decoded images, inside
    the engine, blocked on the last masks' encoding. Decode waits mean the CPU cannot feed the GPU."""

    decode_wait_s: float = 0.0
    engine_s: float = 0.0
    encode_wait_s: float = 0.0


def process_chunk(chunk: Chunk) -> tuple[pa.Table, dict[str, float]]:
    engine = _engine(chunk.engine)
    table = chunk.table
    n = table.num_rows
    sources = table.column("image").to_pylist()
    job_prompts = clean_prompts(chunk.plan.sampling["prompts"])
    prompts = [clean_prompts(p) or job_prompts for p in table.column("prompts").to_pylist()]
    files = chunk.plan.inputs
    offsets = np.array([f.row_offset for f in files], dtype=np.int64)
    which = np.searchsorted(offsets, chunk.rows, side="right") - 1
    bases = [str(Path(files[int(w)].path).parent) for w in which]
    # files may differ in the image column's type (paths vs bytes); reading several promotes paths to bytes
    is_path = {int(w): pa.types.is_string(_image_type(files[int(w)].path)) for w in set(which.tolist())}
    sources = [
        s.decode() if isinstance(s, bytes) and is_path[int(w)] else s
        for s, w in zip(sources, which, strict=True)
    ]
    threshold = float(chunk.plan.sampling["score_threshold"])
    rows: list[list[dict[str, Any]] | None] = [None] * n
    pool = ThreadPoolExecutor(DECODE_WORKERS, thread_name_prefix="decode")
    try:
        times = _pipeline(engine, pool, sources, bases, prompts, threshold, rows)
    finally:  # a dead engine: drop the decodes queued ahead instead of finishing them
        pool.shutdown(wait=True, cancel_futures=True)
    out, counts = _table(chunk, rows)
    timing = {
        "engine_seconds": round(times.engine_s, 4),
        "decode_wait_seconds": round(times.decode_wait_s, 4),
    }
    return out, counts | timing


def _pipeline(
    engine: ImageEngine,
    pool: ThreadPoolExecutor,
    sources: list[Any],
    bases: list[str],
    prompts: list[list[str]],
    threshold: float,
    rows: list[list[dict[str, Any]] | None],
) -> PipelineTimes:
    """Decode ahead on `pool`, segment batch by batch, encode each batch's masks on `pool`; fills `rows`."""
    times = PipelineTimes()
    n = len(sources)
    decoding: dict[int, Future[decode.Decoded]] = {}
    encoding: list[tuple[int, Future[list[dict[str, Any]]]]] = []
    ahead = 0
    size = engine.input_size
    batch = max(1, int(engine.batch_size))
    for lo in range(0, n, batch):
        hi = min(lo + batch, n)
        while ahead < min(n, hi + 2 * batch + DECODE_WORKERS):  # keep the workers busy, memory bounded
            decoding[ahead] = pool.submit(decode.load, sources[ahead], bases[ahead], size)
            ahead += 1
        requests = []
        for i in range(lo, hi):
            t0 = time.perf_counter()
            d = decoding.pop(i).result()
            times.decode_wait_s += time.perf_counter() - t0
            if d.error is None and not prompts[i]:
                d.error = "no prompts: the row's prompts are null or empty and the job has no --prompt"
            if d.error is not None:
                rows[i] = [_error_row(d.error, d.height, d.width)]
            else:
                requests.append(ImageRequest(i, d.image, d.height, d.width, prompts[i]))
        expected = {r.index: r for r in requests}
        t0 = time.perf_counter()
        for result in engine.segment(requests, threshold) if requests else ():
            req = expected.pop(result.index, None)
            if req is None:
                raise RuntimeError(f"engine returned an unknown or repeated result index {result.index}")
            encoding.append((result.index, pool.submit(_result_rows, result, req, threshold)))
        times.engine_s += time.perf_counter() - t0
        if expected:
            raise RuntimeError(f"engine returned no result for {len(expected)} image(s) of the batch")
    t0 = time.perf_counter()
    for i, fut in encoding:
        rows[i] = fut.result()
    times.encode_wait_s = time.perf_counter() - t0
    return times


@functools.cache
def _image_type(path: str) -> pa.DataType:
    t = pq.read_schema(path).field("image").type
    return pa.string() if pa.types.is_string(t) or pa.types.is_large_string(t) else t


def _error_row(error: str, height: int | None, width: int | None) -> dict[str, Any]:
    return {"height": height, "width": width, "error": error}


def _result_rows(result: ImageResult, req: ImageRequest, threshold: float) -> list[dict[str, Any]]:
    """One row per instance (by descending score) of each prompt, or one instance-less row per prompt."""
    if result.error is not None:
        return [_error_row(result.error, req.height, req.width)]
    if len(result.instances) != len(req.prompts) or len(result.presence) != len(req.prompts):
        raise RuntimeError(
            f"engine returned {len(result.instances)} instance lists and {len(result.presence)} presence "
            f"scores for image {req.index} with {len(req.prompts)} prompts"
        )
    out = []
    base = {"height": req.height, "width": req.width}
    for j, (prompt, found, presence) in enumerate(
        zip(req.prompts, result.instances, result.presence, strict=True)
    ):
        kept = sorted((x for x in found if x.score > threshold), key=lambda x: -x.score)
        if not kept:
            out.append({**base, "prompt": prompt, "prompt_index": j, "presence_score": presence})
        for k, inst in enumerate(kept):
            mask = np.asarray(inst.mask, dtype=bool)
            if mask.shape != (req.height, req.width):
                raise RuntimeError(
                    f"engine returned a mask of shape {mask.shape} for image {req.index} of size "
                    f"{req.height}x{req.width}"
                )
            out.append({**base, "prompt": prompt, "prompt_index": j, "instance": k,
                        "score": float(inst.score), "presence_score": float(inst.presence),
                        "box": [float(v) for v in inst.box_xyxy], "mask_rle": rle.encode(mask),
                        "area": int(mask.sum())})  # fmt: skip
    return out


def _table(chunk: Chunk, rows: list[list[dict[str, Any]] | None]) -> tuple[pa.Table, dict[str, float]]:
    ids = chunk.table.column("id").to_pylist()
    source: list[int] = []  # input row (in the chunk) of each output row
    flat: list[dict[str, Any]] = []
    for i, image_rows in enumerate(rows):
        assert image_rows is not None, f"row {i} was never processed"
        source += [i] * len(image_rows)
        flat += image_rows
    columns: dict[str, list[Any]] = {
        "id": [ids[i] for i in source],
        "row": [int(chunk.rows[i]) for i in source],
        "attempt": [chunk.attempt] * len(flat),
        "shard": [chunk.shard] * len(flat),
    }
    keep = chunk.table.select(chunk.plan.keep_columns).take(pa.array(source, pa.int64()))
    arrays = []
    for f in chunk.schema:
        if f.name in chunk.plan.keep_columns:
            arrays.append(keep.column(f.name).cast(f.type))
        else:
            values = columns[f.name] if f.name in columns else [r.get(f.name) for r in flat]
            arrays.append(pa.array(values, type=f.type))
    out = pa.Table.from_arrays(arrays, schema=chunk.schema)
    errors = sum(1 for r in rows if r and r[0].get("error") is not None)
    instances = sum(1 for r in flat if r.get("instance") is not None)
    counts = {"errors": errors, "skipped": 0, "prompt_tokens": 0, "output_tokens": 0}
    return out, {**counts, "instances": instances}


IMAGE_TASK = Task(
    name="image",
    input_schema="image_input",
    output_schema="mask_output",
    check_params=check_params,
    describe_model=describe_model,
    check_rows=check_rows,
    read_columns=read_columns,
    process=process_chunk,
    metadata=metadata,
    outcome_sql="CASE WHEN error IS NULL THEN 'ok' ELSE 'error' END",
    rows_sql="count(DISTINCT id)",
    order_sql="row, prompt_index NULLS FIRST, instance NULLS FIRST",
)
