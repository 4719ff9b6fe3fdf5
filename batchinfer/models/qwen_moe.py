"""The reference model of both families (`qwen3_moe`, `qwen3_5_moe`), built from a `ModelConfig` and the
canonical weights dict of docs/ARCHITECTURE.md. Math only: no file I/O, no tokenizer, no sampling.

Pre-norm decoder layers: x += mixer(norm(x)); x += moe(norm(x)), the mixer being full attention or,
for Qwen3.5's `linear_attention` layers, Gated DeltaNet. A forward takes a right-padded chunk of new
tokens per row (a whole prompt at prefill, one token at decode) and continues from a `ModelCache`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from batchinfer.checkpoint.layout import weight_specs
from batchinfer.errors import CheckpointError
from batchinfer.models.attention import full_attention
from batchinfer.models.cache import AttentionCache, ModelCache
from batchinfer.models.config import ModelConfig
from batchinfer.models.gdn import gated_deltanet
from batchinfer.models.layers import linear, rms_norm, rope_tables
from batchinfer.models.moe import sparse_moe

if TYPE_CHECKING:
    from batchinfer.models.layers import Linear

_MLP = ("gate_proj", "up_proj", "down_proj")


class QwenMoeModel:
    """Reference forward over canonical weights.

    Dense tensors are cast to `dtype` (default: the embedding's dtype) once; quantized linears
    (`NVFP4Weight`, `FP8Weight`) stay quantized and are dequantized to `dtype` at each use.
    The device is the embedding's device. A missing `lm_head` falls back to `embed_tokens` when the
    config ties them.
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, Linear], dtype: torch.dtype | None = None):
        weights = dict(weights)
        if "lm_head" not in weights and config.tie_word_embeddings and "embed_tokens" in weights:
            weights["lm_head"] = weights["embed_tokens"]
        shapes = {name: spec.shape for name, spec in weight_specs(config).items()}
        missing = [n for n in shapes if n not in weights]
        if missing:
            raise CheckpointError(f"weights: missing {len(missing)} tensors, first {missing[:3]}")
        unexpected = sorted(set(weights) - set(shapes))
        if unexpected:
            raise CheckpointError(
                f"weights: unexpected tensors for {config.model_type}, first {unexpected[:3]}"
            )
        for name, expected in shapes.items():
            found = tuple(weights[name].shape)
            if found != expected:
                raise CheckpointError(
                    f"weights: tensor {name!r} has shape {list(found)}, expected {list(expected)}"
                )
        self.config = config
        self.dtype = dtype or weights["embed_tokens"].dtype
        self.device = weights["embed_tokens"].device
        self.weights: dict[str, Linear] = {
            n: w.to(self.dtype) if isinstance(w, torch.Tensor) and w.is_floating_point() else w
            for n, w in weights.items()
        }
        self._layers: list[dict[str, Linear]] = [{} for _ in range(config.num_hidden_layers)]
        for name, w in self.weights.items():
            if name.startswith("layers."):
                _, i, rest = name.split(".", 2)
                part, _, leaf = rest.partition(".")  # "self_attn.q_proj" -> "q_proj"
                self._layers[int(i)][leaf if part in ("self_attn", "linear_attn", "mlp") else rest] = w
        self._experts = [
            [tuple(lw[f"experts.{e}.{n}"] for n in _MLP) for e in range(config.num_experts)]
            for lw in self._layers
        ]
        self._shared = [
            tuple(lw[f"shared_expert.{n}"] for n in _MLP) if config.shared_expert_intermediate_size else None
            for lw in self._layers
        ]

    def new_cache(self, batch: int, capacity: int) -> ModelCache:
        """An empty cache for `batch` rows of up to `capacity` tokens each."""
        return ModelCache.allocate(self.config, batch, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: ModelCache,
        n_new: torch.Tensor | Sequence[int] | None = None,
        all_logits: bool = True,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run a right-padded chunk `input_ids [B, T]` with `n_new[b]` real tokens per row (default: T).

        Continues each row after the `cache.lengths[b]` tokens already cached and advances the cache.
        Returns logits `[B, T, V]` (padding positions hold garbage), or with `all_logits=False` only each
        row's last real token's logits `[B, V]`, or with `logits_at` (bool `[B, T]`) those of the marked
        positions, packed row by row `[N, V]` (teacher forcing keeps only the rows it checks).
        """
        c = self.config
        B, T = input_ids.shape
        if B != cache.batch_size:
            raise ValueError(f"input_ids has {B} rows, the cache {cache.batch_size}")
        input_ids = input_ids.to(self.device)
        if n_new is None:
            n_new = torch.full((B,), T, dtype=torch.int64, device=self.device)
        n_new = torch.as_tensor(n_new, dtype=torch.int64, device=self.device)
        if not bool(((n_new >= 1) & (n_new <= T)).all()):
            raise ValueError(f"n_new must be in 1..{T} per row, got {n_new.tolist()}")
        start = cache.lengths
        valid = torch.arange(T, device=self.device) < n_new[:, None]  # [B, T]
        real = valid.nonzero(as_tuple=True)  # (row, position) of each real token; the forward's one sync
        positions = start[:, None] + torch.arange(T, device=self.device)
        rope = rope_tables(positions, c.rotary_dim, c.rope_theta, self.dtype)
        eps, one_plus = c.rms_norm_eps, c.one_plus_norm

        x = F.embedding(input_ids, self.weights["embed_tokens"])  # [B, T, D]
        for i, lw in enumerate(self._layers):
            h = rms_norm(x, lw["input_layernorm"], eps, one_plus)
            layer_cache = cache.layers[i]
            if isinstance(layer_cache, AttentionCache):
                h = full_attention(h, lw, c, layer_cache, start, n_new, rope)
            else:
                h = gated_deltanet(h, lw, c, layer_cache, n_new, valid)
            x = x + h
            h = rms_norm(x[real], lw["post_attention_layernorm"], eps, one_plus)  # [N, D] real tokens only
            x[real] = x[real] + sparse_moe(h, lw, self._experts[i], c, self._shared[i])
        cache.lengths = start + n_new
        if logits_at is not None:
            if logits_at.shape != (B, T) or logits_at.dtype != torch.bool:
                raise ValueError(
                    f"logits_at: expected bool [{B}, {T}], got {logits_at.dtype} {tuple(logits_at.shape)}"
                )
            x = x[logits_at.to(self.device)]  # [N, D]
        elif not all_logits:
            x = x[torch.arange(B, device=self.device), n_new - 1]  # [B, D]
        return linear(rms_norm(x, self.weights["norm"], eps, one_plus), self.weights["lm_head"])

    __call__ = forward
