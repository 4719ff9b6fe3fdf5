"""Fused per-head q/k RMSNorm + rotary embedding (the step before attention in both families).

q `[T, H, Dh]`, k `[T, Hkv, Dh]` (last dim contiguous, other strides free, so q can be a view of
Qwen3.5's interleaved q|gate projection); outputs are contiguous. RMSNorm in the `(1 + w)` form
(Qwen3.5) or `w` form (Qwen3-MoE), then NeoX rotate-half RoPE on the first `2 * len(inv_freq)` dims
(64 of 256 for Qwen3.5, all 128 for Qwen3-MoE), the rest passed through. fp32 math, one rounding at
the store; cos/sin from fp32 `positions * inv_freq`, as HF computes them. One program per token.
With `store`, the same program also writes the token's normed and rotated k and its v into the layer's KV
cache (`kv_cache.store_kv`'s job: one launch a decode step and attention layer fewer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl, small_ops
from batchinfer.kernels.kv_cache import check_store, store_kv, store_rows
from batchinfer.kernels.nvfp4_gemm import interpreting


@triton.jit
def _norm_rope_heads(x_ptr, stride_xh, NH, w_ptr, out_ptr, stride_oh, pos, inv_freq_ptr, eps,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, ROT_HALF: tl.constexpr,
                     ONE_PLUS: tl.constexpr, INTERPRET: tl.constexpr):
    """RMSNorm + NeoX RoPE of one token's `NH` heads (`[BLOCK_H, HEAD_DIM]` tile), stored and returned."""
    offs_h = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, HEAD_DIM)
    h_ok = (offs_h < NH)[:, None]
    rotated = offs < 2 * ROT_HALF
    partner = tl.where(offs < ROT_HALF, offs + ROT_HALF, tl.where(rotated, offs - ROT_HALF, offs))
    rows = x_ptr + offs_h[:, None] * stride_xh
    x = tl.load(rows + offs[None, :], mask=h_ok, other=0.0).to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=h_ok, other=0.0).to(tl.float32)
    rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps))[:, None]
    w = tl.load(w_ptr + offs).to(tl.float32)
    wp = tl.load(w_ptr + partner).to(tl.float32)
    if ONE_PLUS:
        w += 1.0
        wp += 1.0
    y = x * rstd * w[None, :]
    yp = xp * rstd * wp[None, :]
    freq = pos * tl.load(inv_freq_ptr + offs % ROT_HALF, mask=rotated, other=0.0)
    rot = tl.where((offs < ROT_HALF)[None, :], -yp, yp)  # NeoX rotate_half: pairs (i, i + ROT_HALF)
    out = tl.where(rotated[None, :], y * tl.cos(freq)[None, :] + rot * tl.sin(freq)[None, :], y)
    o_ptrs = out_ptr + offs_h[:, None] * stride_oh + offs[None, :]
    out = small_ops._to(out, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(o_ptrs, out, mask=h_ok)
    return out


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr, q_out_ptr, k_out_ptr,  #
    v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,  #
    H, HKV, eps,  #
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,  #
    stride_vt, stride_vh, stride_cs, stride_ch, stride_ct, stride_ss, stride_sh,  #
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, ROT_HALF: tl.constexpr, ONE_PLUS: tl.constexpr,  #
    STORE: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """One token: q and k normed and rotated; with STORE, k and v into the caches at (slot, :, position)
    (a negative slot or position, a padded decode row, writes nothing there)."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    _norm_rope_heads(q_ptr + t * stride_qt, stride_qh, H, qw_ptr, q_out_ptr + t * stride_qot, stride_qoh,
                     pos, inv_freq_ptr, eps, HEAD_DIM, BLOCK_H, ROT_HALF, ONE_PLUS, INTERPRET)
    k_out = k_out_ptr + t * stride_kot
    k = _norm_rope_heads(k_ptr + t * stride_kt, stride_kh, HKV, kw_ptr, k_out, stride_koh,
                         pos, inv_freq_ptr, eps, HEAD_DIM, BLOCK_H, ROT_HALF, ONE_PLUS, INTERPRET)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        p = tl.load(pos_ptr + t).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs = tl.arange(0, HEAD_DIM)
        ok = offs_h < tl.where((slot >= 0) & (p >= 0), HKV, 0)  # a padded row stores no head
        dst = slot * stride_cs + offs_h[:, None] * stride_ch + p * stride_ct + offs[None, :]
        s_off = slot * stride_ss + offs_h * stride_sh + p
        store_rows(k, kc_ptr + dst, ks_ptr + s_off, ok, FP8)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs[None, :], mask=ok[:, None])
        store_rows(v, vc_ptr + dst, vs_ptr + s_off, ok, FP8)


def _check_heads(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.shape != shape or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected shape {shape} with a contiguous last dim, got {tuple(t.shape)} "
                         f"strides {t.stride()}")


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 `[rotary_dim / 2]` inverse frequencies, computed exactly as HF does (so long positions agree)."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float().to(device) / rotary_dim
    return 1.0 / (theta**exponent)


Tensor = torch.Tensor
KVStore = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor]  # v, caches, scales, slots


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    positions: torch.Tensor, inv_freq: torch.Tensor, eps: float, one_plus: bool,
    store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q `[T, H, Dh]` and k `[T, Hkv, Dh]`, then NeoX RoPE on the first
    `2 * len(inv_freq)` dims (64 of 256 for Qwen3.5, all 128 for Qwen3-MoE); returns contiguous q, k.
    `store = (v, k_cache, v_cache, k_scale, v_scale, slots)` also writes the returned k and `v` into the
    caches as `store_kv(k, v, ..., slots, positions)` does, in the same launch."""
    T, H, Dh = q.shape
    Hkv = k.shape[1]
    _check_heads("q", q, (T, H, Dh))
    _check_heads("k", k, (T, Hkv, Dh))
    if Dh & (Dh - 1):
        raise ValueError(f"q: head_dim must be a power of two, got {Dh}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (Dh,):
            raise ValueError(f"{name}: expected shape ({Dh},), got {tuple(w.shape)}")
    if positions.shape != (T,) or inv_freq.dtype != torch.float32 or 2 * inv_freq.numel() > Dh:
        raise ValueError(f"positions/inv_freq: expected [{T}] positions and fp32 inv_freq of at most "
                         f"{Dh // 2}, got {tuple(positions.shape)} and {inv_freq.dtype} [{inv_freq.numel()}]")
    q_out = torch.empty((T, H, Dh), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, Hkv, Dh), dtype=k.dtype, device=k.device)
    fp8 = False
    if store is not None:
        v, kc, vc, ks, vs, slots = store
        fp8, ks, vs = check_store(k_out, v, kc, vc, ks, vs, slots, positions)
        if v.stride(2) != 1 or kc.stride(3) != 1:
            raise ValueError(f"v {tuple(v.shape)} and the caches: expected contiguous last dims")
        if fp8 and interpreting():  # the interpreter's E4M3 cast is not PyTorch's: `store_kv` does it
            q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps, one_plus)
            store_kv(k_out, v, kc, vc, ks, vs, slots, positions)
            return q_out, k_out
        cache = (v, kc, vc, ks, vs, slots)
        strides = (v.stride(0), v.stride(1), *kc.stride()[:3], ks.stride(0), ks.stride(1))
    else:
        cache, strides = (k,) * 6, (0,) * 7
    _qk_norm_rope_kernel[(T,)](  # one program per token: all its q and k heads
        q, k, q_weight, k_weight, positions, inv_freq, q_out, k_out, *cache,
        H, Hkv, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), *strides,
        HEAD_DIM=Dh, BLOCK_H=triton.next_power_of_2(max(H, Hkv)), ROT_HALF=inv_freq.numel(),
        ONE_PLUS=one_plus, STORE=store is not None, FP8=fp8, INTERPRET=interpreting(), num_warps=4,
        **pdl.launch(q_out.device)
    )
    return q_out, k_out


def qk_norm_rope_ref(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    positions: torch.Tensor, inv_freq: torch.Tensor, eps: float, one_plus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference of `qk_norm_rope` (HF's RMSNorm then `apply_rotary_pos_emb` on the rotary slice)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    outs = []
    for x, w in ((q, q_weight), (k, k_weight)):
        x = x.float()
        scale = w.float() + 1 if one_plus else w.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale
        r = 2 * inv_freq.numel()
        x_rot, x_pass = x[..., :r], x[..., r:]
        half = torch.cat([-x_rot[..., r // 2:], x_rot[..., : r // 2]], -1)
        outs.append(torch.cat([x_rot * cos + half * sin, x_pass], -1))
    return outs[0], outs[1]
