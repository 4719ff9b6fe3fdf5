"""The SAM 3 demo model (`models/demo-sam3-shapes`): its held-out mask IoU, the README's image job over
`examples/shapes`, and the parts of its training (scenes, matching, loss, checkpoint layout).

The thresholds are the shipped model's measured figures (models/demo-sam3-shapes/README.md) rounded
down by about one point: everything here is seeded and runs in float32 on the CPU."""

import argparse
import itertools
import json
from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from batchinfer.cli import cli
from batchinfer.demo import train_sam3
from batchinfer.demo.eval_sam3 import evaluate, match_masks
from batchinfer.demo.sam3_loss import PairTargets, hungarian, set_loss
from batchinfer.demo.shapes_data import EXAMPLES_SEED, PROMPTS, scene
from batchinfer.images import rle
from batchinfer.sam3.checkpoint import load_sam3_state_dict
from batchinfer.sam3.model import GroundingOutput, Sam3Model

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "demo-sam3-shapes" / "sam3.safetensors"
EXAMPLES = ROOT / "examples" / "shapes"
HELDOUT_IMAGES = 48
MIN_MASK_IOU = 0.87  # measured 0.8816 (48 scenes; 0.9029 on 500)
MIN_PRECISION = 0.92  # measured 0.9373
MIN_ABSENT_CLEAN = 0.99  # measured 0.9984
MIN_EXAMPLES_IOU = 0.89  # measured 0.9018 (20 true instances)


@pytest.fixture(scope="module")
def model() -> Sam3Model:
    return Sam3Model.from_checkpoint(MODEL)


def test_heldout_mask_iou(model):
    figures = evaluate(model, HELDOUT_IMAGES)
    assert figures["pairs"] == HELDOUT_IMAGES * len(PROMPTS)
    assert figures["mask_iou"] >= MIN_MASK_IOU, figures
    assert figures["precision"] >= MIN_PRECISION, figures
    assert figures["absent_clean"] >= MIN_ABSENT_CLEAN, figures


def test_readme_image_job_on_the_examples(tmp_path):
    out = tmp_path / "out"
    args = ["segment", "-i", str(EXAMPLES / "images.parquet"), "-o", str(out), "--model", str(MODEL)]
    result = CliRunner().invoke(cli, [*args, "--progress", "none"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = duckdb.sql(
        f"SELECT id, prompt, instance, mask_rle, height, width, error FROM '{out}/shards/*/*.parquet'"
    ).fetchall()
    assert all(r[6] is None for r in rows)
    truth_file = EXAMPLES / "truth.parquet"
    truth = {
        (i, p): n for i, p, n in duckdb.sql(f"SELECT id, prompt, instances FROM '{truth_file}'").fetchall()
    }
    assert {(r[0], r[1]) for r in rows} == set(truth)
    ious, n_truth = [], 0
    for (image_id, prompt), count in truth.items():
        s = scene(EXAMPLES_SEED, int(image_id.split("-")[1]), 160)
        assert count == len(s.targets(prompt))
        pred = [
            rle.decode(r[3], r[4], r[5])
            for r in rows
            if (r[0], r[1]) == (image_id, prompt) and r[2] is not None
        ]
        ious += match_masks(s.targets(prompt), pred)
        n_truth += count
    assert sum(ious) / n_truth >= MIN_EXAMPLES_IOU


def test_examples_are_the_seeded_scenes():
    ids = [r[0] for r in duckdb.sql(f"SELECT id FROM '{EXAMPLES / 'images.parquet'}' ORDER BY id").fetchall()]
    assert ids == [f"scene-{i:02d}" for i in range(len(ids))] and len(ids) >= 6
    for i, image_id in enumerate(ids):
        pixels = np.asarray(Image.open(EXAMPLES / f"{image_id}.png").convert("RGB"))
        assert (pixels == scene(EXAMPLES_SEED, i, 160).image).all(), image_id


def test_scenes_are_seeded_and_masks_exact():
    a, b = scene(5, 3, 128), scene(5, 3, 128)
    assert (a.image == b.image).all() and len(a.shapes) == len(b.shapes) >= 1
    masks = np.stack([s.mask for s in a.shapes])
    assert masks.sum(0).max() == 1  # no overlaps: every mask is exactly its shape's pixels
    for prompt in PROMPTS:
        for m in a.targets(prompt):
            assert any(m is s.mask for s in a.shapes)
    assert sum(len(a.targets(f"{c} shapes")) for c in ("red", "green", "blue", "yellow")) == len(a.shapes)
    with pytest.raises(ValueError, match="unknown shapes prompt 'purple circle'"):
        a.targets("purple circle")


def test_hungarian_is_the_minimum_assignment():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 5))
        cost = rng.normal(size=(n, int(rng.integers(n, 8))))
        cost = np.round(cost) if trial % 3 == 0 else cost  # ties too
        cols = hungarian(cost)
        best = min(
            sum(cost[i, p[i]] for i in range(n)) for p in itertools.permutations(range(cost.shape[1]), n)
        )
        assert len(set(cols)) == n and sum(cost[i, c] for i, c in enumerate(cols)) == pytest.approx(best)
    with pytest.raises(ValueError, match=r"\[3, 2\] has more rows"):
        hungarian(np.zeros((3, 2)))


def test_set_loss_prefers_the_matching_query():
    q, side = 4, 8
    target = PairTargets(torch.tensor([[0.5, 0.5, 0.2, 0.2]]), torch.ones(1, side, side))
    absent = PairTargets(torch.zeros(0, 4), torch.zeros(0, side, side))

    def out(box_of_query_2):
        boxes = torch.full((2, q, 4), 0.1)
        boxes[0, 2] = torch.tensor(box_of_query_2)
        return GroundingOutput(torch.zeros(2, q), torch.zeros(2), boxes, torch.zeros(2, q, side, side))

    good, parts = set_loss(out([0.5, 0.5, 0.2, 0.2]), [target, absent])
    bad, _ = set_loss(out([0.9, 0.9, 0.1, 0.1]), [target, absent])
    assert parts["l1"] == pytest.approx(0.0, abs=1e-6) and parts["giou"] == pytest.approx(0.0, abs=1e-6)
    assert float(good) < float(bad)


def test_training_writes_a_meta_layout_checkpoint(tmp_path):
    args = argparse.Namespace(
        out=str(tmp_path), minutes=0.001, images_per_step=2, lr=1e-3, warmup_fraction=0.03,
        final_lr_ratio=0.05, weight_decay=0.01, clip=1.0, seed=0, threads=1, eval_images=1, log_every=1,
        save_every_minutes=5.0,
    )  # fmt: skip
    report = train_sam3.train(args)
    assert report["steps"] >= 1 and report["heldout"]["images"] == 1
    state, config = load_sam3_state_dict(tmp_path / "sam3.safetensors")
    assert config == train_sam3.demo_config()
    assert json.loads((tmp_path / "training.json").read_text())["steps"] == report["steps"]
