"""COCO RLE: hand-computed counts strings, round trips, and byte equality with pycocotools."""

import numpy as np
import pytest

from batchinfer.errors import InputError
from batchinfer.images import rle


def test_hand_cases():
    m = np.zeros((3, 4), dtype=bool)
    m[0, 0] = True  # column-major: 1, then 6 zeros, then the two pixels of column 2, then 3 zeros
    m[1:, 2] = True
    assert rle.runs(m).tolist() == [0, 1, 6, 2, 3]
    # counts 0, 1, 6; then 2 - 1 = 1 -> "1"; then 3 - 6 = -3 -> one group 29 (sign bit set) -> "M"
    assert rle.encode(m) == "0161M"
    assert rle.encode(np.zeros((2, 2), bool)) == "4"
    assert rle.encode(np.ones((2, 2), bool)) == "04"
    row = np.zeros((1, 40), bool)
    row[0, 33:] = True  # 33 = 0b100001: low group 1 with "more" (0x21 + 48 = 'Q'), then 1 -> '1'
    assert rle.encode(row) == "Q17"
    assert rle.string_to_counts("Q17") == [33, 7]


def test_round_trip_and_area():
    rng = np.random.default_rng(3)
    for _ in range(50):
        h, w = (int(v) for v in rng.integers(1, 30, 2))
        m = rng.random((h, w)) < rng.random()
        s = rle.encode(m)
        assert np.array_equal(rle.decode(s, h, w), m)
        assert rle.area(s) == int(m.sum())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pycocotools vs numpy 2
def test_matches_pycocotools():
    mask_util = pytest.importorskip("pycocotools.mask")
    rng = np.random.default_rng(7)
    for t in range(200):
        h, w = (int(v) for v in rng.integers(1, 64, 2))
        m = (rng.random((h, w)) < rng.random()).astype(np.uint8)
        if t % 4 == 0:  # large runs exercise multi-group and negative deltas
            m = np.zeros((h, w), np.uint8)
            m[rng.integers(0, h) :, rng.integers(0, w) :] = 1
        ref = mask_util.encode(np.asfortranarray(m))
        assert rle.encode(m) == ref["counts"].decode()
        ours = {"size": [h, w], "counts": rle.encode(m).encode()}
        assert np.array_equal(mask_util.decode(ours), m)
        assert int(mask_util.area(ours)) == int(m.sum())


def test_bad_strings_are_clear_errors():
    with pytest.raises(InputError, match="sum to 3"):
        rle.decode("12", 2, 2)
    with pytest.raises(InputError, match="ends inside a number"):
        rle.string_to_counts("Q")
    with pytest.raises(InputError, match="not RLE"):
        rle.string_to_counts("1\x7f")
    with pytest.raises(ValueError, match="2 dimensions"):
        rle.runs(np.zeros((2, 2, 1), bool))
