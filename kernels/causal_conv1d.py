"""Causal depthwise conv1d + SiLU of Gated DeltaNet's q|k|v projection, prefill and single-step decode.

x `[T, C]` (last dim contiguous, row stride free), weight `[C, K]` (the checkpoint's `[C, 1, K]`
squeezed), no bias; `out[t] = silu(sum_j w[:, j] * x[t - (K - 1) + j])` with zeros before a
sequence's start (or, for a later chunk of a chunked prefill, the slot's state). Conv state pool
`[slots, K - 1, C]`: the last K - 1 inputs, oldest first, time-major so every tap is one contiguous
C-row; prefill writes it, decode rolls it in place.
A negative slot marks a padded decode row: no state traffic, zeros out. fp32 math, exact state copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl, small_ops
from batchinfer.kernels.gdn import _check, _check_past, _interpreted
from batchinfer.kernels.nvfp4_gemm import interpreting


@triton.jit
def _conv1d_kernel(
    x_ptr, w_ptr, cu_ptr, slot_ptr, past_ptr, state_ptr, out_ptr,  #
    C,  #
    stride_xt, stride_wc, stride_ss, stride_sk, stride_ot,  #
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CONTINUE: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
):
    tl.static_assert(BLOCK_T >= K - 1)  # taps before the chunk's start are read by the first program only
    seq = tl.program_id(1)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    seqlen = tl.load(cu_ptr + seq + 1) - start
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if CONTINUE:  # a later chunk of a chunked prefill: the inputs before it are the slot's conv state
        # (as a [BLOCK_C] mask: the interpreter cannot mask with a scalar-and-block product)
        cont_n = ((tl.load(past_ptr + seq) > 0) & (slot >= 0)).to(tl.int32)
        cont = (cont_n + tl.zeros_like(offs_c)) > 0
    if tl.program_id(0) * BLOCK_T < seqlen:
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(K):
            src = offs_t - (K - 1) + j  # causal: tap j reads token t - (K - 1 - j), zero before the start
            m = (src >= 0)[:, None] & (offs_t < seqlen)[:, None] & c_ok[None, :]
            ptrs = x_ptr + (start + src)[:, None] * stride_xt + offs_c[None, :]
            if CONTINUE:  # one load a tap: taps before the chunk point into the slot's state
                prev = (src < 0)[:, None] & (offs_t < seqlen)[:, None] & (c_ok & cont)[None, :]
                s_ptrs = state_ptr + slot * stride_ss + (K - 1 + src)[:, None] * stride_sk + offs_c[None, :]
                ptrs = tl.where(prev, s_ptrs, ptrs)
                m = m | prev
            x = tl.load(ptrs, mask=m, other=0.0)
            w = tl.load(w_ptr + offs_c * stride_wc + j, mask=c_ok, other=0.0)
            acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
        out = acc * tl.sigmoid(acc)
        o_ok = (offs_t < seqlen)[:, None] & c_ok[None, :]
        o_ptrs = out_ptr + (start + offs_t)[:, None] * stride_ot + offs_c[None, :]
        tl.store(o_ptrs, small_ops._to(out, out_ptr.dtype.element_ty, INTERPRET), mask=o_ok)
    if (tl.program_id(0) == 0) & (slot >= 0):  # the last K - 1 inputs become the decode state
        if CONTINUE:
            tl.debug_barrier()  # the taps above read the old state first
        for j in tl.static_range(K - 1):
            src = seqlen - (K - 1) + j
            src_ok = (src + tl.zeros_like(offs_c)) >= 0
            x = tl.load(x_ptr + (start + src) * stride_xt + offs_c, mask=c_ok & src_ok, other=0.0)
            if CONTINUE:  # a chunk shorter than K - 1 keeps part of the old state (entry j + seqlen,
                # read before this loop overwrites it: j + seqlen > j)
                old = tl.load(state_ptr + slot * stride_ss + (j + seqlen) * stride_sk + offs_c,
                              mask=c_ok & (src_ok == 0) & cont, other=0.0)
                x = tl.where(src_ok, x, old.to(x.dtype))
            tl.store(state_ptr + slot * stride_ss + j * stride_sk + offs_c, x.to(state_ptr.dtype.element_ty),
                     mask=c_ok)


@triton.jit
def _conv1d_update_kernel(
    x_ptr, w_ptr, slot_ptr, state_ptr, out_ptr,  #
    C,  #
    stride_xb, stride_wc, stride_ss, stride_sk, stride_ob,  #
    K: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    pdl.enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    out = tl.zeros([BLOCK_C], tl.float32)
    if slot >= 0:
        s_ptr = state_ptr + slot * stride_ss + offs_c
        x = tl.load(x_ptr + b * stride_xb + offs_c, mask=c_ok, other=0.0)
        w_last = tl.load(w_ptr + offs_c * stride_wc + K - 1, mask=c_ok, other=0.0)
        acc = x.to(tl.float32) * w_last.to(tl.float32)
        prev = tl.load(s_ptr, mask=c_ok, other=0.0)
        for j in tl.static_range(K - 1):
            w_j = tl.load(w_ptr + offs_c * stride_wc + j, mask=c_ok, other=0.0)
            acc += prev.to(tl.float32) * w_j.to(tl.float32)
            if j < K - 2:
                nxt = tl.load(s_ptr + (j + 1) * stride_sk, mask=c_ok, other=0.0)
                tl.store(s_ptr + j * stride_sk, nxt, mask=c_ok)  # roll left by one
                prev = nxt
        tl.store(s_ptr + (K - 2) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=c_ok)
        out = acc * tl.sigmoid(acc)
    out = small_ops._to(out, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + b * stride_ob + offs_c, out, mask=c_ok)


def _conv_configs() -> dict[str, int]:
    """Tokens and channels a prefill program, and its warps. Tuned on the H200 (`tune_attn --parts conv`,
    16 x 1,024 tokens of 8,192 channels, session 14): 16 x 256 on 4 warps, 215.6 us against 305.6 for
    the earlier 32 x 256."""
    if _interpreted():
        return {"BLOCK_T": 16, "BLOCK_C": 64, "num_warps": 4}
    return {"BLOCK_T": 16, "BLOCK_C": 256, "num_warps": 4}


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    conv_state: torch.Tensor, slot_ids: torch.Tensor, past: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Prefill: `silu(depthwise causal conv(x))` per sequence of packed x `[T, C]` (weight `[C, K]`, no
    bias, zero left padding); returns `[T, C]` and writes each sequence's last K - 1 inputs into
    `conv_state[slot_ids[n]]` (`[slots, K - 1, C]`). With `past` (int32 `[N]`, chunked prefill), a
    sequence with `past[n] > 0` continues its slot: the state holds the inputs before it. `config`
    (tuner) overrides `_conv_configs()`."""
    T, C = x.shape
    _check("x", x, (T, C))
    K = weight.shape[-1]
    _check("weight", weight, (C, K))
    _check("conv_state", conv_state, (conv_state.shape[0], K - 1, C))
    N = cu_seqlens.numel() - 1
    if cu_seqlens.dtype != torch.int32 or slot_ids.shape != (N,):
        raise ValueError(f"cu_seqlens/slot_ids: expected int32 [N + 1] and [N], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)} and {tuple(slot_ids.shape)}")
    _check_past(past, N)
    if past is not None and conv_state.dtype != x.dtype:
        raise ValueError(f"conv_state: expected {x.dtype} like x to continue a chunked prefill, got "
                         f"{conv_state.dtype}")
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    cfg = config or _conv_configs()
    block_t, block_c = cfg["BLOCK_T"], cfg["BLOCK_C"]
    _conv1d_kernel[(triton.cdiv(max(max_seqlen, 1), block_t), N, triton.cdiv(C, block_c))](
        x, weight, cu_seqlens, slot_ids, slot_ids if past is None else past, conv_state, out,
        C,
        x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        K=K, BLOCK_T=block_t, BLOCK_C=block_c, CONTINUE=past is not None, INTERPRET=interpreting(),
        num_warps=cfg["num_warps"],
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """Decode: one new input per row, x `[B, C]`; returns `silu(conv)` `[B, C]` over
    `[conv_state[slot], x]` and rolls x into the state in place."""
    B, C = x.shape
    _check("x", x, (B, C))
    K = weight.shape[-1]
    _check("weight", weight, (C, K))
    _check("conv_state", conv_state, (conv_state.shape[0], K - 1, C))
    if slot_ids.shape != (B,):
        raise ValueError(f"slot_ids: expected shape ({B},), got {tuple(slot_ids.shape)}")
    out = torch.empty((B, C), dtype=x.dtype, device=x.device)
    block_c = 64 if _interpreted() else 1024
    _conv1d_update_kernel[(B, triton.cdiv(C, block_c))](
        x, weight, slot_ids, conv_state, out,
        C,
        x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        K=K, BLOCK_C=block_c, INTERPRET=interpreting(), num_warps=4, **pdl.launch(out.device)
    )
    return out


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `(out [T, C], final_states [N, K - 1, C])`, per sequence as HF's `causal_conv1d_fn`."""
    K = weight.shape[-1]
    outs, states = [], []
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        xs = torch.nn.functional.pad(x[s:e].float().t(), (K - 1, 0))  # [C, K - 1 + L], zero history
        y = torch.nn.functional.conv1d(xs[None], weight.float()[:, None], groups=x.shape[1])[0]
        outs.append(torch.nn.functional.silu(y).t())
        states.append(xs[:, -(K - 1):].t())
    return torch.cat(outs), torch.stack(states)


def causal_conv1d_update_ref(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slot_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `(out [B, C], new conv_state)` for one decode step (the input state is not modified)."""
    state = conv_state.clone()
    window = torch.cat([conv_state[slot_ids.long()].float(), x.float()[:, None]], 1)  # [B, K, C]
    out = torch.nn.functional.silu((window * weight.float().t()[None]).sum(1))
    state[slot_ids.long()] = window[:, 1:].to(state.dtype)
    return out, state
