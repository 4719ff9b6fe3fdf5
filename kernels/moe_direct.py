"""NVFP4 MoE for a few tokens on the tensor cores with no alignment: one program an entry.

Why: at one to eight tokens a layer's 8-72 (token, expert) entries mostly route to distinct experts. The
decode path (`moe.py`) runs them as GEMVs on CUDA cores at ~7 SASS instructions a code (docs/PERF.md,
session 27); `moe_tc` decodes a code in ~3.9 and multiplies on the tensor cores, but first groups the
entries by expert (`moe_align`, three launches) and sums each token's slots after (`sum_slots`). Here
every entry is its own tile: x^T has 16 columns (the smallest MMA N Triton takes) of which column 0 is the
entry's row, the rest masked to zero. The MMA does 16 times the useful work, which costs nothing at this
size: the weight bytes and their decode take the time, and they are `moe_tc`'s (`expert_rows`,
`expert_tile_dot`: the paired layout, decoded in registers into the wgmma operand).
- gate_up: one program an (entry, column tile, K split), SPLIT programs a tile to cover the SMs (a lone
  token's 72-96 tiles would leave most idle); the last of them sums the splits (`split_total`) and stores
  `silu(gate) * up` in bf16.
- down: one program a (token, column tile, slot); the last of a tile's slots sums them in slot order with
  the routing weights and stores bf16, rounded once (as the decode path, not `moe_tc`'s per-slot bf16
  rows); with `norm` the program that completes a token's row then runs the residual add + RMSNorm that
  follows the block (`small_ops.store_token_tile`, `moe_experts_add_rmsnorm`).
H100, docs/PERF.md session 28: one Qwen3.6 layer at one token 22.4 us on the decode path (both kernels
and the norm), 19.7 here; Qwen3-30B 28.4 -> 21.7; at 2 and 4 tokens 17-32% less; at 8 tokens 20-26% less
(and 6-12% under `moe_tc`). `single` +3.2% (Qwen3.6), +7.8% (Qwen3-30B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl
from batchinfer.kernels.moe_tc import expert_rows, expert_tile_dot, fit_steps, scale_words
from batchinfer.kernels.moe_weights import MoEWeights
from batchinfer.kernels.nvfp4_gemm import interpreting, split_k_locks
from batchinfer.kernels.small_ops import FusedNorm, fused_norm_args, silu_mul_splits, store_token_tile

COLUMNS = tl.constexpr(16)  # x^T columns a tile: the smallest MMA N; column 0 holds the entry's row


@dataclass(frozen=True, slots=True)
class MoEDirectConfig:
    """gate_up (BLOCK_N, num_warps, num_stages, STEPS, SPLIT: programs a tile over K) and down (BLOCK_N,
    num_warps, num_stages, STEPS; one program a slot). STEPS and `max_regs` as in `MoETCConfig`."""

    gate_up: tuple[int, int, int, int, int]
    down: tuple[int, int, int, int]
    max_regs: int = 0


def direct_config() -> MoEDirectConfig:
    """One config for 1-8 tokens (H100, one layer of each model, docs/PERF.md session 28 items 2 and 5): 64
    rows on 4 warps, 3 stages, 4 blocks an iteration for both; gate_up in 4 K splits. `tune_kernels --kinds
    moe_direct` found 4 stages ahead at 8 tokens and at one Qwen3-30B token, behind at one Qwen3.6 token,
    against the kernel probe's 3 stages ahead at 1-4 tokens: not changed until an H200 decides. Registers
    capped at 80 (H100, session 30, same call: `bench run single` Qwen3-30B 355.8 -> 364.5 decode tok/s,
    Qwen3.6 430.9 -> 428.8; one Qwen3-30B layer at one token 22.5 -> 17.9 us)."""
    if interpreting():  # one wide tile, no K split: the interpreter's cost is per program and op
        return MoEDirectConfig((64, 4, 1, 4, 1), (64, 4, 1, 4))
    return MoEDirectConfig((64, 4, 3, 4, 4), (64, 4, 3, 4), max_regs=80)


@triton.jit
def _column0(acc):
    """[BN, COLUMNS] -> [BN]: the accumulator's column 0 (the entry's; the others are zero)."""
    return tl.sum(tl.where((tl.arange(0, acc.shape[1]) == 0)[None, :], acc, 0.0), axis=1)


@triton.jit
def _x_column0(a_ptr, row, stride_am, STEPS: tl.constexpr):
    """x^T pointers [32 STEPS, COLUMNS] at K = 0 of x row `row`, and the mask that reads column 0 only."""
    cols = tl.arange(0, COLUMNS)
    ptrs = a_ptr + row.to(tl.int64) * stride_am + tl.arange(0, 32 * STEPS)[:, None] + cols[None, :] * 0
    return ptrs, cols == 0


@triton.jit
def _moe_direct_gate_up_kernel(
    a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ids_ptr, ws_ptr, lock_ptr,  #
    NUMEL, N, A_DIV,  #
    stride_am, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
    K: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr, SPLIT: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """out[entry, n] = silu(gate[n] . a[tok]) * (up[n] . a[tok]), tok = entry // A_DIV: BLOCK_N rows n and
    one of SPLIT ranges of K a program."""
    pdl.enter(PDL)
    entry = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    e = tl.load(ids_ptr + entry).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    w_ptrs, s_ptrs = expert_rows(w_ptr, s_ptr, e, rows, stride_we, stride_wn, stride_sk, stride_se, stride_sn,
                                 STEPS)
    x_ptrs, col0 = _x_column0(a_ptr, entry // A_DIV, stride_am, STEPS)
    K_SPLIT: tl.constexpr = K // SPLIT  # a multiple of 32 STEPS (`fit_steps`)
    acc, acc_up = expert_tile_dot(x_ptrs, col0, w_ptrs, s_ptrs, mask_n[:, None], pid_s * K_SPLIT, N,  #
                                  stride_wn, stride_sk, stride_sn, K_SPLIT // (32 * STEPS), BLOCK_N,  #
                                  COLUMNS, STEPS, True, INTERPRET)
    gate_up = tl.join(_column0(acc), _column0(acc_up))  # [BN, 2]
    gate_scale = tl.load(ts_ptr + e * 2) * 67108864.0  # tensor scale * 2^26 (`moe_tc`)
    up_scale = tl.load(ts_ptr + e * 2 + 1) * 67108864.0
    lock = lock_ptr + entry * tl.num_programs(1) + pid_n
    act, last = silu_mul_splits(gate_up, ws_ptr, lock, entry, pid_s, NUMEL, N, rows, mask_n, gate_scale,  #
                                up_scale, SPLIT, INTERPRET)
    if last:
        tl.store(out_ptr + entry.to(tl.int64) * stride_om + rows, act, mask=mask_n)


@triton.jit
def _moe_direct_down_kernel(
    a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ids_ptr, route_w_ptr, ws_ptr, lock_ptr,  #
    res_ptr, norm_w_ptr, h_ptr, res_out_ptr,  #
    T, N, eps,  #
    stride_am, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
    stride_res, stride_h, stride_res_out,  #
    K: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr, SLOTS: tl.constexpr,  #
    INTERPRET: tl.constexpr, NORM: tl.constexpr, ONE_PLUS: tl.constexpr, BLOCK_D: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """out[t, n] = sum over the token's SLOTS slots of route_w * (a[entry] . down_e[n]): one program a
    (token, BLOCK_N rows, slot). NORM: then the residual add + RMSNorm of the token's row into h and
    res_out (`store_token_tile`; the token counters follow the tile counters [T * tiles])."""
    pdl.enter(PDL)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    entry = t * SLOTS + slot
    e = tl.load(ids_ptr + entry).to(tl.int64)
    scale = tl.load(ts_ptr + e) * tl.load(route_w_ptr + entry) * 67108864.0
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    w_ptrs, s_ptrs = expert_rows(w_ptr, s_ptr, e, rows, stride_we, stride_wn, stride_sk, stride_se, stride_sn,
                                 STEPS)
    x_ptrs, col0 = _x_column0(a_ptr, entry, stride_am, STEPS)
    acc, _ = expert_tile_dot(x_ptrs, col0, w_ptrs, s_ptrs, mask_n[:, None], 0, N, stride_wn, stride_sk,
                             stride_sn, K // (32 * STEPS), BLOCK_N, COLUMNS, STEPS, False, INTERPRET)
    out = _column0(acc) * scale
    store_token_tile(out, ws_ptr, lock_ptr, out_ptr, t, pid_n, slot, T, N, rows, mask_n, stride_om,  #
                     res_ptr, norm_w_ptr, h_ptr, res_out_ptr, stride_res, stride_h, stride_res_out, eps,  #
                     SLOTS, NORM, ONE_PLUS, BLOCK_D, INTERPRET)


def moe_experts_direct(
    h: torch.Tensor,
    ids: torch.Tensor,
    rw: torch.Tensor,
    w: MoEWeights,
    cfg: MoEDirectConfig,
    norm: FusedNorm | None = None,
) -> torch.Tensor:
    """`moe.moe_experts` on this path: `h [T, D]` bf16, `ids [T, A]` int32, flat fp32 `rw [T * A]`, paired
    NVFP4 experts -> `[T, D]` bf16 (`moe_experts` checks the inputs). With `norm`, the down kernel also
    writes its residual add + RMSNorm into `norm.h` and `norm.residual_out`."""
    if not w.paired:
        raise ValueError("moe_experts_direct: expected experts in the paired layout "
                         "(moe_tc.pair_moe_weights)")
    t, a = ids.shape
    inter_n, d = w.intermediate, w.hidden
    dev = h.device
    ids = ids.contiguous()
    inter = torch.empty((t * a, inter_n), dtype=torch.bfloat16, device=dev)
    out = torch.empty((t, d), dtype=torch.bfloat16, device=dev)

    block_n, warps, stages, steps, split = cfg.gate_up
    steps, split = fit_steps(d, steps, split)
    tiles = triton.cdiv(inter_n, block_n)
    wt, st = w.w13.view(torch.int32), scale_words(w.w13_scale, steps)
    ws = torch.empty((split, t * a, 2, inter_n), dtype=torch.float32, device=dev) if split > 1 else out
    locks = split_k_locks(dev, t * a * tiles) if split > 1 else out
    _moe_direct_gate_up_kernel[(t * a, tiles, split)](
        h, wt, st, w.w13_tensor_scale, inter, ids, ws, locks,  #
        t * a, inter_n, a,  #
        h.stride(0), wt.stride(0), wt.stride(1), st.stride(0), st.stride(1), st.stride(2), inter.stride(0),  #
        K=d, BLOCK_N=block_n, STEPS=steps, SPLIT=split, INTERPRET=interpreting(),  #
        num_warps=warps, num_stages=stages, maxnreg=cfg.max_regs or None, **pdl.launch(dev),  #
    )

    block_n, warps, stages, steps = cfg.down
    steps, _ = fit_steps(inter_n, steps)
    tiles = triton.cdiv(d, block_n)
    wt, st = w.w2.view(torch.int32), scale_words(w.w2_scale, steps)
    ws = torch.empty((a, t, d), dtype=torch.float32, device=dev) if a > 1 else out
    locks = split_k_locks(dev, t * tiles + t)  # slot counters [t * tiles], then (norm) the tokens' [t]
    (res, norm_w, normed, res_out), eps, norm_args = fused_norm_args(norm, out)
    _moe_direct_down_kernel[(t, tiles, a)](
        inter, wt, st, w.w2_tensor_scale, out, ids, rw, ws, locks,  #
        res, norm_w, normed, res_out,  #
        t, d, eps,  #
        inter.stride(0), wt.stride(0), wt.stride(1), st.stride(0), st.stride(1), st.stride(2),  #
        out.stride(0), res.stride(0), normed.stride(0), res_out.stride(0),  #
        K=inter_n, BLOCK_N=block_n, STEPS=steps, SLOTS=a, INTERPRET=interpreting(), **norm_args,  #
        num_warps=warps, num_stages=stages, maxnreg=cfg.max_regs or None, **pdl.launch(dev),  #
    )
    return out

