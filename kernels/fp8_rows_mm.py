"""FP8 W8A16 linear for a few rows (2-64: decode batches) on stacked checkpoint weights (`FP8Rows`).

Why: from two rows up the engine ran its FP8 projections on cuBLAS over bf16 copies of the weights, twice the
bytes of the checkpoint's, because the tile kernel `_fp8_gemm_kernel` (x as the MMA's A operand, the decoded
weight as B) routes every decoded weight tile through shared memory, and at M = 32 moved 0.77 TB/s (session 4)
against cuBLAS bf16's ~3. Here the product runs swapped, out^T = W x^T: the weight tile, decoded in registers
(E4M3 -> bf16 is exact), is the wgmma's register operand (A, 64 rows a warpgroup), and the few rows of x are
its N (`_dot_nt`: x tiles loaded row-major, transposed in shared memory). The rows of `FP8Rows` keep a scale
each (stacked tensors), and its bf16 tail rows (DeltaNet's b|a) run in the same launch, a tile that straddles
the boundary running both loops. K is a constexpr, so every split's K loop runs at least once: no zero-trip
path defines the accumulator, which makes ptxas serialize wgmmas (`sm90_report`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from batchinfer.kernels.fp8_gemm import FP8Rows, check_fp8_rows
from batchinfer.kernels.nvfp4_gemm import (
    _dot_nt,
    check_gemm_out,
    check_rows_x,
    choose_split_k,
    interpreting,
    num_sms,
    split_k_locks,
    store_split_tile,
)

ROWS_MM_MAX_M = 64  # rows of x a launch takes (the wgmma N of one tile)


@dataclass(frozen=True, slots=True)
class RowsMMConfig:
    """Weight rows and K columns a tile, K splits (0: from the CTA count), warps, pipeline stages."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def fp8_rows_mm_config() -> RowsMMConfig:
    """64 weight rows on one warpgroup (wgmma M = 64), 128 K columns a stage. Not yet tuned."""
    return RowsMMConfig(16, 32, 0, 4, 1) if interpreting() else RowsMMConfig(64, 128, 0, 4, 4)


@triton.jit
def _fp8_rows_mm_kernel(
    x_ptr, w_ptr, scale_ptr, tail_ptr, out_ptr, ws_ptr, lock_ptr,  #
    M, N, N_TAIL, stride_xm, stride_wn, stride_om,  #
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  #
    SPLIT_K: tl.constexpr, HAS_TAIL: tl.constexpr, F32_DOT: tl.constexpr,  #
):
    """acc[n, m] = sum over this split's K of W[n, k] x[m, k]; out[m, n] = scale[n] acc[n, m], rows N to
    N + N_TAIL from `tail` [N_TAIL, K] bf16 (scale 1). Grid: (weight row tiles, K splits); every row of x
    (M <= BLOCK_M) in each program."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    K_SPLIT: tl.constexpr = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # x tiles [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if pid_n * BLOCK_N < N:
        mask_w = rows < N
        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
        for i in range(K_SPLIT // BLOCK_K):
            mask_k = offs_k + i * BLOCK_K < K
            x = tl.load(x_ptrs + i * BLOCK_K, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(w_ptrs + i * BLOCK_K, mask=mask_w[:, None] & mask_k[None, :], other=0)
            acc = _dot_nt(b.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), x, acc, F32_DOT)
    n_out = N
    if HAS_TAIL:
        n_out = N + N_TAIL
        if (pid_n + 1) * BLOCK_N > N:
            mask_t = (rows >= N) & (rows < n_out)
            t_ptrs = tail_ptr + (rows - N)[:, None] * K + offs_k[None, :]
            for i in range(K_SPLIT // BLOCK_K):
                mask_k = offs_k + i * BLOCK_K < K
                x = tl.load(x_ptrs + i * BLOCK_K, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                t = tl.load(t_ptrs + i * BLOCK_K, mask=mask_t[:, None] & mask_k[None, :], other=0.0)
                acc = _dot_nt(t, x, acc, F32_DOT)
    acc = acc * tl.load(scale_ptr + rows, mask=rows < N, other=1.0)[:, None]
    mask = (rows < n_out)[:, None] & mask_m[None, :]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + rows[:, None]
    ws_ptrs = ws_ptr + offs_m[None, :] * n_out + rows[:, None]
    store_split_tile(acc, out_ptrs, ws_ptrs, mask, lock_ptr, pid_n, pid_k, M * n_out, SPLIT_K)


def fp8_rows_mm(
    x: torch.Tensor, w: FP8Rows, out: torch.Tensor | None = None, config: RowsMMConfig | None = None
) -> torch.Tensor:
    """A few bf16 rows `x [M, K]` (1 <= M <= ROWS_MM_MAX_M) times stacked FP8 (and bf16 tail) rows
    `W [N, K]` transposed -> `[M, N]` bf16 with fp32 accumulation, reading the checkpoint's FP8 bytes.
    `out` may be a view with unit column stride; `config` overrides the launch (tuner)."""
    k = w.data.shape[1]
    m = check_rows_x(x, k, ROWS_MM_MAX_M)
    check_fp8_rows(w, x.device)
    out = check_gemm_out(out, m, w.rows, x.device)
    n = w.data.shape[0]
    n_tail = w.rows - n
    cfg = config or fp8_rows_mm_config()
    block_m = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(w.rows, cfg.block_n)
    split = cfg.split_k or choose_split_k(tiles, k, cfg.block_k, num_sms(x.device))
    ws = torch.empty((split, m, w.rows), dtype=torch.float32, device=x.device) if split > 1 else out
    locks = split_k_locks(x.device, tiles) if split > 1 else out
    _fp8_rows_mm_kernel[(tiles, split)](
        x, w.data.view(torch.uint8), w.scale, x if w.tail is None else w.tail, out, ws, locks,  #
        m, n, n_tail, x.stride(0), w.data.stride(0), out.stride(0),  #
        K=k, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,  #
        HAS_TAIL=w.tail is not None, F32_DOT=interpreting(), num_warps=cfg.num_warps,  #
        num_stages=cfg.num_stages,  #
    )
    return out


def fp8_rows_mm_ref(x: torch.Tensor, w: FP8Rows) -> torch.Tensor:
    """fp32 `x @ W^T` of `fp8_rows_mm` (each FP8 row times its scale, then the tail rows)."""
    dense = w.data.float() * w.scale[:, None]
    if w.tail is not None:
        dense = torch.cat([dense, w.tail.float()])
    return x.float() @ dense.t()
