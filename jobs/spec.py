"""Job spec files: the arguments of `batchinfer run` kept in a TOML (or JSON) file under version control.

Keys mirror the command-line flags (underscores for dashes); sampling parameters sit in a `[sampling]`
table, engine arguments in `[engine_args]`. Relative paths resolve against the spec file's folder.
Flags given on the command line override the file. Documented examples: `jobs/examples/*.toml`.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from batchinfer.engine.api import SamplingParams
from batchinfer.errors import ConfigError

SAMPLING_KEYS = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "stop": list,
    "ignore_eos": bool,
}
TOP_KEYS = {
    "input": (str, list),
    "output": str,
    "model": str,
    "shards": int,
    "chunk_rows": int,
    "seed": int,
    "keep_columns": list,
    "engine": str,
    "engine_args": dict,
    "progress": str,
    "sampling": dict,
}
PATH_KEYS = ("output", "model")


def load_spec(path: str | Path) -> dict[str, Any]:
    """Parse and check a spec file; returns a flat dict of run arguments."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read job spec ({e.strerror})") from None
    if data.startswith(b"PAR1"):
        raise ConfigError(
            f"{path}: a Parquet file, not a TOML or JSON job spec; pass input files with --input (-i)"
        )
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a TOML or JSON job spec (not UTF-8 text)") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'} ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object of run arguments, found {type(raw).__name__}")
    for key, value in raw.items():
        if key in SAMPLING_KEYS:
            raise ConfigError(
                f"{path}: key {key!r} is a sampling parameter; put it in the sampling table ([sampling] in "
                "TOML)"
            )
        if key not in TOP_KEYS:
            raise ConfigError(f"{path}: unknown key {key!r}; known keys: {', '.join(sorted(TOP_KEYS))}")
        _check_type(path, key, value, TOP_KEYS[key])
    lists = {"input": raw.get("input"), "keep_columns": raw.get("keep_columns"),
             "sampling.stop": raw.get("sampling", {}).get("stop")}  # fmt: skip
    for key, items in lists.items():
        if isinstance(items, list) and not all(isinstance(i, str) for i in items):
            raise ConfigError(f"{path}: key {key!r}: expected a list of strings, found {items!r}")
    for key in ("shards", "chunk_rows"):
        if key in raw and raw[key] < 1:
            raise ConfigError(f"{path}: key {key!r}: expected a whole number >= 1, found {raw[key]}")
    if raw.get("progress", "bar") not in ("bar", "json", "none"):
        raise ConfigError(f"{path}: key 'progress': expected bar, json or none, found {raw['progress']!r}")
    for key, value in raw.get("sampling", {}).items():
        if key not in SAMPLING_KEYS:
            raise ConfigError(
                f"{path}: unknown key sampling.{key}; known: {', '.join(sorted(SAMPLING_KEYS))}"
            )
        _check_type(path, f"sampling.{key}", value, SAMPLING_KEYS[key])
    try:
        SamplingParams(**raw.get("sampling", {}))
    except ValueError as e:
        raise ConfigError(f"{path}: [sampling]: {e}") from None
    for key, value in raw.get("engine_args", {}).items():
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{path}: key 'engine_args.{key}': expected a string, number or boolean")
    base = path.resolve().parent
    spec = dict(raw)
    for key in PATH_KEYS:
        if key in spec:
            spec[key] = str(_resolve(base, spec[key]))
    if "input" in spec:
        items = [spec["input"]] if isinstance(spec["input"], str) else spec["input"]
        spec["input"] = [str(_resolve(base, i)) for i in items]
    spec["engine_args"] = {str(k): _arg_text(v) for k, v in spec.get("engine_args", {}).items()}
    return spec


def _arg_text(value: Any) -> str:
    """An engine argument as `--engine-arg KEY=VALUE` spells it: a boolean as true or false (str() gives
    True, which a later `--engine-arg KEY=true` would count as another plan)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def _check_type(path: Path, key: str, value: Any, expected: type | tuple[type, ...]) -> None:
    types = expected if isinstance(expected, tuple) else (expected,)
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        names = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{path}: key {key!r}: expected {names}, found {type(value).__name__} {value!r}")
