"""The MoE experts for many tokens (prefill): experts decoded to bf16 once, then `torch._grouped_mm`.

Past a few thousand (token, expert) entries every expert has rows, and the fused kernels of `moe.py`,
which decode FP4 in registers inside the GEMM loop, spend most of their time decoding (one decode per
weight per 16-row tile). Here each NVFP4 expert is decoded once per call (`dequantize_rows`: one read of
its 4-bit codes, one bf16 write; ~1.6 GB of bf16 a Qwen3.6 layer, freed after the call) and the two GEMMs
run as grouped GEMMs on the tensor cores (CUTLASS on Hopper, through PyTorch). bf16 experts skip the
decode. Entries are sorted by expert (stable), so the result does not depend on the arrival order, and
each slot's weighted output is rounded to bf16 before the fp32 sum over a token's slots, as in the
grouped kernels. Graph-safe (no host sync), though only prefill passes use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from batchinfer.kernels.moe_weights import MoEWeights
from batchinfer.kernels.nvfp4_gemm import dequantize_rows


def dequantize_experts(w: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked experts as bf16 `[E', 2I, D]` and `[E', D, I]` (NVFP4 decoded; bf16 returned as is)."""
    if not w.nvfp4:
        return w.w13, w.w2
    mats = []
    for packed, scale, ts in (
        (w.w13, w.w13_scale, w.w13_tensor_scale),
        (w.w2, w.w2_scale, w.w2_tensor_scale),
    ):
        e, n, kb = packed.shape
        out = torch.empty((e, n, 2 * kb), dtype=torch.bfloat16, device=packed.device)
        rows_per_scale = n // ts[0].numel()  # gate and up matrices (w13) or the whole down matrix (w2)
        dequantize_rows(
            packed.view(e * n, kb), scale.reshape(e * n, -1), ts, rows_per_scale, out.view(e * n, -1)
        )
        mats.append(out)
    return mats[0], mats[1]


def moe_experts_grouped_mm(
    h: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w: MoEWeights
) -> torch.Tensor:
    """`h [T, D]` bf16 through the experts `ids [T, A']` (int32) weighted by `route_w` (fp32, `T * A'`
    flattened) -> `[T, D]` bf16."""
    t, a = ids.shape
    experts, i = w.w13.shape[0], w.intermediate
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=h.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    w13, w2 = dequantize_experts(w)
    gate_up = torch._grouped_mm(h.index_select(0, order // a), w13.transpose(1, 2), offs=offs)  # [N, 2I]
    act = (F.silu(gate_up[:, :i].float()) * gate_up[:, i:].float()).to(torch.bfloat16)
    del gate_up
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [N, D]
    del act, w13, w2
    out = torch.empty_like(y)
    out[order] = (y.float() * route_w[order, None]).to(torch.bfloat16)
    return out.view(t, a, -1).sum(dim=1, dtype=torch.float32).to(torch.bfloat16)
