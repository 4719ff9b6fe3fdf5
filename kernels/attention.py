"""Full attention for both families: causal prefill and decode over a KV cache (q/k norm + RoPE come
first, from `qk_norm_rope.py`).

Layouts (last dim contiguous, other strides free, so q and the output gate can be views of q_proj's
interleaved `[T, H, 2 * Dh]` output):
- prefill: packed tokens `q [T, H, Dh]`, `k, v [T, Hkv, Dh]`, sequences delimited by `cu_seqlens [N + 1]`
  (int32); each sequence attends causally to itself only (fresh prefill, no cached prefix).
  `prefill_attention_cached` (chunked prefill of long prompts): the same kernel reading K/V from the
  decode cache, each chunk after its slot's first `past[n]` tokens.
- decode KV cache, one slot per running sequence: `k_cache, v_cache [slots, Hkv, max_len, Dh]` (bf16),
  so one (slot, kv head) is a contiguous `[max_len, Dh]` run and a split streams it with wide loads.
  Token `p` of the sequence in slot `s` sits at `[s, :, p]`; the engine writes new keys and values with
  `kv_cache.store_kv` and then calls `decode_attention` with `seq_lens` counting them.
  Rows with `seq_len == 0` (CUDA-graph padding) read nothing, not even their slot (which may be
  negative), and return zeros.
- FP8 cache (`kv_cache.py`): the same caches in `float8_e4m3fn` with fp32 scales `[slots, Hkv, max_len]`,
  one a (slot, head, position) row; the kernels convert the tiles exactly (decode to fp16, one
  conversion a pair, with its queries, which after q_norm sit far inside fp16's range; chunked prefill
  to bf16), multiply each score by its key's scale and each probability by its value's scale (in decode
  relative to the tile's largest) before the PV dot.
Numerics: fp32 accumulation and softmax (exp2 with the scale, Dh**-0.5, folded in), bf16 tensor-core dots; the
output gate of Qwen3.5 (`o * sigmoid(gate)`) is fused into the epilogue. Expected error vs `*_ref`:
~3e-3 relative (bf16 probabilities into the PV dot). GPU: sm_90, Triton's wgmma path; GQA group of 8
query heads (16/2 and 32/4) shares each K/V tile in decode.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl, small_ops
from batchinfer.kernels.kv_cache import cache_scales, dequantize_kv
from batchinfer.kernels.nvfp4_gemm import interpreting

_LOG2E = 1.4426950408889634


def _interpreted() -> bool:
    """Small tiles under the Triton interpreter; CPU tests patch this to run the production tiles there.
    (GPU tests run the production tiles, as the engine does.)"""
    return interpreting()


def _prefill_configs(head_dim: int, fp8: bool = False) -> dict[str, int]:
    """Tiles per head dim; one small tile under the interpreter.

    Measured 2026-11-30 at 4k tokens: Dh=128 with 128x64 on 8 warps, 384 TFLOP/s (56% of cuBLAS);
    Dh=256 with 64x64 on 4 warps, 222 TFLOP/s (32%). The sm_90 compile report
    (`python -m batchinfer.bench.sm90_report`) showed why: at Dh=256 the fp32 accumulator alone is 128
    registers a thread and 64x64/4 warps spilled ~500 B; 128x32 on two warpgroups (below) spills only
    in the gated epilogue. Not yet re-timed (`python -m batchinfer.bench.tune_attn`).
    """
    if _interpreted():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if fp8:  # an FP8 cache's K/V tiles are converted in registers: half the key tile keeps the spills
        # where the bf16 tiles have them (compile report; not yet timed)
        if head_dim <= 128:
            return {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3}
        return {"BLOCK_M": 128, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    if head_dim <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def _decode_configs(head_dim: int, fp8: bool = False) -> dict[str, int]:
    """Split-KV tiles: ~140 registers and no spills (FP8: 145 at Dh=128; 255 and an 8-byte spill at
    Dh=256), 3-stage cp.async pipeline (sm_90 compile report, Triton 3.6)."""
    if _interpreted():
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "MIN_SPLIT": 32}
    # MIN_SPLIT 64: at batch 1-8 a row's KV is spread over up to 64 splits (measured 2026-11-30 with 256:
    # 15% of copy bandwidth at batch 1, 61% at 8); from batch 32 the 264-program rule decides alone.
    # FP8 tiles: the best of BLOCK_N {32, 64} x warps {4, 8} x stages {2, 3} at batch 32 over 2,048
    # tokens (2026-11-30): 44.4 us at Dh=256 (default 32: 50.6), 39.9 at Dh=128 (default 64: 49.3).
    block_n = 32 if (head_dim <= 128) == fp8 else 64  # bf16: 64 at Dh=128, 32 at 256; FP8 the reverse
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 3, "MIN_SPLIT": 64}


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b; fp32 operands under the interpreter (INTERPRET, set by the launchers), whose Triton 3.9
    version multiplies bf16 operands as raw bits. They hold values of the input dtype already."""
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _pv_fp8(acc, alpha, p, v, v_scale, INTERPRET: tl.constexpr):
    """acc * alpha + (p * v_scale) @ v for an FP8 V tile, as an fp16 product: E4M3 -> fp16 is one
    conversion a pair where bf16 needs three, and it left the bf16 version slower than a bf16 cache.
    p * v_scale is taken relative to the tile's largest scale, so it lies in [0, 1] where fp16 keeps 11
    bits down to 6e-5; the largest scale goes back on in fp32."""
    top = tl.max(v_scale, axis=0)
    top = tl.where(top > 0.0, top, 1.0)
    p = (p * (v_scale / top)[None, :]).to(tl.float16)
    return _dot(p, v.to(tl.float16), acc * (alpha / top)[:, None], INTERPRET) * top


@triton.jit
def _attn_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, ks_ptrs, vs_ptrs, offs_m, offs_n, n_start, seqlen, qk_scale,
                stride_kt, stride_vt, MASKED: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """One K/V tile of online softmax: k_ptrs `[Dh, BLOCK_N]`, v_ptrs `[BLOCK_N, Dh]` at token n_start
    (FP8: ks_ptrs, vs_ptrs `[BLOCK_N]` their rows' scales); `offs_m` are the query rows' positions and
    `seqlen` the keys' count (both counting a cached prefix)."""
    cols = n_start + offs_n
    if MASKED:
        k = tl.load(k_ptrs + n_start * stride_kt, mask=cols[None, :] < seqlen, other=0.0)
    else:
        k = tl.load(k_ptrs + n_start * stride_kt)
    if FP8:
        k = k.to(tl.bfloat16)
    s = _dot(q, k, None, INTERPRET) * qk_scale
    if FP8:
        s = s * tl.load(ks_ptrs + n_start, mask=cols < seqlen, other=0.0)[None, :]
    if MASKED:
        s = tl.where((cols[None, :] <= offs_m[:, None]) & (cols[None, :] < seqlen), s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_ptrs + n_start * stride_vt, mask=cols[:, None] < seqlen, other=0.0)
    else:
        v = tl.load(v_ptrs + n_start * stride_vt)
    if FP8:  # bf16 tiles here: the fp16 product of decode (`_pv_fp8`) spills 184 B at Dh=256 (sm_90 report)
        v = v.to(tl.bfloat16)
        p = p * tl.load(vs_ptrs + n_start, mask=cols < seqlen, other=0.0)[None, :]
    acc = _dot(small_ops._to(p, v.dtype, INTERPRET), v, acc * alpha[:, None], INTERPRET)
    return acc, m_new, l_i


@triton.jit
def _prefill_attn_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, gate_ptr, o_ptr, cu_ptr, slot_ptr, past_ptr,  #
    H, GROUP, qk_scale,  #
    stride_qt, stride_qh, stride_ks, stride_kt, stride_kh, stride_vs, stride_vt, stride_vh,  #
    stride_ss, stride_sh, stride_gt, stride_gh, stride_ot, stride_oh,  #
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_GATE: tl.constexpr,  #
    CACHED: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr,  #
):
    """Packed K/V (CACHED False: each sequence sees its own tokens) or the KV cache (CACHED: sequence n's
    queries sit at positions past[n] + i of slot slot_ids[n] and see the slot's first past[n] + i + 1
    tokens, its own chunk written there already; FP8: an FP8 cache with scales `[slots, Hkv, max_len]`
    at (stride_ss, stride_sh, 1))."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (most causal work) blocks first
    seq = tl.program_id(1) // H
    h = tl.program_id(1) % H
    kvh = h // GROUP
    start = tl.load(cu_ptr + seq).to(tl.int64)
    seqlen = tl.load(cu_ptr + seq + 1) - start
    m_start = pid_m * BLOCK_M
    if m_start >= seqlen:
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < seqlen
    q = tl.load(q_ptr + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=row_ok)
    if CACHED:  # positions and key counts include the slot's first `past` tokens
        past = tl.load(past_ptr + seq)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        k_ptrs = k_ptr + slot * stride_ks + offs_n[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None]
        v_ptrs = v_ptr + slot * stride_vs + offs_n[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
        ks_ptrs = ks_ptr + slot * stride_ss + kvh * stride_sh + offs_n
        vs_ptrs = vs_ptr + slot * stride_ss + kvh * stride_sh + offs_n
        pos_m = past + offs_m
        kv_len = past + seqlen
        diag = (past + m_start) // BLOCK_N * BLOCK_N  # tiles before it are visible to every row
        diag_end = tl.minimum(kv_len, past + m_start + BLOCK_M)
    else:
        k_ptrs = k_ptr + (start + offs_n)[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None]
        v_ptrs = v_ptr + (start + offs_n)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
        ks_ptrs, vs_ptrs = ks_ptr, vs_ptr  # unused: packed K/V are bf16
        pos_m = offs_m
        kv_len = seqlen
        diag = m_start
        diag_end = tl.minimum(seqlen, m_start + BLOCK_M)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n_start in range(0, diag, BLOCK_N):  # fully visible tiles: no mask
        acc, m_i, l_i = _attn_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, ks_ptrs, vs_ptrs, pos_m, offs_n,
                                    n_start, kv_len, qk_scale, stride_kt, stride_vt, False, FP8, INTERPRET)
    for n_start in range(diag, diag_end, BLOCK_N):  # the diagonal
        acc, m_i, l_i = _attn_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, ks_ptrs, vs_ptrs, pos_m, offs_n,
                                    n_start, kv_len, qk_scale, stride_kt, stride_vt, True, FP8, INTERPRET)
    acc = acc / l_i[:, None]
    if HAS_GATE:
        g_ptrs = gate_ptr + (start + offs_m)[:, None] * stride_gt + h * stride_gh + offs_d[None, :]
        g = tl.load(g_ptrs, mask=row_ok)
        acc = acc * tl.sigmoid(g.to(tl.float32))
    o_ptrs = o_ptr + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, small_ops._to(acc, o_ptr.dtype.element_ty, INTERPRET), mask=row_ok)


@triton.jit
def _decode_attn_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, len_ptr, gate_ptr, o_ptr, part_o_ptr, part_lse_ptr,  #
    GROUP, SPLIT_LEN, qk_scale,  #
    stride_qb, stride_qh, stride_kcs, stride_kch, stride_kct, stride_vcs, stride_vch, stride_vct,  #
    stride_ss, stride_sh, stride_gb, stride_gh, stride_ob, stride_oh,  #
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,  #
    HAS_GATE: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    pdl.enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seqlen = tl.load(len_ptr + b)
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, seqlen)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0)
    if FP8:
        q = q.to(tl.float16)
    k_ptrs = kc_ptr + slot * stride_kcs + kvh * stride_kch + offs_n[None, :] * stride_kct + offs_d[:, None]
    v_ptrs = vc_ptr + slot * stride_vcs + kvh * stride_vch + offs_n[:, None] * stride_vct + offs_d[None, :]
    ks_ptrs = ks_ptr + slot * stride_ss + kvh * stride_sh + offs_n
    vs_ptrs = vs_ptr + slot * stride_ss + kvh * stride_sh + offs_n
    m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n_start in range(lo, hi, BLOCK_N):
        n_ok = n_start + offs_n < hi
        k = tl.load(k_ptrs + n_start * stride_kct, mask=n_ok[None, :], other=0.0)
        if FP8:
            k = k.to(tl.float16)
        s = _dot(q, k, None, INTERPRET) * qk_scale
        if FP8:
            s = s * tl.load(ks_ptrs + n_start, mask=n_ok, other=0.0)[None, :]
        s = tl.where(n_ok[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptrs + n_start * stride_vct, mask=n_ok[:, None], other=0.0)
        if FP8:
            acc = _pv_fp8(acc, alpha, p, v, tl.load(vs_ptrs + n_start, mask=n_ok, other=0.0), INTERPRET)
        else:
            acc = _dot(small_ops._to(p, v.dtype, INTERPRET), v, acc * alpha[:, None], INTERPRET)
        m_i = m_new
    has = l_i > 0.0  # an empty split (or a padded row) contributes nothing
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    if NUM_SPLITS == 1:
        if HAS_GATE:
            gate = tl.load(gate_ptr + b * stride_gb + heads[:, None] * stride_gh + offs_d[None, :],
                           mask=g_ok[:, None], other=0.0)
            o = o * tl.sigmoid(gate.to(tl.float32))
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 small_ops._to(o, o_ptr.dtype.element_ty, INTERPRET), mask=g_ok[:, None])
    else:
        row = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # part_* are [B, H, S(, Dh)]
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), -float("inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_ok)


@triton.jit
def _decode_combine_kernel(
    part_o_ptr, part_lse_ptr, gate_ptr, o_ptr,  #
    H,  #
    stride_gb, stride_gh, stride_ob, stride_oh,  #
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_GATE: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    pdl.enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (b * H + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < NUM_SPLITS, other=-float("inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top > -float("inf"), top, 0.0)  # a padded row (every split empty): no -inf - -inf
    w = tl.where(lse > -float("inf"), tl.exp2(lse - top), 0.0)
    total = tl.sum(w, axis=0)
    parts = tl.load(part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=offs_s[:, None] < NUM_SPLITS, other=0.0)
    o = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    if HAS_GATE:
        o = o * tl.sigmoid(tl.load(gate_ptr + b * stride_gb + h * stride_gh + offs_d).to(tl.float32))
    o = small_ops._to(o, o_ptr.dtype.element_ty, INTERPRET)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, o)


def _check_heads(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.shape != shape or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected shape {shape} with a contiguous last dim, got {tuple(t.shape)} "
                         f"strides {t.stride()}")


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    gate: torch.Tensor | None = None, config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Causal varlen attention over packed sequences; returns `[T, H, Dh]` (times sigmoid(gate) if given).

    `max_seqlen` is the longest sequence (host int the scheduler already knows, so no device sync);
    `config` overrides the tuned tiles (used by the benchmark sweep).
    """
    T, H, Dh = q.shape
    Hkv = k.shape[1]
    for name, t, shape in (("k", k, (T, Hkv, Dh)), ("v", v, (T, Hkv, Dh))):
        _check_heads(name, t, shape)
    return _launch_prefill(q, k, v, cu_seqlens, None, None, max_seqlen, gate, config, (False, k, k))


def prefill_attention_cached(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor, past: torch.Tensor, max_seqlen: int, gate: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked prefill: packed query chunks `q [T, H, Dh]` (`cu_seqlens`), chunk n continuing the sequence
    in slot `slot_ids[n]` (int32 `[N]`) after its first `past[n]` (int32 `[N]`) tokens. Attends causally
    over the slot's cache `[slots, Hkv, max_len, Dh]`, which must hold the chunk's own keys and values
    already (the engine writes them first; an FP8 cache with its `k_scale`, `v_scale`, `kv_cache.py`).
    `max_seqlen`: the longest chunk."""
    N = cu_seqlens.numel() - 1
    Dh = q.shape[2]
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_heads(name, t, (k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], Dh))
    for name, t in (("slot_ids", slot_ids), ("past", past)):
        if t.shape != (N,) or t.dtype != torch.int32:
            raise ValueError(f"{name}: expected int32 [{N}] (one per chunk), got {t.dtype} {tuple(t.shape)}")
    scales = cache_scales(k_cache, v_cache, k_scale, v_scale)
    return _launch_prefill(q, k_cache, v_cache, cu_seqlens, slot_ids, past, max_seqlen, gate, None, scales)


def _launch_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    slot_ids: torch.Tensor | None, past: torch.Tensor | None, max_seqlen: int, gate: torch.Tensor | None,
    config: dict[str, int] | None, scales: tuple[bool, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """`k, v`: packed `[T, Hkv, Dh]`, or the cache `[slots, Hkv, max_len, Dh]` when `slot_ids` is given;
    `scales`: (FP8?, k scales, v scales) from `kv_cache.cache_scales`."""
    T, H, Dh = q.shape
    Hkv = k.shape[1]
    _check_heads("q", q, (T, H, Dh))
    if gate is not None:
        _check_heads("gate", gate, (T, H, Dh))
    if H % Hkv or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"expected H % Hkv == 0 and int32 1-D cu_seqlens, got H={H} Hkv={Hkv} "
                         f"cu_seqlens {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    cached = slot_ids is not None
    # packed: (token, head) strides with a zero slot stride; cache: (slot, token, head)
    ks = (k.stride(0), k.stride(2), k.stride(1)) if cached else (0, k.stride(0), k.stride(1))
    vs = (v.stride(0), v.stride(2), v.stride(1)) if cached else (0, v.stride(0), v.stride(1))
    fp8, k_sc, v_sc = scales
    cfg = dict(config or _prefill_configs(Dh, fp8))
    o = torch.empty((T, H, Dh), dtype=q.dtype, device=q.device)
    g = gate if gate is not None else o
    grid = (triton.cdiv(max_seqlen, cfg["BLOCK_M"]), (cu_seqlens.numel() - 1) * H)
    _prefill_attn_kernel[grid](
        q, k, v, k_sc, v_sc, g, o, cu_seqlens,
        slot_ids if cached else cu_seqlens, past if cached else cu_seqlens,
        H, H // Hkv, Dh**-0.5 * _LOG2E,
        q.stride(0), q.stride(1), *ks, *vs, k_sc.stride(0), k_sc.stride(1),
        g.stride(0), g.stride(1), o.stride(0), o.stride(1),
        HEAD_DIM=Dh, HAS_GATE=gate is not None, CACHED=cached, FP8=fp8, INTERPRET=interpreting(), **cfg,
    )
    return o


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
    seq_lens: torch.Tensor, max_seqlen: int | None = None, gate: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per row: q `[B, H, Dh]` over its slot's first `seq_lens[b]` cached tokens (an FP8
    cache with its `k_scale`, `v_scale`: `kv_cache.py`).

    `max_seqlen` bounds every seq_len (default: the cache's max_len) and sets the split-KV count;
    a CUDA graph captures it per bucket. Returns `[B, H, Dh]`, times sigmoid(gate) if given.
    """
    B, H, Dh = q.shape
    _, Hkv, max_len, _ = k_cache.shape
    _check_heads("q", q, (B, H, Dh))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_heads(name, t, (k_cache.shape[0], Hkv, max_len, Dh))
    if gate is not None:
        _check_heads("gate", gate, (B, H, Dh))
    if slot_ids.shape != (B,) or seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"slot_ids/seq_lens: expected [{B}] (seq_lens int32), got {tuple(slot_ids.shape)}, "
                         f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
    if H % Hkv:
        raise ValueError(f"q: {H} heads is not a multiple of the cache's {Hkv} kv heads")
    fp8, k_sc, v_sc = cache_scales(k_cache, v_cache, k_scale, v_scale)
    cfg = dict(config or _decode_configs(Dh, fp8))
    min_split = cfg.pop("MIN_SPLIT")
    max_seqlen = max_len if max_seqlen is None else max_seqlen
    # Enough (row, kv head, split) programs to fill 132 SMs twice, but no split shorter than min_split.
    splits = max(1, min(math.ceil(264 / (B * Hkv)), triton.cdiv(max_seqlen, min_split)))
    split_len = triton.cdiv(triton.cdiv(max_seqlen, splits), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    splits = triton.cdiv(max_seqlen, split_len)
    o = torch.empty((B, H, Dh), dtype=q.dtype, device=q.device)
    part_o = torch.empty((B, H, splits, Dh) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, H, splits) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    g = gate if gate is not None else o
    _decode_attn_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, k_sc, v_sc, slot_ids, seq_lens, g, o, part_o, part_lse,
        H // Hkv, split_len, Dh**-0.5 * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_sc.stride(0), k_sc.stride(1),
        g.stride(0), g.stride(1), o.stride(0), o.stride(1),
        HEAD_DIM=Dh, BLOCK_G=max(16, triton.next_power_of_2(H // Hkv)), NUM_SPLITS=splits,
        HAS_GATE=gate is not None, FP8=fp8, INTERPRET=interpreting(), **cfg, **pdl.launch(o.device)
    )
    if splits > 1:
        _decode_combine_kernel[(B, H)](
            part_o, part_lse, g, o, H, g.stride(0), g.stride(1), o.stride(0), o.stride(1),
            HEAD_DIM=Dh, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), HAS_GATE=gate is not None,
            INTERPRET=interpreting(), num_warps=4, **pdl.launch(o.device)
        )
    return o


def prefill_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 causal softmax attention per sequence (GQA by repeating kv heads); `[T, H, Dh]`."""
    H, Dh = q.shape[1], q.shape[2]
    scale = Dh**-0.5
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        qs = q[s:e].float().transpose(0, 1)  # [H, L, Dh]
        ks = k[s:e].float().repeat_interleave(H // k.shape[1], 1).transpose(0, 1)
        vs = v[s:e].float().repeat_interleave(H // k.shape[1], 1).transpose(0, 1)
        att = (qs @ ks.transpose(1, 2)) * scale
        future = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1)
        att = att.masked_fill(future, -float("inf"))
        out[s:e] = (att.softmax(-1) @ vs).transpose(0, 1)
    return out * torch.sigmoid(gate.float()) if gate is not None else out


def decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
    seq_lens: torch.Tensor, gate: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 reference of `decode_attention`: row b attends to `cache[slot_ids[b], :, :seq_lens[b]]` (an FP8
    cache dequantized with its scales first)."""
    k_cache, v_cache = dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale)
    B, H, Dh = q.shape
    scale = Dh**-0.5
    out = torch.zeros((B, H, Dh), dtype=torch.float32, device=q.device)
    for b in range(B):
        n, slot = int(seq_lens[b]), int(slot_ids[b])
        if n == 0:
            continue
        ks = k_cache[slot, :, :n].float().repeat_interleave(H // k_cache.shape[1], 0)  # [H, n, Dh]
        vs = v_cache[slot, :, :n].float().repeat_interleave(H // k_cache.shape[1], 0)
        att = torch.einsum("hd,hnd->hn", q[b].float(), ks) * scale
        out[b] = torch.einsum("hn,hnd->hd", att.softmax(-1), vs)
    return out * torch.sigmoid(gate.float()) if gate is not None else out
