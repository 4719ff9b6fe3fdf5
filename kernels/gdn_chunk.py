"""Chunked gated delta rule for prefill: the same function as `gdn.gated_delta_rule(cu_seqlens=...)`,
computed 64 tokens at a time on tensor cores instead of one token at a time.

Per chunk of BT tokens with inclusive log-decay cumsum G, the WY form of the delta rule gives
(rows t, s of the chunk; S the state entering the chunk, `[Dk, Dv]`):
  A[t, s]  = beta_t exp(G_t - G_s) k_t . k_s           for s < t      (strictly lower)
  Tm       = (I + A)^-1                                 (fp32, formed explicitly)
  U        = Tm (beta * V) - Tm (beta exp(G) * K) S     (the per-token deltas)
  O        = exp(G) * (Q S) + [exp(G_t - G_s) q_t . k_s]_{s <= t} U
  S'       = exp(G_last) S + (exp(G_last - G) * K)^T U
Layouts, gate math and state pool as in `gdn.py` (sequences from a zero state, or from their slot's state for
later pieces of a chunked prefill; final state written to `state[slot_ids[n]]`). Five launches, split as in
FLA so that each is short and light on registers (many programs an SM; sm_90 compile, docs/PERF.md session
17): three do everything that depends on neither S nor the other chunks, for all chunks at once:
`_chunk_scores_kernel` (G, the decayed keys of the state update, the decayed causal scores of Q K^T and A,
in workspaces), `_chunk_inverse_kernel` (Tm in place of A, 16 x 16 blocks at a time) and `_chunk_wu_kernel`
(W = Tm (beta exp(G) K), U0 = Tm (beta V)); `_chunk_state_kernel` walks each sequence's chunks in order (one
program per (sequence, v-head, v-tile), the state in registers) and does only U = U0 - W S and the state
update, writing U and the state entering each chunk (bf16); `_chunk_out_kernel` then computes every chunk's
outputs at once, O = exp(G) (Q S) + scores U. Head dims that are not powers of two (the demo model's 48) run
in tiles padded to the next one (at least 16, for the dots), zero-filled by masks that only padded shapes
compile. Numerics: A, Tm and the state in fp32; Tm's diagonal blocks in full fp32, the dots that form the rest
of Tm and apply it in tf32, the others with operands in the input dtype (bf16), all with fp32 accumulation;
expected error vs `gdn.gated_delta_rule_ref` ~3e-3 relative. Under the Triton CPU interpreter (`INTERPRET`,
set by the launcher) the dots take fp32 operands and the bf16 casts round to nearest explicitly, working
around Triton 3.9's interpreter; compiled code is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from batchinfer.kernels import small_ops
from batchinfer.kernels.gdn import _check_past, _interpreted
from batchinfer.kernels.nvfp4_gemm import interpreting


def _chunk_configs(seqs: int = 1) -> dict[str, int]:
    """Chunk, v-tile, warps and stages of the five launches for a pass of `seqs` sequences. 64-token chunks
    keep wgmma (M = 64). Tuned on the H200 (`tune_attn --parts gdn_chunk`, docs/PERF.md sessions 14 and
    18): 64-wide v-tiles on 4 warps once the sequential launch (seqs x 32 heads x 128 / BLOCK_V programs)
    fills the SMs anyway (8 x 2,048 tokens: 2,461 -> 1,681 us a layer against 16-wide tiles), there with
    two pipeline stages (two programs an SM: 1,412 -> 1,385 us); one sequence (a 512-token prompt) keeps
    more programs with 32-wide tiles on 8 warps. The scores launch runs on 4 warps: when it ran a program a
    v-head, that took 1,412 -> 1,318 us at 8 x 2,048 (78.6 -> 80.1 at one sequence); a program a k-head
    (session 18, untimed) holds 174 registers on 8 warps (one program an SM), 244 on 4 (two). The inverse
    and W/U launches' warps won no sweep."""
    base = {"BT": 64, "state_stages": 3, "scores_warps": 4, "inv_warps": 1, "wu_warps": 4, "out_warps": 8}
    if _interpreted():
        return base | {"BT": 16, "BLOCK_V": 16, "num_warps": 4, "out_warps": 4}
    if seqs < 4:
        return base | {"BLOCK_V": 32, "num_warps": 8}
    return base | {"BLOCK_V": 64, "num_warps": 4, "state_stages": 2}


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    """a @ b in fp32. Under the interpreter (INTERPRET, set by the launcher) the operands go in as fp32,
    since Triton 3.9's interpreter multiplies bf16 operands as raw bits; they hold bf16 values already."""
    if INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _gates(a_ptr, b_ptr, t, ok, h, stride_at, stride_bt, neg_a, dt_bias):
    """beta and the inclusive log-decay cumsum G of one chunk (padded rows: beta 0, g 0)."""
    a = tl.load(a_ptr + t * stride_at + h, mask=ok, other=0.0).to(tl.float32) + dt_bias
    b = tl.load(b_ptr + t * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
    beta = tl.where(ok, tl.sigmoid(b), 0.0)
    g = tl.where(ok, neg_a * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0)))), 0.0)
    return beta, tl.cumsum(g, axis=0)


@triton.jit
def _chunk_rows(cu_ptr, BT: tl.constexpr):
    """A chunk-parallel program's rows: program (sequence, chunk, head) -> (sequence, head, whether the
    chunk exists, row index [BT], token index t [BT], which rows exist). The head is a v-head, or a k-head
    in the scores launch."""
    seq = tl.program_id(0).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    c0 = tl.load(cu_ptr + seq).to(tl.int64) + tl.program_id(1) * BT
    rows = tl.arange(0, BT)
    t = c0 + rows
    return seq, tl.program_id(2), c0 < end, rows, t, t < end


@triton.jit
def _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, t, ok, h, stride_at, stride_bt):
    """`_gates` of one chunk of v-head h, its per-head constants loaded here."""
    neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    return _gates(a_ptr, b_ptr, t, ok, h, stride_at, stride_bt, neg_a, dt_bias)


@triton.jit
def _tile_mask(row_ok, col_ok, PAD: tl.constexpr):
    """Mask of a `[rows, head dim]` tile: the rows alone on the power-of-two path, the padded head-dim
    lanes too when the head dim is padded up to its tile (their zeros leave every dot exact)."""
    if PAD:
        m = row_ok[:, None] & col_ok[None, :]
    else:
        m = row_ok[:, None]
    return m


@triton.jit
def _l2_rows(ptr, t, ok, stride_t, offs_k, k_ok, scale, PAD: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows of a q or k tile, l2-normalised in fp32 (times scale), back in the input dtype."""
    x = tl.load(ptr + t[:, None] * stride_t + offs_k[None, :], mask=_tile_mask(ok, k_ok, PAD), other=0.0)
    xf = x.to(tl.float32)
    return small_ops._to(xf * (scale / tl.sqrt(tl.sum(xf * xf, axis=1) + 1e-6))[:, None], x.dtype, INTERPRET)


@triton.jit
def _inv_norms(ptr, t, ok, stride_t, offs_k, k_ok, PAD: tl.constexpr):
    """1 / l2 norm of each row, as `_l2_rows` scales them (fp32 `[BT]`)."""
    x = tl.load(ptr + t[:, None] * stride_t + offs_k[None, :], mask=_tile_mask(ok, k_ok, PAD), other=0.0)
    xf = x.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) + 1e-6)


@triton.jit
def _scaled_cols(ptr, t, ok, stride_t, offs, col_ok, row_scale, PAD: tl.constexpr, INTERPRET: tl.constexpr):
    """Columns `offs` of the rows, times row_scale `[BT]` in fp32, rounded to the input dtype (with
    `_inv_norms`, a column slice of `_l2_rows`' tile, bit for bit)."""
    x = tl.load(ptr + t[:, None] * stride_t + offs[None, :], mask=_tile_mask(ok, col_ok, PAD), other=0.0)
    return small_ops._to(x.to(tl.float32) * row_scale[:, None], x.dtype, INTERPRET)


@triton.jit
def _dot_tf32(a, b, INTERPRET: tl.constexpr):
    """a @ b of fp32 tiles on the tf32 tensor cores (10-bit mantissas: 4x finer than bf16 operands)."""
    if INTERPRET:
        out = tl.dot(a, b)
    else:
        out = tl.dot(a, b, input_precision="tf32")
    return out


@triton.jit
def _chunk_scores_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, cu_ptr, kt_ptr, qk_ptr, g_ptr, am_ptr,  #
    q_scale,  #
    stride_qt, stride_qh, stride_kt, stride_kh, stride_at, stride_bt,  #
    stride_kt_t, stride_kt_h, stride_qkt, stride_qkh, stride_gt, stride_amt, stride_amh,  #
    HV_PER_K: tl.constexpr, DK: tl.constexpr, BLOCK_K: tl.constexpr, BT: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
):
    """Per (sequence, chunk, k-head), what needs only the chunk's own keys and gates, for each of the
    HV_PER_K v-heads that share the k-head: its cumulative gates G (fp32 `[T, Hv]`: the sequential kernel
    loads 4 bytes a row, which cp.async pipelines), the keys of the state update (unit keys times
    exp(G_last - G), `[T, Hv, DK]`), the decayed causal scores [exp(G_t - G_s) q_t . k_s]_{s <= t} (bf16
    `[T, Hv, BT]`, for the output launch) and A = [beta_t exp(G_t - G_s) k_t . k_s]_{s < t} (fp32
    `[T, Hv, BT]`, its diagonal and the blocks below it: the inverse launch reads nothing else). The
    normalised q and k and their two dots are the k-head's, so they are made once for its v-heads."""
    PAD: tl.constexpr = BLOCK_K != DK
    _, hk, live, rows, t, ok = _chunk_rows(cu_ptr, BT)
    if live:
        offs_k = tl.arange(0, BLOCK_K)
        k_ok = offs_k < DK
        kd = _l2_rows(k_ptr + hk * stride_kh, t, ok, stride_kt, offs_k, k_ok, 1.0, PAD, INTERPRET)
        lower = rows[:, None] > rows[None, :]
        last = tl.sum(ok.to(tl.int32), axis=0) - 1  # the chunk's last real row
        kk = _dot(kd, tl.trans(kd), INTERPRET)
        for j in tl.static_range(HV_PER_K):  # two loops: one 64 x 64 fp32 tile live at a time
            h = hk * HV_PER_K + j
            beta, G = _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, t, ok, h, stride_at, stride_bt)
            tl.store(g_ptr + t * stride_gt + h, G, mask=ok)
            g_last = tl.sum(tl.where(rows == last, G, 0.0), axis=0)
            k_tail = small_ops._to(kd.to(tl.float32) * tl.exp(g_last - G)[:, None], kd.dtype, INTERPRET)
            tl.store(kt_ptr + t[:, None] * stride_kt_t + h * stride_kt_h + offs_k[None, :], k_tail,
                     mask=_tile_mask(ok, k_ok, PAD))
            A = tl.where(lower, tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0)) * beta[:, None], 0.0)
            tl.store(am_ptr + t[:, None] * stride_amt + h * stride_amh + rows[None, :], A * kk,
                     mask=ok[:, None] & (rows[:, None] // 16 >= rows[None, :] // 16))
        qd = _l2_rows(q_ptr + hk * stride_qh, t, ok, stride_qt, offs_k, k_ok, q_scale, PAD, INTERPRET)
        qk0 = _dot(qd, tl.trans(kd), INTERPRET)
        causal = rows[:, None] >= rows[None, :]
        for j in tl.static_range(HV_PER_K):
            h = hk * HV_PER_K + j
            _beta, G = _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, t, ok, h, stride_at, stride_bt)
            qk = qk0 * tl.exp(tl.where(causal, G[:, None] - G[None, :], -float("inf")))
            tl.store(qk_ptr + t[:, None] * stride_qkt + h * stride_qkh + rows[None, :],
                     small_ops._to(qk, kd.dtype, INTERPRET), mask=ok[:, None])


@triton.jit
def _inv16(D):
    """(I + D)^-1 of a strictly lower 16 x 16 block D, as (I - D)(I + D^2)(I + D^4)(I + D^8) (D^16 = 0): six
    dots in full fp32, no sequential steps. |D| <= 1 entrywise (beta < 1, decays <= 1, unit keys), so the
    powers stay below C(15, 8)."""
    r = tl.arange(0, 16)
    T = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - D
    for _p in tl.static_range(3):  # D^2, D^4, D^8
        D = tl.dot(D, D, input_precision="ieee")
        T = T + tl.dot(T, D, input_precision="ieee")
    return T


@triton.jit
def _block(ptr, i, j, c0, end, stride_t):
    """Block (i, j) of a chunk's 16 x 16 blocks: rows c0 + 16 i.., columns 16 j.. (rows past `end` zero)."""
    r = tl.arange(0, 16)
    t = c0 + 16 * i + r
    return tl.load(ptr + t[:, None] * stride_t + 16 * j + r[None, :], mask=(t < end)[:, None], other=0.0)


@triton.jit
def _put_block(ptr, x, i, j, c0, end, stride_t):
    r = tl.arange(0, 16)
    t = c0 + 16 * i + r
    tl.store(ptr + t[:, None] * stride_t + 16 * j + r[None, :], x, mask=(t < end)[:, None])


@triton.jit
def _chunk_inverse_kernel(am_ptr, cu_ptr, stride_t, stride_h, BT: tl.constexpr, INTERPRET: tl.constexpr):
    """Per (sequence, chunk, v-head), in place: A -> (I + A)^-1 (fp32, lower blocks), 16 x 16 blocks at a
    time: the diagonal blocks' inverses T_i (`_inv16`), then the blocks below them by block forward
    substitution, X_ij = -T_i sum_{j <= m < i} A_im X_mj (X_jj = T_j; tf32 dots). Small tiles keep the
    registers low (a program is one or two warps, many to an SM), where forming the inverse on 64 x 64
    tiles held one 8-warp program an SM, each a long chain of dependent dots (sm_90 compile, session 17)."""
    NB: tl.constexpr = BT // 16
    tl.static_assert(NB == 1 or NB == 2 or NB == 4)
    seq = tl.program_id(0).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    c0 = tl.load(cu_ptr + seq).to(tl.int64) + tl.program_id(1) * BT
    if c0 < end:
        p = am_ptr + tl.program_id(2) * stride_h
        T0 = _inv16(_block(p, 0, 0, c0, end, stride_t))
        _put_block(p, T0, 0, 0, c0, end, stride_t)
        if NB > 1:
            T1 = _inv16(_block(p, 1, 1, c0, end, stride_t))
            A10 = _block(p, 1, 0, c0, end, stride_t)
            X10 = -_dot_tf32(T1, _dot_tf32(A10, T0, INTERPRET), INTERPRET)
            _put_block(p, T1, 1, 1, c0, end, stride_t)
            _put_block(p, X10, 1, 0, c0, end, stride_t)
            if NB > 2:
                T2 = _inv16(_block(p, 2, 2, c0, end, stride_t))
                T3 = _inv16(_block(p, 3, 3, c0, end, stride_t))
                A20 = _block(p, 2, 0, c0, end, stride_t)
                A21 = _block(p, 2, 1, c0, end, stride_t)
                A30 = _block(p, 3, 0, c0, end, stride_t)
                A31 = _block(p, 3, 1, c0, end, stride_t)
                A32 = _block(p, 3, 2, c0, end, stride_t)
                X21 = -_dot_tf32(T2, _dot_tf32(A21, T1, INTERPRET), INTERPRET)
                X32 = -_dot_tf32(T3, _dot_tf32(A32, T2, INTERPRET), INTERPRET)
                S20 = _dot_tf32(A20, T0, INTERPRET) + _dot_tf32(A21, X10, INTERPRET)
                X20 = -_dot_tf32(T2, S20, INTERPRET)
                S31 = _dot_tf32(A31, T1, INTERPRET) + _dot_tf32(A32, X21, INTERPRET)
                X31 = -_dot_tf32(T3, S31, INTERPRET)
                S30 = _dot_tf32(A30, T0, INTERPRET) + _dot_tf32(A31, X10, INTERPRET)
                S30 += _dot_tf32(A32, X20, INTERPRET)
                X30 = -_dot_tf32(T3, S30, INTERPRET)
                _put_block(p, T2, 2, 2, c0, end, stride_t)
                _put_block(p, T3, 3, 3, c0, end, stride_t)
                _put_block(p, X20, 2, 0, c0, end, stride_t)
                _put_block(p, X21, 2, 1, c0, end, stride_t)
                _put_block(p, X30, 3, 0, c0, end, stride_t)
                _put_block(p, X31, 3, 1, c0, end, stride_t)
                _put_block(p, X32, 3, 2, c0, end, stride_t)


@triton.jit
def _chunk_wu_kernel(
    k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, cu_ptr, am_ptr, w_ptr, u_ptr,  #
    HV_PER_K,  #
    stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, stride_amt, stride_amh,  #
    stride_wt, stride_wh,  #
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BT: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
):
    """Per (sequence, chunk, v-head): W = Tm (beta e^G K) `[BT, DK]` and U0 = Tm (beta V), Tm = (I + A)^-1
    from the inverse launch (tf32 dots, bf16 results), half of the head dim at a time (the columns are
    independent: fewer live fp32 tiles)."""
    PAD: tl.constexpr = (BLOCK_K != DK) | (BLOCK_DV != DV)
    PARTS: tl.constexpr = 2 if BLOCK_K >= 32 else 1  # column slices of W and U0 (dots need N >= 16)
    _, h, live, rows, t, ok = _chunk_rows(cu_ptr, BT)
    if live:
        offs_k = tl.arange(0, BLOCK_K)
        k_rows = k_ptr + (h // HV_PER_K) * stride_kh
        rk = _inv_norms(k_rows, t, ok, stride_kt, offs_k, offs_k < DK, PAD)
        beta, G = _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, t, ok, h, stride_at, stride_bt)
        inv = tl.load(am_ptr + t[:, None] * stride_amt + h * stride_amh + rows[None, :],
                      mask=ok[:, None] & (rows[:, None] // 16 >= rows[None, :] // 16), other=0.0)
        for part in tl.static_range(PARTS):
            cols = part * (BLOCK_K // PARTS) + tl.arange(0, BLOCK_K // PARTS)
            x = _scaled_cols(k_rows, t, ok, stride_kt, cols, cols < DK, rk, PAD, INTERPRET).to(tl.float32)
            w = _dot_tf32(inv, x * (beta * tl.exp(G))[:, None], INTERPRET)
            tl.store(w_ptr + t[:, None] * stride_wt + h * stride_wh + cols[None, :],
                     small_ops._to(w, w_ptr.dtype.element_ty, INTERPRET), mask=_tile_mask(ok, cols < DK, PAD))
        for part in tl.static_range(PARTS):
            cols = part * (BLOCK_DV // PARTS) + tl.arange(0, BLOCK_DV // PARTS)
            v_ptrs = v_ptr + t[:, None] * stride_vt + h * stride_vh + cols[None, :]
            v = tl.load(v_ptrs, mask=_tile_mask(ok, cols < DV, PAD), other=0.0)
            u = _dot_tf32(inv, v.to(tl.float32) * beta[:, None], INTERPRET)
            tl.store(u_ptr + t[:, None] * stride_wt + h * stride_wh + cols[None, :],
                     small_ops._to(u, u_ptr.dtype.element_ty, INTERPRET), mask=_tile_mask(ok, cols < DV, PAD))


@triton.jit
def _chunk_state_kernel(
    kt_ptr, g_ptr, w_ptr, u_ptr, state_ptr, slot_ptr, cu_ptr, past_ptr,  #
    base_ptr, h_ptr, vn_ptr,  #
    stride_gt, stride_wt, stride_wh,  #
    stride_hc, stride_hh, stride_hk, stride_ss, stride_sh, stride_sk,  #
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BT: tl.constexpr, BLOCK_V: tl.constexpr,  #
    CONTINUE: tl.constexpr, INTERPRET: tl.constexpr,  #
):
    """Per (sequence, v-head, v-tile), chunks in order: the state entering the chunk (bf16, for the output
    launch), U = U0 - W S (likewise), the state update. S starts at zero, or (CONTINUE and past[seq] > 0:
    a later piece of a chunked prefill) from the slot."""
    PAD: tl.constexpr = (BLOCK_K != DK) | (DV % BLOCK_V != 0)
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    rows = tl.arange(0, BT)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    S = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)
    if CONTINUE:
        if tl.load(past_ptr + seq) > 0:
            slot0 = tl.load(slot_ptr + seq).to(tl.int64)
            s0 = state_ptr + slot0 * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
            if PAD:
                S = tl.load(s0, mask=k_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
            else:
                S = tl.load(s0).to(tl.float32)
    h_ptrs = h_ptr + tl.load(base_ptr + seq).to(tl.int64) * stride_hc + h * stride_hh
    h_ptrs = h_ptrs + offs_k[:, None] * stride_hk + offs_v[None, :]
    # G at each chunk's last real row (the scores launch's cumulative gates), loaded a chunk ahead: a scalar
    # feeds no dot, so Triton's pipeliner would leave it a synchronous load in every step
    g_last = tl.load(g_ptr + (tl.minimum(end, start + BT) - 1) * stride_gt + h, mask=start < end, other=0.0)
    for c0 in range(start, end, BT):
        t = c0 + rows
        ok = t < end
        nxt = c0 + BT
        g_next = tl.load(g_ptr + (tl.minimum(end, nxt + BT) - 1) * stride_gt + h, mask=nxt < end, other=0.0)
        row_off = t[:, None] * stride_wt + h * stride_wh
        w = tl.load(w_ptr + row_off + offs_k[None, :], mask=_tile_mask(ok, k_ok, PAD), other=0.0)
        k_tail = tl.load(kt_ptr + row_off + offs_k[None, :], mask=_tile_mask(ok, k_ok, PAD), other=0.0)
        u0 = tl.load(u_ptr + row_off + offs_v[None, :], mask=_tile_mask(ok, v_ok, PAD), other=0.0)
        Sd = small_ops._to(S, w.dtype, INTERPRET)
        if PAD:
            tl.store(h_ptrs, Sd, mask=k_ok[:, None] & v_ok[None, :])
        else:
            tl.store(h_ptrs, Sd)
        h_ptrs += stride_hc
        ud = small_ops._to(u0.to(tl.float32) - _dot(w, Sd, INTERPRET), w.dtype, INTERPRET)  # [BT, BV]
        tl.store(vn_ptr + row_off + offs_v[None, :], ud, mask=_tile_mask(ok, v_ok, PAD))
        S = S * tl.exp(g_last) + _dot(tl.trans(k_tail), ud, INTERPRET)
        g_last = g_next
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    S = small_ops._to_state(S, state_ptr.dtype.element_ty, INTERPRET)
    if PAD:
        tl.store(s_ptrs, S, mask=k_ok[:, None] & v_ok[None, :])
    else:
        tl.store(s_ptrs, S)


@triton.jit
def _chunk_out_kernel(
    q_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, qk_ptr, h_ptr, vn_ptr, cu_ptr, base_ptr, o_ptr,  #
    HV_PER_K, q_scale,  #
    stride_qt, stride_qh, stride_at, stride_bt, stride_qkt, stride_qkh,  #
    stride_hc, stride_hh, stride_hk, stride_ut, stride_uh, stride_ot, stride_oh,  #
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BT: tl.constexpr,  #
    INTERPRET: tl.constexpr,  #
):
    """Per (sequence, chunk, v-head), all at once: O = exp(G) * (Q S) + scores U, with S the state
    entering the chunk and U its deltas, both from the state launch."""
    PAD: tl.constexpr = (BLOCK_K != DK) | (BLOCK_DV != DV)
    seq, h, live, rows, t, ok = _chunk_rows(cu_ptr, BT)
    if live:
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = tl.arange(0, BLOCK_DV)
        k_ok = offs_k < DK
        v_ok = offs_v < DV
        qd = _l2_rows(q_ptr + (h // HV_PER_K) * stride_qh, t, ok, stride_qt, offs_k, k_ok, q_scale, PAD,
                      INTERPRET)
        _, G = _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, t, ok, h, stride_at, stride_bt)
        chunk = tl.load(base_ptr + seq).to(tl.int64) + tl.program_id(1)
        s_ptrs = h_ptr + chunk * stride_hc + h * stride_hh + offs_k[:, None] * stride_hk + offs_v[None, :]
        Sd = tl.load(s_ptrs, mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        qk = tl.load(qk_ptr + t[:, None] * stride_qkt + h * stride_qkh + rows[None, :], mask=ok[:, None],
                     other=0.0)
        ud = tl.load(vn_ptr + t[:, None] * stride_ut + h * stride_uh + offs_v[None, :],
                     mask=_tile_mask(ok, v_ok, PAD), other=0.0)
        o = _dot(qd, Sd, INTERPRET) * tl.exp(G)[:, None]
        o = o + _dot(qk, ud, INTERPRET)
        o_ptrs = o_ptr + t[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
        tl.store(o_ptrs, small_ops._to(o, o_ptr.dtype.element_ty, INTERPRET), mask=_tile_mask(ok, v_ok, PAD))


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
    cu_seqlens: torch.Tensor, max_seqlen: int, config: dict[str, int] | None = None,
    past: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill form of `gdn.gated_delta_rule` (same arguments and result, `past` included, plus
    `max_seqlen`, the longest sequence as a host int the scheduler knows), chunked on tensor cores."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    for name, t, shape in (("q", q, (T, Hk, Dk)), ("k", k, (T, Hk, Dk)), ("v", v, (T, Hv, Dv)),
                           ("a", a, (T, Hv)), ("b", b, (T, Hv)),
                           ("state", state, (state.shape[0], Hv, Dk, Dv))):
        if t.shape != shape or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected shape {shape} with a contiguous last dim, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    N = cu_seqlens.numel() - 1
    if Hv % Hk or Dk != Dv or cu_seqlens.dtype != torch.int32 or slot_ids.shape != (N,):
        raise ValueError(f"expected Hv % Hk == 0, Dk == Dv, int32 cu_seqlens and slot_ids [{N}]; got "
                         f"Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}, {cu_seqlens.dtype}, {tuple(slot_ids.shape)}")
    _check_past(past, N)
    cfg = dict(config or _chunk_configs(N))
    BT, BV = cfg["BT"], cfg["BLOCK_V"]
    block_k = max(16, triton.next_power_of_2(Dk))  # tensor-core dots need K >= 16
    w = torch.empty((T, Hv, Dk), dtype=k.dtype, device=k.device)  # W, then U0 and U in the same layout
    u0 = torch.empty((T, Hv, Dv), dtype=k.dtype, device=k.device)
    k_tail = torch.empty((T, Hv, Dk), dtype=k.dtype, device=k.device)  # unit keys x exp(G_last - G)
    qk = torch.empty((T, Hv, BT), dtype=k.dtype, device=k.device)  # each token's row of its chunk's scores
    chunks = torch.div(cu_seqlens[1:] - cu_seqlens[:-1] + BT - 1, BT, rounding_mode="floor")
    base = (chunks.cumsum(0) - chunks).to(torch.int32)  # each sequence's first chunk (no host sync)
    states = torch.empty((T // BT + N, Hv, Dk, Dv), dtype=k.dtype, device=k.device)  # entering each chunk
    u = torch.empty((T, Hv, Dv), dtype=k.dtype, device=k.device)
    grid = (N, triton.cdiv(max(max_seqlen, 1), BT), Hv)
    gates = torch.empty((T, Hv), dtype=torch.float32, device=v.device)
    am = torch.empty((T, Hv, BT), dtype=torch.float32, device=k.device)  # A, then (I + A)^-1 in place
    _chunk_scores_kernel[grid[:2] + (Hk,)](  # a program per k-head, for its Hv // Hk v-heads
        q, k, a, b, A_log, dt_bias, cu_seqlens, k_tail, qk, gates, am,
        Dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), a.stride(0), b.stride(0),
        k_tail.stride(0), k_tail.stride(1), qk.stride(0), qk.stride(1), gates.stride(0),
        am.stride(0), am.stride(1),
        HV_PER_K=Hv // Hk, DK=Dk, BLOCK_K=block_k, BT=BT, INTERPRET=interpreting(),
        num_warps=cfg["scores_warps"],
    )
    _chunk_inverse_kernel[grid](
        am, cu_seqlens, am.stride(0), am.stride(1), BT=BT, INTERPRET=interpreting(),
        num_warps=cfg["inv_warps"],
    )
    _chunk_wu_kernel[grid](
        k, v, a, b, A_log, dt_bias, cu_seqlens, am, w, u0,
        Hv // Hk,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        am.stride(0), am.stride(1), w.stride(0), w.stride(1),
        DK=Dk, DV=Dv, BLOCK_K=block_k, BLOCK_DV=block_k, BT=BT, INTERPRET=interpreting(),
        num_warps=cfg["wu_warps"],
    )
    _chunk_state_kernel[(N, Hv, triton.cdiv(Dv, BV))](
        k_tail, gates, w, u0, state, slot_ids, cu_seqlens, slot_ids if past is None else past,
        base, states, u,
        gates.stride(0), w.stride(0), w.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        state.stride(0), state.stride(1), state.stride(2),
        DK=Dk, DV=Dv, BLOCK_K=block_k, BT=BT, BLOCK_V=BV, CONTINUE=past is not None,
        INTERPRET=interpreting(), num_warps=cfg["num_warps"], num_stages=cfg["state_stages"],
    )
    o = torch.empty((T, Hv, Dv), dtype=v.dtype, device=v.device)
    _chunk_out_kernel[grid](
        q, a, b, A_log, dt_bias, qk, states, u, cu_seqlens, base, o,
        Hv // Hk, Dk**-0.5,
        q.stride(0), q.stride(1), a.stride(0), b.stride(0), qk.stride(0), qk.stride(1),
        states.stride(0), states.stride(1), states.stride(2), u.stride(0), u.stride(1),
        o.stride(0), o.stride(1),
        DK=Dk, DV=Dv, BLOCK_K=block_k, BLOCK_DV=block_k, BT=BT, INTERPRET=interpreting(),
        num_warps=cfg["out_warps"],
    )
    return o
