"""SAM 3's vision backbone: the Perception Encoder ViT (`sam3/model/vitdet.py`) and its SimpleFPN neck.

Patch embedding (conv, no bias) + absolute position embeddings tiled from the 24x24 pretraining grid,
`ln_pre`, then blocks of pre-norm attention and MLP. Most blocks attend inside non-overlapping
`vit_window`-token windows; `vit_global_blocks` attend over the whole grid. Every block applies 2-D
axial RoPE to q and k: the first half of the rotated pairs carries the token's column (x), the second
half its row (y); global blocks scale positions by window/grid so they span the same range as a
window (Meta's `use_interp_rope`). The MLP uses the exact erf GELU of Meta's Nov-2025 code (timm `Mlp`),
not the bf16 tanh GELU of the Mar-2026 SAM 3.1 code; the reference is fp32/bf16 PyTorch. The CUDA bf16 path
(`Block.forward_fused`) takes the tanh form, fused into fc1's GEMM, and embeds the patches with one GEMM
(`patch_embed_gemm`) in place of cuDNN's conv.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchinfer.sam3.config import Sam3Config

ROPE_THETA = 10000.0
LN_EPS = 1e-5


@lru_cache(maxsize=16)
def axial_rope(head_dim: int, side: int, scale: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin float32 [side*side, head_dim // 2] of Meta's `compute_axial_cis` for a side x side grid.

    Token t = row * side + col; pair j < head_dim // 4 rotates by col * scale * f_j, pair
    head_dim // 4 + j by row * scale * f_j, with f_j = theta ** (-4 j / head_dim). The tables are
    cached across calls, so they are built as normal tensors even under inference mode: a cached
    inference tensor could not take part in a later autograd graph."""
    with torch.inference_mode(False):
        freqs = 1.0 / (
            ROPE_THETA ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim)
        )
        t = torch.arange(side * side, device=device, dtype=torch.float32)
        col, row = (t % side) * scale, torch.div(t, side, rounding_mode="floor") * scale
        angles = torch.cat([torch.outer(col, freqs), torch.outer(row, freqs)], dim=-1)
        return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs (x[2j], x[2j+1]) of x [..., L, Dh] by the angles of row L; fp32 math."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).type_as(x)


def window_partition(x: Tensor, window: int) -> Tensor:
    """[B, H, W, C] -> [B * (H/w) * (W/w), w * w, C], windows in row-major order."""
    b, h, w, c = x.shape
    x = x.view(b, h // window, window, w // window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, c)


def window_unpartition(windows: Tensor, window: int, h: int, w: int) -> Tensor:
    """Inverse of `window_partition`: [B * nW, w * w, C] -> [B, H, W, C]."""
    b = windows.shape[0] // ((h // window) * (w // window))
    x = windows.view(b, h // window, w // window, window, window, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, L, D] (L = side * side tokens of one window or the whole grid)."""
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # [3, B, H, L, Dh]
        v = qkv[2]
        if qkv.is_cuda:  # one fused pass instead of ~10 (the largest memory traffic of the backbone)
            from batchinfer.sam3.rope_triton import apply_rope_triton

            q, k = apply_rope_triton(qkv[:2], cos, sin)
        else:
            q, k = apply_rope(qkv[0], cos, sin), apply_rope(qkv[1], cos, sin)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward_fused(self, x: Tensor) -> Tensor:
        """The CUDA bf16 path: fc1's bias and GELU in cuBLASLt's GEMM epilogue, which computes the tanh
        form of GELU on CUDA (within 1e-3 of erf's; the image accuracy lock bounds the effect; PyTorch's CPU
        form is exact), saving a pass over the [tokens, 4,736] activations (202.8 -> 190.1 ms a 16-image
        backbone on the H200, session 15). An fc1 swapped for FP8 (`sam3.fp8`) keeps the plain form."""
        if type(self.fc1) is not nn.Linear:
            return self(x)
        rows = x.reshape(-1, x.shape[-1])
        h = torch._addmm_activation(self.fc1.bias, rows, self.fc1.weight.t(), use_gelu=True)
        return self.fc2(h).view(*x.shape[:-1], -1)


class Block(nn.Module):
    def __init__(self, config: Sam3Config, window: int) -> None:
        super().__init__()
        self.window = window  # 0 = global attention
        self.norm1 = nn.LayerNorm(config.vit_dim, eps=LN_EPS)
        self.attn = Attention(config.vit_dim, config.vit_heads)
        self.norm2 = nn.LayerNorm(config.vit_dim, eps=LN_EPS)
        self.mlp = Mlp(config.vit_dim, config.vit_mlp_dim)
        self.head_dim = config.vit_dim // config.vit_heads
        self.rope_scale = 1.0 if window else config.vit_window / config.grid

    def forward(self, x: Tensor) -> Tensor:
        """x [B, H, W, D]. On CUDA below fp32, the LayerNorms run fused with the window partitioning and
        the residual add (`norm_triton`); the fp32 reference stays in PyTorch."""
        if x.is_cuda and x.dtype != torch.float32:
            return self.forward_fused(x)
        return self.forward_torch(x)

    def _rope(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return axial_rope(self.head_dim, self.window or x.shape[1], self.rope_scale, x.device)

    def forward_fused(self, x: Tensor) -> Tensor:
        from batchinfer.sam3.norm_triton import add_layer_norm_rows, layer_norm_rows

        x = x.contiguous()
        y = self.attn(layer_norm_rows(x, self.norm1, self.window), *self._rope(x))
        x, h2 = add_layer_norm_rows(x, y, self.norm2, self.window)
        return x + self.mlp.forward_fused(h2)

    def forward_torch(self, x: Tensor) -> Tensor:
        b, h, w, d = x.shape
        y = self.norm1(x)
        if self.window:
            y = window_unpartition(
                self.attn(window_partition(y, self.window), *self._rope(x)), self.window, h, w
            )
        else:
            y = self.attn(y.view(b, h * w, d), *self._rope(x)).view(b, h, w, d)
        x = x + y
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(3, config.vit_dim, kernel_size=p, stride=p, bias=False)


class ViT(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Parameter(torch.randn(1, config.vit_pretrain_grid**2 + 1, config.vit_dim) * 0.02)
        self.ln_pre = nn.LayerNorm(config.vit_dim, eps=LN_EPS)
        self.blocks = nn.ModuleList(
            Block(config, 0 if i in config.vit_global_blocks else config.vit_window)
            for i in range(config.vit_depth)
        )

    def forward(self, images: Tensor) -> Tensor:
        """images [B, 3, S, S] normalised to [-1, 1] -> features [B, D, S/p, S/p] of the last block."""
        if images.is_cuda and images.dtype != torch.float32:
            x = patch_embed_gemm(images, self.patch_embed.proj.weight)
        else:
            x = self.patch_embed.proj(images).permute(0, 2, 3, 1)  # [B, h, w, D]
        x = x + tiled_pos_embed(self.pos_embed, x.shape[1], x.shape[2])
        x = self.ln_pre(x)
        for block in self.blocks:
            x = block(x)
        return x.permute(0, 3, 1, 2)


def patch_embed_gemm(images: Tensor, weight: Tensor) -> Tensor:
    """The patch embedding (a p x p conv of stride p, no bias, `weight [D, C, p, p]`) as one GEMM over the
    unfolded patches: images [B, C, S1, S2] -> [B, S1 // p, S2 // p, D], channels last as the blocks take
    it. For 3 input channels cuDNN runs a non-tensor-core kernel in bf16 (5.4 of the backbone's 184 ms
    for 16 images on the H200, session 16). K = C p^2 is zero-padded to a multiple of 8 (SAM 3: 588 -> 592)
    so cuBLAS gets 16-byte aligned rows."""
    d, c, p, _ = weight.shape
    b, _, s1, s2 = images.shape
    h, w = s1 // p, s2 // p
    k = c * p * p
    k_pad = -(-k // 8) * 8
    patches = images.new_zeros(b, h, w, k_pad)
    unfolded = images[:, :, : h * p, : w * p].reshape(b, c, h, p, w, p).permute(0, 2, 4, 1, 3, 5)
    patches[..., :k].view(b, h, w, c, p, p).copy_(unfolded)
    weight = F.pad(weight.reshape(d, k).to(images.dtype), (0, k_pad - k))
    return (patches.view(-1, k_pad) @ weight.t()).view(b, h, w, d)


def tiled_pos_embed(pos_embed: Tensor, h: int, w: int) -> Tensor:
    """Drop the cls row of [1, 1 + P*P, D] and tile the P x P grid over h x w (Meta's `tile_abs_pos`)."""
    grid = pos_embed[:, 1:]
    p = math.isqrt(grid.shape[1])
    grid = grid.reshape(1, p, p, -1)
    return grid.repeat(1, h // p + 1, w // p + 1, 1)[:, :h, :w].contiguous()  # a vectorized add after


def sine_position_2d(d_model: int, h: int, w: int, device: torch.device) -> Tensor:
    """Meta's `PositionEmbeddingSine(d_model, normalize=True)`: float32 [d_model, h, w], y channels first."""
    half = d_model // 2
    eps, scale = 1e-6, 2 * math.pi
    y = torch.arange(1, h + 1, dtype=torch.float32, device=device) / (h + eps) * scale
    x = torch.arange(1, w + 1, dtype=torch.float32, device=device) / (w + eps) * scale
    dim_t = 10000 ** (2 * torch.div(torch.arange(half, device=device), 2, rounding_mode="floor") / half)

    def embed(v: Tensor) -> Tensor:  # [n] -> [n, half], sin/cos interleaved
        a = v[:, None] / dim_t
        return torch.stack([a[:, 0::2].sin(), a[:, 1::2].cos()], dim=2).flatten(1)

    pos_y = embed(y)[:, None, :].expand(h, w, half)
    pos_x = embed(x)[None, :, :].expand(h, w, half)
    return torch.cat([pos_y, pos_x], dim=-1).permute(2, 0, 1)


class Neck(nn.Module):
    """Meta's `Sam3DualViTDetNeck` (without the SAM2 copy): four levels at scales 4, 2, 1 and 0.5.

    The 0.5 level exists in the checkpoint but Meta's image model discards it (`scalp=1`), so its
    weights are loaded and never run."""

    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        self.trunk = ViT(config)
        dim, d = config.vit_dim, config.d_model
        self.convs = nn.ModuleList()
        for scale in (4.0, 2.0, 1.0, 0.5):
            level = nn.Sequential()
            if scale == 4.0:
                level.add_module("dconv_2x2_0", nn.ConvTranspose2d(dim, dim // 2, 2, stride=2))
                level.add_module("gelu", nn.GELU())
                level.add_module("dconv_2x2_1", nn.ConvTranspose2d(dim // 2, dim // 4, 2, stride=2))
                in_dim = dim // 4
            elif scale == 2.0:
                level.add_module("dconv_2x2", nn.ConvTranspose2d(dim, dim // 2, 2, stride=2))
                in_dim = dim // 2
            elif scale == 0.5:
                level.add_module("maxpool_2x2", nn.MaxPool2d(2, stride=2))
                in_dim = dim
            else:
                in_dim = dim
            level.add_module("conv_1x1", nn.Conv2d(in_dim, d, 1))
            level.add_module("conv_3x3", nn.Conv2d(d, d, 3, padding=1))
            self.convs.append(level)

    def forward(self, images: Tensor) -> list[Tensor]:
        """images [B, 3, S, S] -> [x4 [B, d, 4g, 4g], x2 [B, d, 2g, 2g], x1 [B, d, g, g]] (g = grid)."""
        x = self.trunk(images)
        return [self.convs[i](x) for i in range(3)]
