"""The reference `TextEngine`: tokenise, check, batch, generate on the pure-PyTorch model, detokenise.

It is the engine the job layer uses on machines without a GPU and the yardstick for the fast one.
Bad rows (empty, malformed chat, too long for the context) come back as `skipped`/`error` results;
only a failure of the model itself raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from batchinfer.engine.api import SamplingParams, TextRequest, TextResult
from batchinfer.errors import ConfigError, InputError
from batchinfer.models.config import ModelConfig
from batchinfer.models.generate import GenerationOutput, StepCallback, generate
from batchinfer.models.qwen_moe import QwenMoeModel
from batchinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DEFAULT_MAX_BATCH_SIZE = 16


@dataclass(slots=True)
class _Row:
    index: int
    prompt_ids: list[int]
    sampling: SamplingParams


def context_limit(config: ModelConfig, max_model_len: int | None, model_path: str) -> int:
    """The context limit (prompt + max_tokens) to enforce: `max_model_len` if given, which may only
    lower the model's `max_position_embeddings`."""
    limit = config.max_position_embeddings
    if max_model_len is not None and not 0 < max_model_len <= limit:
        raise ConfigError(
            f"max_model_len {max_model_len} must be in 1..{limit} "
            f"(the max_position_embeddings of {model_path})"
        )
    return max_model_len or limit


class ReferenceEngine:
    """`TextEngine` over `QwenMoeModel` and `batchinfer.models.generate`.

    Rows run in batches of at most `max_batch_size`, grouped by prompt length to keep padding small;
    a row's output does not depend on its batch (per-row seeded sampling, finished rows dropped).
    """

    def __init__(
        self,
        model: QwenMoeModel,
        tokenizer: Tokenizer,
        model_path: str,
        quantization: str,
        max_model_len: int | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.quantization = quantization
        self.max_model_len = context_limit(model.config, max_model_len, model_path)
        self._limit_source = "max_model_len" if max_model_len else "max_position_embeddings"
        self.max_batch_size = max_batch_size
        self.stop_token_ids = frozenset(tokenizer.eos_token_ids)

    def describe(self) -> dict[str, str]:
        return {
            "model": self.model_path,
            "model_type": self.model.config.model_type,
            "quantization": self.quantization,
            "engine": "reference",
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
        }

    def generate(
        self, requests: Sequence[TextRequest], on_tokens: Callable[[int], None] | None = None
    ) -> Iterator[TextResult]:
        """Yield bad rows' results first, then each batch's results as the batch finishes."""
        rows: list[_Row] = []
        for req in requests:
            prepared = self._prepare(req)
            if isinstance(prepared, TextResult):
                yield prepared
            else:
                rows.append(prepared)
        rows.sort(key=lambda r: len(r.prompt_ids))
        for start in range(0, len(rows), self.max_batch_size):
            yield from self._run_batch(rows[start : start + self.max_batch_size], on_tokens)

    def _prepare(self, req: TextRequest) -> _Row | TextResult:
        """Token ids of a runnable row, or the row's `skipped`/`error` result."""
        if req.prompt is not None and req.messages is not None:
            return _failed(req, "error", "request has both a prompt and messages; give exactly one")
        if not req.prompt and not req.messages:
            what = "messages list" if req.messages is not None else "prompt"
            return _failed(req, "skipped", f"empty {what}")
        try:
            ids = (
                self.tokenizer.encode_chat(req.messages)
                if req.messages
                else self.tokenizer.encode(req.prompt)
            )
        except InputError as e:
            return _failed(req, "error", str(e))
        if not ids:
            return _failed(req, "skipped", "the prompt encodes to no tokens")
        vocab = self.model.config.vocab_size
        bad = sorted({t for t in ids if t >= vocab})
        if bad:
            return _failed(
                req,
                "error",
                f"prompt token ids {bad[:5]} are outside the model's vocab_size {vocab} "
                "(tokenizer and checkpoint do not match)",
                len(ids),
            )
        total = len(ids) + req.sampling.max_tokens
        if total > self.max_model_len:
            return _failed(
                req,
                "skipped",
                f"prompt of {len(ids)} tokens + max_tokens {req.sampling.max_tokens} = {total} exceeds the "
                f"context limit {self.max_model_len} ({self._limit_source})",
                len(ids),
            )
        return _Row(req.index, ids, req.sampling)

    def _generate(
        self, prompts: list[list[int]], params: list[SamplingParams], on_step: StepCallback
    ) -> list[GenerationOutput]:
        """Token generation for one batch (the fast engine overrides this with its own loop)."""
        return generate(self.model, prompts, params, self.stop_token_ids, on_step)

    def _run_batch(self, rows: list[_Row], on_tokens: Callable[[int], None] | None) -> list[TextResult]:
        started = time.perf_counter()
        # generate() names rows by their position in this batch.
        detoks = [self.tokenizer.detokenizer(r.prompt_ids, r.sampling.stop) for r in rows]

        def on_step(step_tokens: dict[int, int]) -> list[int]:
            if on_tokens is not None:
                on_tokens(len(step_tokens))
            stopped = []
            for pos, token in step_tokens.items():
                if token in self.stop_token_ids and not rows[pos].sampling.ignore_eos:
                    continue  # the EOS token ends the row; it is not part of the text
                detoks[pos].add(token)
                if detoks[pos].stopped:
                    stopped.append(pos)
            return stopped

        outputs = self._generate([r.prompt_ids for r in rows], [r.sampling for r in rows], on_step)
        results = []
        for row, out, detok in zip(rows, outputs, detoks, strict=True):
            detok.finish()
            results.append(
                TextResult(
                    index=row.index,
                    text=detok.text,
                    finish_reason=out.finish_reason,
                    prompt_tokens=len(row.prompt_ids),
                    output_tokens=len(out.token_ids),
                    token_ids=out.token_ids,
                )
            )
        generated = sum(r.output_tokens for r in results)
        seconds = time.perf_counter() - started
        log.info(
            "batch of %d rows (prompts %d..%d tokens): %d tokens generated in %.1f s (%.1f tok/s)",
            len(rows),
            len(rows[0].prompt_ids),
            len(rows[-1].prompt_ids),
            generated,
            seconds,
            generated / max(seconds, 1e-9),
        )
        return results


def _failed(req: TextRequest, reason: str, message: str, prompt_tokens: int = 0) -> TextResult:
    return TextResult(
        index=req.index,
        text="",
        finish_reason=reason,
        prompt_tokens=prompt_tokens,
        output_tokens=0,
        error=message,
    )
