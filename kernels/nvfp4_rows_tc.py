"""NVFP4 linear for a few rows (1-64: decode batches, lm_head) on the tensor cores, `moe_tc`'s paired layout.

Why: the one-row NVFP4 GEMV (`nvfp4_gemm.nvfp4_gemv`) multiplies on CUDA cores, 5.8 SASS instructions a
code (decode, fp32 conversion, FMA with x); at lm_head's size it runs at 75-85% of the rate its instruction
issue allows (docs/PERF.md, session 37), and from two rows up the engine ran NVFP4 weights on cuBLAS over
bf16 copies, four times the bytes. `moe_tc`'s tile loop decodes codes straight into the wgmma operand
(`expert_rows`, `expert_tile_dot`): compiled here (sm_90), 261 instructions an iteration of 64 codes a
thread against the GEMV's 739 of 128, so ~1.4x the GEMV's issue bound for the same bytes, and each decoded
code serves up to 64 rows of x. Here that loop runs on one dense weight: x^T is
the MMA's N (16-64 columns, the rows of x; columns past M masked to zero), the weight's rows its M, 64 a
warpgroup; a weight row tile splits K over several programs when the tiles alone do not cover the SMs, the
last split to arrive summing them (`nvfp4_gemm.store_split_tile`). Stacked weights keep a tensor scale a row.
Against the fp32 product of the dequantized weights expect fp32-sum-order differences and the bf16 output
rounding (~4e-3 relative). H100, docs/PERF.md session 37: Qwen3.6's lm_head at 32 rows 138.7 us against
cuBLAS's 352.9 (the engine's lm_head for 2-64 rows since), at one row 130.5 against the GEMV's 118.8
(which there reads at 82% of the copy bandwidth: the issue bound is not what limits it on that GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl
from batchinfer.kernels.moe_tc import (
    expert_rows,
    expert_tile_dot,
    fit_steps,
    pair_groups,
    pair_scales,
    scale_words,
)
from batchinfer.kernels.nvfp4 import NVFP4Weight
from batchinfer.kernels.nvfp4_gemm import (
    check_gemm_out,
    check_rows_x,
    choose_split_k,
    interpreting,
    num_sms,
    split_k_locks,
    store_split_tile,
)

ROWS_TC_MAX_M = 64  # rows of x a launch takes (the widest wgmma N it compiles for)


@dataclass(frozen=True, slots=True)
class NVFP4PairedRows:
    """NVFP4 weights stacked along N in `moe_tc`'s paired layout: codes int32 `[N, K/8]` (`pair_groups`),
    block scales `[K/64, 1, N, 4]` (`pair_scales`, one "expert"), and each row's tensor scale fp32 `[N]`."""

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], 8 * self.codes.shape[1]


def pair_nvfp4_rows(weights: Sequence[NVFP4Weight]) -> NVFP4PairedRows:
    """`weights` (same K, a multiple of 32) stacked along N in the paired layout, tensor scales repeated per
    row."""
    if not weights:
        raise ValueError("pair_nvfp4_rows: expected at least one NVFP4 weight")
    ks = {w.shape[1] for w in weights}
    if len(ks) != 1 or next(iter(ks)) % 32:
        raise ValueError(f"pair_nvfp4_rows: the weights must share K (a multiple of 32), got {sorted(ks)}")
    packed = torch.cat([w.packed for w in weights])
    scales = torch.cat([w.block_scale.view(torch.uint8) for w in weights])
    ts = torch.cat([w.tensor_scale.reshape(1).expand(w.shape[0]) for w in weights]).float().contiguous()
    return NVFP4PairedRows(pair_groups(packed).view(torch.int32), pair_scales(scales[None]), ts)


@dataclass(frozen=True, slots=True)
class RowsTCConfig:
    """BLOCK_N weight rows a program (64 a warpgroup), num_warps, num_stages, STEPS 32-code blocks a K
    iteration (1, 2 or 4, as `MoETCConfig`), SPLIT programs a row tile over K (0: from the CTA count)."""

    block_n: int
    warps: int
    stages: int
    steps: int
    split: int


def rows_tc_config() -> RowsTCConfig:
    """64 rows on 4 warps, 4 stages, 4 blocks an iteration, K splits to cover the SMs: `tune_kernels --kinds
    nvfp4_rows_tc` on an H100 (docs/PERF.md session 37): on both lm_heads at 1-32 rows within 4% of the best
    of 24 configs (the best at 32 rows: Qwen3.6's 135.3 us against cuBLAS's 348.5 on the bf16 weight; 2 K
    splits gain up to 4% at 1-8 rows). Not yet swept on an H200."""
    if interpreting():  # few, wide programs: the interpreter's cost is per program and op
        return RowsTCConfig(64, 4, 1, 4, 1)
    return RowsTCConfig(64, 4, 4, 4, 0)


@triton.jit
def _nvfp4_rows_tc_kernel(
    x_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ws_ptr, lock_ptr,  #
    M, N,  #
    stride_xm, stride_wn, stride_sk, stride_sn, stride_om,  #
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, STEPS: tl.constexpr,  #
    SPLIT: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """out[m, n] = ts[n] * (w[n] . x[m]) for BLOCK_N rows n, every m < M, and one of SPLIT ranges of K a
    program; acc is [BLOCK_N, BLOCK_M] (rows x columns of x^T)."""
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    cols = tl.arange(0, BLOCK_M)
    valid = cols < M
    w_ptrs, s_ptrs = expert_rows(w_ptr, s_ptr, 0, rows, 0, stride_wn, stride_sk, 0, stride_sn, STEPS)
    x_ptrs = x_ptr + cols[None, :] * stride_xm + tl.arange(0, 32 * STEPS)[:, None]  # x^T [32 STEPS, BM]
    K_SPLIT: tl.constexpr = K // SPLIT  # a multiple of 32 STEPS (`fit_steps`)
    acc, _ = expert_tile_dot(x_ptrs, valid, w_ptrs, s_ptrs, mask_n[:, None], pid_s * K_SPLIT, N, stride_wn,  #
                             stride_sk, stride_sn, K_SPLIT // (32 * STEPS), BLOCK_N, BLOCK_M, STEPS, False,  #
                             INTERPRET)
    acc = acc * (tl.load(ts_ptr + rows, mask=mask_n, other=0.0) * 67108864.0)[:, None]  # tensor scale * 2^26
    mask = mask_n[:, None] & valid[None, :]
    out_ptrs = out_ptr + cols[None, :] * stride_om + rows[:, None]
    ws_ptrs = ws_ptr + cols[None, :] * N + rows[:, None]
    store_split_tile(acc, out_ptrs, ws_ptrs, mask, lock_ptr, pid_n, pid_s, M * N, SPLIT)


def nvfp4_rows_tc(
    x: torch.Tensor, w: NVFP4PairedRows, out: torch.Tensor | None = None, config: RowsTCConfig | None = None
) -> torch.Tensor:
    """A few bf16 rows `x [M, K]` (1 <= M <= ROWS_TC_MAX_M) times the paired NVFP4 rows `W [N, K]`
    transposed -> `[M, N]` bf16 (fp32 accumulation); into `out` when given (a view with unit column stride:
    CUDA graphs). `config` overrides the launch (a sweep)."""
    n, k = w.shape
    m = check_rows_x(x, k, ROWS_TC_MAX_M)
    if w.codes.device != x.device or w.codes.dtype != torch.int32 or not w.codes.is_contiguous() \
            or tuple(w.scales.shape) != (triton.cdiv(k, 64), 1, n, 4) or tuple(w.tensor_scale.shape) != (n,):
        raise ValueError("weight: expected NVFP4PairedRows as pair_nvfp4_rows makes them, on x's device")
    out = check_gemm_out(out, m, n, x.device)
    cfg = config or rows_tc_config()
    if cfg.steps not in (1, 2, 4):
        raise ValueError(f"RowsTCConfig: STEPS must be 1, 2 or 4, got {cfg.steps}")
    tiles = triton.cdiv(n, cfg.block_n)
    split = cfg.split or choose_split_k(tiles, k, 32 * cfg.steps, num_sms(x.device))
    steps, split = fit_steps(k, cfg.steps, split)
    st = scale_words(w.scales, steps)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    locks = split_k_locks(x.device, tiles) if split > 1 else out
    _nvfp4_rows_tc_kernel[(tiles, split)](
        x, w.codes, st, w.tensor_scale, out, ws, locks,  #
        m, n,  #
        x.stride(0), w.codes.stride(0), st.stride(0), st.stride(2), out.stride(0),  #
        K=k, BLOCK_N=cfg.block_n, BLOCK_M=max(16, triton.next_power_of_2(m)), STEPS=steps, SPLIT=split,  #
        INTERPRET=interpreting(), num_warps=cfg.warps, num_stages=cfg.stages, **pdl.launch(x.device),  #
    )
    return out


def nvfp4_rows_tc_ref(x: torch.Tensor, weights: Sequence[NVFP4Weight]) -> torch.Tensor:
    """fp32 `x @ W^T` of the stacked weights, each dequantized by its own formula (`NVFP4Weight`)."""
    return x.float() @ torch.cat([w.dequantize(torch.float32) for w in weights]).t()
