import pytest
import torch

from batchinfer.errors import InputError
from batchinfer.sam3.api import Instance
from batchinfer.sam3.checkpoint import random_sam3_state_dict
from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.model import Sam3Model
from batchinfer.sam3.postprocess import preprocess_image

TINY = Sam3Config.tiny()


@pytest.fixture(scope="module")
def model() -> Sam3Model:
    m = Sam3Model(TINY)
    m.load_state_dict({k.removeprefix("detector."): v for k, v in random_sam3_state_dict(TINY, 3).items()})
    return m.eval()


def _pattern_image(h: int = 56, w: int = 56) -> torch.Tensor:
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([(x * 7 + y * 3 + k * 50) % 256 for k in range(3)], -1).to(torch.uint8)


def test_matches_metas_reference_implementation(model):
    """Numbers from Meta's own code (facebookresearch/sam3 @ 99d02f2, `Sam3Image.forward_grounding`,
    built at the tiny config on CPU in fp32) with these exact random weights (seed 3) and image."""
    with torch.no_grad():
        fpn = model.encode_images(preprocess_image(_pattern_image(), 56)[None])
        text, mask = model.encode_prompts(["red car", "cat"])
        out = model.ground(fpn, torch.tensor([0, 0]), text, mask)
    assert out.presence_logit.tolist() == pytest.approx([0.533149, 0.329884], abs=1e-4)
    assert out.logits[:, :4].tolist() == [
        pytest.approx([0.204634, -0.280453, -0.214956, 0.082035], abs=1e-4),
        pytest.approx([1.226497, 0.733382, 0.985139, 1.114589], abs=1e-4),
    ]
    assert out.boxes[:, 0].tolist() == [
        pytest.approx([0.448631, 0.451279, 0.945936, 0.875875], abs=1e-4),
        pytest.approx([0.497428, 0.519580, 0.941138, 0.918513], abs=1e-4),
    ]
    assert out.mask_logits[:, 0, 5, :4].tolist() == [
        pytest.approx([0.326360, 0.829499, 0.504492, -0.285168], abs=1e-4),
        pytest.approx([0.343265, 0.628508, 0.510916, -1.090799], abs=1e-4),
    ]


def test_segment_interface_and_shapes(model):
    images = [_pattern_image(40, 70), _pattern_image()]
    out = model.segment(images, [["red car", "person"], []], score_threshold=0.0)
    assert len(out) == 2 and len(out[0]) == 2 and out[1] == []
    inst = out[0][1][0]
    assert isinstance(inst, Instance)
    assert inst.mask.shape == (40, 70) and inst.mask.dtype == torch.bool
    assert len(out[0][0]) == TINY.num_queries  # threshold 0 keeps every query
    scores = [i.score for i in out[0][0]]
    assert scores == sorted(scores, reverse=True)
    x0, y0, x1, y1 = inst.box_xyxy
    assert 0 <= x0 <= x1 <= 70 and 0 <= y0 <= y1 <= 40
    assert model.segment(images, [["red car"], ["cat"]], score_threshold=1.0) == [[[]], [[]]]


def test_pair_batching_does_not_change_results(model):
    images = [_pattern_image(), _pattern_image(30, 30).flip(0).contiguous()]
    prompts = [["red car", "cat", "person"], ["cat", "red car"]]
    together = model.segment_pairs(images, prompts, 0.1, pairs_per_batch=16)
    one_by_one = model.segment_pairs(images, prompts, 0.1, pairs_per_batch=1)
    for a_img, b_img in zip(together, one_by_one, strict=True):
        for a, b in zip(a_img, b_img, strict=True):
            assert a.presence == pytest.approx(b.presence, abs=1e-5)
            assert [i.score for i in a.instances] == pytest.approx([i.score for i in b.instances], abs=1e-5)
            assert all(torch.equal(x.mask, y.mask) for x, y in zip(a.instances, b.instances, strict=True))


def test_deterministic_and_prompt_sensitive(model):
    img = [_pattern_image()]
    a = model.segment_pairs(img, [["red car", "cat"]], 0.0)
    b = model.segment_pairs(img, [["red car", "cat"]], 0.0)
    assert [r.presence for r in a[0]] == [r.presence for r in b[0]]
    assert [i.box_xyxy for i in a[0][0].instances] == [i.box_xyxy for i in b[0][0].instances]
    assert a[0][0].presence != a[0][1].presence


def test_text_cache_reuses_encodings(model):
    model._text_cache.clear()
    first, _ = model.encode_prompts(["cat", "red car", "cat"])
    assert sorted(model._text_cache) == ["cat", "red car"]
    assert torch.equal(first[0], first[2])
    again, _ = model.encode_prompts(["red car"])
    assert torch.equal(again[0], first[1])


def test_text_cache_follows_dtype_changes():
    m = Sam3Model(TINY).eval()
    m.encode_prompts(["cat"])
    m.to(torch.bfloat16)
    feats, _ = m.encode_prompts(["cat"])
    assert feats.dtype == torch.bfloat16


def test_bad_inputs(model):
    with pytest.raises(InputError, match="2 images but 1 prompt lists"):
        model.segment([_pattern_image(), _pattern_image()], [["cat"]], 0.5)
    with pytest.raises(InputError, match="uint8"):
        model.segment([torch.zeros(8, 8, 3)], [["cat"]], 0.5)


def test_real_shapes_on_meta_device():
    with torch.device("meta"):
        model = Sam3Model(Sam3Config.real())
        fpn = model.encode_images(torch.empty(2, 3, 1008, 1008))
        text, mask = model.backbone.language_backbone(torch.zeros(3, 32, dtype=torch.long))
        out = model.ground(fpn, torch.tensor([0, 1, 1]), text, mask)
    assert [tuple(f.shape) for f in fpn] == [(2, 256, 288, 288), (2, 256, 144, 144), (2, 256, 72, 72)]
    assert tuple(text.shape) == (3, 32, 256)
    assert tuple(out.logits.shape) == (3, 200) and tuple(out.presence_logit.shape) == (3,)
    assert tuple(out.boxes.shape) == (3, 200, 4) and tuple(out.mask_logits.shape) == (3, 200, 288, 288)
