"""Norms, rotary embedding and the format-agnostic linear of the reference model."""

import math

import torch
from batchinfer.kernels.nvfp4 import quantize_fp8, quantize_nvfp4

from batchinfer.models.layers import apply_rope, gated_rms_norm, linear, rms_norm, rope_tables

X = torch.tensor([[3.0, 4.0]])  # rms = sqrt(12.5), x / rms = [0.84853, 1.13137]
W = torch.tensor([0.5, -1.0])


def test_rms_norm_both_forms():
    unit = torch.tensor([[0.848528, 1.131371]])
    torch.testing.assert_close(rms_norm(X, W, 0.0, one_plus=True), unit * 1.0 + unit * W)  # (1 + w)
    torch.testing.assert_close(rms_norm(X, W, 0.0, one_plus=False), unit * W)
    out = rms_norm(X.bfloat16(), W.bfloat16(), 1e-6, one_plus=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), unit * (1 + W), rtol=1e-2, atol=1e-2)


def test_gated_rms_norm_multiplies_silu_of_the_gate():
    z = torch.tensor([[0.0, 2.0]])  # silu(0) = 0, silu(2) = 2 * sigmoid(2)
    expected = torch.tensor([[0.0, -1.131371 * 2.0 / (1.0 + math.exp(-2.0))]])
    torch.testing.assert_close(gated_rms_norm(X, z, W, 0.0), expected)


def test_rope_rotates_pairs_i_and_i_plus_half():
    theta, Dh, rd = 10000.0, 8, 4  # partial: only the first 4 of 8 dims rotate
    x = torch.randn(1, 2, 3, Dh, generator=torch.Generator().manual_seed(0))  # [B, H, T, Dh]
    positions = torch.tensor([[0, 5, 17]])
    cos, sin = rope_tables(positions, rd, theta, torch.float32)
    out = apply_rope(x, cos, sin)
    for t, pos in enumerate(positions[0].tolist()):
        for i in range(rd // 2):
            angle = pos * theta ** (-2 * i / rd)
            pair = torch.complex(x[..., t, i], x[..., t, i + rd // 2]) * complex(
                math.cos(angle), math.sin(angle)
            )
            torch.testing.assert_close(out[..., t, i], pair.real)
            torch.testing.assert_close(out[..., t, i + rd // 2], pair.imag)
    torch.testing.assert_close(out[..., rd:], x[..., rd:])


def test_rope_scores_depend_only_on_relative_position():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16, generator=gen), torch.randn(1, 1, 1, 16, generator=gen)

    def score(pq, pk):
        cq, sq = rope_tables(torch.tensor([[pq]]), 16, 1e6, torch.float32)
        ck, sk = rope_tables(torch.tensor([[pk]]), 16, 1e6, torch.float32)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert math.isclose(score(10, 3), score(1007, 1000), rel_tol=1e-4)
    assert not math.isclose(score(10, 3), score(10, 4), rel_tol=1e-3)


def test_linear_dequantizes_quantized_weights():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(24, 32, generator=gen)
    x = torch.randn(5, 32, generator=gen)
    for q in (quantize_nvfp4(w), quantize_fp8(w)):
        got = linear(x, q)
        torch.testing.assert_close(got, x @ q.dequantize().T)
        assert float((got - x @ w.T).abs().max()) < 0.25 * float((x @ w.T).abs().max())
        assert linear(x.bfloat16(), q).dtype == torch.bfloat16
    torch.testing.assert_close(linear(x, w), x @ w.T)
