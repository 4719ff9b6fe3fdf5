"""Gated DeltaNet (Qwen3.5 linear attention): the gated delta rule and the gated RMSNorm after it
(the causal conv1d before it is `causal_conv1d.py`).

Layouts (last dim contiguous, row strides free so q/k/v can be views of the conv output
`[T, 2 * Hk * Dk + Hv * Dv]` = `[q | k | v]`):
- tokens packed `[T, ...]`, sequences delimited by `cu_seqlens [N + 1]` (int32) for prefill, one token
  per row for decode; `slot_ids [N]` maps a sequence to its state slot; a negative slot marks a
  padded row (CUDA graphs): it reads and writes no state and returns zeros.
- recurrent state pool `[slots, Hv, Dk, Dv]` fp32 (bf16 or fp16 accepted: computed in fp32, stored
  rounded; fp16 saturates at +-65504).
Math (HF `Qwen3_5MoeGatedDeltaNet`): q, k l2-normalised in fp32 (q also scaled by Dk^-0.5), v-head h
uses qk-head h // (Hv / Hk), `g = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`; per token
`S = S * exp(g); S += k (x) (v - S^T k) * beta; o = S^T q`. `gated_delta_rule(cu_seqlens=...)` runs
the same token recurrence over whole prompts (state in registers, one program per (sequence, v-head,
v-tile), from a zero state); `gdn_chunk.chunk_gated_delta_rule` computes the same function 64 tokens
at a time on tensor cores and is the prefill path for long prompts (measured 2026-11-30: the token
recurrence takes 3.25 ms for 4 x 1024 tokens). A 16-bit state costs accuracy: emulated on random
inputs with Mamba-style decays, bf16 outputs drift 2e-3 -> 1.2e-2 relative to the fp32-state path over
512 steps. A second emulation (2026-12-02, unit keys, 1,024 steps, a scratch script not kept) put bf16
at 6-8e-4 and fp16 (3 more mantissa bits) at 7-10e-5: ~8x closer. fp32 (the checkpoint's
`mamba_ssm_dtype`) is the default.
Head dims: any; one that is not a power of two (the demo model's 48) is padded to the next one with
zero-filled lanes, masks only in that case, so the power-of-two shapes compile to the code they always did.
Numerics: all fp32; expected error vs `*_ref` ~1e-3 relative (bf16 inputs/outputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchinfer.kernels import pdl, small_ops
from batchinfer.kernels.nvfp4_gemm import interpreting


def _interpreted() -> bool:
    """Small tiles under the Triton interpreter; CPU tests patch this to run the production tiles there.
    (GPU tests run the production tiles, as the engine does.)"""
    return interpreting()


def _delta_rule_configs(decode: bool, state_bytes: int = 4, rows: int = 0) -> dict[str, int]:
    """v-tile and warps. Decode: each program streams a `[Dk, BLOCK_V]` state tile. From 32 rows, 64-wide
    tiles on 4 warps (H200, 2026-12-05, fp32 state: 40.3 / 144.7 / 563.6 us at 32 / 128 / 512 rows
    against 42.9 / 166.7 / 656.4 for 32-wide; 3.8 TB/s of state at 512; the same order on an H100;
    a persistent launch with pipelined tile loads lost to both); below, 128-byte rows (32 fp32 or 64
    bf16 values), twice the programs for a small batch (not timed against 64-wide there). Prefill:
    narrow tiles, more programs to hide the token loop's latency."""
    if _interpreted():
        return {"BLOCK_V": 16, "num_warps": 1}
    if decode:
        return {"BLOCK_V": 64 if rows >= 32 else 128 // state_bytes, "num_warps": 4}
    return {"BLOCK_V": 16, "num_warps": 4}


@triton.jit
def _load(ptrs, ok, PAD: tl.constexpr):
    """Unmasked load on the power-of-two path (the code real shapes compile to); masked, zero-filled when
    a head dim is padded up to its power-of-two tile."""
    if PAD:
        x = tl.load(ptrs, mask=ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _store(ptrs, x, ok, PAD: tl.constexpr):
    """Store counterpart of `_load`: masked only when a head dim is padded."""
    if PAD:
        tl.store(ptrs, x, mask=ok)
    else:
        tl.store(ptrs, x)


@triton.jit
def _rule_step(S, q, k, v, a, b, neg_a, q_scale):
    """One token on a state tile `S [BLOCK_K, BLOCK_V]` (fp32) from its raw q, k `[BLOCK_K]`, v `[BLOCK_V]`,
    a (with dt_bias added) and b: returns (S, o `[BLOCK_V]`)."""
    beta = tl.sigmoid(b)
    q = q * (q_scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    S = S * tl.exp(neg_a * softplus)
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BLOCK_V]
    S = S + k[:, None] * delta[None, :]
    return S, tl.sum(S * q[:, None], axis=0)


@triton.jit
def _delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slot_ptr, cu_ptr, past_ptr,  #
    o_ptr,  #
    HV_PER_K, q_scale,  #
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,  #
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,  #
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,  #
    DECODE: tl.constexpr, CONTINUE: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    # Padded (e.g. Dk = Dv = 48 in a 64-wide tile): zeros in the padded k lanes keep the norms, S's extra
    # rows and every dot exact; padded v lanes are computed on zeros and never stored.
    pdl.enter(PDL)
    PAD: tl.constexpr = (BLOCK_K != DK) | (DV % BLOCK_V != 0)
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    s_ok = k_ok[:, None] & v_ok[None, :]
    if DECODE:  # one token per row, continuing the slot's state
        start = seq
        end = seq + 1
    else:  # a whole sequence from a zero state, or (CONTINUE, past[seq] > 0) a chunk of one
        start = tl.load(cu_ptr + seq).to(tl.int64)
        end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    hk = h // HV_PER_K
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    if slot < 0:  # padded row: zeros out, no state traffic
        for t in range(start, end):
            _store(o_ptr + t * stride_ot + h * stride_oh + offs_v,
                   tl.zeros([BLOCK_V], tl.float32).to(o_ptr.dtype.element_ty), v_ok, PAD)
    else:
        S = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)
        if DECODE:
            S = _load(s_ptrs, s_ok, PAD).to(tl.float32)  # [BLOCK_K, BLOCK_V]
        elif CONTINUE:
            if tl.load(past_ptr + seq) > 0:
                S = _load(s_ptrs, s_ok, PAD).to(tl.float32)
        neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        for t in range(start, end):
            q = _load(q_ptr + t * stride_qt + hk * stride_qh + offs_k, k_ok, PAD).to(tl.float32)
            k = _load(k_ptr + t * stride_kt + hk * stride_kh + offs_k, k_ok, PAD).to(tl.float32)
            v = _load(v_ptr + t * stride_vt + h * stride_vh + offs_v, v_ok, PAD).to(tl.float32)
            a = tl.load(a_ptr + t * stride_at + h).to(tl.float32) + dt_bias
            b = tl.load(b_ptr + t * stride_bt + h).to(tl.float32)
            S, o = _rule_step(S, q, k, v, a, b, neg_a, q_scale)
            o = small_ops._to(o, o_ptr.dtype.element_ty, INTERPRET)
            _store(o_ptr + t * stride_ot + h * stride_oh + offs_v, o, v_ok, PAD)
        _store(s_ptrs, small_ops._to_state(S, state_ptr.dtype.element_ty, INTERPRET), s_ok, PAD)


@triton.jit
def _gated_rmsnorm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,  #
    R, H, eps,  #
    stride_xt, stride_xh, stride_zt, stride_zh, stride_out,  #
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr,  #
    PDL: tl.constexpr = False,  #
):
    """Rows r = (t, h) of x, z `[T, H, D]` with free t and h strides (z is a view of the in-projection)."""
    pdl.enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    t, h = rows // H, rows % H
    offs = tl.arange(0, BLOCK_D)
    d_ok = offs < D
    if BLOCK_D == D:
        m = (rows < R)[:, None]
    else:  # padded width: zeros in the extra lanes leave the sum of squares exact
        m = (rows < R)[:, None] & d_ok[None, :]
    x_rows = x_ptr + t * stride_xt + h * stride_xh
    z_rows = z_ptr + t * stride_zt + h * stride_zh
    x = tl.load(x_rows[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_rows[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
    w = _load(w_ptr + offs, d_ok, BLOCK_D != D).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None] * w[None, :] * (z * tl.sigmoid(z))
    y = small_ops._to(y, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + rows[:, None] * stride_out + offs[None, :], y, mask=m)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.shape != shape or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected shape {shape} with a contiguous last dim, got {tuple(t.shape)} "
                         f"strides {t.stride()}")


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None, config: dict[str, int] | None = None,
    past: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule with the gate/beta math fused; returns `o [T, Hv, Dv]` in v's dtype.

    q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, a, b `[T, Hv]` (raw in_proj_a / in_proj_b outputs).
    Decode (`cu_seqlens=None`): one token per row, starting from and updating `state[slot_ids[t]]`.
    Prefill (`cu_seqlens [N + 1]` int32): each sequence starts from a zero state and its final state
    is written to `state[slot_ids[n]]` (`[slots, Hv, Dk, Dv]`, fp32 or bf16); with `past` (int32 `[N]`,
    chunked prefill) a sequence with `past[n] > 0` is a later chunk and starts from its slot's state.
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
    _check_past(past, N, decode)
    cfg = config or _delta_rule_configs(decode, state.element_size(), N)
    o = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    _delta_rule_kernel[(N, Hv, triton.cdiv(Dv, cfg["BLOCK_V"]))](
        q, k, v, a, b, A_log, dt_bias, state, slot_ids, slot_ids if decode else cu_seqlens,
        slot_ids if past is None else past, o,
        Hv // Hk, Dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0),
        state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1),
        DK=Dk, DV=Dv, BLOCK_K=triton.next_power_of_2(Dk), DECODE=decode, CONTINUE=past is not None,
        INTERPRET=interpreting(), **cfg, **pdl.launch(o.device)
    )
    return o


def _check_past(past: torch.Tensor | None, n: int, decode: bool = False) -> None:
    """`past` of chunked prefill: int32, one per sequence; decode continues every row anyway."""
    if past is None:
        return
    if decode or past.shape != (n,) or past.dtype != torch.int32:
        raise ValueError(f"past: expected int32 [{n}] (one per prefill sequence), got {past.dtype} "
                         f"{tuple(past.shape)}" + (" with cu_seqlens=None (decode)" if decode else ""))


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`w * rmsnorm(x) * silu(z)` over the last dim (a v-head: 128, 48 in the demo model) of x, z `[..., Dv]`;
    plain w, not 1+w."""
    Dv = x.shape[-1]
    if z.shape != x.shape or weight.shape != (Dv,):
        raise ValueError(f"z/weight: expected z of shape {tuple(x.shape)} and weight ({Dv},), got "
                         f"{tuple(z.shape)} and {tuple(weight.shape)}")
    # as [T, H, Dv] views: a head-strided z (the engine's, a slice of the in-projection) is read in place
    x3, z3 = (t.reshape(-1, 1, Dv) if t.dim() < 3 else t.reshape(-1, *t.shape[-2:]) for t in (x, z))
    _check("x", x3, x3.shape)
    _check("z", z3, z3.shape)
    H = x3.shape[1]
    R = x3.shape[0] * H
    out = torch.empty((R, Dv), dtype=x.dtype, device=x.device)
    block_r = 16
    _gated_rmsnorm_kernel[(triton.cdiv(R, block_r),)](
        x3, z3, weight, out, R, H, eps, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), out.stride(0),
        D=Dv, BLOCK_D=triton.next_power_of_2(Dv), BLOCK_R=block_r, INTERPRET=interpreting(), num_warps=4,
        **pdl.launch(out.device),
    )
    return out.view(x.shape)


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
