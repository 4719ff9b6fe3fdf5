"""The MoE experts for many tokens (prefill): experts decoded to bf16 once, then `torch._grouped_mm`.

Past a few thousand (token, expert) entries every expert has rows, and the fused kernels of `moe.py`,
which decode FP4 in registers inside the GEMM loop, spend most of their time decoding (one decode per
weight per 16-row tile). Here each NVFP4 expert is decoded once per call (`dequantize_rows`: one read of
its 4-bit codes, one bf16 write; ~1.6 GB of bf16 a Qwen3.6 layer, freed after the call) and the two
GEMMs run as grouped GEMMs on the tensor cores (CUTLASS on Hopper, through PyTorch). bf16 experts skip
the decode, and so do NVFP4 ones whose decoded copy the engine keeps (`bf16_experts`). Entries are
sorted by expert (stable), so the result does not depend on the arrival order; `silu_mul` makes the
activations and `_combine_kernel` weights each slot's output, rounds it to bf16 and sums a token's slots
in fp32, as the grouped kernels do (one pass each, instead of PyTorch elementwise ops and a scatter,
which took more time than the GEMMs). Graph-safe (no host sync), though only prefill
passes use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchinfer.kernels.moe_tc import dequantize_paired_rows
from batchinfer.kernels.moe_weights import MoEWeights
from batchinfer.kernels.nvfp4_gemm import bf16_rne, dequantize_rows, interpreting
from batchinfer.kernels.small_ops import silu_mul


def dequantize_experts(w: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked experts as bf16 `[E', 2I, D]` and `[E', D, I]` (NVFP4 decoded, or the copy decoded
    once and kept in `w.decoded`; bf16 returned as is)."""
    if not w.nvfp4:
        return w.w13, w.w2
    if w.decoded is not None:
        return w.decoded
    mats = []
    for packed, scale, ts in (
        (w.w13, w.w13_scale, w.w13_tensor_scale),
        (w.w2, w.w2_scale, w.w2_tensor_scale),
    ):
        e, n, kb = packed.shape
        out = torch.empty((e, n, 2 * kb), dtype=torch.bfloat16, device=packed.device)
        rows_per_scale = n // ts[0].numel()  # gate and up matrices (w13) or the whole down matrix (w2)
        if w.paired:  # scales [K/64, E', N, 4]: the experts' rows are one run of rows already
            dequantize_paired_rows(packed.view(e * n, kb), scale.view(scale.shape[0], e * n, 4), ts,
                                   rows_per_scale, out.view(e * n, -1))
        else:
            dequantize_rows(packed.view(e * n, kb), scale.reshape(e * n, -1), ts, rows_per_scale,
                            out.view(e * n, -1))
        mats.append(out)
    return mats[0], mats[1]


@triton.jit
def _combine_kernel(
    y_ptr, pos_ptr, rw_ptr, out_ptr,  #
    A, D,  #
    BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,  #
):
    """out[t] = sum over the token's A slots of bf16(route_w * y[row of the slot]), in fp32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for a in range(A):
        row = tl.load(pos_ptr + t * A + a).to(tl.int64)
        y = tl.load(y_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        acc += bf16_rne(y * tl.load(rw_ptr + t * A + a), INTERPRET).to(tl.float32)
    tl.store(out_ptr + t * D + offs, bf16_rne(acc, INTERPRET), mask=mask)


def moe_experts_grouped_mm(
    h: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w: MoEWeights
) -> torch.Tensor:
    """`h [T, D]` bf16 through the experts `ids [T, A']` (int32) weighted by `route_w` (fp32, `T * A'`
    flattened) -> `[T, D]` bf16."""
    t, a = ids.shape
    d, experts = h.shape[1], w.w13.shape[0]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # entries grouped by expert
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(len(order), device=h.device))
    counts = torch.zeros(experts, dtype=torch.int32, device=h.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    w13, w2 = dequantize_experts(w)
    gate_up = torch._grouped_mm(h.index_select(0, order // a), w13.transpose(1, 2), offs=offs)  # [N, 2I]
    act = silu_mul(gate_up)
    del gate_up
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [N, D], row j = entry order[j]
    del act, w13, w2
    out = torch.empty((t, d), dtype=torch.bfloat16, device=h.device)
    block = min(1024, triton.next_power_of_2(d))
    _combine_kernel[(t, triton.cdiv(d, block))](y, pos, route_w, out, a, d, BLOCK_D=block,
                                                INTERPRET=interpreting())
    return out
