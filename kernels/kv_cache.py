"""Writes new keys and values into the slot caches of the full-attention layers: bf16, or FP8 (E4M3) with
one fp32 scale per (slot, kv head, position).

Why FP8: a KV cache entry is `2 x Hkv x Dh` values a token and layer: for Qwen3-30B-A3B (48 layers, 4 KV
heads of 128) 96 KiB a token in bf16, which bounds the slots a GPU holds and is what decode attention
reads at long contexts; E4M3 halves both. The scale of each (token, head) row is max|x| / 448 (E4M3's
largest finite value), so every row uses E4M3's whole range with no calibration and nothing saturates;
`attention.decode_attention` and `prefill_attention_cached` apply it to the scores (K) and to the
probabilities (V), never per element. Codes are x / scale rounded to nearest (IEEE division and the
GPU's `cvt.rn.satfinite`, PyTorch's bits). The Triton interpreter's fp32 -> E4M3 cast is its own
(`fp8_quant.py`), so on the CPU `store_kv` quantizes with `quantize_kv_ref` and scatters with PyTorch;
the kernel's CPU test checks it roughly and its GPU test asks for PyTorch's bits.

Layouts as in `attention.py`: caches `[slots, Hkv, max_len, Dh]`, scales `[slots, Hkv, max_len]`; x
`[T, Hkv, Dh]` (last dim contiguous), token t goes to slot `slots[t]` at `positions[t]`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@triton.jit
def _store_kv_kernel(
    x_ptr, cache_ptr, scale_ptr, slot_ptr, pos_ptr,  #
    stride_xt, stride_xh, stride_cs, stride_ch, stride_ct, stride_ss, stride_sh,  #
    HEAD_DIM: tl.constexpr, FP8: tl.constexpr,  #
):
    """One (token, kv head) row a program: x row -> cache (bf16 as is; FP8: codes, and its scale)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dst = cache_ptr + slot * stride_cs + h * stride_ch + pos * stride_ct + d
    if FP8:
        xf = x.to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-12), 448.0)  # as PyTorch's division
        tl.store(dst, tl.div_rn(xf, scale).to(tl.float8e4nv))
        tl.store(scale_ptr + slot * stride_ss + h * stride_sh + pos, scale)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty))


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., Dh]` -> (E4M3 codes `[..., Dh]`, fp32 scales `[...]`): one scale per row, max|x| / 448."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (xf / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def dequantize_kv(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A cache (or part of one) as fp32 values: FP8 codes times their rows' scales, bf16 as is."""
    if scale is None:
        return cache.float()
    return cache.float() * scale.unsqueeze(-1)


def store_kv(
    x: torch.Tensor,
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Write `x [T, Hkv, Dh]` (bf16) into `cache [S, Hkv, L, Dh]` at (`slots[t]`, :, `positions[t]`); an
    FP8 cache (`float8_e4m3fn`) needs `scale [S, Hkv, L]` (fp32), written alongside. `slots` and
    `positions` are integer `[T]` on the cache's device. No host sync (CUDA-graph safe)."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    t, hkv, dh = x.shape
    if cache.dim() != 4 or cache.shape[1] != hkv or cache.shape[3] != dh or cache.stride(3) != 1:
        raise ValueError(f"store_kv: cache {tuple(cache.shape)} does not take rows of x {tuple(x.shape)}")
    if fp8 != (scale is not None):
        raise ValueError("store_kv: an FP8 cache needs its scales, a bf16 cache has none")
    if scale is not None and (scale.shape != cache.shape[:3] or scale.dtype != torch.float32):
        raise ValueError(f"store_kv: scale {tuple(scale.shape)} {scale.dtype}, expected "
                         f"{tuple(cache.shape[:3])} float32")
    if t == 0:
        return
    if not x.is_cuda:  # the interpreter's E4M3 cast is not PyTorch's: quantize and scatter with torch
        s, p = slots.long(), positions.long()
        if fp8:
            cache[s, :, p], scale[s, :, p] = quantize_kv_ref(x)  # type: ignore[index]
        else:
            cache[s, :, p] = x.to(cache.dtype)
        return
    if x.stride(2) != 1 or dh & (dh - 1):
        raise ValueError(f"store_kv: x needs a contiguous last dim of a power of two, got {tuple(x.shape)}")
    sc = scale if scale is not None else cache  # unused without FP8
    _store_kv_kernel[(t, hkv)](
        x, cache, sc, slots, positions,  #
        x.stride(0), x.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),  #
        sc.stride(0), sc.stride(1),  #
        HEAD_DIM=dh, FP8=fp8, num_warps=1 if dh <= 128 else 2,  #
    )
