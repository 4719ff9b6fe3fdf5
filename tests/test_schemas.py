"""The schema files and their loader: type grammar, Arrow checks with clear messages, JSON checks."""

import pyarrow as pa
import pytest
from batchinfer.schemas import loader


def test_every_shipped_schema_loads_and_output_schemas_are_concrete():
    names = loader.available()
    assert {
        "llm_input",
        "llm_output",
        "image_input",
        "mask_output",
        "plan",
        "shard_marker",
        "attempt",
    } <= set(names)
    for name in names:
        s = loader.load(name)
        assert s.name == name and s.version == names[name][-1] and s.fields
    out = loader.load("llm_output").to_arrow({"id": pa.string()})
    assert out.names[:4] == ["id", "row", "text", "finish_reason"]
    assert out.field("seed").type == pa.int64() and not out.field("id").nullable
    masks = loader.load("mask_output").to_arrow({"id": pa.int64()})
    assert masks.field("box").type == pa.list_(pa.float32())
    assert masks.field("mask_rle").type == pa.string()


def test_unknown_names_and_versions_are_clear():
    with pytest.raises(KeyError, match="no schema named 'nope'"):
        loader.load("nope")
    with pytest.raises(KeyError, match="has no version 99"):
        loader.load("llm_input", 99)


@pytest.mark.parametrize(
    "spec, arrow, ok",
    [
        ("string|integer", pa.int32(), True),
        ("string|integer", pa.large_string(), True),
        ("string|integer", pa.float64(), False),
        ("number", pa.int8(), True),
        ("number", pa.float32(), True),
        ("number", pa.string(), False),
        ("integer", pa.float64(), False),
        ("list<string>", pa.list_(pa.string()), True),
        ("list<string>", pa.list_(pa.int64()), False),
        ("list<struct<role:string,content:string>>",
         pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])), True),
        ("list<struct<role:string,content:string>>", pa.list_(pa.struct([("role", pa.string())])), False),
        ("string|binary", pa.binary(), True),
    ],
)  # fmt: skip
def test_type_matches(spec, arrow, ok):
    assert loader.type_matches(spec, arrow) is ok


def test_to_arrow_nested_and_rejects_families():
    assert loader.to_arrow("list<struct<a:int32,b:list<float64>>>") == pa.list_(
        pa.struct([("a", pa.int32()), ("b", pa.list_(pa.float64()))])
    )
    with pytest.raises(ValueError, match="not concrete"):
        loader.to_arrow("integer")


def test_check_arrow_names_column_expected_and_found():
    s = loader.load("llm_input")
    loader.check_arrow(s, pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("extra", pa.float16())]))
    with pytest.raises(
        loader.SchemaMismatch, match=r"missing required column 'id'.*found columns \['prompt'\]"
    ):
        loader.check_arrow(s, pa.schema([("prompt", pa.string())]))
    with pytest.raises(loader.SchemaMismatch, match="column 'prompt': expected type string, found int64"):
        loader.check_arrow(s, pa.schema([("id", pa.int64()), ("prompt", pa.int64())]))
    with pytest.raises(loader.SchemaMismatch, match=r"needs one of the columns \['prompt', 'messages'\]"):
        loader.check_arrow(s, pa.schema([("id", pa.string()), ("text", pa.string())]))
    with pytest.raises(
        loader.SchemaMismatch, match="column 'temperature': expected type number, found string"
    ):
        loader.check_arrow(
            s, pa.schema([("id", pa.string()), ("prompt", pa.string()), ("temperature", pa.string())])
        )


def test_image_input_schema_accepts_paths_or_bytes():
    s = loader.load("image_input")
    for image in (pa.string(), pa.binary()):
        loader.check_arrow(
            s, pa.schema([("id", pa.string()), ("image", image), ("prompts", pa.list_(pa.string()))])
        )
    with pytest.raises(loader.SchemaMismatch, match="missing required column 'prompts'"):
        loader.check_arrow(s, pa.schema([("id", pa.string()), ("image", pa.string())]))


def test_check_json():
    s = loader.load("shard_marker")
    good = {"plan_id": "x", "shard": 0, "attempt": 1, "chunks": 1, "rows": 3, "errors": 0, "skipped": 0,
            "prompt_tokens": 5, "output_tokens": 6, "seconds": 0.5, "finished_at": "t"}  # fmt: skip
    loader.check_json(s, good)
    with pytest.raises(loader.SchemaMismatch, match="missing key 'rows'"):
        loader.check_json(s, {k: v for k, v in good.items() if k != "rows"})
    with pytest.raises(loader.SchemaMismatch, match="key 'shard': expected integer, found str"):
        loader.check_json(s, {**good, "shard": "0"})
    with pytest.raises(loader.SchemaMismatch, match="key 'rows': expected integer, found bool"):
        loader.check_json(s, {**good, "rows": True})
