"""Small fused ops of the decoder loop: residual add + RMSNorm, SiLU x mul, embedding gather, the MoE's sum
over a token's slots; and the epilogues the MoE decode and direct paths share (`silu_mul_splits` after a
split gate_up, `store_token_tile` after a split down, with the row's add + RMSNorm: `add_rmsnorm_row`).

Layouts: every activation is a row-major `[T, D]` bf16/fp16/fp32 tensor (last dim contiguous).
Numerics: reductions and math in fp32, one cast at the store; the residual sum is rounded to the
activation dtype before it is normalised, as in HF (`x + r` in bf16, then RMSNorm), so results match
`*_ref` to bf16 rounding (<= 1e-2 relative, usually ~4e-3). Sampling lives in `sampling.py`.
GPU assumptions: none beyond Triton; these are bandwidth-bound row kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl
from batchinfer.kernels.nvfp4_gemm import bf16_rne, interpreting, split_total


def _row_configs(d: int) -> dict[str, int]:
    """Block and warps for a row kernel of width d (one program per row, whole row in registers)."""
    block = triton.next_power_of_2(d)
    if interpreting():
        return {"BLOCK_D": block, "num_warps": 1}
    return {"BLOCK_D": block, "num_warps": 4 if block <= 2048 else 8}


@triton.jit
def _to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """x.to(dtype), rounded to nearest even under the interpreter too (INTERPRET, set by launchers): Triton
    3.9's interpreter truncates fp32 -> bf16 where the GPU rounds, a -0.3% bias per cast that compounds over
    a model's layers. Compiled code is unchanged."""
    if INTERPRET and dtype == tl.bfloat16:
        return bf16_rne(x.to(tl.float32), INTERPRET)
    return x.to(dtype)


@triton.jit
def _to_state(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """`_to` for a stored recurrent state: fp16 saturates at +-65504 instead of overflowing to inf (a
    clipped state stays finite for the output lock to judge; an inf one would turn every later token to
    NaN). A NaN stays NaN, as the fp32 and bf16 states keep it."""
    if dtype == tl.float16:
        x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL)
    return _to(x, dtype, INTERPRET)


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,  #
    D, eps,  #
    stride_x, stride_res, stride_out, stride_res_out,  #
    HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr, ONE_PLUS: tl.constexpr,  #
    BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = x.to(tl.float32) + r.to(tl.float32)
    if STORE_RESIDUAL:  # rounded to the residual's dtype (bf16 as in HF, or kept in fp32) before the norm
        x = _to(x, res_out_ptr.dtype.element_ty, INTERPRET)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ONE_PLUS:
        w = w + 1.0
    tl.store(out_ptr + row * stride_out + offs, _to(xf * rstd * w, out_ptr.dtype.element_ty, INTERPRET),
             mask=mask)


@dataclass(frozen=True, slots=True)
class FusedNorm:
    """The residual add + RMSNorm that a MoE down kernel fuses after the block (`moe_experts_add_rmsnorm`):
    its inputs (residual fp32 `[T, D]`, weight `[D]`) and outputs (normed h bf16, new residual fp32, both
    `[T, D]`)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    one_plus: bool
    h: torch.Tensor
    residual_out: torch.Tensor


def fused_norm_args(
    norm: FusedNorm | None, out: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], float, dict[str, bool | int]]:
    """A MoE down kernel's `store_token_tile` arguments for `norm` (or none, with `out` [T, D] standing in
    for its tensors): (residual, weight, h, residual_out), eps, and the NORM / ONE_PLUS / BLOCK_D
    constexprs."""
    if norm is None:
        return (out, out, out, out), 0.0, {"NORM": False, "ONE_PLUS": False, "BLOCK_D": 16}
    block_d = _row_configs(out.shape[1])["BLOCK_D"]
    tensors = (norm.residual, norm.weight, norm.h, norm.residual_out)
    return tensors, norm.eps, {"NORM": True, "ONE_PLUS": norm.one_plus, "BLOCK_D": block_d}


@triton.jit
def add_rmsnorm_row(x_row, res_row, w_ptr, h_row, res_out_row, D, eps,  #
                    ONE_PLUS: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """`_add_rmsnorm_kernel` on one row (a bf16 x, an fp32 residual kept in fp32), the same ops in the same
    order, so the same roundings; x is read from L2 (`.cg`): other programs wrote it."""
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_row + offs, mask=mask, other=0.0, cache_modifier=".cg")
    r = tl.load(res_row + offs, mask=mask, other=0.0)
    x = x.to(tl.float32) + r.to(tl.float32)
    x = _to(x, res_out_row.dtype.element_ty, INTERPRET)
    tl.store(res_out_row + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ONE_PLUS:
        w = w + 1.0
    tl.store(h_row + offs, _to(xf * rstd * w, h_row.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def silu_mul_splits(gate_up, ws_ptr, lock_ptr, entry, pid_s, NUMEL, N, rows, mask_n, gate_scale, up_scale,  #
                    SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """The end of a MoE gate_up program over one of SPLIT ranges of K: its fp32 (gate, up) partial [BN, 2]
    of entry `entry`, rows `rows`; with splits, the last to arrive sums them (`split_total`: workspace
    [SPLIT, NUMEL, 2, N], the tile's counter at lock_ptr) -> (bf16 silu(gate * gate_scale) * up *
    up_scale, is_last: only the last program's values are the tile's)."""
    last = True
    if SPLIT > 1:
        ws = ws_ptr + entry.to(tl.int64) * 2 * N + rows[:, None] + (tl.arange(0, 2) * N)[None, :]
        gate_up, last = split_total(gate_up, ws, lock_ptr, pid_s, NUMEL * 2 * N, mask_n[:, None], SPLIT)
    gate, up = tl.split(gate_up)
    gate = gate * gate_scale
    up = up * up_scale
    return bf16_rne(gate * tl.sigmoid(gate) * up, INTERPRET), last


@triton.jit
def store_token_tile(out, ws_ptr, lock_ptr, out_ptr, t, pid_n, pid_s, T, N, rows, mask_n, stride_om,  #
                     res_ptr, norm_w_ptr, h_ptr, res_out_ptr, stride_res, stride_h, stride_res_out, eps,  #
                     SPLIT: tl.constexpr, NORM: tl.constexpr, ONE_PLUS: tl.constexpr,  #
                     BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """The end of a MoE down program (grid: tokens, row tiles, SPLIT slot ranges): its fp32 partial `out`
    of token t's row tile `rows`; the last split to arrive sums them (`split_total`: workspace [SPLIT, T,
    N], tile counters lock_ptr[T * tiles]) and stores the tile in bf16. NORM: it then counts the tile on
    the token's counter (lock_ptr[T * tiles + t], release: the tile's stores first), and the program that
    completes the row (acquire: it sees every tile) runs `add_rmsnorm_row` on it into h and res_out and
    resets the counter."""
    last = True
    tiles = tl.num_programs(1)
    if SPLIT > 1:
        ws = ws_ptr + t.to(tl.int64) * N + rows
        out, last = split_total(out, ws, lock_ptr + t * tiles + pid_n, pid_s, T * N, mask_n, SPLIT)
    if last:
        out_row = out_ptr + t.to(tl.int64) * stride_om
        tl.store(out_row + rows, bf16_rne(out, INTERPRET), mask=mask_n)
        if NORM:
            tl.debug_barrier()
            count = lock_ptr + T * tiles + t
            if tl.atomic_add(count, 1, sem="acq_rel") == tiles - 1:
                t64 = t.to(tl.int64)
                add_rmsnorm_row(out_row, res_ptr + t64 * stride_res, norm_w_ptr, h_ptr + t64 * stride_h,  #
                                res_out_ptr + t64 * stride_res_out, N, eps, ONE_PLUS, BLOCK_D, INTERPRET)
                tl.atomic_xchg(count, 0)


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr,  #
    I,  #
    stride_x, stride_out,  #
    BLOCK_I: tl.constexpr, INTERPRET: tl.constexpr,  #
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + offs, _to(out, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _sum_slots_kernel(
    y_ptr, out_ptr, T, D, stride_y,  #
    A: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """out[t] = sum over a < A of y[t * A + a] for BLOCK_T tokens and BLOCK_D columns, fp32, rounded once.
    A slot's rows are one [BLOCK_T, BLOCK_D] load each, independent of the others (an unrolled loop), summed
    element by element in registers: no padded slots, no reduction across threads and 8x fewer programs
    than one token a program with its slots padded to a power of two and reduced across warps, which
    moved ~0.5 TB/s on the H200 (9.4 MB in 20.9 us at 256 tokens, session 13; the cause not isolated)."""
    pdl.enter(PDL)
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (toks < T)[:, None] & (offs < D)[None, :]
    rows = y_ptr + (toks * A)[:, None] * stride_y + offs[None, :]
    total = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for a in tl.static_range(A):
        total += tl.load(rows + a * stride_y, mask=mask, other=0.0).to(tl.float32)
    out = _to(total, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + toks[:, None] * D + offs[None, :], out, mask=mask)


@triton.jit
def _embedding_kernel(
    ids_ptr, table_ptr, out_ptr,  #
    D,  #
    stride_table, stride_out,  #
    BLOCK_D: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    tok = tl.load(ids_ptr + row).to(tl.int64)
    vals = tl.load(table_ptr + tok * stride_table + offs, mask=mask)
    tl.store(out_ptr + row * stride_out + offs, vals, mask=mask)


def _check_rows(name: str, t: torch.Tensor, rows: int | None = None, width: int | None = None) -> None:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a 2-D tensor with a contiguous last dim, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows, got {t.shape[0]}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name}: expected width {width}, got {t.shape[1]}")


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    one_plus: bool,
    residual_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm residual step: `r = x + residual; return rmsnorm(r), r` in one pass.

    x, residual `[T, D]`; weight `[D]`. With `residual=None` the sum is x itself (first layer).
    The residual is kept in `residual_dtype` (default: residual's, else x's): fp32 skips the bf16
    rounding of the residual stream at every layer, HF's largest source of drift from fp32. `one_plus`
    selects Qwen3.5's `(1 + w)` scale, else `w`.
    """
    _check_rows("x", x)
    T, D = x.shape
    if residual is not None:
        _check_rows("residual", residual, T, D)
        if residual.dtype not in (x.dtype, torch.float32) or residual_dtype not in (None, residual.dtype):
            raise ValueError(f"residual: expected dtype {residual_dtype or x.dtype} or float32, got "
                             f"{residual.dtype}")
    if weight.shape != (D,):
        raise ValueError(f"weight: expected shape ({D},), got {tuple(weight.shape)}")
    res_dtype = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    out = torch.empty_like(x)
    store = residual is not None or res_dtype != x.dtype
    res_out = torch.empty((T, D), dtype=res_dtype, device=x.device) if store else x
    cfg = _row_configs(D)
    _add_rmsnorm_kernel[(T,)](
        x, residual if residual is not None else x, weight, out, res_out,
        D, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
        HAS_RESIDUAL=residual is not None, STORE_RESIDUAL=store, ONE_PLUS=one_plus, INTERPRET=interpreting(),
        BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"], **pdl.launch(out.device)
    )
    return out, res_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    """RMSNorm over the last dim of `[T, D]` x: `x * rsqrt(mean(x^2) + eps) * (1 + w if one_plus else w)`."""
    return add_rmsnorm(x, None, weight, eps, one_plus)[0]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """`[T, 2I]` -> `[T, I]`: `silu(x[:, :I]) * x[:, I:]` (gate first, then up, as a fused gate_up)."""
    _check_rows("x", x)
    T, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x: expected an even width (gate | up), got {two_i}")
    I = two_i // 2
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(I))
    _silu_mul_kernel[(T, triton.cdiv(I, block))](x, out, I, x.stride(0), out.stride(0), BLOCK_I=block,
                                                   INTERPRET=interpreting())
    return out


def sum_slots(y: torch.Tensor, slots: int) -> torch.Tensor:
    """`y [T * slots, D]` (row t * slots + a: token t's slot a) -> `[T, D]` in y's dtype, each token's rows
    summed in fp32 and rounded once: the MoE's top-k combine where the routing weights are applied already.
    One kernel where `y.view(T, A, D).sum(1, dtype=float32).to(bf16)` took a reduction and a cast (5.4 and
    1.1 us a layer at 32 tokens of Qwen3.6 on the H200, session 10). Not yet timed in this form."""
    _check_rows("y", y)
    n, d = y.shape
    if slots < 1 or n % slots:
        raise ValueError(f"y: expected a multiple of {slots} rows (tokens x slots), got {n}")
    t = n // slots
    out = torch.empty((t, d), dtype=y.dtype, device=y.device)
    block_t, block_d = 8, min(256, triton.next_power_of_2(d))
    _sum_slots_kernel[(triton.cdiv(t, block_t), triton.cdiv(d, block_d))](
        y, out, t, d, y.stride(0), A=slots, BLOCK_T=block_t, BLOCK_D=block_d, INTERPRET=interpreting(),
        **pdl.launch(out.device),
    )
    return out


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Gather rows of `table [V, D]` for `ids [T]` (int32/int64, each in [0, V): the tokenizer's contract)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids: expected a 1-D int32/int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
    _check_rows("table", table)
    D = table.shape[1]
    out = torch.empty((ids.shape[0], D), dtype=table.dtype, device=table.device)
    block = min(1024, triton.next_power_of_2(D))
    _embedding_kernel[(ids.shape[0], triton.cdiv(D, block))](
        ids.contiguous(), table, out, D, table.stride(0), out.stride(0), BLOCK_D=block,
        **pdl.launch(out.device),
    )
    return out


def add_rmsnorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    one_plus: bool,
    residual_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference of `add_rmsnorm`; returns fp32 (normed, residual sum in `add_rmsnorm`'s dtype)."""
    dtype = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    r = (x.float() if residual is None else x.float() + residual.float()).to(dtype)  # reads x, res; writes r
    rf = r.float()
    w = weight.float() + 1.0 if one_plus else weight.float()
    return rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * w, r  # reads r, w; writes out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 reference of `silu_mul`."""
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def embedding_ref(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.long()]
