"""The prompt side of SAM 3: the geometry encoder's CLS token and the image-prompt fusion encoder.

Meta appends the geometry encoder's output to the text tokens even for a text-only prompt
(`Sam3Image._encode_prompt`): with no boxes or points, that output is one learned CLS token,
projected, normed and refined by `geometry_layers` layers that cross-attend to the image tokens. The
prompt is therefore `text_context + 1` tokens. The box/point projections of the geometry encoder
are held for the checkpoint layout; this image path runs text prompts only.

The fusion encoder (`TransformerEncoderFusion`) then updates the image tokens: per layer,
self-attention over all image tokens (sine positions on q/k), cross-attention to the prompt, FFN.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.layers import EncoderLayer


class GeometryEncoder(nn.Module):
    """Meta's `SequenceGeometryEncoder` as `_create_geometry_encoder` builds it."""

    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        d, roi = config.d_model, 7
        self.label_embed = nn.Embedding(2, d)
        self.cls_embed = nn.Embedding(1, d)
        self.points_direct_project = nn.Linear(2, d)
        self.points_pool_project = nn.Linear(d, d)
        self.points_pos_enc_project = nn.Linear(d, d)
        self.boxes_direct_project = nn.Linear(4, d)
        self.boxes_pool_project = nn.Conv2d(d, d, roi)
        self.boxes_pos_enc_project = nn.Linear(d + 2, d)
        self.final_proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.img_pre_norm = nn.LayerNorm(d)
        self.encode = nn.ModuleList(
            EncoderLayer(d, config.num_heads, config.ffn_dim, pos_at_self_attn=False, pos_at_cross_keys=True)
            for _ in range(config.geometry_layers)
        )
        self.encode_norm = nn.LayerNorm(d)

    def forward(self, image_tokens: Tensor, image_pos: Tensor) -> Tensor:
        """image_tokens, image_pos [N, HW, d] -> the CLS prompt token [N, 1, d]."""
        n = image_tokens.shape[0]
        x = self.cls_embed.weight[None].expand(n, 1, -1)
        x = self.norm(self.final_proj(x))
        pad = torch.zeros(n, 1, dtype=torch.bool, device=x.device)
        for layer in self.encode:
            x = layer(x, image_tokens, memory_pos=image_pos, x_padding_mask=pad)
        return self.encode_norm(x)


class FusionEncoder(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            EncoderLayer(
                config.d_model,
                config.num_heads,
                config.ffn_dim,
                pos_at_self_attn=True,
                pos_at_cross_keys=False,
            )
            for _ in range(config.encoder_layers)
        )

    def forward(self, image_tokens: Tensor, image_pos: Tensor, prompt: Tensor, prompt_mask: Tensor) -> Tensor:
        """image_tokens, image_pos [N, HW, d]; prompt [N, Lp, d], prompt_mask bool [N, Lp] (True = pad)
        -> fused image tokens [N, HW, d]."""
        x = image_tokens
        for layer in self.layers:
            x = layer(x, prompt, pos=image_pos, memory_padding_mask=prompt_mask)
        return x
