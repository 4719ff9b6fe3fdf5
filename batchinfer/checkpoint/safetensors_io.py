"""Tensor sources: memory-mapped safetensors files (single or sharded) and plain in-memory dicts.

Every file header is parsed and checked against the file size here, before `safetensors` or torch
read a byte of tensor data, so a truncated or corrupt file is a `CheckpointError` naming the file
instead of a crash deep inside a library. Tensors are read one at a time, memory-mapped, onto the
requested device; nothing holds a second full copy of the checkpoint.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from batchinfer.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype string -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format caps headers at 100 MB


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str  # where the tensor lives, for error messages ("<memory>" for dicts)


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors header: lengths, JSON, dtypes and every data range."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{file}: truncated safetensors file ({size} bytes, shorter than the 8-byte "
                    "header length)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{file}: corrupt safetensors header: header length {n} bytes does not fit in a "
                    f"file of {size} bytes"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{file}: corrupt safetensors header: expected a JSON object, found {type(header).__name__}"
        )
    data_size = size - 8 - n
    infos: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_str, shape, (begin, end) = (
                entry["dtype"],
                [int(d) for d in entry["shape"]],
                entry["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{file}: corrupt safetensors header entry for tensor {name!r}: {entry!r}"
            ) from None
        if dtype_str not in DTYPES:
            raise CheckpointError(
                f"{file}: tensor {name!r} has dtype {dtype_str!r}; supported: {', '.join(DTYPES)}"
            )
        dtype, itemsize = DTYPES[dtype_str]
        nbytes = math.prod(shape) * itemsize
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(
                f"{file}: corrupt safetensors header: tensor {name!r} {dtype_str} {shape} needs "
                f"{nbytes} bytes "
                f"but its data_offsets [{begin}, {end}] span {end - begin}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{file}: truncated safetensors file: tensor {name!r} needs data bytes [{begin}, {end}) "
                f"but the file holds only {data_size} bytes of data"
            )
        infos[name] = TensorInfo(tuple(shape), dtype, str(file))
        spans.append((begin, end, name))
    # safetensors itself refuses data with gaps, overlaps or trailing bytes; say so here, naming the file.
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise CheckpointError(
                f"{file}: corrupt safetensors header: tensor {name!r} starts at data byte {begin}, expected "
                f"{covered} (tensors must tile the data without gaps or overlaps)"
            )
        covered = end
    if covered != data_size:
        raise CheckpointError(
            f"{file}: corrupt safetensors file: its tensors cover {covered} bytes of data but the file holds "
            f"{data_size} (trailing bytes after the last tensor)"
        )
    return infos


class TensorSource:
    """Names, shapes and dtypes of a checkpoint's tensors, and lazy access to each tensor."""

    def __init__(self, infos: dict[str, TensorInfo], tensors: Mapping[str, torch.Tensor] | None = None):
        self.infos = infos
        self._tensors = tensors
        self._handles: dict[str, object] = {}

    @classmethod
    def from_path(cls, path: str | Path) -> TensorSource:
        """A folder with `model.safetensors` or `model.safetensors.index.json` (or one .safetensors file)."""
        path = Path(path)
        if path.is_file():
            return cls(read_header(path))
        index = path / INDEX_FILE
        if index.is_file():
            return cls(_read_index(index))
        single = path / SINGLE_FILE
        if single.is_file():
            return cls(read_header(single))
        if not path.exists():
            raise CheckpointError(f"{path}: no such checkpoint folder")
        raise CheckpointError(
            f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found (is it a Hugging Face checkpoint?)"
        )

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> TensorSource:
        infos = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(
                    f"<memory>: tensor {name!r} is a {type(t).__name__}, expected a torch.Tensor"
                )
            infos[name] = TensorInfo(tuple(t.shape), t.dtype, "<memory>")
        return cls(infos, tensors)

    def get(self, name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read one tensor onto `device`, cast to `dtype` if given (else kept as stored)."""
        if self._tensors is not None:
            t = self._tensors[name]
        else:
            file = self.infos[name].file
            handle = self._handles.get(file)
            if handle is None:
                handle = safe_open(file, framework="pt", device=str(device))
                self._handles[file] = handle
            t = handle.get_tensor(name)
        return t.to(device=device, dtype=dtype or t.dtype)

    def close(self) -> None:
        self._handles.clear()


def _read_index(index: Path) -> dict[str, TensorInfo]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from None
    except (KeyError, TypeError):
        raise CheckpointError(f"{index}: missing the 'weight_map' object") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index}: 'weight_map' is a {type(weight_map).__name__}, expected an object of tensor name -> "
            "shard file name"
        )
    bad = next((n for n, f in weight_map.items() if not isinstance(f, str)), None)
    if bad is not None:
        raise CheckpointError(
            f"{index}: weight_map[{bad!r}] is {weight_map[bad]!r}, expected a shard file name (a string)"
        )
    headers: dict[str, dict[str, TensorInfo]] = {}
    infos: dict[str, TensorInfo] = {}
    for name, fname in weight_map.items():
        file = index.parent / fname
        if fname not in headers:
            if not file.is_file():
                raise CheckpointError(
                    f"{index}: shard {fname!r} (holding tensor {name!r}) does not exist in {index.parent}"
                )
            headers[fname] = read_header(file)
        if name not in headers[fname]:
            raise CheckpointError(
                f"{file}: tensor {name!r} is listed in {INDEX_FILE} but missing from this shard"
            )
        infos[name] = headers[fname][name]
    return infos
