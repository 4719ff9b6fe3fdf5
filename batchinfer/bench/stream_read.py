"""A plain read of N bytes as one PDL launch: the floor the one-row decode kernels are measured against.

Why: a one-row decode step is a chain of a few hundred launches of 1-25 MB each, and at those sizes no
kernel moves its bytes at the copy bandwidth (a 1 GiB copy's): every launch pays its ramp-up and tail.
This kernel does nothing but read its bytes (4 programs an SM, each summing its slice of int32 words so
the loads cannot be dropped), launched like the engine's decode kernels (programmatic dependent launch in
a CUDA graph), so its time at a kernel's byte count is what a kernel of that size could reach on this GPU
without restructuring the step. With 0 bytes it times one empty launch of that grid.

`row_tile_read` reads the same bytes in the order the MoE kernels do (`moe_tc`, `moe_direct`: a program a
tile of 64 weight rows, 64 bytes of each row an iteration, the next row a row's width away), still doing
nothing else: set beside `stream_read`, it says how much of a kernel's distance from that floor is its
access pattern rather than its decode, dependencies or launch shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from batchinfer.kernels import pdl
from batchinfer.kernels.nvfp4_gemm import num_sms

BLOCK = 1024  # int32 words a program loads an iteration (4 KiB)
PROGRAMS_AN_SM = 4
TILE_ROWS = 64  # rows a program of `row_tile_read` (a `moe_tc` / `moe_direct` weight tile)
ROW_PIECE = 16  # int32 words of each row an iteration (64 bytes: `moe_tc`'s STEPS 4 paired words)


@triton.jit
def _stream_read_kernel(src_ptr, out_ptr, n_words, words_per_program, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):  # fmt: skip
    """out[pid] = the wrapping int32 sum of words [pid * words_per_program, ...) of src (those < n_words)."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * words_per_program
    end = tl.minimum(start + words_per_program, n_words)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in tl.range(start, end, BLOCK, num_stages=3):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < end, other=0)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _row_tile_read_kernel(src_ptr, out_ptr, n_rows, ROW_WORDS: tl.constexpr, ROWS: tl.constexpr,
                          PIECE: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """out[pid] = the wrapping int32 sum of rows [pid * ROWS, (pid + 1) * ROWS) of src viewed as [n_rows,
    ROW_WORDS] (rows < n_rows), read PIECE words of every row an iteration."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    ptrs = src_ptr + rows.to(tl.int64)[:, None] * ROW_WORDS + tl.arange(0, PIECE)[None, :]
    mask = (rows < n_rows)[:, None]
    acc = tl.zeros([ROWS, PIECE], tl.int32)
    for i in tl.range(0, ROW_WORDS // PIECE, num_stages=3):
        acc += tl.load(ptrs + i * PIECE, mask=mask, other=0)
    tl.store(out_ptr + pid, tl.sum(acc))


def stream_read(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reads every byte of `src` (int32, contiguous; numel may be 0) once; `out` int32 holds at least
    `programs(src.device)` sums, one a program."""
    if src.dtype != torch.int32 or not src.is_contiguous():
        raise ValueError(f"src: expected a contiguous int32 tensor, got {src.dtype}")
    grid = programs(src.device)
    if out.dtype != torch.int32 or out.numel() < grid:
        raise ValueError(f"out: expected int32 with at least {grid} elements, got {out.dtype} {out.numel()}")
    per = _words_per_program(src.numel(), grid)
    launch = pdl.launch(src.device)
    _stream_read_kernel[(grid,)](src, out, src.numel(), per, BLOCK=BLOCK, num_warps=4, **launch)
    return out


def row_tile_read(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reads every byte of `src` (int32 `[rows, row_words]`, contiguous, row_words a multiple of ROW_PIECE)
    once, a program a tile of TILE_ROWS rows; `out` int32 holds at least `row_tiles(rows)` sums."""
    if src.dtype != torch.int32 or src.dim() != 2 or not src.is_contiguous() or src.shape[1] % ROW_PIECE:
        raise ValueError(
            f"src: expected a contiguous int32 [rows, row_words] with row_words a multiple of "
            f"{ROW_PIECE}, got {src.dtype} {list(src.shape)}"
        )
    grid = row_tiles(src.shape[0])
    if out.dtype != torch.int32 or out.numel() < grid:
        raise ValueError(f"out: expected int32 with at least {grid} elements, got {out.dtype} {out.numel()}")
    if grid:
        _row_tile_read_kernel[(grid,)](src, out, src.shape[0], ROW_WORDS=src.shape[1], ROWS=TILE_ROWS,
                                       PIECE=ROW_PIECE, num_warps=4, **pdl.launch(src.device))  # fmt: skip
    return out


def row_tiles(rows: int) -> int:
    return triton.cdiv(rows, TILE_ROWS)


def _words_per_program(n_words: int, grid: int) -> int:
    return triton.cdiv(triton.cdiv(n_words, grid), BLOCK) * BLOCK


def stream_read_ref(src: torch.Tensor, grid: int) -> torch.Tensor:
    """What `stream_read` stores for a grid of `grid` programs: each slice's sum, wrapped to int32."""
    per = _words_per_program(src.numel(), grid)
    sums = [src[p * per : (p + 1) * per].long().sum() for p in range(grid)]
    return ((torch.stack(sums) + 2**31) % 2**32 - 2**31).to(torch.int32)


def programs(device: torch.device) -> int:
    return PROGRAMS_AN_SM * num_sms(device)


def stream_read_baseline(nbytes: int, n_sets: int, device: torch.device) -> Callable[[int], torch.Tensor]:
    """A benchmark baseline: call `i` reads `nbytes` (rounded down to whole words) of buffer `i % n_sets`,
    so that rotating sets keep the reads out of the L2 as the measured kernel's inputs are."""
    srcs = [torch.empty(nbytes // 4, dtype=torch.int32, device=device) for _ in range(n_sets)]
    out = torch.empty(programs(device), dtype=torch.int32, device=device)
    return lambda i: stream_read(srcs[i % n_sets], out)


def row_tile_read_baseline(
    nbytes: int, row_bytes: int, n_sets: int, device: torch.device
) -> Callable[[int], torch.Tensor]:
    """`stream_read_baseline` in `row_tile_read`'s order: `nbytes` (rounded down to whole rows) as rows of
    `row_bytes` (a multiple of 4 ROW_PIECE)."""
    rows = nbytes // row_bytes
    srcs = [torch.empty((rows, row_bytes // 4), dtype=torch.int32, device=device) for _ in range(n_sets)]
    out = torch.empty(max(1, row_tiles(rows)), dtype=torch.int32, device=device)
    return lambda i: row_tile_read(srcs[i % n_sets], out)
