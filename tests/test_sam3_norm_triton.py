"""The ViT's fused LayerNorm passes against PyTorch: norm1 written in window order, and the residual add
of the attention output (read back from window order) with norm2 (CPU: TRITON_INTERPRET=1)."""

import pytest
import torch

from batchinfer.sam3.norm_triton import add_layer_norm_rows, layer_norm_rows
from batchinfer.sam3.vit import window_partition, window_unpartition

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _norm(d, dtype):
    norm = torch.nn.LayerNorm(d, eps=1e-5).to(DEV).requires_grad_(False)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d) * 0.5 + 1)
        norm.bias.copy_(torch.randn(d) * 0.1)
    return norm.to(dtype)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    ("grid", "window", "d"), [(6, 3, 24), (4, 2, 32), (6, 0, 24), (5, 5, 16), (5, 0, 16)]
)
def test_norm_in_window_order_and_add_norm_match_pytorch(dtype, tol, grid, window, d):
    b = 1 if grid == 5 else 2  # 1 x 5 x 5 = 25 rows: the 4-row programs' row mask at work
    x = torch.randn(b, grid, grid, d, device=DEV).to(dtype) * 3 + 1
    norm1, norm2 = _norm(d, dtype), _norm(d, dtype)
    got = layer_norm_rows(x, norm1, window)
    ref = norm1(x)
    ref = window_partition(ref, window) if window else ref.view(b, grid * grid, d)
    assert got.shape == ref.shape and got.dtype == dtype
    assert _rel(got, ref) < tol

    y = torch.randn_like(got) * 2  # the attention output, in the same order as norm1's
    total, out = add_layer_norm_rows(x, y, norm2, window)
    y_grid = window_unpartition(y, window, grid, grid) if window else y.view(b, grid, grid, d)
    ref_total = x + y_grid
    assert torch.equal(total, ref_total)  # the sum rounds as `x + y` does
    assert out.shape == x.shape and _rel(out, norm2(ref_total)) < tol


def test_shape_errors_name_the_tensors():
    norm = _norm(8, torch.float32)
    x = torch.randn(1, 4, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="contiguous"):
        layer_norm_rows(x.transpose(1, 2), norm, 2)
    with pytest.raises(ValueError, match="does not split into 3 x 3 windows"):
        layer_norm_rows(x, norm, 3)
    with pytest.raises(ValueError, match="norm over D"):
        layer_norm_rows(x, _norm(4, torch.float32), 2)
    with pytest.raises(ValueError, match="add \\+ LayerNorm: y"):
        add_layer_norm_rows(x, torch.randn(1, 8, 8, device=DEV), norm, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_block_matches_the_pytorch_block_at_real_width():
    from batchinfer.sam3.config import Sam3Config
    from batchinfer.sam3.vit import Block

    config = Sam3Config()
    for window in (config.vit_window, 0):
        block = Block(config, window).to(DEV, torch.bfloat16).eval()
        x = torch.randn(2, 48, 48, config.vit_dim, device=DEV, dtype=torch.bfloat16)
        with torch.inference_mode():
            fused, plain = block(x), block.forward_torch(x)
        assert _rel(fused - x, plain - x) < 1e-2  # the block's own contribution, not the residual


def test_fused_mlp_keeps_the_token_shape_and_values():
    """`Mlp.forward_fused` (fc1 + GELU as one addmm epilogue) on [B, H, W, D] tokens: the MLP's values
    (erf GELU on the CPU, where PyTorch's epilogue is exact; the GPU's tanh form is the block test's)."""
    from batchinfer.sam3.vit import Mlp

    mlp = Mlp(16, 40).to(DEV)
    x = torch.randn(2, 3, 5, 16, device=DEV)
    with torch.inference_mode():
        out = mlp.forward_fused(x)
        assert out.shape == x.shape
        assert _rel(out, mlp(x)) < (1e-2 if DEV == "cuda" else 1e-5)


def test_fused_mlp_keeps_an_fp8_fc1():
    """`--vit fp8` swaps fc1 for an `FP8Linear` (E4M3 weight and scales): the fused form must not read its
    weight as a bf16 matrix, so it runs the module as it is."""
    from batchinfer.sam3.fp8 import FP8Linear
    from batchinfer.sam3.vit import Mlp

    mlp = Mlp(32, 64).to(DEV, torch.bfloat16 if DEV == "cuda" else torch.float32)
    mlp.fc1 = FP8Linear(mlp.fc1)  # after the move, as `use_fp8_vit` does: `.to(dtype)` would cast E4M3
    x = torch.randn(2, 3, 5, 32, device=DEV, dtype=mlp.fc2.weight.dtype)
    with torch.inference_mode():
        assert torch.equal(mlp.forward_fused(x), mlp(x))
