"""Sparse MoE block of both families, pure PyTorch: fp32 softmax router, top-k, optional
renormalisation, a loop over the experts that got tokens, and Qwen3.5's sigmoid-gated shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from batchinfer.models.config import ModelConfig
from batchinfer.models.layers import linear

if TYPE_CHECKING:
    from batchinfer.models.layers import Linear

    Expert = tuple[Linear, Linear, Linear]  # gate_proj, up_proj, down_proj


def expert_mlp(x: torch.Tensor, expert: Expert) -> torch.Tensor:
    """SwiGLU MLP `down(silu(gate(x)) * up(x))`."""
    gate, up, down = expert
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def route(
    x: torch.Tensor, router: Linear, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights `[N, A]` (x's dtype) and expert ids `[N, A]` for tokens `x [N, D]`.

    Softmax in fp32 over all experts, then top-k; the Qwen3.5 router always renormalises the k
    weights to sum to one, Qwen3-MoE only when `norm_topk_prob`.
    """
    logits = linear(x, router)  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


def sparse_moe(
    x: torch.Tensor,
    w: Mapping[str, Linear],
    experts: Sequence[Expert],
    config: ModelConfig,
    shared: Expert | None,
) -> torch.Tensor:
    """MoE output for tokens `x [N, D]`: routed experts plus, when given, the gated shared expert."""
    weights, ids = route(x, w["gate"], config.num_experts_per_tok, config.norm_topk_prob)
    A = ids.shape[1]
    # (token, slot) pairs grouped by expert with one stable sort, in token order within each expert;
    # the counts are the block's one host sync (was a nonzero and a sync per active expert).
    order = ids.flatten().argsort(stable=True)  # [N * A]
    counts = torch.bincount(ids.flatten(), minlength=len(experts)).tolist()
    flat_weights = weights.flatten()
    out = torch.zeros_like(x)
    lo = 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[lo : lo + n]
            token = pairs // A
            out.index_add_(0, token, expert_mlp(x[token], experts[e]) * flat_weights[pairs, None])
        lo += n
    if shared is not None:
        out = out + linear(x, w["shared_expert_gate"]).sigmoid() * expert_mlp(x, shared)
    return out
