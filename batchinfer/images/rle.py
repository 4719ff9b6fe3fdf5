"""COCO run-length encoding of binary masks, byte-compatible with pycocotools' compressed RLE.

A mask [H, W] is read in column-major order (down each column, then across), as alternating runs of
0s and 1s starting with 0s (so the first count is 0 when the top-left pixel is set). The counts are
written as pycocotools' `rleToString`: each count (from the fourth on, as the difference to the count
two before it) in signed 5-bit groups, low group first, 0x20 marking "more groups follow", each group
offset by 48 into printable ASCII. `{"size": [H, W], "counts": encode(mask)}` is what
`pycocotools.mask.decode` / `area` / `toBbox` read. No pycocotools dependency at run time.
"""

from __future__ import annotations

import numpy as np

from batchinfer.errors import InputError


def runs(mask: np.ndarray) -> np.ndarray:
    """Run lengths of a [H, W] mask in column-major order, starting with a (maybe empty) run of 0s."""
    if mask.ndim != 2:
        raise ValueError(f"mask: expected 2 dimensions [H, W], found shape {tuple(mask.shape)}")
    flat = np.asarray(mask, dtype=bool).ravel(order="F")
    if flat.size == 0:
        return np.zeros(0, dtype=np.int64)
    change = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    bounds = np.concatenate(([0], change, [flat.size]))
    counts = np.diff(bounds)
    if flat[0]:
        counts = np.concatenate(([0], counts))
    return counts.astype(np.int64)


def counts_to_string(counts: np.ndarray | list[int]) -> str:
    """pycocotools' rleToString over explicit run lengths."""
    out = bytearray()
    values = [int(c) for c in counts]
    for i, c in enumerate(values):
        x = c - values[i - 2] if i > 2 else c
        more = True
        while more:
            group = x & 0x1F
            x >>= 5  # arithmetic shift: negative deltas end at -1
            more = x != -1 if group & 0x10 else x != 0
            out.append((group | 0x20 if more else group) + 48)
    return out.decode("ascii")


def string_to_counts(s: str) -> list[int]:
    """pycocotools' rleFrString: the run lengths back from a counts string."""
    counts: list[int] = []
    data = s.encode("ascii")
    p = 0
    while p < len(data):
        x, k, more = 0, 0, True
        while more:
            if p >= len(data):
                raise InputError(f"RLE counts {s[:40]!r}: ends inside a number")
            c = data[p] - 48
            if not 0 <= c < 64:
                raise InputError(f"RLE counts {s[:40]!r}: character {chr(data[p])!r} at {p} is not RLE")
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts


def encode(mask: np.ndarray) -> str:
    """The COCO compressed RLE counts string of a [H, W] boolean (or 0/1) mask."""
    return counts_to_string(runs(mask))


def decode(counts: str, height: int, width: int) -> np.ndarray:
    """The bool [height, width] mask of a COCO compressed RLE counts string."""
    lengths = np.asarray(string_to_counts(counts), dtype=np.int64)
    total = height * width
    if (lengths < 0).any() or lengths.sum() != total:
        raise InputError(
            f"RLE counts {counts[:40]!r}: run lengths sum to {int(lengths.sum())} with "
            f"{int((lengths < 0).sum())} negative; expected non-negative runs summing to {height}x{width}"
        )
    values = np.zeros(len(lengths), dtype=bool)
    values[1::2] = True
    flat = np.repeat(values, lengths)
    return flat.reshape((width, height)).T


def area(counts: str) -> int:
    """Pixels set, straight from the counts (every second run)."""
    return int(sum(string_to_counts(counts)[1::2]))
