"""Load the versioned schemas kept as JSON files next to this module, and check data against them.

Arrow schemas (`kind: arrow`) describe Parquet files; their field types use a small grammar:
`string`, `binary`, `boolean`, `int32`, `int64`, `float32`, `float64`, the families `integer` (any int)
and `number` (any int or float), `list<T>`, `struct<a:T,b:T>`, and alternatives `A|B`. Input schemas use
families so any sensible Arrow type is accepted; output schemas use concrete types (`to_arrow`).
JSON schemas (`kind: json`) describe our JSON files (plan, markers) with JSON type names.
This module imports nothing of batchinfer's, so every room can use it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa

SCHEMA_DIR = Path(__file__).parent
_FILE_RE = re.compile(r"^(?P<name>[a-z_]+)\.v(?P<version>\d+)\.json$")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}
_CONCRETE = {
    "string": pa.string(),
    "binary": pa.binary(),
    "boolean": pa.bool_(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
}


class SchemaMismatch(ValueError):
    """Raised by the check_* functions; the caller adds the file name."""


@dataclass(slots=True, frozen=True)
class FieldSpec:
    name: str
    type: str
    required: bool
    nullable: bool = True
    doc: str = ""


@dataclass(slots=True, frozen=True)
class Schema:
    name: str
    version: int
    kind: str  # "arrow" or "json"
    fields: tuple[FieldSpec, ...]
    one_of: tuple[tuple[str, ...], ...] = field(default_factory=tuple)
    doc: str = ""

    @property
    def tag(self) -> str:
        """`name/version`, as recorded in plans and file metadata."""
        return f"{self.name}/{self.version}"

    def field(self, name: str) -> FieldSpec:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"schema {self.tag} has no field {name!r}")

    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def to_arrow(self, overrides: dict[str, pa.DataType] | None = None) -> pa.Schema:
        """Concrete Arrow schema; `overrides` picks the type of alternative fields such as `id`."""
        overrides = overrides or {}
        return pa.schema(
            [
                pa.field(f.name, overrides.get(f.name) or to_arrow(f.type), nullable=f.nullable)
                for f in self.fields
            ]
        )


def versions(name: str) -> list[int]:
    """Versions of schema `name` shipped with this package, ascending."""
    found = [int(m["version"]) for p in SCHEMA_DIR.glob(f"{name}.v*.json") if (m := _FILE_RE.match(p.name))]
    return sorted(found)


def available() -> dict[str, list[int]]:
    """Every schema name shipped, with its versions."""
    names = {m["name"] for p in SCHEMA_DIR.glob("*.json") if (m := _FILE_RE.match(p.name))}
    return {n: versions(n) for n in sorted(names)}


@cache
def load(name: str, version: int | None = None) -> Schema:
    """Schema `name` at `version` (default: the newest shipped)."""
    have = versions(name)
    if not have:
        raise KeyError(f"no schema named {name!r}; shipped: {sorted(available())}")
    version = have[-1] if version is None else version
    if version not in have:
        raise KeyError(f"schema {name!r} has no version {version}; shipped versions: {have}")
    raw = json.loads((SCHEMA_DIR / f"{name}.v{version}.json").read_text())
    fields = tuple(
        FieldSpec(
            f["name"],
            f["type"],
            bool(f.get("required", False)),
            bool(f.get("nullable", True)),
            f.get("doc", ""),
        )
        for f in raw["fields"]
    )
    one_of = tuple(tuple(group) for group in raw.get("one_of", []))
    return Schema(raw["name"], int(raw["version"]), raw["kind"], fields, one_of, raw.get("doc", ""))


def _split(text: str, sep: str) -> list[str]:
    """Split on `sep` at bracket depth 0."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def to_arrow(type_str: str) -> pa.DataType:
    """The Arrow type of a concrete type string such as `list<float32>`."""
    t = type_str.strip()
    if t in _CONCRETE:
        return _CONCRETE[t]
    if t.startswith("list<") and t.endswith(">"):
        return pa.list_(to_arrow(t[5:-1]))
    if t.startswith("struct<") and t.endswith(">"):
        members = [m.split(":", 1) for m in _split(t[7:-1], ",")]
        return pa.struct([pa.field(n.strip(), to_arrow(ty)) for n, ty in members])
    raise ValueError(f"type {type_str!r} is not concrete (alternatives and families need an override)")


def type_matches(type_str: str, actual: pa.DataType) -> bool:
    """Whether an Arrow type satisfies a type string (families and alternatives allowed)."""
    alternatives = _split(type_str, "|")
    if len(alternatives) > 1:
        return any(type_matches(a, actual) for a in alternatives)
    t = type_str.strip()
    if t in ("string",):
        return (
            pa.types.is_string(actual) or pa.types.is_large_string(actual) or pa.types.is_string_view(actual)
        )
    if t == "binary":
        return (
            pa.types.is_binary(actual) or pa.types.is_large_binary(actual) or pa.types.is_binary_view(actual)
        )
    if t == "boolean":
        return pa.types.is_boolean(actual)
    if t in ("integer", "int32", "int64"):
        return pa.types.is_integer(actual)
    if t in ("number", "float32", "float64"):
        return pa.types.is_integer(actual) or pa.types.is_floating(actual)
    if t.startswith("list<"):
        is_list = pa.types.is_list(actual) or pa.types.is_large_list(actual) or pa.types.is_list_view(actual)
        return is_list and type_matches(t[5:-1], actual.value_type)
    if t.startswith("struct<"):
        if not pa.types.is_struct(actual):
            return False
        names = {actual.field(i).name: actual.field(i).type for i in range(actual.num_fields)}
        for member in _split(t[7:-1], ","):
            name, ty = (s.strip() for s in member.split(":", 1))
            if name not in names or not type_matches(ty, names[name]):
                return False
        return True
    raise ValueError(f"unknown type {type_str!r} in a schema file")


def check_arrow(schema: Schema, actual: pa.Schema) -> None:
    """Check an Arrow schema (e.g. a Parquet file's) against `schema`; extra columns are allowed.

    Raises SchemaMismatch naming the column, the expected and the found type.
    """
    present = set(actual.names)
    for f in schema.fields:
        if f.name not in present:
            if f.required:
                raise SchemaMismatch(
                    f"missing required column {f.name!r} (expected {f.type}); found columns {actual.names}"
                )
            continue
        found = actual.field(f.name).type
        if not type_matches(f.type, found):
            raise SchemaMismatch(f"column {f.name!r}: expected type {f.type}, found {found}")
    for group in schema.one_of:
        if not present & set(group):
            raise SchemaMismatch(f"needs one of the columns {list(group)}; found columns {actual.names}")


def check_json(schema: Schema, doc: Any) -> None:
    """Check a parsed JSON document against a `kind: json` schema (keys and JSON types)."""
    if not isinstance(doc, dict):
        raise SchemaMismatch(f"expected a JSON object for schema {schema.tag}, found {type(doc).__name__}")
    for f in schema.fields:
        if f.name not in doc:
            if f.required:
                raise SchemaMismatch(f"missing key {f.name!r} ({f.type})")
            continue
        value = doc[f.name]
        ok = _JSON_TYPES[f.type]
        if not isinstance(value, ok) or (isinstance(value, bool) and f.type != "boolean"):
            raise SchemaMismatch(
                f"key {f.name!r}: expected {f.type}, found {type(value).__name__} {value!r:.60}"
            )
