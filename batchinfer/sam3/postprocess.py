"""Image pre-processing and output post-processing of SAM 3, as Meta's `Sam3Processor` does them.

Pre: uint8 [H, W, 3] -> resize to image_size x image_size (bilinear, antialiased, aspect ratio NOT
kept, result rounded to uint8 like torchvision's uint8 resize) -> [0, 1] -> (x - 0.5) / 0.5.

Post, per (image, prompt): score = sigmoid(query logit) * sigmoid(presence logit); instances with
score > threshold; boxes cxcywh in [0, 1] -> xyxy pixels of the original image; masks = bilinear
(align_corners=False) upsampling of the mask logits to H x W, then sigmoid > 0.5. Two choices are
ours, not Meta's: boxes are clamped to the image ([0, W] x [0, H]), and instances come highest score
first (Meta keeps query order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from batchinfer.errors import InputError
from batchinfer.sam3.api import Instance, PairResult
from batchinfer.sam3.decoder import box_cxcywh_to_xyxy


def preprocess_image(image: Tensor, size: int) -> Tensor:
    """uint8 [H, W, 3] -> float32 [3, size, size] in [-1, 1]."""
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise InputError(
            f"image: expected a uint8 tensor [H, W, 3], found {image.dtype} {tuple(image.shape)}"
        )
    x = image.permute(2, 0, 1)[None].float()
    if tuple(x.shape[-2:]) != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        x = x.round().clamp(0, 255)
    return ((x / 255.0 - 0.5) / 0.5)[0]


def select_instances(
    logits: Tensor, presence_logit: Tensor, boxes: Tensor, mask_logits: Tensor, height: int, width: int,
    score_threshold: float,
) -> PairResult:  # fmt: skip
    """One (image, prompt) pair: logits [Q], presence_logit scalar, boxes cxcywh [Q, 4] in [0, 1],
    mask_logits [Q, h, w] -> instances with score > score_threshold, best first, masks at H x W on CPU."""
    presence = torch.sigmoid(presence_logit.float())
    scores = torch.sigmoid(logits.float()) * presence
    keep = torch.nonzero(scores > score_threshold).flatten()
    keep = keep[torch.argsort(scores[keep], descending=True, stable=True)]
    p = float(presence)
    if keep.numel() == 0:
        return PairResult(presence=p, instances=[])
    scale = torch.tensor([width, height, width, height], dtype=torch.float32, device=boxes.device)
    xyxy = box_cxcywh_to_xyxy(boxes[keep].float()) * scale
    xyxy = torch.minimum(xyxy.clamp(min=0), scale)
    masks = F.interpolate(
        mask_logits[keep][:, None].float(), size=(height, width), mode="bilinear", align_corners=False
    )
    masks = (masks.sigmoid() > 0.5)[:, 0].cpu()
    xyxy_list = xyxy.cpu().tolist()
    score_list = scores[keep].cpu().tolist()
    instances = [
        Instance(score=s, presence=p, box_xyxy=tuple(b), mask=m)
        for s, b, m in zip(score_list, xyxy_list, masks, strict=True)
    ]
    return PairResult(presence=p, instances=instances)
