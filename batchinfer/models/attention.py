"""Full (softmax) attention of both families with a contiguous KV cache, pure PyTorch.

Qwen3-MoE: per-head q/k RMSNorm, full RoPE, GQA. Qwen3.5 adds a sigmoid output gate that q_proj emits
per head (`[h0_q, h0_gate, h1_q, ...]`), zero-centred (1 + w) q/k norms and partial RoPE.
Chunks are right-padded: row b has `n_new[b]` real tokens at positions `cache.lengths[b] + t`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from batchinfer.models.cache import AttentionCache
from batchinfer.models.config import ModelConfig
from batchinfer.models.layers import apply_rope, linear, rms_norm

if TYPE_CHECKING:
    from batchinfer.models.layers import Linear


QUERY_BLOCK = 1024  # queries per score block in prefill


def full_attention(
    h: torch.Tensor,
    w: Mapping[str, Linear],
    config: ModelConfig,
    cache: AttentionCache,
    start: torch.Tensor,
    n_new: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Attention over `h [B, T, D]`; writes the real tokens' k/v into `cache` after `start [B]` tokens."""
    B, T, _ = h.shape
    H, Hkv, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps, one_plus = config.rms_norm_eps, config.one_plus_norm
    q = linear(h, w["q_proj"])
    gate = None
    if config.attn_output_gate:
        q, gate = q.view(B, T, H, 2 * Dh).chunk(2, dim=-1)
        gate = gate.reshape(B, T, H * Dh)
    q = rms_norm(q.reshape(B, T, H, Dh), w["q_norm"], eps, one_plus).transpose(1, 2)  # [B, H, T, Dh]
    k = rms_norm(linear(h, w["k_proj"]).view(B, T, Hkv, Dh), w["k_norm"], eps, one_plus).transpose(1, 2)
    v = linear(h, w["v_proj"]).view(B, T, Hkv, Dh).transpose(1, 2)  # [B, Hkv, T, Dh]
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)

    end = start + n_new
    capacity = cache.k.shape[2]
    longest = int(end.max())
    if longest > capacity:
        raise ValueError(f"KV cache holds {capacity} tokens per row, a row needs {longest}")
    # One indexed write of every real token (row b, token t -> slot start[b] + t), not a loop over rows.
    rows, t = (torch.arange(T, device=h.device) < n_new[:, None]).nonzero(as_tuple=True)
    slots = start[rows] + t
    cache.k[rows, :, slots] = k[rows, :, t]  # [N, Hkv, Dh]
    cache.v[rows, :, slots] = v[rows, :, t]
    keys = cache.k[:, :, :longest].repeat_interleave(H // Hkv, dim=1)  # [B, H, S, Dh]
    values = cache.v[:, :, :longest].repeat_interleave(H // Hkv, dim=1)

    # Queries in blocks: fp32 scores of a whole long prompt at once ([B, H, T, S], 69 GB for 16 rows of
    # 8k tokens) would run a GPU out of memory; a block's are [B, H, QUERY_BLOCK, S].
    o = torch.empty_like(q)  # [B, H, T, Dh]
    j = torch.arange(longest, device=h.device)
    for lo in range(0, T, QUERY_BLOCK):
        hi = min(lo + QUERY_BLOCK, T)
        scores = (q[:, :, lo:hi] @ keys.transpose(-1, -2)) * Dh**-0.5  # [B, H, t, S]
        positions = start[:, None] + torch.arange(lo, hi, device=h.device)  # [B, t]
        visible = (j <= positions[..., None]) & (j < end[:, None, None])  # [B, t, S]
        # finfo.min rather than -inf: padding queries may see nothing and must stay finite.
        scores = scores.float().masked_fill(~visible[:, None], torch.finfo(torch.float32).min)
        o[:, :, lo:hi] = scores.softmax(-1).to(q.dtype) @ values
    o = o.transpose(1, 2).reshape(B, T, H * Dh)
    if gate is not None:
        o = o * gate.sigmoid()
    return linear(o, w["o_proj"])
