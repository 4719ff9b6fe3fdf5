"""The stacked expert weights of one MoE layer, as the fused MoE kernels (`moe.py`) and the grouped-GEMM
path (`moe_grouped_mm.py`) read them; layouts in `moe.py`'s docstring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from batchinfer.kernels.nvfp4 import NVFP4Weight

Linear = NVFP4Weight | torch.Tensor


@dataclass(slots=True)
class MoEWeights:
    """One layer's experts stacked for the fused kernels; see the module docstring for layouts."""

    router_rows: torch.Tensor  # bf16 [E' rounded up to ROW_ALIGN, D]: `router`, then zero rows
    w13: torch.Tensor  # NVFP4 uint8 [E', 2I, D/2] or bf16 [E', 2I, D]
    w2: torch.Tensor  # NVFP4 uint8 [E', D, I/2] or bf16 [E', D, I]
    w13_scale: torch.Tensor | None  # uint8 e4m3 bits [E', 2I, D/16] (paired: [D/64, E', 2I, 4])
    w2_scale: torch.Tensor | None  # uint8 e4m3 bits [E', D, I/16] (paired: [ceil(I/64), E', D, 4])
    w13_tensor_scale: torch.Tensor | None  # fp32 [E', 2]
    w2_tensor_scale: torch.Tensor | None  # fp32 [E']
    num_experts: int  # routed experts E
    has_shared: bool
    paired: bool = False  # NVFP4 codes in `moe_tc`'s paired layout (`moe_tc.pair_moe_weights`)
    # The NVFP4 experts decoded to bf16 `[E', 2I, D]`, `[E', D, I]` once and kept, so prefill's grouped
    # GEMMs skip their per-call decode (`KernelModel(bf16_experts=True)`: memory for speed). None: decoded
    # in each call.
    decoded: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def router(self) -> torch.Tensor:
        """bf16 `[E (+1 shared gate row), D]`."""
        return self.router_rows[: self.num_experts + self.has_shared]

    @property
    def nvfp4(self) -> bool:
        return self.w13_scale is not None

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]


ROW_ALIGN = 8  # bf16 rows: a router GEMM of a multiple of 8 columns gets cuBLAS's aligned kernels


def _router_rows(rows: torch.Tensor) -> torch.Tensor:
    """`rows` in bf16, then zero rows up to a multiple of ROW_ALIGN."""
    e, d = rows.shape
    buf = torch.zeros((-(-e // ROW_ALIGN) * ROW_ALIGN, d), dtype=torch.bfloat16, device=rows.device)
    buf[:e] = rows
    return buf


def stack_moe_weights(
    router: torch.Tensor,
    experts: Sequence[tuple[Linear, Linear, Linear]],
    shared: tuple[Linear, Linear, Linear] | None = None,
    shared_gate: torch.Tensor | None = None,
) -> MoEWeights:
    """Stack per-expert (gate_proj, up_proj, down_proj) weights (all NVFP4 or all bf16) at load time."""
    mats = [*experts, *([shared] if shared is not None else [])]
    if (shared is None) != (shared_gate is None):
        raise ValueError("shared expert and shared_expert_gate must be given together")
    if len(experts) != router.shape[0]:
        raise ValueError(
            f"router: expected [{len(experts)}, D] for {len(experts)} experts, got {list(router.shape)}"
        )
    shapes = {(g.shape, u.shape, d.shape) for g, u, d in mats}
    if len(shapes) != 1:
        raise ValueError(
            f"experts (and the shared expert) must share one shape to be stacked, got {sorted(shapes)}"
        )
    quant = isinstance(mats[0][0], NVFP4Weight)
    if any(isinstance(w, NVFP4Weight) != quant for m in mats for w in m):
        raise ValueError("experts mix NVFP4 and dense weights; expected one format for all")
    rows = torch.cat([router, shared_gate.reshape(1, -1)]) if shared_gate is not None else router
    if not quant:
        w13 = torch.stack([torch.cat([g, u]) for g, u, _ in mats]).to(torch.bfloat16).contiguous()
        w2 = torch.stack([d for _, _, d in mats]).to(torch.bfloat16).contiguous()
        return MoEWeights(
            _router_rows(rows),
            w13,
            w2,
            None,
            None,
            None,
            None,
            len(experts),
            shared is not None,
        )
    return MoEWeights(
        router_rows=_router_rows(rows),
        w13=torch.stack([torch.cat([g.packed, u.packed]) for g, u, _ in mats]),
        w2=torch.stack([d.packed for _, _, d in mats]),
        w13_scale=torch.stack([torch.cat([g.block_scale, u.block_scale]) for g, u, _ in mats]).view(
            torch.uint8
        ),
        w2_scale=torch.stack([d.block_scale for _, _, d in mats]).view(torch.uint8),
        w13_tensor_scale=torch.stack([torch.stack([g.tensor_scale, u.tensor_scale]) for g, u, _ in mats]),
        w2_tensor_scale=torch.stack([d.tensor_scale for _, _, d in mats]),
        num_experts=len(experts),
        has_shared=shared is not None,
    )
