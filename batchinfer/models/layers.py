"""Small building blocks of the reference forward: RMSNorms, rotary embedding, linear over any weight format.

Numerics follow Hugging Face transformers so the reference can be checked against it: norms compute in
fp32 and cast back, rotary tables are built in fp32 and cast to the activation dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from typing import TypeAlias

    from batchinfer.kernels.nvfp4 import FP8Weight, NVFP4Weight

    Linear: TypeAlias = torch.Tensor | NVFP4Weight | FP8Weight


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """`x @ w.T` for a dense `[out, in]` weight or a quantized one.

    Quantized weights are dequantized on every call, on purpose: the reference keeps the checkpoint's
    memory footprint (4 bits per weight) instead of holding a second, dense copy of every matrix.
    """
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return F.linear(x, w.dequantize(x.dtype))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    """RMSNorm over the last dim.

    `one_plus=True` is the Qwen3.5 "zero-centred" form `(x / rms) * (1 + w)` with the product taken in
    fp32; `one_plus=False` is the Qwen3-MoE form `w * (x / rms)` with the product taken in x's dtype.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if one_plus:
        return (normed * (1.0 + w.float())).to(x.dtype)
    return w * normed.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: `w * (x / rms(x)) * silu(z)` (plain weight, not 1 + w)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((w * normed) * F.silu(z.float())).to(x.dtype)


def rope_tables(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables `[*positions.shape, rotary_dim]` for NeoX-style (rotate-half) rotary embedding.

    Built in fp32 (positions up to 262k need it), then cast to the activation dtype.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., rotary_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` dims of x (pairs i, i + half); the rest pass through (partial RoPE).

    x is `[B, H, T, Dh]`; cos and sin are `[B, T, rotary_dim]`.
    """
    rd = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1)
