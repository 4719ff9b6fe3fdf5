"""The per-row sampler: greedy, temperature, top-k, top-p, and its (seed, step) randomness."""

import bisect
import math

import pytest
import torch

from batchinfer.engine.api import SamplingParams
from batchinfer.engine.sampling import row_uniform, sample_rows, sample_token

PROBS = torch.tensor([0.1, 0.5, 0.05, 0.3, 0.05])  # sorted: id 1 (0.5), 3 (0.3), 0 (0.1), 2, 4
LOGITS = PROBS.log()


def _counts(params, steps=4000, logits=LOGITS):
    counts = torch.zeros(logits.numel())
    for step in range(steps):
        counts[sample_token(logits, params, step)] += 1
    return counts / steps


def test_greedy_is_argmax_lowest_id_on_ties():
    assert sample_token(LOGITS, SamplingParams(temperature=0.0), step=0) == 1
    assert sample_token(torch.tensor([0.0, 2.0, 2.0]), SamplingParams(), step=5) == 1


def test_row_uniform_is_a_pure_function_of_seed_and_step():
    assert row_uniform(3, 7) == row_uniform(3, 7)
    draws = [row_uniform(42, s) for s in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert len({row_uniform(seed, 0) for seed in range(1000)}) == 1000
    assert row_uniform(-1, 0) == row_uniform(2**64 - 1, 0)  # seeds are taken mod 2^64


def test_draw_inverts_the_cdf_of_sorted_probabilities():
    # sorted descending the CDF is 0.5, 0.8, 0.9, 0.95, 1.0 over ids 1, 3, 0, 2, 4 (stable order on ties)
    bounds, ids = [0.5, 0.8, 0.9, 0.95, 1.0], [1, 3, 0, 2, 4]
    params = SamplingParams(temperature=1.0, seed=11)
    checked = 0
    for step in range(300):
        u = row_uniform(11, step)
        if all(abs(u - b) > 1e-5 for b in bounds):  # fp32 CDF: stay clear of the bounds
            assert sample_token(LOGITS, params, step) == ids[bisect.bisect_right(bounds, u)]
            checked += 1
    assert checked > 290


def test_temperature_one_follows_the_distribution():
    freq = _counts(SamplingParams(temperature=1.0, seed=1))
    torch.testing.assert_close(freq, PROBS, atol=0.03, rtol=0)


def test_top_k_keeps_the_k_most_likely():
    freq = _counts(SamplingParams(temperature=1.0, top_k=2, seed=2))
    torch.testing.assert_close(freq, torch.tensor([0.0, 0.625, 0.0, 0.375, 0.0]), atol=0.03, rtol=0)
    assert all(
        sample_token(LOGITS, SamplingParams(temperature=5.0, top_k=1, seed=3), s) == 1 for s in range(50)
    )


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # mass before ids 1, 3, 0 is 0, 0.5, 0.8: top_p 0.7 keeps {1, 3}, top_p 0.85 keeps {1, 3, 0}
    freq = _counts(SamplingParams(temperature=1.0, top_p=0.7, seed=4))
    torch.testing.assert_close(freq, torch.tensor([0.0, 0.625, 0.0, 0.375, 0.0]), atol=0.03, rtol=0)
    freq = _counts(SamplingParams(temperature=1.0, top_p=0.85, seed=5))
    torch.testing.assert_close(freq, torch.tensor([1 / 9, 5 / 9, 0.0, 3 / 9, 0.0]), atol=0.03, rtol=0)


def test_temperature_sharpens_and_flattens():
    cold = _counts(SamplingParams(temperature=0.5, seed=6))
    hot = _counts(SamplingParams(temperature=2.0, seed=6))
    expected_cold = PROBS**2 / (PROBS**2).sum()
    expected_hot = PROBS.sqrt() / PROBS.sqrt().sum()
    torch.testing.assert_close(cold, expected_cold, atol=0.03, rtol=0)
    torch.testing.assert_close(hot, expected_hot, atol=0.03, rtol=0)
    assert math.isclose(float(hot.sum()), 1.0)


def test_rows_sample_independently():
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    params = [
        SamplingParams(temperature=1.0, seed=9),
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=9),
    ]
    for step in range(20):
        a, b, c = sample_rows(logits, params, [step, step, step])
        assert a == c == sample_token(LOGITS, params[0], step)
        assert b == 3  # greedy on the flipped row: id 1 moves to 3


def test_greedy_rows_in_a_mixed_batch_match_their_own_argmax():
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0], [9.0, 0.0, 0.0, 9.0], [0.0, 0.0, 1.0, 2.0]])
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=4), SamplingParams()]
    tokens = sample_rows(logits, params, [0, 3, 7])
    assert tokens[0] == 1 and tokens[2] == 3  # ties go to the lowest id
    assert tokens[1] == sample_token(logits[1], params[1], 3) and tokens[1] in (0, 3)
    assert sample_rows(logits[:0], [], []) == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_non_finite_or_negative_temperature_is_refused(bad):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=bad)
