"""Per-row FP8 activation quantization (`kernels/fp8_quant.py`) and the SAM 3 ViT's FP8 linears."""

import pytest
import torch
import triton
from batchinfer.kernels import fp8_quant
from batchinfer.kernels.fp8_quant import quantize_rows_fp8, quantize_rows_fp8_ref
from kernel_checks import rel_err

from batchinfer.sam3.fp8 import FP8Linear, use_fp8_vit


def _x(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]  # rows of very different size
    x[1] = 0.0  # an all-zero row must not divide by zero
    return x.to(torch.bfloat16)


def test_reference_codes_and_scales():
    x = _x(5, 96, 1)
    q, s = quantize_rows_fp8_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1)
    assert torch.equal(q.float().abs().amax(1)[[0, 2, 3, 4]], torch.full((4,), 448.0))  # each row spans E4M3
    assert torch.equal(q[1].float(), torch.zeros(96))
    assert rel_err(q.float() * s, x.float()) < 0.04  # E4M3: 3 mantissa bits


@pytest.mark.parametrize("m,k", [(5, 96), (3, 200)])
def test_kernel_matches_reference_on_the_interpreter(m, k):
    """The kernel under the interpreter: scales equal to the reference's; the codes only roughly, since the
    interpreter's fp32 -> E4M3 cast is its own (it truncates, and drops a binade when the mantissa carries:
    124.4 -> 64); the GPU test below asks for identical codes."""
    x = _x(m, k, 2)
    q = torch.full((m, k), float("nan")).to(torch.float8_e4m3fn)
    s = torch.full((m, 1), float("nan"))
    fp8_quant._quantize_rows_kernel[(m,)](
        x, q, s, k, x.stride(0), q.stride(0), BLOCK_K=triton.next_power_of_2(k)
    )
    q_ref, s_ref = quantize_rows_fp8_ref(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    exact = x.float() / s_ref
    assert torch.equal(q.float().sign(), q_ref.float().sign())
    assert ((q.float() - exact).abs() <= exact.abs() / 2 + 2.0**-9).all()


def test_fp8_linear_matches_the_linear():
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * 0.1)
        lin.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(2, 7, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        out, ref = FP8Linear(lin)(x), lin(x)
    assert out.shape == (2, 7, 48) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 0.05
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8Linear(torch.nn.Linear(40, 32))


def test_fp8_vit_swaps_the_aligned_linears():
    from batchinfer.sam3.config import Sam3Config
    from batchinfer.sam3.model import Sam3Model

    model = Sam3Model(Sam3Config.tiny()).to(torch.bfloat16).eval()
    pixels = torch.rand(2, 3, 56, 56, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16) * 2 - 1
    with torch.no_grad():
        before = model.encode_images(pixels)
        assert use_fp8_vit(model) == 8  # qkv and proj of 4 blocks; the tiny MLP (32 -> 40) is not aligned
        after = model.encode_images(pixels)
    assert isinstance(model.backbone.vision_backbone.trunk.blocks[0].attn.qkv, FP8Linear)
    assert all(rel_err(a, b) < 0.1 for a, b in zip(after, before, strict=True))


def test_fp8_vit_mlp_only_keeps_the_attention_projections():
    """`vit=fp8-mlp`: fc1 and fc2 of every block on FP8, qkv and proj as they were (a tiny config with
    MLP widths that are multiples of 16)."""
    import dataclasses

    from batchinfer.sam3.config import Sam3Config
    from batchinfer.sam3.model import Sam3Model

    model = Sam3Model(dataclasses.replace(Sam3Config.tiny(), vit_mlp_dim=48)).to(torch.bfloat16).eval()
    pixels = torch.rand(2, 3, 56, 56, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16) * 2 - 1
    with torch.no_grad():
        before = model.encode_images(pixels)
        assert use_fp8_vit(model, mlp_only=True) == 8  # fc1 and fc2 of 4 blocks
        after = model.encode_images(pixels)
    block = model.backbone.vision_backbone.trunk.blocks[0]
    assert isinstance(block.mlp.fc1, FP8Linear) and isinstance(block.mlp.fc2, FP8Linear)
    assert isinstance(block.attn.qkv, torch.nn.Linear) and isinstance(block.attn.proj, torch.nn.Linear)
    assert all(rel_err(a, b) < 0.1 for a, b in zip(after, before, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1024, 4736])  # the SAM 3 ViT's widths
def test_kernel_rounds_as_pytorch_gpu(k):
    x = torch.randn(5184, k, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_rows_fp8(x)
    q_ref, s_ref = quantize_rows_fp8_ref(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
