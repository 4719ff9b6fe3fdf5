"""SegmenterEngine: SAM 3's segment() (torch tensors in, per image and prompt instances out) as an
ImageEngine, with contract checks on what the segmenter returns."""

import numpy as np
import pytest
import torch

from batchinfer.engine.api import ImageRequest, Instance
from batchinfer.images.segmenter import SegmenterEngine
from batchinfer.sam3.api import PairResult


class FakeSam:
    """Returns one instance per prompt: the top-left quarter of the image it was given."""

    def __init__(self, broken: bool = False):
        self.calls = []
        self.broken = broken

    def segment(self, images, prompts, score_threshold):
        self.calls.append(([tuple(i.shape) for i in images], [list(p) for p in prompts], score_threshold))
        out = []
        for img, ps in zip(images, prompts, strict=True):
            assert isinstance(img, torch.Tensor) and img.dtype == torch.uint8
            h, w = img.shape[:2]
            mask = torch.zeros(h, w, dtype=torch.bool)
            mask[: h // 2, : w // 2] = True
            out.append([[Instance(0.9, 0.95, (0.0, 0.0, w / 2, h / 2), mask)] for _ in ps])
        return out[:-1] if self.broken else out


def test_passes_images_and_prompts_through():
    sam = FakeSam()
    engine = SegmenterEngine(sam, {"engine": "fake"}, batch_size=4)
    reqs = [ImageRequest(i, np.zeros((8, 12, 3), np.uint8), 8, 12, ["a", "b"][: i + 1]) for i in range(2)]
    results = list(engine.segment(reqs, 0.3))
    assert sam.calls == [([(8, 12, 3), (8, 12, 3)], [["a"], ["a", "b"]], 0.3)]
    assert [r.index for r in results] == [0, 1] and [len(r.instances) for r in results] == [1, 2]
    inst = results[1].instances[1][0]
    assert isinstance(inst.mask, np.ndarray) and inst.mask.shape == (8, 12) and inst.mask.sum() == 24
    assert results[1].presence == [0.95, 0.95]
    assert engine.describe() == {"engine": "fake", "batch_size": "4", "input_size": "None"}
    assert list(engine.segment([], 0.5)) == []


def test_resized_inputs_come_back_at_original_size():
    engine = SegmenterEngine(FakeSam(), {}, input_size=10)
    (r,) = engine.segment([ImageRequest(0, np.zeros((10, 10, 3), np.uint8), 40, 20, ["x"])], 0.5)
    (inst,) = r.instances[0]
    assert inst.mask.shape == (40, 20) and inst.mask[:20, :10].all() and inst.mask.sum() == 200
    assert inst.box_xyxy == (0.0, 0.0, 10.0, 20.0)


class FakeSamWithPairs(FakeSam):
    """Also reports per-pair presence, as Sam3Model.segment_pairs does: prompt "none" finds nothing."""

    def segment_pairs(self, images, prompts, score_threshold):
        found = self.segment(images, prompts, score_threshold)
        return [
            [
                PairResult(0.01 if p == "none" else 0.95, [] if p == "none" else insts)
                for p, insts in zip(ps, per, strict=True)
            ]
            for ps, per in zip(prompts, found, strict=True)
        ]


def test_segment_pairs_gives_presence_without_instances():
    engine = SegmenterEngine(FakeSamWithPairs(), {})
    (r,) = engine.segment([ImageRequest(3, np.zeros((4, 4, 3), np.uint8), 4, 4, ["x", "none"])], 0.5)
    assert [len(i) for i in r.instances] == [1, 0] and r.presence == [0.95, 0.01]


def test_contract_violations_raise():
    engine = SegmenterEngine(FakeSam(broken=True), {})
    req = ImageRequest(0, np.zeros((4, 4, 3), np.uint8), 4, 4, ["x"])
    with pytest.raises(RuntimeError, match="returned 0 results for 1 images"):
        list(engine.segment([req], 0.5))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        SegmenterEngine(FakeSam(), {}, batch_size=0)
