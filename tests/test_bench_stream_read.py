"""The stream-read floor kernel under the Triton interpreter: it reads every word exactly once."""

import pytest
import torch

from batchinfer.bench.stream_read import (
    BLOCK,
    ROW_PIECE,
    TILE_ROWS,
    programs,
    row_tile_read,
    row_tiles,
    stream_read,
    stream_read_ref,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("n_words", [0, 5, 3 * BLOCK + 7, 2 * BLOCK * programs(CPU) + 11])
def test_each_program_sums_its_slice_of_every_word(n_words):
    """Slices cover the words once: a word dropped, read twice or past the end changes a sum (random words
    over the whole int32 range, so the sums wrap)."""
    src = torch.randint(-(2**31), 2**31 - 1, (n_words,), dtype=torch.int32)
    out = torch.zeros(programs(CPU), dtype=torch.int32)
    stream_read(src, out)
    assert torch.equal(out, stream_read_ref(src, programs(CPU)))
    assert out.long().sum() % 2**32 == src.long().sum() % 2**32


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="src: expected a contiguous int32"):
        stream_read(torch.zeros(8, dtype=torch.int64), torch.zeros(programs(CPU), dtype=torch.int32))
    with pytest.raises(ValueError, match="out: expected int32 with at least"):
        stream_read(torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize(
    "rows, row_words", [(0, ROW_PIECE), (TILE_ROWS, ROW_PIECE), (2 * TILE_ROWS + 5, 4 * ROW_PIECE)]
)
def test_row_tiles_sum_each_tile_of_every_word(rows, row_words):
    """A program a tile of TILE_ROWS rows, every word of them once (random words over the int32 range)."""
    src = torch.randint(-(2**31), 2**31 - 1, (rows, row_words), dtype=torch.int32)
    out = torch.zeros(max(1, row_tiles(rows)), dtype=torch.int32)
    row_tile_read(src, out)
    for p in range(row_tiles(rows)):
        total = src[p * TILE_ROWS : (p + 1) * TILE_ROWS].long().sum()
        assert out[p].item() == (total + 2**31) % 2**32 - 2**31


def test_row_tile_read_names_bad_arguments():
    with pytest.raises(ValueError, match="src: expected a contiguous int32 \\[rows, row_words\\]"):
        row_tile_read(torch.zeros(4, ROW_PIECE + 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="out: expected int32 with at least 2"):
        row_tile_read(
            torch.zeros(TILE_ROWS + 1, ROW_PIECE, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        )
