"""The colour-shapes dry-run engine: connected components, shape scores, thresholds, resized inputs."""

import numpy as np
from images_fixtures import blue_mask, scene

from batchinfer.engine.api import ImageRequest
from batchinfer.images.shapes_engine import ColorShapesEngine, components


def test_components_are_4_connected():
    m = np.array([[1, 1, 0, 1], [0, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=bool)
    comps = components(m)
    assert sorted(int(c.sum()) for c in comps) == [2, 3, 5]
    assert np.array_equal(np.logical_or.reduce(comps), m)
    assert not components(np.zeros((3, 3), bool))


def _segment(engine, k, prompts, threshold=0.5):
    img = np.asarray(scene(k)).copy()
    (result,) = engine.segment([ImageRequest(7, img, 64, 96, prompts)], threshold)
    assert result.index == 7 and result.error is None
    return result


def test_colours_shapes_and_scores():
    r = _segment(ColorShapesEngine(), 1, ["red", "red circle", "red triangle", "blue square", "green"])
    red, circle, triangle, square, green = r.instances
    assert len(red) == 2 and [i.score for i in red] == [1.0, 1.0]
    assert red[0].mask.sum() > red[1].mask.sum()  # ties in score: larger first
    assert len(circle) == 1 and circle[0].box_xyxy == (5.0, 4.0, 30.0, 29.0) and circle[0].score > 0.9
    assert len(triangle) == 1 and triangle[0].box_xyxy[1] == 40.0
    (blue,) = square  # 24x16: a rectangle, so its square score is 2/3
    assert np.array_equal(blue.mask, blue_mask()) and abs(blue.score - 16 / 24) < 1e-6
    assert green == [] and r.presence[4] == 0.0  # absent: presence still reported
    assert r.presence[0] == 1.0


def test_threshold_drops_low_scores():
    r = _segment(ColorShapesEngine(), 0, ["blue square", "blue"], threshold=0.7)
    assert r.instances[0] == [] and len(r.instances[1]) == 1


def test_input_size_returns_masks_at_original_size():
    engine = ColorShapesEngine(input_size="48")
    assert engine.input_size == 48 and engine.batch_size == 8
    small = np.asarray(scene(0).resize((48, 48))).copy()
    (r,) = engine.segment([ImageRequest(0, small, 64, 96, ["blue"])], 0.5)
    (blue,) = r.instances[0]
    assert blue.mask.shape == (64, 96)
    iou = (blue.mask & blue_mask()).sum() / (blue.mask | blue_mask()).sum()
    assert iou > 0.8
    x0, y0, x1, y1 = blue.box_xyxy
    assert abs(x0 - 50) <= 2 and abs(y0 - 6) <= 2 and abs(x1 - 74) <= 2 and abs(y1 - 22) <= 2
