import math

import pytest
import torch

from batchinfer.errors import InputError
from batchinfer.sam3.postprocess import preprocess_image, select_instances, select_pairs


def test_preprocess_normalises_to_minus_one_one():
    img = torch.tensor([[[0, 255, 51]]], dtype=torch.uint8).expand(4, 4, 3).contiguous()
    out = preprocess_image(img, 4)
    assert out.shape == (3, 4, 4)
    assert out[:, 0, 0].tolist() == pytest.approx([-1.0, 1.0, 51 / 255 * 2 - 1])


def test_preprocess_resizes_without_keeping_aspect():
    img = torch.full((10, 30, 3), 200, dtype=torch.uint8)
    img[:, 15:] = 0
    out = preprocess_image(img, 8)
    assert out.shape == (3, 8, 8)
    assert out[0, :, 0].tolist() == pytest.approx([200 / 255 * 2 - 1] * 8)
    assert out[0, :, 7].tolist() == pytest.approx([-1.0] * 8)


@pytest.mark.parametrize("bad", [torch.zeros(4, 4, 3), torch.zeros(4, 4, dtype=torch.uint8)])
def test_preprocess_rejects_wrong_images(bad):
    with pytest.raises(InputError, match=r"uint8 tensor \[H, W, 3\]"):
        preprocess_image(bad, 4)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_scores_threshold_order_and_boxes():
    logits = torch.tensor([_logit(0.5), _logit(0.9), _logit(0.99), _logit(0.2)])
    presence = torch.tensor(_logit(0.8))
    boxes = torch.tensor(
        [[0.5, 0.5, 0.5, 0.25], [0.1, 0.1, 0.4, 0.4], [0.5, 0.5, 0.2, 0.2], [0.5, 0.5, 1, 1]]
    )
    masks = torch.zeros(4, 2, 2)
    res = select_instances(logits, presence, boxes, masks, height=100, width=200, score_threshold=0.3)
    assert res.presence == pytest.approx(0.8)
    # scores 0.4, 0.72, 0.792, 0.16 -> above 0.3, best first: query 2, 1, 0
    assert [i.score for i in res.instances] == pytest.approx([0.792, 0.72, 0.4])
    assert res.instances[0].box_xyxy == pytest.approx((80.0, 40.0, 120.0, 60.0))
    assert res.instances[2].box_xyxy == pytest.approx((50.0, 37.5, 150.0, 62.5))
    # query 1 reaches past the top-left corner: clamped to the image
    assert res.instances[1].box_xyxy == pytest.approx((0.0, 0.0, 60.0, 30.0))
    assert all(i.presence == pytest.approx(0.8) for i in res.instances)


def test_no_instances_keeps_presence():
    res = select_instances(
        torch.tensor([-5.0]), torch.tensor(-2.0), torch.rand(1, 4), torch.zeros(1, 2, 2), 3, 3, 0.5
    )
    assert res.instances == [] and res.presence == pytest.approx(1 / (1 + math.exp(2)))


def test_mask_bilinear_upsampling_by_hand():
    # 2x2 logits [[1, -1], [-1, 1]] to 4x4 (align_corners=False): samples at -0.25, 0.25, 0.75, 1.25
    # give rows/cols weights (1, 0), (.75, .25), (.25, .75), (0, 1); the sign pattern is block diagonal.
    masks = torch.tensor([[[1.0, -1.0], [-1.0, 1.0]]])
    res = select_instances(
        torch.tensor([5.0]), torch.tensor(5.0), torch.tensor([[0.5, 0.5, 1.0, 1.0]]), masks, 4, 4, 0.5
    )
    mask = res.instances[0].mask
    assert mask.dtype == torch.bool and mask.shape == (4, 4)
    assert mask.int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]


def test_mask_at_original_non_square_size():
    masks = torch.full((1, 8, 8), 3.0)
    masks[0, :, 4:] = -3.0
    res = select_instances(
        torch.tensor([5.0]), torch.tensor(5.0), torch.tensor([[0.5, 0.5, 1.0, 1.0]]), masks, 5, 20, 0.5
    )
    mask = res.instances[0].mask
    assert mask.shape == (5, 20)
    assert mask[:, :10].all() and not mask[:, 10:].any()


def test_pairs_at_once_match_pair_by_pair():
    """Three pairs of different sizes, the middle one without instances: `select_pairs` returns what
    `select_instances` gives each pair alone (scores, order, boxes, masks)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g) * 3
    logits[1] = -8.0
    presence = torch.tensor([2.0, 1.0, 0.5])
    boxes = torch.rand(3, 6, 4, generator=g)
    masks = torch.randn(3, 6, 4, 4, generator=g)
    sizes = [(10, 12), (7, 7), (5, 9)]
    together = select_pairs(logits, presence, boxes, masks, sizes, 0.3)
    assert [len(r.instances) for r in together][1] == 0 and all(len(together[k].instances) for k in (0, 2))
    for k, (h, w) in enumerate(sizes):
        alone = select_instances(logits[k], presence[k], boxes[k], masks[k], h, w, 0.3)
        assert together[k].presence == alone.presence
        assert [i.score for i in together[k].instances] == [i.score for i in alone.instances]
        assert [i.box_xyxy for i in together[k].instances] == [i.box_xyxy for i in alone.instances]
        for a, b in zip(together[k].instances, alone.instances, strict=True):
            assert a.mask.shape == (h, w) and torch.equal(a.mask, b.mask)


def test_pairs_and_sizes_must_agree():
    with pytest.raises(ValueError, match="2 pairs of logits but 1 image sizes"):
        select_pairs(
            torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 3, 4), torch.zeros(2, 3, 2, 2), [(4, 4)], 0.5
        )
