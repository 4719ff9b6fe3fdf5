"""Token sorting for the fused MoE: group the (token, slot) entries by expert, padded to BLOCK_M.

Input `topk_ids int32 [T, A]` (flattened to NUMEL = T*A entries). Output, all on the device (no host
sync, CUDA-graph safe):
- `sorted_ids int32 [max_padded]`: entry indices grouped by expert, each expert's group padded to a
  multiple of BLOCK_M with the sentinel NUMEL; within a group entries keep token order (deterministic);
- `block_expert int32 [max_blocks]`: the expert of each BLOCK_M block;
- `num_padded int32 [1]`: the used length of `sorted_ids` (blocks at or past it are idle).
Three launches: per-chunk expert histograms (many CTAs, which also fill `sorted_ids` with the sentinel),
one CTA turning them into offsets, then a scatter (many CTAs, which also find each block's expert). Only
the offsets are serial: the sentinel fill and the block experts, once in that one CTA too, took most of
its time (63 us at 18,432 entries on the H200, session 6). Ranks within a chunk come from a cumulative
count of the chunk's earlier entries of the same expert, so no atomics and the order is reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl

_CHUNK = 64


@triton.jit
def _moe_hist_kernel(
    ids_ptr, hist_ptr, sorted_ptr, NUMEL, MAX_PADDED, FILL,  #
    E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False,  #
):
    """Chunk pid's expert histogram; and the sentinel NUMEL into sorted_ids[pid * FILL, (pid + 1) * FILL)
    (the scatter overwrites the real entries' places later)."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < NUMEL, other=-1)
    onehot = (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    tl.store(hist_ptr + pid * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, axis=0))
    end = tl.minimum((pid + 1) * FILL, MAX_PADDED)
    for p0 in range(pid * FILL, end, 256):
        p = p0 + tl.arange(0, 256)
        tl.store(sorted_ptr + p, tl.full((256,), 0, tl.int32) + NUMEL, mask=p < end)


@triton.jit
def _moe_offsets_kernel(
    hist_ptr, chunk_base_ptr, ends_ptr, num_padded_ptr,  #
    NUM_CHUNKS,  #
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CB: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """Each expert's padded group end (`ends`), the total, and each chunk's base per expert."""
    pdl.enter(PDL)
    e_offs = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, NUM_CHUNKS, CB):
        rows = c0 + tl.arange(0, CB)
        mask = rows[:, None] < NUM_CHUNKS
        h = tl.load(hist_ptr + rows[:, None] * E_PAD + e_offs[None, :], mask=mask, other=0)
        counts += tl.sum(h, axis=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(ends_ptr + e_offs, ends)
    # chunk_base[c, e] = starts[e] + entries of expert e in chunks before c
    running = starts
    for c0 in range(0, NUM_CHUNKS, CB):
        rows = c0 + tl.arange(0, CB)
        mask = rows[:, None] < NUM_CHUNKS
        h = tl.load(hist_ptr + rows[:, None] * E_PAD + e_offs[None, :], mask=mask, other=0)
        excl = tl.cumsum(h, axis=0) - h
        tl.store(chunk_base_ptr + rows[:, None] * E_PAD + e_offs[None, :], running[None, :] + excl, mask=mask)
        running += tl.sum(h, axis=0)


@triton.jit
def _moe_scatter_kernel(
    ids_ptr, chunk_base_ptr, sorted_ptr, ends_ptr, num_padded_ptr, block_expert_ptr,  #
    NUMEL, MAX_BLOCKS, BLOCKS_PER,  #
    E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """Chunk pid's entries to their places; and the experts of blocks [pid * BLOCKS_PER, + BLOCKS_PER)
    (-1 past the used length)."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    e_offs = tl.arange(0, E_PAD)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < NUMEL, other=-1)
    valid = (offs < NUMEL) & (ids >= 0) & (ids < E_PAD)  # an id out of range writes nothing
    # rank: the chunk's earlier entries of the same expert ([CHUNK, CHUNK] pairs, not a scan of a one-hot
    # [CHUNK, E_PAD]: 8x fewer elements for Qwen3.6's 512 and a sum instead of a cumulative sum)
    lanes = tl.arange(0, CHUNK)
    earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.load(chunk_base_ptr + pid * E_PAD + ids, mask=valid, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=valid)
    ends = tl.load(ends_ptr + e_offs)
    total = tl.load(num_padded_ptr)
    b_end = tl.minimum((pid + 1) * BLOCKS_PER, MAX_BLOCKS)
    for b0 in range(pid * BLOCKS_PER, b_end, 16):
        blocks = b0 + tl.arange(0, 16)
        pos = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= pos[:, None]).to(tl.int32), axis=1)  # first expert ending after pos
        tl.store(block_expert_ptr + blocks, tl.where(pos < total, expert, -1), mask=blocks < b_end)


def max_blocks(numel: int, num_experts: int, block_m: int) -> int:
    """Upper bound on BLOCK_M blocks after padding: every non-empty expert adds < one block."""
    return triton.cdiv(numel, block_m) + min(num_experts, numel)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`topk_ids int32 [T, A]` -> (sorted_ids, block_expert, num_padded); see the module docstring."""
    if topk_ids.dtype != torch.int32 or topk_ids.ndim != 2:
        raise ValueError(f"topk_ids: expected int32 [T, A], got {topk_ids.dtype} {list(topk_ids.shape)}")
    ids = topk_ids.contiguous().view(-1)
    numel, dev = ids.numel(), ids.device
    e_pad = triton.next_power_of_2(num_experts)
    blocks = max_blocks(numel, num_experts, block_m)
    chunks = max(1, triton.cdiv(numel, _CHUNK))
    hist = torch.empty((chunks, e_pad), dtype=torch.int32, device=dev)
    chunk_base = torch.empty_like(hist)
    ends = torch.empty(e_pad, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    fill = triton.cdiv(blocks * block_m, chunks)
    _moe_hist_kernel[(chunks,)](
        ids, hist, sorted_ids, numel, blocks * block_m, fill, E_PAD=e_pad, CHUNK=_CHUNK,
        **pdl.launch(hist.device),
    )
    _moe_offsets_kernel[(1,)](
        hist, chunk_base, ends, num_padded, chunks, E_PAD=e_pad, BLOCK_M=block_m, CB=16, num_warps=8,
        **pdl.launch(hist.device),
    )
    _moe_scatter_kernel[(chunks,)](
        ids, chunk_base, sorted_ids, ends, num_padded, block_expert,  #
        numel, blocks, triton.cdiv(blocks, chunks),  #
        E_PAD=e_pad, CHUNK=_CHUNK, BLOCK_M=block_m, **pdl.launch(sorted_ids.device),  #
    )
    return sorted_ids, block_expert, num_padded


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[list[int]], int]:
    """Reference: per expert, the entry indices routed to it in order, and the padded total length."""
    flat = topk_ids.reshape(-1).tolist()
    groups = [[i for i, e in enumerate(flat) if e == x] for x in range(num_experts)]
    return groups, sum(triton.cdiv(len(g), block_m) * block_m for g in groups)
