"""The ViT's 2-D RoPE as one Triton pass over q and k (CUDA): `vit.apply_rope`'s math in fp32.

Why: in PyTorch the rotation of q and k takes about ten elementwise passes (upcast, four products, two
sums, stack, downcast), each over a [B, H, L, Dh] tensor. This kernel reads the strided q and k views of
the qkv projection once and writes them contiguous, in one launch. Every load and store is a whole
[BLOCK, Dh] tile (a head's row is contiguous): the partner of element d is read as a second tile at
d ^ 1, which hits L1. The first form loaded and stored the even and odd elements as separate stride-2
tiles; its half-sector stores ran at ~0.26 TB/s on the H200 and took 29% of the backbone.
Same arithmetic as `apply_rope` (fp32 products and sums, one rounding), up to fused multiply-adds.
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
    sxs, sxb, sxh, sxl, sos, sob, soh, sol,
    DH: tl.constexpr, DH_P2: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid_l = tl.program_id(0)
    bh = tl.program_id(1)
    s = tl.program_id(2)  # 0: q, 1: k
    b = bh // H
    h = bh % H
    rows = pid_l * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, DH_P2)
    mask = (rows[:, None] < L) & (d[None, :] < DH)
    src = x_ptr + s * sxs + b * sxb + h * sxh + rows[:, None] * sxl
    x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(src + (d ^ 1)[None, :], mask=mask, other=0.0).to(tl.float32)
    table = rows[:, None] * (DH // 2) + (d // 2)[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    sign = tl.where(d % 2 == 0, -1.0, 1.0)  # out[2j] = a cos - b sin, out[2j+1] = b cos + a sin
    out = x * cos + (sign[None, :] * partner) * sin
    dst = out_ptr + s * sos + b * sob + h * soh + rows[:, None] * sol + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def apply_rope_triton(qk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """qk [2, B, H, L, Dh] (q then k, any strides, last dim contiguous); cos, sin float32 [L, Dh // 2]
    -> contiguous [2, B, H, L, Dh] in qk's dtype, adjacent pairs (x[2j], x[2j+1]) rotated by the angles
    of row L."""
    if qk.dim() != 5 or qk.shape[0] != 2 or qk.stride(-1) != 1 or qk.shape[-1] % 2:
        raise ValueError(
            f"rope: qk {tuple(qk.shape)} (last stride {qk.stride(-1)}): expected q and k stacked as "
            "[2, B, H, L, Dh] with a contiguous, even last dim"
        )
    _, b, h, n, dh = qk.shape
    if cos.shape != (n, dh // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"rope: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: expected [L, Dh/2] = [{n}, {dh // 2}] "
            "tables"
        )
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
    grid = (triton.cdiv(n, BLOCK_L), b * h, 2)
    _rope_kernel[grid](
        qk, out, cos, sin, n, h,
        *qk.stride()[:4], *out.stride()[:4],
        DH=dh, DH_P2=triton.next_power_of_2(dh), BLOCK=BLOCK_L,
    )  # fmt: skip
    return out
