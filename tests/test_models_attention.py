"""Full attention of the reference model: query blocks in prefill give the same result as one block."""

from __future__ import annotations

import torch

from batchinfer.checkpoint.loader import model_config_from_hf
from batchinfer.checkpoint.presets import preset_config, random_weights
from batchinfer.models import attention
from batchinfer.models.cache import ModelCache
from batchinfer.models.layers import rope_tables


def _run(monkeypatch, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill 5 tokens per row, then a right-padded chunk of 7 (row 1 has 4 real tokens)."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    cfg = model_config_from_hf(preset_config("tiny-qwen3.5-moe"))
    weights = random_weights(cfg, seed=1, dtype=torch.float32)
    layer = cfg.layer_types.index("full_attention")
    p = f"layers.{layer}.self_attn."
    w = {n[len(p) :]: t for n, t in weights.items() if n.startswith(p)}
    cache = ModelCache.allocate(cfg, 2, 16, torch.float32, "cpu").layers[layer]
    gen = torch.Generator().manual_seed(0)
    outs = []
    start = torch.zeros(2, dtype=torch.int64)
    for T, n_new in ((5, torch.tensor([5, 5])), (7, torch.tensor([7, 4]))):
        h = torch.randn(2, T, cfg.hidden_size, generator=gen)
        positions = start[:, None] + torch.arange(T)
        rope = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta, torch.float32)
        outs.append(attention.full_attention(h, w, cfg, cache, start, n_new, rope))
        start = start + n_new
    return outs[1], cache.k[:, :, :12], cache.v[:, :, :12]


def test_query_blocks_match_one_block(monkeypatch):
    one = _run(monkeypatch, 1024)
    blocked = _run(monkeypatch, 3)  # blocks of 3, 3 and 1 queries, over a cache already holding 5 tokens
    for a, b in zip(one, blocked, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert one[0][1, :4].abs().sum() > 0  # real tokens of the short row produce output
