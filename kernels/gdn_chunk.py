"""Chunked gated delta rule for prefill: the same function as `gdn.gated_delta_rule(cu_seqlens=...)`,
computed 64 tokens at a time on tensor cores instead of one token at a time.

Per chunk of BT tokens with inclusive log-decay cumsum G, the WY form of the delta rule gives
(rows t, s of the chunk; S the state entering the chunk, `[Dk, Dv]`):
  A[t, s]  = beta_t exp(G_t - G_s) k_t . k_s           for s < t      (strictly lower)
  Tm       = (I + A)^-1                                 (forward substitution, fp32)
  U        = Tm (beta * V - (beta exp(G) * K) S)        (the per-token deltas)
  O        = exp(G) * (Q S) + [exp(G_t - G_s) q_t . k_s]_{s <= t} U
  S'       = exp(G_last) S + (exp(G_last - G) * K)^T U
Layouts, gate math and state pool as in `gdn.py` (sequences from a zero state, final state written to
`state[slot_ids[n]]`). One program per (sequence, v-head, v-tile) walks its chunks in order, the state
in registers. Numerics: Tm and the state in fp32; dot operands in the input dtype (bf16) with fp32
accumulation, as FLA does; expected error vs `gdn.gated_delta_rule_ref` ~2e-3 relative.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchinfer.kernels.gdn import _interpreted


def _chunk_configs() -> dict[str, int]:
    """Chunk and v-tile from the sm_90 compile report (`python -m batchinfer.bench.sm90_report`), not yet
    timed: 64-token chunks keep wgmma (M = 64); 16-wide v-tiles on 8 warps spill 64 B, wider ones 150+."""
    if _interpreted():
        return {"BT": 16, "BLOCK_V": 16, "num_warps": 4, "num_stages": 1}
    return {"BT": 64, "BLOCK_V": 16, "num_warps": 8, "num_stages": 1}


@triton.jit
def _chunk_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slot_ptr, cu_ptr, o_ptr,  #
    HV_PER_K, q_scale,  #
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,  #
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,  #
    DK: tl.constexpr, BT: tl.constexpr, BLOCK_V: tl.constexpr,  #
):
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // HV_PER_K
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, DK)
    rows = tl.arange(0, BT)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    S = tl.zeros([DK, BLOCK_V], tl.float32)
    for c0 in range(start, end, BT):
        t = c0 + rows
        ok = t < end
        # keys (bf16 after the fp32 l2 norm), gates, and the WY solve first: fewer live tiles
        k_ptrs = k_ptr + t[:, None] * stride_kt + hk * stride_kh + offs_k[None, :]
        k = tl.load(k_ptrs, mask=ok[:, None], other=0.0)
        k_rnorm = 1.0 / tl.sqrt(tl.sum(k.to(tl.float32) * k.to(tl.float32), axis=1) + 1e-6)
        kd = (k.to(tl.float32) * k_rnorm[:, None]).to(k.dtype)
        a = tl.load(a_ptr + t * stride_at + h, mask=ok, other=0.0).to(tl.float32) + dt_bias
        b = tl.load(b_ptr + t * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
        beta = tl.where(ok, tl.sigmoid(b), 0.0)
        g = tl.where(ok, neg_a * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0)))), 0.0)
        G = tl.cumsum(g, axis=0)  # padded rows add 0, so G[BT - 1] is the chunk's total decay
        g_last = tl.sum(tl.where(rows == BT - 1, G, 0.0), axis=0)
        lower = rows[:, None] > rows[None, :]
        A = tl.where(lower, tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0)) * beta[:, None], 0.0)
        A = A * tl.dot(kd, tl.trans(kd))
        Tm = (rows[:, None] == rows[None, :]).to(tl.float32)  # row i = e_i - A[i, :i] Tm[:i]
        for i in range(1, BT):
            a_row = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)  # [BT]
            new = tl.where(rows == i, 1.0, -tl.sum(a_row[:, None] * Tm, axis=0))
            Tm = tl.where(rows[:, None] == i, new[None, :], Tm)
        Td = Tm.to(kd.dtype)
        v_ptrs = v_ptr + t[:, None] * stride_vt + h * stride_vh + offs_v[None, :]
        v = tl.load(v_ptrs, mask=ok[:, None], other=0.0)
        Sd = S.to(kd.dtype)
        k_beta = (kd.to(tl.float32) * (beta * tl.exp(G))[:, None]).to(kd.dtype)
        # U = Tm (beta V - beta e^G K S): associated so that no [BT, Dk] fp32 tile is formed
        rhs = v.to(tl.float32) * beta[:, None] - tl.dot(k_beta, Sd)  # [BT, BV]
        ud = tl.dot(Td, rhs.to(kd.dtype)).to(kd.dtype)
        q_ptrs = q_ptr + t[:, None] * stride_qt + hk * stride_qh + offs_k[None, :]
        q = tl.load(q_ptrs, mask=ok[:, None], other=0.0)
        q_rnorm = q_scale / tl.sqrt(tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1) + 1e-6)
        qd = (q.to(tl.float32) * q_rnorm[:, None]).to(kd.dtype)
        causal = rows[:, None] >= rows[None, :]
        qk = tl.dot(qd, tl.trans(kd)) * tl.exp(tl.where(causal, G[:, None] - G[None, :], -float("inf")))
        o = tl.dot(qd, Sd) * tl.exp(G)[:, None] + tl.dot(qk.to(kd.dtype), ud)
        o_ptrs = o_ptr + t[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=ok[:, None])
        k_tail = (kd.to(tl.float32) * tl.exp(g_last - G)[:, None]).to(kd.dtype)
        S = S * tl.exp(g_last) + tl.dot(tl.trans(k_tail), ud)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty))


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
    cu_seqlens: torch.Tensor, config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Prefill form of `gdn.gated_delta_rule` (same arguments and result), chunked on tensor cores."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    for name, t, shape in (("q", q, (T, Hk, Dk)), ("k", k, (T, Hk, Dk)), ("v", v, (T, Hv, Dv)),
                           ("a", a, (T, Hv)), ("b", b, (T, Hv)),
                           ("state", state, (state.shape[0], Hv, Dk, Dv))):
        if t.shape != shape or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected shape {shape} with a contiguous last dim, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    N = cu_seqlens.numel() - 1
    if Hv % Hk or cu_seqlens.dtype != torch.int32 or slot_ids.shape != (N,):
        raise ValueError(f"expected Hv % Hk == 0, int32 cu_seqlens and slot_ids [{N}]; got Hk={Hk} Hv={Hv}, "
                         f"{cu_seqlens.dtype}, {tuple(slot_ids.shape)}")
    cfg = dict(config or _chunk_configs())
    if Dv % cfg["BLOCK_V"]:
        raise ValueError(f"v: head dim {Dv} is not a multiple of BLOCK_V={cfg['BLOCK_V']}")
    o = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    _chunk_delta_rule_kernel[(N, Hv, Dv // cfg["BLOCK_V"])](
        q, k, v, a, b, A_log, dt_bias, state, slot_ids, cu_seqlens, o,
        Hv // Hk, Dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0),
        state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1),
        DK=Dk, **cfg,
    )
    return o
