"""The ViT's 2-D RoPE as one Triton pass (CUDA): `vit.apply_rope`'s math in fp32, one read, one write.

Why: in PyTorch the rotation of q and k takes about ten elementwise passes (upcast, four products, two
sums, stack, downcast), each over a [B, H, L, Dh] tensor; at the real ViT (32 blocks, 5,184 tokens,
width 1,024) that moved about 19 GB per image, more bytes than anything else in the backbone. This
kernel reads the strided q (or k) view of the qkv projection once and writes a contiguous
[B, H, L, Dh] result in the input dtype. Same arithmetic as `apply_rope` (fp32 products and sums,
one rounding to the output dtype), up to fused multiply-adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_L = 64


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr, L, H,
    sxb, sxh, sxl, sob, soh, sol,
    HALF: tl.constexpr, HALF_P2: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid_l = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_l * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, HALF_P2)
    mask = (rows[:, None] < L) & (j[None, :] < HALF)
    src = x_ptr + b * sxb + h * sxh + rows[:, None] * sxl + 2 * j[None, :]
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    table = rows[:, None] * HALF + j[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    dst = out_ptr + b * sob + h * soh + rows[:, None] * sol + 2 * j[None, :]
    tl.store(dst, (a * cos - c * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + 1, (a * sin + c * cos).to(out_ptr.dtype.element_ty), mask=mask)


def apply_rope_triton(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, L, Dh] (any strides, last dim contiguous); cos, sin float32 [L, Dh // 2] -> contiguous
    [B, H, L, Dh] in x's dtype, adjacent pairs (x[2j], x[2j+1]) rotated by the angles of row L."""
    b, h, n, dh = x.shape
    if x.stride(-1) != 1 or dh % 2 or cos.shape != (n, dh // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"rope: x {tuple(x.shape)} (last stride {x.stride(-1)}), cos {tuple(cos.shape)}, sin "
            f"{tuple(sin.shape)}: expected a last-dim-contiguous [B, H, L, Dh] and [L, Dh/2] tables"
        )
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty((b, h, n, dh), dtype=x.dtype, device=x.device)
    half = dh // 2
    grid = (triton.cdiv(n, BLOCK_L), b * h)
    _rope_kernel[grid](
        x, out, cos, sin, n, h,
        x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        HALF=half, HALF_P2=triton.next_power_of_2(half), BLOCK=BLOCK_L,
    )  # fmt: skip
    return out
