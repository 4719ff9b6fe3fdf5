"""Train the SAM 3 demo model: our SAM 3 image architecture at a few million parameters, on the
synthetic shapes (`shapes_data`), written in Meta's checkpoint key layout (`detector.*`).

    nice -n 10 python -m batchinfer.demo.train_sam3 --out models/demo-sam3-shapes --minutes 30
    python -m batchinfer.demo.train_sam3 --out /tmp/sam3-smoke --minutes 0.5 --eval-images 8

It trains `batchinfer.sam3.model.Sam3Model` itself (the module the image engine runs), fed by the
same pre-processing as inference (`preprocess_image`), with the set loss of `sam3_loss`. Scenes are
drawn fresh every step from the training stream, so nothing repeats. The run has a wall-clock budget
rather than a step count, because the CPU it runs on is shared: the learning rate follows a cosine
over the elapsed fraction of the budget. The checkpoint is safetensors with the `Sam3Config` in its
metadata (float16 tensors, to keep the file small), so `batchinfer segment --model` loads it like a
real SAM 3 checkpoint. `training.json` beside it records the run and the held-out figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from batchinfer.demo.eval_sam3 import evaluate
from batchinfer.demo.sam3_loss import WEIGHTS, PairTargets, set_loss
from batchinfer.demo.shapes_data import KINDS, PROMPTS, TRAIN_SEED, Scene, scene
from batchinfer.sam3.checkpoint import CONFIG_METADATA_KEY
from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.model import Sam3Model
from batchinfer.sam3.postprocess import preprocess_image

log = logging.getLogger("batchinfer.demo.train_sam3")

CANVAS_SIZES = (96, 128, 160, 192)  # scenes are drawn at these sizes and resized like any input image
PROMPTS_PER_IMAGE = 3  # up to two prompts naming something in the image, the rest naming nothing


def demo_config() -> Sam3Config:
    """Every part of SAM 3 (windowed and global ViT blocks with 2-D RoPE, neck, CLIP text encoder,
    geometry and fusion encoders, decoder with presence token, mask head) at a 2-core-CPU size:
    80 px input, 10 x 10 tokens, masks at 40 x 40."""
    return Sam3Config(
        image_size=80, patch_size=8, vit_dim=64, vit_depth=4, vit_heads=4, vit_mlp_dim=128,
        vit_window=5, vit_global_blocks=(1, 3), vit_pretrain_grid=5, d_model=64, text_width=16,
        text_layers=1, text_heads=2, text_mlp_dim=64, text_context=8, text_proj_dim=16, num_heads=4,
        ffn_dim=128, geometry_layers=1, encoder_layers=2, decoder_layers=3, num_queries=10,
        scorer_mlp_dim=128,
    )  # fmt: skip


def _pick_prompts(s: Scene, rng: np.random.Generator) -> list[str]:
    """Up to two prompts with instances, then absent ones; half of the absent ones are "hard" (they
    share the colour or the kind of a shape in the image) when such prompts exist."""
    present = [p for p in PROMPTS if s.targets(p)]
    absent = [p for p in PROMPTS if p not in present]
    words = {w for shape in s.shapes for w in (shape.colour, shape.kind, f"{shape.kind}s")}
    hard = [p for p in absent if words & set(p.split())]
    chosen = list(rng.choice(present, size=min(2, len(present)), replace=False))
    while len(chosen) < PROMPTS_PER_IMAGE:
        pool = [p for p in (hard if hard and rng.random() < 0.5 else absent) if p not in chosen]
        chosen.append(str(rng.choice(pool)))
    return chosen


def _targets(s: Scene, prompt: str, mask_side: int) -> PairTargets:
    masks = s.targets(prompt)
    if not masks:
        return PairTargets(torch.zeros(0, 4), torch.zeros(0, mask_side, mask_side))
    h, w = masks[0].shape
    boxes = []
    for m in masks:
        ys, xs = np.nonzero(m)
        x0, y0, x1, y1 = xs.min() / w, ys.min() / h, (xs.max() + 1) / w, (ys.max() + 1) / h
        boxes.append([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0])
    full = torch.from_numpy(np.stack(masks)).float()[:, None]
    soft = F.interpolate(full, size=(mask_side, mask_side), mode="area")[:, 0]  # pixel fraction per cell
    return PairTargets(torch.tensor(boxes, dtype=torch.float32), soft)


def make_batch(
    step: int, images: int, config: Sam3Config
) -> tuple[torch.Tensor, list[int], list[str], list[PairTargets]]:
    """Training batch `step`: pixels [B, 3, S, S], then per pair its image index, prompt and targets."""
    rng = np.random.default_rng([TRAIN_SEED, step])
    pixels, image_ids, prompts, targets = [], [], [], []
    for j in range(images):
        index = step * images + j
        s = scene(TRAIN_SEED, index, CANVAS_SIZES[index % len(CANVAS_SIZES)])
        pixels.append(preprocess_image(torch.from_numpy(s.image), config.image_size))
        for prompt in _pick_prompts(s, rng):
            image_ids.append(j)
            prompts.append(prompt)
            targets.append(_targets(s, prompt, 4 * config.grid))
    return torch.stack(pixels), image_ids, prompts, targets


def save_checkpoint(model: Sam3Model, path: Path, extra: dict[str, str]) -> None:
    """Meta's key layout (`detector.` + our module names) as float16 safetensors, config in metadata."""
    from safetensors.torch import save_file

    state = {
        f"detector.{k}": v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp), metadata={CONFIG_METADATA_KEY: model.config.to_json(), **extra})
    tmp.replace(path)


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    config = demo_config()
    model = Sam3Model(config).train()
    params = sum(p.numel() for p in model.parameters())
    log.info("model: %d parameters, %s", params, config.to_json())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    tokens = model.tokenizer(list(PROMPTS), config.text_context)
    prompt_index = {p: i for i, p in enumerate(PROMPTS)}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = out_dir / "sam3.safetensors"
    budget = args.minutes * 60.0
    start = last_save = time.monotonic()
    history: list[dict[str, float]] = []
    running: dict[str, float] = {}
    step = 0
    while (elapsed := time.monotonic() - start) < budget:
        frac = elapsed / budget
        warm = min(1.0, frac / args.warmup_fraction)
        lr = (
            args.lr
            * warm
            * (args.final_lr_ratio + (1 - args.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        pixels, image_ids, prompts, targets = make_batch(step, args.images_per_step, config)
        fpn = model.encode_images(pixels)
        text, text_mask = model.backbone.language_backbone(tokens)
        pick = torch.tensor([prompt_index[p] for p in prompts])
        out = model.ground(fpn, torch.tensor(image_ids), text[pick], text_mask[pick])
        loss, parts = set_loss(out, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        for name, value in {"loss": float(loss.detach()), **parts}.items():
            running[name] = running.get(name, 0.0) + value
        if step % args.log_every == 0:
            row = {"step": step, "minutes": round(elapsed / 60, 2), "lr": lr}
            row |= {k: round(v / args.log_every, 4) for k, v in running.items()}
            history.append(row)
            running = {}
            log.info("%s", row)
        if time.monotonic() - last_save > args.save_every_minutes * 60:
            save_checkpoint(model, ckpt, {"steps": str(step)})
            last_save = time.monotonic()
    save_checkpoint(model, ckpt, {"steps": str(step)})
    minutes = (time.monotonic() - start) / 60
    log.info("trained %d steps in %.1f minutes; evaluating the saved checkpoint", step, minutes)
    shipped = Sam3Model.from_checkpoint(ckpt)  # the float16 file, as users load it
    figures = evaluate(shipped, args.eval_images)
    report = {
        "seed": args.seed,
        "parameters": params,
        "config": json.loads(config.to_json()),
        "steps": step,
        "images_per_step": args.images_per_step,
        "prompts_per_image": PROMPTS_PER_IMAGE,
        "canvas_sizes": list(CANVAS_SIZES),
        "train_minutes": round(minutes, 1),
        "threads": args.threads,
        "lr": args.lr,
        "warmup_fraction": args.warmup_fraction,
        "final_lr_ratio": args.final_lr_ratio,
        "weight_decay": args.weight_decay,
        "grad_clip": args.clip,
        "loss_weights": WEIGHTS,
        "prompts": list(PROMPTS),
        "kinds": list(KINDS),
        "heldout": figures,
        "history": history,
    }
    (out_dir / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for sam3.safetensors and training.json")
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock training budget")
    p.add_argument("--images-per-step", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-fraction", type=float, default=0.03)
    p.add_argument("--final-lr-ratio", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared CPU)")
    p.add_argument("--eval-images", type=int, default=200, help="held-out scenes evaluated at the end")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--save-every-minutes", type=float, default=5.0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    report = train(p.parse_args())
    print(json.dumps(report["heldout"], indent=1))


if __name__ == "__main__":
    main()
