"""Mask IoU of a SAM 3 checkpoint against the synthetic ground truth of held-out shapes scenes.

    python -m batchinfer.demo.eval_sam3 --model models/demo-sam3-shapes/sam3.safetensors --images 200

Every held-out scene is segmented for every prompt of `shapes_data.PROMPTS` (most of them name
nothing in the scene) through `Sam3Model.segment_pairs`, the engine's own path: resize, model,
masks upsampled to the scene's size, score threshold. Per (image, prompt) pair, predicted and true
masks are matched one-to-one by maximum total IoU. Figures:
`mask_iou`: mean over true instances of the IoU with the matched prediction (0 when missed), the
headline; `matched_iou`: mean IoU of matches with IoU >= 0.5; `recall` / `precision`: true instances /
predictions in a match with IoU >= 0.5; `absent_clean`: share of pairs naming nothing in the scene
that got no prediction.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch

from batchinfer.demo.sam3_loss import hungarian
from batchinfer.demo.shapes_data import HELDOUT_SEED, PROMPTS, scene
from batchinfer.sam3.model import Sam3Model

EVAL_SIZE = 128  # held-out scenes are 128 x 128 (training saw 96 to 192)
IOU_HIT = 0.5


def match_masks(truth: list[np.ndarray], pred: list[np.ndarray]) -> list[float]:
    """IoUs of the one-to-one matching of bool masks that maximises their sum (len = min of the two)."""
    if not truth or not pred:
        return []
    t = np.stack(truth).reshape(len(truth), -1).astype(np.float32)
    p = np.stack(pred).reshape(len(pred), -1).astype(np.float32)
    inter = t @ p.T
    union = t.sum(1)[:, None] + p.sum(1)[None] - inter
    iou = inter / np.maximum(union, 1.0)  # [T, P]
    if len(truth) <= len(pred):
        return [float(iou[i, j]) for i, j in enumerate(hungarian(-iou))]
    return [float(iou[i, j]) for j, i in enumerate(hungarian(-iou.T))]


def evaluate(
    model: Sam3Model, images: int, seed: int = HELDOUT_SEED, size: int = EVAL_SIZE,
    score_threshold: float = 0.5, batch: int = 8,
) -> dict[str, Any]:  # fmt: skip
    """The figures above over held-out scenes 0..images-1 of stream `seed`, every prompt each."""
    model.eval()
    n_truth = n_pred = hits_truth = hits_pred = absent = absent_clean = 0
    iou_sum = hit_iou_sum = 0.0
    for start in range(0, images, batch):
        scenes = [scene(seed, i, size) for i in range(start, min(images, start + batch))]
        results = model.segment_pairs(
            [torch.from_numpy(s.image) for s in scenes], [list(PROMPTS)] * len(scenes), score_threshold,
            pairs_per_batch=64,
        )  # fmt: skip
        for s, per_prompt in zip(scenes, results, strict=True):
            for prompt, result in zip(PROMPTS, per_prompt, strict=True):
                truth = s.targets(prompt)
                pred = [inst.mask.numpy() for inst in result.instances]
                if not truth:
                    absent += 1
                    absent_clean += not pred
                ious = match_masks(truth, pred)
                hits = [v for v in ious if v >= IOU_HIT]
                n_truth += len(truth)
                n_pred += len(pred)
                iou_sum += sum(ious)
                hit_iou_sum += sum(hits)
                hits_truth += len(hits)
                hits_pred += len(hits)
    return {
        "images": images,
        "image_size": size,
        "seed": seed,
        "score_threshold": score_threshold,
        "pairs": images * len(PROMPTS),
        "true_instances": n_truth,
        "predictions": n_pred,
        "mask_iou": round(iou_sum / max(n_truth, 1), 4),
        "matched_iou": round(hit_iou_sum / max(hits_truth, 1), 4),
        "recall": round(hits_truth / max(n_truth, 1), 4),
        "precision": round(hits_pred / max(n_pred, 1), 4),
        "absent_clean": round(absent_clean / max(absent, 1), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="SAM 3 checkpoint (.safetensors or .pt)")
    p.add_argument("--images", type=int, default=200, help="held-out scenes to evaluate")
    p.add_argument("--score-threshold", type=float, default=0.5)
    args = p.parse_args()
    model = Sam3Model.from_checkpoint(args.model)
    print(json.dumps(evaluate(model, args.images, score_threshold=args.score_threshold), indent=1))


if __name__ == "__main__":
    main()
