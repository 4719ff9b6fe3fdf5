"""NVFP4 W4A16 linear: `out[M, N] = x[M, K] @ W[N, K]^T` with W in NVFP4, x and out in bf16.

Layout: the checkpoint layout as is (no repack): codes uint8 `[N, K // 2]` (element 2j in the low
nibble), block scales float8_e4m3fn `[N, K // 16]` read as raw bytes, fp32 tensor scale read on the
device (no host sync, so the launcher is CUDA-graph safe).
Numerics: Hopper has no FP4 tensor cores, so each `[BLOCK_N, BLOCK_K]` weight tile is decoded in
registers by bit construction (E2M1 nibble -> fp16 bits, times 2^14 is the exact value; E4M3 byte ->
fp16 bits, times 2^8), multiplied by its block scale in fp32, rounded to bf16 (exact: E2M1 x E4M3 has
at most 6 significant bits) and fed to bf16 `tl.dot` with fp32 accumulation. The 2^22 and the tensor
scale are applied once to the accumulator. Against `nvfp4_gemm_ref` (fp32 on the dequantized weight
and the same bf16 x) the only errors are fp32 accumulation order and the bf16 rounding of the output.
Small M is bandwidth-bound, so it splits K across CTAs (SPLIT_K > 1): partials go to an fp32
workspace and the last CTA of each tile (counted with an atomic) sums them and writes bf16, all in one
launch. Above FUSED_MAX_M rows the decode would be repeated per M tile, so W is instead dequantized to
bf16 once (`nvfp4_dequantize`, same decode, fp32 scale product rounded once to bf16) and cuBLAS runs
the GEMM; huge weights (lm_head) go in row slices of at most 128 MiB. One row (single-stream decode)
takes a GEMV on CUDA cores instead (`_nvfp4_gemv_kernel`, the FP8 GEMV's scheme on the checkpoint
layout), since the tensor-core kernel padded to 16 rows moved 0.4-0.7 TB/s at M=1 (session 10).
Assumes sm_90 (or the Triton interpreter); one CUDA stream per device at a time uses the split-K
counters.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from batchinfer.kernels.nvfp4 import NVFP4Weight

# Rows above which dequantize + cuBLAS beats the fused kernel (H200, bench/tune_kernels.py).
FUSED_MAX_M = 16
DEQUANT_CHUNK_ELEMS = 2**26  # bf16 weight slice of at most 128 MiB


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """One launch configuration; SPLIT_K = 0 means "choose from the CTA count"."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    even_odd: bool = False  # multiply even and odd K columns separately instead of interleaving


def interpreting() -> bool:
    """True under the Triton CPU interpreter (tests on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _nvfp4_gemm_configs(m: int, n: int) -> GemmConfig:
    """Offline-tuned table for the fused path (H200, `batchinfer.bench.tune_kernels`, 2026-11-30).

    Larger M is tuned too because the tuner and tests force the fused kernel there."""
    if interpreting():
        return GemmConfig(16, 16, 32, 0, 4, 1)
    if m <= 16:
        return GemmConfig(16, 32, 256, 0, 4, 5) if n < 2048 else GemmConfig(16, 64, 256, 0, 4, 4)
    if m <= 32:
        return GemmConfig(32, 64, 256, 0, 4, 4)
    if m <= 64:
        return GemmConfig(64, 64, 128, 0, 4, 4)
    if m <= 256:
        return GemmConfig(64, 128, 128, 1, 8, 3)
    return GemmConfig(128, 64, 128, 1, 8, 3)


@triton.jit
def bf16_rne(acc, INTERPRET: tl.constexpr):
    """fp32 -> bf16 rounded to nearest even; the interpreter truncates, so round the bits first there."""
    if INTERPRET:
        bits = acc.to(tl.uint32, bitcast=True)
        acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return acc.to(tl.bfloat16)


@triton.jit
def e2m1_to_f32(b, HI: tl.constexpr):
    """Bytes (int32) -> fp32 E2M1 code * 2^-14 of their low or (HI) high nibble: sign and magnitude bits
    placed in an fp16 at its subnormal/normal boundary (exact)."""
    if HI:
        c = ((b & 0x80) << 8) | ((b & 0x70) << 5)
    else:
        c = ((b & 0x8) << 12) | ((b & 0x7) << 9)
    return c.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_to_f32(s):
    """E4M3 bits (uint8) -> fp32 value * 2^-8 (fp16 bit construction, exact)."""
    s = s.to(tl.int32)
    return (((s & 0x80) << 8) | ((s & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_nvfp4_tile(b, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 codes [BN, BK/2] and uint8 e4m3 scales [BN, BK/16] -> bf16 W tile [BN, BK] times 2^-22."""
    b = b.to(tl.int32)
    sf = e4m3_to_f32(s)
    sf = tl.reshape(tl.broadcast_to(sf[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)), (BLOCK_N, BLOCK_K // 2))
    w_lo = (e2m1_to_f32(b, False) * sf).to(tl.bfloat16)  # element 2j
    w_hi = (e2m1_to_f32(b, True) * sf).to(tl.bfloat16)  # element 2j + 1
    return tl.interleave(w_lo, w_hi)


@triton.jit
def _dot_nt(a, b, acc, F32_DOT: tl.constexpr):
    """acc + a @ b^T; F32_DOT because the Triton 3.9 interpreter multiplies bf16 operands as raw bits."""
    if F32_DOT:
        acc = tl.dot(a.to(tl.float32), tl.trans(b).to(tl.float32), acc)
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _nvfp4_dequant_kernel(
    w_ptr, s_ptr, ts_ptr, out_ptr,  #
    N, KB, TS_ROWS,  #
    stride_wn, stride_sn, stride_on,  #
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, INTERPRET: tl.constexpr,  #
):
    """W tile [BLOCK_N, BLOCK_G * 16] -> bf16, stored as uint32 pairs (element 2j in the low half).
    Row r takes tensor scale ts[r // TS_ROWS] (stacked experts: one per gate, up or down matrix)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    byte = groups[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # [1, G, 8]: 8 bytes per scale
    mask = (rows < N)[:, None, None] & (byte < KB)
    b = tl.load(w_ptr + rows[:, None, None] * stride_wn + byte, mask=mask, other=0).to(tl.int32)
    sf = e4m3_to_f32(tl.load(s_ptr + rows[:, None] * stride_sn + groups[None, :],
                             mask=(rows < N)[:, None] & (groups < KB // 8)[None, :], other=0))
    ts = tl.load(ts_ptr + rows // TS_ROWS, mask=rows < N, other=0.0)[:, None]
    sf = (sf * (ts * 4194304.0))[:, :, None]  # block scale * tensor scale * 2^22, [N, G, 1]
    lo_bits = bf16_rne(e2m1_to_f32(b, False) * sf, INTERPRET).to(tl.uint16, bitcast=True).to(tl.uint32)
    hi_bits = bf16_rne(e2m1_to_f32(b, True) * sf, INTERPRET).to(tl.uint16, bitcast=True).to(tl.uint32)
    tl.store(out_ptr + rows[:, None, None] * stride_on + byte, lo_bits | (hi_bits << 16), mask=mask)


@triton.jit
def _nvfp4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ws_ptr, lock_ptr,  #
    M, N, K,  #
    stride_xm, stride_wn, stride_sn, stride_om,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  #
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_ODD: tl.constexpr, F32_DOT: tl.constexpr,  #
):
    tl.static_assert(BLOCK_K % 32 == 0)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_m
    pid_n = (pid % group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)

    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs_kb = k_start // 2 + tl.arange(0, BLOCK_K // 2)
    offs_ks = k_start // 16 + tl.arange(0, BLOCK_K // 16)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_kb[None, :]
    s_ptrs = s_ptr + offs_n[:, None] * stride_sn + offs_ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kk = k - k_start
        b = tl.load(w_ptrs, mask=mask_n[:, None] & (offs_kb[None, :] * 2 + kk < k_end), other=0)
        if EVEN_ODD:  # x[:, 0::2] @ W_lo^T + x[:, 1::2] @ W_hi^T: no interleave, scales gathered per byte
            xe_ptrs = x_ptr + offs_m[:, None] * stride_xm + (offs_kb * 2 + kk)[None, :]
            mask_x = mask_m[:, None] & (offs_kb[None, :] * 2 + kk < k_end)
            xe = tl.load(xe_ptrs, mask=mask_x, other=0.0)
            xo = tl.load(xe_ptrs + 1, mask=mask_x, other=0.0)
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + ((offs_kb + kk // 2) // 8)[None, :],
                        mask=mask_n[:, None] & (offs_kb[None, :] * 2 + kk < k_end), other=0).to(tl.int32)
            sf = (((s & 0x80) << 8) | ((s & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
            b = b.to(tl.int32)
            lo = (((b & 0x8) << 12) | ((b & 0x7) << 9)).to(tl.uint16).to(tl.float16, bitcast=True)
            hi = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.uint16).to(tl.float16, bitcast=True)
            w_lo = (lo.to(tl.float32) * sf.to(tl.float32)).to(tl.bfloat16)
            w_hi = (hi.to(tl.float32) * sf.to(tl.float32)).to(tl.bfloat16)
            acc = _dot_nt(xe, w_lo, acc, F32_DOT)
            acc = _dot_nt(xo, w_hi, acc, F32_DOT)
        else:
            x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] + kk < k_end), other=0.0)
            s = tl.load(s_ptrs, mask=mask_n[:, None] & (offs_ks[None, :] * 16 + kk < k_end), other=0)
            acc = _dot_nt(x, _decode_nvfp4_tile(b, s, BLOCK_N, BLOCK_K), acc, F32_DOT)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 16
    acc = acc * (tl.load(ts_ptr) * 4194304.0)  # tensor scale * 2^22 (2^14 from E2M1, 2^8 from E4M3 bits)

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Serial split-K: publish this split's partial, then the last CTA of the tile reduces.
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptrs + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in range(SPLIT_K):
                total += tl.load(ws_ptrs + i * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + pid, 0)


_LOCKS: dict[torch.device, list[torch.Tensor]] = {}


@triton.jit
def store_gemv_split(part, out_ptr, ws_ptr, lock_ptr, rows, mask_n, N, SPLIT_K: tl.constexpr):
    """The end of a one-row split-K GEMV program (grid: row tiles x SPLIT_K): with one split store `part`
    (fp32 [BLOCK_N] of outputs `rows`), else publish it in `ws` [SPLIT_K, N] and let the tile's last split
    to arrive (its counter in `lock`) sum the partials in split order, store them and reset the counter."""
    if SPLIT_K == 1:
        tl.store(out_ptr + rows, part.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        pid_n = tl.program_id(0)
        tl.store(ws_ptr + tl.program_id(1) * N + rows, part, mask=mask_n)
        tl.debug_barrier()
        done = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros_like(part)
            for i in range(SPLIT_K):
                total += tl.load(ws_ptr + i * N + rows, mask=mask_n, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=mask_n)
            tl.atomic_xchg(lock_ptr + pid_n, 0)


@triton.jit
def _nvfp4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ws_ptr, lock_ptr,  #
    N, K, stride_wn, stride_sn,  #
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT_K: tl.constexpr,  #
):
    """out[n] = ts * sum_k x[k] W[n, k] for one row x, BLOCK_N rows n and one of SPLIT_K ranges of K, in
    16-code groups: a row's 8 code bytes of each group ([BN, BG, 8]) decoded in registers (low nibble:
    element 2j, high: 2j + 1) times x's even and odd elements, summed over the group and times the group's
    scale; per-thread partial sums, one reduction at the end, splits summed as `_fp8_gemv_kernel`'s."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    G = K // 16
    g_per_split = tl.cdiv(tl.cdiv(G, SPLIT_K), BLOCK_G) * BLOCK_G
    g_start = pid_k * g_per_split
    g_end = tl.minimum(G, g_start + g_per_split)
    pair = tl.arange(0, 8)
    acc = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    for g0 in tl.range(g_start, g_end, BLOCK_G, num_stages=3):
        groups = g0 + tl.arange(0, BLOCK_G)
        mask_g = groups < g_end
        x = tl.load(x_ptr + groups[:, None] * 16 + tl.arange(0, 16)[None, :], mask=mask_g[:, None], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_G, 8, 2)))  # [BG, 8] each
        mask = mask_n[:, None] & mask_g[None, :]
        byte = (groups[:, None] * 8 + pair[None, :])[None, :, :]  # [1, BG, 8]
        b = tl.load(w_ptr + rows[:, None, None] * stride_wn + byte, mask=mask[:, :, None], other=0)
        b = b.to(tl.int32)
        dot = e2m1_to_f32(b, False) * x_even[None, :, :] + e2m1_to_f32(b, True) * x_odd[None, :, :]
        scale = e4m3_to_f32(tl.load(s_ptr + rows[:, None] * stride_sn + groups[None, :], mask=mask, other=0))
        acc += tl.sum(dot, axis=2) * scale
    part = tl.sum(acc, axis=1) * (tl.load(ts_ptr) * 4194304.0)  # 2^22: the codes' 2^-14, the scales' 2^-8
    store_gemv_split(part, out_ptr, ws_ptr, lock_ptr, rows, mask_n, N, SPLIT_K)


def split_k_locks(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 split-K tile counters, reused across calls (each reducing CTA resets its own).
    Outgrown buffers are kept, never freed: a CUDA graph captured earlier still points at its buffer (the
    engine captures small decode batches first; freeing their counters corrupted later replays)."""
    bufs = _LOCKS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return bufs[-1]


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_split_k(tiles: int, k: int, block_k: int, num_sms: int) -> int:
    """Enough K splits that the grid covers the SMs about twice, each split keeping >= 2 K blocks."""
    split = 1
    while tiles * split < 2 * num_sms and k // (2 * split * block_k) >= 2:
        split *= 2
    return split


def check_gemm_out(out: torch.Tensor | None, m: int, n: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty((m, n), dtype=torch.bfloat16, device=device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or out.stride(-1) != 1\
        or out.device != device:
        raise ValueError(
            f"out: expected bfloat16 [{m}, {n}] with unit column stride on {device}, got {out.dtype} "
            f"{list(out.shape)} strides {out.stride()} on {out.device}"
        )
    return out


def nvfp4_dequantize(w: NVFP4Weight, row_start: int = 0, row_end: int | None = None) -> torch.Tensor:
    """Rows `[row_start, row_end)` of W as bf16 `[rows, K]` (fp32 scale product, one rounding), one pass."""
    n, k = w.shape
    row_end = n if row_end is None else row_end
    out = torch.empty((row_end - row_start, k), dtype=torch.bfloat16, device=w.device)
    dequantize_rows(w.packed[row_start:row_end], w.block_scale[row_start:row_end], w.tensor_scale, n, out)
    return out


def dequantize_rows(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    tensor_scale: torch.Tensor,
    ts_rows: int,
    out: torch.Tensor,
) -> None:
    """NVFP4 rows `packed [N, K/2]`, `block_scale [N, K/16]` (e4m3 or its uint8 bits) -> bf16 `out [N, K]`,
    row r scaled by `tensor_scale.view(-1)[r // ts_rows]` (one scale per stacked matrix of ts_rows rows)."""
    n, kb = packed.shape
    block_n, block_g = (16, 16) if interpreting() else (32, 32)
    grid = (triton.cdiv(n, block_n), triton.cdiv(kb // 8, block_g))
    _nvfp4_dequant_kernel[grid](
        packed, block_scale.view(torch.uint8), tensor_scale.reshape(-1), out.view(torch.int32),  #
        n, kb, ts_rows,  #
        packed.stride(0), block_scale.stride(0), out.stride(0) // 2,  #
        BLOCK_N=block_n, BLOCK_G=block_g, INTERPRET=interpreting(), num_warps=4,  #
    )


def dequant_matmul(
    x: torch.Tensor, dequant: Callable[[int, int], torch.Tensor], n: int, out: torch.Tensor
) -> None:
    """out = x @ W^T via bf16 row slices of W from `dequant(r0, r1)` and cuBLAS; slices stay <= 128 MiB."""
    rows = max(1, DEQUANT_CHUNK_ELEMS // x.shape[1])
    if rows >= n and out.is_contiguous():
        torch.mm(x, dequant(0, n).t(), out=out)
        return
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        out[:, r0:r1].copy_(x @ dequant(r0, r1).t())


def _nvfp4_gemv(x: torch.Tensor, w: NVFP4Weight, out: torch.Tensor) -> None:
    """`_nvfp4_gemv_kernel` for one row: x `[1, K]`, out `[1, N]` (unit strides), K a multiple of 16."""
    n, k = w.shape
    block_n, block_g = (16, 2) if interpreting() else (16, 16)
    tiles = triton.cdiv(n, block_n)
    split = choose_split_k(tiles, k, 16 * block_g, num_sms(x.device))
    ws = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else out
    locks = split_k_locks(x.device, tiles) if split > 1 else out
    _nvfp4_gemv_kernel[(tiles, split)](
        x, w.packed, w.block_scale.view(torch.uint8), w.tensor_scale, out, ws, locks,  #
        n, k, w.packed.stride(0), w.block_scale.stride(0),  #
        BLOCK_N=block_n, BLOCK_G=block_g, SPLIT_K=split, num_warps=4,  #
    )


def nvfp4_gemm(
    x: torch.Tensor, w: NVFP4Weight, out: torch.Tensor | None = None, config: GemmConfig | None = None
) -> torch.Tensor:
    """`x [..., K]` bf16 times NVFP4 `W [N, K]` transposed -> `[..., N]` bf16 (fp32 accumulation).

    Up to FUSED_MAX_M rows the fused kernel decodes W in registers; above, W is dequantized to bf16
    in one pass and cuBLAS multiplies (the decode then costs little next to the GEMM).
    `out` (bf16 `[M, N]` with unit column stride, M = x rows) receives the result in place, e.g. a
    static buffer under CUDA graphs; `config` forces the fused kernel with that configuration (tuner).
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension K={k} (weight is [N={n}, K={k}]), got {x.shape[-1]}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x: expected bfloat16, got {x.dtype}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but the weight is on {w.device}")
    if not (w.packed.is_contiguous() and w.block_scale.is_contiguous()):
        raise ValueError("weight: packed and block_scale must be contiguous ([N, K//2] and [N, K//16])")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = check_gemm_out(out, m, n, x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    if config is None and m > FUSED_MAX_M:
        dequant_matmul(x2, lambda r0, r1: nvfp4_dequantize(w, r0, r1), n, out)
        return out.reshape(*x.shape[:-1], n)
    if config is None and m == 1:
        _nvfp4_gemv(x2, w, out)
        return out.reshape(*x.shape[:-1], n)
    cfg = config or _nvfp4_gemm_configs(m, n)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split_k or choose_split_k(tiles, k, cfg.block_k, num_sms(x.device))
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    locks = split_k_locks(x.device, tiles) if split > 1 else out
    _nvfp4_gemm_kernel[(tiles, split)](
        x2, w.packed, w.block_scale.view(torch.uint8), w.tensor_scale, out, ws, locks,  #
        m, n, k,  #
        x2.stride(0), w.packed.stride(0), w.block_scale.stride(0), out.stride(0),  #
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, GROUP_M=8,  #
        EVEN_ODD=cfg.even_odd, F32_DOT=interpreting(),  #
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,  #
    )
    return out.reshape(*x.shape[:-1], n)


def nvfp4_gemm_ref(x: torch.Tensor, w: NVFP4Weight) -> torch.Tensor:
    """fp32 reference: dequantize W (reads N*K/2 code bytes + N*K/16 scale bytes), fp32 matmul."""
    return x.float() @ w.dequantize(torch.float32).t()
