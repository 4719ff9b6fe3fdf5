"""Input files: resolving paths, fingerprints, reading arbitrary global rows across files and row groups."""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchinfer.jobs import inputs
from batchinfer.schemas import loader

from batchinfer.errors import InputError


def _files(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"id": list(range(0, 50)), "prompt": [f"p{i}" for i in range(50)],
                             "temperature": [0.5] * 50}), d / "a.parquet", row_group_size=8)  # fmt: skip
    pq.write_table(pa.table({"id": list(range(50, 53)), "prompt": ["x", "y", "z"]}), d / "sub" / "b.parquet")
    return inputs.describe_files(inputs.resolve([str(d)]), loader.load("llm_input"))


def test_resolve_folders_globs_and_duplicates(tmp_path):
    files = _files(tmp_path)
    assert [os.path.basename(f.path) for f in files] == ["a.parquet", "b.parquet"]
    assert [f.row_offset for f in files] == [0, 50]
    again = inputs.resolve([str(tmp_path / "in" / "*.parquet"), str(tmp_path / "in" / "a.parquet")])
    assert [p.name for p in again] == ["a.parquet"]
    rec = inputs.resolve([str(tmp_path / "in" / "**" / "*.parquet")])
    assert sorted(p.name for p in rec) == ["a.parquet", "b.parquet"]


def test_read_rows_across_files_and_row_groups(tmp_path, monkeypatch):
    files = _files(tmp_path)
    reads = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, **kw: reads.append(i) or original(self, i, **kw))  # fmt: skip
    cache = inputs.RowGroupCache()
    rows = np.array([3, 7, 8, 15, 49, 50, 52])
    t = inputs.read_rows(files, rows, ["id", "prompt", "temperature", "messages"], cache)
    assert t.column("id").to_pylist() == [3, 7, 8, 15, 49, 50, 52]
    assert t.column("prompt").to_pylist() == ["p3", "p7", "p8", "p15", "p49", "x", "z"]
    assert t.column("temperature").to_pylist() == [0.5] * 5 + [None, None]  # b.parquet lacks the column
    assert t.column("messages").null_count == 7
    # consecutive chunks inside one row group decode it once
    reads.clear()
    for lo in range(16, 24, 2):
        chunk = inputs.read_rows(files, np.arange(lo, lo + 2), ["id"], cache)
        assert chunk.column("id").to_pylist() == [lo, lo + 1]
    assert reads == [2]


def test_fingerprint_ignores_touch_but_sees_rewrites(tmp_path):
    files = _files(tmp_path)
    f = files[0]
    os.utime(f.path, (1, 1))
    assert inputs.check_unchanged(f) is None
    t = pq.read_table(f.path).to_pydict()
    t["prompt"][0] = "P0"
    pq.write_table(pa.table(t), f.path, row_group_size=8)
    assert "changed" in inputs.check_unchanged(f)
    os.remove(f.path)
    assert "missing" in inputs.check_unchanged(f)


def test_unsigned_ids_beyond_int64_are_a_one_line_error(tmp_path):
    """uint64 ids (64-bit hashes, say) above 2**63 - 1 cannot be the int64 output id: refused by file."""
    path = tmp_path / "u.parquet"
    pq.write_table(pa.table({"id": pa.array([1, 2**63 + 5], pa.uint64()), "prompt": ["a", "b"]}), path)
    files = inputs.describe_files([path], loader.load("llm_input"))
    with pytest.raises(InputError, match=rf"{path}: column 'id' .*9223372036854775813.*cast them to strings"):
        inputs.check_rows(files, inputs.id_type(files))
