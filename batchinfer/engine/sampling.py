"""Per-row token sampling: greedy, temperature, top-k, top-p.

Randomness is a pure function of (row seed, step): each step draws one uniform from a counter-based
hash (splitmix64) and inverts the filtered distribution's CDF. No global or shared RNG is touched, so
a row's tokens depend only on its own logits, seed and step, never on which rows share its batch or on
the device the logits sit on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchinfer.engine.api import SamplingParams

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) that row `seed` uses at generation step `step` (53 random bits)."""
    return (_splitmix64(_splitmix64(seed & _M64) ^ (step & _M64)) >> 11) * 2.0**-53


def sample_token(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Next token id from one row's logits `[V]`.

    temperature 0 is greedy (argmax, lowest id on ties). Otherwise: logits / temperature in fp32, keep
    the `top_k` most likely tokens (0 = all), then the smallest prefix of them whose probability mass
    reaches `top_p`, renormalise and draw with `row_uniform(params.seed, step)`.
    """
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.float() / params.temperature
    sorted_logits, order = torch.sort(scaled, descending=True, stable=True)
    if params.top_k:
        sorted_logits, order = sorted_logits[: params.top_k], order[: params.top_k]
    probs = torch.softmax(sorted_logits, dim=-1)
    if params.top_p < 1.0:
        mass_before = probs.cumsum(-1) - probs
        keep = max(int((mass_before < params.top_p).sum()), 1)
        probs, order = probs[:keep], order[:keep]
    cdf = probs.cumsum(-1)
    u = torch.tensor(row_uniform(params.seed, step), dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    i = int(torch.searchsorted(cdf, u.reshape(1), right=True).clamp(max=cdf.numel() - 1))
    return int(order[i])


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]) -> list[int]:
    """`sample_token` for each row of `logits [B, V]`, row b with `params[b]` at step `steps[b]`.

    Greedy rows share one argmax and one device-to-host copy instead of one each.
    """
    greedy = [b for b, p in enumerate(params) if p.temperature == 0]
    tokens = dict(zip(greedy, logits[greedy].argmax(-1).tolist() if greedy else [], strict=True))
    return [
        tokens[b] if b in tokens else sample_token(logits[b], p, s)
        for b, (p, s) in enumerate(zip(params, steps, strict=True))
    ]
