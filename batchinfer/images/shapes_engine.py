"""A model-free segmentation engine for dry runs: finds pure-colour shapes, so the whole image job path
(decode, plan, shards, masks, Parquet, queries) runs and is tested on a CPU without SAM 3 weights.

`batchinfer segment ... --engine batchinfer.images.shapes_engine:ColorShapesEngine`: a prompt names a
colour ("red") and optionally a shape ("red circle", "blue squares", "green triangle"). Every
4-connected region of pixels within `tolerance` (per channel) of that colour and at least `min_area`
pixels large is an instance. With a shape word, the region's fill of its bounding box decides: about 1
for squares and rectangles, pi/4 for circles, 1/2 for triangles; score = max(0, 1 - 4 * |fill - ideal|),
times min(w, h) / max(w, h) for squares and circles.
Without one the score is 1. Presence is the best score of the prompt. Deterministic by construction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from batchinfer.engine.api import Instance
from batchinfer.images.segmenter import SegmenterEngine
from batchinfer.sam3.api import PairResult

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "cyan": (0, 255, 255),
    "magenta": (255, 0, 255),
    "orange": (255, 128, 0),
    "purple": (128, 0, 128),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
}
SHAPE_FILL = {"square": 1.0, "rectangle": 1.0, "circle": math.pi / 4, "triangle": 0.5}


def components(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected components of a bool [H, W] mask, each as its own bool mask, in scan order.

    Union-find over the runs of each row: a run joins every run of the previous row it overlaps.
    """
    runs: list[tuple[int, int, int]] = []  # (row, start, end)
    parent: list[int] = []
    prev: list[int] = []  # run ids of the previous row

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for y in range(mask.shape[0]):
        row = np.concatenate(([False], mask[y], [False]))
        edges = np.flatnonzero(row[1:] != row[:-1])
        cur = []
        for s, e in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            rid = len(runs)
            runs.append((y, s, e))
            parent.append(rid)
            for p in prev:
                _, ps, pe = runs[p]
                if ps < e and s < pe:
                    a, b = find(p), find(rid)
                    parent[max(a, b)] = min(a, b)
            cur.append(rid)
        prev = cur
    groups: dict[int, list[int]] = {}
    for rid in range(len(runs)):
        groups.setdefault(find(rid), []).append(rid)
    out = []
    for members in groups.values():
        comp = np.zeros(mask.shape, dtype=bool)
        for rid in members:
            y, s, e = runs[rid]
            comp[y, s:e] = True
        out.append(comp)
    return out


class ColorShapesSegmenter:
    """The segmenter (SAM 3's `segment` signature) behind ColorShapesEngine."""

    def __init__(self, tolerance: int = 64, min_area: int = 16, delay: float = 0.0) -> None:
        self.tolerance = tolerance
        self.min_area = min_area
        self.delay = delay

    def segment(
        self, images: Sequence[object], prompts: Sequence[Sequence[str]], score_threshold: float
    ) -> list[list[list[Instance]]]:
        return [[p.instances for p in per] for per in self.segment_pairs(images, prompts, score_threshold)]

    def segment_pairs(
        self, images: Sequence[object], prompts: Sequence[Sequence[str]], score_threshold: float
    ) -> list[list[PairResult]]:
        if self.delay:
            time.sleep(self.delay * len(images))
        return [
            [self._one(np.asarray(img), p, score_threshold) for p in image_prompts]
            for img, image_prompts in zip(images, prompts, strict=True)
        ]

    def _one(self, image: np.ndarray, prompt: str, score_threshold: float) -> PairResult:
        words = [w.rstrip("s") if w.rstrip("s") in SHAPE_FILL else w for w in prompt.lower().split()]
        colour = next((COLOURS[w] for w in words if w in COLOURS), None)
        shape = next((w for w in words if w in SHAPE_FILL), None)
        if colour is None:
            return PairResult(0.0, [])
        diff = np.abs(image[..., :3].astype(np.int16) - np.asarray(colour, dtype=np.int16))
        found = []
        for comp in components((diff <= self.tolerance).all(axis=-1)):
            area = int(comp.sum())
            if area < self.min_area:
                continue
            ys, xs = np.nonzero(comp)
            x0, y0, x1, y1 = int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1
            score = 1.0
            if shape is not None:
                fill = area / ((x1 - x0) * (y1 - y0))
                score = max(0.0, 1.0 - 4.0 * abs(fill - SHAPE_FILL[shape]))
                if shape in ("square", "circle"):  # and as wide as tall
                    score *= min(x1 - x0, y1 - y0) / max(x1 - x0, y1 - y0)
            found.append((round(score, 6), area, (float(x0), float(y0), float(x1), float(y1)), comp))
        found.sort(key=lambda f: (-f[0], -f[1], f[2][1], f[2][0]))
        presence = found[0][0] if found else 0.0
        kept = [Instance(s, presence, box, comp) for s, _, box, comp in found if s > score_threshold]
        return PairResult(presence, kept)


def ColorShapesEngine(  # noqa: N802 - a factory named like the engine it builds, for --engine
    model_path: str = "",
    batch_size: str = "8",
    input_size: str = "0",
    tolerance: str = "64",
    min_area: str = "16",
    delay: str = "0",
) -> SegmenterEngine:
    """`--engine batchinfer.images.shapes_engine:ColorShapesEngine`; `--engine-arg input_size=N` makes
    the decode workers shrink images to N x N first (masks come back nearest-upsampled); `delay`
    seconds per image stand in for GPU time when rehearsing kills and preemption."""
    size = int(input_size)
    facts = {"engine": "color-shapes", "model": str(model_path), "quantization": "none", "device": "cpu"}
    facts |= {"tolerance": tolerance, "min_area": min_area}
    return SegmenterEngine(
        ColorShapesSegmenter(int(tolerance), int(min_area), float(delay)),
        facts,
        int(batch_size),
        size or None,
    )
