"""Fused MoE for Qwen3-MoE / Qwen3.5-MoE: router top-k, grouped gate_up GEMM with SiLU*up, down GEMM.

Flow (no host sync; CUDA-graph safe): `logits = h @ router^T` (cuBLAS, bf16) -> `moe_route` (one
program per token: fp32 softmax, top-k, renormalise; the shared expert rides along as slot A with
weight sigmoid(shared_gate logit)) -> one of five paths (by entry count and layout, `_moe_configs`):
- a few tokens of paired NVFP4 experts (the engine's, at most DIRECT_MAX_ENTRIES entries): the direct path
  (`moe_direct`), the tensor cores on one tile an entry with no alignment, `moe_tc`'s decode, and this
  module's fused combine and add + RMSNorm in down;
- the decode path (NVFP4 experts in the standard layout, at most DECODE_MAX_ENTRIES entries): no alignment;
  gate_up one program per (entry, column tile, K split), down one per (token, column tile, slot split)
  with the routing weights and the top-k sum fused; GEMVs on CUDA cores that decode and multiply each
  word of 8 E2M1 codes in one inline PTX block (`nvfp4_gemm.e2m1_dot8`) and apply each 16-code block
  scale once per group sum; `moe_experts_add_rmsnorm` also fuses the residual add + RMSNorm that follows
  the block into down (the last program of a token's row tiles normalises the row);
- mid-size batches of NVFP4 experts in `moe_tc`'s paired layout (the engine's): `moe_tc`, the weight as
  the tensor cores' register operand (1.3-2x the grouped GEMMs below, timed on the H200);
- the fused grouped GEMMs (bf16 experts, or NVFP4 in the standard layout): `moe_align` (entries grouped
  by expert, BLOCK_M-padded) -> gate_up GEMM (x rows gathered by token, gate and up tiles of the same
  columns, `silu(g) * u` in the fp32 epilogue, written per entry) -> down GEMM (routing weight applied in
  the epilogue, written per entry) -> a sum over each token's slots (`small_ops.sum_slots`: one pass
  over `[T, A, D]`, fp32);
- many entries (prefill): the experts decoded to bf16 once, then `torch._grouped_mm`
  (`moe_grouped_mm.py`).
Weights are stacked at load (`moe_weights.stack_moe_weights`): NVFP4 `uint8 [E', 2I, D/2]` (gate rows then up
rows), e4m3 bytes `[E', 2I, D/16]`, tensor scales `[E', 2]` (gate and up keep their own), down
`[E', D, I/2]`, `[E', D, I/16]`, `[E']`; or bf16 `[E', 2I, D]` / `[E', D, I]`. E' = E + 1 when the shared
expert is stacked as expert E (it needs the routed experts' width, as in Qwen3.5/3.6).
Accumulation is fp32 and intermediates are bf16 (as in the HF model); the decode path sums a token's
slots in fp32 and rounds once (the grouped path rounds each slot's output to bf16 first). Against
`fused_moe_ref` (fp32 throughout) expect ~1e-2 relative error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl
from batchinfer.kernels.moe_align import moe_align
from batchinfer.kernels.moe_direct import MoEDirectConfig, direct_config, moe_experts_direct
from batchinfer.kernels.moe_grouped_mm import moe_experts_grouped_mm
from batchinfer.kernels.moe_tc import MoETCConfig, moe_experts_tc, paired_dot8, scale_offset, slot_k
from batchinfer.kernels.moe_weights import MoEWeights
from batchinfer.kernels.nvfp4 import NVFP4Weight
from batchinfer.kernels.nvfp4_gemm import (
    _decode_nvfp4_tile,
    bf16_rne,
    e4m3_to_f32,
    group_dot16,
    interpreting,
    split_k_locks,
)
from batchinfer.kernels.small_ops import (
    FusedNorm,
    _row_configs,
    add_rmsnorm,
    fused_norm_args,
    silu_mul_splits,
    store_token_tile,
    sum_slots,
)


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Launch configuration of the grouped GEMMs: BLOCK_M (also the alignment), then per GEMM
    (BLOCK_N, BLOCK_K, num_warps, num_stages)."""

    block_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class MoEGroupedMMConfig:
    """Selects the grouped-GEMM path (`moe_grouped_mm`): experts decoded to bf16 once, then
    `torch._grouped_mm`; it has nothing to tune."""


@dataclass(frozen=True, slots=True)
class MoEDecodeConfig:
    """Launch configuration of the NVFP4 decode path, per kernel (BLOCK_N, BLOCK_G (16-code scale groups
    per K step), num_warps, SPLIT). gate_up splits K and down splits the token's slots over SPLIT
    programs; the last of them to finish sums the fp32 partials in split order (deterministic). Splits
    turn one long chain of dependent loads per program into independent ones (a lone token otherwise
    leaves the GPU waiting on DRAM latency, not bandwidth)."""

    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


# Entries (tokens x slots) up to which NVFP4 experts in the standard layout take the decode path (against
# the fused grouped GEMMs): 32 tokens of 9 slots. Paired experts (the engine's) never do: on an H100
# (session 36, `tune_kernels --kinds moe_paths` and `--kinds moe_direct`, docs/PERF.md) it lost at every
# size timed, 1 to 32 tokens of both models, to the direct path, and from 8 tokens on also to `moe_tc` at
# BLOCK_M 16 (Qwen3.6 at 8 tokens: 81.7 us against 62.1 direct and 68.7 `moe_tc`); it had won at
# 0.25-0.28 entries an expert against the `moe_tc` of 21b74a1 (H200, docs/PERF_KERNELS.md), before
# `moe_tc`'s one-dot loop.
DECODE_MAX_ENTRIES = 288
# Entries up to which paired experts take the direct path (`moe_direct`: the tensor cores, one tile an
# entry) before `moe_tc`: 8 tokens of 9 slots. H100, session 28 (one layer, `tune_kernels --kinds
# moe_paths`, docs/PERF.md): at 1, 2, 4 and 8 tokens the direct path was the fastest of all, 15%, 13%, 27%
# and 20% under the decode path on Qwen3.6 (6-21% under `moe_tc` at BLOCK_M 16 from 2 tokens), 13-30% on
# Qwen3-30B. Session 36 (H100): at 16 tokens a tie on Qwen3.6 (105.8 against 108.3 us) and 7% over on
# Qwen3-30B, at 32 tokens 24% and 53% over `moe_tc` (it reads an expert once an entry, `moe_tc` once a block).
DIRECT_MAX_ENTRIES = 72
# Entries from which the experts are decoded to bf16 once and run as `torch._grouped_mm` (prefill),
# against the fused grouped GEMMs (standard layout); against `moe_tc` (paired layout) entries an expert.
# H200, session 9 (the decode to bf16 at 2.6 TB/s, docs/PERF_KERNELS.md): `moe_tc` at BLOCK_M 128 wins at
# 143 (Qwen3.6, 4,096 tokens: 1,263 against 1,776 us) and 256 (Qwen3-30B: 1,484 against 1,589), ties at
# 287 (Qwen3.6, 8,192), and grouped_mm wins at 512 and 574 (by 23% and 26%).
GROUPED_MM_MIN_ENTRIES = 8192
TC_GROUPED_MM_MIN_PER_EXPERT = 288
# `moe_tc`'s BLOCK_M by entries an expert: 16 up to TC_BLOCK_M_16_MAX_PER_EXPERT, 32 up to
# TC_BLOCK_M_32_MAX_PER_EXPERT, 64 up to TC_BLOCK_M_64_MAX_PER_EXPERT, then 128. H200, session 13 (the one-dot
# loop, docs/PERF_KERNELS.md): 16 beats 32 by 9-13% at 4.5-9 an expert, 32 beats 16 by 7-8% at 16-18; 32
# beats 64 by 18% at 17.9 and loses by 3-4% at 32-36; 64 beats 128 by 5% at 72, 128 beats 64 by 2-5% from 128.
TC_BLOCK_M_16_MAX_PER_EXPERT = 12
TC_BLOCK_M_32_MAX_PER_EXPERT = 24
TC_BLOCK_M_64_MAX_PER_EXPERT = 96
# `moe_tc`'s tiles (BLOCK_N, warps, stages, STEPS) by BLOCK_M, for gate_up and for down. H200, session 13
# (`tune_kernels --kinds moe_tc`, both models, 32-4,096 tokens): STEPS 4 at BLOCK_M 16 and 32; BLOCK_M 64
# takes the 128-row down tile (2-6% on the layer); 128 rows on 8 warps for BLOCK_M 128's gate_up.
TC_TILES = {
    16: ((64, 4, 3, 4), (64, 4, 3, 4)),
    32: ((64, 4, 3, 4), (64, 4, 4, 2)),
    64: ((64, 4, 3, 2), (128, 8, 3, 4)),
    128: ((128, 8, 3, 4), (64, 4, 3, 2)),
}


def tc_config(block_m: int) -> MoETCConfig:
    """`moe_tc` at BLOCK_M with its gate_up and down tiles from TC_TILES."""
    return MoETCConfig(block_m, *TC_TILES[block_m])


MoEPath = MoEConfig | MoEDecodeConfig | MoEDirectConfig | MoEGroupedMMConfig | MoETCConfig


def _moe_configs(numel: int, experts: int, *, nvfp4: bool = True, paired: bool = False) -> MoEPath:
    """By entries and average entries per expert, from `tune_kernels` on the H200 at both models' shapes
    (docs/PERF_KERNELS.md). Paired NVFP4 experts (the engine's): the direct path up to DIRECT_MAX_ENTRIES
    entries, `moe_tc` up to TC_GROUPED_MM_MIN_PER_EXPERT entries an expert, then grouped_mm. Standard
    layout: the decode path, the fused grouped GEMMs, grouped_mm. The interpreter (CPU tests) keeps to wide
    tiles and never picks grouped_mm unless a test asks for it."""
    avg = numel / experts
    if paired:
        if numel <= DIRECT_MAX_ENTRIES:
            return direct_config()
        if interpreting():  # few, wide programs (as below)
            return MoETCConfig(32, (64, 4, 1, 2), (64, 4, 1, 2))
        if avg >= TC_GROUPED_MM_MIN_PER_EXPERT:
            return MoEGroupedMMConfig()
        if avg <= TC_BLOCK_M_16_MAX_PER_EXPERT:
            return tc_config(16)
        if avg <= TC_BLOCK_M_32_MAX_PER_EXPERT:
            return tc_config(32)
        return tc_config(64 if avg <= TC_BLOCK_M_64_MAX_PER_EXPERT else 128)
    if nvfp4 and numel <= DECODE_MAX_ENTRIES:
        return _decode_config(numel)
    if numel >= GROUPED_MM_MIN_ENTRIES and not interpreting():
        return MoEGroupedMMConfig()
    if interpreting():  # few, wide programs: the interpreter's cost is per program and op, not per element
        return MoEConfig(16, (64, 64, 4, 1), (64, 64, 4, 1))
    if avg <= 16:
        return MoEConfig(16, (64, 128, 4, 4), (64, 128, 4, 4))
    if avg <= 48:
        return MoEConfig(32, (64, 128, 4, 4), (64, 128, 4, 4))
    return MoEConfig(64, (128, 64, 8, 3), (128, 64, 8, 3))


def _decode_config(numel: int) -> MoEDecodeConfig:
    """H200 sweeps of one Qwen3.6 layer (`_moe_decode` alone, docs/PERF_KERNELS.md). Session 10: one token
    23.8 -> 19.6 us with K in 16-group steps and one program a slot in down; 8 tokens 94.6 -> 75.9 us.
    Session 11 (the PTX decode, `tune_kernels --kinds moe_decode`): one token 18.9 us with 32-row gate_up
    tiles (16 rows: 19.5); 8 tokens 81.4 us with 64-row 4-warp gate_up tiles (32 rows: 89.3).
    Session 26 (H100, two calls): one token 22.2-22.7 -> 20.6-20.7 us with 8 K splits of 8 groups (ncu:
    the 4-split gate_up ran 8 warps an SM at 21% of DRAM bandwidth); 2 tokens keep 4 (31.1 against 31.7).
    Session 27 (H100, a K step's loads all issued before its dots): one token 20.8 -> 19.5 us on this entry,
    the best tile 19.2 (within noise of it); 2 tokens 31.1 -> 29.0; 8 tokens unchanged (80.2)."""
    if interpreting():
        return MoEDecodeConfig((16, 2, 4, 1), (16, 2, 4, 1))
    if numel <= 9:  # one token: 8 K splits of 8-group steps, 1,152 gate_up programs (H100, session 26)
        return MoEDecodeConfig((32, 8, 2, 8), (32, 32, 2, 9))
    if numel <= 18:  # up to 2 tokens of 9 slots
        return MoEDecodeConfig((32, 16, 2, 4), (32, 32, 2, 9))
    if numel <= 72:  # up to 8 tokens
        return MoEDecodeConfig((64, 16, 4, 4), (64, 16, 2, 3))
    return MoEDecodeConfig((16, 32, 2, 4), (64, 32, 4, 3))


@triton.jit
def route_row(
    logits_ptr, ids_ptr, weights_ptr,  #
    E,  #
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr,  #
    CACHE: tl.constexpr,  #
):
    """One token's routing from its logits row `[E (+1)]` to ids and weights rows `[TOP_K (+1)]`: softmax in
    fp32 over the E routed logits, top-k, optional renormalisation, the shared expert's gate sigmoid(logit E)
    in slot TOP_K. Shared by `_moe_route_kernel` and `norm_route` (which reads logits other programs of its
    grid wrote, so it loads them with CACHE=".cg", past the SM's L1)."""
    offs = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + offs, mask=offs < E, other=-float("inf"), cache_modifier=CACHE)
    logits = logits.to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    slots = tl.arange(0, TOP_K)
    top_w = tl.zeros((TOP_K,), dtype=tl.float32)
    top_i = tl.zeros((TOP_K,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):  # ties go to the lower expert index, as torch.topk on CUDA
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, E_PAD), axis=0)
        top_w = tl.where(slots == k, best, top_w)
        top_i = tl.where(slots == k, idx, top_i)
        p = tl.where(offs == idx, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(ids_ptr + slots, top_i)
    tl.store(weights_ptr + slots, top_w)
    if SHARED:
        gate = tl.load(logits_ptr + E, cache_modifier=CACHE).to(tl.float32)
        tl.store(ids_ptr + TOP_K, E)
        tl.store(weights_ptr + TOP_K, tl.sigmoid(gate))


@triton.jit
def _moe_route_kernel(
    logits_ptr, ids_ptr, weights_ptr,  #
    E, stride_lt,  #
    TOP_K: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    pdl.enter(PDL)
    t = tl.program_id(0)
    stride = TOP_K + SHARED
    route_row(logits_ptr + t * stride_lt, ids_ptr + t * stride, weights_ptr + t * stride, E,  #
              TOP_K, E_PAD, RENORM, SHARED, "")


def moe_route(
    logits: torch.Tensor, num_experts: int, top_k: int, renormalize: bool, shared: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[T, E (+1)]` -> (ids int32 `[T, A']`, weights fp32 `[T, A']`), A' = top_k (+1 shared).

    Softmax in fp32 over the E routed logits; with `shared`, column E is the shared expert's gate logit.
    """
    t = logits.shape[0]
    if logits.ndim != 2 or logits.shape[1] != num_experts + int(shared) or logits.stride(1) != 1:
        raise ValueError(f"logits: expected [T, {num_experts + int(shared)}] with unit column stride, "
                         f"got {list(logits.shape)} strides {logits.stride()}")
    if top_k & (top_k - 1) or not 0 < top_k <= num_experts:
        raise ValueError(f"top_k: expected a power of two in 1..{num_experts}, got {top_k}")
    a = top_k + int(shared)
    ids = torch.empty((t, a), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, a), dtype=torch.float32, device=logits.device)
    if t:
        # one warp a token: its reductions stay in shuffles (H200, session 11, 257 logits: 3.05 us a launch
        # at one token against 3.69 with 4 warps, 3.38 / 4.00 at 32, 3.49 / 4.55 at 512)
        _moe_route_kernel[(t,)](logits, ids, weights, num_experts, logits.stride(0), TOP_K=top_k,
                                E_PAD=triton.next_power_of_2(num_experts), RENORM=renormalize, SHARED=shared,
                                num_warps=1, **pdl.launch(ids.device))
    return ids, weights


@triton.jit
def _load_w_tile(w_ptr, s_ptr, rows, offs_kb, offs_ks, offs_k, mask_k, mask_kb, mask_ks,  #
                 stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NVFP4: tl.constexpr):
    """bf16 weight tile [BLOCK_N, BLOCK_K] of rows `rows`; NVFP4 tiles carry a 2^-22 factor."""
    if NVFP4:
        b = tl.load(w_ptr + rows[:, None] * stride_wn + offs_kb[None, :], mask=mask_kb, other=0)
        s = tl.load(s_ptr + rows[:, None] * stride_sn + offs_ks[None, :], mask=mask_ks, other=0)
        w = _decode_nvfp4_tile(b, s, BLOCK_N, BLOCK_K)
    else:
        w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=mask_k, other=0.0)
    return w


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    if INTERPRET:  # the Triton 3.9 interpreter multiplies bf16 dot operands as raw bits
        acc = tl.dot(a.to(tl.float32), tl.trans(b).to(tl.float32), acc)
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, route_w_ptr,  #
    sorted_ptr, block_expert_ptr, num_padded_ptr,  #
    NUMEL, N, K, A_DIV,  #
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  #
    GATE_UP: tl.constexpr, NVFP4: tl.constexpr, INTERPRET: tl.constexpr,  #
):
    """GATE_UP: out[entry, n] = silu(a[tok] . gate[n]) * (a[tok] . up[n]), tok = entry // A_DIV.
    Else (down): out[entry, n] = route_w[entry] * (a[entry] . w[n])."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    entry = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = entry < NUMEL
    a_rows = entry // A_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        offs_kb = k // 2 + tl.arange(0, BLOCK_K // 2)
        offs_ks = k // 16 + tl.arange(0, BLOCK_K // 16)
        mask_k = mask_n[:, None] & (offs_k[None, :] < K)
        mask_kb = mask_n[:, None] & (offs_kb[None, :] * 2 < K)
        mask_ks = mask_n[:, None] & (offs_ks[None, :] * 16 < K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        w = _load_w_tile(w_base, s_base, offs_n, offs_kb, offs_ks, offs_k, mask_k, mask_kb, mask_ks,
                         stride_wn, stride_sn, BLOCK_N, BLOCK_K, NVFP4)
        acc = _dot(a, w, acc, INTERPRET)
        if GATE_UP:
            w_up = _load_w_tile(w_base, s_base, offs_n + N, offs_kb, offs_ks, offs_k, mask_k, mask_kb,
                                mask_ks, stride_wn, stride_sn, BLOCK_N, BLOCK_K, NVFP4)
            acc_up = _dot(a, w_up, acc_up, INTERPRET)
    if GATE_UP:
        if NVFP4:
            acc = acc * (tl.load(ts_ptr + e * 2) * 4194304.0)
            acc_up = acc_up * (tl.load(ts_ptr + e * 2 + 1) * 4194304.0)
        acc = acc * tl.sigmoid(acc) * acc_up
    else:
        if NVFP4:
            acc = acc * (tl.load(ts_ptr + e) * 4194304.0)
        acc = acc * tl.load(route_w_ptr + entry, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + entry.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, bf16_rne(acc, INTERPRET), mask=valid[:, None] & mask_n[None, :])


def _launch_moe_gemm(a, w: MoEWeights, gate_up: bool, out, route_w, sorted_ids, block_expert, num_padded,
                     numel: int, a_div: int, cfg: MoEConfig) -> None:
    wt, st = (w.w13, w.w13_scale) if gate_up else (w.w2, w.w2_scale)
    ts = w.w13_tensor_scale if gate_up else w.w2_tensor_scale
    n = w.intermediate if gate_up else w.hidden
    k = a.shape[1]
    block_n, block_k, warps, stages = cfg.gate_up if gate_up else cfg.down
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, wt, st if st is not None else wt, ts if ts is not None else route_w, out, route_w,  #
        sorted_ids, block_expert, num_padded,  #
        numel, n, k, a_div,  #
        a.stride(0), wt.stride(0), wt.stride(1), st.stride(0) if st is not None else 0,  #
        st.stride(1) if st is not None else 0, out.stride(0),  #
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k,  #
        GATE_UP=gate_up, NVFP4=w.nvfp4, INTERPRET=interpreting(),  #
        num_warps=warps, num_stages=stages,  #
    )


@triton.jit
def _x_at(x_row, groups, P: tl.constexpr, G, mask_g, X_PMAJOR: tl.constexpr, PAIRED: tl.constexpr):
    """The x of code P of the int64 `groups` of a row (fp32): x[16 g + P]; in the paired layout (`moe_tc`:
    int64 g = 2 q + r' holds words t = 2 r' and 2 r' + 1 of block q, P = 8 (t % 2) + slot) x[32 q +
    slot_k(t, slot)]. X_PMAJOR rows are stored as [16, G] in that order (the gate_up kernel's store)."""
    if X_PMAJOR:
        offs = P * G + groups
    elif PAIRED:
        offs = (groups // 2) * 32 + (groups % 2) * 4 + slot_k(P // 8, P % 8)
    else:
        offs = groups * 16 + P
    return tl.load(x_row + offs, mask=mask_g, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _group_dot(w, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
               PAIRED: tl.constexpr, INTERPRET: tl.constexpr):
    """Per (row, int64 of 16 codes) of `w` [BN, BG] (codes 0-7 in the low word): two sums of code * x,
    ([BN, BG], [BN, BG]) fp32 (times 2^-14): over its even and its odd codes, or in the paired layout over
    the codes of scale groups A and B."""
    if PAIRED:
        a0, b0 = paired_dot8(w.to(tl.uint32), x0, x1, x2, x3, x4, x5, x6, x7, INTERPRET)
        a1, b1 = paired_dot8((w >> 32).to(tl.uint32), x8, x9, x10, x11, x12, x13, x14, x15, INTERPRET)
        return a0 + a1, b0 + b1
    return group_dot16(w, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, INTERPRET)


@triton.jit
def _block_scales(s_ptrs, groups, mask, PAIRED: tl.constexpr):
    """The block scales of `_apply_scales` as raw e4m3 bytes: one per int64 (its group), or in the
    paired layout the pair's two (A, B)."""
    if PAIRED:
        first = s_ptrs - (groups % 2)[None, :]
        return tl.load(first, mask=mask, other=0), tl.load(first + 1, mask=mask, other=0)
    s = tl.load(s_ptrs, mask=mask, other=0)
    return s, s


@triton.jit
def _apply_scales(even, odd, sa, sb, PAIRED: tl.constexpr):
    """The two sums of `_group_dot` times their block scales (times 2^-22)."""
    if PAIRED:
        return even * e4m3_to_f32(sa) + odd * e4m3_to_f32(sb)
    return (even + odd) * e4m3_to_f32(sa)


@triton.jit
def _gemv_step(x_row, w_base, s_base, rows, mask_n, g0, G, stride_wn, stride_sk, stride_sn,  #
               BLOCK_G: tl.constexpr, X_PMAJOR: tl.constexpr, TWO: tl.constexpr, ROW2, PAIRED: tl.constexpr,
               INTERPRET: tl.constexpr):
    """One K step of `_group_dot` times the block scales for rows `rows` (and, with TWO, rows + ROW2
    of the same weight, sharing the x loads): returns ([BN, BG], [BN, BG]) fp32 times 2^-22.

    Every load of the step is issued before the first dot, codes first: in source order after the dots,
    the scale loads went out only after the decode (sm_90 SASS), a second wait on DRAM each step.
    `w` [BN, BG]: 16 codes each as one int64, one 2-D load contiguous along the groups, which Triton lays
    out with the groups across the threads."""
    groups = g0 + tl.arange(0, BLOCK_G)
    mask_g = groups < G
    mask = mask_n[:, None] & mask_g[None, :]
    offs_w = rows[:, None] * stride_wn + groups[None, :]
    w = tl.load(w_base + offs_w, mask=mask, other=0)
    w2 = w
    if TWO:
        w2 = tl.load(w_base + ROW2 * stride_wn + offs_w, mask=mask, other=0)
    if PAIRED:  # `moe_tc.pair_scales`: a row's 64-code blocks stride_sk apart, rows 4 bytes apart
        offs_s = scale_offset(rows[:, None], groups[None, :], stride_sk)
    else:
        offs_s = rows[:, None] * stride_sn + groups[None, :]
    sa, sb = _block_scales(s_base + offs_s, groups, mask, PAIRED)
    sa2, sb2 = sa, sb
    if TWO:
        sa2, sb2 = _block_scales(s_base + ROW2 * stride_sn + offs_s, groups, mask, PAIRED)  # stride_sn: 4
    x0 = _x_at(x_row, groups, 0, G, mask_g, X_PMAJOR, PAIRED)
    x1 = _x_at(x_row, groups, 1, G, mask_g, X_PMAJOR, PAIRED)
    x2 = _x_at(x_row, groups, 2, G, mask_g, X_PMAJOR, PAIRED)
    x3 = _x_at(x_row, groups, 3, G, mask_g, X_PMAJOR, PAIRED)
    x4 = _x_at(x_row, groups, 4, G, mask_g, X_PMAJOR, PAIRED)
    x5 = _x_at(x_row, groups, 5, G, mask_g, X_PMAJOR, PAIRED)
    x6 = _x_at(x_row, groups, 6, G, mask_g, X_PMAJOR, PAIRED)
    x7 = _x_at(x_row, groups, 7, G, mask_g, X_PMAJOR, PAIRED)
    x8 = _x_at(x_row, groups, 8, G, mask_g, X_PMAJOR, PAIRED)
    x9 = _x_at(x_row, groups, 9, G, mask_g, X_PMAJOR, PAIRED)
    x10 = _x_at(x_row, groups, 10, G, mask_g, X_PMAJOR, PAIRED)
    x11 = _x_at(x_row, groups, 11, G, mask_g, X_PMAJOR, PAIRED)
    x12 = _x_at(x_row, groups, 12, G, mask_g, X_PMAJOR, PAIRED)
    x13 = _x_at(x_row, groups, 13, G, mask_g, X_PMAJOR, PAIRED)
    x14 = _x_at(x_row, groups, 14, G, mask_g, X_PMAJOR, PAIRED)
    x15 = _x_at(x_row, groups, 15, G, mask_g, X_PMAJOR, PAIRED)
    even, odd = _group_dot(w, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,  #
                           PAIRED, INTERPRET)
    p = _apply_scales(even, odd, sa, sb, PAIRED)
    q = p
    if TWO:
        even, odd = _group_dot(w2, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,  #
                               PAIRED, INTERPRET)
        q = _apply_scales(even, odd, sa2, sb2, PAIRED)
    return p, q


@triton.jit
def _moe_decode_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ids_ptr, ws_ptr, lock_ptr,  #
    NUMEL, N, G, A_DIV,  #
    stride_xm, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT: tl.constexpr, PAIRED: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """out[entry] = silu(x[tok] . gate[n]) * (x[tok] . up[n]) for one entry, BLOCK_N columns n and one
    of SPLIT ranges of K, with tok = entry // A_DIV; stored K-group-major ([16, N / 16]: column n at
    (n % 16) * N/16 + n // 16, or the paired layout's order (`_x_at`)), the order in which the down
    kernel reads its x."""
    pdl.enter(PDL)
    entry = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    e = tl.load(ids_ptr + entry).to(tl.int64)
    x_row = x_ptr + (entry // A_DIV).to(tl.int64) * stride_xm
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    gate_scale = tl.load(ts_ptr + e * 2) * 4194304.0  # the tensor scales, with the first step's loads
    up_scale = tl.load(ts_ptr + e * 2 + 1) * 4194304.0
    per_split = tl.cdiv(tl.cdiv(G, SPLIT), BLOCK_G) * BLOCK_G  # whole K steps, so splits never overlap
    acc_g = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    for g0 in range(pid_s * per_split, tl.minimum(G, (pid_s + 1) * per_split), BLOCK_G):
        p, q = _gemv_step(x_row, w_base, s_base, rows, mask_n, g0, G, stride_wn, stride_sk, stride_sn,  #
                          BLOCK_G, False, True, N, PAIRED, INTERPRET)
        acc_g += p
        acc_u += q
    gate_up = tl.join(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1))  # [BN, 2]
    lock = lock_ptr + entry * tl.num_programs(1) + pid_n
    act, last = silu_mul_splits(gate_up, ws_ptr, lock, entry, pid_s, NUMEL, N, rows, mask_n, gate_scale,  #
                                up_scale, SPLIT, INTERPRET)
    if last:
        if PAIRED:  # column n = 32 q + 16 grp + 8 h + 2 t + c is slot j = 4 grp + 2 h + c of word t of
            # block q: code P = 8 (t % 2) + j of int64 g = 2 q + t // 2 (`_x_at`)
            k = rows % 16
            t = (k % 8) // 2
            j = 4 * ((rows % 32) // 16) + 2 * (k // 8) + k % 2
            cols = (8 * (t % 2) + j) * (N // 16) + 2 * (rows // 32) + t // 2
        else:
            cols = (rows % 16) * (N // 16) + rows // 16
        tl.store(out_ptr + entry.to(tl.int64) * stride_om + cols, act, mask=mask_n)


@triton.jit
def _moe_decode_down_kernel(
    x_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ids_ptr, route_w_ptr, ws_ptr, lock_ptr,  #
    res_ptr, norm_w_ptr, h_ptr, res_out_ptr,  #
    T, N, G, A, eps,  #
    stride_xm, stride_we, stride_wn, stride_sk, stride_se, stride_sn, stride_om,  #
    stride_res, stride_h, stride_res_out,  #
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT: tl.constexpr, PAIRED: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
    NORM: tl.constexpr, ONE_PLUS: tl.constexpr, BLOCK_D: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """out[t, n] = sum over the token's A slots of route_w * (x[entry] . down_e[n]) (this program: one of
    SPLIT ranges of slots), x rows K-group-major; the top-k combine and the routing weights are fused
    here, summed in fp32 and rounded once.

    NORM: then the residual add + RMSNorm of the token's row into h and res_out by the program that
    completes its last tile (`small_ops.store_token_tile`: each program that completes a tile counts
    it on the token's counter, lock_ptr[T * tiles + t], past the split counters [T * tiles])."""
    pdl.enter(PDL)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    steps = tl.cdiv(G, BLOCK_G)
    per_split = tl.cdiv(A, SPLIT)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # one flat loop over (slot, K step) of this split's slots
    for i in range(pid_s * per_split * steps, tl.minimum(A, (pid_s + 1) * per_split) * steps):
        entry = t * A + i // steps
        e = tl.load(ids_ptr + entry).to(tl.int64)
        x_row = x_ptr + entry.to(tl.int64) * stride_xm
        scale = tl.load(ts_ptr + e) * tl.load(route_w_ptr + entry) * 4194304.0  # issued with the step's loads
        p, _ = _gemv_step(x_row, w_ptr + e * stride_we, s_ptr + e * stride_se, rows, mask_n,  #
                          (i % steps) * BLOCK_G, G, stride_wn, stride_sk, stride_sn, BLOCK_G, True, False,  #
                          0, PAIRED, INTERPRET)
        out += tl.sum(p, axis=1) * scale
    store_token_tile(out, ws_ptr, lock_ptr, out_ptr, t, pid_n, pid_s, T, N, rows, mask_n, stride_om,  #
                     res_ptr, norm_w_ptr, h_ptr, res_out_ptr, stride_res, stride_h, stride_res_out, eps,  #
                     SPLIT, NORM, ONE_PLUS, BLOCK_D, INTERPRET)


def _scale_strides(scale: torch.Tensor, paired: bool) -> tuple[int, int, int]:
    """(stride_sk, stride_se, stride_sn) of block scales: paired `[K/64, E', N, 4]` (`moe_tc.pair_scales`),
    or standard `[E', N, K/16]` (no stride_sk)."""
    if paired:
        return scale.stride(0), scale.stride(1), scale.stride(2)
    return 0, scale.stride(0), scale.stride(1)


def _moe_decode(h: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w: MoEWeights, cfg: MoEDecodeConfig,
                norm: FusedNorm | None = None) -> torch.Tensor:
    """The NVFP4 decode path: no alignment; GEMVs on CUDA cores over whole 16-code groups; combine fused.
    With `norm`, the down kernel also writes its residual add + RMSNorm."""
    t, a = ids.shape
    inter_n, d = w.intermediate, w.hidden
    if inter_n % 16 or d % 16:
        raise ValueError(f"decode path: hidden {d} and intermediate {inter_n} must be multiples of 16")
    ids = ids.contiguous()
    dev = h.device
    inter = torch.empty((t * a, inter_n), dtype=torch.bfloat16, device=dev)  # K-group-major rows
    out = torch.empty((t, d), dtype=torch.bfloat16, device=dev)
    w13, w2 = w.w13.view(torch.int64), w.w2.view(torch.int64)  # one 16-code group per element
    block_n, block_g, warps, split = cfg.gate_up
    split = min(split, triton.cdiv(d // 16, block_g))  # no split without a K step of its own
    tiles = triton.cdiv(inter_n, block_n)
    ws = torch.empty((split, t * a, 2, inter_n), dtype=torch.float32, device=dev) if split > 1 else out
    locks = split_k_locks(dev, t * a * tiles) if split > 1 else out
    _moe_decode_gate_up_kernel[(t * a, tiles, split)](
        h, w13, w.w13_scale, w.w13_tensor_scale, inter, ids, ws, locks,  #
        t * a, inter_n, d // 16, a,  #
        h.stride(0), w13.stride(0), w13.stride(1), *_scale_strides(w.w13_scale, w.paired),  #
        inter.stride(0),  #
        BLOCK_N=block_n, BLOCK_G=block_g, SPLIT=split, PAIRED=w.paired, INTERPRET=interpreting(),  #
        num_warps=warps, num_stages=1, **pdl.launch(inter.device),  #
    )
    block_n, block_g, warps, split = cfg.down
    split = min(split, a)  # no split without a slot of its own
    tiles = triton.cdiv(d, block_n)
    ws = torch.empty((split, t, d), dtype=torch.float32, device=dev) if split > 1 else out
    # split counters [t * tiles], then (norm) the tokens' counters [t]
    locks = split_k_locks(dev, t * tiles + t) if split > 1 or norm else out
    (res, norm_w, normed, res_out), eps, norm_args = fused_norm_args(norm, out)
    if norm:  # the row's sum over as many warps as `add_rmsnorm`'s: the same layout, the same order
        warps = _row_configs(d)["num_warps"]
    _moe_decode_down_kernel[(t, tiles, split)](
        inter, w2, w.w2_scale, w.w2_tensor_scale, out, ids, rw, ws, locks,  #
        res, norm_w, normed, res_out,  #
        t, d, inter_n // 16, a, eps,  #
        inter.stride(0), w2.stride(0), w2.stride(1), *_scale_strides(w.w2_scale, w.paired),  #
        out.stride(0), res.stride(0), normed.stride(0), res_out.stride(0),  #
        BLOCK_N=block_n, BLOCK_G=block_g, SPLIT=split, PAIRED=w.paired, INTERPRET=interpreting(),  #
        num_warps=warps, num_stages=1, **norm_args, **pdl.launch(out.device),  #
    )
    return out


def _moe_path(h: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w: MoEWeights,
              config: MoEPath | None) -> MoEPath | None:
    """The checked inputs' path (`moe_experts`); None without entries."""
    t, d = h.shape
    if h.dtype != torch.bfloat16 or d != w.hidden or h.stride(1) != 1:
        raise ValueError(f"h: expected bfloat16 [T, {w.hidden}] with unit column stride, got {h.dtype} "
                         f"{list(h.shape)}")
    if ids.shape != route_w.shape or ids.shape[0] != t or ids.dtype != torch.int32:
        raise ValueError(f"ids {ids.dtype} {list(ids.shape)} and route_w {list(route_w.shape)}: expected "
                         f"int32 ids, both [T={t}, A]")
    numel = ids.numel()
    if numel == 0:
        return None
    cfg = config or _moe_configs(numel, w.w13.shape[0], nvfp4=w.nvfp4, paired=w.paired)
    if isinstance(cfg, MoETCConfig | MoEDirectConfig) and not w.paired:
        raise ValueError(f"{type(cfg).__name__}: expected experts in the paired layout "
                         "(moe_tc.pair_moe_weights)")
    if isinstance(cfg, MoEConfig) and w.paired:
        raise ValueError("MoEConfig: the fused grouped GEMMs read the standard layout, not the paired one")
    if isinstance(cfg, MoEDecodeConfig) and not w.nvfp4:
        raise ValueError("MoEDecodeConfig: the decode path needs NVFP4 experts, got bf16")
    return cfg


def moe_experts(
    h: torch.Tensor,
    ids: torch.Tensor,
    route_w: torch.Tensor,
    w: MoEWeights,
    config: MoEPath | None = None,
) -> torch.Tensor:
    """`h [T, D]` bf16 through the experts `ids [T, A']` (int32) weighted by `route_w [T, A']` -> `[T, D]`
    bf16.

    The path follows `_moe_configs` (paired NVFP4 experts, as the engine loads them: direct path, decode
    path, `moe_tc`, grouped_mm; standard layout: decode path, fused grouped GEMMs, grouped_mm); `config`
    overrides it (tuner, tests): a `MoEDecodeConfig` forces the decode path, `MoEDirectConfig` the
    direct path (`moe_direct`, paired layout only), `MoEGroupedMMConfig` the grouped-GEMM path,
    `MoETCConfig` the tensor-core kernels of `moe_tc` (paired layout only), `MoEConfig` the fused grouped
    GEMMs (standard layout only)."""
    cfg = _moe_path(h, ids, route_w, w, config)
    if cfg is None:
        return torch.zeros_like(h)
    rw = route_w.contiguous().view(-1).float()
    if isinstance(cfg, MoETCConfig):
        return moe_experts_tc(h, ids, rw, w, cfg)
    if isinstance(cfg, MoEDecodeConfig):
        return _moe_decode(h, ids, rw, w, cfg)
    if isinstance(cfg, MoEDirectConfig):
        return moe_experts_direct(h, ids, rw, w, cfg)
    if isinstance(cfg, MoEGroupedMMConfig):
        return moe_experts_grouped_mm(h, ids, rw, w)
    numel, a_slots = ids.numel(), ids.shape[1]
    sorted_ids, block_expert, num_padded = moe_align(ids, w.w13.shape[0], cfg.block_m)
    inter = torch.empty((numel, w.intermediate), dtype=torch.bfloat16, device=h.device)  # [T*A', I]
    y = torch.empty((numel, w.hidden), dtype=torch.bfloat16, device=h.device)  # [T*A', D]
    _launch_moe_gemm(h, w, True, inter, rw, sorted_ids, block_expert, num_padded, numel, a_slots, cfg)
    _launch_moe_gemm(inter, w, False, y, rw, sorted_ids, block_expert, num_padded, numel, 1, cfg)
    return sum_slots(y, a_slots)


def moe_experts_add_rmsnorm(
    h: torch.Tensor,
    ids: torch.Tensor,
    route_w: torch.Tensor,
    w: MoEWeights,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    one_plus: bool,
    config: MoEPath | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rmsnorm(moe_experts(h, ids, route_w, w, config), residual, norm_weight, eps, one_plus)`: the
    MoE block, then the residual add + RMSNorm that follows it (the next layer's input norm, or the final
    norm) -> (normed h bf16 `[T, D]`, new residual fp32 `[T, D]`).

    On the decode path (`MoEDecodeConfig`) and the direct path (`MoEDirectConfig`) the down kernel's program
    that completes a token's last row tile does the add + RMSNorm on the row, read back from L2: one launch
    fewer. The decode path's down kernel then runs on `add_rmsnorm`'s warps (4 at D <= 2048, whatever the
    config says): the norm's row sum is laid out, so ordered, as there, but where the config has 2 warps
    (up to 8 tokens) the down GEMV's own sums change order, so the MoE output can differ from the two calls
    by a bf16 rounding (on the H100, session 25: not bit-equal at 2 and 8 tokens; bit for bit under the
    interpreter). The direct path keeps its config's warps (a 64-row tile needs one warpgroup): 4, as
    `add_rmsnorm`'s at D <= 2048. Other paths make the two calls.
    `residual` (fp32 `[T, D]`, the engine's stream) is only read: the new residual is a new tensor, as from
    `add_rmsnorm`."""
    t, d = h.shape
    if residual.dtype != torch.float32 or residual.shape != (t, d) or residual.stride(1) != 1:
        raise ValueError(f"residual: expected float32 [{t}, {d}] with unit column stride, got "
                         f"{residual.dtype} {list(residual.shape)} strides {residual.stride()}")
    if norm_weight.shape != (d,) or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight: expected a contiguous ({d},), got {tuple(norm_weight.shape)} strides "
                         f"{norm_weight.stride()}")
    cfg = _moe_path(h, ids, route_w, w, config)
    if not isinstance(cfg, MoEDecodeConfig | MoEDirectConfig):
        return add_rmsnorm(moe_experts(h, ids, route_w, w, cfg), residual, norm_weight, eps, one_plus)
    normed = torch.empty_like(h)
    residual_out = torch.empty_like(residual)
    norm = FusedNorm(residual, norm_weight, eps, one_plus, normed, residual_out)
    rw = route_w.contiguous().view(-1).float()
    if isinstance(cfg, MoEDirectConfig):
        moe_experts_direct(h, ids, rw, w, cfg, norm)
    else:
        _moe_decode(h, ids, rw, w, cfg, norm)
    return normed, residual_out


def fused_moe(h: torch.Tensor, w: MoEWeights, top_k: int, renormalize: bool) -> torch.Tensor:
    """The whole sparse MoE block (routed experts, plus the gated shared expert if stacked) on `h [T, D]`."""
    ids, route_w = moe_route(router_logits(h, w), w.num_experts, top_k, renormalize, w.has_shared)
    return moe_experts(h, ids, route_w, w)


def router_logits(h: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """`h @ router^T` `[T, E']` bf16, as the HF router computes it. With E' not a multiple of 8 (Qwen3.6's
    257: 256 experts and the shared expert's gate) cuBLAS takes an unaligned sm_75 kernel for more than one
    row (11.8 ms of a 16 x 1,024-token prefill pass, 6.5 us a layer at batch 32 on the H200), so more rows
    run the GEMM on the zero-padded `router_rows`, whose first E' columns are the logits (5.4 us at batch
    32, session 10). One row keeps cuBLAS's GEMV on the unpadded rows (3.0 us; the padded GEMM took 5.2)."""
    if h.shape[0] == 1:
        return h @ w.router.t()
    return (h @ w.router_rows.t())[:, : w.router.shape[0]]


def _expert_weights_f32(w: MoEWeights, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    if w.paired:
        raise ValueError("the references read the standard NVFP4 layout; pass the experts before pairing")
    if not w.nvfp4:
        return w.w13[e].float(), w.w2[e].float()
    i = w.intermediate
    gate = NVFP4Weight(w.w13[e, :i], w.w13_scale[e, :i].view(torch.float8_e4m3fn), w.w13_tensor_scale[e, 0])
    up = NVFP4Weight(w.w13[e, i:], w.w13_scale[e, i:].view(torch.float8_e4m3fn), w.w13_tensor_scale[e, 1])
    down = NVFP4Weight(w.w2[e], w.w2_scale[e].view(torch.float8_e4m3fn), w.w2_tensor_scale[e])
    return torch.cat([gate.dequantize(), up.dequantize()]), down.dequantize()


def moe_route_ref(logits: torch.Tensor, num_experts: int, top_k: int, renormalize: bool, shared: bool):
    """fp32 reference of `moe_route` (HF: softmax fp32, topk, optional renormalisation)."""
    p = torch.softmax(logits[:, :num_experts].float(), dim=-1)
    top_w, top_i = torch.topk(p, top_k, dim=-1)
    if renormalize:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    if shared:
        top_i = torch.cat([top_i, torch.full_like(top_i[:, :1], num_experts)], dim=1)
        top_w = torch.cat([top_w, torch.sigmoid(logits[:, num_experts:].float())], dim=1)
    return top_i.int(), top_w


def moe_experts_ref(h: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """fp32 loop over experts: each reads its dequantized weights and the rows routed to it.

    Rounds to bf16 where the kernels store bf16 (SiLU*up activations, each slot's weighted output), as
    the HF model does, so the comparison isolates accumulation order.
    """
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    x = h.float()
    i = w.intermediate
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        w13, w2 = _expert_weights_f32(w, e)
        gu = x[rows] @ w13.t()  # [R, 2I]
        act = (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]).bfloat16().float()
        y = ((act @ w2.t()) * route_w[rows, slots].float()[:, None]).bfloat16().float()
        out.index_add_(0, rows, y)
    return out


def fused_moe_ref(h: torch.Tensor, w: MoEWeights, top_k: int, renormalize: bool) -> torch.Tensor:
    """fp32 reference of `fused_moe` (router logits from the same bf16 matmul)."""
    ids, route_w = moe_route_ref(h @ w.router.t(), w.num_experts, top_k, renormalize, w.has_shared)
    return moe_experts_ref(h, ids, route_w, w)
