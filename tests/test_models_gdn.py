"""Gated DeltaNet pieces: chunked vs recurrent delta rule, a hand-computed case, padding, conv state."""

import math

import pytest
import torch

from batchinfer.models.gdn import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule


def _inputs(B=2, T=150, Hv=3, Dk=8, Dv=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hv, Dk, generator=gen)
    k = torch.randn(B, T, Hv, Dk, generator=gen)
    v = torch.randn(B, T, Hv, Dv, generator=gen)
    g = -torch.rand(B, T, Hv, generator=gen) * 0.5  # log decay in (-0.5, 0]
    beta = torch.rand(B, T, Hv, generator=gen)
    state = torch.randn(B, Hv, Dk, Dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_chunked_equals_recurrent(T):
    q, k, v, g, beta, state = _inputs(T=T)
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    o_chk, s_chk = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert o_chk.shape == (2, T, 3, 5) and s_chk.dtype == torch.float32
    torch.testing.assert_close(o_chk, o_rec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_chk, s_rec, rtol=1e-5, atol=1e-5)


def test_chunk_size_does_not_matter():
    q, k, v, g, beta, state = _inputs(T=100)
    o64, s64 = chunk_gated_delta_rule(q, k, v, g, beta, state)
    o16, s16 = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    torch.testing.assert_close(o16, o64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s16, s64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_hand_computed_two_steps(rule):
    # One head, Dk = Dv = 1, k = q = 1 (unit after L2 norm, scale 1/sqrt(1)).
    # Step 1: S = 0 -> delta = 0.5 * (2 - 0) = 1, S = 1, o = 1.
    # Step 2: S = 0.5 * 1 = 0.5 -> delta = 0.25 * (4 - 0.5) = 0.875, S = 1.375, o = 1.375.
    ones = torch.ones(1, 2, 1, 1)
    v = torch.tensor([2.0, 4.0]).view(1, 2, 1, 1)
    g = torch.tensor([0.0, math.log(0.5)]).view(1, 2, 1)
    beta = torch.tensor([0.5, 0.25]).view(1, 2, 1)
    o, s = rule(ones, ones, v, g, beta, torch.zeros(1, 1, 1, 1))
    torch.testing.assert_close(o.flatten(), torch.tensor([1.0, 1.375]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.flatten(), torch.tensor([1.375]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_padding_with_zero_beta_and_decay_leaves_state_unchanged(rule):
    q, k, v, g, beta, state = _inputs(B=1, T=40)
    _, s_real = rule(q[:, :30], k[:, :30], v[:, :30], g[:, :30], beta[:, :30], state)
    g, beta = g.clone(), beta.clone()
    g[:, 30:], beta[:, 30:] = 0.0, 0.0
    o, s_padded = rule(q, k, v, g, beta, state)
    torch.testing.assert_close(s_padded, s_real, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(o).all()


def test_causal_conv_continues_from_its_state():
    gen = torch.Generator().manual_seed(1)
    B, T, C, K = 2, 12, 6, 4
    x = torch.randn(B, T, C, generator=gen)
    w = torch.randn(C, 1, K, generator=gen)
    zero = torch.zeros(B, C, K - 1)
    full, full_state = causal_conv1d(x, w, zero, torch.full((B,), T))
    # direct definition: out[t, c] = silu(sum_j w[c, 0, j] * x[t - (K-1) + j, c]), zeros before the start
    xp = torch.cat([torch.zeros(B, K - 1, C), x], dim=1)
    direct = torch.stack([(xp[:, t : t + K].transpose(1, 2) * w[:, 0]).sum(-1) for t in range(T)], dim=1)
    torch.testing.assert_close(full, torch.nn.functional.silu(direct), rtol=1e-5, atol=1e-6)
    a, state = causal_conv1d(x[:, :7], w, zero, torch.full((B,), 7))
    b, state = causal_conv1d(x[:, 7:], w, state, torch.full((B,), T - 7))
    torch.testing.assert_close(torch.cat([a, b], dim=1), full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, full_state)
    torch.testing.assert_close(full_state, x[:, -(K - 1) :].transpose(1, 2))


def test_conv_state_skips_right_padding():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, 4, generator=gen)
    w = torch.randn(4, 1, 4, generator=gen)
    n_new = torch.tensor([9, 2])  # row 1 has 2 real tokens then 7 padding positions
    out, state = causal_conv1d(x, w, torch.zeros(2, 4, 3), n_new)
    torch.testing.assert_close(state[0], x[0, 6:].T)
    torch.testing.assert_close(state[1], torch.cat([torch.zeros(4, 1), x[1, :2].T], dim=1))
    alone, _ = causal_conv1d(x[1:, :2], w, torch.zeros(1, 4, 3), torch.tensor([2]))
    torch.testing.assert_close(out[1:, :2], alone)
