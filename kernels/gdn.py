"""Gated DeltaNet (Qwen3.5 linear attention): causal conv1d + SiLU, the gated delta rule, gated RMSNorm.

Layouts (last dim contiguous, row strides free so q/k/v can be views of the conv output
`[T, 2 * Hk * Dk + Hv * Dv]` = `[q | k | v]`):
- tokens packed `[T, ...]`, sequences delimited by `cu_seqlens [N + 1]` (int32) for prefill, one token
  per row for decode; `slot_ids [N]` maps a sequence to its state slot; a negative slot marks a
  padded row (CUDA graphs): it reads and writes no state and returns zeros.
- conv state pool `[slots, K - 1, C]`: the last K - 1 inputs, oldest first, time-major so every tap is
  one contiguous C-row.
- recurrent state pool `[slots, Hv, Dk, Dv]` fp32 (bf16 accepted: computed in fp32, stored rounded).
Math (HF `Qwen3_5MoeGatedDeltaNet`): q, k l2-normalised in fp32 (q also scaled by Dk^-0.5), v-head h
uses qk-head h // (Hv / Hk), `g = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`; per token
`S = S * exp(g); S += k (x) (v - S^T k) * beta; o = S^T q`. `gated_delta_rule(cu_seqlens=...)` runs
the same token recurrence over whole prompts (state in registers, one program per (sequence, v-head,
v-tile), from a zero state); `gdn_chunk.chunk_gated_delta_rule` computes the same function 64 tokens
at a time on tensor cores and is the prefill path for long prompts (measured 2026-11-30: the token
recurrence takes 3.25 ms for 4 x 1024 tokens).
Numerics: all fp32; expected error vs `*_ref` ~1e-3 relative (bf16 inputs/outputs).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _interpreted() -> bool:
    return "PYTEST_VERSION" in os.environ or os.environ.get("TRITON_INTERPRET") == "1"


def _delta_rule_configs(decode: bool, state_bytes: int = 4) -> dict[str, int]:
    """v-tile and warps. Decode: each program streams a `[Dk, BLOCK_V]` state tile, 128-byte rows (32 fp32
    or 64 bf16 values; measured 2026-11-30: fp32 32-wide tiles 73-79% of copy bandwidth, bf16 32-wide
    ones only 44-48%). Prefill: narrow tiles, more programs to hide the token loop's latency."""
    if _interpreted():
        return {"BLOCK_V": 16, "num_warps": 1}
    if decode:
        return {"BLOCK_V": 128 // state_bytes, "num_warps": 4}
    return {"BLOCK_V": 16, "num_warps": 4}


@triton.jit
def _conv1d_kernel(
    x_ptr, w_ptr, cu_ptr, slot_ptr, state_ptr, out_ptr,  #
    C,  #
    stride_xt, stride_wc, stride_ss, stride_sk, stride_ot,  #
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,  #
):
    seq = tl.program_id(1)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    seqlen = tl.load(cu_ptr + seq + 1) - start
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    if tl.program_id(0) * BLOCK_T < seqlen:
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(K):
            src = offs_t - (K - 1) + j  # causal: tap j reads token t - (K - 1 - j), zero before the start
            m = (src >= 0)[:, None] & (offs_t < seqlen)[:, None] & c_ok[None, :]
            x = tl.load(x_ptr + (start + src)[:, None] * stride_xt + offs_c[None, :], mask=m, other=0.0)
            w = tl.load(w_ptr + offs_c * stride_wc + j, mask=c_ok, other=0.0)
            acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
        out = acc * tl.sigmoid(acc)
        o_ok = (offs_t < seqlen)[:, None] & c_ok[None, :]
        o_ptrs = out_ptr + (start + offs_t)[:, None] * stride_ot + offs_c[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_ok)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if (tl.program_id(0) == 0) & (slot >= 0):  # the last K - 1 inputs become the decode state
        for j in tl.static_range(K - 1):
            src = seqlen - (K - 1) + j
            src_ok = (src + tl.zeros_like(offs_c)) >= 0
            x = tl.load(x_ptr + (start + src) * stride_xt + offs_c, mask=c_ok & src_ok, other=0.0)
            tl.store(state_ptr + slot * stride_ss + j * stride_sk + offs_c, x.to(state_ptr.dtype.element_ty),
                     mask=c_ok)


@triton.jit
def _conv1d_update_kernel(
    x_ptr, w_ptr, slot_ptr, state_ptr, out_ptr,  #
    C,  #
    stride_xb, stride_wc, stride_ss, stride_sk, stride_ob,  #
    K: tl.constexpr, BLOCK_C: tl.constexpr,  #
):
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
    tl.store(out_ptr + b * stride_ob + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slot_ptr, cu_ptr, o_ptr,  #
    HV_PER_K, q_scale,  #
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,  #
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,  #
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, DECODE: tl.constexpr,  #
):
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, DK)
    if DECODE:  # one token per row, continuing the slot's state
        start = seq
        end = seq + 1
    else:  # a whole sequence from a zero state
        start = tl.load(cu_ptr + seq).to(tl.int64)
        end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    hk = h // HV_PER_K
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    if slot < 0:  # padded row: zeros out, no state traffic
        for t in range(start, end):
            tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_v, tl.zeros([BLOCK_V], tl.float32).to(
                o_ptr.dtype.element_ty))
    else:
        if DECODE:
            S = tl.load(s_ptrs).to(tl.float32)  # [DK, BLOCK_V]
        else:
            S = tl.zeros([DK, BLOCK_V], tl.float32)
        neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        for t in range(start, end):
            q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + offs_k).to(tl.float32)
            k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + offs_k).to(tl.float32)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_v).to(tl.float32)
            a = tl.load(a_ptr + t * stride_at + h).to(tl.float32) + dt_bias
            beta = tl.sigmoid(tl.load(b_ptr + t * stride_bt + h).to(tl.float32))
            q = q * (q_scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
            softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
            S = S * tl.exp(neg_a * softplus)
            delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BLOCK_V]
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty))
        tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty))


@triton.jit
def _gated_rmsnorm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,  #
    R, eps,  #
    stride_x, stride_z, stride_out,  #
    D: tl.constexpr, BLOCK_R: tl.constexpr,  #
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = tl.arange(0, D)
    m = (rows < R)[:, None]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rows[:, None] * stride_z + offs[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None] * w[None, :] * (z * tl.sigmoid(z))
    tl.store(out_ptr + rows[:, None] * stride_out + offs[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.shape != shape or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected shape {shape} with a contiguous last dim, got {tuple(t.shape)} "
                         f"strides {t.stride()}")


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    conv_state: torch.Tensor, slot_ids: torch.Tensor,
) -> torch.Tensor:
    """Prefill: `silu(depthwise causal conv(x))` per sequence of packed x `[T, C]` (weight `[C, K]`, no
    bias, zero left padding); returns `[T, C]` and writes each sequence's last K - 1 inputs into
    `conv_state[slot_ids[n]]` (`[slots, K - 1, C]`)."""
    T, C = x.shape
    _check("x", x, (T, C))
    K = weight.shape[-1]
    _check("weight", weight, (C, K))
    _check("conv_state", conv_state, (conv_state.shape[0], K - 1, C))
    N = cu_seqlens.numel() - 1
    if cu_seqlens.dtype != torch.int32 or slot_ids.shape != (N,):
        raise ValueError(f"cu_seqlens/slot_ids: expected int32 [N + 1] and [N], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)} and {tuple(slot_ids.shape)}")
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    block_t, block_c = (16, 64) if _interpreted() else (32, 256)
    _conv1d_kernel[(triton.cdiv(max(max_seqlen, 1), block_t), N, triton.cdiv(C, block_c))](
        x, weight, cu_seqlens, slot_ids, conv_state, out,
        C,
        x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        K=K, BLOCK_T=block_t, BLOCK_C=block_c,
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
        K=K, BLOCK_C=block_c, num_warps=4,
    )
    return out


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None, config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The gated delta rule with the gate/beta math fused; returns `o [T, Hv, Dv]` in v's dtype.

    q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, a, b `[T, Hv]` (raw in_proj_a / in_proj_b outputs).
    Decode (`cu_seqlens=None`): one token per row, starting from and updating `state[slot_ids[t]]`.
    Prefill (`cu_seqlens [N + 1]` int32): each sequence starts from a zero state and its final state
    is written to `state[slot_ids[n]]` (`[slots, Hv, Dk, Dv]`, fp32 or bf16).
    """
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    for name, t, shape in (("q", q, (T, Hk, Dk)), ("k", k, (T, Hk, Dk)), ("v", v, (T, Hv, Dv)),
                           ("a", a, (T, Hv)), ("b", b, (T, Hv)),
                           ("state", state, (state.shape[0], Hv, Dk, Dv))):
        _check(name, t, shape)
    if Hv % Hk or A_log.shape != (Hv,) or dt_bias.shape != (Hv,):
        raise ValueError(f"expected Hv % Hk == 0 and A_log, dt_bias of shape ({Hv},); got Hk={Hk} Hv={Hv} "
                         f"A_log {tuple(A_log.shape)} dt_bias {tuple(dt_bias.shape)}")
    decode = cu_seqlens is None
    N = T if decode else cu_seqlens.numel() - 1
    if not decode and cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens: expected int32, got {cu_seqlens.dtype}")
    if slot_ids.shape != (N,):
        raise ValueError(f"slot_ids: expected shape ({N},) (one per {'row' if decode else 'sequence'}), "
                         f"got {tuple(slot_ids.shape)}")
    cfg = dict(config or _delta_rule_configs(decode, state.element_size()))
    if Dv % cfg["BLOCK_V"]:
        raise ValueError(f"v: head dim {Dv} is not a multiple of BLOCK_V={cfg['BLOCK_V']}")
    o = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    _delta_rule_kernel[(N, Hv, Dv // cfg["BLOCK_V"])](
        q, k, v, a, b, A_log, dt_bias, state, slot_ids, slot_ids if decode else cu_seqlens, o,
        Hv // Hk, Dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0),
        state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1),
        DK=Dk, DV=Dv, DECODE=decode, **cfg,
    )
    return o


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`w * rmsnorm(x) * silu(z)` over the last dim (a v-head, 128) of x, z `[..., Dv]`; plain w, not 1+w."""
    Dv = x.shape[-1]
    if z.shape != x.shape or weight.shape != (Dv,) or Dv & (Dv - 1):
        raise ValueError(f"z/weight: expected z of shape {tuple(x.shape)} and weight ({Dv},) with a "
                         f"power-of-two width, got {tuple(z.shape)} and {tuple(weight.shape)}")
    x2, z2 = x.reshape(-1, Dv), z.reshape(-1, Dv)
    _check("x", x2, x2.shape)
    _check("z", z2, z2.shape)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    R = x2.shape[0]
    block_r = 4 if _interpreted() else 16
    _gated_rmsnorm_kernel[(triton.cdiv(R, block_r),)](
        x2, z2, weight, out, R, eps, x2.stride(0), z2.stride(0), out.stride(0),
        D=Dv, BLOCK_R=block_r, num_warps=4,
    )
    return out.view(x.shape)


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


def gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 token loop of HF's `torch_recurrent_gated_delta_rule`: `(o [T, Hv, Dv], final [N, Hv, Dk, Dv])`.

    `initial_state [N, Hv, Dk, Dv]` continues sequences (decode); None starts them from zeros.
    """
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    rep = Hv // Hk
    qf = q.float() * torch.rsqrt(q.float().pow(2).sum(-1, keepdim=True) + 1e-6) * Dk**-0.5
    kf = k.float() * torch.rsqrt(k.float().pow(2).sum(-1, keepdim=True) + 1e-6)
    qf, kf = qf.repeat_interleave(rep, 1), kf.repeat_interleave(rep, 1)  # [T, Hv, Dk]
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())  # [T, Hv]
    beta = torch.sigmoid(b.float())
    o = torch.empty((T, Hv, Dv), dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    finals = []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        S = torch.zeros(Hv, Dk, Dv, device=q.device) if initial_state is None else initial_state[n].float()
        for t in range(s, e):
            S = S * g[t].exp()[:, None, None]  # reads/writes the whole state: the memory-bound term
            delta = (v[t].float() - (S * kf[t][:, :, None]).sum(1)) * beta[t][:, None]  # [Hv, Dv]
            S = S + kf[t][:, :, None] * delta[:, None, :]
            o[t] = (S * qf[t][:, :, None]).sum(1)
        finals.append(S)
    return o, torch.stack(finals)


def gated_rmsnorm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 reference of `gated_rmsnorm` (HF `Qwen3_5MoeRMSNormGated`)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed * weight.float() * torch.nn.functional.silu(z.float())
