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
from batchinfer.kernels import pdl

FP8_MAX = 448.0
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@triton.jit
def _store_row(x, cache_ptr, scale_ptr, s_off, FP8: tl.constexpr):
    """One row into a cache (bf16 as is; FP8: codes at cache_ptr, its scale at scale_ptr + s_off)."""
    if FP8:
        xf = x.to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-12), 448.0)  # as PyTorch's division
        tl.store(cache_ptr, tl.div_rn(xf, scale).to(tl.float8e4nv))
        tl.store(scale_ptr + s_off, scale)
    else:
        tl.store(cache_ptr, x.to(cache_ptr.dtype.element_ty))


@triton.jit
def store_rows(x, cache_ptrs, scale_ptrs, ok, FP8: tl.constexpr):
    """`_store_row` for the rows of a tile `x [R, Dh]` where `ok [R]` (the KV store in `qk_norm_rope`)."""
    rows_ok = tl.broadcast_to(ok[:, None], x.shape)
    if FP8:
        xf = x.to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-12), 448.0)
        tl.store(cache_ptrs, tl.div_rn(xf, scale[:, None]).to(tl.float8e4nv), mask=rows_ok)
        tl.store(scale_ptrs, scale, mask=ok)
    else:
        tl.store(cache_ptrs, x.to(cache_ptrs.dtype.element_ty), mask=rows_ok)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, pos_ptr,  #
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_ct, stride_ss, stride_sh,  #
    HEAD_DIM: tl.constexpr, FP8: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """One (token, kv head) a program: its key and value rows into the caches (one launch for both); a
    negative slot or position (a padded decode row) writes nothing."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if (slot >= 0) & (pos >= 0):
        dst = slot * stride_cs + h * stride_ch + pos * stride_ct + d
        s_off = slot * stride_ss + h * stride_sh + pos
        _store_row(tl.load(k_ptr + t * stride_kt + h * stride_kh + d), kc_ptr + dst, ks_ptr, s_off, FP8)
        _store_row(tl.load(v_ptr + t * stride_vt + h * stride_vh + d), vc_ptr + dst, vs_ptr, s_off, FP8)


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., Dh]` -> (E4M3 codes `[..., Dh]`, fp32 scales `[...]`): one scale per row, max|x| / 448."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / torch.full_like(amax, FP8_MAX)  # a true division: CUDA multiplies by 1/448 for a scalar
    return (xf / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def cache_scales(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(FP8?, k scales, v scales) of a cache pair, checked for the store and the attention kernels: an FP8
    cache needs contiguous fp32 scales `[slots, Hkv, max_len]` on its device, a bf16 one none (k_cache
    then stands in for both, unused)."""
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in KV_DTYPES.values():
        raise ValueError(f"k_cache/v_cache: expected both bfloat16 or both float8_e4m3fn, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if k_cache.dtype != torch.float8_e4m3fn:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale/v_scale: a bf16 cache has no scales")
        return False, k_cache, k_cache
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (t is None or t.shape != k_cache.shape[:3] or t.dtype != torch.float32 or not t.is_contiguous()
                or t.device != k_cache.device):
            got = "None" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise ValueError(f"{name} {got}: an FP8 cache needs its scales, expected contiguous float32 "
                             f"{tuple(k_cache.shape[:3])} on {k_cache.device}")
    return True, k_scale, v_scale  # type: ignore[return-value]


def dequantize_kv(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A cache (or part of one) as fp32 values: FP8 codes times their rows' scales, bf16 as is."""
    if scale is None:
        return cache.float()
    return cache.float() * scale.unsqueeze(-1)


def check_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """`store_kv`'s arguments checked; returns `cache_scales`' (FP8?, k scales, v scales)."""
    t, hkv, dh = k.shape
    for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if x.shape != k.shape or cache.dim() != 4 or cache.shape[1] != hkv or cache.shape[3] != dh:
            raise ValueError(f"store_kv: {name}_cache {tuple(cache.shape)} does not take rows of {name} "
                             f"{tuple(x.shape)}")
    if (v_cache.dtype, v_cache.shape, v_cache.stride()) != (k_cache.dtype, k_cache.shape, k_cache.stride()):
        raise ValueError("store_kv: k_cache and v_cache need one dtype, shape and layout")
    fp8, ks, vs = cache_scales(k_cache, v_cache, k_scale, v_scale)
    for name, idx in (("slots", slots), ("positions", positions)):
        if idx.shape != (t,) or idx.device != k_cache.device or idx.is_floating_point():
            raise ValueError(f"store_kv: {name} {idx.dtype} {tuple(idx.shape)} on {idx.device}, expected "
                             f"integer [{t}] on {k_cache.device}")
    return fp8, ks, vs


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Write `k, v [T, Hkv, Dh]` (bf16) into `k_cache, v_cache [S, Hkv, L, Dh]` (one layout) at (`slots[t]`,
    :, `positions[t]`); FP8 caches (`float8_e4m3fn`) need `k_scale, v_scale [S, Hkv, L]` (fp32), written
    alongside. `slots` and `positions` are integer `[T]` on the caches' device; a row with a negative
    slot or position (a padded decode row) writes nothing. One launch, no host sync (CUDA-graph safe)."""
    fp8, ks, vs = check_store(k, v, k_cache, v_cache, k_scale, v_scale, slots, positions)
    t, hkv, dh = k.shape
    if t == 0:
        return
    if not k.is_cuda:  # the interpreter's E4M3 cast is not PyTorch's: quantize and scatter with torch
        real = (slots >= 0) & (positions >= 0)
        s, p = slots[real].long(), positions[real].long()
        for x, cache, scale in ((k[real], k_cache, ks), (v[real], v_cache, vs)):
            if fp8:
                cache[s, :, p], scale[s, :, p] = quantize_kv_ref(x)
            else:
                cache[s, :, p] = x.to(cache.dtype)
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or dh & (dh - 1):
        raise ValueError(f"store_kv: contiguous last dims of a power of two expected, got {tuple(k.shape)}")
    _store_kv_kernel[(t, hkv)](
        k, v, k_cache, v_cache, ks, vs, slots, positions,  #
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),  #
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ks.stride(0), ks.stride(1),  #
        HEAD_DIM=dh, FP8=fp8, num_warps=1 if dh <= 128 else 2, **pdl.launch(k_cache.device),  #
    )
