"""A plain read of N bytes as one PDL launch: the floor the one-row decode kernels are measured against.

Why: a one-row decode step is a chain of a few hundred launches of 1-25 MB each, and at those sizes no
kernel moves its bytes at the copy bandwidth (a 1 GiB copy's): every launch pays its ramp-up and tail.
This kernel does nothing but read its bytes (4 programs an SM, each summing its slice of int32 words so
the loads cannot be dropped), launched like the engine's decode kernels (programmatic dependent launch in
a CUDA graph), so its time at a kernel's byte count is what a kernel of that size could reach on this GPU
without restructuring the step. With 0 bytes it times one empty launch of that grid.
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
