"""The training loss of the SAM 3 demo model: a simplified version of Meta's DETR-style set loss.

Per (image, prompt) pair the `num_queries` predictions are matched one-to-one to the prompt's ground
truth instances (Hungarian matching on 2 x class cost + 5 x box L1 + 2 x (-GIoU), DETR's weights);
matched queries learn their box (L1 + GIoU) and mask (BCE + dice, at the mask head's 4g x 4g
resolution against area-averaged ground truth), every query of a pair whose concept is present
learns whether it was matched (BCE on its logit), and the presence token learns whether the concept
is in the image at all (BCE). As in Meta's recipe, query classification is not supervised on pairs
whose concept is absent: there the presence score alone has to say no. Simplifications against
Meta's loss: plain BCE instead of its focal classification loss (ten queries, and calibrated scores
for the 0.5 threshold), last decoder layer only (no auxiliary per-layer losses), no one-to-many
(DAC) queries, no semantic-segmentation loss. scipy is not a dependency, so the matching is a small
Hungarian algorithm of our own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from batchinfer.sam3.decoder import box_cxcywh_to_xyxy
from batchinfer.sam3.model import GroundingOutput

COST_CLASS, COST_L1, COST_GIOU = 2.0, 5.0, 2.0
WEIGHTS = {"class": 2.0, "presence": 2.0, "l1": 5.0, "giou": 2.0, "mask_bce": 5.0, "dice": 5.0}


def hungarian(cost: np.ndarray) -> list[int]:
    """Minimum-cost assignment of every row of cost [n, m] (n <= m) to a distinct column: returns the
    column of each row. The O(n^2 m) potentials method (Kuhn-Munkres with Jonker-Volgenant updates)."""
    n, m = cost.shape
    if n > m:
        raise ValueError(f"hungarian: cost matrix [{n}, {m}] has more rows than columns")
    u, v = np.zeros(n + 1), np.zeros(m + 1)
    owner = np.zeros(m + 1, dtype=np.int64)  # owner[j] = 1-based row assigned to column j, 0 = none
    way = np.zeros(m + 1, dtype=np.int64)
    for i in range(1, n + 1):
        owner[0], j0 = i, 0
        minv = np.full(m + 1, np.inf)
        used = np.zeros(m + 1, dtype=bool)
        while owner[j0] != 0:
            used[j0] = True
            i0 = owner[j0]
            free = ~used[1:]
            cur = cost[i0 - 1] - u[i0] - v[1:]
            better = free & (cur < minv[1:])
            minv[1:][better] = cur[better]
            way[1:][better] = j0
            j1 = 1 + int(np.argmin(np.where(free, minv[1:], np.inf)))
            delta = minv[j1]
            u[owner[used]] += delta
            v[used] -= delta
            minv[~used] -= delta
            j0 = j1
        while j0:
            j1 = way[j0]
            owner[j0] = owner[j1]
            j0 = j1
    cols = [0] * n
    for j in range(1, m + 1):
        if owner[j]:
            cols[owner[j] - 1] = j - 1
    return cols


def generalized_box_iou(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Pairwise (IoU, GIoU) of xyxy boxes a [A, 4] and b [B, 4] -> two [A, B] tensors."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    lt, rb = torch.max(a[:, None, :2], b[None, :, :2]), torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area_a[:, None] + area_b[None] - inter
    iou = inter / union.clamp(min=1e-6)
    hull = (torch.max(a[:, None, 2:], b[None, :, 2:]) - torch.min(a[:, None, :2], b[None, :, :2])).clamp(
        min=0
    )
    hull_area = hull.prod(-1)
    return iou, iou - (hull_area - union) / hull_area.clamp(min=1e-6)


@dataclass(slots=True)
class PairTargets:
    """Ground truth of one (image, prompt) pair: boxes cxcywh [T, 4] in [0, 1], soft masks [T, h, w]
    at the mask head's resolution (T = 0 when the concept is absent)."""

    boxes: Tensor
    masks: Tensor


def match(out: GroundingOutput, targets: list[PairTargets]) -> list[tuple[list[int], list[int]]]:
    """Per pair: (matched query indices, target indices), from the DETR matching cost."""
    probs = out.logits.detach().float().sigmoid()
    pred_xyxy = box_cxcywh_to_xyxy(out.boxes.detach().float())
    found = []
    for k, t in enumerate(targets):
        if len(t.boxes) == 0:
            found.append(([], []))
            continue
        l1 = torch.cdist(out.boxes[k].detach().float(), t.boxes, p=1)  # [Q, T]
        _, giou = generalized_box_iou(pred_xyxy[k], box_cxcywh_to_xyxy(t.boxes))
        cost = COST_L1 * l1 - COST_GIOU * giou - COST_CLASS * probs[k][:, None]
        queries = hungarian(cost.T.numpy())  # each target picks a distinct query
        found.append((queries, list(range(len(t.boxes)))))
    return found


def dice_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Per mask 1 - soft dice, logits and target [T, h, w] -> [T]."""
    p = logits.sigmoid().flatten(1)
    t = target.flatten(1)
    return 1 - (2 * (p * t).sum(1) + 1) / (p.sum(1) + t.sum(1) + 1)


def set_loss(out: GroundingOutput, targets: list[PairTargets]) -> tuple[Tensor, dict[str, float]]:
    """The weighted total loss of N pairs and its parts (floats, for the training log)."""
    matches = match(out, targets)
    device = out.logits.device
    present = torch.tensor([len(t.boxes) > 0 for t in targets], device=device)
    num_targets = max(1, sum(len(t.boxes) for t in targets))
    parts = {"presence": F.binary_cross_entropy_with_logits(out.presence_logit.float(), present.float())}
    labels = torch.zeros_like(out.logits, dtype=torch.float32)
    pair_idx, query_idx, target_boxes, target_masks = [], [], [], []
    for k, ((queries, tgt), t) in enumerate(zip(matches, targets, strict=True)):
        labels[k, queries] = 1.0
        pair_idx += [k] * len(queries)
        query_idx += queries
        target_boxes.append(t.boxes[tgt])
        target_masks.append(t.masks[tgt])
    cls = F.binary_cross_entropy_with_logits(out.logits.float(), labels, reduction="none")
    parts["class"] = cls[present].sum() / num_targets
    if query_idx:
        boxes = out.boxes[pair_idx, query_idx].float()
        gt_boxes = torch.cat(target_boxes)
        parts["l1"] = F.l1_loss(boxes, gt_boxes, reduction="sum") / num_targets
        _, giou = generalized_box_iou(box_cxcywh_to_xyxy(boxes), box_cxcywh_to_xyxy(gt_boxes))
        parts["giou"] = (1 - giou.diagonal()).sum() / num_targets
        masks = out.mask_logits[pair_idx, query_idx].float()
        gt_masks = torch.cat(target_masks)
        bce = F.binary_cross_entropy_with_logits(masks, gt_masks, reduction="none")
        parts["mask_bce"] = bce.flatten(1).mean(1).sum() / num_targets
        parts["dice"] = dice_loss(masks, gt_masks).sum() / num_targets
    total = sum(WEIGHTS[name] * value for name, value in parts.items())
    return total, {name: float(value.detach()) for name, value in parts.items()}
