"""The accuracy lock of every benchmark run: no speed figure from wrong output.

A sample of the engine's own generated sequences is teacher-forced through the fp32 reference model
(`teacher_forcing_logits`, same weights, quantized ones dequantized) and every generated token is
checked at its position:

* Greedy within tolerance: token `t` at a position whose reference logits are `z` passes when
  `max(z) - z[t] <= TOL_STD * std(z)`. Why 0.5: a bf16 engine flips near-ties of the fp32 reference.
  Measured on the tiny presets (bf16 activations, bf16 / mixed / nvfp4 weights, 38,646 teacher-forced
  positions each, logit relative L2 error 0.9e-2..1.6e-2 against this reference): 1.5-2% of the
  bf16 argmaxes differ from the fp32 ones, the worst by 0.18-0.21 std, 99.9% within 0.06 std. Issue 6
  lets the kernels reach relative L2 2e-2 at real depth, so the bound sits ~2.5x above the worst
  measured flip. A wrong token lies far outside it: a random id sits about 3 std below the max for a
  512-token vocab and 4.5 std for 150k. The lock catches wrong output, not small numeric drift:
  a kernel a few times over the error budget can still pass it, which is what the kernel-exactness
  test (relative L2 of teacher-forced logits) is for. std rather than rms keeps the test blind to a
  constant shift of the logits.
* Degenerate output: a *repeat stretch* is a span of generated tokens with period p <= MAX_PERIOD
  (`out[j] == out[j - p]` throughout) covering at least MIN_REPEAT tokens (32 copies of one token,
  or an 8-gram four times). Random-weight models do loop under greedy decoding; a stretch is excused
  only when the reference's strict argmax equals the generated token at >= EXCUSE_AGREEMENT of its
  positions (the reference would produce the loop itself). Otherwise the run fails, even if every
  token passed the tolerance.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from batchinfer.errors import BatchinferError
from batchinfer.models.generate import teacher_forcing_logits
from batchinfer.models.qwen_moe import QwenMoeModel

log = logging.getLogger(__name__)
TOL_STD = 0.5
MIN_SAMPLE = 16
MAX_PERIOD = 8
MIN_REPEAT = 32
EXCUSE_AGREEMENT = 0.9
_MAX_LISTED = 5
# A teacher-forcing forward takes sampled sequences until it would return more logit rows or run more
# padded tokens than these. The reference dequantizes every weight once a forward (40 layers x 256
# experts x 3 matrices on Qwen3.6), and one forward a sequence took the lock ~80 s on Qwen3.6's `offline`
# (H200, session 16); how much of that the grouping saves is not measured yet.
LOCK_LOGIT_ROWS = 2048  # fp32 [rows, V]: 2 GB at Qwen3.6's V = 248,320
LOCK_TOKENS = 32768


class AccuracyLockError(BatchinferError):
    """The benchmarked engine's output is not what the reference model would generate."""


@dataclass(slots=True)
class LockResult:
    passed: bool
    sequences: list[int]  # request indices checked
    positions: int  # generated tokens checked
    top1_agreement: float  # fraction of checked tokens equal to the reference's strict argmax
    max_gap_std: float  # worst (max(z) - z[t]) / std(z) over checked tokens
    tol_std: float = TOL_STD
    failures: list[str] = field(default_factory=list)  # first few offending positions, readable
    repeats: list[str] = field(default_factory=list)  # repeat stretches found, excused or not

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_indices(n: int, size: int = MIN_SAMPLE) -> list[int]:
    """`size` request indices spread evenly over `n` requests (all of them when n <= size)."""
    if n <= size:
        return list(range(n))
    return sorted({round(i * (n - 1) / (size - 1)) for i in range(size)})


def repeat_stretches(tokens: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal `(start, end, period)` spans with `tokens[j] == tokens[j - period]` for start+period <= j <
    end, covering >= MIN_REPEAT tokens, smallest period first; a span inside an earlier one is dropped."""
    found: list[tuple[int, int, int]] = []
    n = len(tokens)
    for p in range(1, MAX_PERIOD + 1):
        j = p
        while j < n:
            if tokens[j] != tokens[j - p]:
                j += 1
                continue
            k = j
            while k < n and tokens[k] == tokens[k - p]:
                k += 1
            start, end = j - p, k
            if end - start >= MIN_REPEAT and not any(s <= start and end <= e for s, e, _ in found):
                found.append((start, end, p))
            j = k
    return found


def check_positions(logits: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per generated token: its gap below the reference's max in std units, and whether it is the argmax.

    `logits [G, V]`: the reference's fp32 logits predicting each of the G generated `tokens`.
    """
    t = torch.as_tensor(list(tokens), dtype=torch.int64, device=logits.device)
    chosen = logits.gather(1, t[:, None])[:, 0]
    top = logits.max(dim=1)
    gap = (top.values - chosen) / logits.std(dim=1).clamp_min(1e-12)
    return gap.cpu(), (top.indices == t).cpu()


def lock_groups(lens: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Consecutive groups of the sampled sequences, `lens[i] = (tokens, generated)`, one teacher-forcing
    forward each: within LOCK_LOGIT_ROWS generated rows and LOCK_TOKENS padded tokens (a sequence over
    either alone still gets a forward of its own)."""
    groups: list[list[int]] = []
    rows = longest = 0
    for i, (tokens, generated) in enumerate(lens):
        if (
            groups
            and rows + generated <= LOCK_LOGIT_ROWS
            and (len(groups[-1]) + 1) * max(longest, tokens) <= LOCK_TOKENS
        ):
            groups[-1].append(i)
            rows, longest = rows + generated, max(longest, tokens)
        else:
            groups.append([i])
            rows, longest = generated, tokens
    return groups


def _judge(
    i: int, out: list[int], gap: torch.Tensor, top1: torch.Tensor, failures: list[str], repeats: list[str]
) -> bool:
    """Record request i's tokens off tolerance and its repeat stretches; True when a stretch is degenerate."""
    for pos in (gap > TOL_STD).nonzero()[:, 0].tolist():
        if len(failures) < _MAX_LISTED:
            failures.append(
                f"request {i} output token {pos}: id {out[pos]} is {float(gap[pos]):.3f} std below the "
                f"reference's best (tolerance {TOL_STD})"
            )
    degenerate = False
    for start, end, period in repeat_stretches(out):
        agreement = float(top1[start:end].float().mean())
        excused = agreement >= EXCUSE_AGREEMENT
        degenerate |= not excused
        repeats.append(
            f"request {i} output tokens {start}..{end - 1}: period {period}, reference argmax agrees at "
            f"{agreement:.0%} ({'excused' if excused else 'degenerate'})"
        )
    return degenerate


def accuracy_lock(
    reference: QwenMoeModel,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    sample: int = MIN_SAMPLE,
) -> LockResult:
    """Teacher-force a sample of (prompt, generated) pairs through `reference` and judge every generated
    token (module docstring). Several sequences a forward (`lock_groups`), logits of the generated
    positions only."""
    indices = sample_indices(len(prompts), max(sample, MIN_SAMPLE))
    failures = [f"request {i}: no generated tokens" for i in indices if not outputs[i]]
    repeats: list[str] = []
    positions, agree, worst = 0, 0, 0.0
    degenerate = False
    checked = [i for i in indices if outputs[i]]
    lens = [(len(prompts[i]) + len(outputs[i]) - 1, len(outputs[i])) for i in checked]
    for group in lock_groups(lens):
        rows = [checked[g] for g in group]
        seqs = [list(prompts[i]) + list(outputs[i])[:-1] for i in rows]
        logits = teacher_forcing_logits(reference, seqs, [len(prompts[i]) - 1 for i in rows])
        for i, row_logits in zip(rows, logits, strict=True):
            out = list(outputs[i])
            gap, top1 = check_positions(row_logits, out)
            positions += len(out)
            degenerate |= _judge(i, out, gap, top1, failures, repeats)
            agree += int(top1.sum())
            worst = max(worst, float(gap.max()))
        del logits
    off_tolerance = worst > TOL_STD or any("no generated" in f for f in failures)
    result = LockResult(
        passed=not off_tolerance and not degenerate,
        sequences=indices,
        positions=positions,
        top1_agreement=agree / max(positions, 1),
        max_gap_std=worst,
        failures=failures,
        repeats=repeats,
    )
    log.info(
        "accuracy lock: %s over %d sequences, %d tokens, top-1 %.4f, worst gap %.3f std",
        "passed" if result.passed else "FAILED",
        len(indices),
        positions,
        result.top1_agreement,
        worst,
    )
    return result
