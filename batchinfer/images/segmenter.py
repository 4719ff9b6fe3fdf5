"""`SegmenterEngine`: turns a model with SAM 3's `segment(images, prompts, score_threshold)` method
(`batchinfer.sam3.api.ImageSegmenter`) into the `ImageEngine` the job layer calls. When the model also
has `segment_pairs` (same arguments; per image and prompt a `PairResult(presence, instances)`, as
`Sam3Model` does), that is used, so prompts without instances still get their presence score.

The segmenter takes uint8 [H, W, 3] tensors of any size and returns, per image and prompt, instances at
that image's size. With `input_size` set, the CPU decode workers hand over images already resized to a
square; boxes are then scaled and masks resized (nearest) back to the original size, which is only
right for engines whose masks are coarse anyway (the colour-shapes dry run). SAM 3 upsamples its mask
logits to the original size itself, so it runs with `input_size=None`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from batchinfer.engine.api import ImageRequest, ImageResult, Instance

log = logging.getLogger(__name__)


class SegmenterEngine:
    def __init__(
        self,
        segmenter: Any,
        facts: dict[str, str],
        batch_size: int = 8,
        input_size: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if input_size is not None and input_size < 1:
            raise ValueError(f"input_size must be >= 1 or None, got {input_size}")
        self.segmenter = segmenter
        self.facts = dict(facts)
        self.batch_size = batch_size
        self.input_size = input_size

    def describe(self) -> dict[str, str]:
        return {**self.facts, "batch_size": str(self.batch_size), "input_size": str(self.input_size)}

    def segment(self, requests: Sequence[ImageRequest], score_threshold: float) -> Iterator[ImageResult]:
        if not requests:
            return
        images = [torch.from_numpy(np.ascontiguousarray(r.image)) for r in requests]
        prompts = [r.prompts for r in requests]
        pairs = getattr(self.segmenter, "segment_pairs", None)
        if pairs is not None:  # also the presence of prompts without instances (sam3.api.PairResult)
            found = [
                [(p.instances, p.presence) for p in per] for per in pairs(images, prompts, score_threshold)
            ]
        else:
            found = [
                [(insts, insts[0].presence if insts else None) for insts in per]
                for per in self.segmenter.segment(images, prompts, score_threshold)
            ]
        if len(found) != len(requests):
            raise RuntimeError(f"segmenter returned {len(found)} results for {len(requests)} images")
        for req, per_prompt in zip(requests, found, strict=True):
            if len(per_prompt) != len(req.prompts):
                raise RuntimeError(
                    f"segmenter returned {len(per_prompt)} prompt results for request {req.index} "
                    f"with {len(req.prompts)} prompts"
                )
            instances = [[self._to_original(i, req) for i in insts] for insts, _ in per_prompt]
            presence = [None if p is None else float(p) for _, p in per_prompt]
            yield ImageResult(req.index, instances, presence)

    def _to_original(self, inst: Any, req: ImageRequest) -> Instance:
        """The instance at the original image size (a no-op when images were not resized)."""
        mask = inst.mask.numpy() if isinstance(inst.mask, torch.Tensor) else np.asarray(inst.mask)
        h, w = mask.shape
        box = tuple(float(v) for v in inst.box_xyxy)
        if (h, w) != (req.height, req.width):
            sy, sx = req.height / h, req.width / w
            rows = np.minimum((np.arange(req.height) + 0.5) / sy, h - 1).astype(np.int64)
            cols = np.minimum((np.arange(req.width) + 0.5) / sx, w - 1).astype(np.int64)
            mask = mask[rows][:, cols]
            box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        return Instance(float(inst.score), float(inst.presence), box, mask.astype(bool, copy=False))
