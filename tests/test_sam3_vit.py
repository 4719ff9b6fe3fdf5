import math

import pytest
import torch
import torch.nn.functional as F

from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.vit import (
    Attention,
    Block,
    Neck,
    apply_rope,
    axial_rope,
    patch_embed_gemm,
    sine_position_2d,
    tiled_pos_embed,
    window_partition,
    window_unpartition,
)

CPU = torch.device("cpu")


def test_rope_head_dim_4_by_hand():
    # head_dim 4: one frequency (1.0) per axis; pair 0 turns by the column, pair 1 by the row.
    cos, sin = axial_rope(4, 3, 1.0, CPU)
    x = torch.tensor([1.0, 0.0, 1.0, 0.0]).expand(9, 4)
    out = apply_rope(x, cos, sin)
    for t in range(9):
        row, col = divmod(t, 3)
        expected = [math.cos(col), math.sin(col), math.cos(row), math.sin(row)]
        assert out[t].tolist() == pytest.approx(expected, abs=1e-6)


def test_rope_scale_and_frequencies_match_metas_complex_form():
    # Meta: freqs f_j = theta^(-4j/dim) for j < dim/4; x-angles then y-angles; rotation as complex product.
    dim, side, scale = 8, 4, 1 / 3
    f = 1.0 / (10000 ** (torch.arange(0, dim, 4)[: dim // 4].float() / dim))
    t = torch.arange(side * side, dtype=torch.float32)
    ang = torch.cat([torch.outer((t % side) * scale, f), torch.outer((t // side) * scale, f)], -1)
    x = torch.randn(2, 3, side * side, dim, generator=torch.Generator().manual_seed(0))
    ref = torch.view_as_real(
        torch.view_as_complex(x.reshape(2, 3, -1, dim // 2, 2)) * torch.polar(torch.ones_like(ang), ang)
    )
    cos, sin = axial_rope(dim, side, scale, CPU)
    assert torch.allclose(apply_rope(x, cos, sin), ref.flatten(-2), atol=1e-6)
    assert f.tolist() == pytest.approx([1.0, 0.01])


def test_rope_preserves_norm_and_dtype():
    cos, sin = axial_rope(16, 4, 1.0, CPU)
    x = torch.randn(16, 16).to(torch.bfloat16)
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float().norm(dim=-1), x.float().norm(dim=-1), rtol=1e-2)


def test_window_partition_by_hand():
    grid = torch.arange(16.0).view(1, 4, 4, 1)
    windows = window_partition(grid, 2)
    assert windows.shape == (4, 4, 1)
    assert windows[..., 0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    assert torch.equal(window_unpartition(windows, 2, 4, 4), grid)


def test_tiled_pos_embed_by_hand():
    pos = torch.tensor([-1.0, 0, 1, 2, 3]).view(1, 5, 1)  # cls row first, then a 2x2 grid
    tiled = tiled_pos_embed(pos, 3, 5)[0, ..., 0]
    assert tiled.tolist() == [[0, 1, 0, 1, 0], [2, 3, 2, 3, 2], [0, 1, 0, 1, 0]]


def test_sine_position_by_hand():
    # d_model 4: two channels per axis with dim_t = [1, 1]: (sin, cos) of the normalised coordinate.
    pos = sine_position_2d(4, 2, 3, CPU)
    assert pos.shape == (4, 2, 3)
    eps = 1e-6
    for r in range(2):
        for c in range(3):
            y, x = (r + 1) / (2 + eps) * 2 * math.pi, (c + 1) / (3 + eps) * 2 * math.pi
            expected = [math.sin(y), math.cos(y), math.sin(x), math.cos(x)]
            assert pos[:, r, c].tolist() == pytest.approx(expected, abs=1e-5)


def _init(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_window_block_equals_attention_run_per_window():
    cfg = Sam3Config.tiny()  # grid 8, window 4
    block = Block(cfg, window=4)
    _init(block, 0)
    x = torch.randn(2, 8, 8, cfg.vit_dim, generator=torch.Generator().manual_seed(1))
    out = block(x)
    h = block.norm1(x)
    cos, sin = axial_rope(cfg.vit_dim // cfg.vit_heads, 4, 1.0, CPU)
    manual = torch.empty_like(x)
    for r in range(0, 8, 4):
        for c in range(0, 8, 4):
            win = h[:, r : r + 4, c : c + 4].reshape(2, 16, -1)
            manual[:, r : r + 4, c : c + 4] = block.attn(win, cos, sin).view(2, 4, 4, -1)
    manual = x + manual
    manual = manual + block.mlp.fc2(F.gelu(block.mlp.fc1(block.norm2(manual))))
    assert torch.allclose(out, manual, atol=1e-5)


def test_global_block_mixes_all_windows_and_window_block_does_not():
    cfg = Sam3Config.tiny()
    x = torch.randn(1, 8, 8, cfg.vit_dim, generator=torch.Generator().manual_seed(2))
    x2 = x.clone()
    x2[0, 7, 7] += torch.linspace(-1, 1, cfg.vit_dim)  # a token in the bottom-right window (not a
    # constant shift, which LayerNorm would remove)
    for window, changes_top_left in ((4, False), (0, True)):
        block = Block(cfg, window=window)
        _init(block, 3)
        delta = (block(x) - block(x2))[0, :4, :4].abs().max().item()
        assert (delta > 1e-6) == changes_top_left


def test_attention_uses_scaled_dot_product():
    attn = Attention(8, 2)
    _init(attn, 4)
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(5))
    cos, sin = axial_rope(4, 2, 1.0, CPU)
    q, k, v = attn.qkv(x).view(1, 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    weights = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
    expected = attn.proj((weights @ v).transpose(1, 2).reshape(1, 4, 8))
    assert torch.allclose(attn(x, cos, sin), expected, atol=1e-6)


def test_neck_shapes_at_real_config_on_meta():
    with torch.device("meta"):
        neck = Neck(Sam3Config.real())
        levels = neck(torch.empty(1, 3, 1008, 1008))
    assert [tuple(t.shape) for t in levels] == [(1, 256, 288, 288), (1, 256, 144, 144), (1, 256, 72, 72)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_patch_embed_gemm_is_the_strided_conv(dtype, tol):
    """The CUDA bf16 path's GEMM patch embedding against the conv it replaces, channels last, on sides
    that are not a multiple of the patch (the conv drops the remainder) and a K of 3 x 5 x 5 = 75 (padded
    to 80)."""
    images = torch.randn(2, 3, 33, 27, dtype=dtype)
    weight = torch.randn(16, 3, 5, 5, dtype=dtype) * 0.1
    expected = F.conv2d(images.float(), weight.float(), stride=5).permute(0, 2, 3, 1)
    out = patch_embed_gemm(images, weight)
    assert out.shape == (2, 6, 5, 16) and out.dtype == dtype and out.is_contiguous()
    assert ((out.float() - expected).norm() / expected.norm()).item() < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_patch_embed_gemm_real_shape_gpu():
    config = Sam3Config()
    p, dev = config.patch_size, torch.device("cuda")
    images = torch.rand(2, 3, 1008, 1008, device=dev, dtype=torch.bfloat16) * 2 - 1
    weight = torch.randn(config.vit_dim, 3, p, p, device=dev, dtype=torch.bfloat16) * 0.02
    expected = F.conv2d(images.float(), weight.float(), stride=p).permute(0, 2, 3, 1)
    out = patch_embed_gemm(images, weight)
    assert out.shape == expected.shape and ((out.float() - expected).norm() / expected.norm()).item() < 1e-2
