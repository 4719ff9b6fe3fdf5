"""The accuracy lock: sampling, repeat stretches, tolerance and the degenerate-output rule."""

from __future__ import annotations

import pytest
import torch

from batchinfer.bench import accuracy_lock as lock_mod
from batchinfer.bench.accuracy_lock import (
    TOL_STD,
    accuracy_lock,
    check_positions,
    lock_groups,
    repeat_stretches,
    sample_indices,
)


def test_sample_indices_spread_and_cover_small_runs():
    assert sample_indices(5) == [0, 1, 2, 3, 4]
    picked = sample_indices(2048)
    assert len(picked) == 16 and picked[0] == 0 and picked[-1] == 2047
    assert (
        sample_indices(100, 32) == sorted(set(sample_indices(100, 32))) and len(sample_indices(100, 32)) == 32
    )


def test_repeat_stretches():
    assert repeat_stretches([7] * 31 + [1, 2, 3]) == []  # 31 copies: below MIN_REPEAT
    assert repeat_stretches([1, 2] + [7] * 32 + [3]) == [(2, 34, 1)]
    gram = [4, 5, 6, 7, 8, 9, 10, 11]
    assert repeat_stretches([0] + gram * 4) == [(1, 33, 8)]
    assert repeat_stretches(list(range(100))) == []
    # one token repeated is also period 2..8: only the smallest period is listed
    assert repeat_stretches([3] * 40) == [(0, 40, 1)]
    assert repeat_stretches(list(range(9)) * 4) == []  # a 9-gram is beyond MAX_PERIOD


def test_check_positions_gap_in_std_units():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 1.0, 1.0, 1.0]])
    gap, top1 = check_positions(logits, [3, 0])
    std0 = float(logits[0].std())
    assert gap.tolist() == pytest.approx([1.0 / std0, 0.0])
    assert top1.tolist() == [False, True]


def _fake_reference(monkeypatch, rows: list[torch.Tensor]):
    """teacher_forcing_logits replaced by fixed logits for the generated positions (prompt of 1 token)."""

    def fake(model, sequences, starts):
        assert starts == [0] * len(sequences)  # prompts of one token: every position is a generated one
        return [rows.pop(0) for _ in sequences]

    monkeypatch.setattr(lock_mod, "teacher_forcing_logits", fake)


def _logits(best: list[int], chosen: list[int], gap_std: float, vocab: int = 64) -> torch.Tensor:
    """[G, V] logits whose argmax is `best[g]` and where `chosen[g]` sits `gap_std` std below it."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(len(best), vocab, generator=g)
    for i, (b, c) in enumerate(zip(best, chosen, strict=True)):
        z[i, b] = z[i].max() + 3.0
        if c != b:
            z[i, c] = z[i, b] - gap_std * z[i].std()  # close enough: std moves little with one entry
    return z


def test_near_ties_pass_wrong_tokens_fail(monkeypatch):
    n = 10
    best = list(range(1, n + 1))
    chosen = best[:]
    chosen[4] = 40  # one near-tie flipped at 0.1 std
    _fake_reference(monkeypatch, [_logits(best, chosen, 0.1)])
    ok = accuracy_lock(None, [[0]], [chosen])
    assert ok.passed and ok.positions == n and ok.top1_agreement == pytest.approx(0.9)
    assert 0.05 < ok.max_gap_std < TOL_STD and ok.failures == []

    chosen[7] = 41  # and one token 2 std below the best
    _fake_reference(monkeypatch, [_logits(best, chosen, 2.0)])
    bad = accuracy_lock(None, [[0]], [chosen])
    assert not bad.passed and len(bad.failures) == 2
    assert bad.failures[0].startswith("request 0 output token 4: id 40 is ")


def test_degenerate_loop_fails_unless_the_reference_agrees(monkeypatch):
    out = [5, 6] + [9] * 38  # 38 copies of one token
    # every 9 is within tolerance but the reference's argmax is another token at each of them
    best = [5, 6] + [10 + i for i in range(38)]
    _fake_reference(monkeypatch, [_logits(best, out, 0.1)])
    res = accuracy_lock(None, [[0]], [out])
    assert not res.passed and res.failures == [] and res.max_gap_std < TOL_STD
    assert res.repeats == [
        "request 0 output tokens 2..39: period 1, reference argmax agrees at 0% (degenerate)"
    ]
    # the same loop, produced by the reference itself: excused
    _fake_reference(monkeypatch, [_logits(out, out, 0.0)])
    res = accuracy_lock(None, [[0]], [out])
    assert res.passed and res.repeats[0].endswith("agrees at 100% (excused)")


def test_empty_output_fails(monkeypatch):
    _fake_reference(monkeypatch, [])
    res = accuracy_lock(None, [[0, 1]], [[]])
    assert not res.passed and res.failures == ["request 0: no generated tokens"]


def test_lock_groups_keep_within_both_budgets(monkeypatch):
    monkeypatch.setattr(lock_mod, "LOCK_LOGIT_ROWS", 100)
    monkeypatch.setattr(lock_mod, "LOCK_TOKENS", 400)
    # (tokens, generated): rows 60 + 30 fit, + 20 would pass 100; 3 x 150 tokens would pass 400;
    # a sequence over a budget alone gets its own forward
    lens = [(100, 60), (120, 30), (50, 20), (150, 10), (150, 10), (150, 10), (900, 500), (10, 5)]
    assert lock_groups(lens) == [[0, 1], [2, 3], [4, 5], [6], [7]]
    assert lock_groups([]) == []


def test_grouped_lock_judges_as_one_sequence_a_forward(monkeypatch):
    """The lock on the tiny reference model: several sequences a forward give the same verdict and
    figures as one a forward (the figures within fp32 rounding of differently batched GEMMs)."""
    from models_tiny import VOCAB, hf_canonical, hf_model

    from batchinfer.engine.api import SamplingParams
    from batchinfer.models.generate import generate
    from batchinfer.models.qwen_moe import QwenMoeModel

    config, weights = hf_canonical(hf_model("qwen3_5_moe"))
    model = QwenMoeModel(config, weights)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 70, 12, 1)]
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 3, 66, 20)]
    # the reference's own greedy continuations pass with every token its argmax: the logits line up
    # with the generated tokens in every group
    greedy = [
        o.token_ids
        for o in generate(
            model, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 3, 66, 20)]
        )
    ]
    own = accuracy_lock(model, prompts, greedy, sample=4)
    assert own.passed and own.top1_agreement == 1.0 and own.positions == 98 and own.max_gap_std == 0.0
    shifted = accuracy_lock(model, prompts, [g[1:] + g[:1] for g in greedy], sample=4)  # off by one token
    assert not shifted.passed and shifted.top1_agreement < 0.9  # tiny-model greedy output loops: some agree
    grouped = accuracy_lock(model, prompts, outputs, sample=4)
    monkeypatch.setattr(lock_mod, "LOCK_LOGIT_ROWS", 1)
    assert lock_groups([(80, 9), (72, 3)]) == [[0], [1]]
    alone = accuracy_lock(model, prompts, outputs, sample=4)
    assert grouped.positions == alone.positions == 98
    assert grouped.top1_agreement == alone.top1_agreement and grouped.failures == alone.failures
    assert grouped.max_gap_std == pytest.approx(alone.max_gap_std, rel=1e-4)
    assert not grouped.passed  # random outputs are far from the reference's choices
