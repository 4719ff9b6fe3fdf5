"""The GPU engine behind the job layer: the reference engine's request handling (tokenise, check,
detokenise, stop strings) with `FastGenerator`'s slots, CUDA graphs and Triton kernels doing the work.

`batchinfer run` uses it by default on a machine with CUDA (`--engine-arg engine=reference` for the
yardstick instead).
"""

from __future__ import annotations

import sys

from batchinfer.engine.api import SamplingParams
from batchinfer.engine.fast import FastGenerator
from batchinfer.engine.reference import ReferenceEngine
from batchinfer.models.generate import GenerationOutput, StepCallback
from batchinfer.tokenizer import Tokenizer


class FastEngine(ReferenceEngine):
    """`TextEngine` on `FastGenerator`: every runnable row of a call goes to the generator at once, which
    schedules them over its slots itself."""

    def __init__(
        self,
        generator: FastGenerator,
        tokenizer: Tokenizer,
        model_path: str,
        quantization: str,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(
            generator.model,
            tokenizer,
            model_path,
            quantization,
            max_model_len,  # type: ignore[arg-type]
            max_batch_size=sys.maxsize,
        )
        self.generator = generator

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "engine": "fast", "max_slots": str(self.generator.max_slots)}

    def _generate(
        self, prompts: list[list[int]], params: list[SamplingParams], on_step: StepCallback
    ) -> list[GenerationOutput]:
        return self.generator.generate(prompts, params, self.stop_token_ids, on_step)
