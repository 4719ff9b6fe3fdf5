"""A weights dict packed into one host buffer, to take the benchmark's own weights off the GPU for a while.

Why: `bench run` keeps the loaded weights for the accuracy lock's fp32 reference, while the fast engine
runs on copies it laid out at load time. A production run (`engine.loader`) drops the loaded tensors,
so with them kept the benchmark planned its slots in less memory than a user's job has: at Qwen3.6's
shape ~20 GiB (the quantized linears, ~20 GB, and the reference's fp32 embedding, 2 GB), ~170 of
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


class HostCopy:
    """The tensors of `weights` in one host buffer (made once; the weights never change)."""

    def __init__(self, weights: Mapping[str, Weight]) -> None:
        self._kinds = {name: type(w) for name, w in weights.items()}
        self._layout: list[tuple[str, str, int, torch.dtype, torch.Size]] = []
        offset = 0
        for name, w in weights.items():
            for part, t in _parts(w).items():
                self._layout.append((name, part, offset, t.dtype, t.shape))
                offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self.nbytes = offset
        self._buffer = torch.empty(offset, dtype=torch.uint8)
        sources = (t for w in weights.values() for t in _parts(w).values())
        for view, t in zip(self._views(self._buffer), sources, strict=True):
            view.copy_(t)

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        views = []
        for _, _, offset, dtype, shape in self._layout:
            n = shape.numel() * dtype.itemsize
            views.append(buffer[offset : offset + n].view(dtype).view(shape))
        return views

    def to(self, device: torch.device) -> dict[str, Weight]:
        """The weights again, on `device`, as views of one buffer there (one copy)."""
        buffer = self._buffer.to(device)
        parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self._kinds}
        for (name, part, *_), view in zip(self._layout, self._views(buffer), strict=True):
            parts[name][part] = view
        return {
            name: p[""] if issubclass(kind, torch.Tensor) else kind(**p)
            for (name, kind), p in zip(self._kinds.items(), parts.values(), strict=True)
        }
