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
takes a GEMV on CUDA cores instead (`_nvfp4_gemv_kernel`), since the tensor-core kernel padded to 16
rows moved 0.4-0.7 TB/s at M=1 (session 10): each 16-code group's 8 bytes as one int64, decoded and
multiplied by `e2m1_dot8`'s inline PTX. On the checkpoint layout (`nvfp4_gemm`) a thread holds one row;
the engine stacks its weights group-major instead (`NVFP4Rows`, `nvfp4_gemv`), where each thread holds
several rows of the same groups: lm_head 248,320 x 2,048 in 114.6 us on the H200, 2.50 TB/s (354.0 us
on the checkpoint layout; cuBLAS on the bf16 copy 248.0; session 11).
Assumes sm_90 (or the Triton interpreter); one CUDA stream per device at a time uses the split-K
counters.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl
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


# Rows from which the one-row GEMV is an lm_head (151,936 and 248,320 rows; projections are <= 16,384).
GEMV_WIDE_ROWS = 65536


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """One-row launch: BLOCK_N rows by BLOCK_G 16-code groups a step; SPLIT_K = 0: from the CTA count;
    num_stages 1 loads in the loop, more pipelines the weight stream through shared memory (cp.async)."""

    block_n: int
    block_g: int
    num_warps: int
    split_k: int = 0
    num_stages: int = 3


def interpreting() -> bool:
    """True under the Triton CPU interpreter (tests on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def gemv_config(group_major: bool, n: int) -> GemvConfig:
    """The one-row GEMV's launch for N rows. Group-major rows (`NVFP4Rows`, the engine's): session 11 (H200,
    `tune_kernels --kinds nvfp4_gemv`, the scale loads then after the dots) chose (64, 16, 4) with loads in
    the loop for every shape. Session 27 (H100, a step's loads all first, docs/PERF.md): projections (below
    GEMV_WIDE_ROWS) on 8 warps (N 8,192: 8.8 against 10.9 us on 4; 16,384: 13.0 against 16.7), lm_head on
    the cp.async pipeline (248,320 rows: 116.6 against 124.3). The checkpoint layout keeps the untuned
    first guess."""
    if interpreting():  # few, wide programs: the interpreter's cost is per program and op
        return GemvConfig(64, 4, 4)
    if not group_major:
        return GemvConfig(64, 16, 4)
    return GemvConfig(64, 16, 4, 0, 3) if n >= GEMV_WIDE_ROWS else GemvConfig(64, 16, 8, 0, 1)


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
def _e2m1_pair(w, P: tl.constexpr):
    """uint32 word of 8 E2M1 codes (code j in bits 4j..4j+3) -> codes P and P + 4 as fp32 times 2^-14.

    Both codes become fp16 bit patterns with the same shifts and masks (sign to bit 15/31, the three
    magnitude bits to bits 9-11/25-27: E2M1 maps onto fp16's subnormal/normal boundary exactly). The
    interpreter's form of `e2m1_dot8`."""
    if P == 3:
        mag = (w >> 3) & 0x0E000E00
    else:
        mag = (w << (9 - 4 * P)) & 0x0E000E00
    u = mag | ((w << (12 - 4 * P)) & 0x80008000)
    lo = u.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (u >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


def _dot8_ptx() -> str:
    """PTX of `e2m1_dot8`: per code pair (P, P + 4) two shifts and masks build the pair as fp16x2 (as
    `_e2m1_pair`), each half converts to fp32 straight from its register half and is multiplied into its
    parity's sum. Written out because Triton's compile of the same math extracts the halves with PRMTs
    (sm_90 SASS, session 11: the MoE decode path's gate_up loop 908 -> 860 instructions for 128 codes)."""
    lines = ["{", ".reg .b32 m, s, u;", ".reg .b16 lo, hi;", ".reg .f32 c;"]
    for p in range(4):
        acc = f"${p % 2}"
        mag = "shr.b32 m, $2, 3;" if p == 3 else f"shl.b32 m, $2, {9 - 4 * p};"
        first = "mul.rn.f32 {a}, c, ${x};" if p < 2 else "fma.rn.f32 {a}, c, ${x}, {a};"
        lines += [
            mag, "and.b32 m, m, 0x0E000E00;", f"shl.b32 s, $2, {12 - 4 * p};", "and.b32 s, s, 0x80008000;",
            "or.b32 u, m, s;", "mov.b32 {lo, hi}, u;",
            "cvt.f32.f16 c, lo;", first.format(a=acc, x=3 + p),
            "cvt.f32.f16 c, hi;", f"fma.rn.f32 {acc}, c, ${7 + p}, {acc};",
        ]
    return "\n".join(lines + ["}"])


_DOT8_PTX = tl.constexpr(_dot8_ptx())


@triton.jit
def e2m1_dot8(w, x0, x1, x2, x3, x4, x5, x6, x7, INTERPRET: tl.constexpr):
    """Sums of the 8 E2M1 codes of uint32 words `w` (code j in bits 4j..4j+3, as `_e2m1_pair`) times x0..x7
    (fp32, broadcast against w): (even codes' sum, odd codes' sum), both times 2^-14. On the GPU one inline
    PTX block a word (`_dot8_ptx`); the interpreter runs the same math in Triton."""
    if INTERPRET:
        c0, c4 = _e2m1_pair(w, 0)
        c1, c5 = _e2m1_pair(w, 1)
        c2, c6 = _e2m1_pair(w, 2)
        c3, c7 = _e2m1_pair(w, 3)
        even = c0 * x0 + c2 * x2 + c4 * x4 + c6 * x6
        odd = c1 * x1 + c3 * x3 + c5 * x5 + c7 * x7
    else:
        even, odd = tl.inline_asm_elementwise(
            _DOT8_PTX, "=f,=f,r,f,f,f,f,f,f,f,f", [w, x0, x1, x2, x3, x4, x5, x6, x7],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
        )
    return even, odd


@triton.jit
def group_dot16(w, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                INTERPRET: tl.constexpr):
    """int64 words `w` of 16 E2M1 codes each (code j in bits 4j..4j+3: 8 checkpoint bytes) times x0..x15:
    (even codes' sum, odd codes' sum), fp32 times 2^-14."""
    ea, oa = e2m1_dot8(w.to(tl.uint32), x0, x1, x2, x3, x4, x5, x6, x7, INTERPRET)
    eb, ob = e2m1_dot8((w >> 32).to(tl.uint32), x8, x9, x10, x11, x12, x13, x14, x15, INTERPRET)
    return ea + eb, oa + ob


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
    ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
    store_split_tile(acc, out_ptrs, ws_ptrs, mask, lock_ptr, pid, pid_k, M * N, SPLIT_K)


_LOCKS: dict[torch.device, list[torch.Tensor]] = {}


@triton.jit
def store_split_tile(acc, out_ptrs, ws_ptrs, mask, lock_ptr, tile, split, MN, SPLIT_K: tl.constexpr):
    """The end of a split-K GEMM program: with one split store `acc` at `out_ptrs`; else publish it in the
    fp32 workspace (`ws_ptrs` of split 0, splits MN elements apart) and let the tile's last split to arrive
    (its counter at `lock_ptr + tile`) sum the partials in split order, store them and reset the counter."""
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptrs + split * MN, acc, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for i in range(SPLIT_K):
                total += tl.load(ws_ptrs + i * MN, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def split_total(part, ws_ptrs, lock_ptr, pid_s, stride_s, mask, SPLIT: tl.constexpr):
    """Serial split reduction of any tile shape: publish this split's fp32 partial (`ws_ptrs` of split 0,
    splits `stride_s` elements apart); the program of the split that arrives last gets (the sum over the
    splits in split order, True) and resets the counter at `lock_ptr`, the others (0, False)."""
    tl.store(ws_ptrs + pid_s * stride_s, part, mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(lock_ptr, 1, sem="acq_rel")
    last = done == SPLIT - 1
    total = tl.zeros_like(part)
    if last:
        for i in range(SPLIT):
            total += tl.load(ws_ptrs + i * stride_s, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(lock_ptr, 0)
    return total, last


@triton.jit
def gemv_split_total(part, ws_ptr, lock_ptr, rows, mask_n, N, SPLIT_K: tl.constexpr):
    """`(total, is_last)` at the end of a one-row split-K GEMV program (grid: row tiles x SPLIT_K): with one
    split `(part, True)` (fp32 [BLOCK_N] of outputs `rows`); else publish `part` in `ws` [SPLIT_K, N]; the
    tile's last split to arrive (its counter in `lock`) gets the partials summed in split order and resets
    the counter, every other program `is_last` False (its `total` is not the tile's). For an epilogue that
    needs the tile's final values (`fp8_gemm`'s conv update)."""
    if SPLIT_K == 1:
        return part, True
    else:
        pid_n = tl.program_id(0)
        tl.store(ws_ptr + tl.program_id(1) * N + rows, part, mask=mask_n)
        tl.debug_barrier()
        done = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
        last = done == SPLIT_K - 1
        total = part
        if last:
            total = tl.zeros_like(part)
            for i in range(SPLIT_K):
                total += tl.load(ws_ptr + i * N + rows, mask=mask_n, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + pid_n, 0)
        return total, last


@triton.jit
def store_gemv_split(part, out_ptr, ws_ptr, lock_ptr, rows, mask_n, N, SPLIT_K: tl.constexpr):
    """The end of a one-row split-K GEMV program: `gemv_split_total`, and the tile's last program stores the
    total (as `out`'s dtype)."""
    total, last = gemv_split_total(part, ws_ptr, lock_ptr, rows, mask_n, N, SPLIT_K)
    if last:
        tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _x16(x_ptr, groups, mask_g):
    """x[16 g + P] for P = 0..15 of the 16-code groups `groups` ([BG] int), each as fp32 [1, BG]."""
    base = x_ptr + groups * 16
    x0 = tl.load(base + 0, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x1 = tl.load(base + 1, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x2 = tl.load(base + 2, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x3 = tl.load(base + 3, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x4 = tl.load(base + 4, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x5 = tl.load(base + 5, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x6 = tl.load(base + 6, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x7 = tl.load(base + 7, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x8 = tl.load(base + 8, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x9 = tl.load(base + 9, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x10 = tl.load(base + 10, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x11 = tl.load(base + 11, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x12 = tl.load(base + 12, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x13 = tl.load(base + 13, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x14 = tl.load(base + 14, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    x15 = tl.load(base + 15, mask=mask_g, other=0.0).to(tl.float32)[None, :]
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _nvfp4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ws_ptr, lock_ptr,  #
    N, G, stride_wn, stride_wg, stride_sn, stride_sg, stride_ts,  #
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_G: tl.constexpr,  #
    STAGES: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """out[n] = ts[n] * sum_k x[k] W[n, k] for one row x, BLOCK_N rows n and one of SPLIT_K ranges of the G
    16-code groups: each group's 8 code bytes as one int64 (at n * stride_wn + g * stride_wg: the
    checkpoint's row-major layout or `NVFP4Rows`' group-major one), decoded and multiplied by
    `group_dot16`, times the group's scale; per-thread partial sums, one reduction at the end, splits
    summed by `store_gemv_split`. Tensor scale ts[n] at n * stride_ts (0: one for all rows). EVEN_G: every
    split is whole BLOCK_G steps (no group mask)."""
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    g_per_split = tl.cdiv(tl.cdiv(G, SPLIT_K), BLOCK_G) * BLOCK_G
    g_start = pid_k * g_per_split
    g_end = tl.minimum(G, g_start + g_per_split)
    ts = tl.load(ts_ptr + rows * stride_ts, mask=mask_n, other=0.0)  # with the first step's loads
    acc = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    for g0 in tl.range(g_start, g_end, BLOCK_G, num_stages=STAGES):
        groups = g0 + tl.arange(0, BLOCK_G)
        if EVEN_G:
            mask_g = groups >= 0
        else:
            mask_g = groups < g_end
        mask = mask_n[:, None] & mask_g[None, :]
        # codes, scales, then x: every load of the step before its dots (scales loaded after the dots went
        # out only after the decode in sm_90 SASS, a second wait on DRAM each step; as `moe._gemv_step`)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + groups[None, :] * stride_wg, mask=mask, other=0)
        s = tl.load(s_ptr + rows[:, None] * stride_sn + groups[None, :] * stride_sg, mask=mask, other=0)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _x16(x_ptr, groups, mask_g)
        even, odd = group_dot16(w, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                                INTERPRET)
        acc += (even + odd) * e4m3_to_f32(s)
    part = tl.sum(acc, axis=1) * (ts * 4194304.0)  # 2^22: the codes' 2^-14, the scales' 2^-8
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


def check_rows_x(x: torch.Tensor, k: int, max_m: int) -> int:
    """The few-row kernels' input (`fp8_rows_mm`, `nvfp4_rows_tc`): bf16 `[M, K]`, 1 <= M <= max_m, unit
    column stride. Returns M."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= max_m or x.shape[1] != k or x.dtype != torch.bfloat16 \
            or x.stride(-1) != 1:  # fmt: skip
        raise ValueError(f"x: expected bfloat16 [M, {k}] with 1 <= M <= {max_m} and unit column stride, got "
                         f"{x.dtype} {list(x.shape)} strides {x.stride()}")  # fmt: skip
    return x.shape[0]


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


def _launch_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, ts: torch.Tensor, n: int, g: int,
                 group_major: bool, out: torch.Tensor, config: GemvConfig | None) -> None:
    """`_nvfp4_gemv_kernel` on int64 `codes` and uint8 `scales`, `[N, G]` or (group_major) `[G, N]`; `ts`
    fp32 of one element or one a row."""
    cfg = config or gemv_config(group_major, n)
    tiles = triton.cdiv(n, cfg.block_n)
    split = cfg.split_k or choose_split_k(tiles, 16 * g, 16 * cfg.block_g, num_sms(x.device))
    g_per_split = triton.cdiv(triton.cdiv(g, split), cfg.block_g) * cfg.block_g
    ws = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else out
    locks = split_k_locks(x.device, tiles) if split > 1 else out
    strides = (1, n, 1, n) if group_major else (g, 1, g, 1)
    _nvfp4_gemv_kernel[(tiles, split)](
        x, codes, scales, ts, out, ws, locks,  #
        n, g, *strides, int(ts.numel() > 1),  #
        BLOCK_N=cfg.block_n, BLOCK_G=cfg.block_g, SPLIT_K=split, EVEN_G=g % g_per_split == 0,  #
        STAGES=cfg.num_stages, INTERPRET=interpreting(), num_warps=cfg.num_warps, **pdl.launch(out.device),  #
    )


def _nvfp4_gemv(x: torch.Tensor, w: NVFP4Weight, out: torch.Tensor, config: GemvConfig | None = None) -> None:
    """The GEMV on the checkpoint layout: x `[1, K]`, out `[1, N]` (unit strides)."""
    n, k = w.shape
    codes = w.packed.view(torch.int64)  # [N, K/16]: a group's 8 bytes
    _launch_gemv(x, codes, w.block_scale.view(torch.uint8), w.tensor_scale, n, k // 16, False, out, config)


@dataclass(slots=True)
class NVFP4Rows:
    """NVFP4 weights stacked along N for the one-row GEMV, stored group-major: each 16-code group's 8
    code bytes as one int64 `codes [K/16, N]`, its e4m3 scale byte in `scales [K/16, N]`, and each row's
    tensor scale. A warp's load of a group then spans consecutive rows and each thread holds several rows
    of the same groups, so an x element it loads serves all of them; on the checkpoint's row-major layout
    Triton gives a thread one row and eight groups, an x load for every 8 codes (sm_90 SASS, session 11)."""

    codes: torch.Tensor  # int64 [K/16, N]
    scales: torch.Tensor  # uint8 [K/16, N]
    tensor_scale: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[1], 16 * self.codes.shape[0]


def stack_nvfp4(weights: Sequence[NVFP4Weight]) -> NVFP4Rows:
    """`weights` (same K) as one group-major `NVFP4Rows`: rows concatenated, tensor scales repeated per
    row."""
    if not weights:
        raise ValueError("stack_nvfp4: expected at least one NVFP4 weight")
    ks = {w.shape[1] for w in weights}
    if len(ks) != 1:
        raise ValueError(f"NVFP4 weights to stack must share K, got K in {sorted(ks)}")
    codes = torch.cat([w.packed.contiguous().view(torch.int64) for w in weights]).t().contiguous()
    scales = torch.cat([w.block_scale.view(torch.uint8) for w in weights]).t().contiguous()
    ts = torch.cat([w.tensor_scale.reshape(1).expand(w.shape[0]) for w in weights]).float().contiguous()
    return NVFP4Rows(codes, scales, ts)


def nvfp4_gemv(x: torch.Tensor, w: NVFP4Rows, out: torch.Tensor | None = None,
               config: GemvConfig | None = None) -> torch.Tensor:
    """One row `x [1, K]` bf16 times the stacked NVFP4 rows `w` -> `[1, N]` bf16 (fp32 accumulation); into
    `out` when given (CUDA graphs)."""
    n, k = w.shape
    if x.dtype != torch.bfloat16 or x.ndim != 2 or tuple(x.shape) != (1, k) or x.stride(1) != 1:
        raise ValueError(f"x: expected bfloat16 [1, {k}] with unit stride, got {x.dtype} {list(x.shape)}")
    if x.device != w.codes.device:
        raise ValueError(f"x is on {x.device} but the weight is on {w.codes.device}")
    g = k // 16
    shapes = (w.codes.dtype, w.codes.is_contiguous(), w.scales.dtype, tuple(w.scales.shape),
              w.scales.is_contiguous(), w.tensor_scale.dtype, tuple(w.tensor_scale.shape))
    if shapes != (torch.int64, True, torch.uint8, (g, n), True, torch.float32, (n,)):
        raise ValueError(
            f"weight: expected NVFP4Rows as stack_nvfp4 makes them (contiguous int64 codes [{g}, {n}], uint8 "
            f"scales [{g}, {n}], float32 tensor scales [{n}]), got codes {w.codes.dtype}, scales "
            f"{w.scales.dtype} {list(w.scales.shape)}, tensor scales {w.tensor_scale.dtype} "
            f"{list(w.tensor_scale.shape)}"
        )
    out = check_gemm_out(out, 1, n, x.device)
    _launch_gemv(x, w.codes, w.scales, w.tensor_scale, n, g, True, out, config)
    return out


def nvfp4_gemm(
    x: torch.Tensor,
    w: NVFP4Weight,
    out: torch.Tensor | None = None,
    config: GemmConfig | GemvConfig | None = None,
) -> torch.Tensor:
    """`x [..., K]` bf16 times NVFP4 `W [N, K]` transposed -> `[..., N]` bf16 (fp32 accumulation).

    One row runs the CUDA-core GEMV; up to FUSED_MAX_M rows the fused tensor-core kernel decodes W in
    registers; above, W is dequantized to bf16 in one pass and cuBLAS multiplies (the decode then costs
    little next to the GEMM). `out` (bf16 `[M, N]` with unit column stride, M = x rows) receives the
    result in place, e.g. a static buffer under CUDA graphs; `config` forces the fused kernel (a
    `GemmConfig`) or, for one row, the GEMV (a `GemvConfig`) with that configuration (tuner).
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
    if isinstance(config, GemvConfig) or (config is None and m == 1):
        if m != 1:
            raise ValueError(f"GemvConfig: the GEMV takes one row, got {m}")
        _nvfp4_gemv(x2, w, out, config)
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
