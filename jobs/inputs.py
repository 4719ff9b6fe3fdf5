"""Input Parquet files: finding them, validating them against a schema, fingerprints, reading rows.

Job-level problems (unreadable or empty file, missing column, wrong type, null or duplicate ids, ids of
different types across files, a row with neither or both of prompt / messages) raise InputError here,
before any work starts. Row-level problems (a malformed message list, invalid per-row sampling values)
are left to `jobs.requests`, which turns them into error rows.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from batchinfer.schemas import loader

from batchinfer.errors import InputError

FOOTER_BYTES = 64 * 1024


@dataclass(slots=True)
class InputFile:
    path: str  # absolute
    size: int
    rows: int
    fingerprint: str
    row_offset: int  # global index of this file's first row

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "size": self.size,
            "rows": self.rows,
            "fingerprint": self.fingerprint,
            "row_offset": self.row_offset,
        }


def resolve(patterns: Sequence[str]) -> list[Path]:
    """Expand paths, globs and folders (all `*.parquet` inside) into a sorted, de-duplicated file list."""
    files: list[Path] = []
    for pattern in patterns:
        p = Path(pattern).expanduser()
        if p.is_dir():
            found = sorted(p.rglob("*.parquet"))
        elif glob.has_magic(pattern):
            found = sorted(Path(x) for x in glob.glob(str(p), recursive=True) if Path(x).is_file())
        elif p.is_file():
            found = [p]
        else:
            raise InputError(f"{pattern}: no such file or directory")
        if not found:
            raise InputError(f"{pattern}: matches no Parquet files")
        files.extend(found)
    unique = list(dict.fromkeys(f.resolve() for f in files))
    return unique


def fingerprint(path: Path, size: int) -> str:
    """Cheap content fingerprint: sha256 of the size and the last 64 KiB (the Parquet footer, row counts
    and column statistics). Touching a file keeps it; rewriting it almost always changes it."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        f.seek(max(0, size - FOOTER_BYTES))
        h.update(f.read())
    return h.hexdigest()[:16]


def open_parquet(path: Path) -> pq.ParquetFile:
    """Open a Parquet file, turning every way it can be unreadable into one clear InputError."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    if size == 0:
        raise InputError(f"{path}: empty file (0 bytes); expected a Parquet file")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})") from None


def describe_files(paths: Sequence[Path], schema: loader.Schema) -> list[InputFile]:
    """Validate each file's schema and row count; return them with global row offsets."""
    out: list[InputFile] = []
    offset = 0
    for path in paths:
        pf = open_parquet(path)
        try:
            loader.check_arrow(schema, pf.schema_arrow)
        except loader.SchemaMismatch as e:
            raise InputError(f"{path}: {e}") from None
        rows = pf.metadata.num_rows
        if rows == 0:
            raise InputError(f"{path}: has 0 rows; expected at least one (remove it from the input)")
        size = path.stat().st_size
        out.append(InputFile(str(path), size, rows, fingerprint(path, size), offset))
        offset += rows
    return out


def id_type(files: Sequence[InputFile]) -> pa.DataType:
    """The output id type: int64 if every file's ids are integers, string if every file's are strings."""
    kinds = {}
    for f in files:
        t = pq.ParquetFile(f.path).schema_arrow.field("id").type
        kinds[f.path] = "int64" if pa.types.is_integer(t) else "string"
    if len(set(kinds.values())) > 1:
        detail = ", ".join(f"{p}: {k}" for p, k in kinds.items())
        raise InputError(f"column 'id' must have one type across input files; found {detail}")
    return pa.int64() if next(iter(kinds.values())) == "int64" else pa.string()


def column_type(files: Sequence[InputFile], column: str) -> pa.DataType:
    """The type of a carried (`--keep-columns`) column, which every file must have with one type."""
    found: dict[str, pa.DataType] = {}
    for f in files:
        schema = pq.ParquetFile(f.path).schema_arrow
        if column not in schema.names:
            raise InputError(
                f"{f.path}: --keep-columns names column {column!r}, which this file lacks; "
                f"found columns {schema.names}"
            )
        found[f.path] = schema.field(column).type
    if len(set(map(str, found.values()))) > 1:
        detail = ", ".join(f"{p}: {t}" for p, t in found.items())
        raise InputError(f"column {column!r} must have one type across input files; found {detail}")
    return next(iter(found.values()))


def check_rows(files: Sequence[InputFile], id_arrow_type: pa.DataType) -> None:
    """One pass over the inputs before any work: null or duplicate ids, and rows without exactly one of
    prompt / messages, are job-level errors reported with file, row, id and column."""
    _check_ids(files, id_arrow_type, _check_prompt_or_messages)


def check_ids(files: Sequence[InputFile], id_arrow_type: pa.DataType) -> None:
    """Null or duplicate ids are job-level errors (the image task's row check: bad images are rows)."""
    _check_ids(files, id_arrow_type, None)


def _check_ids(
    files: Sequence[InputFile],
    id_arrow_type: pa.DataType,
    check_file: Callable[[str, pq.ParquetFile, pa.Array], None] | None,
) -> None:
    arrays = []
    for f in files:
        pf = pq.ParquetFile(f.path)
        try:
            col = pf.read(columns=["id"]).column("id").combine_chunks()
        except (pa.ArrowInvalid, OSError) as e:
            raise InputError(f"{f.path}: cannot read column 'id' ({e})") from None
        nulls = col.null_count
        if nulls:
            first = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise InputError(
                f"{f.path}: column 'id' has {nulls} null value(s), first at row {first}; "
                "expected a unique non-null id on every row"
            )
        if check_file is not None:
            check_file(f.path, pf, col)
        try:
            arrays.append(col.cast(id_arrow_type))
        except pa.ArrowInvalid as e:  # uint64 above 2**63 - 1: the output id column is int64
            raise InputError(
                f"{f.path}: column 'id' ({col.type}) does not fit the output's {id_arrow_type} ({e}); "
                "use ids in the int64 range, or cast them to strings"
            ) from None
    ids = pa.chunked_array(arrays, type=id_arrow_type)
    counts = pc.value_counts(ids)
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(dup):
        value = dup[0]["values"].as_py()
        where = []
        for f, arr in zip(files, arrays, strict=True):
            hits = np.flatnonzero(
                pc.equal(arr, pa.scalar(value, id_arrow_type)).to_numpy(zero_copy_only=False)
            )
            where += [f"{f.path} row {int(i)}" for i in hits[:3]]
        raise InputError(
            f"column 'id' has {len(dup)} duplicated value(s); id {value!r} appears at "
            f"{', '.join(where)}; ids must be unique across all input files"
        )


def _check_prompt_or_messages(path: str, pf: pq.ParquetFile, ids: pa.Array) -> None:
    """Each row needs exactly one of a non-null prompt / messages (a row cannot be judged otherwise).

    Kept cheap: prompt text is read only for row groups whose statistics do not settle its nulls, and
    messages only through its first leaf column (the roles), which carries the lists' nulls without
    decoding their contents.
    """
    names = pf.schema_arrow.names
    leaves = [pf.schema.column(i).path for i in range(len(pf.schema))]
    leaf = next((c for c in leaves if c.split(".")[0] == "messages"), None) if "messages" in names else None
    start = 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        prompt = _validity(path, pf, g, "prompt", n) if "prompt" in names else np.zeros(n, dtype=bool)
        if leaf is None and prompt.all():
            start += n
            continue
        messages = _validity(path, pf, g, leaf, n) if leaf else np.zeros(n, dtype=bool)
        neither = "column 'prompt' is null and " + (
            "column 'messages' is null" if leaf else "the file has no 'messages' column"
        )
        for bad, what in (
            (~prompt & ~messages, neither),
            (prompt & messages, "columns 'prompt' and 'messages' are both set"),
        ):
            hits = np.flatnonzero(bad)
            if len(hits):
                row = start + int(hits[0])
                more = f" ({len(hits)} such rows in its row group)" if len(hits) > 1 else ""
                raise InputError(
                    f"{path}: row {row} (id {ids[row].as_py()!r}): {what}{more}; expected exactly one "
                    "of prompt / messages on every row"
                )
        start += n


def _validity(path: str, pf: pq.ParquetFile, group: int, column: str, rows: int) -> np.ndarray:
    """Which rows of a row group are non-null in `column` (a top-level column or a leaf path), from
    the column statistics where they settle it, else by reading that one column."""
    meta = pf.metadata.row_group(group)
    for i in range(meta.num_columns):
        chunk = meta.column(i)
        stats = chunk.statistics
        if chunk.path_in_schema == column and stats is not None and stats.has_null_count:
            if stats.null_count == 0:
                return np.ones(rows, dtype=bool)
            if stats.null_count == rows and "." not in column:  # a leaf's count also holds empty lists
                return np.zeros(rows, dtype=bool)
    try:
        arr = pf.read_row_group(group, columns=[column]).column(0)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: cannot read column {column.split('.')[0]!r} ({e})") from None
    return ~arr.is_null().to_numpy(zero_copy_only=False)


class RowGroupCache:
    """The last few decoded row groups. Chunks are usually much smaller than row groups (pyarrow writes
    up to 1Mi rows per group by default), so consecutive chunks would otherwise decode one group again
    and again; two entries cover a chunk that straddles a group boundary."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._items: OrderedDict[tuple[str, int], pa.Table] = OrderedDict()

    def get(self, pf: pq.ParquetFile, path: str, group: int, columns: list[str]) -> pa.Table:
        key = (path, group)
        if key not in self._items:
            self._items[key] = pf.read_row_group(group, columns=columns)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        self._items.move_to_end(key)
        return self._items[key]


def read_rows(
    files: Sequence[InputFile], rows: np.ndarray, columns: Sequence[str], cache: RowGroupCache | None = None
) -> pa.Table:
    """Rows at the given global indices (ascending), as one table with `columns`.

    A column one file lacks (an optional column) comes back as nulls. Only the row groups holding
    the rows are read (and kept in `cache` for the next chunk), so a chunk of a huge file is cheap.
    """
    cache = cache or RowGroupCache()
    offsets = np.array([f.row_offset for f in files], dtype=np.int64)
    which = np.searchsorted(offsets, rows, side="right") - 1
    parts = []
    for file_idx in np.unique(which):
        f = files[int(file_idx)]
        local = rows[which == file_idx] - f.row_offset
        parts.append(_read_file_rows(f, local, list(columns), cache))
    return pa.concat_tables(parts, promote_options="permissive")


def _read_file_rows(f: InputFile, local: np.ndarray, columns: list[str], cache: RowGroupCache) -> pa.Table:
    try:
        pf = pq.ParquetFile(f.path)
        present = [c for c in columns if c in pf.schema_arrow.names]
        meta = pf.metadata
        starts = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        groups = np.unique(np.searchsorted(starts, local, side="right") - 1)
        table = pa.concat_tables([cache.get(pf, f.path, int(g), present) for g in groups])
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{f.path}: cannot read rows {int(local[0])}..{int(local[-1])} ({e})") from None
    base = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in groups])
    table = table.take(pa.array(np.searchsorted(base, local)))
    for c in columns:
        if c not in present:
            table = table.append_column(c, pa.nulls(len(table)))
    return table.select(list(columns))


def check_unchanged(f: InputFile) -> str | None:
    """What changed in an input file since the plan was made, or None."""
    if not os.path.exists(f.path):
        return f"{f.path}: missing (the plan lists it)"
    size = os.path.getsize(f.path)
    if size != f.size:
        return f"{f.path}: size changed from {f.size} to {size} bytes"
    if fingerprint(Path(f.path), size) != f.fingerprint:
        return f"{f.path}: content changed (fingerprint {f.fingerprint} -> {fingerprint(Path(f.path), size)})"
    return None
