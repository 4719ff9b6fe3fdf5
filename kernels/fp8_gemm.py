"""FP8 W8A16 linear: `out[M, N] = x[M, K] @ W[N, K]^T` with W per-tensor E4M3, x and out in bf16.

Layout: the checkpoint layout (`float8_e4m3fn [N, K]`, read as raw bytes) and an fp32 scalar scale
read on the device. Numerics: each E4M3 byte becomes fp16 bits by bit construction (value * 2^-8,
exact, subnormals included), is converted to bf16 (exact: 3 mantissa bits) and fed to bf16 `tl.dot`
with fp32 accumulation; scale * 2^8 is applied to the accumulator. Against `fp8_gemm_ref` only the
accumulation order and the bf16 output rounding differ.
Why W8A16 and not W8A8 on the FP8 tensor cores: decode (M <= 64) is bandwidth-bound, where both read
the same weight bytes and W8A16 skips quantizing activations and keeps bf16 accuracy; the benchmark
measures cuBLAS W8A8 (`torch._scaled_mm`) beside it for the prefill sizes.
Small M splits K across CTAs exactly like `nvfp4_gemm` (same counters and workspace scheme); above
FUSED_MAX_M rows W is dequantized to bf16 in one pass and cuBLAS runs the GEMM. One row (single-stream
decode) takes a GEMV on CUDA cores instead (`_fp8_gemv_kernel`): the tensor-core kernel pads it to 16 rows
and moves each decoded W tile through shared memory into the MMA layout, and reached 1.16 TB/s at q_proj
(8192 x 2048) on the H200, where cuBLAS bf16 moves 3.0 TB/s; the GEMV converts each byte once in
registers (E4M3 -> fp32 is exact) and keeps per-thread partial sums. Its K loop is pipelined explicitly
(`tl.range(num_stages=3)`): with no dot in the loop Triton left its loads synchronous, and ncu saw 35% of
DRAM bandwidth at q_proj's shape (session 7); now cp.async (sm_90 compile): 7.3 us at q_proj, 2.3 TB/s,
against cuBLAS bf16's 11.4 us (session 10). `fp8_gemv` runs the same kernel on `FP8Rows`, per-tensor
weights stacked along N with a scale per row: the engine's q|k|v and DeltaNet qkv|z in one launch. Two
options fuse DeltaNet's neighbouring decode steps into it (out_proj's gated RMSNorm on its input,
in_proj's causal-conv1d update on its conv outputs). sm_90.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl, small_ops
from batchinfer.kernels.gdn import gated_rmsnorm
from batchinfer.kernels.nvfp4 import FP8Weight
from batchinfer.kernels.nvfp4_gemm import (
    FUSED_MAX_M,
    GemmConfig,
    GemvConfig,
    check_gemm_out,
    choose_split_k,
    dequant_matmul,
    e4m3_to_f32,
    gemv_split_total,
    interpreting,
    num_sms,
    split_k_locks,
    store_split_tile,
)


def _fp8_gemm_configs(m: int, n: int) -> GemmConfig:
    """Offline-tuned table by M bucket (H200, tuned with `batchinfer.bench.tune_kernels`)."""
    if interpreting():
        return GemmConfig(16, 16, 32, 0, 4, 1)
    if m <= 16:
        return GemmConfig(16, 64, 256, 0, 4, 4)
    if m <= 64:
        return GemmConfig(64, 64, 128, 0, 4, 4)
    if m <= 256:
        return GemmConfig(64, 128, 128, 1, 8, 3)
    return GemmConfig(128, 128, 64, 1, 8, 3)


@triton.jit
def _fp8_dequant_kernel(
    w_ptr, scale_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = e4m3_to_f32(tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0))
    w = w * (tl.load(scale_ptr) * 256.0)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], w.to(tl.bfloat16), mask=mask)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, ws_ptr, lock_ptr,  #
    M, N, K,  #
    stride_xm, stride_wn, stride_om,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  #
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, F32_DOT: tl.constexpr,  #
):
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
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k[None, :] + (k - k_start) < k_end
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k, other=0.0)
        b = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k, other=0).to(tl.int32)
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)  # E4M3 -> fp16 bits of value * 2^-8
        w = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.bfloat16)
        if F32_DOT:  # the Triton 3.9 interpreter multiplies bf16 dot operands as raw bits
            acc = tl.dot(x.to(tl.float32), tl.trans(w).to(tl.float32), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * (tl.load(scale_ptr) * 256.0)

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
    store_split_tile(acc, out_ptrs, ws_ptrs, mask, lock_ptr, pid, pid_k, M * N, SPLIT_K)


@triton.jit
def _gemv_x(x_ptr, z_ptr, nw, eps, k, k_end,
            BLOCK_K: tl.constexpr, DV: tl.constexpr, GATED_NORM: tl.constexpr, INTERPRET: tl.constexpr):
    """x[k : k + BLOCK_K] (columns from k_end on: 0) as fp32. With GATED_NORM, x and z are DeltaNet's raw o
    and z, and the result is `gdn._gated_rmsnorm_kernel`'s output for those BLOCK_K / DV whole heads: its
    fp32 expressions, `nw` the norm weight [DV] in fp32, rounded once to bf16 as that kernel stores it. The
    per-head sum of squares is a `tl.sum` whose order follows the register layout, which Triton picks here
    for the reshape into the GEMV's x (sm_90: 2 a thread, 32 lanes, 2 warps a head of 128) and there for
    its [16, 128] tile (a tree of 8 a thread, 16 lanes): rstd may differ in its last fp32 bit."""
    if GATED_NORM:
        heads = k + tl.arange(0, BLOCK_K // DV) * DV  # K, k and k_end are multiples of DV: whole heads
        offs = tl.arange(0, DV)
        m = (heads < k_end)[:, None]
        o = tl.load(x_ptr + heads[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + heads[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / DV + eps)
        y = o * rstd[:, None] * nw[None, :] * (z * tl.sigmoid(z))
        x = tl.reshape(small_ops._to(y, tl.bfloat16, INTERPRET), (BLOCK_K,)).to(tl.float32)
    else:
        cols = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + cols, mask=cols < k_end, other=0.0).to(tl.float32)
    return x


@triton.jit
def _conv_update(y, rows, C, cw_ptr, slot_ptr, state_ptr, mixed_ptr, stride_cw, stride_ss, stride_sk,
                 BLOCK_N: tl.constexpr, CONV_K: tl.constexpr, STATE_PAD: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """`causal_conv1d._conv1d_update_kernel` for the channels `rows` (those < C) of one decode row whose new
    input is `y` (bf16 [BLOCK_N]: the projection as stored): its fp32 expressions in its order, `mixed`
    rounded as it stores it, the slot's state rolled (no state traffic and zeros out for a negative slot).
    The [BLOCK_N] vectors of a GEMV tile are copied across the threads that reduced its rows, so every read
    of the old state comes before a barrier and every write after: a copy that read late would see the
    rolled state. Only this tile's channels are touched (one program a tile reaches here)."""
    c_ok = rows < C
    slot = tl.load(slot_ptr).to(tl.int64)
    out = tl.zeros([BLOCK_N], tl.float32)
    if slot >= 0:
        s_ptrs = state_ptr + slot * stride_ss + rows
        w_last = tl.load(cw_ptr + rows * stride_cw + CONV_K - 1, mask=c_ok, other=0.0)
        acc = y.to(tl.float32) * w_last.to(tl.float32)
        for j in tl.static_range(CONV_K - 1):
            prev = tl.load(s_ptrs + j * stride_sk, mask=c_ok, other=0.0)
            w_j = tl.load(cw_ptr + rows * stride_cw + j, mask=c_ok, other=0.0)
            acc += prev.to(tl.float32) * w_j.to(tl.float32)
        taps = tl.arange(0, STATE_PAD)[:, None]  # the rolled state's entries: old entries 1..K-2, then y
        keep = (taps < CONV_K - 2) & c_ok[None, :]
        rolled = tl.load(s_ptrs[None, :] + (taps + 1) * stride_sk, mask=keep, other=0.0)
        rolled = tl.where(taps == CONV_K - 2, y.to(state_ptr.dtype.element_ty)[None, :], rolled)
        tl.debug_barrier()  # all reads of the old state above, all writes below
        tl.store(s_ptrs[None, :] + taps * stride_sk, rolled, mask=(taps < CONV_K - 1) & c_ok[None, :])
        out = acc * tl.sigmoid(acc)
    tl.store(mixed_ptr + rows, small_ops._to(out, mixed_ptr.dtype.element_ty, INTERPRET), mask=c_ok)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, tail_ptr, z_ptr, nw_ptr, out_ptr, ws_ptr, lock_ptr,  #
    cw_ptr, slot_ptr, state_ptr, mixed_ptr,  #
    N, N_TAIL, K, stride_wn, stride_s, eps, C,  #
    stride_cw, stride_ss, stride_sk,  #
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_TAIL: tl.constexpr,  #
    STAGES: tl.constexpr,  #
    GATED_NORM: tl.constexpr = False, DV: tl.constexpr = 1, INTERPRET: tl.constexpr = False,  #
    CONV: tl.constexpr = False, CONV_K: tl.constexpr = 2, STATE_PAD: tl.constexpr = 1,  #
    PDL: tl.constexpr = False,  #
):
    """out[n] = scale[n] * sum_k x[k] W[n, k] for BLOCK_N rows n and one of SPLIT_K ranges of K (scale[n]
    at n * stride_s: 0 for one tensor scale, 1 for stacked weights' rows); with HAS_TAIL, rows N to
    N + N_TAIL are bf16 rows of `tail` [N_TAIL, K] (scale 1), a tile across the boundary runs both loops.
    With GATED_NORM, x is DeltaNet's o before its gated RMSNorm (heads of DV, z at z_ptr, weight at nw_ptr),
    applied to each K step's heads as they are loaded (`_gemv_x`). With CONV, outputs 0 to C are DeltaNet's
    conv channels: the program that completes their tile runs the decode conv update on them (`_conv_update`:
    conv weight [C, CONV_K] at cw_ptr, slot at slot_ptr, state [slots, CONV_K - 1, C], mixed [C]).
    Partial sums [BLOCK_N, BLOCK_K] per thread, one reduction at the end, split partials summed in split
    order by the last program to finish (as `_fp8_gemm_kernel`)."""
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_w = rows < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    nw = tl.load(nw_ptr + tl.arange(0, DV)).to(tl.float32) if GATED_NORM else 0.0
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if pid_n * BLOCK_N < N:
        for k in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            cols = k + tl.arange(0, BLOCK_K)
            mask_k = cols < k_end
            x = _gemv_x(x_ptr, z_ptr, nw, eps, k, k_end, BLOCK_K, DV, GATED_NORM, INTERPRET)
            b = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :],
                        mask=mask_w[:, None] & mask_k[None, :], other=0)
            acc += b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * x[None, :]
    n_out = N
    if HAS_TAIL:
        n_out = N + N_TAIL
        mask_t = (rows >= N) & (rows < n_out)
        if (pid_n + 1) * BLOCK_N > N:
            for k in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
                cols = k + tl.arange(0, BLOCK_K)
                mask_k = cols < k_end
                x = _gemv_x(x_ptr, z_ptr, nw, eps, k, k_end, BLOCK_K, DV, GATED_NORM, INTERPRET)
                t = tl.load(tail_ptr + (rows - N)[:, None] * K + cols[None, :],
                            mask=mask_t[:, None] & mask_k[None, :], other=0.0)
                acc += t.to(tl.float32) * x[None, :]
    mask_n = rows < n_out
    part = tl.sum(acc, axis=1) * tl.load(scale_ptr + rows * stride_s, mask=mask_w, other=1.0)
    total, last = gemv_split_total(part, ws_ptr, lock_ptr, rows, mask_n, n_out, SPLIT_K)
    if last:
        y = total.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows, y, mask=mask_n)
        if CONV:
            if pid_n * BLOCK_N < C:
                _conv_update(y, rows, C, cw_ptr, slot_ptr, state_ptr, mixed_ptr,
                             stride_cw, stride_ss, stride_sk, BLOCK_N, CONV_K, STATE_PAD, INTERPRET)


@dataclass(slots=True)
class FP8Rows:
    """Per-tensor FP8 weights stacked along N, each row with its own tensor's scale, then optional bf16
    rows, so that linears reading one input (q|k|v; DeltaNet's qkv|z|b|a, whose b and a NVIDIA's
    checkpoints keep in bf16) run as one GEMV on their checkpoint bytes."""

    data: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]
    tail: torch.Tensor | None = None  # bf16 [N_TAIL, K]: output rows N to N + N_TAIL

    @property
    def rows(self) -> int:
        return self.data.shape[0] + (0 if self.tail is None else self.tail.shape[0])


def stack_fp8(weights: Sequence[FP8Weight], tail: Sequence[torch.Tensor] = ()) -> FP8Rows:
    """`weights` (same K) as one `FP8Rows`: the data concatenated, each tensor scale repeated per row; then
    the bf16 `tail` matrices' rows."""
    if not weights:
        raise ValueError("stack_fp8: expected at least one FP8 weight")
    ks = {w.shape[1] for w in weights} | {t.shape[1] for t in tail}
    if len(ks) != 1:
        raise ValueError(f"FP8 weights to stack must share K, got K in {sorted(ks)}")
    data = torch.cat([w.data.view(torch.uint8) for w in weights]).view(torch.float8_e4m3fn)
    scale = torch.cat([w.scale.reshape(1).expand(w.shape[0]) for w in weights]).contiguous()
    rows = torch.cat([t.to(torch.bfloat16) for t in tail]).contiguous() if tail else None
    return FP8Rows(data, scale, rows)


def check_fp8_rows(w: FP8Rows, device: torch.device) -> None:
    """`w` as `stack_fp8` makes it, on `device`."""
    k = w.data.shape[1]
    if w.data.stride(-1) != 1 or w.scale.shape != (w.data.shape[0],) or device != w.data.device:
        raise ValueError("weight: expected FP8Rows as stack_fp8 makes them (unit-stride rows, a scale per "
                         "row), on x's device")
    t = w.tail
    if t is not None and (t.dtype != torch.bfloat16 or not t.is_contiguous() or t.shape[1] != k):
        raise ValueError(f"weight: expected a contiguous bfloat16 tail [rows, {k}], got {t.dtype} "
                         f"{list(t.shape)}")


def fp8_gemv_config() -> GemvConfig:
    """One-row FP8 launch (BLOCK_G: 16 columns of K a group): session 10's (16 rows, 256 columns)."""
    return GemvConfig(64, 4, 4) if interpreting() else GemvConfig(16, 16, 4)  # interpreter: few programs


GatedNorm = tuple[torch.Tensor, torch.Tensor, float]  # DeltaNet's (z [1, K], weight [Dv], eps)
# DeltaNet's decode conv: (weight [C, Kc], state [slots, Kc - 1, C], slot int32/int64 [1])
ConvUpdate = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _fp8_gemv(
    x: torch.Tensor,
    w: FP8Weight | FP8Rows,
    out: torch.Tensor,
    config: GemvConfig | None = None,
    gated_norm: GatedNorm | None = None,
    conv: ConvUpdate | None = None,
    mixed: torch.Tensor | None = None,
) -> None:
    """`_fp8_gemv_kernel` for one row: x `[1, K]`, out `[1, N (+ N_TAIL)]` (unit strides); `gated_norm`
    checked by `fp8_gemv`, its Dv dividing the launch's BLOCK_K; `conv` checked by `_check_conv`, with
    `mixed` its output `[1, C]`."""
    n, k = w.data.shape
    tail = w.tail if isinstance(w, FP8Rows) else None
    n_tail = 0 if tail is None else tail.shape[0]
    cfg = config or fp8_gemv_config()
    block_k = 16 * cfg.block_g
    tiles = triton.cdiv(n + n_tail, cfg.block_n)
    split = cfg.split_k or choose_split_k(tiles, k, block_k, num_sms(x.device))
    ws = torch.empty((split, n + n_tail), dtype=torch.float32, device=x.device) if split > 1 else out
    locks = split_k_locks(x.device, tiles) if split > 1 else out
    z, nw, eps = gated_norm or (x, x, 0.0)
    cw, state, slot = conv or (x, x.view(1, 1, -1), x)
    kc = cw.shape[1] if conv else 2
    _fp8_gemv_kernel[(tiles, split)](
        x, w.data.view(torch.uint8), w.scale, x if tail is None else tail, z, nw, out, ws, locks,  #
        cw, slot, state, out if mixed is None else mixed,  #
        n, n_tail, k, w.data.stride(0), int(w.scale.ndim == 1), eps, cw.shape[0] if conv else 0,  #
        cw.stride(0), state.stride(0), state.stride(1),  #
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=split, HAS_TAIL=tail is not None,  #
        STAGES=cfg.num_stages,  #
        GATED_NORM=gated_norm is not None, DV=nw.shape[0] if gated_norm else 1, INTERPRET=interpreting(),  #
        CONV=conv is not None, CONV_K=kc, STATE_PAD=triton.next_power_of_2(kc - 1),  #
        num_warps=cfg.num_warps, **pdl.launch(out.device),  #
    )


def _check_gated_norm(gated_norm: GatedNorm, x: torch.Tensor) -> int:
    """Dv of `fp8_gemv`'s `gated_norm` for x `[1, K]` (K = heads * Dv)."""
    z, weight, _ = gated_norm
    dv, k = weight.shape[0], x.shape[1]
    if z.shape != x.shape or z.dtype != torch.bfloat16 or z.stride(-1) != 1 or z.device != x.device:
        raise ValueError(f"gated_norm z: expected bfloat16 [1, {k}] with unit stride on {x.device}, got "
                         f"{z.dtype} {list(z.shape)} strides {z.stride()} on {z.device}")
    if weight.dim() != 1 or weight.stride(0) != 1 or dv == 0 or k % dv or weight.device != x.device:
        raise ValueError(f"gated_norm weight: expected a contiguous [Dv], Dv dividing K={k}, on {x.device}; "
                         f"got {list(weight.shape)} strides {weight.stride()} on {weight.device}")
    return dv


def _check_conv(conv: ConvUpdate, w: FP8Rows, device: torch.device) -> int:
    """C of `fp8_gemv`'s `conv` (its channels the first C of w's rows)."""
    weight, state, slot = conv
    shape_ok = weight.dim() == 2 and 0 < weight.shape[0] <= w.rows and weight.shape[1] >= 2
    if not shape_ok or weight.stride(-1) != 1 or weight.device != device:
        raise ValueError(f"conv weight: expected [C, Kc] with unit column stride, 0 < C <= {w.rows} (the "
                         f"GEMV's rows), Kc >= 2, on {device}; got {list(weight.shape)} strides "
                         f"{weight.stride()} on {weight.device}")
    c, kc = weight.shape
    if state.dim() != 3 or state.shape[1:] != (kc - 1, c) or state.stride(-1) != 1 or state.device != device:
        raise ValueError(f"conv state: expected [slots, {kc - 1}, {c}] with unit channel stride on {device}, "
                         f"got {list(state.shape)} strides {state.stride()} on {state.device}")
    if slot.shape != (1,) or slot.dtype not in (torch.int32, torch.int64) or slot.device != device:
        raise ValueError(f"conv slot: expected int32 or int64 [1] on {device}, got {slot.dtype} "
                         f"{list(slot.shape)} on {slot.device}")
    return c


@overload
def fp8_gemv(
    x: torch.Tensor, w: FP8Rows, out: torch.Tensor | None = None, config: GemvConfig | None = None,
    gated_norm: GatedNorm | None = None, conv: None = None,
) -> torch.Tensor: ...


@overload
def fp8_gemv(
    x: torch.Tensor, w: FP8Rows, out: torch.Tensor | None = None, config: GemvConfig | None = None,
    gated_norm: GatedNorm | None = None, *, conv: ConvUpdate,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def fp8_gemv(
    x: torch.Tensor,
    w: FP8Rows,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    gated_norm: GatedNorm | None = None,
    conv: ConvUpdate | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One bf16 row `x [1, K]` times stacked FP8 (and bf16 tail) rows `W [N, K]` transposed -> `[1, N]`
    bf16, reading the FP8 bytes (single-stream decode, where the weights are all the bytes a step moves).
    `out` may be a view with unit column stride; `config` overrides the launch (tuner).

    `gated_norm = (z, weight, eps)`, z `[1, K]` bf16: x is DeltaNet's o before its gated RMSNorm (heads of
    Dv = len(weight) along K), normalised in registers as each K step loads it (one launch instead of two,
    single-stream decode's out_proj). The same as `fp8_gemv(gdn.gated_rmsnorm(x.view(-1, Dv),
    z.view(-1, Dv), weight, eps).view(1, K), w)`: the same fp32 expressions and bf16 rounding of the
    normalised x, bit-identical under the interpreter; compiled, the two kernels sum each head's squares
    in different orders (`_gemv_x`), so an x element can land one bf16 ulp apart where rstd's last bit
    decides its rounding.
    A Dv that does not divide the launch's 16 * block_g columns (the demo model's 48) runs those two
    launches instead.

    `conv = (weight [C, Kc], state [slots, Kc - 1, C], slot [1])`: the first C outputs are DeltaNet's conv
    channels (in_proj's qkv), and the GEMV also runs their decode conv update (one launch instead of two,
    single-stream decode's in_proj): returns `(out, mixed)`, mixed `[1, C]` bf16, rolling the slot's state
    in place. The same as `out = fp8_gemv(x, w)` then `mixed = causal_conv1d_update(out[:, :C], weight,
    state, slot)`: the program that completes a tile of conv channels runs that kernel's fp32 expressions
    on the tile's bf16 outputs; proj, mixed and the state are bit-identical to the two launches (a
    negative slot: no state read or write, mixed zeros)."""
    k = w.data.shape[1]
    if x.shape != (1, k) or x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        raise ValueError(f"x: expected bfloat16 [1, {k}] with unit stride, got {x.dtype} {list(x.shape)}")
    check_fp8_rows(w, x.device)
    out = check_gemm_out(out, 1, w.rows, x.device)
    if gated_norm is not None:
        dv = _check_gated_norm(gated_norm, x)
        if 16 * (config or fp8_gemv_config()).block_g % dv:  # a head across two K steps: two launches
            z, weight, eps = gated_norm
            x, gated_norm = gated_rmsnorm(x.view(-1, dv), z.view(-1, dv), weight, eps).view(1, k), None
    if conv is None:
        _fp8_gemv(x, w, out, config, gated_norm)
        return out
    mixed = torch.empty((1, _check_conv(conv, w, x.device)), dtype=torch.bfloat16, device=x.device)
    _fp8_gemv(x, w, out, config, gated_norm, conv, mixed)
    return out, mixed


def fp8_dequantize(w: FP8Weight, row_start: int = 0, row_end: int | None = None) -> torch.Tensor:
    """Rows `[row_start, row_end)` of W as bf16 `[rows, K]` (E4M3 * scale in fp32, rounded once)."""
    n, k = w.shape
    row_end = n if row_end is None else row_end
    out = torch.empty((row_end - row_start, k), dtype=torch.bfloat16, device=w.device)
    block_n, block_k = (16, 32) if interpreting() else (32, 256)
    grid = (triton.cdiv(row_end - row_start, block_n), triton.cdiv(k, block_k))
    _fp8_dequant_kernel[grid](w.data.view(torch.uint8)[row_start:], w.scale, out, row_end - row_start, k,
                              w.data.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def fp8_gemm(
    x: torch.Tensor, w: FP8Weight, out: torch.Tensor | None = None, config: GemmConfig | None = None
) -> torch.Tensor:
    """`x [..., K]` bf16 times FP8 `W [N, K]` transposed -> `[..., N]` bf16 (fp32 accumulation).

    Above FUSED_MAX_M rows: bf16 dequantization in one pass, then cuBLAS; one row: the CUDA-core GEMV
    (both only without a `config`). `out` and `config` as in `nvfp4_gemm`.
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension K={k} (weight is [N={n}, K={k}]), got {x.shape[-1]}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x: expected bfloat16, got {x.dtype}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but the weight is on {w.device}")
    if w.data.stride(-1) != 1:
        raise ValueError(f"weight: data must have unit stride along K, got strides {w.data.stride()}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = check_gemm_out(out, m, n, x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    if config is None and m > FUSED_MAX_M:
        dequant_matmul(x2, lambda r0, r1: fp8_dequantize(w, r0, r1), n, out)
        return out.reshape(*x.shape[:-1], n)
    if config is None and m == 1:
        _fp8_gemv(x2, w, out)
        return out.reshape(*x.shape[:-1], n)
    cfg = config or _fp8_gemm_configs(m, n)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split_k or choose_split_k(tiles, k, cfg.block_k, num_sms(x.device))
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    locks = split_k_locks(x.device, tiles) if split > 1 else out
    _fp8_gemm_kernel[(tiles, split)](
        x2, w.data.view(torch.uint8), w.scale, out, ws, locks,  #
        m, n, k,  #
        x2.stride(0), w.data.stride(0), out.stride(0),  #
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, GROUP_M=8,  #
        F32_DOT=interpreting(),  #
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,  #
    )
    return out.reshape(*x.shape[:-1], n)


def fp8_gemm_ref(x: torch.Tensor, w: FP8Weight) -> torch.Tensor:
    """fp32 reference: dequantize W (reads N*K bytes), fp32 matmul."""
    return x.float() @ w.dequantize(torch.float32).t()
