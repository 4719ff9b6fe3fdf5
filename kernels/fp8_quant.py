"""Per-row dynamic FP8 (E4M3) quantization of activations in one pass, for `torch._scaled_mm` with row-wise
scales (the SAM 3 ViT's FP8 linears, `batchinfer/sam3/fp8.py`).

Why a kernel: in PyTorch ops the same takes four passes over x (abs, row max, divide, cast); here each
program reads one row once and writes its E4M3 codes and its scale: scale = max|x| / 448 (E4M3's largest
finite value), code = x / scale rounded to nearest (the GPU's `cvt.rn.satfinite`). On the CPU (tests, the
reference engine) `quantize_rows_fp8` runs `quantize_rows_fp8_ref`. The Triton interpreter's fp32 ->
E4M3 cast is its own (it truncates, and loses a binade when the mantissa carries), so the kernel's CPU
test checks the scales exactly and the codes only roughly; its GPU test asks for PyTorch's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), 448.0)  # IEEE division, as PyTorch's
    tl.store(q_ptr + row * stride_q + offs, tl.div_rn(x, scale).to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` (bf16/fp16/fp32, unit column stride) -> (E4M3 codes `[M, K]`, fp32 scales `[M, 1]`)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected a 2-D tensor with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if not x.is_cuda:
        return quantize_rows_fp8_ref(x)
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK_K=block,
                                num_warps=max(1, min(16, block // 256)))
    return q, s


def quantize_rows_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of `quantize_rows_fp8`."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    # A tensor divisor: PyTorch's CUDA division by a Python scalar multiplies by its fp32 reciprocal
    # (1 / 448 is inexact, so ~1 ulp off for some rows), where the kernel divides in IEEE.
    s = amax / torch.full_like(amax, FP8_MAX)
    return (xf / s).to(torch.float8_e4m3fn), s
