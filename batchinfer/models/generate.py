"""Batched generation and teacher forcing on the reference model.

`generate` prefills all prompts in one right-padded batch, then decodes one token per active row per
step. A row that finishes is dropped from the batch and its cache, so it neither slows nor changes
the others; sampling is per row and keyed on (seed, step), so a row's output does not depend on the
rows it is batched with.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from batchinfer.engine.api import SamplingParams
from batchinfer.engine.sampling import sample_rows
from batchinfer.models.qwen_moe import QwenMoeModel

# Called once per step with {request index: token just sampled} for the rows still running; returns
# the indices of those to stop now (finish_reason "stop"), e.g. when a stop string appeared in the
# detokenized text. Other indices are ignored.
StepCallback = Callable[[dict[int, int]], Collection[int] | None]


@dataclass(slots=True)
class GenerationOutput:
    token_ids: list[int]  # generated tokens; ends with the stop token when finish_reason is "stop" by token
    finish_reason: str  # "stop" (stop token or stopped by on_step) or "length" (max_tokens reached)


def _right_padded(sequences: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    lengths = [len(s) for s in sequences]
    ids = torch.zeros(len(sequences), max(lengths), dtype=torch.int64)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.int64)
    return ids.to(device), lengths


def _check_prompts(model: QwenMoeModel, sequences: Sequence[Sequence[int]]) -> None:
    vocab = model.config.vocab_size
    for i, s in enumerate(sequences):
        if not s:
            raise ValueError(f"sequence {i} is empty")
        bad = [t for t in s if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"sequence {i} has token ids outside 0..{vocab - 1}: {bad[:5]}")


def generate(
    model: QwenMoeModel,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    stop_token_ids: Collection[int] = frozenset(),
    on_step: StepCallback | None = None,
) -> list[GenerationOutput]:
    """Generate for each prompt (token ids) with its own sampling params; one output per prompt, in order.

    A row stops at the first token in `stop_token_ids` (unless its `ignore_eos`), when `on_step`
    says so, or after `max_tokens` tokens. `SamplingParams.stop` strings are the caller's business
    (through `on_step`): this layer only sees token ids.
    """
    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    if not prompts:
        return []
    _check_prompts(model, prompts)
    capacity = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
    cache = model.new_cache(len(prompts), capacity)
    ids, lengths = _right_padded(prompts, model.device)
    logits = model.forward(ids, cache, lengths, all_logits=False)  # [B, V]

    outputs: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    active = list(range(len(prompts)))  # request index of each cache row
    while True:
        tokens = sample_rows(logits, [params[r] for r in active], [len(outputs[r]) for r in active])
        for r, token in zip(active, tokens, strict=True):
            outputs[r].append(token)
            if token in stop_token_ids and not params[r].ignore_eos:
                reasons[r] = "stop"
            elif len(outputs[r]) >= params[r].max_tokens:
                reasons[r] = "length"
        if on_step is not None:
            step_tokens = dict(zip(active, tokens, strict=True))
            for r in on_step(step_tokens) or ():
                if r in step_tokens:  # a stop string on the last allowed token still counts as "stop"
                    reasons[r] = "stop"
        keep = [row for row, r in enumerate(active) if reasons[r] is None]
        if not keep:
            break
        if len(keep) < len(active):
            cache.select(torch.tensor(keep, dtype=torch.int64))
            active = [active[row] for row in keep]
        next_ids = torch.tensor([[outputs[r][-1]] for r in active], dtype=torch.int64, device=model.device)
        logits = model.forward(next_ids, cache, all_logits=False)
    return [GenerationOutput(out, reason) for out, reason in zip(outputs, reasons, strict=True)]


def teacher_forcing_logits(
    model: QwenMoeModel, sequences: Sequence[Sequence[int]], starts: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """fp32 logits `[len(s) - start, V]` at each sequence's positions from `starts[i]` on (default 0), in
    one batched forward.

    Row t holds the prediction for the token after position start + t. This is the yardstick the fast
    engines are compared to. Only the asked rows' logits are formed (`[V]` fp32 each: 1 MB at V = 248k).
    """
    if not sequences:
        return []
    _check_prompts(model, sequences)
    starts = [0] * len(sequences) if starts is None else list(starts)
    for i, (s, start) in enumerate(zip(sequences, starts, strict=True)):
        if not 0 <= start < len(s):
            raise ValueError(f"sequence {i}: start {start} outside its {len(s)} positions")
    ids, lengths = _right_padded(sequences, model.device)
    pos = torch.arange(ids.shape[1])
    wanted = (pos >= torch.tensor(starts)[:, None]) & (pos < torch.tensor(lengths)[:, None])
    cache = model.new_cache(len(sequences), ids.shape[1])
    logits = model.forward(ids, cache, lengths, logits_at=wanted)  # [N, V], row by row
    return list(logits.float().split([n - s for n, s in zip(lengths, starts, strict=True)]))
