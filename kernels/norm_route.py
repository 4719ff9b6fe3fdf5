"""One-row decode (T == 1): the post-mixer residual add + RMSNorm, the router GEMV and the MoE routing in one
launch, where the engine makes three (`small_ops.add_rmsnorm`, `moe.router_logits`, `moe.moe_route`).

Layouts: x bf16 `[1, D]`, residual fp32 `[1, D]`, norm weight `[D]`, router bf16 `[E', D]`
(`MoEWeights.router`: E routed rows, then the shared expert's gate row when stacked).
Numerics: those of the three launches it replaces. Every program recomputes the sum and the norm op for op as
`_add_rmsnorm_kernel` does (residual kept in fp32, h rounded once to bf16; program 0 stores both), then dots
its `rows` router rows with the bf16 h in fp32 and rounds each logit to bf16, as cuBLAS's bf16 output does.
Logits go to a small bf16 workspace; the program that arrives last at a counter (`nvfp4_gemm.split_k_locks`,
reset to 0 by that program, so CUDA-graph replays reuse it) reads them all and routes as `_moe_route_kernel`
does (`moe.route_row`, the same code). Bit for bit under the interpreter; compiled, the residual is the same
bits, but the reductions follow this launch's warps (the norm's sum of squares, add_rmsnorm's 4 warps; the
softmax sum, moe_route's 1) and the router dots are summed in another order than cuBLAS's, so an element of
h or a logit can land one bf16 step away, and a routing weight an fp32 rounding away, from the unfused ones.
GPU assumptions: sm_90 or the Triton interpreter; one CUDA stream per device at a time uses the counters.
The grid is cdiv(E', rows) programs (257 at Qwen3.6's 257 rows with the default rows=1), each reading the
whole x, residual and norm weight (from L2 after the first) and its own router rows. H100, session 29: 6.5
us a launch at Qwen3.6's shape against 6.8 for the three launches it replaces; `single` +2.5% (Qwen3.6)
and +2.4% (Qwen3-30B) over the untuned launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl
from batchinfer.kernels.moe import moe_route_ref, route_row
from batchinfer.kernels.moe_weights import MoEWeights
from batchinfer.kernels.nvfp4_gemm import interpreting, split_k_locks
from batchinfer.kernels.small_ops import _to, add_rmsnorm_ref


@dataclass(frozen=True, slots=True)
class NormRouteConfig:
    """Launch configuration: `rows` router rows a program (grid cdiv(E', rows)), `warps` its num_warps."""

    rows: int
    warps: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.rows & (self.rows - 1):
            raise ValueError(f"rows: expected a power of two >= 1, got {self.rows}")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"warps: expected 1, 2, 4 or 8, got {self.warps}")


def _norm_route_config() -> NormRouteConfig:
    """One router row a program on one warp: swept on an H100 (docs/PERF.md session 29: rows 1-16 by 1-8
    warps, both models' routers, CUDA-graph replays) it was the fastest or tied, 6.5 us at Qwen3.6's 257
    rows and 5.4 at Qwen3-30B's 128 against 7.8 and 6.6 for the untuned 2 rows on 2 warps; the last
    program's routing reduces within one warp, with no shared-memory round. The interpreter takes few,
    wide programs (its cost is per program and op)."""
    if interpreting():
        return NormRouteConfig(rows=16, warps=1)
    return NormRouteConfig(rows=1, warps=1)


@triton.jit
def _norm_route_kernel(
    x_ptr, res_ptr, norm_w_ptr, router_ptr, h_ptr, res_out_ptr, logits_ptr, lock_ptr, ids_ptr, route_w_ptr,  #
    D, E, N_ROWS, eps,  #
    stride_router,  #
    ONE_PLUS: tl.constexpr, TOP_K: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr,  #
    SHARED: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """h, residual = add_rmsnorm(x, res) (program 0 stores them); logits[rows] = bf16(router[rows] . h) for
    this program's ROWS of the N_ROWS = E (+ SHARED) rows; the last program to arrive routes them all."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    # `_add_rmsnorm_kernel` with an fp32 residual, op for op, so the results are the same bits
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = x + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ONE_PLUS:
        w = w + 1.0
    h = _to(x * rstd * w, tl.bfloat16, INTERPRET)
    if pid == 0:
        tl.store(res_out_ptr + offs, x, mask=mask)
        tl.store(h_ptr + offs, h, mask=mask)
    # this program's router rows, fp32 dots with the bf16 h, rounded to bf16 as cuBLAS's output
    rows = pid * ROWS + tl.arange(0, ROWS)
    mask_r = rows < N_ROWS
    wr = tl.load(router_ptr + rows[:, None] * stride_router + offs[None, :],
                 mask=mask_r[:, None] & mask[None, :], other=0.0)
    logits = tl.sum(wr.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)  # [ROWS]
    tl.store(logits_ptr + rows, _to(logits, tl.bfloat16, INTERPRET), mask=mask_r)
    # the split-counter pattern of `nvfp4_gemm.store_gemv_split`: publish, count, the last one reads all
    tl.debug_barrier()
    done = tl.atomic_add(lock_ptr, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        route_row(logits_ptr, ids_ptr, route_w_ptr, E, TOP_K, E_PAD, RENORM, SHARED, ".cg")
        tl.atomic_xchg(lock_ptr, 0)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != shape or t.dtype not in dtypes or t.stride(-1) != 1:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: expected {want} {list(shape)} with a contiguous last dim, got {t.dtype} "
                         f"{list(t.shape)} strides {t.stride()}")


def norm_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    one_plus: bool,
    w: MoEWeights,
    top_k: int,
    renormalize: bool,
    config: NormRouteConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode row's `add_rmsnorm` then `moe_route(router_logits(h, w), ...)` in one launch.

    x bf16 `[1, D]` (the mixer's output), residual fp32 `[1, D]`, norm_weight `[D]` (`(1 + w)` with
    `one_plus`). Returns (h bf16 `[1, D]`, the new residual fp32 `[1, D]`, ids int32 `[1, A']`, route_w fp32
    `[1, A']`), A' = top_k (+1: the shared expert E with weight sigmoid(its gate logit)): the results of
    `add_rmsnorm` and of `moe_route` on bf16 logits of the bf16 h, up to reduction order on the GPU (the
    module docstring). `config` overrides the launch (a sweep)."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x: norm_route takes one row (T == 1), got shape {list(x.shape)}")
    d = x.shape[1]
    _check("x", x, (1, d), (torch.bfloat16,))
    _check("residual", residual, (1, d), (torch.float32,))
    _check("norm_weight", norm_weight, (d,), (torch.bfloat16, torch.float16, torch.float32))
    e = w.num_experts
    router = w.router
    _check("router", router, (e + w.has_shared, d), (torch.bfloat16,))
    if top_k & (top_k - 1) or not 0 < top_k <= e:
        raise ValueError(f"top_k: expected a power of two in 1..{e}, got {top_k}")
    cfg = config or _norm_route_config()
    dev = x.device
    h = torch.empty_like(x)
    res_out = torch.empty_like(residual)
    logits = torch.empty((router.shape[0],), dtype=torch.bfloat16, device=dev)  # the workspace
    ids = torch.empty((1, top_k + w.has_shared), dtype=torch.int32, device=dev)
    route_w = torch.empty((1, top_k + w.has_shared), dtype=torch.float32, device=dev)
    _norm_route_kernel[(triton.cdiv(router.shape[0], cfg.rows),)](
        x, residual, norm_weight, router, h, res_out, logits, split_k_locks(dev, 1), ids, route_w,  #
        d, e, router.shape[0], eps,  #
        router.stride(0),  #
        ONE_PLUS=one_plus, TOP_K=top_k, E_PAD=triton.next_power_of_2(e), RENORM=renormalize,  #
        SHARED=w.has_shared, ROWS=cfg.rows, BLOCK_D=triton.next_power_of_2(d), INTERPRET=interpreting(),  #
        num_warps=cfg.warps, **pdl.launch(dev),  #
    )
    return h, res_out, ids, route_w


def norm_route_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    one_plus: bool,
    w: MoEWeights,
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 reference of `norm_route`: (h fp32, residual fp32, ids, route_w); the logits are dots with h
    rounded to bf16, rounded to bf16 themselves, as the kernel stores them."""
    h, r = add_rmsnorm_ref(x, residual, norm_weight, eps, one_plus)  # reads x, residual; writes h, r
    logits = (h.bfloat16().float() @ w.router.float().t()).bfloat16()  # reads h, router; writes [1, E']
    ids, route_w = moe_route_ref(logits, w.num_experts, top_k, renormalize, w.has_shared)
    return h, r, ids, route_w
