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

from collections.abc import Sequence

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
    pair = (logits[None], presence_logit.reshape(1), boxes[None], mask_logits[None])
    return select_pairs(*pair, [(height, width)], score_threshold)[0]


def select_pairs(
    logits: Tensor, presence_logit: Tensor, boxes: Tensor, mask_logits: Tensor,
    sizes: Sequence[tuple[int, int]], score_threshold: float,
) -> list[PairResult]:  # fmt: skip
    """`select_instances` for N pairs at once (logits [N, Q], presence_logit [N], boxes [N, Q, 4],
    mask_logits [N, Q, h, w], sizes (H, W) a pair). Why: the scores and presences of all N pairs come to
    the host in one copy, so a batch without detections costs one host sync instead of two a pair; only
    pairs with instances upsample and copy masks."""
    if len(sizes) != logits.shape[0]:
        raise ValueError(f"select_pairs: {logits.shape[0]} pairs of logits but {len(sizes)} image sizes")
    presence = torch.sigmoid(presence_logit.float())
    scores = torch.sigmoid(logits.float()) * presence[:, None]
    host = torch.cat([presence[:, None], scores], dim=1).cpu()
    results = []
    for k, (height, width) in enumerate(sizes):
        p, pair_scores = float(host[k, 0]), host[k, 1:]
        keep = torch.nonzero(pair_scores > score_threshold).flatten()
        if keep.numel() == 0:
            results.append(PairResult(presence=p, instances=[]))
            continue
        keep = keep[torch.argsort(pair_scores[keep], descending=True, stable=True)]
        on_device = keep.to(boxes.device)
        scale = torch.tensor([width, height, width, height], dtype=torch.float32, device=boxes.device)
        xyxy = box_cxcywh_to_xyxy(boxes[k, on_device].float()) * scale
        xyxy = torch.minimum(xyxy.clamp(min=0), scale)
        masks = F.interpolate(
            mask_logits[k, on_device][:, None].float(), size=(height, width), mode="bilinear",
            align_corners=False,
        )  # fmt: skip
        masks = (masks.sigmoid() > 0.5)[:, 0].cpu()
        instances = [
            Instance(score=s, presence=p, box_xyxy=tuple(b), mask=m)
            for s, b, m in zip(pair_scores[keep].tolist(), xyxy.cpu().tolist(), masks, strict=True)
        ]
        results.append(PairResult(presence=p, instances=instances))
    return results
