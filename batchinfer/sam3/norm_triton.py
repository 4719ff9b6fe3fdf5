"""The ViT block's LayerNorms fused with the window partitioning and the residual add (CUDA, bf16).

Why: around attention a windowed block ran LayerNorm, a window-partition copy, an unpartition copy, the
residual add and the second LayerNorm as five passes over the [B, 72, 72, 1024] token grid; on the H200
copies, LayerNorms and adds took 50 of the 227 ms of a 16-image backbone (docs/PERF_IMAGES.md, session
14). Here two passes do the same: `layer_norm_rows` writes norm1's output straight in window order, and
`add_layer_norm_rows` adds the attention output read back from window order and normalises the sum.

Rows are tokens. `window` 0 means no partitioning (the global blocks). The math follows PyTorch's bf16
ops: the sum is rounded to the input dtype before it is normalised (as `x + y` then `LayerNorm` do),
statistics and the affine map in fp32, one rounding on the way out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchinfer.kernels.nvfp4_gemm import interpreting
from batchinfer.kernels.small_ops import _to

BLOCK_ROWS = 4  # tokens a program


@triton.jit
def _window_rows(t, H: tl.constexpr, W: tl.constexpr, WIN: tl.constexpr):
    """Image-order token t of a [B, H, W] grid -> its row in window order ([B, H/w, W/w, w, w]). One
    return: code after a return inside a constexpr `if` is still compiled (H // 0 for WIN = 0)."""
    if WIN == 0:
        win = t
    else:
        b = t // (H * W)
        rem = t % (H * W)
        row = rem // W
        col = rem % W
        win = (((b * (H // WIN) + row // WIN) * (W // WIN) + col // WIN) * WIN + row % WIN) * WIN + col % WIN
    return win


@triton.jit
def _ln_kernel(
    x_ptr, y_ptr, w_ptr, b_ptr, sum_ptr, out_ptr, n_rows, eps,
    D: tl.constexpr, D_P2: tl.constexpr, H: tl.constexpr, W: tl.constexpr, WIN: tl.constexpr,
    ADD: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Rows t (image order) of x [n_rows, D]. ADD: s = x[t] + y[window row of t], stored to sum[t], and
    out[t] = LN(s); else out[window row of t] = LN(x[t])."""
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: t * D passes 2^31 at ~400 images
    d = tl.arange(0, D_P2)
    row_ok = t < n_rows
    mask = row_ok[:, None] & (d[None, :] < D)
    win = _window_rows(t, H, W, WIN)
    x = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0)
    if ADD:
        y = tl.load(y_ptr + win[:, None] * D + d[None, :], mask=mask, other=0.0)
        s = _to(x.to(tl.float32) + y.to(tl.float32), x_ptr.dtype.element_ty, INTERPRET)  # rounded, as `x + y`
        tl.store(sum_ptr + t[:, None] * D + d[None, :], s, mask=mask)
        v = s.to(tl.float32)
        dst = t
    else:
        v = x.to(tl.float32)
        dst = win
    mean = tl.sum(v, axis=1) / D
    centred = tl.where(mask, v - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / D + eps)
    weight = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    out = centred * rstd[:, None] * weight[None, :] + bias[None, :]
    tl.store(
        out_ptr + dst[:, None] * D + d[None, :], _to(out, out_ptr.dtype.element_ty, INTERPRET), mask=mask
    )


def _check(x: Tensor, norm: torch.nn.LayerNorm, window: int) -> tuple[int, int, int, int]:
    if x.dim() != 4 or not x.is_contiguous() or tuple(norm.normalized_shape) != (x.shape[-1],):
        raise ValueError(
            f"LayerNorm rows: x {tuple(x.shape)} (contiguous {x.is_contiguous()}), norm "
            f"{tuple(norm.normalized_shape)}: expected a contiguous [B, H, W, D] grid and a norm over D"
        )
    b, h, w, d = x.shape
    if window and (h % window or w % window):
        raise ValueError(f"LayerNorm rows: a {h} x {w} grid does not split into {window} x {window} windows")
    return b, h, w, d


def _launch(
    x: Tensor, y: Tensor | None, total: Tensor | None, out: Tensor, norm: torch.nn.LayerNorm, window: int
) -> None:
    """`_ln_kernel` over x's rows; with y (and `total` for the sum) the add + norm form."""
    b, h, w, d = _check(x, norm, window)
    n = b * h * w
    _ln_kernel[(triton.cdiv(n, BLOCK_ROWS),)](
        x, x if y is None else y, norm.weight, norm.bias, out if total is None else total, out, n, norm.eps,
        D=d, D_P2=triton.next_power_of_2(d), H=h, W=w, WIN=window, ADD=y is not None, BLOCK=BLOCK_ROWS,
        INTERPRET=interpreting(), num_warps=4,
    )  # fmt: skip


def layer_norm_rows(x: Tensor, norm: torch.nn.LayerNorm, window: int) -> Tensor:
    """norm(x) of x [B, H, W, D]: [B * nW, window^2, D] in window order (`vit.window_partition`'s), or
    [B, H * W, D] for window 0."""
    out = torch.empty_like(x)
    _launch(x, None, None, out, norm, window)
    b, h, w, d = x.shape
    return out.view(-1, window * window, d) if window else out.view(b, h * w, d)


def add_layer_norm_rows(x: Tensor, y: Tensor, norm: torch.nn.LayerNorm, window: int) -> tuple[Tensor, Tensor]:
    """x [B, H, W, D] plus y (the same tokens in window order, [B * nW, window^2, D], or [B, H * W, D] for
    window 0) -> (s = x + y as [B, H, W, D], norm(s) as [B, H, W, D])."""
    if y.numel() != x.numel() or not y.is_contiguous() or y.dtype != x.dtype:
        raise ValueError(
            f"add + LayerNorm: y {tuple(y.shape)} {y.dtype} (contiguous {y.is_contiguous()}): expected the "
            f"{x.numel()} elements of x {tuple(x.shape)} {x.dtype}, contiguous"
        )
    total, out = torch.empty_like(x), torch.empty_like(x)
    _launch(x, y, total, out, norm, window)
    return total, out
