"""The SAM 3 engine (tiny random weights, CPU) through the whole image job path: masks, boxes, presence."""

import re

import numpy as np
import pytest
import torch
from batchinfer.jobs import plan as plans
from batchinfer.jobs import query, worker
from images_fixtures import image_folder

from batchinfer.errors import ConfigError
from batchinfer.images import rle, sources
from batchinfer.images.sam3_engine import load_engine
from batchinfer.sam3.checkpoint import write_random_sam3
from batchinfer.sam3.config import Sam3Config

ENGINE = "batchinfer.images.sam3_engine:load_engine"


def test_sam3_job_on_cpu(tmp_path):
    ckpt = write_random_sam3(tmp_path / "tiny.safetensors", Sam3Config.tiny(), 0)
    _, images = sources.split_inputs([str(image_folder(tmp_path, n=2, corrupt=False))])
    job = tmp_path / "job"
    manifest = sources.write_manifest(job, images, ["red circle", "blue square"])
    params = {"score_threshold": 0.05, "prompts": ["red circle", "blue square"]}
    plan = plans.open_or_create(
        plans.build_plan(job, [str(manifest)], str(ckpt), params, engine=ENGINE, task="image")
    )
    engine = load_engine(str(ckpt), batch_size="2")
    assert engine.describe()["engine"] == "sam3" and engine.describe()["quantization"] == "float32"
    worker.run_shards(plan, [0], engine)
    con = query.connect(job)
    cols = "id, prompt, instance, height, width, score, presence_score, box, mask_rle, area"
    rows = con.execute(f"SELECT {cols} FROM latest ORDER BY row, prompt_index, instance").fetchall()
    assert {(r[0], r[1]) for r in rows} == {
        (i, p) for i in ("img0.png", "sub/img1.jpg") for p in params["prompts"]
    }
    found = [r for r in rows if r[2] is not None]
    assert found, "random tiny weights at threshold 0.05 still find instances"
    for _, _, _, h, w, score, presence, box, counts, area in found:
        assert (h, w) == (64, 96) and 0.05 < score <= presence <= 1
        assert 0 <= box[0] <= box[2] <= w and 0 <= box[1] <= box[3] <= h
        assert rle.decode(counts, h, w).sum() == area
    assert all(r[6] is not None for r in rows)  # presence also on pairs without instances (segment_pairs)
    assert plan.doc["model"]["model_type"] == "safetensors"
    assert np.isfinite([r[5] for r in found]).all()


def test_sam3_engine_needs_a_model():
    with pytest.raises(ConfigError, match="needs --model"):
        load_engine("")


@pytest.mark.parametrize(
    "args, message",
    [
        ({"batch_size": "8x"}, "batch_size='8x': expected a whole number >= 1"),
        ({"batch_size": "0"}, "batch_size='0': expected a whole number >= 1"),
        ({"batch_size": "\u00b2"}, "batch_size='\u00b2': expected a whole number >= 1"),  # isdigit() is True
        ({"device": "gpu"}, "device='gpu': not a device; expected cpu or cuda[:N]"),
    ]
    + ([] if torch.cuda.is_available() else [({"device": "cuda"}, "device='cuda': torch sees no CUDA GPU")]),
)
def test_sam3_engine_args_are_config_errors_before_loading(args, message):
    """A mistyped --engine-arg is the one-line error of every engine, not a traceback from int() or CUDA."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_engine("/nonexistent/sam3.safetensors", **args)


def test_sam3_engine_fp8_vit(tmp_path):
    """`--engine-arg vit=fp8` swaps the ViT's (aligned) linears and says so; other values are refused."""
    from batchinfer.sam3.fp8 import FP8Linear

    ckpt = write_random_sam3(tmp_path / "tiny.safetensors", Sam3Config.tiny(), 0)
    engine = load_engine(str(ckpt), batch_size="2", vit="fp8")
    assert engine.describe()["quantization"] == "float32, ViT linears fp8"
    assert any(isinstance(m, FP8Linear) for m in engine.segmenter.modules())
    engine = load_engine(str(ckpt), batch_size="2", vit="fp8-mlp")
    assert engine.describe()["quantization"] == "float32, ViT MLP linears fp8"
    with pytest.raises(ConfigError, match="vit='int4': expected one of bf16, fp8, fp8-mlp"):
        load_engine(str(ckpt), vit="int4")
