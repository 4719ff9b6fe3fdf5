"""Building blocks shared by the SAM 3 modules, with Meta's parameter names.

`MultiheadAttention` stores its weights like `torch.nn.MultiheadAttention` (`in_proj_weight`,
`in_proj_bias`, `out_proj`), which is how every attention outside the ViT sits in `sam3.pt`, but runs
batch-first through `scaled_dot_product_attention` and takes an additive per-head bias.
`MLP` is Meta's `model_misc.MLP` (ReLU between layers, optional residual and output norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MultiheadAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = nn.Linear(dim, dim)
        nn.init.xavier_uniform_(self.in_proj_weight)  # torch.nn.MultiheadAttention's init
        nn.init.zeros_(self.in_proj_bias)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_bias: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """query [B, Lq, D], key/value [B, Lk, D]; key_padding_mask bool [B, Lk], True = ignore;
        attn_bias float [B, H, Lq, Lk] added to the logits. Returns [B, Lq, D]."""
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q = self._heads(F.linear(query, w_q, b_q))
        k = self._heads(F.linear(key, w_k, b_k))
        v = self._heads(F.linear(value, w_v, b_v))
        mask = attn_bias
        if key_padding_mask is not None:
            pad = torch.zeros(key_padding_mask.shape, dtype=q.dtype, device=q.device)
            pad = pad.masked_fill(key_padding_mask, float("-inf"))[:, None, None, :]  # [B, 1, 1, Lk]
            mask = pad if mask is None else mask.to(q.dtype) + pad
        elif mask is not None:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        return self.out_proj(out.transpose(1, 2).flatten(2))

    def _heads(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        return x.view(b, n, self.num_heads, d // self.num_heads).transpose(1, 2)  # [B, H, L, Dh]


class MLP(nn.Module):
    def __init__(
        self, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int, residual: bool = False,
        out_norm: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.residual = residual
        self.out_norm = nn.LayerNorm(out_dim) if out_norm else None

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < len(self.layers) - 1:
                h = F.relu(h)
        if self.residual:
            h = h + x
        return self.out_norm(h) if self.out_norm is not None else h


class EncoderLayer(nn.Module):
    """Meta's pre-norm `TransformerEncoderLayer`: self-attention, cross-attention, ReLU FFN.

    Used by the fusion encoder (positions added to self-attention q/k, cross-attention to the prompt)
    and by the geometry encoder (no positions in self-attention, positions added to the image keys).
    """

    def __init__(
        self, dim: int, num_heads: int, ffn_dim: int, pos_at_self_attn: bool, pos_at_cross_keys: bool
    ):
        super().__init__()
        self.self_attn = MultiheadAttention(dim, num_heads)
        self.cross_attn_image = MultiheadAttention(dim, num_heads)
        self.linear1 = nn.Linear(dim, ffn_dim)
        self.linear2 = nn.Linear(ffn_dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.pos_at_self_attn = pos_at_self_attn
        self.pos_at_cross_keys = pos_at_cross_keys

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        pos: Tensor | None = None,
        memory_pos: Tensor | None = None,
        x_padding_mask: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """x [B, L, D] with positions `pos`; memory [B, M, D] with positions `memory_pos`."""
        h = self.norm1(x)
        qk = h + pos if self.pos_at_self_attn else h
        x = x + self.self_attn(qk, qk, h, key_padding_mask=x_padding_mask)
        h = self.norm2(x)
        keys = memory + memory_pos if self.pos_at_cross_keys else memory
        x = x + self.cross_attn_image(h, keys, memory, key_padding_mask=memory_padding_mask)
        return x + self.linear2(F.relu(self.linear1(self.norm3(x))))
