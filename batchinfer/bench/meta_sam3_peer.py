"""Meta's SAM 3 (facebookresearch/sam3) as the peer of `bench images`, with our weights loaded into it.

Meta's code is never part of batchinfer: `--peer-path DIR` points at a copy of their repository's
`sam3/` package (DIR/sam3), run as their README does: `build_sam3_image_model` (random init, no
download), then `Sam3Processor.set_image(PIL image)` and `set_text_prompt(prompt)` per image and
prompt, under TF32 and bf16 autocast as their example notebooks set up. DIR/stubs, if present, is
searched *after* the installed packages, for modules their image path imports but never calls
(e.g. `decord`, `pkg_resources`) on machines that lack them.

The same seeded random state dict goes into both models. Parity on a sample of images compares
every query (Meta's processor with its confidence threshold below every score) with ours: Meta's
instances are matched one to one with ours by box IoU (greedy, best pairs first, IoU >= 0.5), then the
matched masks are compared by IoU.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from batchinfer.bench.images import (
    ROW_SCHEMA,
    PairOutputs,
    box_iou,
    mask_iou,
    pair_outputs,
)
from batchinfer.errors import ConfigError
from batchinfer.images import rle
from batchinfer.sam3.model import Sam3Model

MATCH_MIN_BOX_IOU = 0.5
PARITY_MIN_MASK_IOU = 0.95  # mean over matched instances
PARITY_MIN_MATCHED = 0.99  # share of Meta's instances that find a partner in ours
# Buffers Meta's modules compute at construction and also store (RoPE tables); not weights.
COMPUTED_BUFFERS = (".freqs_cis", ".relative_coords")


def match_instances(a: Tensor, b: Tensor, min_iou: float = MATCH_MIN_BOX_IOU) -> list[tuple[int, int]]:
    """Greedy one-to-one matching of boxes a [N, 4] and b [M, 4] (xyxy), best IoU first."""
    if a.numel() == 0 or b.numel() == 0:
        return []
    iou = box_iou(a.float(), b.float()).cpu()
    order = torch.argsort(iou.flatten(), descending=True, stable=True)
    used_a, used_b, pairs = set(), set(), []
    m = iou.shape[1]
    for flat in order.tolist():
        i, j = divmod(flat, m)
        if iou[i, j] < min_iou:
            break
        if i not in used_a and j not in used_b:
            used_a.add(i)
            used_b.add(j)
            pairs.append((i, j))
    return pairs


def parity_report(ours: Sequence[PairOutputs], theirs: Sequence[PairOutputs]) -> dict[str, Any]:
    """Match each pair's instances by box IoU and compare the matched masks and scores."""
    ious, score_diff = [], []
    matched = meta_total = ours_total = 0
    for o, t in zip(ours, theirs, strict=True):
        pairs = match_instances(o.boxes, t.boxes.to(o.boxes.device))
        meta_total += len(t.scores)
        ours_total += len(o.scores)
        matched += len(pairs)
        if pairs:
            oi = torch.tensor([i for i, _ in pairs], device=o.masks.device)
            ti = torch.tensor([j for _, j in pairs], device=t.masks.device)
            ious.append(mask_iou(o.masks[oi], t.masks[ti].to(o.masks.device)).cpu())
            score_diff.append((o.scores[oi].cpu() - t.scores[ti].cpu()).abs())
    iou = torch.cat(ious) if ious else torch.zeros(0, dtype=torch.float64)
    valid = iou[~iou.isnan()]
    sd = torch.cat(score_diff) if score_diff else torch.zeros(0)
    mean_iou = float(valid.mean()) if valid.numel() else 1.0
    share = matched / meta_total if meta_total else 1.0
    return {
        "pairs": len(ours),
        "meta_instances": meta_total,
        "our_instances": ours_total,
        "matched": matched,
        "unmatched_meta": meta_total - matched,
        "unmatched_ours": ours_total - matched,
        "mean_mask_iou": mean_iou,
        "min_mask_iou": float(valid.min()) if valid.numel() else 1.0,
        "score_abs_diff_mean": float(sd.mean()) if sd.numel() else 0.0,
        "score_abs_diff_max": float(sd.max()) if sd.numel() else 0.0,
        "bounds": {
            "mean_mask_iou_min": PARITY_MIN_MASK_IOU,
            "matched_share_min": PARITY_MIN_MATCHED,
            "match_box_iou": MATCH_MIN_BOX_IOU,
        },  # fmt: skip
        "passed": mean_iou >= PARITY_MIN_MASK_IOU and share >= PARITY_MIN_MATCHED,
    }


def import_meta(peer_path: str | Path) -> tuple[Any, Any]:
    """(build_sam3_image_model, Sam3Processor) from DIR/sam3; TF32 flags as they were before the import
    (Meta's model_builder turns TF32 on globally when imported)."""
    root = Path(peer_path).resolve()
    if not (root / "sam3" / "model_builder.py").is_file():
        raise ConfigError(f"--peer-path {peer_path}: no sam3/model_builder.py there (a copy of Meta's repo)")
    sys.path.insert(0, str(root))
    if (root / "stubs").is_dir():
        sys.path.append(str(root / "stubs"))
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        from sam3.model.sam3_image_processor import Sam3Processor
        from sam3.model_builder import build_sam3_image_model
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    return build_sam3_image_model, Sam3Processor


class MetaSam3Peer:
    def __init__(self, peer_path: str | Path, state: dict[str, Tensor], device: torch.device) -> None:
        """`state`: our model's state dict (Meta's names without `detector.`), fp32."""
        if device.type != "cuda":
            raise ConfigError("--peer meta needs a CUDA GPU (Meta's model allocates on cuda when built)")
        build, self._processor_cls = import_meta(peer_path)
        bpe = Path(peer_path).resolve() / "sam3" / "assets" / "bpe_simple_vocab_16e6.txt.gz"
        self.model = build(bpe_path=str(bpe), device="cuda", checkpoint_path=None, load_from_HF=False)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith(COMPUTED_BUFFERS)]
        if missing or unexpected:
            raise ConfigError(
                f"Meta's model does not take our state dict: {len(missing)} missing (e.g. {missing[:3]}), "
                f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})"
            )
        self.model.eval()
        self.device = device

    def describe(self) -> dict[str, str]:
        return {"engine": "meta sam3 (Sam3Processor)", "precision": "fp32 weights, TF32, bf16 autocast"}

    def _processor(self, threshold: float) -> Any:
        return self._processor_cls(self.model, device="cuda", confidence_threshold=threshold)

    def _autocast(self) -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16)

    def _tf32(self) -> None:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    def run(
        self, encoded: Sequence[bytes], prompts: Sequence[Sequence[str]], threshold: float, out_path: Path
    ) -> dict[str, Any]:
        """Their README's loop, one image at a time: decode, set_image, set_text_prompt per prompt,
        masks to COCO RLE, rows to Parquet. Also times their model calls alone."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        self._tf32()
        processor = self._processor(threshold)
        rows: list[dict[str, Any]] = []
        model_s = 0.0
        try:
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            for i, data in enumerate(encoded):
                image = Image.open(io.BytesIO(data)).convert("RGB")
                t1 = time.perf_counter()
                outs = []
                with self._autocast():
                    state = processor.set_image(image)
                    for p in prompts[i]:  # the state dict is updated in place: keep each prompt's tensors
                        out = processor.set_text_prompt(state=state, prompt=p)
                        outs.append((out["masks"], out["boxes"], out["scores"]))
                torch.cuda.synchronize(self.device)
                model_s += time.perf_counter() - t1
                for j, (prompt, out) in enumerate(zip(prompts[i], outs, strict=True)):
                    rows += _meta_rows(i, j, prompt, *out, image.height, image.width)
            pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), out_path)
            wall = time.perf_counter() - t0
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
        n, pairs = len(encoded), sum(len(p) for p in prompts)
        return {
            "images": n,
            "pairs": pairs,
            "instances": sum(1 for r in rows if r.get("instance") is not None),
            "wall_s": wall,
            "images_per_s": n / wall,
            "pairs_per_s": pairs / wall,
            "model_images_per_s": n / model_s,
        }

    def pair_outputs(self, image: np.ndarray, prompts: Sequence[str]) -> list[PairOutputs]:
        """Every query of each prompt, through their processor with a threshold under every score."""
        old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        self._tf32()
        processor = self._processor(-1.0)
        h, w = image.shape[:2]
        scale = torch.tensor([w, h, w, h], dtype=torch.float32, device=self.device)
        result = []
        try:
            with self._autocast():
                state = processor.set_image(Image.fromarray(image))
                for p in prompts:
                    out = processor.set_text_prompt(state=state, prompt=p)
                    boxes = torch.minimum(out["boxes"].float().clamp(min=0), scale)
                    result.append(PairOutputs(out["scores"].float(), boxes, out["masks"][:, 0].bool()))
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
        return result

    def parity(
        self, ours: Sam3Model, images: Sequence[np.ndarray], prompts: Sequence[Sequence[str]],
        indices: Sequence[int],
    ) -> dict[str, Any]:  # fmt: skip
        mine: list[PairOutputs] = []
        theirs: list[PairOutputs] = []
        for i in indices:
            mine += pair_outputs(ours, images[i], prompts[i])
            theirs += self.pair_outputs(images[i], prompts[i])
        return parity_report(mine, theirs) | {"images": list(indices)}


def _meta_rows(
    image: int, j: int, prompt: str, masks: Tensor, boxes: Tensor, scores: Tensor, height: int, width: int
) -> list[dict[str, Any]]:
    """Rows of one (image, prompt) from Meta's processor outputs, as our job writes them."""
    base = {"image": image, "height": height, "width": width, "prompt": prompt, "prompt_index": j}
    score_list = scores.float().cpu().tolist()
    if not score_list:
        return [base]
    mask_np = masks[:, 0].cpu().numpy()
    box_list = boxes.float().cpu().tolist()
    order = np.argsort(-np.asarray(score_list), kind="stable")
    return [
        {
            **base,
            "instance": k,
            "score": score_list[q],
            "box": box_list[q],
            "mask_rle": rle.encode(mask_np[q]),
            "area": int(mask_np[q].sum()),
        }  # fmt: skip
        for k, q in enumerate(order.tolist())
    ]
