"""A weights dict packed into one host buffer, to take the benchmark's own weights off the GPU for a while.

Why: `bench run` keeps the loaded weights for the accuracy lock's fp32 reference, while the fast engine
runs on copies it laid out at load time. A production run (`engine.loader`) drops the loaded tensors,
so with them kept the benchmark planned its slots in less memory than a user's job has: at Qwen3.6's
shape ~20.6 GiB (the quantized linears, ~20 GB, and the reference's fp32 embedding, 2 GB), ~175 of
`offline`'s slots. `workload_run` moves them here while such an engine runs and back for the lock.

One buffer, so that bringing the weights back is one copy at the link's speed rather than tens of
thousands of small ones (one per expert matrix and scale); they come back as views of one device
buffer, which is freed when the last of them goes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from batchinfer.checkpoint.loader import Weight

_ALIGN = 256  # bytes: every tensor starts aligned, so a view of the buffer can take any dtype


def _parts(w: Weight) -> dict[str, torch.Tensor]:
    """The tensors of one weight: itself, or the fields of an `NVFP4Weight` / `FP8Weight`."""
    if isinstance(w, torch.Tensor):
        return {"": w}
    return {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}


def _unique(weights: Mapping[str, Weight]) -> dict[int, torch.Tensor]:
    """Every tensor of `weights` once, by identity (a tied embedding and lm_head are one)."""
    return {id(t): t for w in weights.values() for t in _parts(w).values()}


def _aligned(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN


def nbytes(weights: Mapping[str, Weight]) -> int:
    """The host buffer `HostCopy` would make for `weights`."""
    return sum(_aligned(t) for t in _unique(weights).values())


def host_available() -> int | None:
    """Bytes of host memory available to a new allocation (Linux `MemAvailable`), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


class HostCopy:
    """The tensors of `weights` in one host buffer (made once; the weights never change). A tensor that
    several names share (a tied embedding and lm_head) is copied once and comes back shared."""

    def __init__(self, weights: Mapping[str, Weight]) -> None:
        self._kinds = {name: type(w) for name, w in weights.items()}
        self._parts = [(name, part, id(t)) for name, w in weights.items() for part, t in _parts(w).items()]
        unique = _unique(weights)
        self._layout: dict[int, tuple[int, torch.dtype, torch.Size]] = {}
        offset = 0
        for key, t in unique.items():
            self._layout[key] = (offset, t.dtype, t.shape)
            offset += _aligned(t)
        self.nbytes = offset
        self._buffer = torch.empty(offset, dtype=torch.uint8)
        views = self._views(self._buffer)
        for key, t in unique.items():
            views[key].copy_(t)

    def _views(self, buffer: torch.Tensor) -> dict[int, torch.Tensor]:
        return {
            key: buffer[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for key, (offset, dtype, shape) in self._layout.items()
        }

    def to(self, device: torch.device) -> dict[str, Weight]:
        """The weights again, on `device`, as views of one buffer there (one copy)."""
        views = self._views(self._buffer.to(device))
        parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self._kinds}
        for name, part, key in self._parts:
            parts[name][part] = views[key]
        return {
            name: p[""] if issubclass(kind, torch.Tensor) else kind(**p)
            for (name, kind), p in zip(self._kinds.items(), parts.values(), strict=True)
        }
