"""SAM 3's output heads: the query scorer and the mask head (`model_misc.DotProductScoring`,
`maskformer_segmentation.UniversalSegmentationHead` + `PixelDecoder`).

Scorer: the prompt tokens go through a residual MLP with an output LayerNorm, are mean-pooled over
non-pad tokens and projected; each query's logit is its projection dotted with that, / sqrt(d),
clamped to +-12.

Mask head: the fused image tokens first cross-attend to the prompt (pre-norm, residual); reshaped to
the g x g map they replace the x1 neck level, and a top-down pixel decoder (nearest upsample + add,
3x3 conv, GroupNorm(8), ReLU) climbs to the x2 and x4 levels. A 1x1 conv gives per-pixel embeddings;
mask logits [Q, 4g, 4g] are the dot products with an MLP of each query. The semantic-segmentation
1x1 conv and the third pixel-decoder conv are in the checkpoint but unused by instance output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.layers import MLP, MultiheadAttention

SCORE_CLAMP = 12.0


class DotProductScoring(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        d = config.d_model
        self.prompt_mlp = MLP(d, config.scorer_mlp_dim, d, 2, residual=True, out_norm=True)
        self.prompt_proj = nn.Linear(d, d)
        self.hs_proj = nn.Linear(d, d)

    def forward(self, queries: Tensor, prompt: Tensor, prompt_mask: Tensor) -> Tensor:
        """queries [N, Q, d], prompt [N, Lp, d], prompt_mask bool [N, Lp] (True = pad) -> logits [N, Q]."""
        p = self.prompt_mlp(prompt)
        valid = (~prompt_mask).to(p.dtype)[..., None]  # [N, Lp, 1]
        pooled = (p * valid).sum(1) / valid.sum(1).clamp(min=1.0)  # [N, d]
        logits = torch.einsum("nqd,nd->nq", self.hs_proj(queries), self.prompt_proj(pooled))
        return (logits / math.sqrt(self.hs_proj.out_features)).clamp(-SCORE_CLAMP, SCORE_CLAMP)


class PixelDecoder(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv_layers = nn.ModuleList(nn.Conv2d(d, d, 3, 1, 1) for _ in range(3))
        self.norms = nn.ModuleList(nn.GroupNorm(8, d) for _ in range(3))

    def forward(self, levels: list[Tensor]) -> Tensor:
        """levels [x4, x2, x1] maps [N, d, *, *] -> [N, d, 4g, 4g]."""
        x = levels[-1]
        for i, feat in enumerate(reversed(levels[:-1])):
            x = feat + F.interpolate(x, size=feat.shape[-2:], mode="nearest")
            x = F.relu(self.norms[i](self.conv_layers[i](x)))
        return x


class MaskPredictor(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mask_embed = MLP(d, d, d, 3)


class SegmentationHead(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        d = config.d_model
        self.pixel_decoder = PixelDecoder(d)
        self.mask_predictor = MaskPredictor(d)
        self.cross_attend_prompt = MultiheadAttention(d, config.num_heads)
        self.cross_attn_norm = nn.LayerNorm(d)
        self.semantic_seg_head = nn.Conv2d(d, 1, 1)
        self.instance_seg_head = nn.Conv2d(d, d, 1)

    def forward(
        self, fpn: list[Tensor], fused: Tensor, queries: Tensor, prompt: Tensor, prompt_mask: Tensor
    ) -> Tensor:
        """fpn [x4, x2] neck maps [N, d, *, *] of each pair's image; fused image tokens [N, g*g, d];
        queries [N, Q, d] -> mask logits [N, Q, 4g, 4g]."""
        n, hw, d = fused.shape
        g = math.isqrt(hw)
        h = self.cross_attn_norm(fused)
        fused = fused + self.cross_attend_prompt(h, prompt, prompt, key_padding_mask=prompt_mask)
        x1 = fused.transpose(1, 2).reshape(n, d, g, g)
        pixels = self.instance_seg_head(self.pixel_decoder([*fpn, x1]))  # [N, d, 4g, 4g]
        return torch.einsum("nqc,nchw->nqhw", self.mask_predictor.mask_embed(queries), pixels)
