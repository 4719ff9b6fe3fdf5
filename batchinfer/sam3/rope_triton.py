"""The ViT's 2-D RoPE as one Triton pass over q and k (CUDA): `vit.apply_rope`'s math in fp32.

Why: in PyTorch the rotation of q and k takes about ten elementwise passes (upcast, four products, two
sums, stack, downcast), each over a [B, H, L, Dh] tensor. This kernel reads the strided q and k views of
the qkv projection once and writes them token-major ([2, B, L, H, Dh] in memory, seen as [2, B, H, L,
Dh]), in one launch. Token-major because PyTorch's cuDNN attention allocates its output in q's layout:
the attention output's `transpose(1, 2).reshape` before the output projection is then a view, not a copy
(unmeasured on the H200). A program takes two tokens' whole q (or k) rows, all heads (one contiguous run
of H x Dh in the qkv row); the partner of element d is read as a second tile at d ^ 1, which hits L1.
Measured on the H200 (docs/PERF_IMAGES.md, session 14) at 16 images' windowed and global shapes: 2.9
TB/s, against 0.33 TB/s for a [64 tokens, Dh] tile a head (and 0.26 for the first, stride-2 form: 29% of
the backbone); a plain tile copy of the same views ran at 4.0. Same arithmetic as `apply_rope` (fp32
products and sums, one rounding), up to fused multiply-adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_L = 2  # tokens a program; more per program ran slower (4: 2.0 TB/s, 8: 1.1)


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr, L,
    sxs, sxb, sxl, sos, sob, soh, sol,
    DH: tl.constexpr, HD: tl.constexpr, HD_P2: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid_l = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # b * sxb passes 2^31 at ~135 images of global blocks
    s = tl.program_id(2).to(tl.int64)  # 0: q, 1: k
    rows = pid_l * BLOCK + tl.arange(0, BLOCK)
    c = tl.arange(0, HD_P2)  # head c // DH, element c % DH
    mask = (rows[:, None] < L) & (c[None, :] < HD)
    src = x_ptr + s * sxs + b * sxb + rows[:, None] * sxl
    x = tl.load(src + c[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(src + (c ^ 1)[None, :], mask=mask, other=0.0).to(tl.float32)
    d = c % DH
    table = rows[:, None] * (DH // 2) + (d // 2)[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    sign = tl.where(d % 2 == 0, -1.0, 1.0)  # out[2j] = a cos - b sin, out[2j+1] = b cos + a sin
    out = x * cos + (sign[None, :] * partner) * sin
    dst = out_ptr + s * sos + b * sob + (c // DH)[None, :] * soh + rows[:, None] * sol + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def apply_rope_triton(qk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """qk [2, B, H, L, Dh] (q then k; a head's Dh and the H heads of a token contiguous, as in the qkv
    projection's view); cos, sin float32 [L, Dh // 2] -> [2, B, H, L, Dh] in qk's dtype, token-major,
    adjacent pairs (x[2j], x[2j+1]) rotated by the angles of row L."""
    if qk.dim() != 5 or qk.shape[0] != 2 or qk.shape[-1] % 2:
        raise ValueError(f"rope: qk {tuple(qk.shape)}: expected q and k stacked as [2, B, H, L, Dh], Dh even")
    if qk.stride(-1) != 1 or qk.stride(2) != qk.shape[-1]:
        raise ValueError(
            f"rope: qk strides {qk.stride()}: expected each token's heads contiguous (head stride "
            f"{qk.shape[-1]} = Dh, unit last stride), as in the qkv projection's view"
        )
    _, b, h, n, dh = qk.shape
    if cos.shape != (n, dh // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"rope: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: expected [L, Dh/2] = [{n}, {dh // 2}] "
            "tables"
        )
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty((2, b, n, h, dh), dtype=qk.dtype, device=qk.device).permute(0, 1, 3, 2, 4)
    grid = (triton.cdiv(n, BLOCK_L), b, 2)
    _rope_kernel[grid](
        qk, out, cos, sin, n,
        qk.stride(0), qk.stride(1), qk.stride(3), out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        DH=dh, HD=h * dh, HD_P2=triton.next_power_of_2(h * dh), BLOCK=BLOCK_L, num_warps=4,
    )  # fmt: skip
    return out
