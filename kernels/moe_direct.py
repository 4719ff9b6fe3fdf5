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
    num_warps, num_stages, STEPS; one program a slot). STEPS and `max_regs` as in `MoETCConfig`. `fused`:
    both in one launch (`_moe_direct_kernel`), which takes gate_up's num_warps and num_stages for both."""

    gate_up: tuple[int, int, int, int, int]
    down: tuple[int, int, int, int]
    max_regs: int = 0
    fused: bool = False


def direct_config() -> MoEDirectConfig:
    """One config for 1-8 tokens (H100, one layer of each model, docs/PERF.md session 28 items 2 and 5): 64
    rows on 4 warps, 3 stages, 4 blocks an iteration for both; gate_up in 4 K splits. `tune_kernels --kinds
    moe_direct` found 4 stages ahead at 8 tokens and at one Qwen3-30B token, behind at one Qwen3.6 token,
    against the kernel probe's 3 stages ahead at 1-4 tokens: not changed until an H200 decides. Registers
    capped at 80 (H100, session 30, same call: `bench run single` Qwen3-30B 355.8 -> 364.5 decode tok/s,
    Qwen3.6 430.9 -> 428.8; one Qwen3-30B layer at one token 22.5 -> 17.9 us)."""
    if interpreting():
        return MoEDirectConfig((16, 4, 1, 2, 2), (16, 4, 1, 2))
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
def _gate_up_program(
    a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ids_ptr, ws_ptr, lock_ptr,  #
    entry, pid_n, pid_s, tiles, NUMEL, N, A_DIV,  #
    stride_am, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
    K: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr, SPLIT: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
):
    """out[entry, n] = silu(gate[n] . a[tok]) * (up[n] . a[tok]), tok = entry // A_DIV: BLOCK_N rows n
    (tile pid_n of `tiles`) and one of SPLIT ranges of K. Returns whether this program stored the tile (the
    last split to arrive)."""
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
    lock = lock_ptr + entry * tiles + pid_n
    act, last = silu_mul_splits(gate_up, ws_ptr, lock, entry, pid_s, NUMEL, N, rows, mask_n, gate_scale,  #
                                up_scale, SPLIT, INTERPRET)
    if last:
        tl.store(out_ptr + entry.to(tl.int64) * stride_om + rows, act, mask=mask_n)
    return last


@triton.jit
def _down_program(
    a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ids_ptr, route_w_ptr, ws_ptr, lock_ptr,  #
    res_ptr, norm_w_ptr, h_ptr, res_out_ptr, ready_ptr,  #
    t, pid_n, slot, tiles, T, N, eps, READY,  #
    stride_am, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
    stride_res, stride_h, stride_res_out,  #
    K: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr, SLOTS: tl.constexpr,  #
    INTERPRET: tl.constexpr, NORM: tl.constexpr, ONE_PLUS: tl.constexpr, BLOCK_D: tl.constexpr,  #
    WAIT: tl.constexpr, PREFETCH: tl.constexpr,  #
):
    """out[t, n] += route_w * (a[entry] . down_e[n]) for BLOCK_N rows n (tile pid_n of `tiles`), entry =
    t * SLOTS + slot; the last of a tile's slots sums them, with NORM the row's last tile the add + RMSNorm
    (`store_token_tile`). WAIT (in the one-launch kernel): the entry's row of `a` is ready once its counter
    at ready_ptr reaches READY (every gate_up tile stored); until then the program asks the L2 for its
    codes (PREFETCH); the tiles' last reader resets the counter."""
    entry = t * SLOTS + slot
    e = tl.load(ids_ptr + entry).to(tl.int64)
    scale = tl.load(ts_ptr + e) * tl.load(route_w_ptr + entry) * 67108864.0
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    w_ptrs, s_ptrs = expert_rows(w_ptr, s_ptr, e, rows, stride_we, stride_wn, stride_sk, stride_se, stride_sn,
                                 STEPS)
    x_ptrs, col0 = _x_column0(a_ptr, entry, stride_am, STEPS)
    if WAIT:
        if PREFETCH:
            first = pid_n * BLOCK_N
            pdl.prefetch_l2(w_ptr + e * stride_we + first * stride_wn,
                            tl.minimum(BLOCK_N, N - first) * stride_wn * 4)
        counter = ready_ptr + entry
        while _load_acquire(counter, INTERPRET) < READY:
            pass
    acc, _ = expert_tile_dot(x_ptrs, col0, w_ptrs, s_ptrs, mask_n[:, None], 0, N, stride_wn, stride_sk,
                             stride_sn, K // (32 * STEPS), BLOCK_N, COLUMNS, STEPS, False, INTERPRET, WAIT)
    if WAIT:
        if tl.atomic_add(counter, 1) == READY + tiles - 1:  # the entry's last reader
            tl.atomic_xchg(counter, 0)
    out = _column0(acc) * scale
    store_token_tile(out, ws_ptr, lock_ptr, out_ptr, t, pid_n, slot, tiles, T, N, rows, mask_n, stride_om,  #
                     res_ptr, norm_w_ptr, h_ptr, res_out_ptr, stride_res, stride_h, stride_res_out, eps,  #
                     SLOTS, NORM, ONE_PLUS, BLOCK_D, INTERPRET)


@triton.jit
def _load_acquire(ptr, INTERPRET: tl.constexpr):
    """*ptr (int32) with acquire semantics at GPU scope: loads after it see what the release before the
    value's increment published."""
    if INTERPRET:
        return tl.load(ptr)
    else:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _moe_direct_gate_up_kernel(
    a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ids_ptr, ws_ptr, lock_ptr,  #
    NUMEL, N, A_DIV,  #
    stride_am, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
    K: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr, SPLIT: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """`_gate_up_program` a program: grid (entries, row tiles, SPLIT)."""
    pdl.enter(PDL)
    _gate_up_program(a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ids_ptr, ws_ptr, lock_ptr,  #
                     tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(1),  #
                     NUMEL, N, A_DIV,  #
                     stride_am, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
                     K, BLOCK_N, STEPS, SPLIT, INTERPRET)


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
    """`_down_program` a program: grid (tokens, row tiles, slots); the token counters follow the tile
    counters [T * tiles]."""
    pdl.enter(PDL)
    _down_program(a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ids_ptr, route_w_ptr, ws_ptr, lock_ptr,  #
                  res_ptr, norm_w_ptr, h_ptr, res_out_ptr, lock_ptr,  #
                  tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(1), T, N, eps, 0,  #
                  stride_am, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
                  stride_res, stride_h, stride_res_out,  #
                  K, BLOCK_N, STEPS, SLOTS, INTERPRET, NORM, ONE_PLUS, BLOCK_D, False, False)


@triton.jit
def _moe_direct_kernel(
    a_ptr, w13_ptr, s13_ptr, ts13_ptr, inter_ptr, ids_ptr, ws13_ptr, lock13_ptr,  #
    w2_ptr, s2_ptr, ts2_ptr, out_ptr, route_w_ptr, ws2_ptr, lock2_ptr,  #
    res_ptr, norm_w_ptr, h_ptr, res_out_ptr, sync_ptr,  #
    T, NUMEL, I, D, eps, GU_TILES, DOWN_TILES,  #
    stride_am, stride_w13e, stride_w13n, stride_s13k, stride_s13e, stride_s13n, stride_im,  #
    stride_w2e, stride_w2n, stride_s2k, stride_s2e, stride_s2n, stride_om,  #
    stride_res, stride_h, stride_res_out,  #
    K13: tl.constexpr, BN13: tl.constexpr, STEPS13: tl.constexpr, SPLIT: tl.constexpr,  #
    K2: tl.constexpr, BN2: tl.constexpr, STEPS2: tl.constexpr, SLOTS: tl.constexpr,  #
    INTERPRET: tl.constexpr, NORM: tl.constexpr, ONE_PLUS: tl.constexpr, BLOCK_D: tl.constexpr,  #
    PREFETCH: tl.constexpr, PDL: tl.constexpr = False,  #
):
    """gate_up and down in one launch. Programs take tickets in the order they start (sync_ptr[0], reset by
    the last ticket): the first NUMEL * GU_TILES * SPLIT run gate_up tiles entry by entry, the rest down
    tiles in the same entry order, each waiting on its entry's counter (sync_ptr[1 + entry]), which every
    stored gate_up tile increments (release). A waiting program holds a ticket drawn after every gate_up
    ticket, so the gate_up programs it waits on are running: no order of dispatch can deadlock. A down
    tile starts when its entry's rows are stored, not when every entry's are, and its codes stream in while
    it waits."""
    pdl.enter(PDL)
    gate_ups = NUMEL * GU_TILES * SPLIT
    total = gate_ups + NUMEL * DOWN_TILES
    ticket = tl.atomic_add(sync_ptr, 1)
    if ticket == total - 1:
        tl.atomic_xchg(sync_ptr, 0)
    ready = sync_ptr + 1
    if ticket < gate_ups:
        entry = ticket // (GU_TILES * SPLIT)
        pid_n = ticket // SPLIT % GU_TILES
        stored = _gate_up_program(a_ptr, w13_ptr, s13_ptr, ts13_ptr, inter_ptr, ids_ptr, ws13_ptr,  #
                                  lock13_ptr, entry, pid_n, ticket % SPLIT, GU_TILES, NUMEL, I, SLOTS,  #
                                  stride_am, stride_w13e, stride_w13n, stride_s13k, stride_s13e,  #
                                  stride_s13n, stride_im, K13, BN13, STEPS13, SPLIT, INTERPRET)
        if stored:
            tl.debug_barrier()  # every thread's stores of the tile before the count (release)
            tl.atomic_add(ready + entry, 1, sem="release")
    else:
        j = ticket - gate_ups
        entry = j // DOWN_TILES
        _down_program(inter_ptr, w2_ptr, s2_ptr, ts2_ptr, out_ptr, ids_ptr, route_w_ptr, ws2_ptr,  #
                      lock2_ptr, res_ptr, norm_w_ptr, h_ptr, res_out_ptr, ready,  #
                      entry // SLOTS, j % DOWN_TILES, entry % SLOTS, DOWN_TILES, T, D, eps, GU_TILES,  #
                      stride_im, stride_w2e, stride_w2n, stride_s2k, stride_s2e, stride_s2n, stride_om,  #
                      stride_res, stride_h, stride_res_out,  #
                      K2, BN2, STEPS2, SLOTS, INTERPRET, NORM, ONE_PLUS, BLOCK_D, True, PREFETCH)


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

    if cfg.fused:
        _moe_direct_one_launch(h, ids, rw, w, cfg, norm, inter, out)
        return out

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



def _moe_direct_one_launch(
    h: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w: MoEWeights, cfg: MoEDirectConfig,
    norm: FusedNorm | None, inter: torch.Tensor, out: torch.Tensor,
) -> None:  # fmt: skip
    """`_moe_direct_kernel` for `moe_experts_direct`: its counters in one zeroed buffer, in disjoint parts
    (gate_up's split counters, down's slot and token counters, the ticket and the entries' counters), all
    live at once."""
    t, a = ids.shape
    inter_n, d = w.intermediate, w.hidden
    dev = h.device
    bn13, warps, stages, steps13, split = cfg.gate_up
    steps13, split = fit_steps(d, steps13, split)
    bn2, _, _, steps2 = cfg.down
    steps2, _ = fit_steps(inter_n, steps2)
    gu_tiles, down_tiles = triton.cdiv(inter_n, bn13), triton.cdiv(d, bn2)
    w13, s13 = w.w13.view(torch.int32), scale_words(w.w13_scale, steps13)
    w2, s2 = w.w2.view(torch.int32), scale_words(w.w2_scale, steps2)
    ws13 = torch.empty((split, t * a, 2, inter_n), dtype=torch.float32, device=dev) if split > 1 else out
    ws2 = torch.empty((a, t, d), dtype=torch.float32, device=dev) if a > 1 else out
    n13, n2 = t * a * gu_tiles, t * down_tiles + t
    locks = split_k_locks(dev, n13 + n2 + 1 + t * a)
    lock13, lock2, sync = locks[:n13], locks[n13 : n13 + n2], locks[n13 + n2 :]
    (res, norm_w, normed, res_out), eps, norm_args = fused_norm_args(norm, out)
    contiguous_rows = w2.stride(2) == 1 and w2.stride(1) == w2.shape[2]
    _moe_direct_kernel[(t * a * (gu_tiles * split + down_tiles),)](
        h, w13, s13, w.w13_tensor_scale, inter, ids, ws13, lock13,  #
        w2, s2, w.w2_tensor_scale, out, rw, ws2, lock2,  #
        res, norm_w, normed, res_out, sync,  #
        t, t * a, inter_n, d, eps, gu_tiles, down_tiles,  #
        h.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s13.stride(2),  #
        inter.stride(0),  #
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), s2.stride(2), out.stride(0),  #
        res.stride(0), normed.stride(0), res_out.stride(0),  #
        K13=d, BN13=bn13, STEPS13=steps13, SPLIT=split, K2=inter_n, BN2=bn2, STEPS2=steps2, SLOTS=a,  #
        INTERPRET=interpreting(), **norm_args, PREFETCH=contiguous_rows and pdl.launch(dev)["PDL"],  #
        num_warps=warps, num_stages=stages, maxnreg=cfg.max_regs or None, **pdl.launch(dev),  #
    )
