"""Per-sequence state of the reference model: KV cache for attention layers, conv + recurrent state for
Gated DeltaNet layers, and how many tokens of each row are already in it.

Rows are independent: `select` drops finished rows so the remaining ones run exactly as before.
This is the simple contiguous cache of the reference engine, not the paged cache of the GPU engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.models.config import ModelConfig


@dataclass(slots=True)
class AttentionCache:
    k: torch.Tensor  # [B, Hkv, S, Dh]
    v: torch.Tensor  # [B, Hkv, S, Dh]


@dataclass(slots=True)
class DeltaNetCache:
    conv: torch.Tensor  # [B, conv_dim, kernel - 1], the last inputs of the causal conv, activation dtype
    state: torch.Tensor  # [B, Hv, Dk, Dv] fp32 recurrent state


class ModelCache:
    """All layers' state for a batch of B rows (`allocate`: room for `capacity` tokens per row)."""

    def __init__(self, layers: list[AttentionCache | DeltaNetCache], lengths: torch.Tensor):
        self.layers = layers
        self.lengths = lengths  # [B] int64: tokens of each row already in the cache

    @classmethod
    def allocate(
        cls, config: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str
    ) -> ModelCache:
        layers: list[AttentionCache | DeltaNetCache] = []
        for kind in config.layer_types:
            if kind == "full_attention":
                shape = (batch, config.num_key_value_heads, capacity, config.head_dim)
                k = torch.zeros(shape, dtype=dtype, device=device)
                layers.append(AttentionCache(k, torch.zeros_like(k)))
            else:
                conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
                    config.linear_num_value_heads * config.linear_value_head_dim
                )
                conv = torch.zeros(
                    batch, conv_dim, config.linear_conv_kernel_dim - 1, dtype=dtype, device=device
                )
                state = torch.zeros(
                    batch,
                    config.linear_num_value_heads,
                    config.linear_key_head_dim,
                    config.linear_value_head_dim,
                    dtype=torch.float32,
                    device=device,
                )
                layers.append(DeltaNetCache(conv, state))
        lengths = torch.zeros(batch, dtype=torch.int64, device=device)
        return cls(layers, lengths)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (int64 indices, in the new order), e.g. to drop finished sequences."""
        rows = rows.to(self.lengths.device)
        for layer in self.layers:
            if isinstance(layer, AttentionCache):
                layer.k, layer.v = layer.k.index_select(0, rows), layer.v.index_select(0, rows)
            else:
                layer.conv, layer.state = layer.conv.index_select(0, rows), layer.state.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)
