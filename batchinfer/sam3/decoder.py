"""SAM 3's DETR-style decoder with the presence token (`sam3/model/decoder.py`, inference path).

`num_queries` learned queries with learned reference boxes (sigmoid -> cxcywh in [0, 1]) and one
presence token run through `decoder_layers` post-norm layers: self-attention over [presence, queries]
(query positions = MLP of a sine embedding of the current boxes; the presence token gets zero
position), cross-attention to the prompt tokens, cross-attention to the fused image tokens with a
box-relative position bias ("log" boxRPB: per-head bias from MLPs of log-scaled x/y distances between
each token's grid coordinate and the box edges), then a ReLU FFN. After each layer the boxes are
refined: sigmoid(bbox_embed(norm(q)) + inverse_sigmoid(box)). Training-only parts (DAC duplicated
queries, dropout) are absent. Meta's presence logits are not clamped in effect (the clamp result is
discarded, decoder.py:590), so we do not clamp either.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.layers import MLP, MultiheadAttention


def inverse_sigmoid(x: Tensor, eps: float = 1e-3) -> Tensor:
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def box_cxcywh_to_xyxy(box: Tensor) -> Tensor:
    cx, cy, w, h = box.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def box_sine_embed(boxes: Tensor, d_model: int) -> Tensor:
    """Meta's `gen_sineembed_for_position`: [..., 4] cxcywh -> [..., 2 * d_model] as (y, x, w, h) blocks."""
    half = d_model // 2
    dim_t = torch.arange(half, dtype=torch.float32, device=boxes.device)
    dim_t = 10000 ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / half)

    def embed(v: Tensor) -> Tensor:
        a = (v * 2 * math.pi)[..., None] / dim_t
        return torch.stack([a[..., 0::2].sin(), a[..., 1::2].cos()], dim=-1).flatten(-2)

    cx, cy, w, h = boxes.float().unbind(-1)
    return torch.cat([embed(cy), embed(cx), embed(w), embed(h)], dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, d: int, num_heads: int, ffn_dim: int) -> None:
        super().__init__()
        self.self_attn = MultiheadAttention(d, num_heads)
        self.norm2 = nn.LayerNorm(d)
        self.ca_text = MultiheadAttention(d, num_heads)
        self.catext_norm = nn.LayerNorm(d)
        self.cross_attn = MultiheadAttention(d, num_heads)
        self.norm1 = nn.LayerNorm(d)
        self.linear1 = nn.Linear(d, ffn_dim)
        self.linear2 = nn.Linear(ffn_dim, d)
        self.norm3 = nn.LayerNorm(d)

    def forward(
        self, x: Tensor, pos: Tensor, prompt: Tensor, prompt_mask: Tensor, memory: Tensor, memory_pos: Tensor,
        rpb: Tensor,
    ) -> Tensor:  # fmt: skip
        """x, pos [N, 1 + Q, d] (presence first); memory, memory_pos [N, HW, d]; rpb [N, H, 1 + Q, HW]."""
        q = x + pos
        x = self.norm2(x + self.self_attn(q, q, x))
        x = self.catext_norm(x + self.ca_text(x + pos, prompt, prompt, key_padding_mask=prompt_mask))
        x = self.norm1(x + self.cross_attn(x + pos, memory + memory_pos, memory, attn_bias=rpb))
        return self.norm3(x + self.linear2(F.relu(self.linear1(x))))


class Decoder(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.layers = nn.ModuleList(
            DecoderLayer(d, config.num_heads, config.ffn_dim) for _ in range(config.decoder_layers)
        )
        self.norm = nn.LayerNorm(d)
        self.bbox_embed = MLP(d, d, 4, 3)
        self.query_embed = nn.Embedding(config.num_queries, d)
        self.reference_points = nn.Embedding(config.num_queries, 4)
        self.boxRPB_embed_x = MLP(2, d, config.num_heads, 2)
        self.boxRPB_embed_y = MLP(2, d, config.num_heads, 2)
        self.presence_token = nn.Embedding(1, d)
        self.presence_token_head = MLP(d, d, 1, 3)
        self.presence_token_out_norm = nn.LayerNorm(d)
        self.ref_point_head = MLP(2 * d, d, d, 2)

    def box_rpb(self, boxes: Tensor, h: int, w: int) -> Tensor:
        """boxes cxcywh [N, Q, 4] (fp32) -> additive bias [N, heads, Q, h*w] (Meta's `_get_rpb_matrix`)."""
        xyxy = box_cxcywh_to_xyxy(boxes)
        coords_h = torch.arange(h, dtype=torch.float32, device=boxes.device) / h
        coords_w = torch.arange(w, dtype=torch.float32, device=boxes.device) / w
        dy = coords_h[None, None, :, None] - xyxy[:, :, None, 1:4:2]  # [N, Q, h, 2] to (y0, y1)
        dx = coords_w[None, None, :, None] - xyxy[:, :, None, 0:3:2]  # [N, Q, w, 2] to (x0, x1)

        def log_scale(v: Tensor) -> Tensor:
            v = v * 8
            return torch.sign(v) * torch.log2(v.abs() + 1.0) / math.log2(8)

        dtype = self.boxRPB_embed_y.layers[0].weight.dtype
        by = self.boxRPB_embed_y(log_scale(dy).to(dtype))  # [N, Q, h, heads]
        bx = self.boxRPB_embed_x(log_scale(dx).to(dtype))  # [N, Q, w, heads]
        bias = by[:, :, :, None, :] + bx[:, :, None, :, :]  # [N, Q, h, w, heads]
        return bias.flatten(2, 3).permute(0, 3, 1, 2).contiguous()

    def forward(
        self,
        memory: Tensor,
        memory_pos: Tensor,
        grid_hw: tuple[int, int],
        prompt: Tensor,
        prompt_mask: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """memory, memory_pos [N, HW, d]; prompt [N, Lp, d] -> (queries [N, Q, d] after the output
        norm, boxes cxcywh in [0, 1] float32 [N, Q, 4], presence logit [N]) of the last layer."""
        n, dtype = memory.shape[0], memory.dtype
        x = self.query_embed.weight[None].expand(n, -1, -1)
        # Boxes stay fp32 in a bf16 model, as they do in Meta's bf16-autocast runs (fp32 parameters).
        boxes = self.reference_points.weight.float().sigmoid()[None].expand(n, -1, -1)
        presence = self.presence_token.weight[None].expand(n, 1, -1)
        for layer in self.layers:
            pos = self.ref_point_head(box_sine_embed(boxes, x.shape[-1]).to(dtype))
            pos = torch.cat([torch.zeros_like(presence), pos], dim=1)
            rpb = self.box_rpb(boxes, *grid_hw)
            rpb = torch.cat([torch.zeros_like(rpb[:, :, :1]), rpb], dim=2)
            out = layer(torch.cat([presence, x], dim=1), pos, prompt, prompt_mask, memory, memory_pos, rpb)
            presence, x = out[:, :1], out[:, 1:]
            boxes = (self.bbox_embed(self.norm(x)).float() + inverse_sigmoid(boxes)).sigmoid()
        presence_logit = self.presence_token_head(self.presence_token_out_norm(presence))[:, 0, 0]
        return self.norm(x), boxes, presence_logit
