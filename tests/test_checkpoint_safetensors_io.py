"""Safetensors sources: single and sharded files, in-memory dicts, and corrupt or truncated files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from batchinfer.checkpoint.safetensors_io import TensorSource, read_header
from batchinfer.errors import CheckpointError

TENSORS = {
    "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "c": torch.arange(6, dtype=torch.uint8).reshape(2, 3),
}


def _write_raw(path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_single_file_reads_values_shapes_and_casts(tmp_path):
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    src = TensorSource.from_path(tmp_path)
    assert {n: (i.shape, i.dtype) for n, i in src.infos.items()} == {
        "a": ((3, 4), torch.float32),
        "b": ((2,), torch.bfloat16),
        "c": ((2, 3), torch.uint8),
    }
    assert torch.equal(src.get("a", "cpu"), TENSORS["a"])
    b = src.get("b", "cpu", torch.float32)
    assert b.dtype == torch.float32 and b.tolist() == [1.5, -2.0]
    assert src.get("c", "cpu").dtype == torch.uint8
    # a single .safetensors file path works too
    assert set(TensorSource.from_path(tmp_path / "model.safetensors").infos) == {"a", "b", "c"}


def test_sharded_checkpoint_follows_the_index(tmp_path):
    save_file({"a": TENSORS["a"]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": TENSORS["b"], "c": TENSORS["c"]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    src = TensorSource.from_path(tmp_path)
    assert src.infos["b"].file.endswith("model-00002-of-00002.safetensors")
    for name, t in TENSORS.items():
        assert torch.equal(src.get(name, "cpu"), t)


def test_index_pointing_at_missing_shard_or_tensor(tmp_path):
    save_file({"a": TENSORS["a"]}, str(tmp_path / "s1.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(
        CheckpointError, match=r"shard 's2.safetensors' \(holding tensor 'b'\) does not exist"
    ):
        TensorSource.from_path(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "zz": "s1.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"s1.safetensors: tensor 'zz' is listed in .* but missing"):
        TensorSource.from_path(tmp_path)
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json: not valid JSON"):
        TensorSource.from_path(tmp_path)


@pytest.mark.parametrize(
    ("weight_map", "match"),
    [
        (["a"], r"'weight_map' is a list, expected an object of tensor name -> shard file name"),
        ({"a": None}, r"weight_map\['a'\] is None, expected a shard file name \(a string\)"),
    ],
)
def test_malformed_weight_map_names_the_index(tmp_path, weight_map, match):
    save_file({"a": TENSORS["a"]}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json: {match}"):
        TensorSource.from_path(tmp_path)


def test_folder_without_weights(tmp_path):
    with pytest.raises(CheckpointError, match=r"no model.safetensors or model.safetensors.index.json found"):
        TensorSource.from_path(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        TensorSource.from_path(tmp_path / "nope")


def test_truncated_data_is_caught_before_torch_reads(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file(TENSORS, str(good))
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(good.read_bytes()[:-5])
    with pytest.raises(CheckpointError) as e:
        TensorSource.from_path(tmp_path)
    msg = str(e.value)
    assert str(bad) in msg and "truncated safetensors file" in msg and "holds only" in msg


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"\x01\x02", "shorter than the 8-byte header length"),
        (struct.pack("<Q", 10**6) + b"{}", "header length 1000000 bytes does not fit in a file of 10 bytes"),
        (struct.pack("<Q", 5) + b"{abc}", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "expected a JSON object, found list"),
    ],
)
def test_corrupt_headers(tmp_path, content, expected):
    f = tmp_path / "x.safetensors"
    f.write_bytes(content)
    with pytest.raises(CheckpointError, match=expected) as e:
        read_header(f)
    assert str(e.value).startswith(str(f))


def test_inconsistent_header_entries(tmp_path):
    f = tmp_path / "x.safetensors"
    _write_raw(
        f, json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}).encode(), b"\0" * 16
    )
    with pytest.raises(CheckpointError, match=r"tensor 'w' F32 \[2, 2\] needs 16 bytes but its data_offsets"):
        read_header(f)
    _write_raw(
        f, json.dumps({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}).encode(), b"\0" * 2
    )
    with pytest.raises(CheckpointError, match=r"tensor 'w' has dtype 'Q4'; supported: F64, F32"):
        read_header(f)
    _write_raw(f, json.dumps({"w": {"dtype": "F32"}}).encode(), b"")
    with pytest.raises(CheckpointError, match=r"corrupt safetensors header entry for tensor 'w'"):
        read_header(f)


def test_trailing_bytes_gaps_and_overlaps_are_caught_before_safetensors_reads(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file(TENSORS, str(good))
    f = tmp_path / "model.safetensors"
    f.write_bytes(good.read_bytes() + b"junk")  # e.g. two copies written into one file
    with pytest.raises(CheckpointError, match=r"cover \d+ bytes of data but the file holds \d+ \(trailing"):
        TensorSource.from_path(tmp_path)
    entry = {"dtype": "U8", "shape": [2]}
    _write_raw(f, json.dumps({"w": {**entry, "data_offsets": [1, 3]}}).encode(), b"\0" * 3)
    with pytest.raises(CheckpointError, match=r"tensor 'w' starts at data byte 1, expected 0"):
        read_header(f)
    overlap = {"v": {**entry, "data_offsets": [0, 2]}, "w": {**entry, "data_offsets": [1, 3]}}
    _write_raw(f, json.dumps(overlap).encode(), b"\0" * 3)
    with pytest.raises(CheckpointError, match=r"tensor 'w' starts at data byte 1, expected 2"):
        read_header(f)


def test_in_memory_source_moves_and_casts_without_touching_originals():
    src = TensorSource.from_tensors(TENSORS)
    assert src.infos["a"].file == "<memory>" and src.infos["a"].shape == (3, 4)
    out = src.get("a", "cpu", torch.bfloat16)
    assert out.dtype == torch.bfloat16 and TENSORS["a"].dtype == torch.float32
    with pytest.raises(CheckpointError, match=r"tensor 'x' is a list, expected a torch.Tensor"):
        TensorSource.from_tensors({"x": [1, 2]})
