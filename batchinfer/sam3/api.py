"""The narrow interface between the image job layer and the SAM 3 model.

The job layer hands the model decoded images (uint8 [H, W, 3] tensors, any size) and, per image,
a list of text prompts; it gets back, per image and per prompt, the instances whose score passes
the threshold. This module imports no torch at run time, so the job layer can import it cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Instance:
    """One detected instance of a prompt's concept in one image.

    `score` = sigmoid(query logit) * sigmoid(presence logit), the number the threshold is applied to.
    `presence` = sigmoid(presence logit), shared by every instance of the same (image, prompt) pair.
    `box_xyxy` = (x0, y0, x1, y1) in pixels of the original image, clamped to [0, W] x [0, H].
    `mask` = bool [H, W] at the original image's resolution (CPU tensor).
    """

    score: float
    presence: float
    box_xyxy: tuple[float, float, float, float]
    mask: torch.Tensor


@dataclass(slots=True)
class PairResult:
    """Everything about one (image, prompt) pair, also when nothing passed the threshold: `presence`
    (sigmoid of the presence logit) says how sure the model is that the concept is in the image."""

    presence: float
    instances: list[Instance]


class ImageSegmenter(Protocol):
    """What the image job layer needs from a SAM 3 model."""

    def segment(
        self,
        images: Sequence[torch.Tensor],
        prompts: Sequence[Sequence[str]],
        score_threshold: float,
    ) -> list[list[list[Instance]]]:
        """Per image, per prompt: instances with score > score_threshold, highest score first."""
        ...
