"""SAM 3's text encoder (`sam3/model/text_encoder_ve.py`): a causal CLIP-style transformer.

Token + learned position embeddings, pre-norm residual blocks (fused-qkv attention with a causal
mask, GELU MLP), `ln_final`, then `resizer` projects every token state to d_model. All
`text_context` token states are used; pad id 0 marks padding. `text_projection` is kept only because
the checkpoint carries it (Meta computes and discards its output).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.layers import MultiheadAttention

PAD_ID = 0


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.attn = MultiheadAttention(width, heads)
        self.ln_1 = nn.LayerNorm(width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("c_fc", nn.Linear(width, mlp_dim)),
                    ("gelu", nn.GELU()),
                    ("c_proj", nn.Linear(mlp_dim, width)),
                ]
            )
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, is_causal=True)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList(
            ResidualAttentionBlock(config.text_width, config.text_heads, config.text_mlp_dim)
            for _ in range(config.text_layers)
        )


class TextTransformer(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.text_width)
        self.positional_embedding = nn.Parameter(torch.randn(config.text_context, config.text_width) * 0.01)
        self.transformer = Transformer(config)
        self.ln_final = nn.LayerNorm(config.text_width)
        self.text_projection = nn.Parameter(
            torch.randn(config.text_width, config.text_proj_dim) * config.text_width**-0.5
        )

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens int64 [P, T] -> token states [P, T, text_width]."""
        x = self.token_embedding(tokens) + self.positional_embedding[: tokens.shape[1]]
        for block in self.transformer.resblocks:
            x = block(x)
        return self.ln_final(x)


class TextEncoder(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        self.encoder = TextTransformer(config)
        self.resizer = nn.Linear(config.text_width, config.d_model)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """tokens int64 [P, T] -> (features [P, T, d_model], padding mask bool [P, T], True = pad)."""
        return self.resizer(self.encoder(tokens)), tokens == PAD_ID
