"""The narrow interface between the job layer and any text engine (reference CPU or fast GPU).

The job layer hands an engine a list of requests and gets one result per request back, in any
order, matched by `index`. Bad rows are data, not exceptions: an over-long or empty prompt or a
malformed message list comes back as a result with `finish_reason` "skipped" or "error" and the
reason in `error`. Only a dead engine raises. This module imports no torch, so the job layer can
import it cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

FINISH_REASONS = ("stop", "length", "error", "skipped")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int = 0  # the row's own seed; the job layer derives it from (job seed, row id) if absent
    stop: list[str] = field(default_factory=list)  # stop strings, in addition to the model's EOS tokens
    ignore_eos: bool = False  # benchmarks generate exactly max_tokens

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(slots=True)
class TextRequest:
    index: int  # the caller's handle, returned unchanged in the result
    prompt: str | None = None  # exactly one of prompt / messages
    messages: list[dict[str, Any]] | None = (
        None  # chat messages [{role, content}], rendered by the chat template
    )
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(slots=True)
class TextResult:
    index: int
    text: str
    finish_reason: str  # one of FINISH_REASONS
    prompt_tokens: int
    output_tokens: int
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)


class TextEngine(Protocol):
    """What the job layer needs from an engine."""

    def describe(self) -> dict[str, str]:
        """Facts recorded in output metadata: model path, quantization, engine name, device."""
        ...

    def generate(
        self, requests: Sequence[TextRequest], on_tokens: Callable[[int], None] | None = None
    ) -> Iterator[TextResult]:
        """Yield one result per request (any order). `on_tokens(n)` reports n newly generated tokens."""
        ...


# ---- image path: concept segmentation (issue 7) ----


@dataclass(slots=True)
class Instance:
    """One detected instance of a prompt's concept. `batchinfer.sam3.api.Instance` has the same fields.

    `score` in [0, 1] (the number the score threshold applies to); `presence` = probability that the
    concept is in the image at all; `box_xyxy` in original-image pixels; `mask` bool [H, W] at the
    original resolution (numpy array or CPU tensor).
    """

    score: float
    presence: float
    box_xyxy: tuple[float, float, float, float]
    mask: Any


@dataclass(slots=True)
class ImageRequest:
    index: int  # the caller's handle, returned unchanged in the result
    image: Any  # numpy uint8 [h, w, 3] RGB; resized to input_size x input_size when the engine sets one
    height: int  # original size: boxes and masks come back at this size
    width: int
    prompts: list[str]  # distinct, non-empty


@dataclass(slots=True)
class ImageResult:
    index: int
    instances: list[list[Any]]  # per prompt (request order): Instance-like objects, highest score first
    presence: list[float | None]  # per prompt; None when the engine only reports it with instances
    error: str | None = None  # the image failed in the engine (then instances and presence are empty)


class ImageEngine(Protocol):
    """What the image job layer needs from a segmentation engine."""

    batch_size: int  # images per `segment` call
    input_size: int | None  # square side the CPU decode workers resize to; None = original images

    def describe(self) -> dict[str, str]:
        """Facts recorded in output metadata: model path, precision, engine name, device."""
        ...

    def segment(self, requests: Sequence[ImageRequest], score_threshold: float) -> Iterator[ImageResult]:
        """Yield one result per request (any order), keeping instances with score > score_threshold."""
        ...
